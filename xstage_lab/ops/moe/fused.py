"""The host-scheduled launch of the fused kernel (paper §2.2, §4.2): a layout, a schedule built on
the host (``schedules``) and a peer table become one checked launch of ``kernels/moe_fused_ws.py``
(Gluon, sm_90) or ``kernels/moe_fused.py`` (Triton, elsewhere: ``tiles.default_tile_config``).
Each Linear-2 epilogue stores its rows straight into the source ranks' Combine buffers."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

from ...kernel_sources import load_kernel_module
from ...platform import ALIGN_BYTES
from .call_args import triton_dtype
from .combine import CombinePeers
from .dispatch import DispatchLayout
from .schedules import L1, L2, MoEProblem, Schedule, check_schedule, tile_table
from .shapes import MoEContractError
from .tiles import TileConfig, check_tile_config, kernel_unsupported
from .weights import ExpertWeights

# About seconds of polling on an H200, far above any legitimate wait (a whole call is milliseconds).
DEFAULT_MAX_SPIN_ITERS = 1 << 22
TRACE_FIELDS = 10  # kernels/moe_fused.py: clock64 x 4, globaltimer x 4, smid, spins per tile
# kernel name -> (kernels/ module, entry point)
KERNEL_ENTRIES = {"triton": ("moe_fused", "fused_moe_kernel"),
                  "gluon_ws": ("moe_fused_ws", "moe_fused_ws_kernel")}


@dataclass
class FusedMoECall:
    """A prepared launch of the fused kernel for one schedule; calling it zeroes the row counters
    (and, instrumented, poisons the trace with -1) and launches. ``error_count()`` reads the
    spin-timeout flag (synchronizes). ``trace`` is int64 ``[programs, max_tiles, TRACE_FIELDS]``
    for an instrumented call (see ``kernels/moe_fused.py``), else None."""

    schedule: Schedule
    args: tuple
    constexprs: dict
    grid: tuple[int]
    row_ready: torch.Tensor
    error: torch.Tensor
    trace: torch.Tensor | None = None
    kernel: str = "triton"
    synthetic_k_fraction: float | None = None  # not the MoE layer where set (knee sweep)
    # what it reads or writes through addresses held on the device: the Combine buffers its peer
    # table points into (CombinePeers.owners), the layout's rows
    owners: tuple = ()

    def __call__(self) -> None:
        self.row_ready.zero_()
        if self.trace is not None:
            self.trace.fill_(-1)
        module, entry = KERNEL_ENTRIES[self.kernel]
        getattr(load_kernel_module(module), entry)[self.grid](*self.args, **self.constexprs)

    def error_count(self) -> int:
        return int(self.error.item())


def expect_tensor(t: torch.Tensor | None, name: str, shape: tuple, dtypes, device) -> None:
    """Raise MoEContractError unless ``t`` is a contiguous ``shape`` tensor on ``device`` of
    ``dtypes`` (one dtype, or a tuple of those it may be)."""
    dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
    want = f"{' or '.join(map(str, dtypes))} {list(shape)}"
    if t is None:
        raise MoEContractError(f"{name} must be {want}, got None")
    if tuple(t.shape) != tuple(shape) or t.dtype not in dtypes:
        raise MoEContractError(f"{name} must be {want}, got {t.dtype} {list(t.shape)}")
    if t.device != device or not t.is_contiguous():
        raise MoEContractError(f"{name} must be contiguous on {device}")


def check_expert_weights(weights: ExpertWeights, config: TileConfig,
                         expert_rows: int | None = None) -> None:
    """Raise MoEContractError unless ``weights`` are what ``config``'s kernel reads (nothing is
    launched): the tiles dividing H and I (``check_tile_config``); ``w1 [E, 2I, H]`` and ``w2
    [E, H, I]`` in bf16, or in e4m3 with fp32 scales per ``config.scale_block`` square block
    (``w1_scale [E, 2I/sb, H/sb]``, ``w2_scale [E, H/sb, I/sb]``); each contiguous on ``w1``'s
    device (the kernels index them by the shapes alone) and, for gluon_ws, 16-byte aligned (its
    TMA descriptors over ``w1`` and ``w2``). ``expert_rows``: the most routed rows an expert can
    hold in a call, where known, within a tile's first half where the ring holds one A half a
    stage (``a_halves`` 1; else the kernel flags each tile past it)."""
    precision, device = weights.precision, weights.w1.device
    e_loc, hidden, inter = weights.num_experts, weights.hidden, weights.intermediate
    check_tile_config(config, precision, hidden, inter)
    if config.a_halves == 1 and expert_rows is not None and expert_rows > config.block_m // 2:
        raise MoEContractError(f"a ring of one A half a stage (a_halves=1) holds "
                               f"{config.block_m // 2} routed rows an expert; the bound allows "
                               f"{expert_rows}")
    wdt = torch.bfloat16 if precision == "bf16" else torch.float8_e4m3fn
    expect_tensor(weights.w1, "w1", (e_loc, 2 * inter, hidden), wdt, device)
    expect_tensor(weights.w2, "w2", (e_loc, hidden, inter), wdt, device)
    if precision == "fp8":
        sb = config.scale_block
        expect_tensor(weights.w1_scale, "w1_scale", (e_loc, 2 * inter // sb, hidden // sb),
                      torch.float32, device)
        expect_tensor(weights.w2_scale, "w2_scale", (e_loc, hidden // sb, inter // sb),
                      torch.float32, device)
    if config.kernel == "gluon_ws":
        _expect_aligned("w1", weights.w1)
        _expect_aligned("w2", weights.w2)


def _expect_aligned(name: str, t: torch.Tensor) -> None:
    if t.data_ptr() % ALIGN_BYTES:
        raise MoEContractError(f"{name} must start {ALIGN_BYTES}-byte aligned (TMA, 16-byte "
                               "cp.async)")


def _check_table_bounds(table: np.ndarray, counts: np.ndarray, problem: MoEProblem,
                        num_experts: int) -> None:
    """Every used entry names a tile kind, a local expert, a row and an N tile that exist (also
    for schedules launched without ``check_schedule``): the kernel indexes memory with them."""
    used = np.concatenate([table[g, :c] for g, c in enumerate(counts)] + [np.zeros((0, 4), np.int32)])
    kind, expert, row, n = used.T
    n_limit = np.where(kind == L1, problem.l1_n_blocks, problem.l2_n_blocks)
    if (~np.isin(kind, (L1, L2))).any() or ((expert < 0) | (expert >= num_experts)).any() or \
            ((row < 0) | (row >= problem.num_rows)).any() or ((n < 0) | (n >= n_limit)).any():
        raise MoEContractError("tile table entry outside the layout's experts, rows or N tiles")
    rows_expert = np.asarray(problem.row_expert, dtype=np.int64)
    if len(row) and (rows_expert[row] != expert).any():
        raise MoEContractError("tile table entry names an expert that does not own its row")


def prepare_fused_moe(layout: DispatchLayout, weights: ExpertWeights, schedule: Schedule,
                      peers: CombinePeers, *, config: TileConfig,
                      max_spin_iters: int = DEFAULT_MAX_SPIN_ITERS,
                      verify_schedule: bool = True, instrument: bool = False,
                      fence: bool = False,
                      synthetic_k_fraction: float | None = None,
                      l2_splits: int = 1) -> FusedMoECall:
    """Check the contract of the fused kernel and build its launch; nothing runs on the device.

    Contract: ``weights`` in the kernel layout for ``weights.precision``; ``layout`` from the same
    ``block_m``; every shape divisible by its tile (``check_tile_config``); a peer table of P
    mapped bf16 ``[slots >= max slot + 1, hidden]`` buffers, P covering every ``row_src``; a
    schedule over exactly this layout's tiles (``check_schedule``: each tile once, dependencies,
    lead D, no deadlock with all programs resident) with at most one program per SM (persistent
    programs must all be resident). ``verify_schedule=False`` skips only the schedule rules (the
    bounded-spin test launches a deliberately unsatisfiable schedule). ``instrument``: per-tile
    stamps into ``FusedMoECall.trace``; ``fence``: every Linear-2 tile waits until its Combine
    stores are visible system-wide (the completion-coupled variant). Both leave the results
    unchanged. ``synthetic_k_fraction`` (gluon_ws only; the X-Stage knee sweep, never the MoE
    layer): every mainloop runs only that fraction of its K blocks (``synthetic_k_blocks``) while
    every Combine store is kept; the result is the layer over those K blocks. ``l2_splits`` > 1
    (gluon_ws): the schedule's Linear-2 tiles are split in that many along K, its ``n`` indices
    counting ``l2_splits`` times the column blocks (``MoEWorkspace``'s tables at few rows:
    ``device_tables.l2_split_count``)."""
    precision, device = weights.precision, weights.w1.device
    e_loc, hidden, inter = weights.num_experts, weights.hidden, weights.intermediate
    check_expert_weights(weights, config)
    wdt = weights.w1.dtype
    if layout.block_m != config.block_m:
        raise MoEContractError(f"layout padded to block_m={layout.block_m}, tiles use {config.block_m}")
    if len(layout.tokens_per_expert) != e_loc:
        raise MoEContractError(f"layout has {len(layout.tokens_per_expert)} experts, weights {e_loc}")
    rows = layout.num_rows
    if rows != config.block_m * sum(layout.blocks_per_expert):
        raise MoEContractError(f"layout rows {rows} != block_m * row blocks")
    expect_tensor(layout.x, "x", (rows, hidden), wdt, device)
    if precision == "fp8":
        expect_tensor(layout.x_scale, "x_scale", (rows, hidden // config.scale_block),
                      torch.float32, device)
    expect_tensor(layout.row_src, "row_src", (rows,), torch.int32, device)
    expect_tensor(layout.row_slot, "row_slot", (rows,), torch.int32, device)
    if peers.world != len(layout.recv_counts):
        raise MoEContractError(f"peer table has {peers.world} ranks, Dispatch had {len(layout.recv_counts)}")
    if peers.hidden != hidden or peers.slots <= layout.max_slot:
        raise MoEContractError(f"Combine buffers [{peers.slots}, {peers.hidden}] cannot take slot "
                               f"{layout.max_slot} of hidden {hidden}")
    if peers.table.device != device:
        raise MoEContractError(f"peer table on {peers.table.device}, kernel on {device}")
    if l2_splits < 1:
        raise MoEContractError(f"l2_splits must be >= 1, got {l2_splits}")
    p2 = hidden // config.block_n2
    problem = MoEProblem(layout.blocks_per_expert, inter // config.block_n1, p2 * l2_splits)
    if verify_schedule:
        check_schedule(problem, schedule)
    table, counts = tile_table(schedule)
    _check_table_bounds(table, counts, problem, e_loc)
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if schedule.num_programs > sms:
            raise MoEContractError(f"{schedule.num_programs} persistent programs exceed the {sms} SMs:"
                                   " waiting programs could keep later ones from ever starting")
    if max_spin_iters < 1:
        raise MoEContractError("max_spin_iters must be >= 1")
    k_blocks = synthetic_k_blocks(synthetic_k_fraction, config, hidden, inter)
    if config.kernel == "gluon_ws":
        reason = kernel_unsupported("gluon_ws", device)
        if reason:
            raise MoEContractError(reason)
        _expect_aligned("x", layout.x)
    h = torch.empty(rows, inter, dtype=wdt, device=device)
    h_scale = (torch.empty(rows, inter // config.scale_block, dtype=torch.float32, device=device)
               if precision == "fp8" else None)
    row_ready = torch.zeros(max(1, problem.num_rows), dtype=torch.int32, device=device)
    error = torch.zeros(1, dtype=torch.int32, device=device)
    tiles = torch.from_numpy(table).to(device)
    # the layout's own rows, in place: layout row r reads row r (padding: -1)
    origin = torch.arange(rows, dtype=torch.int32, device=device)
    origin[layout.row_slot < 0] = -1
    # Uninstrumented, the kernel never touches the trace: one element stands in for the pointer.
    trace = torch.full((*table.shape[:2], TRACE_FIELDS) if instrument else (1,), -1,
                       dtype=torch.int64, device=device)
    split = split_k_buffers(sum(layout.blocks_per_expert), l2_splits, config.block_m, hidden, p2,
                            device)
    buffers = KernelBuffers(tiles, torch.from_numpy(counts).to(device),
                            row_addresses(layout.x, layout.x_scale), origin, h, h_scale, row_ready,
                            layout.row_src, layout.row_slot, peers.table, error, trace, l2_splits,
                            *split)
    args, constexprs = kernel_launch(config, weights, buffers, max_spin_iters=max_spin_iters,
                                     instrument=instrument, fence=fence, k_blocks=k_blocks)
    return FusedMoECall(schedule, args, constexprs, (schedule.num_programs,), row_ready, error,
                        trace if instrument else None, kernel=config.kernel,
                        synthetic_k_fraction=synthetic_k_fraction,
                        owners=(*peers.owners, *(t for t in (layout.x, layout.x_scale)
                                                 if t is not None)))


@dataclass(frozen=True)
class InKernelSum:
    """The top-k weighted sum a gluon_ws launch ends with at EP = 1 (``SUM_TOP_K`` of
    ``kernels/moe_fused_ws.py``): ``args`` int64 [3], the addresses of the Combine rows, the
    top-k weights and the output (``call_args.sum_args_view`` of a call's argument block);
    ``arrivals`` int64 [1], zero when allocated (the launches count up in it); ``tokens`` rows of
    the output, ``top_k`` picks each, weights of ``weight_dtype``. ``atomic`` (``SUM_ATOMIC``):
    each Linear-2 epilogue adds its weighted rows into the output, which must be zero at
    launch; ``arrivals`` and ``tokens`` are then not read."""

    args: torch.Tensor
    arrivals: torch.Tensor
    tokens: int
    top_k: int
    weight_dtype: torch.dtype
    atomic: bool = False


@dataclass(frozen=True)
class KernelBuffers:
    """What one launch of a fused kernel reads and writes besides the weights: the tile table
    (int32 ``[G, max_tiles, 4]``) and each program's tile count (int32 ``[G]``, read on the
    device), Linear-1's rows (``a_rows``: int64 ``[3]`` on the device, the addresses of ``x [N,
    H]`` and of its scales, and 1 where layout row ``r``'s scales are row ``r`` of them, 0 where
    they are those of the row of ``x`` it reads: ``row_addresses``; ``row_origin``: int32
    ``[R]``, the row of ``x`` each layout row reads, -1 on padding), the intermediate ``h`` and
    its scales, the row block counters (zero at launch for the row blocks in use), each row's
    source and slot, the peer table, the error flag and the trace (int64 ``[G, max_tiles,
    TRACE_FIELDS]`` when instrumented, else one element); where the table splits each Linear-2
    tile in ``l2_splits`` > 1 along K (gluon_ws only), the splits' fp32 partials and the tile
    halves' counters (``split_k_buffers``); where the launch ends with the weighted sum
    (gluon_ws only), what it reads and writes (``weighted_sum``)."""

    tiles: torch.Tensor
    num_tiles: torch.Tensor
    a_rows: torch.Tensor
    row_origin: torch.Tensor
    h: torch.Tensor
    h_scale: torch.Tensor | None
    row_ready: torch.Tensor
    row_src: torch.Tensor
    row_slot: torch.Tensor
    peer_table: torch.Tensor
    error: torch.Tensor
    trace: torch.Tensor
    l2_splits: int = 1
    l2_partial: torch.Tensor | None = None
    l2_ready: torch.Tensor | None = None
    weighted_sum: InKernelSum | None = None


def split_k_buffers(row_blocks: int, splits: int, block_m: int, hidden: int, l2_n_blocks: int,
                    device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``KernelBuffers.l2_partial`` (fp32 ``[row_blocks · splits · block_m, hidden]``) and
    ``l2_ready`` (int32 ``[row_blocks · l2_n_blocks · 2]``, zero: the kernel leaves it zero) for
    a layout of at most ``row_blocks`` row blocks in use and ``l2_n_blocks`` column blocks; none
    for one split (an unsplit table)."""
    if splits == 1:
        return None, None
    return (torch.empty(row_blocks * splits * block_m, hidden, dtype=torch.float32, device=device),
            torch.zeros(row_blocks * l2_n_blocks * 2, dtype=torch.int32, device=device))


def kernel_launch(config: TileConfig, weights: ExpertWeights, b: KernelBuffers, *,
                  max_spin_iters: int, instrument: bool = False, fence: bool = False,
                  k_blocks: tuple[int, int] | None = None) -> tuple[tuple, dict]:
    """The arguments and constexprs of ``config.kernel`` over ``b`` (contract checked by the
    caller: ``prepare_fused_moe``, or ``op.MoEWorkspace`` for its static buffers)."""
    e_loc, hidden, inter = weights.num_experts, weights.hidden, weights.intermediate
    fp8 = weights.precision == "fp8"
    k_blocks = k_blocks or synthetic_k_blocks(None, config, hidden, inter)
    split_k = b.l2_splits > 1
    if split_k and (config.kernel != "gluon_ws" or b.l2_partial is None or b.l2_ready is None):
        raise MoEContractError("a table of split Linear-2 tiles needs the gluon_ws kernel and its "
                               "split_k_buffers")
    summed = b.weighted_sum
    if summed is not None and config.kernel != "gluon_ws":
        raise MoEContractError("the weighted sum in the fused kernel needs the gluon_ws kernel")
    if config.kernel == "triton":
        args = (b.tiles, b.num_tiles, b.tiles.shape[1], b.a_rows, b.row_origin, weights.w1,
                weights.w1_scale, weights.w2, weights.w2_scale, b.h, b.h_scale, b.row_ready,
                b.row_src, b.row_slot, b.peer_table, b.error, max_spin_iters, e_loc, b.trace,
                hidden, inter)
        return args, dict(FP8=fp8, BLOCK_M=config.block_m, BLOCK_N1=config.block_n1,
                          BLOCK_N2=config.block_n2, BLOCK_K=config.block_k,
                          SCALE_BLOCK=config.scale_block, INSTRUMENT=bool(instrument),
                          FENCE=bool(fence), num_warps=config.num_warps,
                          num_stages=config.num_stages)
    half, bk = config.block_m // 2, config.block_k
    unused = b.error  # bf16 launches read no scales, unsplit ones no partials: any pointer
    args = (b.tiles, b.num_tiles, b.tiles.shape[1], b.a_rows, b.row_origin,
            _ws_descriptor(weights.w1.view(e_loc * 2 * inter, hidden), [config.block_n1, bk]),
            _ws_descriptor(b.h, [half, bk]),
            _ws_descriptor(weights.w2.view(e_loc * hidden, inter), [config.block_n2, bk]),
            weights.w1_scale if fp8 else unused,
            weights.w2_scale if fp8 else unused, b.h, b.h_scale if fp8 else unused, b.row_ready,
            b.row_src, b.row_slot, b.peer_table, b.error, max_spin_iters, e_loc, b.trace, hidden,
            inter, *k_blocks, b.l2_splits, b.l2_partial if split_k else unused,
            b.l2_ready if split_k else unused,
            *((summed.args, summed.arrivals, summed.tokens) if summed else (unused, unused, 0)))
    sums = (dict(SUM_TOP_K=summed.top_k, SUM_WEIGHT_DTYPE=triton_dtype(summed.weight_dtype),
                 SUM_ATOMIC=summed.atomic) if summed else {})
    return args, dict(FP8=fp8, BLOCK_M=config.block_m, BLOCK_N1=config.block_n1,
                      BLOCK_N2=config.block_n2, BLOCK_K=bk,
                      STAGES=config.num_stages, INSTRUMENT=bool(instrument), FENCE=bool(fence),
                      SPLIT_K=split_k, **sums, ONE_HALF=config.a_halves == 1, num_warps=4)


def row_addresses(x: torch.Tensor, x_scale: torch.Tensor | None) -> torch.Tensor:
    """``KernelBuffers.a_rows`` of ``x`` and its scales (none: 0), each layout row's scales those
    of the row of ``x`` it reads, on ``x``'s device. The tensors must outlive every launch that
    reads it."""
    return torch.tensor([x.data_ptr(), 0 if x_scale is None else x_scale.data_ptr(), 0],
                        dtype=torch.int64, device=x.device)


def synthetic_k_blocks(fraction: float | None, config: TileConfig, hidden: int,
                       intermediate: int) -> tuple[int, int]:
    """The K blocks a Linear-1 and a Linear-2 mainloop run: all of them for the MoE layer
    (``fraction`` None), else ``ceil(fraction · blocks)`` of each, at least one (a synthetic
    kernel, gluon_ws only)."""
    full = (hidden // config.block_k, intermediate // config.block_k)
    if fraction is None:
        return full
    if config.kernel != "gluon_ws":
        raise MoEContractError("a synthetic K fraction needs the gluon_ws kernel")
    if not 0 < fraction <= 1:
        raise MoEContractError(f"synthetic_k_fraction must lie in (0, 1], got {fraction}")
    return tuple(max(1, math.ceil(fraction * n)) for n in full)


def _ws_descriptor(t: torch.Tensor, block: list[int]) -> GluonTensorDescriptor:
    """A TMA descriptor over the row-major 2-D ``t`` with ``block`` tiles, 128-byte swizzled."""
    dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float8e4nv
    return GluonTensorDescriptor(t, list(t.shape), [t.shape[1], 1], block,
                                 gl.NVMMASharedLayout.get_default_for(block, dtype))
