"""The fused MoE kernel with its Combine into host memory: the X-Stage, its backpressure and the
paper's remedy measured on one GPU over the host link (issue 26 item 2; paper §4.2, §5.2, Table 2
and Figs. 8–10 on the host link).

    python -m xstage_lab.experiments.moe.host_bench (--out FILE.json | --root DIR)
        [--models M ...] [--precisions bf16 fp8] [--routing balanced skewed] [--tokens 4096]
        [--host-shares 1 2 4 8] [--trials N] [--tune-trials N] [--no-trace]

The workload is ``kernel_bench``'s (``kernel_cell``): one rank (rank 0) of EP = 8 on one GPU,
every row the eight source ranks route to its experts. The host-share dial h: the Combine buffers
of source ranks 0 .. h − 1 are pinned host memory (torch's pinned allocator, mapped under unified
addressing: the buffer's host address is its device address, checked), the other 8 − h stay in
local HBM (``host_combine_peers``). The kernel runs unchanged; its Combine stores to the first
h sources cross PCIe as posted writes and drain after the consumer warpgroups move on.

First the forecast: the run refuses to start without this platform's ``moe_host_forecast``
record (``python -m xstage_lab.experiments.moe.host_forecast <gpu>-host --root data/records``:
the Burst–Gap model on the host link's calibration and the one-GPU kernel record's per-tile
times), and its record names that forecast and copies its prediction into each row.

Per cell (model, precision, routing, tokens) and host share h, on fresh seeded activations:

1. Correctness first. ``kernel_cell.check_cell`` on the all-local launches (both schedules
   bitwise equal, no stray rows, within tolerance of the float32 and quantization-matched
   references, spin errors zero); then every launch this point times into host memory, its host
   and device buffers poisoned with NaN first, runs once and its eight Combine buffers (the host
   ones read back) must equal the all-local Expert-Wave result bitwise. Any failure aborts the
   run before timing; nothing is written.
2. Timing (``dist_timing.time_methods``: events, warm-up, median and p25/p75 over trials, order
   rotated per trial, SM clock per trial) of ``methods``: Expert-Wave with the host share, the
   local control (every store local), the fenced Expert-Wave (each Linear-2 tile waits until its
   stores are visible system-wide: the completion-coupled world), Interleaved at each lead of
   ``leads`` (the D sweep: eq. 16's D_knee, the lead that also covers the Linear-2 stream's
   skew, and multiples), Interleaved at that lead with every store local, and ``auto``: of the
   schedules the forecast predicts within ``host_forecast.AUTO_TUNE_MARGIN`` of its fastest, the
   one a tuning pass over the sweep's own launches (``--tune-trials`` trials, before the cell's
   timing) finds fastest by paired trials, as a launch of its own (the forecast's own pick,
   ``pick_auto``, is ``auto_forecast_lead``; ``auto_tune_ms`` what the tuning cost). After the
   last timed replay the harness runs step 1 again (``Experiment.recheck``): the launches'
   spin-error flags count every run since they were prepared, so an error during timing aborts
   the run with nothing written.
3. Per-tile traces of Expert-Wave and Interleaved with the host share (``kernel_rows.
   trace_columns``): Linear-2 spans, mainloops and G_wave.

``measured_stall_us`` is Expert-Wave's time over the local control's per Linear-2 burst of a
program; ``measured_speedup`` Expert-Wave's time over Interleaved's at the derived lead.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import pandas as pd
import torch

from ...analysis.moe.forecast import HOST_SHARE_SOURCES
from ...analysis.moe.host_view import HostView, latest_host_view
from ...checks import bitwise_equal
from ...cli import list_option
from ...dist_timing import TIMING_METHOD, paired_ratio, time_methods
from ...ops.moe.combine import host_combine_peers
from ...ops.moe.fused import DEFAULT_MAX_SPIN_ITERS, prepare_fused_moe
from ...ops.moe.schedules import (L2, Schedule, expert_wave_schedule,
                                  derived_interleaved_schedule, LEAD_MULTIPLES,
                                  lead_sweep)
from ...ops.moe.shapes import PRECISIONS, ROUTINGS, load_shapes
from ...ops.moe.tiles import KERNELS, kernel_device
from ...records import RECORDS_DIR
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment, Run
from . import kernel_cell as kc
from .bench import TOLERANCE
from .host_forecast import AUTO_TUNE_MARGIN, schedule_lead, tune_candidates
from .kernel_rows import cell_row_base, trace_columns

DEFAULT_TOKENS = (4096,)
DEFAULT_SHARES = (1, 2, 4, 8)
# The launches whose every Combine store is local: they leave the host buffers alone.
LOCAL = frozenset({"wave_local", "interleaved_local"})


@dataclasses.dataclass
class HostStep:
    """One point: the all-local cell, the host buffers and the launches into them."""

    point: dict
    cell: kc.Cell
    host: list                 # the first h sources' pinned host Combine buffers
    lead: int                  # the derived lead (schedules.derived_lead)
    wave: Schedule             # the Expert-Wave schedule
    calls: dict                # method name -> launch (see the module docstring, step 2)
    tuned: dict                # auto's candidates: schedule name -> a launch of its own
    checked: dict              # the all-local cell's check columns
    base_failures: list        # and its failures


class MoEHost(Experiment):
    """The fused MoE kernel with Combine into host memory (issue 26 item 2)."""

    name = "moe_host"
    paper = "§4.2, §5.2, Table 2, Figs. 8-10 on the host link; issue 26 item 2"
    launch = "in_process"
    optional = True  # a platform without a host-link run shows nothing of it
    in_measure_all = True
    links = ("host",)

    @classmethod
    def analyse(cls, record, root: Path) -> HostView:
        return HostView(record.platform, (record,))

    @classmethod
    def analyse_platform(cls, platform: str, root: Path) -> HostView:
        """The records of the platform's latest run, its chunks joined (``latest_host_view``)."""
        return latest_host_view(platform, root)

    def __init__(self, device=None):
        self.device = device  # None: this process's CUDA GPU

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        shapes = load_shapes()
        p.add_argument("--models", **list_option(help=f"default: all of {list(shapes)}"))
        p.add_argument("--precisions", **list_option(default=list(PRECISIONS)))
        p.add_argument("--routing", **list_option(default=list(ROUTINGS)))
        p.add_argument("--tokens", **list_option(int, default=list(DEFAULT_TOKENS),
                                                 help="tokens per source rank"))
        p.add_argument("--host-shares", **list_option(
            int, default=list(DEFAULT_SHARES), help=f"source ranks (of {HOST_SHARE_SOURCES}) "
                                                    "whose Combine buffers are pinned host memory"))
        p.add_argument("--lead-multiples", **list_option(
            int, default=list(LEAD_MULTIPLES), help="the D sweep: D_knee and the derived lead "
                                                    "times each of these"))
        p.add_argument("--kernel", default="gluon_ws", help=f"one of {list(KERNELS)}")
        p.add_argument("--trials", type=int, default=9)
        p.add_argument("--tune-trials", type=int, default=5,
                       help="trials of the tuning pass that picks auto")
        p.add_argument("--warmup", type=int, default=2)
        p.add_argument("--graph-iters", type=int, default=5)
        p.add_argument("--programs", type=int, default=None)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--max-spin", type=int, default=DEFAULT_MAX_SPIN_ITERS)
        p.add_argument("--no-trace", dest="trace", action="store_false")

    def check_args(self, a: argparse.Namespace) -> None:
        shapes = load_shapes()
        a.models = list(shapes) if a.models is None else a.models
        kc.check_cells(shapes, a.models, a.precisions, a.routing, a.kernel)
        bad = [h for h in a.host_shares if not 0 <= h <= HOST_SHARE_SOURCES]
        if bad:
            raise ValueError(f"--host-shares {bad}: a host share is 0..{HOST_SHARE_SOURCES} "
                             "source ranks")
        if min(a.lead_multiples) < 1:
            raise ValueError(f"--lead-multiples {a.lead_multiples}: each must be >= 1")
        if min(a.tokens) < 1 or min(a.trials, a.tune_trials, a.graph_iters) < 1 or a.warmup < 0:
            raise ValueError("--tokens, --trials, --tune-trials and --graph-iters must be >= 1, "
                             "--warmup >= 0")
        if len(a.tokens) != 1:
            raise ValueError(f"--tokens {a.tokens}: one token count per run, the one its "
                             "forecast (a moe_host_forecast record) covers")

    def measure_all_args(self, written, root) -> list[str]:
        """The settings of the committed run (its two chunks ran 186 s and 223 s on one H200)."""
        return ["--warmup", "1", "--graph-iters", "3"]

    def before(self, args: argparse.Namespace, root: Path) -> list[Path]:
        """The forecast this run tests, written first (``host_forecast.write``): from this GPU's
        latest one-GPU kernel record and its host link's latest calibration under ``root``."""
        from ...loading import record_paths
        from ...platform import LOCAL, platform_name
        from .host_forecast import write

        kernel = platform_name(link=LOCAL)
        if not record_paths("moe_kernel", kernel, root):
            raise ValueError(f"the host-link forecast reads this GPU's one-GPU kernel record and "
                             f"{root} has no moe_kernel record of {kernel}: measure it first "
                             "(python -m xstage_lab run moe_kernel, or --backend cuda)")
        return [write(kernel, platform_name(link="host"), args.tokens[0], root)]

    def sweeps(self, args) -> list[Sweep]:
        """Model and precision outermost (their weights made once), the host share innermost (a
        cell's workload and schedules made once for its shares)."""
        return [Sweep("moe_host", (Axis("model", args.models), Axis("precision", args.precisions),
                                   Axis("routing", args.routing), Axis("tokens", args.tokens),
                                   Axis("host_share", args.host_shares)), repeats=1, warmup=0)]

    def start(self, run: Run) -> None:
        """This GPU, its programs, and the forecast this run tests (refused where none exists)."""
        from ...platform import platform_name
        from ...loading import latest as latest_record

        self.on = kernel_device(self.device, run.args.kernel, "moe.host_bench")
        self.platform = platform_name(link="host") if self.on.type == "cuda" else "cpu-host"
        try:
            forecast = latest_record("moe_host_forecast", self.platform,
                                     run.args.root or RECORDS_DIR)
        except FileNotFoundError:
            raise SystemExit(f"no moe_host_forecast record of {self.platform}: write the forecast "
                             f"first (python -m xstage_lab.experiments.moe.host_forecast "
                             f"{self.platform} --root data/records)") from None
        self.forecast_id = f"moe_host_forecast/{self.platform}/{forecast.record_id}"
        self.forecast = forecast.table.set_index(["model", "precision", "routing", "tokens",
                                                  "host_share"])
        self.programs = (run.args.programs
                         or torch.cuda.get_device_properties(self.on).multi_processor_count)
        self.shapes = load_shapes()
        self._cell = (None, None)
        self.tile_configs: dict = {}

    def _base_cell(self, point: dict, run: Run) -> kc.Cell:
        """The all-local cell of the point's (model, precision, routing, tokens), checked once."""
        key = tuple(point[k] for k in ("model", "precision", "routing", "tokens"))
        if self._cell[0] != key:
            shape, precision = self.shapes[point["model"]], point["precision"]
            self._cell = (None, None)  # the last cell's buffers go before this one's are made
            checked = kc.checked_cell(shape, precision, point["routing"], point["tokens"],
                                      run.args, run, programs=self.programs, device=self.on)
            self.tile_configs.setdefault(shape.model, {})[precision] = \
                dataclasses.asdict(checked[0].cfg)
            self._cell = (key, checked)
        return self._cell[1]

    def prepare(self, point: dict, run: Run) -> HostStep:
        cell, checked, failures = self._base_cell(point, run)
        h, args = point["host_share"], run.args
        slots, hidden = cell.workload.slots, cell.shape.hidden
        host = [torch.empty((slots, hidden), dtype=torch.bfloat16,
                            pin_memory=self.on.type == "cuda") for _ in range(h)]
        peers = host_combine_peers(cell.combine, host)
        lead = cell.derived_lead

        def launch(schedule, peers_=peers, fence=False):
            return prepare_fused_moe(cell.layout, cell.weights, schedule, peers_,
                                     config=cell.cfg, max_spin_iters=args.max_spin, fence=fence)

        schedules = {d: derived_interleaved_schedule(cell.problem, self.programs, d)
                     for d in lead_sweep(cell.knee, lead, args.lead_multiples)}
        wave = expert_wave_schedule(cell.problem, self.programs)
        auto = self._auto_lead(point)
        if auto:  # a lead outside the sweep
            schedules.setdefault(auto, derived_interleaved_schedule(cell.problem, self.programs,
                                                                    auto))
        calls = {"wave": launch(wave), "wave_local": cell.calls["wave"],
                 "wave_fenced": launch(wave, fence=True),
                 **{f"interleaved_d{d}": launch(s) for d, s in schedules.items()},
                 "interleaved_local": launch(schedules[lead], cell.peers)}
        tuned = {name: launch(schedules[schedule_lead(name)] if schedule_lead(name) else wave)
                 for name in self._candidates(point, calls)}
        return HostStep(point, cell, host, lead, wave, calls, tuned, dict(checked), failures)

    def _forecast_row(self, point: dict) -> dict | None:
        """The forecast's row of the point; None below host share 1 or where the forecast
        record picks no schedule."""
        if point["host_share"] < 1 or "auto_schedule" not in self.forecast:
            return None
        return self.forecast.loc[tuple(point[k] for k in ("model", "precision", "routing",
                                                          "tokens", "host_share"))].to_dict()

    def _auto_lead(self, point: dict) -> int | None:
        """The schedule the forecast picks for the point (``host_forecast``'s
        ``auto_schedule``): 0 for Expert-Wave, else Interleaved's lead; None where it picks
        none."""
        row = self._forecast_row(point)
        return None if row is None else schedule_lead(row["auto_schedule"])

    def _candidates(self, point: dict, calls: dict) -> list[str]:
        """The schedules ``auto`` is tuned among (``tune_candidates`` of the forecast's
        predictions for the schedules ``calls`` holds); none where the forecast picks none."""
        row = self._forecast_row(point)
        if row is None:
            return []
        schedules = ["wave", *(n for n in calls if n.startswith("interleaved_d"))]
        return tune_candidates({n: row[f"tile_{n}_us"] for n in schedules
                                if pd.notna(row.get(f"tile_{n}_us"))})

    def check(self, step: HostStep, run: Run) -> list[str]:
        """Step 1 of the module docstring."""
        failures = list(step.base_failures)
        if step.cell.workload.rows == 0:
            return ["no row routed to rank 0's experts"]
        cell = step.cell
        cell.combine.fill_(float("nan"))
        cell.calls["wave"]()
        want = cell.combine.clone()
        spin = {}
        tuned = {f"auto[{n}]": call for n, call in step.tuned.items()}
        for name, call in {**step.calls, **tuned}.items():
            if cell.combine.is_cuda:  # nothing of the last launch or read-back still runs
                torch.cuda.synchronize()
            cell.combine.fill_(float("nan"))
            for b in step.host:
                b.fill_(float("nan"))
            call()
            spin[name] = call.error_count()
            got = cell.combine.clone()
            for r, b in enumerate([] if name in LOCAL else step.host):
                got[r] = b.to(cell.combine.device)  # read back from host memory
            if not bitwise_equal(got, want):
                failures.append(f"{name}: Combine rows differ from the all-local Expert-Wave's")
        if any(spin.values()):
            failures.append(f"spin errors {spin}")
        step.checked["host_spin_errors"] = spin
        return failures

    def measure(self, step: HostStep, run: Run) -> dict:
        args, cell, p = run.args, step.cell, step.point
        auto, tuning = self._tune(step, args)
        methods = {**step.calls, **({"auto": step.tuned[auto]} if auto else {})}
        timing = time_methods(methods, trials=args.trials, warmup=args.warmup,
                              graph_iters=args.graph_iters, clocks=True)
        us = {name: t["median_us"] for name, t in timing.items()}
        cols = {f"{name}_{q}": timing[name][k] for name in timing
                for q, k in (("us", "median_us"), ("p25_us", "p25_us"), ("p75_us", "p75_us"))}
        clocks = [c for t in timing.values() for c in t.get("sm_clock_mhz", []) if c is not None]
        traced = {}
        if args.trace:
            traced = trace_columns(dataclasses.replace(
                cell, calls={"wave": step.calls["wave"],
                             "interleaved": step.calls[f"interleaved_d{step.lead}"]},
                peers=host_combine_peers(cell.combine, step.host)))
        best = min((n for n in us if n.startswith("interleaved_d")), key=us.get)
        forecast = self.forecast.loc[(p["model"], p["precision"], p["routing"], p["tokens"],
                                      p["host_share"])].to_dict() \
            if p["host_share"] >= 1 else {}
        programs = step.wave.programs
        l2_bursts = sum(t.kind == L2 for prog in programs for t in prog) / len(programs)
        return {**cell_row_base(cell), "host_share": p["host_share"],
                "lead_rows": step.lead,
                "leads": lead_sweep(cell.knee, step.lead, args.lead_multiples), **cols,
                "interleaved_us": us[f"interleaved_d{step.lead}"],
                "auto_lead": None if auto is None else schedule_lead(auto),
                "auto_us": us.get("auto"),
                "auto_forecast_lead": self._auto_lead(p), **tuning,
                "interleaved_best": best, "interleaved_best_us": us[best],
                "measured_stall_us": (us["wave"] - us["wave_local"]) / l2_bursts,
                "measured_speedup": us["wave"] / us[f"interleaved_d{step.lead}"],
                "local_interleaved_over_wave": us["wave_local"] / us["interleaved_local"],
                "sm_clock_mhz_min": min(clocks) if clocks else None,
                "trials_us": {n: t["trials_us"] for n, t in timing.items()},
                **step.checked, **traced,
                **{f"forecast_{k}": v for k, v in forecast.items()
                   if k in FORECAST_COLUMNS}}

    def _tune(self, step: HostStep, args) -> tuple[str | None, dict]:
        """``auto``'s pick: the fastest candidate in a timing of the sweep's own launches of
        them (one candidate: it, untimed), by the median of its per-trial ratios to the first
        candidate (``paired_ratio``: a clock step between trials moves every candidate of a
        trial together), and the columns that say so: the candidates' median times
        (``auto_tune_us``) and the tuning's host wall time (``auto_tune_ms``)."""
        names = list(step.tuned)
        if len(names) < 2:
            return (names[0] if names else None), {"auto_candidates": names,
                                                   "auto_tune_us": None, "auto_tune_ms": None}
        start = time.perf_counter()
        timing = time_methods({n: step.calls[n] for n in names}, trials=args.tune_trials,
                              warmup=args.warmup, graph_iters=args.graph_iters)
        first = timing[names[0]]["trials_us"]
        paired = {n: paired_ratio(timing[n]["trials_us"], first) for n in names}
        tuned = {n: timing[n]["median_us"] for n in names}
        return min(paired, key=paired.get), {
            "auto_candidates": names, "auto_tune_us": tuned,
            "auto_tune_ms": (time.perf_counter() - start) * 1e3}

    def progress_line(self, rows) -> str | None:
        r = rows.iloc[0]
        return (f"{r['model']:18s} {r['precision']:4s} {r['routing']:8s} h={r['host_share']}  "
                f"wave {r['wave_us']:8.1f} us  local {r['wave_local_us']:8.1f}  interleaved "
                f"{r['interleaved_us']:8.1f} (best {r['interleaved_best']} "
                f"{r['interleaved_best_us']:.1f})  fenced {r['wave_fenced_us']:8.1f}")

    def metadata(self, run: Run) -> dict:
        args = run.args
        return {"link": "host", "forecast_record": self.forecast_id,
                "workload": f"one rank (rank {kc.RANK}) of EP = {kc.EP} on one GPU; the Combine "
                            "buffers of source ranks 0..h-1 pinned host memory, the rest local",
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "kernel": args.kernel, "tile_configs": self.tile_configs,
                "leads": "schedules.lead_sweep: D_knee, and the derived lead times "
                         f"{args.lead_multiples}",
                "auto": f"tuned: of the schedules the forecast predicts within "
                        f"{AUTO_TUNE_MARGIN:.0%} of its fastest, the fastest of a timing of "
                        f"{args.tune_trials} trials before the cell's, by the median of "
                        "per-trial ratios to the first candidate",
                "tolerance": TOLERANCE,
                "timing": f"{TIMING_METHOD}; one process; {args.graph_iters} calls per trial, "
                          "CUDA-graph replays"}


# The forecast's columns each measured row carries (prefixed ``forecast_``).
FORECAST_COLUMNS = ("burst_volume", "g_wave_us", "v_over_r_us", "g_star_us", "action",
                    "predicted_stall_us", "predicted_span_us", "predicted_wave_us",
                    "predicted_interleaved_us", "predicted_speedup", "auto_predicted_us",
                    "tile_wave_us")

EXPERIMENT = MoEHost()

if __name__ == "__main__":
    harness.main(EXPERIMENT)
