"""Remote operations beyond 16-byte stores (issue 6, part 2), and the concurrent launcher that the
injection patterns (``patterns``) share.

``burst_gap_ops`` in ``kernels/remote_store_burst.cu`` runs the Burst–Gap loop of §3.1 with one
operation per burst: 4-, 8- or 16-byte stores, remote reductions (``red.global.add`` u32 or f32),
bulk copies from shared memory into peer memory (``cp.async.bulk``, issue ending when the copy
engine has read the staging) or 16-byte remote loads (summed, so issue ends when the data is
back). Each source GPU's producers may split over several destinations, and several source GPUs
run at once, started together through a pinned host flag.

Every operation gets the Fig. 3 calibration on a reduced axis set (``config_sweeps``): R from
aligned zero-gap bursts (eq. 1), T_iss⁰ from the gap sweep's plateau, Q from isolated bursts
(eq. 7), then two no-refit predictions of its gap sweep (eqs. 1, 3): with its own fitted M_X
(``calibrate``), and with the 16-byte-store M_X of the same run (``no_refit_error``), which says
where the model stops describing the operation.

The kernel's host side is ``ops.remote_store.operations``; the fits read from the records,
``analysis.remote_store.operations``.

    python -m xstage_lab.experiments.remote_store.ops (--out FILE | --root DIR) [--repeats 5] \\
        [--src 0] [--dst 1] [--budget-s 135]

An ``Experiment`` run in process by ``experiments.harness`` (``Operations``): its ``Sweep`` is a
point per operation, each calibrated in a process of its own (``calibrate_isolated``).
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from ... import model
from ...analysis.remote_store.operations import (BASELINE_OP, aligned_drain_rate, fit_entry,
                                                 operation_fits)
from ...analysis.remote_store.routes import format_routes, parse_routes
from ...calibration import BenchSettings
from ...ops.remote_store.burst import BURST_RESOLUTION, KIB, check_gpus, isolated_recovery_us
from ...ops.remote_store.operations import (ALIGNS, OPS, OPS_SETTINGS, PATHS, OpsSettings,
                                           RemoteOpsBench)
from ...platform import inventory, platform_name
from ...records import RECORDS_DIR
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment


# The reduced axes of issue 6 (one K, two gap-sweep volumes, nine gaps).
DRAIN_BURSTS = (32 * KIB, 64 * KIB, 128 * KIB)   # K·B ≥ 4 MiB at K = 132: the R fit's range


GAP_BURSTS = (16 * KIB, 64 * KIB)


# Gaps as fractions of V/R at the larger gap-sweep burst: the drain branch and the plateau
# (calibrate's plateau starts at 2·V/R).
GAP_FRACTIONS = (0.0, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1.0, 1.5, 2.5, 4.0)


ISOLATED_BURSTS = tuple(k * KIB for k in (4, 8, 16, 24, 32, 48, 64, 128))


LAUNCH_BUDGET_US = 10_000.0   # bursts of one periodic launch, at most (slow operations)


MIN_BURSTS = 40               # bursts of a periodic launch at least (warm-up included)


OPS_BUDGET_S = 135.0          # device time the operations may take, process starts included


def config_sweeps(config: dict, sm_count: int, fixed: dict, rate_GBps: float,
                  settings: BenchSettings = OPS_SETTINGS, repeats: int = 5) -> list[Sweep]:
    """The calibration sweeps of Fig. 3 on the reduced axes for one ``config`` (the parameters
    that make one operation or route set), K = all SMs, scaled by its drain-rate estimate
    ``rate_GBps`` so that every operation, however slow, reaches its recovered plateau:

    - ``drain_rate``: zero-gap periodic bursts, aligned each burst (R) and free-running (the
      window-rate cross-check), B in DRAIN_BURSTS;
    - ``gap``: the gap sweep, remote and the local control, B in GAP_BURSTS, G at
      GAP_FRACTIONS of V/R of the larger B (the smaller B sees the same gaps, up to 4× its V/R
      and beyond);
    - ``isolated``: isolated bursts over ISOLATED_BURSTS (Q and the knee), each after a recovery
      of V at half the estimated rate.

    Each launch runs at most LAUNCH_BUDGET_US of bursts (at least MIN_BURSTS)."""
    K = sm_count
    base = dict(fixed, **config, lines="fresh", producers=K)
    drain_us = model.drain_time(K * max(GAP_BURSTS), rate_GBps)
    gaps = tuple(round(f * drain_us, 2) for f in GAP_FRACTIONS)

    def bursts(longest_period_us: float) -> int:
        return int(np.clip(LAUNCH_BUDGET_US // longest_period_us, MIN_BURSTS,
                           settings.periodic_bursts))

    return [
        Sweep("drain_rate", (Axis("align", ALIGNS), Axis("burst_bytes", DRAIN_BURSTS)),
              fixed=dict(base, mode="periodic", path="remote", gap_us=0.0,
                         bursts=bursts(model.drain_time(K * max(DRAIN_BURSTS), rate_GBps))),
              repeats=repeats),
        Sweep("gap", (Axis("path", PATHS), Axis("burst_bytes", GAP_BURSTS), Axis("gap_us", gaps)),
              fixed=dict(base, mode="periodic", align="first",
                         bursts=bursts(drain_us + max(gaps))),
              repeats=repeats),
        Sweep("isolated", (Axis("burst_bytes", ISOLATED_BURSTS),),
              fixed=dict(base, mode="isolated", path="remote", align="each", gap_us=0.0,
                         recovery_rate_GBps=round(min(settings.isolated_recovery_rate_GBps,
                                                      rate_GBps / 2), 2)),
              repeats=repeats),
    ]


def probe_rate(bench: RemoteOpsBench, config: dict, fixed: dict, K: int) -> float:
    """One checked zero-gap launch of ``config`` (B = 64 KiB) before any of its timing: its
    aggregate rate V/T_period, slowest source, is the drain-rate estimate that scales the
    config's drain-rate sweep. Raises RuntimeError where the launch or its check fails."""
    p = dict(fixed, **config, mode="periodic", path="remote", producers=K,
             burst_bytes=max(GAP_BURSTS), gap_us=0.0, lines="fresh", align="first")
    rows = bench.measure(p)
    steady = rows[~rows["warmup"]]
    rate = float((steady["burst_volume"] / steady["period_us"] / 1e3)
                 .groupby(steady["src"]).median().min())
    if not rate > 0:
        raise RuntimeError(f"no steady period in the probe launch (rate {rate})")
    return rate


def sweep_seconds(sweep: Sweep, rate_GBps: float, settings: BenchSettings,
                  launch_overhead_s: float = 0.006) -> float:
    """What ``sweep`` should take at drain rate ``rate_GBps`` (the local control at no cost):
    every launch's bursts at the max law's period plus a fixed overhead per launch (buffer
    poison, check, copies), for the time budget."""
    total = 0.0
    for p in sweep.points():
        v = p["producers"] * p["burst_bytes"]
        drain = model.drain_time(v, rate_GBps) if p["path"] == "remote" else 0.0
        if p["mode"] == "isolated":
            recovery = replace(settings, isolated_recovery_rate_GBps=p["recovery_rate_GBps"])
            run_us = settings.isolated_bursts * (drain + isolated_recovery_us(v, recovery))
        else:
            run_us = p["bursts"] * max(drain, p["gap_us"])
        total += (sweep.repeats + sweep.warmup) * (run_us / 1e6 + launch_overhead_s)
    return total


def _label(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def calibrate_configs(bench: RemoteOpsBench, configs: list[dict], fixed: dict, K: int,
                      repeats: int = 5, progress: bool = True, budget_s: float = float("inf")
                      ) -> tuple[pd.DataFrame, dict]:
    """For each config in turn: a checked probe launch, then its calibration sweeps
    (``config_sweeps``), the drain-rate sweep first, whose R scales the gap and isolated
    sweeps. Every point of a sweep is validated before its first launch. A config whose probe
    fails (its check, or a CUDA fault, which leaves the context unusable for the configs after
    it) or whose sweeps would overrun ``budget_s`` is left out with the reason. Returns the rows
    (``sweep`` and ``config`` columns added) and the run facts (clocks, the sweeps as run, the
    rates that scaled them, the configs left out)."""
    from ...sweep import run_sweep

    t0 = time.monotonic()
    srcs = sorted({s for cfg in configs
                   for s, _ in parse_routes(dict(fixed, **cfg)["routes"])})
    clock = lambda: {str(s): bench.sm_clock_mhz(s) for s in srcs}  # noqa: E731
    frames, facts = [], {"clocks": {}, "sweeps": [], "rates_GBps": {}, "excluded": {}}

    def run(sw: Sweep, label: str, cfg: dict) -> pd.DataFrame:
        rows, facts["clocks"][f"{label}/{sw.name}"] = run_sweep(
            sw, bench.measure, validate=bench.validate, sm_clock_mhz=clock, progress=progress)
        facts["sweeps"].append({"config": cfg, **sw.describe()})
        return rows.assign(sweep=sw.name, config=label)

    def over_budget(sweeps: list[Sweep], rate: float) -> str | None:
        need = sum(sweep_seconds(sw, rate, bench.settings) for sw in sweeps)
        left = budget_s - (time.monotonic() - t0)
        return f"time budget: needs ~{need:.0f} s, {left:.0f} s left" if need > left else None

    for cfg in configs:
        label = _label(cfg)
        try:
            estimate = probe_rate(bench, cfg, fixed, K)
        except RuntimeError as e:
            facts["excluded"][label] = str(e)
            continue
        drain, gap, isolated = config_sweeps(cfg, K, fixed, estimate, bench.settings, repeats)
        reason = over_budget([drain, gap, isolated], estimate)
        if reason:
            facts["excluded"][label] = reason
            continue
        drain = run(drain, label, cfg)
        try:
            rate = aligned_drain_rate(drain)
        except ValueError:  # no drain-limited point: keep the probe's estimate for the scale
            rate = estimate
        facts["rates_GBps"][label] = {"probe": estimate, "drain_sweep": rate}
        _, gap, isolated = config_sweeps(cfg, K, fixed, rate, bench.settings, repeats)
        reason = over_budget([gap, isolated], rate)
        if reason:
            facts["excluded"][label] = reason
            continue
        frames += [drain, run(gap, label, cfg), run(isolated, label, cfg)]
        print(f"{label}: done at {time.monotonic() - t0:.0f} s", flush=True)
    if not frames:
        raise NothingMeasured(facts)
    return pd.concat(frames, ignore_index=True), facts


class NothingMeasured(RuntimeError):
    """``calibrate_configs`` left every configuration out; ``facts`` says why."""

    def __init__(self, facts: dict):
        super().__init__(f"no configuration was measured: {facts['excluded']}")
        self.facts = facts


def calibrate_one(bench: RemoteOpsBench, cfg: dict, fixed: dict, K: int, repeats: int,
                  progress: bool, deadline: float) -> tuple[pd.DataFrame | None, dict]:
    """``calibrate_configs`` of ``cfg`` alone within what is left of the run's budget at
    ``deadline`` (``time.monotonic``, one clock for every process of the machine). Returns (rows,
    or None where it was left out, and the facts)."""
    try:
        return calibrate_configs(bench, [cfg], fixed, K, repeats, progress,
                                 deadline - time.monotonic())
    except NothingMeasured as e:
        return None, e.facts


def calibrate_op(cfg: dict, fixed: dict, K: int, repeats: int, progress: bool,
                 deadline: float, settings: OpsSettings) -> tuple[pd.DataFrame | None, dict]:
    """One operation's ``calibrate_one`` on a bench of its own; the facts with the bench's seed."""
    bench = RemoteOpsBench(settings)
    table, facts = calibrate_one(bench, cfg, fixed, K, repeats, progress, deadline)
    return table, {**facts, "seeds": {_label(cfg): int(bench.seed)}}


def _child_main(calibrate, kwargs: dict, out: Path) -> None:
    """A spawned child: ``calibrate(**kwargs)`` pickled to ``out``; on an exception its
    traceback goes to ``out.with_suffix('.err')`` and the child exits non-zero."""
    import pickle
    import traceback

    try:
        result = calibrate(**kwargs)
    except BaseException:
        out.with_suffix(".err").write_text(traceback.format_exc())
        raise
    out.write_bytes(pickle.dumps(result))


def calibrate_isolated(cfg: dict, fixed: dict, K: int, repeats: int, progress: bool,
                       deadline: float, settings: OpsSettings) -> tuple[pd.DataFrame | None, dict]:
    """``calibrate_op`` of ``cfg`` in a process of its own (``spawn``).

    Why: a CUDA fault (an illegal address) is sticky, it ends the CUDA context of the process
    that met it, so in one process it would lose every config after it and the record of all.
    Here a child that faults, raises or dies loses its own config only: it is left out (None)
    with its exit code and the last lines of its error."""
    import multiprocessing
    import pickle
    import tempfile

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="xstage-ops-") as tmp:
        out = Path(tmp) / "config.pkl"
        child = ctx.Process(target=_child_main, args=(calibrate_op, dict(
            cfg=cfg, fixed=fixed, K=K, repeats=repeats, progress=progress, deadline=deadline,
            settings=settings), out))
        child.start()
        child.join()
        if child.exitcode == 0 and out.exists():
            return pickle.loads(out.read_bytes())
        err = out.with_suffix(".err")
        lines = err.read_text().splitlines() if err.exists() else []
    tail = [ln.strip() for ln in lines if ln.strip(" ^~")][-3:]  # no caret rows
    return None, {"excluded": {_label(cfg): f"child process exited {child.exitcode}: "
                                            + (" | ".join(tail) or "no error text")}}


# A config's rows keep the point, repeat and order of its own calibration sweeps under these
# names while the harness tags them with the config's point (``ConfigCalibration.finish``).
_SWEEP_TAGS = {"point": "sweep_point", "repeat": "sweep_repeat", "order": "sweep_order"}


class ConfigCalibration(Experiment):
    """The calibration sweeps of every configuration (an operation, or a route set) in turn,
    within one time budget: the declared ``Sweep`` is one point per configuration, each measured
    once by ``calibrate_config`` (a checked probe launch, then ``config_sweeps`` scaled by the
    rates it finds; every launch checks its destinations). A configuration that fails or would
    overrun the budget is left out with the reason (``excluded``)."""

    launch = "in_process"
    resolution = BURST_RESOLUTION

    def add_arguments(self, p) -> None:
        p.add_argument("--budget-s", type=float, default=self.budget_s,
                       help="device time the configurations may take, s")
        p.set_defaults(settings=OpsSettings())  # the run_* functions may pass others

    def check_args(self, a) -> None:
        if a.repeats is not None and a.repeats < 1:
            raise ValueError("--repeats must be >= 1")
        if not a.budget_s > 0:
            raise ValueError("--budget-s must be positive")

    def start(self, run) -> None:
        self.deadline = time.monotonic() + run.args.budget_s
        self.facts = {"clocks": {}, "sweeps": [], "rates_GBps": {}, "excluded": {}}

    def calibrate_config(self, point: dict, run) -> tuple[pd.DataFrame | None, dict]:
        raise NotImplementedError

    def measure(self, point, run) -> pd.DataFrame:
        """The config's rows (none where it was left out); its facts kept for the header."""
        table, facts = self.calibrate_config(point, run)
        for key, value in facts.items():
            if isinstance(value, list):
                self.facts[key] += value
            else:
                self.facts.setdefault(key, {}).update(value)
        return pd.DataFrame() if table is None else table.rename(columns=_SWEEP_TAGS)

    def finish(self, table, run) -> pd.DataFrame:
        for label, why in self.facts["excluded"].items():
            print(f"{self.name}: left out {label}: {why}", flush=True)
        if table.empty:
            raise NothingMeasured(self.facts)
        self.table = table.drop(columns=list(_SWEEP_TAGS)).rename(
            columns={v: k for k, v in _SWEEP_TAGS.items()})
        return self.table  # the fits of the header (``metadata``) are made from it

    @staticmethod
    def settings_fact(settings: OpsSettings) -> dict:
        return {**settings.bench.__dict__, "bulk_chunk_bytes": settings.bulk_chunk_bytes}


class Operations(ConfigCalibration):
    """Every operation of ``OPS`` on the route src → dst, each in a process of its own
    (``calibrate_isolated``), fitted against the 16-byte stores of the same run."""

    name = "remote_ops"
    in_measure_all = True
    optional = True
    paper = "issue 6 part 2 (§3's model beyond 16-byte stores)"
    budget_s = OPS_BUDGET_S

    def add_arguments(self, p) -> None:
        p.add_argument("--repeats", type=int, default=5)
        p.add_argument("--src", type=int, default=0)
        p.add_argument("--dst", type=int, default=1)
        super().add_arguments(p)

    def sweeps(self, args) -> list[Sweep]:
        return [Sweep("ops", (Axis("config", [{"op": op} for op in OPS]),),
                      fixed=dict(routes=format_routes(((args.src, (args.dst,)),))),
                      repeats=1, warmup=0)]

    def start(self, run) -> None:
        super().start(run)
        self.facts["seeds"] = {}
        self.inv = inventory()
        check_gpus(run.args.src, run.args.dst, self.inv)
        self.K = self.inv.gpus[run.args.src].sm_count

    def calibrate_config(self, point, run):
        args = run.args
        return calibrate_isolated({"op": point["op"]}, {"routes": point["routes"]}, self.K,
                                  args.repeats, not args.no_progress, self.deadline,
                                  args.settings)

    def metadata(self, run) -> dict:
        args = run.args
        return operations_params(self.table, {**self.facts,
                                              "settings": self.settings_fact(args.settings)},
                                 args.src, args.dst, platform_name(self.inv))


EXPERIMENT = Operations()


def run_operations(repeats: int = 5, src: int = 0, dst: int = 1,
                   settings: OpsSettings = OpsSettings(), progress: bool = True,
                   budget_s: float = OPS_BUDGET_S, root: Path = RECORDS_DIR) -> Path:
    """Calibrate every operation of ``OPS`` on the route ``src → dst`` and save one
    ``remote_ops`` record: per-burst rows, and in its parameters each operation's fit and its
    no-refit error from the 16-byte stores of the same run. Each operation runs in a process of
    its own (``calibrate_isolated``); those that failed their check, faulted or would overrun
    ``budget_s`` are named with the reason, in the record and printed. Returns the record's
    path."""
    args = harness.parse(EXPERIMENT, ["--root", str(root), "--repeats", str(repeats),
                                      "--src", str(src), "--dst", str(dst),
                                      "--budget-s", str(budget_s),
                                      *([] if progress else ["--no-progress"])])
    args.settings = settings
    return harness.run(EXPERIMENT, args)


def operations_params(table: pd.DataFrame, facts: dict, src: int, dst: int,
                      platform: str) -> dict:
    """A ``remote_ops`` record's parameters: the run ``facts`` (its calibration sweeps as
    ``calibration_sweeps``) and each operation's fit with its no-refit error from the baseline
    (16-byte stores) of the same run."""
    if BASELINE_OP not in set(table["op"]):
        raise RuntimeError(f"the baseline {BASELINE_OP} was not measured: {facts['excluded']}")
    fits = operation_fits(table, platform, "this record")
    base = fits[BASELINE_OP].calibration
    return {"ops": list(fits), "baseline": BASELINE_OP, "src": src, "dst": dst,
            **run_facts(facts), "fits": {op: fit_entry(f, base) for op, f in fits.items()}}


def run_facts(facts: dict) -> dict:
    """``facts`` for a record's header, the sweeps run per config as ``calibration_sweeps`` (the
    harness's ``sweeps`` is the declared one, a point per config)."""
    return {("calibration_sweeps" if k == "sweeps" else k): v for k, v in facts.items()}


if __name__ == "__main__":
    harness.main(EXPERIMENT)
