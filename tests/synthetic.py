"""Synthetic remote-store records made from known platform parameters, for the fit tests."""
from __future__ import annotations

import numpy as np
import pandas as pd

from xstage_lab import model
from xstage_lab.experiments.remote_store import characterization_sweeps

KNOWN = dict(drain_rate=700.0, fixed_us=0.25, issue_rate_per_producer_GBps=45.0,
             capacity_per_producer=32 * 1024, loop_gap_us=1.2, sm_count=132)


def issue_floor(k: int, v):
    return model.IssueFloor(k, KNOWN["fixed_us"], KNOWN["issue_rate_per_producer_GBps"] * k)(v)


def capacity(k: int) -> float:
    return KNOWN["capacity_per_producer"] * k


def issue_time(p: dict, k: int, v: float, t0: float, g: float, R: float) -> float:
    """The Burst–Gap model's issue time of point ``p``'s bursts of volume ``v`` from ``k``
    producers: the floor ``t0`` on the local path; isolated, the capacity-limited time; periodic
    with period gap ``g``, the larger of the steady-state and the isolated time."""
    if p["path"] == "local":
        return t0
    isolated = float(model.isolated_issue_time(v, t0, capacity(k), R))
    if p["mode"] == "isolated":
        return isolated
    return float(max(model.issue_time(g, v, t0, R), isolated))


def synthetic_table(noise: float = 0.0, seed: int = 0) -> pd.DataFrame:
    """Per-burst rows shaped like ``RemoteStoreBench.measure``'s, from the Burst–Gap model."""
    rng = np.random.default_rng(seed)
    R, bar = KNOWN["drain_rate"], KNOWN["loop_gap_us"]
    rows = []
    for sw in characterization_sweeps(KNOWN["sm_count"], 2, repeats=3):
        for idx, p in enumerate(sw.points()):
            k, b = p["producers"], p["burst_bytes"]
            v = k * b
            t0 = float(issue_floor(k, v))
            g = p["gap_us"] + bar
            t = issue_time(p, k, v, t0, g, R)
            for rep in range(sw.repeats):
                jitter = 1 + noise * rng.standard_normal(4)
                rows.append(dict(p, sweep=sw.name, point=idx, repeat=rep, burst=5, warmup=False,
                                 producers_in_window=k, window_rate_GBps=min(R, v / (t + g) / 1e3),
                                 t_iss_us=t * jitter[0], period_us=(t + g) * jitter[1],
                                 gap_eff_us=g * jitter[1] + t * (jitter[1] - jitter[0]),
                                 start_skew_ns=50.0, sm_clock_mhz=1980.0, burst_volume=v))
    return pd.DataFrame(rows)


def synthetic_beyond_table(sweeps, drain_rate=None, noise: float = 0.0, seed: int = 0
                           ) -> pd.DataFrame:
    """Per-burst rows shaped like ``RemoteOpsBench.measure``'s for ``remote_ops.config_sweeps``:
    every source of a point's routes drains at ``drain_rate(point)`` (default KNOWN's) times its
    drain share, with KNOWN's issue floor, capacity and loop gap."""
    from xstage_lab.experiments.remote_ops import drain_share, parse_routes

    rng = np.random.default_rng(seed)
    bar = KNOWN["loop_gap_us"]
    rows = []
    for sw in sweeps:
        for idx, p in enumerate(sw.points()):
            routes = parse_routes(p["routes"])
            share = drain_share(routes)
            k, b = p["producers"], p["burst_bytes"]
            v = k * b
            t0 = float(issue_floor(k, v))
            g = p["gap_us"] + bar
            for src, dsts in routes:
                R = (drain_rate(p) if drain_rate else KNOWN["drain_rate"]) * share[src]
                t = issue_time(p, k, v, t0, g, R)
                for rep in range(sw.repeats):
                    jitter = 1 + noise * rng.standard_normal(2)
                    rows.append(dict(p, sweep=sw.name, point=idx, repeat=rep, burst=5,
                                     warmup=False, producers_in_window=k, src=src,
                                     dst=dsts[0] if len(dsts) == 1 else -1, n_dst=len(dsts),
                                     window_rate_GBps=min(R, v / (t + g) / 1e3),
                                     t_iss_us=t * jitter[0], period_us=(t + g) * jitter[1],
                                     gap_eff_us=g * jitter[1] + t * (jitter[1] - jitter[0]),
                                     start_skew_ns=50.0, gpu_start_spread_ns=800.0,
                                     sm_clock_mhz=1980.0, burst_volume=v))
    return pd.DataFrame(rows)


def write_synthetic_beyond_records(root, n_gpus: int = 2, noise: float = 0.01):
    """A ``remote_ops`` and a ``remote_patterns`` record under ``root`` from the model: 16-byte
    stores at KNOWN's rate, every other operation at its own rate (the reductions far slower),
    each all-to-one source at its drain share. Returns (ops path, patterns path)."""
    from xstage_lab.experiments.injection_patterns import (pattern_instances, route_sets,
                                                          write_patterns)
    from xstage_lab.experiments.remote_ops import (OPS, config_sweeps, drain_share,
                                                   parse_routes, write_operations)
    from xstage_lab.experiments.remote_store import BenchSettings

    rates = dict(zip(OPS, (700.0, 650.0, 400.0, 300.0, 690.0, 120.0, 110.0)))
    provenance = {"gpu_name": "NVIDIA H200", "gpu_count": n_gpus, "synthetic": True}
    facts = {"excluded": {}, "rates_GBps": {}, "clocks": {}, "sweeps": [], "elapsed_s": 0.0,
             "seed": 0, "settings": {}}
    sweeps = [sw for op in OPS for sw in config_sweeps({"op": op}, 132, dict(routes="0>1"),
                                                       rates[op], BenchSettings(), repeats=3)]
    ops = synthetic_beyond_table(sweeps, drain_rate=lambda p: rates[p["op"]], noise=noise)
    ops_path = write_operations(ops, facts, 0, 1, f"h200-x{n_gpus}", provenance, root)
    sweeps = [sw for r in route_sets(pattern_instances(n_gpus))
              for sw in config_sweeps({"routes": r}, 132, dict(op="store16"),
                                      KNOWN["drain_rate"] * min(drain_share(parse_routes(r)).values()),
                                      BenchSettings(), repeats=3)]
    patterns = synthetic_beyond_table(sweeps, noise=noise)
    return ops_path, write_patterns(patterns, facts, n_gpus, f"h200-x{n_gpus}", provenance, root)


def write_eight_gpu_beside_committed(root) -> None:
    """A records root with the committed h200-x2 records (all of each experiment: the summary
    reads every ``fa_a2a`` record) and an h200-x8 platform beside them, made from the latest
    ones: the same measurements relabelled for eight GPUs (8 in the provenance, P = 8 in the
    attention record, world_size = 8 in the MoE records) and injection patterns and operations
    made from the model on eight GPUs."""
    import copy
    import shutil
    from datetime import datetime

    from xstage_lab.records import latest_record, list_records, write_record

    for experiment in ("calibration", "remote_store", "visibility", "fa_a2a", "moe", "moe_trace",
                       "remote_patterns", "remote_ops"):
        for path in list_records(experiment, "h200-x2"):
            copied = root / experiment / "h200-x2" / path.name
            copied.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copied)
        rec = latest_record(experiment, "h200-x2")
        if experiment in ("remote_patterns", "remote_ops"):
            continue
        table, params = rec.table.copy(), copy.deepcopy(rec.params)
        for column in ("P", "world_size"):
            if column in table:
                table[column] = 8
        if experiment == "fa_a2a":
            params["params"]["P"] = 8
        if "world_size" in params:
            params["world_size"] = 8
        write_record(experiment, "h200-x8", table, params, {**rec.provenance, "gpu_count": 8},
                     root, created=datetime.fromisoformat(rec.meta["created_utc"]))
    write_synthetic_beyond_records(root, n_gpus=8, noise=0.0)
