"""Gather probe of the fused MoE kernel: what reading Linear-1's rows through ``row_origin`` with
``cp.async`` costs the kernel against TMA loads of a layout moved into place beforehand (issue 27;
record ``moe_gather_probe``).

    python -m xstage_lab.experiments.probes.moe_gather (--out FILE | --root DIR)
        [--setting ep8_rank|ep1] [--tma-kernel FILE] [--variant NAME=FILE ...] [--models M ...]
        [--precisions bf16 fp8] [--routing balanced skewed] [--tokens 4096]
        [--schedule wave|interleaved] [--trials N]

On ``kernel_cell``'s workload (``--setting ep8_rank``: one rank of EP = 8, every Combine store
local), one schedule (``--schedule``: Expert-Wave, or Interleaved at the derived lead as
``FusedMoE``'s device tables build it, ``schedules.derived_interleaved_schedule``) and one launch
of each kernel, all in one rotation:

  in_place     the committed kernel over the layout's own rows (``row_origin[r] = r``): the
               host-scheduled launch;
  scattered    the committed kernel over the received rows in arrival order, each layout row
               through its arrival (what the device-built tables give it: no move into place);
  tma          ``--tma-kernel``: a kernel of the contract before the gather (``x_desc``/``x_scale``
               arguments, TMA loads of the layout's rows; ``git show a343c34:kernels/
               moe_fused_ws.py``) over the layout's rows;
  device_tables  ``FusedMoE``'s path: an ``op.MoEWorkspace`` sized as ``layer_bench``'s EP rank
               (capacity ``EP·T·top_k``) routed once over the received rows, its kernel launched
               over its device tables (``MoEWorkspace.launch``);
  device_tiles   ``in_place`` with the workspace's tile tables (``[G, max_tiles]``, sized by the
               capacity) in place of the host-built ones: the tables' part of the difference;
  NAME         each ``--variant NAME=FILE``: a copy of the committed kernel, changed, over the
               received rows as ``scattered``.

``--setting ep1``: ``layer_bench``'s EP = 1 cell instead (``FusedMoE`` over every expert from
``topk_ids``, balanced routing, its own schedule), where each layout row's row of ``x`` is its
token's, top-k layout rows per token: ``in_place`` over the host layout of the tokens repeated
top-k times and moved into place (``layer_bench``'s host-scheduled launch), ``scattered`` over the
tokens themselves (each layout row through its token; FP8: the tokens quantized once),
``device_tables`` the layer's kernel over its tables (routed once), ``device_tiles`` as above,
and ``scales_in_place``: ``scattered``'s rows with ``in_place``'s scales, read by layout row
(``a_rows``' third slot), which separates the rows' gather from the scales'; each variant runs
over those.
Records before 10f58df have no ``scales_in_place``; those of 16615e6 time it as the variant
``scales_by_row`` (a kernel that read the scales by layout row only).

1. Checks first: the cell passes ``kernel_cell.check_cell`` (the committed schedules against the
   references); the workspace's tables equal the host reference
   (``table_reference.table_mismatches``); every launch, its Combine buffers poisoned with NaN
   first, equals ``in_place`` bitwise; spin errors zero. Any failure aborts the run before
   timing; nothing is written.
2. Timing: every kernel in one rotation (``dist_timing.time_methods``, CUDA-graph replays).

One row per (cell, kernel); ``over_in_place`` is ``in_place``'s time over the kernel's, the median
of their per-trial ratios (``dist_timing.paired_ratio``).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

import pandas as pd
import torch

from ...checks import bitwise_equal
from ...cli import list_option
from ...dist_timing import TIMING_METHOD, median_clock_mhz, paired_ratio, time_methods
from ...kernel_sources import load_kernel_module
from ...ops.moe.fused import (DEFAULT_MAX_SPIN_ITERS, KERNEL_ENTRIES, _ws_descriptor,
                              prepare_fused_moe, row_addresses)
from ...ops.moe.table_reference import host_tables, table_mismatches
from ...ops.moe.op import MoEWorkspace
from ...ops.moe.schedules import derived_interleaved_schedule
from ...ops.moe.shapes import PRECISIONS, load_shapes
from ...ops.moe.tiles import kernel_device
from ...ops.moe.weights import local_expert_weights, quantize_rows_fp8
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment, Run
from ..moe import kernel_cell as kc
from ..moe.bench import tolerance_failures
from ..moe.layer_cells import Ep1Cell
from .variants import file_digests, parse_variants

COMMITTED = ("in_place", "scattered", "device_tables", "device_tiles")
EP1_ONLY = ("scales_in_place",)
SCHEDULES = ("wave", "interleaved")
TMA = "tma"
# the committed kernel's tiles, a_rows, row_origin and row_slot arguments
TILES, A_ROWS, ROW_ORIGIN, ROW_SLOT = 0, 3, 4, 14
SETTINGS = ("ep8_rank", "ep1")


def load_kernel_file(path: Path):
    """The Gluon entry point ``moe_fused_ws_kernel`` of a kernel file (a module of its own)."""
    name = f"_moe_gather_variant_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.moe_fused_ws_kernel


def with_rows(args: tuple, a_rows: torch.Tensor, origin: torch.Tensor) -> tuple:
    """The committed kernel's ``args`` with Linear-1's rows ``a_rows`` read through ``origin``."""
    return (*args[:A_ROWS], a_rows, origin, *args[ROW_ORIGIN + 1:])


def with_tiles(args: tuple, tables, schedule: str) -> tuple:
    """The committed kernel's ``args`` with the device tables' tile table of ``schedule``."""
    tiles = tables.tiles[schedule]
    return (tiles, tables.num_tiles[schedule], tiles.shape[1], *args[TILES + 3:])


def tma_arguments(args: tuple, layout) -> tuple:
    """The committed kernel's ``args`` in the contract before the gather: ``a_rows`` and
    ``row_origin`` replaced by a TMA descriptor over the layout's rows (64-row halves), and the
    rows' scales (bf16: the error flag stands in, as ``kernel_launch`` passes) after ``w2_desc``."""
    bk = args[A_ROWS + 3].block_shape[1]  # h_desc's K block
    scale = layout.x_scale if layout.x_scale is not None else args[16]  # the error flag
    return (*args[:A_ROWS], _ws_descriptor(layout.x, [64, bk]), *args[A_ROWS + 2:A_ROWS + 5],
            scale, *args[A_ROWS + 5:])


@dataclasses.dataclass
class GatherStep:
    point: dict
    cell: kc.Cell
    launches: dict   # kernel -> callable
    checked: dict
    failures: list
    workspace: MoEWorkspace  # device_tables' (its error flag is checked with in_place's)
    keep: tuple      # the tensors the launches read through device-held addresses
    combine: torch.Tensor  # the Combine rows every launch stores
    errors: tuple    # the error flags of the launches (spin timeouts)


class MoEGather(Experiment):
    """The committed kernel over rows in place and scattered, beside a TMA kernel and variants."""

    name = "moe_gather_probe"
    paper = "§4.2 the fused kernel's Linear-1 loads; issue 27"
    launch = "in_process"
    links = ("local",)

    def __init__(self, device=None):
        self.device = device

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--setting", choices=SETTINGS, default="ep8_rank")
        p.add_argument("--tma-kernel", type=Path, default=None,
                       help="a kernel file of the contract before the gather (TMA loads of x)")
        p.add_argument("--variant", action="append", default=[],
                       help="NAME=FILE: a changed copy of the committed kernel")
        p.add_argument("--models", **list_option(default=["DiT-MoE", "Qwen3.5", "GLM-5.x"]))
        p.add_argument("--precisions", **list_option(default=list(PRECISIONS)))
        p.add_argument("--routing", **list_option(default=["balanced"]))
        p.add_argument("--tokens", type=int, default=4096, help="tokens per source rank")
        p.add_argument("--schedule", choices=SCHEDULES, default=None,
                       help="the EP rank's schedule (default wave); at EP = 1 the layer's own")
        p.add_argument("--trials", type=int, default=7)
        p.add_argument("--warmup", type=int, default=2)
        p.add_argument("--graph-iters", type=int, default=5)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--max-spin", type=int, default=DEFAULT_MAX_SPIN_ITERS)
        p.set_defaults(kernel="gluon_ws")  # kernel_cell's configuration: the Gluon kernel

    def check_args(self, a: argparse.Namespace) -> None:
        kc.check_cells(load_shapes(), a.models, a.precisions, a.routing, "gluon_ws")
        if a.tokens < 1 or a.trials < 1 or a.graph_iters < 1 or a.warmup < 0:
            raise ValueError("--tokens, --trials and --graph-iters must be >= 1, --warmup >= 0")
        if a.tma_kernel is not None and not a.tma_kernel.is_file():
            raise ValueError(f"--tma-kernel: no file {a.tma_kernel}")
        a.variants = parse_variants(a.variant, (*COMMITTED, *EP1_ONLY, TMA), ".py")
        if a.setting == "ep1":
            if a.routing != ["balanced"] or a.schedule is not None or a.tma_kernel is not None:
                raise ValueError("--setting ep1 takes balanced routing, the layer's own schedule "
                                 "and no --tma-kernel")
        elif a.schedule is None:
            a.schedule = "wave"

    def sweeps(self, args) -> list[Sweep]:
        return [Sweep("moe_gather", (Axis("model", args.models),
                                     Axis("precision", args.precisions),
                                     Axis("routing", args.routing)), repeats=1, warmup=0)]

    def start(self, run: Run) -> None:
        args = run.args
        self.on = kernel_device(self.device, "gluon_ws", "probes.moe_gather")
        self.programs = torch.cuda.get_device_properties(self.on).multi_processor_count
        self.shapes = load_shapes()
        self.kernels = {name: load_kernel_file(path) for name, path in args.variants.items()}
        if args.tma_kernel is not None:
            self.kernels[TMA] = load_kernel_file(args.tma_kernel)

    def prepare(self, point: dict, run: Run) -> GatherStep:
        if run.args.setting == "ep1":
            return self.prepare_ep1(point, run)
        args = run.args
        cell, checked, failures = kc.checked_cell(
            self.shapes[point["model"]], point["precision"], point["routing"], args.tokens, args,
            run, programs=self.programs, device=self.on)
        in_place = cell.calls["wave"]
        if args.schedule == "interleaved":
            in_place = prepare_fused_moe(
                cell.layout, cell.weights,
                derived_interleaved_schedule(cell.problem, self.programs, cell.derived_lead),
                cell.peers, config=cell.cfg, max_spin_iters=args.max_spin)
        lay = cell.layout
        # the received rows in arrival order, each layout row read through its arrival
        x = lay.x[cell.rows]
        x_scale = None if lay.x_scale is None else lay.x_scale[cell.rows]
        origin = torch.full_like(in_place.args[ROW_ORIGIN], -1)
        origin[cell.rows] = torch.arange(len(cell.rows), dtype=origin.dtype, device=origin.device)
        a_rows = row_addresses(x, x_scale)
        scattered = with_rows(in_place.args, a_rows, origin)
        committed = self._committed()

        def launch(kernel, kernel_args):
            return self._launch(in_place, kernel, kernel_args)

        ws, received, mismatches = self.workspace(cell, x, x_scale, args)
        t = ws.tables
        device_tiles = with_tiles(in_place.args, t, args.schedule)
        launches = {"in_place": in_place, "scattered": launch(committed, scattered),
                    "device_tables": lambda: ws.launch(args.schedule, cell.peers),
                    "device_tiles": launch(committed, device_tiles)}
        for name, kernel in self.kernels.items():
            launches[name] = launch(kernel, tma_arguments(in_place.args, lay) if name == TMA
                                    else scattered)
        failures = [*failures, *(f"device table {m} differs from the host reference"
                                 for m in mismatches)]
        return GatherStep(point, cell, launches, checked, failures, ws,
                          (x, x_scale, a_rows, origin, received), cell.combine,
                          (in_place.error, ws.tables.error))

    def prepare_ep1(self, point: dict, run: Run) -> GatherStep:
        """``--setting ep1`` (module docstring): the layer's call checked against the reference,
        its Combine rows kept as the rows every launch must store."""
        args, shape, precision = run.args, self.shapes[point["model"]], point["precision"]
        weights = run.resource((shape.model, precision), lambda: local_expert_weights(
            shape, 0, 1, precision, seed=args.seed, device=self.on))
        cell = Ep1Cell(shape, precision, args.tokens, weights, None, args.seed, self.on)
        errors = cell.output_error(cell.call(), cell.x, cell.ids, cell.w)
        failures = tolerance_failures("fused", errors, precision)
        in_place = cell.host_launch()
        # each layout row's token: its arrival (the host layout's slot) over top_k; padding -1
        slot = in_place.args[ROW_SLOT]
        origin = torch.where(slot >= 0, slot // shape.top_k, -1).to(torch.int32)
        x, x_scale = (quantize_rows_fp8(cell.x) if precision == "fp8" else (cell.x, None))
        a_rows = row_addresses(x, x_scale)
        scattered = with_rows(in_place.args, a_rows, origin)
        # the tokens' rows, in_place's scales read by layout row
        rows_only = in_place.args[A_ROWS].clone()
        rows_only[0], rows_only[2] = x.data_ptr(), 1
        scales_in_place = with_rows(in_place.args, rows_only, origin)
        schedule, t = cell.layer.schedule, cell.ws.tables
        device_tiles = with_tiles(in_place.args, t, schedule)
        launches = {"in_place": in_place,
                    "scattered": self._launch(in_place, self._committed(), scattered),
                    "device_tables": lambda: cell.ws.launch(schedule, cell.layer.peers),
                    "device_tiles": self._launch(in_place, self._committed(), device_tiles),
                    "scales_in_place": self._launch(in_place, self._committed(),
                                                    scales_in_place)}
        for name, kernel in self.kernels.items():
            launches[name] = self._launch(in_place, kernel, scales_in_place)
        checked = {"schedule": schedule, "rows": slot.numel(),
                   **{f"rel_err_{k}": e for k, e in errors.items()}}
        return GatherStep(point, cell, launches, checked, failures, cell.ws,
                          (x, x_scale, a_rows, rows_only, origin, in_place), cell.combined(),
                          (in_place.error, cell.ws.error))

    @staticmethod
    def _committed():
        module, entry = KERNEL_ENTRIES["gluon_ws"]
        return getattr(load_kernel_module(module), entry)

    @staticmethod
    def _launch(in_place, kernel, kernel_args):
        """``kernel`` over ``kernel_args`` as ``in_place`` launches: its counters zeroed first."""
        def run_once():
            in_place.row_ready.zero_()
            kernel[in_place.grid](*kernel_args, **in_place.constexprs)
        return run_once

    def workspace(self, cell: kc.Cell, x: torch.Tensor, x_scale: torch.Tensor | None, args):
        """An ``op.MoEWorkspace`` of ``layer_bench``'s EP rank (capacity ``EP·T·top_k``, the
        cell's programs and lead) routed once over the received rows ``x`` (arrival order), the
        inputs padded to the capacity as a receive buffer is, the count on the device; with its
        inputs and where its tables differ from the host reference."""
        wl = cell.workload
        capacity = kc.EP * wl.slots
        ws = MoEWorkspace(cell.weights, capacity, config=cell.cfg, num_programs=self.programs,
                          lead_rows=cell.derived_lead, max_spin_iters=args.max_spin,
                          source_rows=0)
        received = kc.receive_buffers(wl, x, x_scale, capacity)
        ws.route(**received)
        host = host_tables(ws.bounds, wl.recv_expert, x, x_scale,
                           arrival_src=kc.arrival_sources(wl), arrival_slot=wl.recv_slot)
        return ws, received, table_mismatches(ws.tables, host)

    def check(self, step: GatherStep, run: Run) -> list[str]:
        failures, combine = list(step.failures), step.combine
        # at EP = 1 the layer's call stored the rows every launch must store; else in_place's
        want = combine.clone() if run.args.setting == "ep1" else None
        if want is None:
            combine.fill_(float("nan"))
            step.launches["in_place"]()
            want = combine.clone()
        for name, launch in step.launches.items():
            combine.fill_(float("nan"))
            launch()
            if not bitwise_equal(combine, want):
                failures.append(f"{name}: Combine rows differ from in_place's")
        errors = sum(int(e) for e in step.errors)
        if errors:
            failures.append(f"spin errors {errors}")
        step.checked["gather_spin_errors"] = errors
        return failures

    def measure(self, step: GatherStep, run: Run) -> pd.DataFrame:
        args, cell = run.args, step.cell
        timing = time_methods(step.launches, trials=args.trials, warmup=args.warmup,
                              graph_iters=args.graph_iters, clocks=True)
        base = timing["in_place"]["trials_us"]
        ep1 = args.setting == "ep1"
        return pd.DataFrame([{
            "model": cell.shape.model, "precision": cell.precision,
            "routing": "balanced" if ep1 else cell.routing, "setting": args.setting,
            "tokens": args.tokens, "schedule": step.checked["schedule"] if ep1 else args.schedule,
            "kernel": name, "rows": step.checked["rows"] if ep1 else cell.problem.num_rows,
            "num_programs": self.programs, "us": t["median_us"],
            "p25_us": t["p25_us"], "p75_us": t["p75_us"],
            "over_in_place": paired_ratio(base, t["trials_us"]),
            "sm_clock_mhz": median_clock_mhz(t),
            "trials_us": t["trials_us"],
            **{k: v for k, v in step.checked.items() if not isinstance(v, dict)}}
            for name, t in timing.items()])

    def progress_line(self, rows) -> str | None:
        r = rows.set_index("kernel")["over_in_place"].round(3).to_dict()
        first = rows.iloc[0]
        return f"{first['model']:10s} {first['precision']} {first['routing']:8s} {r}"

    def metadata(self, run: Run) -> dict:
        args = run.args
        files = dict(args.variants)
        if args.tma_kernel is not None:
            files[TMA] = args.tma_kernel
        ep1 = EP1_ONLY if args.setting == "ep1" else ()
        return {"kernels": [*COMMITTED, *ep1, *files], "files": file_digests(files),
                "workload": (f"EP = 1, {args.tokens} tokens, balanced routing, the layer's "
                             "own schedule" if args.setting == "ep1" else
                             f"one rank (rank {kc.RANK}) of EP = {kc.EP} on one GPU, every "
                             f"Combine store local, schedule {args.schedule}"),
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                         if k != "variants"},
                "timing": f"{TIMING_METHOD}; {args.graph_iters} calls per trial, CUDA-graph "
                          "replays"}


EXPERIMENT = MoEGather()


if __name__ == "__main__":
    harness.main(EXPERIMENT)
