"""Multi-peer injection patterns (issue 6, part 1): 16-byte remote stores from several sources to
several destinations at once, on every GPU of the machine.

- ``one_to_one``: one source, one destination, for every ordered pair;
- ``one_to_all``: one source whose producers split over the P − 1 peers (producer p to the
  (p mod (P − 1))-th peer), for every source;
- ``all_to_one``: every GPU but the destination sends to it (its drain is shared), for every
  destination;
- ``all_to_all``: every GPU sends to every other, producers split as in one_to_all.

Each distinct route set is measured once (on two GPUs one_to_all and all_to_one are one_to_one
routes: the record names them degenerate) with the calibration sweeps of ``ops`` on every
source at once; each source gets its own fitted (T_iss⁰, R, Q) and two no-refit errors of its gap
sweep: from its own fit, and from the one-to-one fit of its route scaled by its drain share.

    python -m xstage_lab.experiments.remote_store.patterns (--out FILE | --root DIR) \\
        [--repeats N] [--budget-s 420]

An ``Experiment`` run in process by ``experiments.harness`` (``Patterns``): its ``Sweep`` is a
point per route set, calibrated as ``ops.ConfigCalibration`` says.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ...analysis.remote_store.patterns import pattern_fits
from ...analysis.remote_store.routes import format_routes, parse_routes
from ...ops.remote_store.operations import OpsSettings, RemoteOpsBench
from ...platform import inventory, platform_name
from ...records import RECORDS_DIR
from ...sweep import Axis, Sweep
from .. import harness
from .ops import ConfigCalibration, calibrate_one, run_facts


PATTERNS = ("one_to_one", "one_to_all", "all_to_one", "all_to_all")


# Device time the route sets may take (measured 16.5 s on 2 GPUs; from that, ~2.2 min on 4 and
# ~6 min on 8 at ``default_repeats``), leaving the fits and the record's write (~1.5 min for the
# 128 source fits of 8 GPUs) inside one 10-minute device call.
PATTERNS_BUDGET_S = 420.0


def default_repeats(n_gpus: int) -> int:
    """Repeats per point: 5 up to four GPUs, 3 beyond. The P(P − 1) one-to-one route sets make
    most of the work (56 of the 73 route sets on 8 GPUs, ~325 launches each at 5 repeats, ~217 at
    3): at 5 repeats the 8-GPU patterns would need ~9 min before their fits, past one device
    call."""
    return 5 if n_gpus <= 4 else 3


def pattern_instances(n_gpus: int) -> list[dict]:
    """Every instance of every pattern on ``n_gpus`` GPUs: ``pattern``, ``instance`` (what it
    is taken over), ``routes`` (``format_routes``) and ``degenerate_of`` (the one-to-one route
    set it equals, or None)."""
    if n_gpus < 2:
        raise ValueError("injection patterns need at least two GPUs")
    gpus = range(n_gpus)
    out = [dict(pattern="one_to_one", instance=f"{a}>{b}", routes=format_routes(((a, (b,)),)))
           for a in gpus for b in gpus if a != b]
    out += [dict(pattern="one_to_all", instance=f"src={s}",
                 routes=format_routes(((s, tuple(d for d in gpus if d != s)),))) for s in gpus]
    out += [dict(pattern="all_to_one", instance=f"dst={d}",
                 routes=format_routes(tuple((s, (d,)) for s in gpus if s != d))) for d in gpus]
    out.append(dict(pattern="all_to_all", instance="all",
                    routes=format_routes(tuple((s, tuple(d for d in gpus if d != s))
                                               for s in gpus))))
    one_to_one = {i["routes"] for i in out if i["pattern"] == "one_to_one"}
    for i in out:
        i["degenerate_of"] = (i["routes"] if i["pattern"] != "one_to_one"
                              and i["routes"] in one_to_one else None)
    return out


def route_sets(instances: list[dict]) -> list[str]:
    """The distinct route sets to measure, in first-seen order."""
    return list(dict.fromkeys(i["routes"] for i in instances))


class Patterns(ConfigCalibration):
    """Every distinct route set of the injection patterns on this machine's peer-capable GPUs,
    one after another on one bench; every source fitted."""

    name = "remote_patterns"
    in_measure_all = True
    optional = True
    paper = "issue 6 part 1 (§3's model under multi-peer injection)"
    budget_s = PATTERNS_BUDGET_S

    def add_arguments(self, p) -> None:
        p.add_argument("--repeats", type=int, default=None,
                       help="per point (default: default_repeats of this machine's GPUs)")
        super().add_arguments(p)

    def sweeps(self, args) -> list[Sweep]:
        self.inv = inventory()
        self.gpus = self.inv.peer_capable_gpus
        if self.gpus < 2:
            raise RuntimeError("injection patterns need two peer-capable GPUs")
        return [Sweep("patterns", (Axis("config", [{"routes": r} for r in
                                                   route_sets(pattern_instances(self.gpus))]),),
                      fixed=dict(op="store16"), repeats=1, warmup=0)]

    def start(self, run) -> None:
        super().start(run)
        self.bench = RemoteOpsBench(run.args.settings, self.inv)
        self.K = min(g.sm_count for g in self.inv.gpus[:self.gpus])
        self.repeats = (default_repeats(self.gpus) if run.args.repeats is None
                        else run.args.repeats)

    def calibrate_config(self, point, run):
        return calibrate_one(self.bench, {"routes": point["routes"]}, {"op": point["op"]},
                             self.K, self.repeats, not run.args.no_progress, self.deadline)

    def metadata(self, run) -> dict:
        facts = {**self.facts, "seed": int(self.bench.seed),
                 "settings": self.settings_fact(run.args.settings)}
        return patterns_params(self.table, facts, self.gpus, platform_name(self.inv))


EXPERIMENT = Patterns()


def run_patterns(repeats: int | None = None, settings: OpsSettings = OpsSettings(),
                 progress: bool = True, budget_s: float = PATTERNS_BUDGET_S,
                 root: Path = RECORDS_DIR) -> Path:
    """Measure every injection pattern on this machine's GPUs and save one ``remote_patterns``
    record: per-burst rows of every source (``routes``, ``src``), and in its parameters the
    pattern instances, their degeneracy on this machine, every source's fit and the route sets
    left out (a failed check, or past ``budget_s``). ``repeats``: per point (None:
    ``default_repeats`` for this machine's GPUs)."""
    args = harness.parse(EXPERIMENT, ["--root", str(root), "--budget-s", str(budget_s),
                                      *([] if repeats is None else ["--repeats", str(repeats)]),
                                      *([] if progress else ["--no-progress"])])
    args.settings = settings
    return harness.run(EXPERIMENT, args)


def patterns_params(table: pd.DataFrame, facts: dict, n_gpus: int, platform: str) -> dict:
    """A ``remote_patterns`` record's parameters: the run ``facts`` (``ops.run_facts``), the
    pattern instances on ``n_gpus`` GPUs with their degeneracy and the fits of every source of
    every route set of ``table`` (``pattern_fits``)."""
    instances = pattern_instances(n_gpus)
    return {"gpus": n_gpus, "instances": instances,
            "degenerate": sorted({i["pattern"] for i in instances if i["degenerate_of"]}),
            **run_facts(facts), "fits": pattern_fits(table, platform),
            # %globaltimer spread of the sources' first bursts (an upper bound of their start
            # skew only where the GPUs' timers agree; the record does not assume they do)
            "gpu_start_spread_ns_median": {
                r: float(v) for r, v in table.groupby("routes")["gpu_start_spread_ns"].median()
                .items() if len(parse_routes(r)) > 1}}


if __name__ == "__main__":
    harness.main(EXPERIMENT)
