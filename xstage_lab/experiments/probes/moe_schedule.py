"""Schedule probe of the fused MoE kernel: where Interleaved loses to Expert-Wave with every
Combine store local (issue 26 item 3; record ``moe_schedule_probe``).

    python -m xstage_lab.experiments.probes.moe_schedule (--out FILE | --root DIR)
        [--models M ...] [--precisions bf16 fp8] [--routing balanced skewed] [--tokens 4096]
        [--trials N]

The local sweep (``moe_host`` with host share 0) at 766434e had Interleaved, both its streams
then dealt with stride G, below 0.98 of Expert-Wave's speed on DiT-MoE at every lead, although
the tile-table simulator, fed each schedule's traced per-tile times, played both at the same
makespan. This probe times schedules that separate the candidate causes, all of the same tiles
and the same launch, on ``kernel_cell``'s workload (one rank of EP = 8, every store local, the
seeds of ``host_bench``); what its records found is in their README:

  wave                   Expert-Wave as committed (waves by counted rows);
  wave_one               Expert-Wave in one wave: every Linear-1 tile, then every Linear-2 tile,
                         one stream dealt with stride G (what waves per expert buy);
  interleaved            Interleaved at the derived lead (``schedules.derived_lead``, counted
                         as ``schedules.leads_from_expert`` says: FusedMoE's schedule), its
                         Linear-1 stream dealt by work (``schedules.l1_deal``);
  interleaved_strided    the same with both streams dealt with stride G (Algorithm 1 as the
                         paper states it): some programs then hold both an extra Linear-1 and an
                         extra Linear-2 tile, which sets the makespan where a Linear-2 tile costs
                         several Linear-1 tiles (DiT-MoE: K = 5632 against 1408);
  interleaved_l1_first   Interleaved at D = the rows: each program's Linear-1 tiles before its
                         Linear-2 ones (separate streams against ``wave_one``'s one);
  interleaved_expert_lead
                         Interleaved at the derived lead counted from the last row of each
                         Linear-2 tile's expert (``expert_lead``): an expert's Linear-2 tiles,
                         which read its W2, come due together, where the row lead spreads them
                         over the expert's rows as Linear-1 completes them (DiT-MoE bf16 read
                         68% more from DRAM than Expert-Wave at the derived lead: ``moe_ncu``);
  interleaved_d<D>       Interleaved at each lead D of ``--leads``, counted as ``interleaved``
                         (the lead's cost on its own).

1. Checks first: every schedule passes ``schedules.check_schedule``; the cell passes
   ``kernel_cell.check_cell`` (both committed schedules against the references); every launch,
   its Combine buffers poisoned with NaN first, equals the Expert-Wave result bitwise; spin errors
   zero. Any failure aborts the run before timing; nothing is written.
2. Timing: all schedules in one rotation (``dist_timing.time_methods``, CUDA-graph replays).
3. One instrumented launch per schedule (``trace_summary``): the makespan, the spread of the
   programs' end times, their busy time, mean and median mainloops per tile kind, the idle time
   between a program's tiles per transition kind, and the Linear-2 mainloops split by how many
   Linear-1 mainloops ran beside them.
4. ``--profile``: after the checks, one launch per schedule, in the order of the record's rows,
   between ``cudaProfilerStart`` and ``cudaProfilerStop``, so that
   ``ncu --profile-from-start off`` profiles exactly those (hardware counters at a locked clock).

One row per (cell, schedule); ``over_wave`` is Expert-Wave's time over the schedule's.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ...checks import bitwise_equal
from ...cli import list_option
from ...dist_timing import TIMING_METHOD, median_clock_mhz, time_methods
from ...ops.moe.fused import DEFAULT_MAX_SPIN_ITERS, prepare_fused_moe
from ...ops.moe.schedules import (L1, L2, MoEProblem, Schedule, check_schedule,
                                  derived_interleaved_schedule,
                                  expert_wave_schedule, interleaved_schedule)
from ...ops.moe.shapes import PRECISIONS, ROUTINGS, load_shapes
from ...ops.moe.tiles import KERNELS, kernel_device
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment, Run
from ..moe import kernel_cell as kc
from ..moe.kernel_rows import traced_tiles

SCHEDULES = ("wave", "wave_one", "interleaved", "interleaved_strided", "interleaved_l1_first",
             "interleaved_expert_lead")
# A Linear-2 mainloop counts as "beside Linear-1" where at least this share of the other busy
# programs ran a Linear-1 mainloop at its midpoint.
MIXED_SHARE = 0.25


def probe_schedules(problem: MoEProblem, num_programs: int, lead: int,
                    leads=()) -> dict[str, Schedule]:
    """The probe's schedules (``SCHEDULES``, then ``interleaved_d<D>`` for each of ``leads``),
    each checked launchable."""
    out = {"wave": expert_wave_schedule(problem, num_programs),
           "wave_one": expert_wave_schedule(problem, num_programs,
                                            experts_per_wave=len(problem.blocks_per_expert)),
           "interleaved": derived_interleaved_schedule(problem, num_programs, lead),
           "interleaved_strided": interleaved_schedule(problem, num_programs, lead,
                                                       by_work=False),
           "interleaved_l1_first": interleaved_schedule(problem, num_programs,
                                                        max(1, problem.num_rows)),
           "interleaved_expert_lead": interleaved_schedule(problem, num_programs, lead,
                                                           expert_lead=True)}
    for d in leads:
        out[f"interleaved_d{d}"] = derived_interleaved_schedule(problem, num_programs, d)
    for s in out.values():
        check_schedule(problem, s)
    return out


def trace_summary(tiles: pd.DataFrame) -> dict:
    """Where one instrumented launch's time went (``moe_trace.tile_frame`` rows)."""
    out = {"trace_makespan_us": float(tiles["t3_us"].max())}
    by_program = tiles.groupby("program")
    end = by_program["t3_us"].max()
    busy = by_program.apply(lambda p: float((p["t3_us"] - p["t1_us"]).sum()))
    out.update({"program_end_min_us": float(end.min()), "program_end_median_us": float(end.median()),
                "program_busy_mean_us": float(busy.mean()), "program_busy_max_us": float(busy.max()),
                "wait_l2_total_us": float(tiles.loc[tiles["kind"] == L2, "wait_us"].sum())})
    for kind, name in ((L1, "l1"), (L2, "l2")):
        m = tiles.loc[tiles["kind"] == kind, "mainloop_us"]
        out[f"mainloop_{name}_mean_us"] = float(m.mean())
        out[f"mainloop_{name}_median_us"] = float(m.median())
        out[f"epilogue_{name}_mean_us"] = float(tiles.loc[tiles["kind"] == kind, "span_us"].mean())
    # Idle time between a program's consecutive tiles (end of one, start of the next), per
    # transition: a cost of switching tile kinds shows as L1->L2 / L2->L1 above L1->L1.
    ordered = tiles.sort_values(["program", "position"])
    same = ordered["program"].to_numpy()[1:] == ordered["program"].to_numpy()[:-1]
    idle = ordered["t0_us"].to_numpy()[1:] - ordered["t3_us"].to_numpy()[:-1]
    kinds = ordered["kind"].to_numpy()
    for a, b, name in ((L1, L1, "l1_l1"), (L1, L2, "l1_l2"), (L2, L1, "l2_l1"), (L2, L2, "l2_l2")):
        sel = same & (kinds[:-1] == a) & (kinds[1:] == b)
        out[f"idle_{name}_mean_us"] = float(idle[sel].mean()) if sel.any() else math.nan
        out[f"transitions_{name}"] = int(sel.sum())
    # Linear-1 and Linear-2 mainloops running at each Linear-2 mainloop's midpoint.
    mid = ((tiles["t1_us"] + tiles["t2_us"]) / 2)[tiles["kind"] == L2].to_numpy()
    running = {}
    for kind in (L1, L2):
        k = tiles[tiles["kind"] == kind]
        running[kind] = (np.searchsorted(np.sort(k["t1_us"].to_numpy()), mid, side="right")
                         - np.searchsorted(np.sort(k["t2_us"].to_numpy()), mid, side="right"))
    share = running[L1] / np.maximum(1, running[L1] + running[L2])
    l2 = tiles.loc[tiles["kind"] == L2, "mainloop_us"].to_numpy()
    mixed = share >= MIXED_SHARE
    out.update({"l2_beside_l1_tiles": int(mixed.sum()),
                "mainloop_l2_beside_l1_mean_us": float(l2[mixed].mean()) if mixed.any() else math.nan,
                "mainloop_l2_alone_mean_us": float(l2[~mixed].mean()) if (~mixed).any() else math.nan})
    return out


@dataclasses.dataclass
class ScheduleStep:
    point: dict
    cell: kc.Cell
    lead: int
    schedules: dict
    calls: dict
    checked: dict
    failures: list


class MoESchedule(Experiment):
    """Schedules of the same tiles timed and traced together, every store local."""

    name = "moe_schedule_probe"
    paper = "§4.2 Algorithm 1 against Expert-Wave with nothing to overlap; issue 26 item 3"
    launch = "in_process"
    links = ("local",)

    def __init__(self, device=None):
        self.device = device

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--models", **list_option(default=["DiT-MoE", "Hy3"]))
        p.add_argument("--precisions", **list_option(default=list(PRECISIONS)))
        p.add_argument("--routing", **list_option(default=list(ROUTINGS)))
        p.add_argument("--tokens", type=int, default=4096, help="tokens per source rank")
        p.add_argument("--kernel", default="gluon_ws", help=f"one of {list(KERNELS)}")
        p.add_argument("--trials", type=int, default=7)
        p.add_argument("--warmup", type=int, default=2)
        p.add_argument("--graph-iters", type=int, default=5)
        p.add_argument("--programs", type=int, default=None, help="default: the GPU's SMs")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--max-spin", type=int, default=DEFAULT_MAX_SPIN_ITERS)
        p.add_argument("--leads", **list_option(int, default=[],
                                                help="Interleaved leads timed beside the rest"))
        p.add_argument("--profile", action="store_true",
                       help="one launch per schedule between cudaProfilerStart/Stop")

    def check_args(self, a: argparse.Namespace) -> None:
        kc.check_cells(load_shapes(), a.models, a.precisions, a.routing, a.kernel)
        if a.tokens < 1 or a.trials < 1 or a.graph_iters < 1 or a.warmup < 0:
            raise ValueError("--tokens, --trials and --graph-iters must be >= 1, --warmup >= 0")
        if any(d < 1 for d in a.leads):
            raise ValueError(f"--leads {a.leads}: each must be >= 1 (D = 0 can self-deadlock)")

    def sweeps(self, args) -> list[Sweep]:
        return [Sweep("moe_schedule", (Axis("model", args.models),
                                       Axis("precision", args.precisions),
                                       Axis("routing", args.routing)), repeats=1, warmup=0)]

    def start(self, run: Run) -> None:
        self.on = kernel_device(self.device, run.args.kernel, "probes.moe_schedule")
        self.programs = (run.args.programs
                         or torch.cuda.get_device_properties(self.on).multi_processor_count)
        self.shapes = load_shapes()

    def prepare(self, point: dict, run: Run) -> ScheduleStep:
        args = run.args
        cell, checked, failures = kc.checked_cell(
            self.shapes[point["model"]], point["precision"], point["routing"], args.tokens, args,
            run, programs=self.programs, device=self.on)
        lead = cell.derived_lead
        schedules = probe_schedules(cell.problem, self.programs, lead, args.leads)
        calls = {name: prepare_fused_moe(cell.layout, cell.weights, s, cell.peers, config=cell.cfg,
                                         max_spin_iters=args.max_spin)
                 for name, s in schedules.items()}
        return ScheduleStep(point, cell, lead, schedules, calls, checked, failures)

    def check(self, step: ScheduleStep, run: Run) -> list[str]:
        failures, cell = list(step.failures), step.cell
        cell.combine.fill_(float("nan"))
        step.calls["wave"]()
        want = cell.combine.clone()
        spin = {}
        for name, call in step.calls.items():
            cell.combine.fill_(float("nan"))
            call()
            spin[name] = call.error_count()
            if not bitwise_equal(cell.combine, want):
                failures.append(f"{name}: Combine rows differ from Expert-Wave's")
        if any(spin.values()):
            failures.append(f"spin errors {spin}")
        step.checked["schedule_spin_errors"] = spin
        return failures

    def measure(self, step: ScheduleStep, run: Run) -> pd.DataFrame:
        args, cell = run.args, step.cell
        if args.profile:
            for call in step.calls.values():
                torch.cuda.synchronize(self.on)
                torch.cuda.cudart().cudaProfilerStart()
                call()
                torch.cuda.synchronize(self.on)
                torch.cuda.cudart().cudaProfilerStop()
        timing = time_methods(step.calls, trials=args.trials, warmup=args.warmup,
                              graph_iters=args.graph_iters, clocks=True)
        traced = dataclasses.replace(cell, calls=step.calls)
        rows = []
        for name, s in step.schedules.items():
            t = timing[name]
            counts = [(sum(x.kind == L1 for x in p), sum(x.kind == L2 for x in p))
                      for p in s.programs]
            rows.append({
                "model": cell.shape.model, "precision": cell.precision, "routing": cell.routing,
                "tokens": args.tokens, "schedule": name, "rows": cell.problem.num_rows,
                "l1_n_blocks": cell.problem.l1_n_blocks, "l2_n_blocks": cell.problem.l2_n_blocks,
                "num_programs": self.programs, "lead_rows": s.lead_rows, "d_knee": cell.knee,
                "us": t["median_us"], "p25_us": t["p25_us"], "p75_us": t["p75_us"],
                "over_wave": timing["wave"]["median_us"] / t["median_us"],
                "sm_clock_mhz": median_clock_mhz(t),
                "trials_us": t["trials_us"],
                "l1_tiles_max": max(c[0] for c in counts), "l2_tiles_max": max(c[1] for c in counts),
                **trace_summary(traced_tiles(traced, name)),
                **{k: v for k, v in step.checked.items() if not isinstance(v, dict)},
                "spin_errors": sum(step.checked["schedule_spin_errors"].values())})
        return pd.DataFrame(rows)

    def progress_line(self, rows) -> str | None:
        r = rows.set_index("schedule")["over_wave"].round(3).to_dict()
        first = rows.iloc[0]
        return f"{first['model']:10s} {first['precision']} {first['routing']:8s} {r}"

    def metadata(self, run: Run) -> dict:
        args = run.args
        return {"schedules": list(SCHEDULES), "workload": f"one rank (rank {kc.RANK}) of EP = "
                f"{kc.EP} on one GPU, every Combine store local",
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "mixed_share": MIXED_SHARE,
                "timing": f"{TIMING_METHOD}; {args.graph_iters} calls per trial, CUDA-graph "
                          "replays"}


EXPERIMENT = MoESchedule()


if __name__ == "__main__":
    harness.main(EXPERIMENT)
