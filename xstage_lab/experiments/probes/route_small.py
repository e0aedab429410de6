"""Routing probe of the fused MoE layer: where one launch (``route_tiny``) writes the tables faster
than the launches whose programs make their passes side by side (issue 27; record
``route_small_probe``, named for ``route_small``, the one program it first measured).

    python -m xstage_lab.experiments.probes.route_small (--out FILE | --root DIR)
        [--models M ...] [--settings ep1 ep8_rank] [--tokens 1 8 64 512] [--trials N]
        [--precisions bf16 fp8] [--paths launches scan_in_histogram one_program quantize_apart]

``device_tables.TINY_ARRIVALS`` (``TINY_RECEIVED`` on an EP rank) sends a call's routing through one
launch up to that many arrivals (at most ``block_m``): every table from the arrivals held in the
registers of each of its programs (the tiles ``ROW_BLOCKS_TINY`` row blocks a program; in records
before 577270a one program wrote them all; before ``route_tiny``: ``route_small``, the histogram,
scan, scatter and tiles passes as loops of one program), against the launches whose programs make
them side by side (three; four in records before the scatter and the tiles shared one). One launch
saves their latency; ``route_small`` paid for its passes' steps one after another. Between them,
up to ``device_tables.scan_chunk_bound`` chunks of arrivals, two launches: the scan and the
layout in ``route_histogram``'s last program (``scan_in_histogram``; records before it have two
paths). This probe times the paths on the same arrivals, per model shape, in the two settings of
``layer_bench`` (EP = 1 from ``topk_ids``, ``T top_k`` arrivals; rank 0 of EP = 8 from its
received rows, their count on the device under a capacity of ``8 T top_k``), so that the
threshold is read off measurement. For an FP8 layer (``--precisions fp8``: bf16 rows quantized
per 1 x 128 on the way) each path quantizes as a call does (up to
``device_tables.QUANT_IN_HISTOGRAM_ROWS`` rows in its first launch), and ``quantize_apart``
takes the launches of ``scan_in_histogram`` with ``route_quantize``'s launch after them at every
count (records before it have bf16 only).

1. Checks first: each path's tables (``allocate_tables`` with ``tiny_arrivals`` and
   ``tiny_received`` 0, and above the capacity; ``scan_chunks`` and ``received_scan_steps`` 0
   for the three launches; ``quant_rows`` 0 to quantize apart), their outputs poisoned first,
   equal the host reference entry for entry (``table_mismatches``; in FP8 the quantized rows and
   scales bitwise), the fused kernel's counters of the row blocks in use zeroed; ids all in
   range (the error flag zero). Any failure aborts the run before timing; nothing is written.
2. Timing: every path's routing (the argument block's writer, the table passes; in records before
   the fused kernel gathered its rows, the activations' gather too) in one rotation
   (``dist_timing.time_methods``, CUDA-graph replays), then each path's kernels by name
   (``kernel_times_us``).

One row per (cell, path) of ``--paths`` (all by default, ``quantize_apart`` in FP8 only;
``one_program`` holds every arrival in registers, so above ``TINY_ARRIVALS`` it times a build no
call takes); ``over_launches`` is the launches' time over the path's (NaN where ``launches``
was not timed; ``over_five`` in records from before the scatter and the tiles shared a launch,
when the argument writer, the four table launches and the activations' gather were five).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pandas as pd
import torch

from ...cli import list_option
from ...dist_timing import TIMING_METHOD, kernel_times_us, time_methods
from ...ops.moe.device_tables import DeviceTables, TableBounds, allocate_tables, route_to_tables
from ...ops.moe.table_reference import host_tables, table_mismatches
from ...ops.moe.schedules import d_knee
from ...ops.moe.shapes import PRECISIONS, load_shapes
from ...ops.moe.weights import quantize_rows_fp8
from ...ops.moe.tiles import default_tile_config
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment, Run
from ..moe.kernel_cell import EP, arrival_sources, build_workload, receive_buffers
from ..moe.layer_cells import balanced_routing

SETTINGS = ("ep1", "ep8_rank")
# each path's tables: tiny_arrivals and tiny_received, scan_chunks and received_scan_steps (0:
# the three launches; None: the scan in route_histogram's last program up to scan_chunk_bound,
# and on an EP rank RECEIVED_SCAN_STEPS: two; or route_tiny: one) and quant_rows (None: the
# first launch quantizes up to QUANT_IN_HISTOGRAM_ROWS rows; 0: route_quantize's launch after the
# tables, an FP8 layer's only)
PATHS = {"launches": {"tiny": 0, "scan_chunks": 0, "quant_rows": None},
         "scan_in_histogram": {"tiny": 0, "scan_chunks": None, "quant_rows": None},
         "one_program": {"tiny": 1 << 30, "scan_chunks": None, "quant_rows": None},
         "quantize_apart": {"tiny": 0, "scan_chunks": None, "quant_rows": 0}}


def cell_paths(paths: list[str], precision: str) -> list[str]:
    """The paths of ``paths`` a cell of ``precision`` times: in bf16 nothing quantizes, so no
    path differs by where."""
    return [p for p in paths if precision == "fp8" or PATHS[p]["quant_rows"] is None]


@dataclasses.dataclass
class Arrivals:
    """One cell's arrivals, as ``route_to_tables`` takes them, and the host reference's view."""

    expert_ids: torch.Tensor      # EP = 1: topk_ids flat; EP rank: [capacity], padded
    x: torch.Tensor
    top_k: int
    received: dict                # EP rank: n_arrivals, arrival_src, arrival_slot
    host_ids: torch.Tensor        # the arrivals' local experts, unpadded
    host_x: torch.Tensor          # their rows
    host_received: dict           # EP rank: arrival_src, arrival_slot, unpadded


def cell_arrivals(shape, setting: str, tokens: int, seed: int, device) -> Arrivals:
    """EP = 1: ``tokens`` tokens' balanced router picks. EP rank: rank 0's received rows of the
    eight sources' balanced routings in Dispatch's order (``layer_bench``'s cells')."""
    k = shape.top_k
    if setting == "ep1":
        x, ids, _ = balanced_routing(shape, tokens, seed, 0, device)
        return Arrivals(ids.reshape(-1), x, k, {}, ids.reshape(-1),
                        x.repeat_interleave(k, dim=0), {})
    wl = build_workload(shape, "balanced", tokens, seed=seed, device=device)
    buffers = receive_buffers(wl, wl.recv_x, None, EP * tokens * k)
    received = {name: buffers[name] for name in ("n_arrivals", "arrival_src", "arrival_slot")}
    return Arrivals(buffers["expert_ids"], buffers["x"], k, received, wl.recv_expert, wl.recv_x,
                    {"arrival_src": arrival_sources(wl), "arrival_slot": wl.recv_slot})


@dataclasses.dataclass
class RouteStep:
    point: dict
    arrivals: Arrivals
    tables: dict                  # path -> DeviceTables
    bounds: TableBounds

    def route(self, path: str) -> None:
        a = self.arrivals
        route_to_tables(self.tables[path], a.expert_ids, a.x, top_k=a.top_k, **a.received)


def _poison(tables: DeviceTables) -> None:
    for t in (tables.expert_counts, tables.expert_offsets, tables.arrival_rows, tables.row_src,
              tables.row_slot, tables.row_origin, tables.meta, tables.row_ready,
              *tables.tiles.values(),
              *tables.num_tiles.values()):
        t.fill_(-7)
    if tables.x_quant is not None:
        tables.x_quant.view(torch.uint8).fill_(0x7F)  # e4m3 NaN
        tables.x_quant_scale.fill_(float("nan"))


class RouteSmall(Experiment):
    """The routing paths over the same arrivals, checked, timed and profiled together."""

    name = "route_small_probe"
    paper = "§4.2 routing to tile tables on the device; issue 27"
    launch = "in_process"
    links = ("local",)

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--models", **list_option(default=list(load_shapes())))
        p.add_argument("--settings", **list_option(default=list(SETTINGS)))
        p.add_argument("--tokens", **list_option(int, default=[1, 8, 64, 512]))
        p.add_argument("--precisions", **list_option(default=["bf16"]))
        p.add_argument("--trials", type=int, default=7)
        p.add_argument("--warmup", type=int, default=2)
        p.add_argument("--graph-iters", type=int, default=20)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--paths", **list_option(default=list(PATHS)),
                       help="the paths to check and time (over_launches NaN without launches)")

    def check_args(self, a: argparse.Namespace) -> None:
        shapes = load_shapes()
        unknown = [m for m in a.models if m not in shapes] + \
            [s for s in a.settings if s not in SETTINGS] + \
            [p for p in a.precisions if p not in PRECISIONS] + \
            [p for p in a.paths if p not in PATHS]
        if unknown:
            raise ValueError(f"unknown models, settings, precisions or paths {unknown}: models "
                             f"{list(shapes)}, settings {list(SETTINGS)}, precisions "
                             f"{list(PRECISIONS)}, paths {list(PATHS)}")
        if min(a.tokens) < 1 or a.trials < 1 or a.graph_iters < 1 or a.warmup < 0:
            raise ValueError("--tokens, --trials and --graph-iters must be >= 1, --warmup >= 0")

    def sweeps(self, args) -> list[Sweep]:
        return [Sweep("route_small", (Axis("model", args.models),
                                      Axis("setting", args.settings),
                                      Axis("precision", args.precisions),
                                      Axis("tokens", args.tokens)), repeats=1, warmup=0)]

    def start(self, run: Run) -> None:
        if not torch.cuda.is_available():
            raise SystemExit("the routing probe needs a CUDA GPU")
        self.device = torch.device("cuda")
        self.programs = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.shapes = load_shapes()

    def prepare(self, point: dict, run: Run) -> RouteStep:
        shape = self.shapes[point["model"]]
        ep1 = point["setting"] == "ep1"
        config = default_tile_config("bf16", "gluon_ws", hidden=shape.hidden)
        capacity = point["tokens"] * shape.top_k * (1 if ep1 else EP)
        bounds = TableBounds.of(capacity, shape.routed_experts // (1 if ep1 else EP),
                                shape.hidden, shape.intermediate, config, self.programs,
                                d_knee(2 * config.block_n1, self.programs, shape.intermediate))
        arrivals = cell_arrivals(shape, point["setting"], point["tokens"], run.args.seed,
                                 self.device)
        precision = point["precision"]
        tables = {path: allocate_tables(bounds, shape.hidden, precision, self.device,
                                        tiny_arrivals=PATHS[path]["tiny"],
                                        tiny_received=PATHS[path]["tiny"],
                                        scan_chunks=PATHS[path]["scan_chunks"],
                                        received_scan_steps=PATHS[path]["scan_chunks"],
                                        quant_rows=PATHS[path]["quant_rows"])
                  for path in cell_paths(run.args.paths, precision)}
        return RouteStep(point, arrivals, tables, bounds)

    def check(self, step: RouteStep, run: Run) -> list[str]:
        a = step.arrivals
        # the rows as the fused kernel reads them: in FP8 quantized, as the routing does
        x, x_scale = (quantize_rows_fp8(a.host_x) if step.point["precision"] == "fp8"
                      else (a.host_x, None))
        want = host_tables(step.bounds, a.host_ids, x, x_scale, top_k=a.top_k,
                           **{k: v.cpu() for k, v in a.host_received.items()})
        failures = []
        for path, tables in step.tables.items():
            _poison(tables)
            step.route(path)
            # the counters of the row blocks in use zeroed (the fused kernel reads no other)
            in_use = tables.row_ready[:int(tables.meta[0])]
            bad = table_mismatches(tables, want) + (["row_ready"] if in_use.any() else [])
            if bad or int(tables.error):
                failures.append(f"{path}: {bad}, error flag {int(tables.error)}")
        return failures

    def measure(self, step: RouteStep, run: Run) -> pd.DataFrame:
        args = run.args
        routes = {path: (lambda p=path: step.route(p)) for path in step.tables}
        timing = time_methods(routes, trials=args.trials, warmup=args.warmup,
                              graph_iters=args.graph_iters, clocks=True)
        launches = timing.get("launches", {}).get("median_us", float("nan"))
        a = step.arrivals
        n = int(a.received["n_arrivals"]) if a.received else a.expert_ids.numel()
        return pd.DataFrame([{
            **step.point, "path": path, "capacity": step.bounds.capacity, "arrivals": n,
            "row_blocks": int(step.tables[path].meta[0]), "num_experts": step.bounds.num_experts,
            "us": t["median_us"], "p25_us": t["p25_us"], "p75_us": t["p75_us"],
            "over_launches": launches / t["median_us"], "trials_us": t["trials_us"],
            "sm_clock_mhz": min((c for c in t.get("sm_clock_mhz", []) if c is not None),
                                default=None),
            "kernels_us": json.dumps(kernel_times_us(routes[path]))}
            for path, t in timing.items()])

    def progress_line(self, rows) -> str | None:
        r = rows.set_index("path")["us"].round(1).to_dict()
        first = rows.iloc[0]
        return (f"{first['model']:18s} {first['setting']:8s} {first['precision']} "
                f"T={first['tokens']:<4d} arrivals {first['arrivals']:5d}  {r}")

    def metadata(self, run: Run) -> dict:
        args = run.args
        return {"paths": PATHS, "programs": self.programs,
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "timing": f"{TIMING_METHOD}; {args.graph_iters} calls per trial, CUDA-graph "
                          "replays"}


EXPERIMENT = RouteSmall()


if __name__ == "__main__":
    harness.main(EXPERIMENT)
