"""The fused MoE as a layer on one GPU, from the router's output to the layer's output (issue 27;
paper §4.2, §5.2): record ``moe_layer``.

    python -m xstage_lab.experiments.moe.layer_bench (--out FILE.json | --root DIR)
        [--models M ...] [--precisions bf16 fp8] [--settings ep1 ep8_rank]
        [--tokens 1 8 64 512 4096 8192] [--trials N] [--smoke]

Settings: ``ep1``, every routed expert of the model on this GPU, ``FusedMoE`` from ``topk_ids``
(T tokens, balanced routing); ``ep8_rank``, rank 0 of EP = 8 (issue 18's workload): its E/8
experts and the rows all eight source ranks (T tokens each) route to them, source by source, as
Dispatch delivers them (in fp8 quantized on the source), ``MoEWorkspace`` from their local expert
ids, sources and slots, storing into eight local Combine buffers (the weighted sum is the
sources').

Per cell (model, precision, setting, tokens), correctness first, on outputs poisoned with NaN:
the fused call against the float32 reference within ``bench.TOLERANCE``, nothing flagged; the
host-scheduled launch of the same schedule storing the same Combine rows bit for bit; the device
tables equal the host reference (``device_tables.table_mismatches``) for T <= 512; the second
eager call (its graph launched) under ``torch.cuda.set_sync_debug_mode("error")``, checked the
same; at T = 64, one CUDA graph captured once and replayed with ``GRAPH_ROUTINGS`` routings, each
checked; at one token (``TRACED_TOKENS``) the instrumented build of the host-scheduled launch,
the same rows bit for bit. Then timed (``time_methods``):
``fused_eager``/``fused_graph`` (the whole call), ``schedule`` (the routing kernels alone),
``kernel`` (the fused kernel alone, over the device tables), ``host_scheduled_kernel`` (the same
kernel over the host-built layout and schedule, prepared beforehand), ``weighted_sum``,
``unfused_eager``/``unfused_graph`` (routing by torch ops, grouped GEMMs, the same weighted-sum
kernel: ``unfused.unfused_layer``), and ``host_scheduled`` (today's path: layout, schedule and
checked launch on the host, then the kernel and the weighted sum; eager, few trials).
``kernel_over_host_kernel_paired``: the kernel over the device tables against the host-scheduled
kernel, the median of their per-trial ratios (``dist_timing.paired_ratio``; both trials kept,
``kernel_trials_us`` and ``host_scheduled_kernel_trials_us``, beside the kernel's median SM clock,
``sm_clock_mhz``).
``host_overhead_us``: host time of an eager call, nothing waited for (``host_call_median_us``,
``host_call_max_us``: of its single calls; ``host_first_call_us``: a run's first call, the host
back from waiting for the device, timed apart: ``host_timing.host_call_times_us``);
``host_<step>_us`` that of each step alone (``host_stages``: at EP = 1 the eager call's own, its
inputs' check, its argument block's addresses and its graph's launch with them, and the direct
launches the graph captures; an EP rank's call launches the graph of its receive buffers:
``MoEWorkspace.received_call``); ``host_launch_floor_us`` that of one bare kernel launch on this
machine, and ``host_floor_*_us`` those of a graph launch and of a launch behind a queue
(``host_timing``). Where the device time goes, per kernel (``layer_profile.device_profile``):
the routing's (``route_kernels_us``, JSON), its table passes (``route_tables_us``: the schedule
kernels of issue 27's bound) apart from the pass over the activations (``route_gather_us``: the
FP8 quantization of the tokens at EP = 1; none where the fused kernel reads them as they are,
which it gathers into its Linear-1 tiles; a record from before that holds the move into the
layout); a whole call's (``call_kernels_us``) and the fused kernel's own time in the call and
alone (``kernel_in_call_us``, ``kernel_alone_device_us``; records from before them have
neither). ``l2_splits``: the K splits of each Linear-2 tile the
layer's tables hold (``device_tables.l2_split_count``; 1: none).
Floors from the HBM bandwidth measured at the start of the run (a device copy):
``weighted_sum_floor_us`` (its bytes) and ``weight_floor_us`` (the bytes of the experts the call
touches). Where a one-token kernel's time goes (``trace_*``,
``layer_view.kernel_phases``): its tiles, the SMs that ran them, their mainloops and stream
rates, the Linear-1 phase's end and the Linear-2 wait, from the instrumented launch.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import torch

from ...analysis.moe.layer_view import SUMMARY_KEYS, LayerView, kernel_phases, layer_view
from ...analysis.moe.trace import tile_frame
from ...cli import list_option
from ...dist_timing import TIMING_METHOD, median_clock_mhz, paired_ratio, time_methods
from ...ops.moe.combine import combine_weighted_sum, local_combine_peers
from ...ops.moe.device_tables import host_tables, table_mismatches
from ...ops.moe.dispatch import build_layout
from ...ops.moe.fused import FusedMoECall, prepare_fused_moe
from ...ops.moe.op import FusedMoE, GraphCache, MoEWorkspace, auto_schedule, launching_graphs
from ...ops.moe.reference import expert_rows_reference, reference_moe
from ...ops.moe.routing import router_logits, router_topk
from ...ops.moe.schedules import (MoEProblem, expert_wave_schedule, interleaved_schedule,
                                  tile_table)
from ...ops.moe.shapes import PRECISIONS, load_shapes
from ...ops.moe.unfused import (GROUP_ALIGN, GroupedWeights, unfused_expert_weights,
                                unfused_layer, unfused_rows)
from ...ops.moe.weights import local_expert_weights, quantize_rows_fp8
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment, Run
from .bench import TOLERANCE
from .kernel_cell import EP, arrival_sources, build_workload, receive_buffers
from .layer_profile import device_profile
from .host_timing import (call_statistics_us, host_call_times_us, host_overhead_us,
                          launch_floor_us, launch_floors_us)

SETTINGS = ("ep1", "ep8_rank")
DEFAULT_TOKENS = (1, 8, 64, 512, 4096, 8192)
DEFAULT_TRIALS = 5
GRAPH_ROUTINGS = 5
GRAPH_CHECK_TOKENS = 64
TRACED_TOKENS = (1,)  # where the record shows the kernel's phases (``kernel_phases``)
TABLE_CHECK_MAX_TOKENS = 512
HOST_SCHEDULED_TRIALS = 2
HBM_PROBE_BYTES = 2 << 30
SMOKE = dict(models=["DeepSeek-V4-Flash"], precisions=list(PRECISIONS), settings=list(SETTINGS),
             tokens=[1, 64, 4096], trials=3)


def balanced_routing(shape, tokens: int, seed: int, rank: int, device):
    """``tokens`` bf16 tokens of ``rank`` and the balanced router's picks and weights for them."""
    ids, w = router_topk(router_logits(tokens, shape.routed_experts, "balanced", seed=seed,
                                       rank=rank, device=device), shape.top_k)
    g = torch.Generator(device).manual_seed(seed + rank)
    x = torch.randn(tokens, shape.hidden, generator=g, device=device).to(torch.bfloat16)
    return x, ids, w


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


class Ep1Cell:
    """EP = 1: ``FusedMoE`` over every expert, inputs static (graph-capturable) per cell."""

    setting = "ep1"

    def __init__(self, shape, precision, tokens, weights, uweights, seed, device):
        self.shape, self.precision, self.tokens, self.seed = shape, precision, tokens, seed
        self.layer = FusedMoE(weights, max_tokens=tokens, top_k=shape.top_k, schedule="auto")
        self.uweights = uweights
        self.x, self.ids, self.w = balanced_routing(shape, tokens, seed, 0, device)
        self.unfused_capacity = tokens * shape.top_k + shape.routed_experts * (GROUP_ALIGN - 1)

    @property
    def ws(self) -> MoEWorkspace:
        """The layer's workspace (``Ep8RankCell.ws``'s counterpart)."""
        return self.layer.workspace

    def call(self):
        return self.layer(self.x, self.ids, self.w)

    def route(self):
        self.ws.route(self.ids.reshape(-1), self.x, top_k=self.shape.top_k)

    def kernel(self, routed: bool = False):
        """The fused kernel over the tables (``MoEWorkspace.launch``; ``routed``: right after
        ``route`` on this stream, which zeroed its counters)."""
        self.ws.launch(self.layer.schedule, self.layer.peers, routed=routed)

    def weighted_sum(self):
        combine_weighted_sum(self.combined(), self.w)

    def unfused(self):
        return unfused_layer(self.x, self.ids, self.w, self.uweights, self.unfused_capacity)

    def reference(self, x, ids, w) -> dict:
        return reference_moe(x, ids, w, self.shape, seed=self.seed, precision=self.precision)

    def output_error(self, y, x, ids, w) -> dict:
        return {k: _relative(y, r) for k, r in self.reference(x, ids, w).items()}

    def host_tables(self):
        k = self.shape.top_k
        rows = self.x.repeat_interleave(k, dim=0)
        xq, xs = quantize_rows_fp8(rows) if self.precision == "fp8" else (rows, None)
        return host_tables(self.ws.bounds, self.ids.reshape(-1), xq, xs, top_k=k)

    def host_launch(self, instrument: bool = False) -> FusedMoECall:
        """Today's path up to the launch: the layout on the host (syncs), the call's schedule
        built and checked there, the launch prepared (``instrument``: the traced build)."""
        ws, k = self.ws, self.shape.top_k
        rows = self.x.repeat_interleave(k, dim=0)
        xq, xs = quantize_rows_fp8(rows) if self.precision == "fp8" else (rows, None)
        n = rows.shape[0]
        layout = build_layout(xq, xs, torch.arange(n, device=rows.device), self.ids.reshape(-1),
                              [n], self.shape.routed_experts, ws.config.block_m)
        return _host_launch(layout, ws, self.layer.schedule, self.layer.peers, instrument)

    def host_scheduled(self):
        """Today's path: ``host_launch``, the kernel, the weighted sum."""
        self.host_launch()()
        return combine_weighted_sum(self.combined(), self.w)

    def combined(self) -> torch.Tensor:
        """The Combine rows a launch stored."""
        return self.layer.combine[:self.tokens * self.shape.top_k]

    def host_stages(self) -> dict:
        """The host side of a call's steps, each timed alone (``host_overhead_us``): those of an
        eager call (``check``, ``output``: its output's allocation, ``capturing``: whether the
        stream is capturing, ``args``: its argument block's addresses gathered and checked,
        ``replay``: its graph launched with them, captured by the checks' calls), the replay's
        two driver calls (``set_addresses``, ``graph_launch``), the launch of graphs of the
        call's first launches alone (``graph_launch_route``: the routing kernels;
        ``graph_launch_kernel``: and the fused kernel), and the direct launches a graph
        captures (``route``, ``launch``, ``weighted_sum``)."""
        layer, y = self.layer, torch.empty_like(self.x)
        graph = layer.graphs.get((self.tokens, layer.schedule, self.ids.dtype, self.w.dtype))

        def addresses():
            return layer.pack_addresses(self.ids, self.x, layer.combine, self.w, y)

        stream, launched = torch.cuda.current_stream().cuda_stream, addresses()

        def route():
            layer.route_launches(launched, self.tokens, self.ids.dtype)

        def route_and_kernel():
            route()
            layer.workspace.launch(layer.schedule, layer.peers, routed=True)

        parts = GraphCache(layer.device)
        route_graph = parts.capture("route", route)
        kernel_graph = parts.capture("kernel", route_and_kernel)
        return {"check": lambda: layer.check_inputs(self.x, self.ids, self.w),
                "output": lambda: torch.empty_like(self.x),
                "capturing": lambda: launching_graphs(layer.device),
                "args": addresses, "replay": lambda: graph(stream, launched),
                "set_addresses": lambda: graph.set_addresses(launched),
                "graph_launch": lambda: graph.launch(stream),
                "graph_launch_route": lambda: route_graph.launch(stream),
                "graph_launch_kernel": lambda: kernel_graph.launch(stream),
                "route": self.route, "launch": self.kernel, "weighted_sum": self.weighted_sum}

    def touched_experts(self) -> int:
        return int(torch.unique(self.ids).numel())

    def weighted_sum_bytes(self) -> int:
        return 2 * self.shape.hidden * self.tokens * (self.shape.top_k + 1)


class Ep8RankCell:
    """Rank 0 of EP = 8: issue 18's workload (``kernel_cell.build_workload``: the received rows of
    all eight sources in the order Dispatch delivers them) into eight local buffers."""

    setting = "ep8_rank"

    def __init__(self, shape, precision, tokens, weights, uweights, seed, device):
        self.shape, self.precision, self.tokens, self.seed = shape, precision, tokens, seed
        wl = build_workload(shape, "balanced", tokens, seed=seed, device=device)
        self.rows, self.slot, self.expert = wl.recv_x, wl.recv_slot, wl.recv_expert
        self.src = arrival_sources(wl)
        capacity = EP * tokens * shape.top_k
        # the rows arrive as Dispatch sent them, e4m3 with their scales in FP8: nothing to
        # quantize, so no quantized copy
        self.ws = MoEWorkspace(weights, capacity, source_rows=0)
        self.buffers = [torch.empty(tokens * shape.top_k, shape.hidden, dtype=torch.bfloat16,
                                    device=device) for _ in range(EP)]
        self.peers = local_combine_peers(self.buffers)
        xq, xsc = quantize_rows_fp8(self.rows) if precision == "fp8" else (self.rows, None)
        self.xq, self.xsc = xq, xsc
        received = receive_buffers(wl, xq, xsc, capacity)
        self.in_expert, self.in_x, self.in_scale = (received[k] for k in
                                                    ("expert_ids", "x", "x_scale"))
        self.n, self.in_src, self.in_slot = (received[k] for k in
                                             ("n_arrivals", "arrival_src", "arrival_slot"))
        self.uweights = uweights
        self.unfused_capacity = capacity + wl.experts_per_rank * (GROUP_ALIGN - 1)
        # each source's rows and slots, found once: a boolean mask in a call would sync
        self.by_source = [((self.src == r).nonzero(as_tuple=True)[0], r) for r in range(EP)]
        self.by_source = [(i, self.slot[i], r) for i, r in self.by_source]

    def route(self):
        self.ws.route(self.in_expert, self.in_x, self.in_scale, n_arrivals=self.n,
                      arrival_src=self.in_src, arrival_slot=self.in_slot)

    def kernel(self, routed: bool = False):
        """``Ep1Cell.kernel``'s counterpart."""
        self.ws.launch(auto_schedule(EP), self.peers, routed=routed)

    def call(self):
        self.ws.received_call(auto_schedule(EP), self.peers, self.in_expert, self.in_x,
                              self.in_scale, self.n, self.in_src, self.in_slot)

    def weighted_sum(self):
        """No weighted sum on an EP rank: the sources sum their Combine buffers."""

    def unfused(self):
        y = unfused_rows(self.rows, self.expert, self.uweights, self.unfused_capacity)
        for rows, slots, r in self.by_source:
            self.buffers[r][slots] = y[rows]

    def output_error(self, *_) -> dict:
        got = torch.stack(self.buffers)[self.src, self.slot]
        refs = expert_rows_reference(self.rows, self.expert, self.shape, seed=self.seed,
                                     precision=self.precision)
        return {k: _relative(got, r) for k, r in refs.items()}

    def host_tables(self):
        return host_tables(self.ws.bounds, self.expert, self.xq, self.xsc, arrival_src=self.src,
                           arrival_slot=self.slot)

    def host_launch(self, instrument: bool = False) -> FusedMoECall:
        ws = self.ws
        counts = torch.bincount(self.src, minlength=EP).tolist()
        layout = build_layout(self.xq, self.xsc, self.slot, self.expert, counts,
                              self.shape.routed_experts // EP, ws.config.block_m)
        return _host_launch(layout, ws, auto_schedule(EP), self.peers, instrument)

    def host_scheduled(self):
        self.host_launch()()

    def combined(self) -> torch.Tensor:
        return torch.stack(self.buffers)

    def host_stages(self) -> dict:
        return {"route": self.route, "launch": self.kernel}

    def touched_experts(self) -> int:
        return int(torch.unique(self.expert).numel())

    def weighted_sum_bytes(self) -> int:
        return 0


def _expert_bytes(weights) -> int:
    per = [weights.w1, weights.w2, weights.w1_scale, weights.w2_scale]
    return sum(t[0].numel() * t.element_size() for t in per if t is not None)


def _host_launch(layout, ws: MoEWorkspace, schedule: str, peers,
                 instrument: bool = False) -> FusedMoECall:
    """``schedule`` (the one the device tables give the fused call) built and checked on the
    host for ``layout``, and its launch prepared (``fused.prepare_fused_moe``)."""
    problem = MoEProblem(layout.blocks_per_expert, ws.bounds.l1_n_blocks, ws.bounds.l2_n_blocks)
    g = ws.bounds.num_programs
    built = (expert_wave_schedule(problem, g) if schedule == "wave"
             else interleaved_schedule(problem, g, ws.bounds.lead_rows,
                                       expert_lead=ws.bounds.expert_lead))
    return prepare_fused_moe(layout, ws.weights, built, peers, config=ws.config,
                             instrument=instrument, l2_splits=ws.bounds.l2_splits)


# How an eager call reaches the device (column ``eager_path``): one graph with the argument
# writer inside, launched by two driver calls (``graph_launch.GraphLauncher``). Records without
# the column launched the writer through Triton, then replayed the graph (EP = 1) or launched
# one by one (the EP rank).
EAGER_PATH = "graph_launch"


def hbm_bandwidth_gbps(device) -> float:
    """Read + write bytes of a large device-to-device copy over its median time."""
    src = torch.empty(HBM_PROBE_BYTES // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_methods({"copy": lambda: dst.copy_(src)}, trials=10, warmup=2)["copy"]["median_us"]
    return HBM_PROBE_BYTES / (t * 1e-6) / 1e9


def check_cell(cell, run: Run) -> list[str]:
    """Correctness first (module docstring)."""
    failures = []
    tol = TOLERANCE[cell.precision]

    def poison():
        if isinstance(cell, Ep1Cell):
            cell.layer.combine.fill_(float("nan"))
        else:
            for b in cell.buffers:
                b.fill_(float("nan"))

    poison()
    y = cell.call()
    torch.cuda.synchronize()
    errs = cell.output_error(y, cell.x, cell.ids, cell.w) if isinstance(cell, Ep1Cell) \
        else cell.output_error()
    failures += [f"fused {k} error {e:.3g} > {tol[k]}" for k, e in errs.items() if not e <= tol[k]]
    error = cell.ws.error
    if int(error):
        failures.append(f"error flag {int(error)}")
    # today's host-scheduled launch of the same schedule: the same rows, bit for bit (poison
    # included where no row lands)
    device_rows = cell.combined().clone()
    poison()
    cell.host_call = cell.host_launch()  # timed alone by measure
    cell.host_call()
    if not torch.equal(cell.combined().view(torch.int16), device_rows.view(torch.int16)):
        failures.append("the host-scheduled launch stores other Combine rows than the call")
    if cell.host_call.error_count():
        failures.append(f"host-scheduled launch: spin errors {cell.host_call.error_count()}")
    if cell.tokens in TRACED_TOKENS:
        failures += check_traced(cell, poison, device_rows)
    if cell.tokens <= TABLE_CHECK_MAX_TOKENS:
        bad = table_mismatches(cell.ws.tables, cell.host_tables())
        failures += [f"device table {b} differs from the host reference" for b in bad]
    # the second eager call launches the graph its first call captured: checked under the sync
    # check, its Combine rows poisoned; the first call's output is still held, so the second's
    # new one cannot be a block that already holds the right answer
    poison()
    torch.cuda.set_sync_debug_mode("error")
    synchronized = False
    try:
        y_graph = cell.call()
    except RuntimeError as e:
        failures.append(f"an eager call synchronized: {e}")
        synchronized = True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if not synchronized:
        torch.cuda.synchronize()
        errs = cell.output_error(y_graph, cell.x, cell.ids, cell.w) \
            if isinstance(cell, Ep1Cell) else cell.output_error()
        failures += [f"graph-launched call {k} error {e:.3g} > {tol[k]}"
                     for k, e in errs.items() if not e <= tol[k]]
    if isinstance(cell, Ep1Cell) and cell.tokens == GRAPH_CHECK_TOKENS:
        failures += check_graph_replays(cell)
    return failures


def check_traced(cell, poison, device_rows: torch.Tensor) -> list[str]:
    """The instrumented build of the host-scheduled launch (warm, then poisoned and run): the
    same Combine rows bit for bit, no spin error; its tiles kept for ``measure``."""
    traced = cell.host_launch(instrument=True)
    traced()
    poison()
    traced()
    failures = []
    if not torch.equal(cell.combined().view(torch.int16), device_rows.view(torch.int16)):
        failures.append("the instrumented launch stores other Combine rows than the call")
    if traced.error_count():
        failures.append(f"instrumented launch: spin errors {traced.error_count()}")
        return failures
    cell.tiles = tile_frame(traced.trace.cpu().numpy(), *tile_table(traced.schedule))
    return failures


def check_graph_replays(cell: Ep1Cell) -> list[str]:
    """One graph captured once, replayed with ``GRAPH_ROUTINGS`` routings, output poisoned
    before each replay, each against the reference."""
    failures = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cell.call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cell.call()
    for i in range(GRAPH_ROUTINGS):
        x, ids, w = balanced_routing(cell.shape, cell.tokens, cell.seed + 101 * (i + 1), 0,
                                     cell.x.device)
        cell.x.copy_(x)
        cell.ids.copy_(ids)
        cell.w.copy_(w)
        y.fill_(float("nan"))
        cell.layer.combine.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for k, e in cell.output_error(y, x, ids, w).items():
            if not e <= TOLERANCE[cell.precision][k]:
                failures.append(f"graph replay {i}: {k} error {e:.3g}")
    return failures


def layer_cell(shape, precision: str, setting: str, tokens: int, run: Run, device):
    """The cell of ``setting`` (``Ep1Cell`` or ``Ep8RankCell``), its weights built once per
    (model, precision, setting) in ``run`` (``run.args.seed``)."""
    world = 1 if setting == "ep1" else EP
    seed = run.args.seed

    def make():
        w = local_expert_weights(shape, 0, world, precision, seed=seed, device=device)
        u = (GroupedWeights(precision, w.w1, w.w2) if precision == "bf16" else
             unfused_expert_weights(shape, 0, world, precision, seed=seed, device=device))
        return w, u

    weights, uweights = run.resource((shape.model, precision, setting), make)
    kind = Ep1Cell if setting == "ep1" else Ep8RankCell
    return kind(shape, precision, tokens, weights, uweights, seed, device)


class MoELayer(Experiment):
    name = "moe_layer"
    paper = "§4.2, §5.2; issue 27"
    launch = "in_process"
    optional = True  # a platform without a layer run shows nothing of it
    in_measure_all = True  # notebook 03 draws it: reproduce measures what measure-all does
    links = ("local",)  # one GPU, its own memory

    @classmethod
    def analyse(cls, record, root: Path) -> LayerView:
        return LayerView(record.platform, (record,))

    @classmethod
    def analyse_platform(cls, platform: str, root: Path) -> LayerView:
        """Every record of the platform, a cell from the newest that holds it (``layer_view``)."""
        return layer_view(platform, root)

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--models", **list_option())
        p.add_argument("--precisions", **list_option())
        p.add_argument("--settings", **list_option())
        p.add_argument("--tokens", **list_option(int))
        p.add_argument("--trials", type=int, default=None)
        p.add_argument("--graph-iters", type=int, default=5)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--smoke", action="store_true",
                       help=f"the cells of {SMOKE}: a first check on the GPU")

    def check_args(self, a: argparse.Namespace) -> None:
        shapes = load_shapes()
        for key in ("models", "precisions", "settings", "tokens", "trials"):
            if a.smoke and getattr(a, key) is None:
                setattr(a, key, SMOKE[key])
        a.models = a.models or list(shapes)
        a.precisions = a.precisions or list(PRECISIONS)
        a.settings = a.settings or list(SETTINGS)
        a.tokens = a.tokens or list(DEFAULT_TOKENS)
        a.trials = a.trials or DEFAULT_TRIALS
        for name, given, allowed in (("model", a.models, shapes),
                                     ("precision", a.precisions, PRECISIONS),
                                     ("setting", a.settings, SETTINGS)):
            bad = [g for g in given if g not in allowed]
            if bad:
                raise ValueError(f"unknown {name} {bad}; choose from {list(allowed)}")
        if min(a.tokens) < 1 or a.trials < 1 or a.graph_iters < 1:
            raise ValueError("--tokens, --trials and --graph-iters must be >= 1")

    def sweeps(self, args) -> list[Sweep]:
        return [Sweep("moe_layer", (Axis("model", args.models), Axis("precision", args.precisions),
                                    Axis("setting", args.settings), Axis("tokens", args.tokens)),
                      repeats=1, warmup=0)]

    def start(self, run: Run) -> None:
        if not torch.cuda.is_available():
            raise SystemExit("moe.layer_bench needs a CUDA GPU")
        self.on = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference is float32
        self.shapes = load_shapes()
        self.hbm_gbps = hbm_bandwidth_gbps(self.on)
        self.launch_floor_us = launch_floor_us(self.on)
        self.launch_floors = launch_floors_us(self.on)

    def prepare(self, point: dict, run: Run):
        return layer_cell(self.shapes[point["model"]], point["precision"], point["setting"],
                          point["tokens"], run, self.on)

    def check(self, cell, run: Run) -> list[str]:
        return check_cell(cell, run)

    def measure(self, cell, run: Run) -> dict:
        a = run.args
        methods = {"fused": cell.call, "schedule": cell.route, "kernel": cell.kernel,
                   "host_scheduled_kernel": cell.host_call, "unfused": cell.unfused}
        if isinstance(cell, Ep1Cell):
            methods["weighted_sum"] = cell.weighted_sum
        graphed = time_methods(methods, trials=a.trials, graph_iters=a.graph_iters, clocks=True)
        eager = time_methods({"fused": cell.call, "unfused": cell.unfused}, trials=a.trials,
                             eager=frozenset({"fused", "unfused"}), graph_iters=a.graph_iters)
        host = time_methods({"host_scheduled": cell.host_scheduled},
                            trials=HOST_SCHEDULED_TRIALS, warmup=1)
        weights = cell.ws.weights
        bw = self.hbm_gbps * 1e9
        # the host time of each step of a call
        stages = {f"host_{k}_us": host_overhead_us(fn) for k, fn in cell.host_stages().items()}
        calls = call_statistics_us(*host_call_times_us(cell.call))
        # a tile's weight bytes: Linear-1 gate and up, Linear-2 its hidden columns
        cfg, elem = cell.ws.config, weights.w1.element_size()
        splits = cell.ws.bounds.l2_splits  # a split Linear-2 tile reads its share of K
        phases = (kernel_phases(cell.tiles, 2 * cfg.block_n1 * weights.hidden * elem,
                                cfg.block_n2 * weights.intermediate * elem / splits)
                  if cell.tokens in TRACED_TOKENS else {})
        # the point's columns too: the progress line reads them before the sweep adds them
        return {"model": cell.shape.model, "precision": cell.precision,
                "setting": cell.setting,
                "tokens": cell.tokens, "fused_eager_us": eager["fused"]["median_us"],
                "fused_graph_us": graphed["fused"]["median_us"],
                "schedule_us": graphed["schedule"]["median_us"],
                "host_overhead_us": calls["overhead"],
                **{f"host_{k}_us": v for k, v in calls.items() if k != "overhead"},
                "kernel_us": graphed["kernel"]["median_us"],
                "weighted_sum_us": graphed.get("weighted_sum", {}).get("median_us", 0.0),
                "weighted_sum_floor_us": cell.weighted_sum_bytes() / bw * 1e6,
                "unfused_eager_us": eager["unfused"]["median_us"],
                "unfused_graph_us": graphed["unfused"]["median_us"],
                "host_scheduled_us": host["host_scheduled"]["median_us"],
                "host_scheduled_kernel_us": graphed["host_scheduled_kernel"]["median_us"],
                "kernel_over_host_kernel_paired": paired_ratio(
                    graphed["kernel"]["trials_us"], graphed["host_scheduled_kernel"]["trials_us"]),
                "kernel_trials_us": json.dumps(graphed["kernel"]["trials_us"]),
                "host_scheduled_kernel_trials_us": json.dumps(
                    graphed["host_scheduled_kernel"]["trials_us"]),
                "sm_clock_mhz": median_clock_mhz(graphed["kernel"]),
                "host_launch_floor_us": self.launch_floor_us,
                "weight_floor_us": cell.touched_experts() * _expert_bytes(weights) / bw * 1e6,
                "touched_experts": cell.touched_experts(), "hbm_gbps": self.hbm_gbps,
                "l2_splits": splits,
                **device_profile(cell),
                "eager_path": EAGER_PATH, **self.launch_floors, **stages, **phases}

    def progress_line(self, rows: pd.DataFrame) -> str | None:
        r = rows.iloc[0]
        return (f"{r['model']:18s} {r['precision']:4s} {r['setting']:8s} {r['tokens']:5d}  "
                f"graph {r['fused_graph_us']:8.1f} us  eager {r['fused_eager_us']:8.1f} us  "
                f"kernel {r['kernel_us']:8.1f} us  schedule {r['schedule_us']:6.1f} us  "
                f"unfused {r['unfused_graph_us']:8.1f} us")

    def metadata(self, run: Run) -> dict:
        return {"settings": {"ep1": "every routed expert on this GPU, FusedMoE from topk_ids",
                             "ep8_rank": f"rank 0 of EP = {EP}: received rows (in Dispatch's "
                                         f"order: kernel_cell.build_workload) into {EP} local "
                                         "Combine buffers, no weighted sum"},
                "hbm_gbps": self.hbm_gbps, "host_launch_floor_us": self.launch_floor_us,
                "host_launch_floors_us": self.launch_floors,
                "tolerance": TOLERANCE,
                "timing": f"{TIMING_METHOD}; {run.args.graph_iters} calls per trial",
                "graph_routings": GRAPH_ROUTINGS, "summary_keys": list(SUMMARY_KEYS)}


EXPERIMENT = MoELayer()

if __name__ == "__main__":
    harness.main(EXPERIMENT)
