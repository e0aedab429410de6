"""Remote-visible completion seen from the receiver (issue 8 part 2, paper §3).

The sender (``visibility_sender`` in ``kernels/visibility_latency.cu``, K producers, one CTA per
SM) stores a burst of B bytes per producer into the receiver's buffer, then a flag warp releases
a per-(burst, producer) flag with ``st.release.sys`` while the store warps spin the gap G and go
on to the next burst. The receiver (``visibility_receiver`` on the destination GPU, launched
concurrently) polls its local flags, stamps when each becomes visible and then checks the burst's
data against the pattern: a visible flag with stale data fails the run before any time is kept.

Each GPU stamps with its own ``%globaltimer``. Their offset θ = t_dst − t_src is measured by a
ping-pong before and after the sweep (Cristian/NTP): the initiator stamps t0 and pings, the
responder stamps t1 on arrival and t2 after its pong, the initiator stamps t3 on the pong;
θ = ((t1 − t0) + (t2 − t3)) / 2 and RTT = (t3 − t0) − (t2 − t1). The samples of smallest RTT
give θ, whose error is at most RTT_min/2 (any asymmetry of the two one-way delays) plus the
timer's resolution, measured too. θ is interpolated linearly between the two measurements
(the drift). The issue-to-visibility latency of a burst is
t_visible − θ − t_iss_end (and from t_iss_start), compared with the fenced sweep's
T_complete(K, V) = V/R + T_lat (``calibration.CompletionFit``).

    python -m xstage_lab.experiments.remote_store.visibility (--out FILE | --root DIR) \\
        [--src 0] [--dst 1] [--repeats 5]

An ``Experiment`` run in process by ``experiments.harness``: its ``Sweep`` is
``visibility_sweep``; θ before and after it, and the latency columns, are its own. The kernels'
host side is ``ops.remote_store.visibility``; what is read of the records,
``analysis.remote_store.visibility``.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import pandas as pd

from ...analysis.remote_store.visibility import (Visibility, add_latency, alignment_summary,
                                                 timer_resolution)
from ...ops.remote_store.burst import check_gpus
from ...ops.remote_store.visibility import KIB, VisibilityBench, VisibilitySettings
from ...platform import inventory, link_problem
from ...records import RECORDS_DIR
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment


def visibility_sweep(sm_count: int, src: int = 0, dst: int = 1, repeats: int = 5) -> Sweep:
    """Producers K (one, a quarter and all SMs), burst volume per producer B and gap G (0 up to
    about 3·V/R of the largest burst at the H200's measured R)."""
    Ks = sorted({1, max(1, sm_count // 4), sm_count})
    return Sweep("visibility", (Axis("producers", Ks),
                              Axis("burst_bytes", [4 * KIB, 16 * KIB, 64 * KIB]),
                              Axis("gap_us", [0.0, 2.0, 8.0, 24.0, 72.0])),
                 fixed=dict(src=src, dst=dst), repeats=repeats)


class VisibilityLatency(Experiment):
    """The visibility sweep (``visibility_sweep``) between two GPUs, with the timers' resolution
    and θ measured before the first point and θ again after the last.

    Each launch checks itself (``VisibilityBench.measure``: every burst's data once its flag is
    visible, every wait, one CTA per SM): a point's first launch, its warm-up, fails the run
    before any of its repeats is kept."""

    name = "visibility"
    in_measure_all = True
    optional = True
    paper = "§3 (issue 8 part 2)"
    launch = "in_process"

    def add_arguments(self, p) -> None:
        p.add_argument("--src", type=int, default=0)
        p.add_argument("--dst", type=int, default=1)
        p.add_argument("--repeats", type=int, default=5)
        p.set_defaults(settings=VisibilitySettings())  # run_visibility may pass others

    def check_args(self, a) -> None:
        if a.repeats < 1:
            raise ValueError("--repeats must be >= 1")

    def sweeps(self, args) -> list[Sweep]:
        self.inv = inventory()
        problem = link_problem("nvlink", self.inv)
        if problem is not None:
            raise RuntimeError(problem)
        check_gpus(args.src, args.dst, self.inv)
        gpus = self.inv.gpus
        return [visibility_sweep(min(gpus[args.src].sm_count, gpus[args.dst].sm_count),
                                 args.src, args.dst, args.repeats)]

    def start(self, run) -> None:
        args = run.args
        self.began = time.monotonic()
        self.bench = VisibilityBench(args.src, args.dst, args.settings, self.inv)
        self.before = None

    def say(self, run, msg: str) -> None:
        if not run.args.no_progress:
            print(f"[visibility {time.monotonic() - self.began:6.1f} s] {msg}", flush=True)

    def validate(self, point, run) -> None:
        self.bench.validate(point)

    def prepare(self, point, run):
        if self.before is None:  # every point validated: the run's first launches
            self.align_before(run)
        return point

    def align_before(self, run) -> None:
        """Peer access and modules, the timers' resolution, a warm-up ping-pong, θ before."""
        bench, src, dst = self.bench, run.args.src, run.args.dst
        bench.prepare()
        self.say(run, "compiled; measuring the timers and the clock offset")
        self.resolution = {dev: timer_resolution(bench.timer_steps(dev)) for dev in (src, dst)}
        bench.pingpong(src, dst)  # warm-up: first-touch of the peer mappings
        self.before = bench.align()
        self.clocks = {"sm_clock_mhz_before": bench.sm_clock_mhz()}
        b = self.before[0]
        self.say(run, f"θ before = {b['offset_ns']:.0f} ns (RTT min {b['rtt_min_ns']} ns, "
                      f"median {b['rtt_median_ns']:.0f} ns)")

    def measure(self, point, run) -> pd.DataFrame:
        return self.bench.measure(point)

    def finish(self, table, run) -> pd.DataFrame:
        """θ after the sweep; the latency columns from the alignment."""
        self.clocks["sm_clock_mhz_after"] = self.bench.sm_clock_mhz()
        after, after_rev = self.bench.align()
        self.say(run, f"θ after = {after['offset_ns']:.0f} ns; {len(table)} rows")
        (before, before_rev), src, dst = self.before, run.args.src, run.args.dst
        self.alignment = alignment_summary(before, after, before_rev, after_rev,
                                           self.resolution[src], self.resolution[dst])
        return add_latency(table, self.alignment)

    def metadata(self, run) -> dict:
        args = run.args
        return {"settings": asdict(args.settings), "src": args.src, "dst": args.dst,
                "seed": int(self.bench.seed), "clocks": self.clocks,
                "clock_alignment": self.alignment}

    @classmethod
    def analyse(cls, record, root):
        return Visibility.from_record(record, root)


EXPERIMENT = VisibilityLatency()


def run_visibility(src: int = 0, dst: int = 1, repeats: int = 5,
                   settings: VisibilitySettings = VisibilitySettings(), progress: bool = True,
                   root: Path = RECORDS_DIR) -> Path:
    """Measure the timers' resolution and θ, run the latency sweep, measure θ again, and save a
    ``visibility`` record (raw stamps plus latency columns; the alignment in the header)."""
    args = harness.parse(EXPERIMENT, ["--root", str(root), "--src", str(src), "--dst", str(dst),
                                      "--repeats", str(repeats),
                                      *([] if progress else ["--no-progress"])])
    args.settings = settings
    return harness.run(EXPERIMENT, args)


if __name__ == "__main__":
    harness.main(EXPERIMENT)
