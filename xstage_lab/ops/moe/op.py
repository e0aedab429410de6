"""The fused MoE as a layer a forward can call (paper §2.2, §4.2): ``FusedMoE``, from the router's
output to the layer's output on the device, with no host sync, in buffers sized by static bounds,
and a ``torch.library`` custom op (``xstage::fused_moe``) with a fake implementation, so that
``torch.compile(fullgraph=True)`` traces a block that uses it.

A call is five launches in bf16, six in FP8 (four and five up to
``device_tables.scan_chunk_bound`` chunks of picks, three in either up to
``device_tables.TINY_ARRIVALS`` picks; in FP8 as in bf16 where the first launch quantizes):
routing to tile tables (``device_tables``: three Triton launches, two, or one, that zero the
fused kernel's row counters; in FP8 one more quantizes the tokens per 1 x 128, or the first
launch's extra programs do, ``RoutingLaunches.quantized_first``), whose first launch takes the
call's addresses (``topk_ids``, ``x``, the Combine rows, ``topk_weights``, ``y``) and writes them
into the argument block the later launches read (``call_args``), the fused kernel over the chosen
schedule's table (``kernels/moe_fused_ws.py`` on sm_90, ``kernels/moe_fused.py`` elsewhere), whose
Linear-1 gathers each pick's token row as it loads and whose Linear-2 epilogues store each pick's
row into the Combine buffer, then the top-k weighted sum (``combine``, one Triton launch, reading
the block; with ``weighted_sum="kernel"`` the fused kernel's end, where it covers the tokens in one
pass; with ``"atomic"`` up to ``ATOMIC_SUM_TOKENS``, and by default (``"auto"``) up to
``AUTO_ATOMIC_TOKENS`` where torch's deterministic algorithms are off, the Linear-2 epilogues' adds
into ``y``, zeroed by the routing). Eagerly on CUDA they run as one CUDA graph
(``graph_launch.GraphCache``), captured once per token count (and deterministic flag) at that
count's first call, the node of its first launch taking each call's addresses as new arguments
(``graph_launch.GraphLauncher``): a call costs the host two driver calls. While the stream is
capturing (a user's graph) or off CUDA they launch directly, each bound once
(``launcher.Launcher``: a call pays the driver's launches, not Triton's Python binding). Once
a T's graph exists, an eager call on CUDA takes the compiled host path (``fused_call.cpp``, built
with ``torch.utils.cpp_extension`` at the layer's construction): the same checks, allocation,
addresses and two driver calls in one C++ function. ``MoEWorkspace`` is the same call over received
rows (the EP rank workload), storing into any ``CombinePeers``, replayed from a graph per set of
buffers. Layers of one shape can share their buffers (``buffers.MoEBuffers``): a model's MoE layers
need one set, not one each.
"""
from __future__ import annotations

import functools
import weakref
from pathlib import Path

import torch
import triton

from ...kernel_sources import load_kernel_module
from ..graph_launch import GraphCache, GraphLauncher, call_functions
from ..launcher import Launcher
from .call_args import (ALIGN_BYTES, FIRST_ADDRESS_PARAM, TRITON_DTYPES, slot_order, slot_packer,
                        sum_args_view)
from .combine import CombinePeers, local_combine_peers, weighted_sum_grid, weighted_sum_launch
from .buffers import BufferSizes, MoEBuffers
from .device_tables import SCHEDULES, TableBounds, route_to_tables
from .fused import (DEFAULT_MAX_SPIN_ITERS, KERNEL_ENTRIES, InKernelSum, KernelBuffers,
                    check_expert_weights, expect_tensor, kernel_launch)
from .schedules import d_knee, derived_lead
from .shapes import FP8_SCALE_BLOCK, MoEContractError
from .tiles import TileConfig, default_tile_config, ws_tile_rows
from .weights import ExpertWeights

SCHEDULE_CHOICES = (*SCHEDULES, "auto")
# Programs of a launch off the GPU: the interpreter runs programs one after another, so a
# Linear-2 tile would wait forever on a Linear-1 tile of a later program; one program walks the
# whole stream, in which every schedule puts a row's Linear-1 tiles before its Linear-2 tiles.
CPU_PROGRAMS = 1
# What a FusedMoE call's argument block takes, in the order its compiled path is given them.
CALL_TENSORS = ("expert_ids", "x", "combine_rows", "topk_weights", "out")
WEIGHT_DTYPES = tuple(d for d in TRITON_DTYPES if d.is_floating_point)  # the weighted sum reads
ID_DTYPES = (torch.int32, torch.int64)
# Where a FusedMoE's top-k weighted sum runs: its own launch after the fused kernel, the fused
# kernel's end (gluon_ws; where one pass of its programs covers the tokens: sums_in_kernel), or
# the Linear-2 epilogues adding into the output (gluon_ws; up to ATOMIC_SUM_TOKENS, as measured:
# the graphed call 0.977x, 0.996x, 0.998x, 0.998x the sum's launch at 1, 8, 64, 512 tokens,
# geometric means over every shape, ab jobs on one H100: moe_layer/h100-80gb-hbm3-x1). "auto":
# the adds up to AUTO_ATOMIC_TOKENS unless torch's deterministic algorithms are on, the launch
# otherwise: on one H200 the launch's graphed call took 1.047x and 1.005x the adds' at 1 and 8
# tokens, 0.999x and 0.998x at 64 and 512 (moe_layer/h200-x1 …073646Z-…074655Z, README)
WEIGHTED_SUMS = ("auto", "launch", "kernel", "atomic")
ATOMIC_SUM_TOKENS = 512
AUTO_ATOMIC_TOKENS = 8


def auto_schedule(peers_world: int) -> str:
    """``schedule="auto"`` without a forecast at hand: Expert-Wave where every Combine store stays
    on this GPU (one Combine destination: no remote-store burst for Interleaved to spread, §4.2),
    Interleaved at the workspace's lead (``schedules.derived_lead``) where the Combine stores go
    to peers. Where a link's calibration and the kernel's tile times are known, the forecast
    picks per cell (``host_forecast.pick_auto``, eqs. 12–16), and its pick is passed as the
    schedule (``moe_host`` times it as ``auto``)."""
    return "wave" if peers_world == 1 else "interleaved"


class MoEWorkspace:
    """The static buffers and launches of the fused MoE over ``weights`` for at most ``capacity``
    arrivals: the device tables (the row counters included), ``h`` and its scales, the error
    flag (shared by the routing kernels and the fused kernel). ``num_programs`` defaults to the
    SMs (one persistent program each); ``lead_rows`` to ``schedules.derived_lead`` (counted as
    ``schedules.leads_from_expert`` says: ``TableBounds.expert_lead``);
    ``source_rows``: the bf16 rows of ``x`` an FP8 layer quantizes at most, 0 where it takes e4m3
    rows only (``allocate_tables``). With the gluon_ws kernel, where the bound leaves most SMs
    without a Linear-2 tile (a few tokens), each Linear-2 tile is split along K
    (``TableBounds.of(split_k=True)``, ``device_tables.l2_split_count``) and its splits' partials
    get buffers of their own (``fused.split_k_buffers``). ``config`` defaults to the kernel's
    tiles for experts of ``rows_per_expert`` routed rows on average (``tiles.ws_tile_rows``;
    default: the bound's, ``capacity`` over the experts).

    ``buffers``: another workspace's (``buffers.MoEBuffers``: every buffer but the weights), to
    share, sized exactly as this one's would be; else allocated here, with a FusedMoE's Combine
    rows where ``combine_rows``. Workspaces that share them share the error flag too; their
    graphed calls (``received_call``, a FusedMoE's) run one at a time whichever stream each is
    made on (the buffers' ``StreamOrder``), their direct launches (``route``, ``launch``) in the
    order of the stream they are made on."""

    def __init__(self, weights: ExpertWeights, capacity: int, *, config: TileConfig | None = None,
                 num_programs: int | None = None, lead_rows: int | None = None,
                 max_spin_iters: int = DEFAULT_MAX_SPIN_ITERS, source_rows: int | None = None,
                 buffers: MoEBuffers | None = None, combine_rows: bool = False,
                 rows_per_expert: float | None = None):
        device = weights.w1.device
        self.weights = weights
        if rows_per_expert is None:
            rows_per_expert = capacity / weights.num_experts
        self.config = config or default_tile_config(
            weights.precision, hidden=weights.hidden, device=device, expert_rows=capacity,
            block_m=ws_tile_rows(weights.precision, rows_per_expert, weights.hidden))
        check_expert_weights(weights, self.config, expert_rows=capacity)
        if num_programs is None:
            num_programs = (torch.cuda.get_device_properties(device).multi_processor_count
                            if device.type == "cuda" else CPU_PROGRAMS)
        if lead_rows is None:
            cfg = self.config
            lead_rows = derived_lead(d_knee(2 * cfg.block_n1, num_programs, weights.intermediate),
                                     num_programs, weights.intermediate // cfg.block_n1,
                                     weights.hidden // cfg.block_n2)
        if max_spin_iters < 1:
            raise MoEContractError("max_spin_iters must be >= 1")
        self.bounds = TableBounds.of(capacity, weights.num_experts, weights.hidden,
                                     weights.intermediate, self.config, num_programs, lead_rows,
                                     split_k=self.config.kernel == "gluon_ws")
        # None quantizes up to the capacity (allocate_tables): the same buffers, one size
        sizes = BufferSizes(self.bounds, weights.precision, weights.hidden, weights.intermediate,
                            capacity if source_rows is None else source_rows, device,
                            combine_rows)
        if buffers is None:
            buffers = MoEBuffers.allocate(sizes)
        buffers.check_serves(sizes)
        self.buffers = buffers
        self.tables, self.h, self.h_scale = buffers.tables, buffers.h, buffers.h_scale
        self.l2_partial, self.l2_ready = buffers.l2_partial, buffers.l2_ready
        self.trace = buffers.trace
        self.max_spin_iters = max_spin_iters
        self._launches: dict = {}
        self.graphs = GraphCache(device, order=buffers.order)

    @property
    def error(self) -> torch.Tensor:
        """int32 [1]: ids out of range plus tiles whose spin expired (never reset by a call)."""
        return self.tables.error

    def route(self, expert_ids: torch.Tensor, x: torch.Tensor, x_scale: torch.Tensor | None = None,
              **received) -> None:
        """``device_tables.route_to_tables`` into this workspace's tables."""
        route_to_tables(self.tables, expert_ids, x, x_scale, **received)

    def launch(self, schedule: str, peers: CombinePeers, *, routed: bool = False,
               weighted_sum: InKernelSum | None = None) -> None:
        """The fused kernel over the tables of ``schedule`` (routed first), storing each row into
        ``peers``' buffer of its source at its slot: the row counters zeroed, then one launch.
        ``routed``: ``route`` ran just before on this stream and zeroed the counters itself.
        ``weighted_sum``: the launch ends with the weighted sum (``fused.InKernelSum``)."""
        s = weighted_sum
        key = (schedule, peers.table.data_ptr(), s and (s.args.data_ptr(), s.arrivals.data_ptr(),
                                                        s.tokens, s.top_k, s.weight_dtype))
        launch = self._launches.get(key)
        if launch is None:
            t = self.tables
            buffers = KernelBuffers(t.tiles[schedule], t.num_tiles[schedule], t.a_rows,
                                    t.row_origin, self.h, self.h_scale, t.row_ready, t.row_src,
                                    t.row_slot, peers.table, t.error, self.trace,
                                    self.bounds.l2_splits, self.l2_partial, self.l2_ready,
                                    weighted_sum)
            args, constexprs = kernel_launch(self.config, self.weights, buffers,
                                             max_spin_iters=self.max_spin_iters)
            module, entry = KERNEL_ENTRIES[self.config.kernel]
            kernel = getattr(load_kernel_module(module), entry)
            launch = self._launches[key] = Launcher(kernel, **dict(zip(kernel.arg_names, args)),
                                                    **constexprs)
        if not routed:
            self.tables.row_ready.zero_()
        launch((self.bounds.num_programs,))

    def received_call(self, schedule: str, peers: CombinePeers, expert_ids: torch.Tensor,
                      x: torch.Tensor, x_scale: torch.Tensor | None, n_arrivals: torch.Tensor,
                      arrival_src: torch.Tensor, arrival_slot: torch.Tensor) -> None:
        """An EP rank's call: ``route`` over received rows (``device_tables.route_to_tables``
        takes the arguments), then ``launch``. Eagerly on CUDA replayed from the graph of these
        buffers, captured at their first call (an EP rank's receive buffers stay where they are
        from call to call: one graph per schedule serves them all); else launched directly. The
        buffers are checked (``check_received``) where no graph of them exists yet: they must
        stay as they were at their first call."""
        def launches():
            self.route(expert_ids, x, x_scale, n_arrivals=n_arrivals, arrival_src=arrival_src,
                       arrival_slot=arrival_slot)
            self.launch(schedule, peers, routed=True)

        key = (schedule, peers.table.data_ptr(), expert_ids.data_ptr(), x.data_ptr(),
               0 if x_scale is None else x_scale.data_ptr(), n_arrivals.data_ptr(),
               arrival_src.data_ptr(), arrival_slot.data_ptr())
        if key not in self.graphs:
            self.check_received(schedule, peers, expert_ids, x, x_scale, n_arrivals,
                                arrival_src, arrival_slot)
        self.graphs.call(key, launches)

    def check_received(self, schedule: str, peers: CombinePeers, expert_ids: torch.Tensor,
                       x: torch.Tensor, x_scale: torch.Tensor | None, n_arrivals: torch.Tensor,
                       arrival_src: torch.Tensor, arrival_slot: torch.Tensor) -> None:
        """Raise MoEContractError on an EP rank's call that these tables cannot take, before
        anything is launched (the kernels read every buffer up to the capacity, by its shape):
        ``schedule`` one of ``SCHEDULES``; the local expert ids (int32 or int64), sources and
        slots (int32) of exactly ``[capacity]`` and their count int32 ``[1]``; ``x [capacity,
        H]`` as this layer reads it (bf16, or in FP8 e4m3 with fp32 ``x_scale [capacity, H /
        128]``); all contiguous on the weights' device; Combine buffers of H columns. That each
        slot lies within its source's Combine buffer is Dispatch's contract, on the device."""
        if schedule not in SCHEDULES:
            raise MoEContractError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        cap, hidden = self.bounds.capacity, self.weights.hidden
        device = self.weights.w1.device
        fp8 = self.weights.precision == "fp8"
        rows = (torch.float8_e4m3fn, torch.bfloat16) if fp8 else (torch.bfloat16,)
        expect = [("expert_ids", expert_ids, ID_DTYPES, (cap,)),
                  ("arrival_src", arrival_src, (torch.int32,), (cap,)),
                  ("arrival_slot", arrival_slot, (torch.int32,), (cap,)),
                  ("n_arrivals", n_arrivals, (torch.int32,), (1,)),
                  ("x", x, rows, (cap, hidden))]
        if x.dtype == torch.float8_e4m3fn:
            expect.append(("x_scale", x_scale, (torch.float32,),
                           (cap, hidden // FP8_SCALE_BLOCK)))
        elif x_scale is not None:
            raise MoEContractError("x_scale goes with e4m3 rows only")
        for name, t, dtypes, shape in expect:
            expect_tensor(t, name, shape, dtypes, device)
        if peers.hidden != hidden or peers.table.device != device:
            raise MoEContractError(f"Combine buffers of {peers.hidden} columns, peer table on "
                                   f"{peers.table.device}: the layer stores {hidden} on {device}")


_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _compiled_hooks(compiled, schedule: str):
    """``GraphCache``'s ``on_capture``/``on_drop`` for a FusedMoE: each graph of the layer's
    schedule added to / removed from its compiled path (None: nothing). They hold the compiled
    path, never the layer: a layer in a reference cycle would be freed by the cyclic collector
    at any moment, and its graphs destroyed inside another graph's capture would invalidate it."""
    if compiled is None:
        return None, None

    def captured(key: tuple, launcher: GraphLauncher) -> None:
        tokens, key_schedule, *dtypes_deterministic = key
        if key_schedule == schedule:
            compiled.add(tokens, *dtypes_deterministic, *launcher.handles())

    def dropped(key: tuple) -> None:
        tokens, key_schedule, *dtypes_deterministic = key
        if key_schedule == schedule:
            compiled.remove(tokens, *dtypes_deterministic)
    return captured, dropped


class FusedMoE(torch.nn.Module):
    """The routed experts of an MoE layer on one GPU (EP = 1), as one fused call.

    ``weights``: the experts in the kernels' layout (``weights.local_expert_weights(shape, 0, 1,
    precision)``: bf16, or e4m3 with 128 x 128 fp32 scales); they stay on their device.
    ``max_tokens``: the bound T every buffer is sized by (``device_tables.row_blocks_in_use``), and,
    without a ``config``, what the kernel's tiles are chosen for (``tiles.ws_tile_rows``, at
    ``max_tokens * top_k`` rows over the experts): a layer built for many more tokens than its calls
    bring may run 256-row tiles where 128 would be faster (at one and 64 tokens on one H100,
    1.03-1.32x the 128-row records' time: ``tiles.ws_tile_rows``); pass ``config`` to choose.
    ``schedule``: ``"wave"`` (Expert-Wave), ``"interleaved"`` (Algorithm 1, lead ``lead_rows``,
    default ``schedules.derived_lead``) or ``"auto"`` (``auto_schedule``). ``check_ids``: also check
    on the host that every id lies in ``0 .. E - 1`` before launch (a device-to-host copy; ids on
    the CPU are always checked; neither while capturing a graph or tracing for torch.compile);
    without it an id out of range adds to ``error`` on the device and its pick gets no row (its slot
    of the output is not defined).

    ``forward(x, topk_ids, topk_weights)``: bf16 ``x [T, H]`` (16-byte aligned), integer
    ``topk_ids [T, top_k]``, float ``topk_weights [T, top_k]``, ``T <= max_tokens``, all on the
    weights' device -> bf16 ``y [T, H]`` = ``sum_j w[t, j] · FFN_{e_tj}(x[t])`` (at ``T = 0`` an
    empty ``y``, nothing launched). Inference only: where grad mode records ``x`` or
    ``topk_weights``, ``y``'s backward raises (the custom op has no autograd formula) instead of
    leaving the layer out of the gradients.

    Eagerly on CUDA (the stream not capturing) a call launches the graph of its T with its
    tensors' addresses: ``graphs``, keyed by T, schedule, the ids' and weights' dtypes and torch's
    deterministic flag (a ``GraphCache``). The first call at a T launches directly, then
    captures that T's graph without synchronizing. Calls share the layer's buffers and run one
    at a time in the order they are made: a call on a stream other than the latest call's over
    them waits for that one (``graph_launch.StreamOrder``; inside a user's capture, the user
    orders the graph's replays).

    ``buffers``: another FusedMoE's (``layer.moe_buffers``), to share: a model's MoE layers of
    one shape, called one after another, need one set of buffers between them
    (``buffers.MoEBuffers``), not one each; refused unless the layers would size them alike
    (the same ``max_tokens * top_k``, ``max_tokens``, experts, precision, H, I, tiles,
    programs, lead and device). Layers that share them share ``error`` too.

    ``weighted_sum``: ``"launch"``, the top-k weighted sum in a launch of its own after the fused
    kernel; ``"kernel"`` (the gluon_ws kernel only), the fused kernel ends with it where one pass
    of its programs covers the call's tokens (``sums_in_kernel``), so the call has one launch and
    one kernel boundary fewer; above that, its own launch. ``"atomic"`` (gluon_ws only): up to
    ``ATOMIC_SUM_TOKENS``, the first routing launch zeroes ``y`` and each Linear-2 epilogue adds
    its rows times their weights into it (bf16 adds in the epilogues' order: the bits may differ
    from call to call, within bf16's rounding), so no launch sums; above, its own launch.
    ``"auto"`` (the default): the adds up to ``AUTO_ATOMIC_TOKENS`` with the gluon_ws kernel,
    unless ``torch.are_deterministic_algorithms_enabled()`` at the call, as torch's own atomic
    adds (``index_add_``) are; else the launch."""

    def __init__(self, weights: ExpertWeights, *, max_tokens: int, top_k: int,
                 schedule: str = "auto", config: TileConfig | None = None,
                 num_programs: int | None = None, lead_rows: int | None = None,
                 check_ids: bool = False, max_spin_iters: int = DEFAULT_MAX_SPIN_ITERS,
                 buffers: MoEBuffers | None = None, weighted_sum: str = "auto"):
        super().__init__()
        if schedule not in SCHEDULE_CHOICES:
            raise MoEContractError(f"schedule must be one of {SCHEDULE_CHOICES}, got {schedule!r}")
        if weighted_sum not in WEIGHTED_SUMS:
            raise MoEContractError(f"weighted_sum must be one of {WEIGHTED_SUMS}, got "
                                   f"{weighted_sum!r}")
        if max_tokens < 1 or top_k < 1 or top_k > weights.num_experts:
            raise MoEContractError(f"max_tokens={max_tokens} must be >= 1 and top_k={top_k} in "
                                   f"1..{weights.num_experts}")
        self.workspace = MoEWorkspace(weights, max_tokens * top_k, config=config,
                                      num_programs=num_programs, lead_rows=lead_rows,
                                      max_spin_iters=max_spin_iters, source_rows=max_tokens,
                                      buffers=buffers, combine_rows=True)
        self.max_tokens, self.top_k, self.check_ids = max_tokens, top_k, check_ids
        self.schedule = auto_schedule(1) if schedule == "auto" else schedule
        if weighted_sum in ("kernel", "atomic") and self.workspace.config.kernel != "gluon_ws":
            raise MoEContractError(f"weighted_sum={weighted_sum!r} needs the gluon_ws kernel, "
                                   f"not {self.workspace.config.kernel}")
        self.weighted_sum = weighted_sum
        # the most tokens one pass of the programs' sum covers (sums_in_kernel): a token's
        # SUM_COLS columns of kernels/moe_fused_ws.py a program
        self.tokens_summed_in_kernel = 0
        if weighted_sum == "kernel":
            pieces = triton.cdiv(weights.hidden, load_kernel_module("moe_fused_ws").SUM_COLS.value)
            self.tokens_summed_in_kernel = self.workspace.bounds.num_programs // pieces
        self.combine = self.workspace.buffers.combine
        self.peers = local_combine_peers([self.combine])
        self.device = weights.w1.device
        self.pack_addresses = slot_packer(self.workspace.tables.args, *CALL_TENSORS)
        # the compiled path of an eager call on CUDA (never with check_ids: that check syncs)
        self.compiled = None
        if self.device.type == "cuda" and not check_ids:
            order, aligned = slot_order(*CALL_TENSORS)
            self.compiled = fused_call_module().FusedCall(
                [-1 if i is None else i for i in order], list(aligned), ALIGN_BYTES,
                self.workspace.tables.args.data_ptr(), self.combine.data_ptr(), weights.hidden,
                top_k, max_tokens, list(WEIGHT_DTYPES), self.device, call_functions(),
                self.moe_buffers.order.address)
        self.graphs = GraphCache(self.device, *_compiled_hooks(self.compiled, self.schedule),
                                 order=self.moe_buffers.order)
        self.key = id(self.workspace)
        _LAYERS[self.key] = self

    @property
    def error(self) -> torch.Tensor:
        return self.workspace.error

    def extra_repr(self) -> str:
        w = self.workspace.weights
        return (f"experts={w.num_experts}, hidden={w.hidden}, intermediate={w.intermediate}, "
                f"top_k={self.top_k}, precision={w.precision}, max_tokens={self.max_tokens}, "
                f"schedule={self.schedule}, kernel={self.workspace.config.kernel}, "
                f"weighted_sum={self.weighted_sum}")

    @property
    def moe_buffers(self) -> MoEBuffers:
        """This layer's buffers, for another layer of its shape to share (``buffers=``; not
        ``buffers``, which is ``torch.nn.Module``'s method)."""
        return self.workspace.buffers

    def check_inputs(self, x: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor) -> None:
        """Raise MoEContractError on inputs the call cannot take, before anything is launched.
        Every eager call pays it: each attribute is read once."""
        hidden, k, device = self.workspace.weights.hidden, self.top_k, self.device
        shape = x.shape
        if x.dtype != torch.bfloat16 or len(shape) != 2 or shape[1] != hidden:
            raise MoEContractError(f"x must be bf16 [T, {hidden}], got {x.dtype} {list(shape)}")
        t = shape[0]
        if t > self.max_tokens:
            raise MoEContractError(f"T={t} tokens above max_tokens={self.max_tokens}, the bound "
                                   "this FusedMoE was built for")
        if topk_ids.dtype not in ID_DTYPES or topk_ids.shape != (t, k):
            raise MoEContractError(f"topk_ids must be int32 or int64 [{t}, {k}], got "
                                   f"{topk_ids.dtype} {list(topk_ids.shape)}")
        if topk_weights.dtype not in WEIGHT_DTYPES or topk_weights.shape != (t, k):
            raise MoEContractError(f"topk_weights must be float [{t}, {k}], got "
                                   f"{topk_weights.dtype} {list(topk_weights.shape)}")
        ids_device = topk_ids.device
        if x.device != device or ids_device != device or topk_weights.device != device:
            where = ", ".join(f"{n} on {v.device}" for n, v in
                              (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)))
            raise MoEContractError(f"{where}: all must be on the experts' device {device}")
        # T last: read while tracing, a symbolic T would be guarded on
        if (ids_device.type == "cpu" or self.check_ids) and not (
                torch.compiler.is_compiling()
                or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())) and t:
            lo, hi = int(topk_ids.min()), int(topk_ids.max())
            if lo < 0 or hi >= self.workspace.weights.num_experts:
                raise MoEContractError(f"expert ids must lie in "
                                       f"0..{self.workspace.weights.num_experts - 1}, got "
                                       f"{lo}..{hi}")

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        if self.compiled is not None and not torch.compiler.is_compiling():
            # None where it does not take the call: no graph of this key yet, the stream
            # capturing, an input the check below refuses (and names) or autograd records
            y = self.compiled(x, topk_ids, topk_weights,
                              self.graphs.current_stream(self.device.index))
            if y is not None:
                return y
        self.check_inputs(x, topk_ids, topk_weights)
        # the op where autograd records an input: its output's backward then raises (no
        # autograd formula), as under torch.compile, where run's would silently have no history
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
                x.requires_grad or topk_weights.requires_grad)):
            return torch.ops.xstage.fused_moe(x, topk_ids, topk_weights, self.key, self.schedule)
        # eager (a CUDA graph capture included): the dispatcher's round trip through the custom
        # op costs 20-40 µs of host time per call on the 2-core CI machine, and only tracing
        # and autograd need the op
        return self.run(x, topk_ids, topk_weights, self.schedule)

    def run(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            schedule: str) -> torch.Tensor:
        """The call itself (what the custom op runs; inputs checked by ``forward``): its
        launches, launched from the graph of this call's key with this call's addresses where
        the device is CUDA and the stream is not capturing, else launched directly."""
        if x.shape[0] == 0:  # an empty batch (an EP rank's that got no tokens): nothing to launch
            return torch.empty_like(x)
        # held until the call returns: the kernels read them through their addresses (a
        # contiguous [T, k] is the arrivals' [T k])
        x, ids, w = x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
        y = torch.empty_like(x)
        addresses = self.pack_addresses(ids, x, self.combine, w, y)
        call = (x.shape[0], schedule, ids.dtype, w.dtype)
        self.graphs.call(self.graph_key(*call), lambda: self.launches(addresses, *call), addresses,
                         lambda: (self.routing(ids.dtype, x.shape[0]).first(
                                      x.shape[0] * self.top_k, self.top_k)[0].function(),
                                  FIRST_ADDRESS_PARAM, addresses))
        return y

    def graph_key(self, tokens: int, schedule: str, id_dtype: torch.dtype,
                  weights_dtype: torch.dtype) -> tuple:
        """The key of a call's graph in ``graphs``: what fixes its launches, torch's
        deterministic flag among them (``"auto"``'s sum follows it)."""
        return (tokens, schedule, id_dtype, weights_dtype,
                torch.are_deterministic_algorithms_enabled())

    def launches(self, addresses: tuple[int, ...], tokens: int, schedule: str,
                 id_dtype: torch.dtype, weights_dtype: torch.dtype) -> None:
        """The launches on the current stream: ``route_launches``, the fused kernel, the
        weighted sum (its own launch unless the kernel ends with it: ``sums_in_kernel``); their
        arguments but ``addresses`` fixed by the graph's key (what it captures)."""
        self.route_launches(addresses, tokens, id_dtype)
        self.fused_kernel(tokens, weights_dtype, schedule, routed=True)
        if not self.sums_in_kernel(tokens):
            hidden = self.workspace.weights.hidden
            weighted_sum_launch(self.top_k, weights_dtype)(weighted_sum_grid(tokens, hidden),
                                                           args=self.workspace.tables.args,
                                                           HIDDEN=hidden)

    def sums_in_kernel(self, tokens: int) -> bool:
        """Whether a call of ``tokens`` tokens has the fused kernel end with the weighted sum:
        ``"kernel"`` and a piece of the sum (a token's ``SUM_COLS`` columns, moe_fused_ws.py) per
        program at most (``tokens_summed_in_kernel``; beyond, a program would sum its pieces in
        turn, the sum's launch uses every SM), ``"atomic"`` up to ``ATOMIC_SUM_TOKENS``, or
        ``"auto"``'s adds (up to ``AUTO_ATOMIC_TOKENS``, torch's deterministic flag off)."""
        if self.weighted_sum == "atomic":
            return tokens <= ATOMIC_SUM_TOKENS
        if self.weighted_sum == "auto":
            return (self.workspace.config.kernel == "gluon_ws" and tokens <= AUTO_ATOMIC_TOKENS
                    and not torch.are_deterministic_algorithms_enabled())
        return tokens <= self.tokens_summed_in_kernel

    def adds_into_output(self, tokens: int) -> bool:
        """Whether a call's Linear-2 epilogues add into ``y``, which its routing then zeroes."""
        return self.weighted_sum in ("atomic", "auto") and self.sums_in_kernel(tokens)

    def fused_kernel(self, tokens: int, weights_dtype: torch.dtype, schedule: str, *,
                     routed: bool = False, sum_args: torch.Tensor | None = None) -> None:
        """The fused kernel as a call of ``tokens`` tokens launches it (``MoEWorkspace.launch``),
        ending with the weighted sum where ``sums_in_kernel``: of the tensors the argument block
        names (``sum_args``: another block of its 3 addresses, ``call_args.sum_args_view``'s)."""
        summed = None
        if self.sums_in_kernel(tokens):
            args = sum_args_view(self.workspace.tables.args) if sum_args is None else sum_args
            summed = InKernelSum(args, self.workspace.buffers.sum_arrivals, tokens, self.top_k,
                                 weights_dtype, atomic=self.adds_into_output(tokens))
        self.workspace.launch(schedule, self.peers, routed=routed, weighted_sum=summed)

    def route_launches(self, addresses: tuple[int, ...], tokens: int,
                       id_dtype: torch.dtype) -> None:
        """The routing kernels, the first writing ``addresses`` into the argument block."""
        self.routing(id_dtype, tokens)(tokens * self.top_k, self.top_k, addresses)

    def routing(self, id_dtype: torch.dtype, tokens: int):
        """The routing launches of a call (its ids' dtype, tokens), zeroing ``y`` if added into."""
        ws = self.workspace
        return ws.tables.routing(False, ws.weights.precision == "fp8", id_dtype,
                                 ws.weights.hidden if self.adds_into_output(tokens) else 0)


@functools.cache
def fused_call_module():
    """``fused_call.cpp`` compiled (once per machine and source: torch's extension cache)."""
    from torch.utils.cpp_extension import load

    return load("xstage_fused_call", [str(Path(__file__).with_name("fused_call.cpp"))],
                extra_cflags=["-O2"])


@torch.library.custom_op("xstage::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, key: int,
              schedule: str) -> torch.Tensor:
    """``FusedMoE`` ``key``'s call on ``(x, topk_ids, topk_weights)`` with ``schedule``."""
    layer = _LAYERS.get(key)
    if layer is None:
        raise MoEContractError(f"no live FusedMoE {key}")
    return layer.run(x, topk_ids, topk_weights, schedule)


@fused_moe.register_fake
def _fused_moe_fake(x, topk_ids, topk_weights, key, schedule):
    return torch.empty_like(x)
