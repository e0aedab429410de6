"""The fused MoE as a layer on one GPU, from the router's output to the layer's output (issue 27;
paper §4.2, §5.2): record ``moe_layer``.

    python -m xstage_lab.experiments.moe.layer_bench (--out FILE.json | --root DIR)
        [--models M ...] [--precisions bf16 fp8] [--settings ep1 ep8_rank]
        [--tokens 1 8 64 512 4096 8192] [--trials N] [--graph-start idle|held] [--smoke]

Settings: ``ep1``, every routed expert of the model on this GPU, ``FusedMoE`` from ``topk_ids``
(T tokens, balanced routing); ``ep8_rank``, rank 0 of EP = 8 (issue 18's workload): its E/8
experts and the rows all eight source ranks (T tokens each) route to them, source by source, as
Dispatch delivers them (in fp8 quantized on the source), ``MoEWorkspace`` from their local expert
ids, sources and slots, storing into eight local Combine buffers (the weighted sum is the
sources').

Per cell (model, precision, setting, tokens), correctness first, on outputs poisoned with NaN:
the fused call against the float32 reference within ``bench.TOLERANCE``, nothing flagged; the
host-scheduled launch of the same schedule storing the same Combine rows bit for bit; the device
tables equal the host reference (``table_reference.table_mismatches``) for T <= 512; the second
eager call (its graph launched) under ``torch.cuda.set_sync_debug_mode("error")``, checked the
same; at T = 64, one CUDA graph captured once and replayed with ``GRAPH_ROUTINGS`` routings, each
checked; at one token (``TRACED_TOKENS``) the instrumented build of the host-scheduled launch,
the same rows bit for bit; where the fused kernel ends with the weighted sum (``--weighted-sum
kernel``), that kernel alone as timed, the call's output bit for bit. Then timed
(``time_methods``):
``fused_eager``/``fused_graph`` (the whole call), ``schedule`` (the routing kernels alone),
``kernel`` (the fused kernel alone, over the device tables, without the weighted sum;
``kernel_summed``: where the call's kernel ends with it, that kernel alone, NaN elsewhere),
``host_scheduled_kernel`` (the same kernel over the host-built layout and schedule, prepared
beforehand), ``weighted_sum``,
``unfused_eager``/``unfused_graph`` (routing by torch ops, grouped GEMMs, the same weighted-sum
kernel: ``unfused.unfused_layer``), and ``host_scheduled`` (today's path: layout, schedule and
checked launch on the host, then the kernel and the weighted sum; eager, few trials).
``--graph-start``: where each trial of a graphed method starts: ``idle`` (the records' so far),
the replay's own launch in its window (the graph's ``graph_iters``-th part of it per call), or
``held``, queued behind a hold kernel (``dist_timing.HOLD_CYCLES``) so that the window holds the
device's time of the calls and their gaps, as inside a graph of a whole forward; the record's
variant and column ``graph_start`` (records without it: idle), ``graph_unheld_trials`` the held
trials whose start the GPU passed before their replay was launched (``time_methods``).
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
neither), and the fill of its row counters before it alone (``alone_fill_us``, with the time
from the fill into the kernel ``alone_fill_boundary_us``: ``kernel_us`` holds both, which
issue 27's bound takes out; none before them); the device's time between consecutive kernels,
per pair, in graphs of the call and of the kernel alone (``call_boundaries_us``,
``alone_boundaries_us``; none before them). ``l2_splits``: the K splits of each Linear-2 tile
the layer's tables hold (``device_tables.l2_split_count``; 1: none).
Floors from the HBM bandwidth measured at the start of the run (a device copy):
``weighted_sum_floor_us`` (its bytes) and ``weight_floor_us`` (the bytes of the experts the call
touches). Where a one-token kernel's time goes (``trace_*``,
``layer_view.kernel_phases``): its tiles, the SMs that ran them, their mainloops and stream
rates, the Linear-1 phase's end and the Linear-2 wait, from the instrumented launch; and around
the mainloops the programs' start spread, a Linear-1 tile's wait for its first weights and its
epilogue, and the tail past the last Linear-2 mainloop (none in records from before them).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd
import torch

from ...analysis.moe import VARIANT
from ...analysis.moe.layer_view import (PLATFORM_VARIANT, SUMMARY_KEYS, LayerView,
                                         kernel_phases, layer_view)
from ...analysis.moe.trace import tile_frame
from ...cli import list_option
from ...dist_timing import (HOLD_CYCLES, median_clock_mhz, paired_ratio, time_methods,
                            timing_method)
from ...ops.moe.op import WEIGHTED_SUMS
from ...ops.moe.table_reference import table_mismatches
from ...ops.moe.schedules import tile_table
from ...ops.moe.shapes import PRECISIONS, load_shapes
from ...ops.moe.tiles import WS_ROW_TILES
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment, Run
from .bench import TOLERANCE, tolerance_failures
from .kernel_cell import EP
from .layer_cells import SETTINGS, Ep1Cell, balanced_routing, layer_cell
from .layer_profile import device_profile
from .host_timing import (call_statistics_us, host_call_times_us, host_overhead_us,
                          launch_floor_us, launch_floors_us)

DEFAULT_TOKENS = (1, 8, 64, 512, 4096, 8192)
DEFAULT_TRIALS = 5
GRAPH_ROUTINGS = 5
GRAPH_CHECK_TOKENS = 64
TRACED_TOKENS = (1,)  # where the record shows the kernel's phases (``kernel_phases``)
TABLE_CHECK_MAX_TOKENS = 512
HOST_SCHEDULED_TRIALS = 2
HBM_PROBE_BYTES = 2 << 30
GRAPH_STARTS = {"idle": 0, "held": HOLD_CYCLES}  # --graph-start: time_methods' hold_cycles
SMOKE = dict(models=["DeepSeek-V4-Flash"], precisions=list(PRECISIONS), settings=list(SETTINGS),
             tokens=[1, 64, 4096], trials=3)


def _expert_bytes(weights) -> int:
    per = [weights.w1, weights.w2, weights.w1_scale, weights.w2_scale]
    return sum(t[0].numel() * t.element_size() for t in per if t is not None)


# How an eager call reaches the device (column ``eager_path``): one graph with the argument
# writer inside, launched by two driver calls (``graph_launch.GraphLauncher``). Records without
# the column launched the writer through Triton, then replayed the graph (EP = 1) or launched
# one by one (the EP rank).
EAGER_PATH = "graph_launch"


def tile_weight_bytes(ws) -> tuple[float, float]:
    """The weight bytes a tile of ``ws``'s kernel streams: Linear-1 its gate and up columns,
    Linear-2 its hidden columns, of a split tile its share of K (``kernel_phases``' rates)."""
    cfg, w = ws.config, ws.weights
    elem = w.w1.element_size()
    return (2 * cfg.block_n1 * w.hidden * elem,
            cfg.block_n2 * w.intermediate * elem / ws.bounds.l2_splits)


def hbm_bandwidth_gbps(device) -> float:
    """Read + write bytes of a large device-to-device copy over its median time."""
    src = torch.empty(HBM_PROBE_BYTES // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_methods({"copy": lambda: dst.copy_(src)}, trials=10, warmup=2)["copy"]["median_us"]
    return HBM_PROBE_BYTES / (t * 1e-6) / 1e9


def check_cell(cell, run: Run) -> list[str]:
    """Correctness first (module docstring)."""
    failures = []
    cell.poison()
    y = cell.call()
    torch.cuda.synchronize()
    errs = cell.output_error(y, cell.x, cell.ids, cell.w) if isinstance(cell, Ep1Cell) \
        else cell.output_error()
    failures += tolerance_failures("fused", errs, cell.precision)
    error = cell.ws.error
    if int(error):
        failures.append(f"error flag {int(error)}")
    # today's host-scheduled launch of the same schedule: the same rows, bit for bit (poison
    # included where no row lands)
    if isinstance(cell, Ep1Cell) and cell.layer.adds_into_output(cell.tokens):
        # the call added its rows into y: the Combine rows of its tables, the kernel's alone
        cell.poison()
        cell.kernel()
    device_rows = cell.combined().clone()
    cell.poison()
    cell.host_call = cell.host_launch()  # timed alone by measure
    cell.host_call()
    if not torch.equal(cell.combined().view(torch.int16), device_rows.view(torch.int16)):
        failures.append("the host-scheduled launch stores other Combine rows than the call")
    if cell.host_call.error_count():
        failures.append(f"host-scheduled launch: spin errors {cell.host_call.error_count()}")
    if cell.tokens in TRACED_TOKENS:
        failures += check_traced(cell, device_rows)
    if cell.tokens <= TABLE_CHECK_MAX_TOKENS:
        bad = table_mismatches(cell.ws.tables, cell.host_tables())
        failures += [f"device table {b} differs from the host reference" for b in bad]
    # the second eager call launches the graph its first call captured: checked under the sync
    # check, its Combine rows poisoned; the first call's output is still held, so the second's
    # new one cannot be a block that already holds the right answer
    cell.poison()
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
        failures += tolerance_failures("graph-launched call", errs, cell.precision)
        if cell.sums_in_kernel():  # over this call's tables, before the replays route anew
            failures += check_kernel_alone_sums(cell, y_graph)
    if isinstance(cell, Ep1Cell) and cell.tokens == GRAPH_CHECK_TOKENS:
        failures += check_graph_replays(cell)
    return failures


def check_kernel_alone_sums(cell: Ep1Cell, y: torch.Tensor) -> list[str]:
    """Where the call's fused kernel ends with the weighted sum: that kernel alone as ``measure``
    times it (``kernel_summed``: over the call's tables, into the cell's own output, poisoned
    first) sums the same bits as the call ``y``, and the count of arrivals holds whole launches
    (two a program). Its adds (``weighted_sum="atomic"``, ``"auto"``'s at a few tokens) go into
    the output zeroed first, as the call's routing leaves it, in an order of their own: within
    bf16's rounding of ``y``."""
    atomic = cell.layer.adds_into_output(cell.tokens)
    cell.alone_out.fill_(0.0 if atomic else float("nan"))
    cell.kernel_summed()
    torch.cuda.synchronize()
    failures = []
    if atomic:
        # each element top_k bf16 adds, each rounding, in an order of their own: a rounding each
        bound = 2.0 ** -8 * cell.shape.top_k
        diff = (cell.alone_out.float() - y.float()).abs().max()
        if not diff <= bound * y.float().abs().max():
            failures.append(f"the kernel alone sums {float(diff):.3g} from the call")
        return failures
    if not torch.equal(cell.alone_out.view(torch.int16), y.view(torch.int16)):
        failures.append("the kernel alone sums other bits than the call")
    parties = 2 * cell.ws.bounds.num_programs
    arrivals = int(cell.layer.moe_buffers.sum_arrivals)
    if arrivals % parties:
        failures.append(f"{arrivals} arrivals: not a whole number of launches of {parties}")
    return failures


def check_traced(cell, device_rows: torch.Tensor) -> list[str]:
    """The instrumented build of the host-scheduled launch (warm, then poisoned and run): the
    same Combine rows bit for bit, no spin error; its tiles kept for ``measure``."""
    traced = cell.host_launch(instrument=True)
    traced()
    cell.poison()
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


class LayerCellRun(Experiment):
    """What an experiment over ``layer_cells``' cells shares: the cells' names checked, one sweep
    over (model, precision, setting, tokens), a CUDA GPU, each cell built (``layer_cell``) and
    checked (``check_cell``) before it is measured."""

    sweep_name: str
    launch = "in_process"
    links = ("local",)  # one GPU, its own memory

    @staticmethod
    def check_cell_names(a: argparse.Namespace) -> None:
        shapes = load_shapes()
        for name, given, allowed in (("model", a.models, shapes),
                                     ("precision", a.precisions, PRECISIONS),
                                     ("setting", a.settings, SETTINGS)):
            bad = [g for g in given if g not in allowed]
            if bad:
                raise ValueError(f"unknown {name} {bad}; choose from {list(allowed)}")

    def sweeps(self, args) -> list[Sweep]:
        return [Sweep(self.sweep_name, (Axis("model", args.models),
                                        Axis("precision", args.precisions),
                                        Axis("setting", args.settings),
                                        Axis("tokens", args.tokens)), repeats=1, warmup=0)]

    def start(self, run: Run) -> None:
        if not torch.cuda.is_available():
            raise SystemExit(f"{self.name} needs a CUDA GPU")
        self.on = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = False  # the reference is float32
        self.shapes = load_shapes()

    def prepare(self, point: dict, run: Run):
        return layer_cell(self.shapes[point["model"]], point["precision"], point["setting"],
                          point["tokens"], run, self.on, **self.cell_options(run))

    def cell_options(self, run: Run) -> dict:
        """What ``layer_cell`` takes beyond the cell, from ``run``'s options (none here)."""
        return {}

    def check(self, cell, run: Run) -> list[str]:
        return check_cell(cell, run)


class MoELayer(LayerCellRun):
    name = "moe_layer"
    sweep_name = "moe_layer"
    paper = "§4.2, §5.2; issue 27"
    optional = True  # a platform without a layer run shows nothing of it
    in_measure_all = True  # notebook 03 draws it: reproduce measures what measure-all does

    @classmethod
    def analyse(cls, record, root: Path) -> LayerView:
        return LayerView(record.platform, (record,))

    @classmethod
    def analyse_platform(cls, platform: str, root: Path) -> LayerView:
        """Every record of the platform's ``PLATFORM_VARIANT``, a cell from the newest that
        holds it (``layer_view``)."""
        return layer_view(platform, root)

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--models", **list_option())
        p.add_argument("--precisions", **list_option())
        p.add_argument("--settings", **list_option())
        p.add_argument("--tokens", **list_option(int))
        p.add_argument("--trials", type=int, default=None)
        p.add_argument("--graph-iters", type=int, default=5)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--weighted-sum", choices=WEIGHTED_SUMS,
                       default=PLATFORM_VARIANT["weighted_sum"],
                       help="where the EP = 1 call's weighted sum runs (FusedMoE's "
                            "weighted_sum): the record's variant")
        p.add_argument("--tile-rows", type=int, choices=list(WS_ROW_TILES), default=None,
                       help="the rows of the gluon_ws kernel's tiles (tiles.WS_ROW_TILES; 256: "
                            "bf16 only), else the workspace's default: the record's variant")
        p.add_argument("--graph-start", choices=list(GRAPH_STARTS),
                       default=PLATFORM_VARIANT["graph_start"],
                       help="each graphed trial from an idle GPU (its replay's launch in the "
                            "window) or held behind a hold kernel: the record's variant")
        p.add_argument("--smoke", action="store_true",
                       help=f"the cells of {SMOKE}: a first check on the GPU")

    def cell_options(self, run: Run) -> dict:
        return {"weighted_sum": run.args.weighted_sum, "tile_rows": run.args.tile_rows}

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
        self.check_cell_names(a)
        if min(a.tokens) < 1 or a.trials < 1 or a.graph_iters < 1:
            raise ValueError("--tokens, --trials and --graph-iters must be >= 1")
        if a.tile_rows and set(a.precisions) - set(WS_ROW_TILES[a.tile_rows]["precisions"]):
            raise ValueError(f"--tile-rows {a.tile_rows} takes only the precisions "
                             f"{WS_ROW_TILES[a.tile_rows]['precisions']}, not {a.precisions}")

    def start(self, run: Run) -> None:
        super().start(run)
        self.hbm_gbps = hbm_bandwidth_gbps(self.on)
        self.launch_floor_us = launch_floor_us(self.on)
        self.launch_floors = launch_floors_us(self.on)

    def measure(self, cell, run: Run) -> dict:
        a = run.args
        methods = {"fused": cell.call, "schedule": cell.route, "kernel": cell.kernel,
                   "host_scheduled_kernel": cell.host_call, "unfused": cell.unfused}
        if isinstance(cell, Ep1Cell):
            methods["weighted_sum"] = cell.weighted_sum
        if cell.sums_in_kernel():
            methods["kernel_summed"] = cell.kernel_summed
        graphed = time_methods(methods, trials=a.trials, graph_iters=a.graph_iters, clocks=True,
                               hold_cycles=GRAPH_STARTS[a.graph_start])
        eager = time_methods({"fused": cell.call, "unfused": cell.unfused}, trials=a.trials,
                             eager=frozenset({"fused", "unfused"}), graph_iters=a.graph_iters)
        host = time_methods({"host_scheduled": cell.host_scheduled},
                            trials=HOST_SCHEDULED_TRIALS, warmup=1)
        weights = cell.ws.weights
        bw = self.hbm_gbps * 1e9
        # the host time of each step of a call
        stages = {f"host_{k}_us": host_overhead_us(fn) for k, fn in cell.host_stages().items()}
        calls = call_statistics_us(*host_call_times_us(cell.call))
        phases = (kernel_phases(cell.tiles, *tile_weight_bytes(cell.ws))
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
                "kernel_summed_us": graphed.get("kernel_summed", {}).get("median_us",
                                                                        float("nan")),
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
                "l2_splits": cell.ws.bounds.l2_splits,
                "weighted_sum_in_kernel": cell.sums_in_kernel(),
                "tile_rows": cell.ws.config.block_m,
                "graph_start": a.graph_start,
                "graph_unheld_trials": sum(g.get("unheld_trials", 0) for g in graphed.values())
                if a.graph_start == "held" else float("nan"),
                **device_profile(cell, a.graph_iters),
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
                "timing": timing_method(run.args.graph_iters,
                                        GRAPH_STARTS[run.args.graph_start]),
                "graph_routings": GRAPH_ROUTINGS, "summary_keys": list(SUMMARY_KEYS),
                VARIANT: {"weighted_sum": run.args.weighted_sum,
                          "graph_start": run.args.graph_start,
                          **({"tile_rows": run.args.tile_rows} if run.args.tile_rows else {})}}


EXPERIMENT = MoELayer()

if __name__ == "__main__":
    harness.main(EXPERIMENT)
