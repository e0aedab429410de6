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
            if p["path"] == "local":
                t = t0
            elif p["mode"] == "isolated":
                t = float(model.isolated_issue_time(v, t0, capacity(k), R))
            else:
                t = float(max(model.issue_time(g, v, t0, R),
                              model.isolated_issue_time(v, t0, capacity(k), R)))
            for rep in range(sw.repeats):
                jitter = 1 + noise * rng.standard_normal(4)
                rows.append(dict(p, sweep=sw.name, point=idx, repeat=rep, burst=5, warmup=False,
                                 producers_in_window=k, window_rate_GBps=min(R, v / (t + g) / 1e3),
                                 t_iss_us=t * jitter[0], period_us=(t + g) * jitter[1],
                                 gap_eff_us=g * jitter[1] + t * (jitter[1] - jitter[0]),
                                 start_skew_ns=50.0, sm_clock_mhz=1980.0, burst_volume=v))
    return pd.DataFrame(rows)
