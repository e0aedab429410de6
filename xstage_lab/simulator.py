"""An X-Stage simulator that runs on the CPU: a fluid queue fed by any burst schedule.

The queue holds the outstanding volume q (bytes). It drains at R whenever it is not empty. A burst
of volume V injects at its backpressure-free rate V / T_iss^0 while q is below the capacity Q;
at Q the injection can go no faster than the drain (backpressure). A gap injects nothing. This is
the fluid abstraction of §3.2 played out in time rather than solved for steady state: for periodic
bursts it settles on eq. 3 (T_iss = max(T_iss^0, V/R − G)) and for one burst from empty on eq. 7
(max(T_iss^0, (V − Q)/R)), and it takes schedules the closed forms do not: mixed volumes, uneven
gaps, the tile order of a fused kernel.

Units as in ``model``: bytes, microseconds, R in GB/s.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .calibration import kb_key

_BYTES_PER_US_PER_GBPS = 1e3


@dataclass(frozen=True)
class Burst:
    """A burst of ``volume`` bytes issued in ``t_iss0`` µs when nothing backpressures it, then a
    producer-side gap of ``gap`` µs."""

    volume: float
    t_iss0: float
    gap: float

    def __post_init__(self):
        if self.volume < 0 or self.t_iss0 <= 0 or self.gap < 0:
            raise ValueError(f"a burst needs volume >= 0, t_iss0 > 0, gap >= 0: {self}")


def _issue(q: float, volume: float, inject: float, drain: float, capacity: float):
    """Issue ``volume`` from outstanding ``q``: returns (issue time, q at the end)."""
    if volume == 0:
        return 0.0, q
    if inject <= drain:  # the queue does not grow: no backpressure, q falls (not below 0)
        t = volume / inject
        return t, max(0.0, q - (drain - inject) * t)
    # q grows at inject - drain until it reaches the capacity, then injection is held to drain
    t_fill = max(0.0, capacity - q) / (inject - drain)
    if volume <= inject * t_fill:
        t = volume / inject
        return t, q + (inject - drain) * t
    return t_fill + (volume - inject * t_fill) / drain, max(q, capacity)


def simulate(bursts: Sequence[Burst], drain_rate: float, capacity: float,
             outstanding: float = 0.0) -> pd.DataFrame:
    """Play ``bursts`` through the fluid queue from ``outstanding`` bytes; one row per burst:
    start, issue time, period (start to next start), and the outstanding volume at issue end."""
    if drain_rate <= 0 or capacity < 0:
        raise ValueError("drain_rate must be > 0 and capacity >= 0")
    drain = drain_rate * _BYTES_PER_US_PER_GBPS  # bytes per µs
    q, now, rows = float(outstanding), 0.0, []
    for b in bursts:
        t_iss, q = _issue(q, b.volume, b.volume / b.t_iss0, drain, capacity)
        rows.append(dict(start_us=now, t_iss_us=t_iss, q_end_bytes=q, volume=b.volume,
                         gap_us=b.gap, period_us=t_iss + b.gap))
        q = max(0.0, q - drain * b.gap)
        now += t_iss + b.gap
    return pd.DataFrame(rows)


def simulate_producers(start_us, volume, t_iss0_us, drain_rate: float,
                       capacity: float) -> pd.DataFrame:
    """Bursts from many producers, overlapping in time, played through one fluid queue: the fluid
    abstraction of §3.2 with concurrent producers sharing the outstanding capacity Q, e.g. the
    output tiles of the attention kernel's epilogues at their measured start times.

    Burst i starts at ``start_us[i]`` and injects ``volume[i]`` bytes at its backpressure-free
    rate ``volume[i] / t_iss0_us[i]``. The queue starts empty and drains at R whenever q > 0.
    While q < Q, or the rates of the active bursts sum to D <= R, every burst injects at its own
    rate; at Q with D > R injection is held to R, shared in proportion to those rates. Exact
    event by event (a start, a finish, q reaching Q or 0). One row per burst, in input order:
    start, volume, T_iss^0, issue time (start to finish), stall (issue time beyond T_iss^0; 0
    for an empty burst) and the outstanding volume when its issue ends."""
    start, vol, t0 = (np.asarray(a, dtype=float) for a in (start_us, volume, t_iss0_us))
    if start.ndim != 1 or vol.shape != start.shape or t0.shape != start.shape:
        raise ValueError("start_us, volume and t_iss0_us must be 1-D and of one length: "
                         f"got shapes {start.shape}, {vol.shape}, {t0.shape}")
    if not np.isfinite(start).all():
        raise ValueError("start_us must be finite")
    if not (np.isfinite(vol).all() and (vol >= 0).all()):
        raise ValueError("volume must be finite and >= 0")
    if not (np.isfinite(t0).all() and (t0 > 0).all()):
        raise ValueError("t_iss0_us must be finite and > 0")
    if not (np.isfinite(drain_rate) and drain_rate > 0):
        raise ValueError(f"drain_rate must be finite and > 0, got {drain_rate}")
    if not capacity >= 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    drain = drain_rate * _BYTES_PER_US_PER_GBPS  # bytes per µs
    rate, order, n = vol / t0, np.argsort(start, kind="stable"), len(start)
    finish, q_end = np.empty(n), np.empty(n)
    # Every active burst works through its own T_iss^0 at one common speed (1, or R/D while held
    # at Q), so on a clock s running at that speed burst i finishes at s(its start) + T_iss^0_i.
    active = []  # heap of (s at finish, burst)
    nxt, now, s, q, demand = 0, float(start[order[0]]) if n else 0.0, 0.0, 0.0, 0.0
    while nxt < n or active:
        while nxt < n and start[order[nxt]] <= now:
            i = order[nxt]
            nxt += 1
            if vol[i] == 0:  # nothing to issue: it ends where it starts
                finish[i], q_end[i] = now, q
            else:
                heapq.heappush(active, (s + t0[i], i))
                demand += rate[i]
        if not active:
            demand = 0.0  # drop what rounding left in the running sum
        held = q >= capacity and demand > drain
        speed = drain / demand if held else 1.0
        dq = 0.0 if held or (q <= 0 and demand <= drain) else demand - drain
        to_start = start[order[nxt]] - now if nxt < n else np.inf
        to_finish = (active[0][0] - s) / speed if active else np.inf
        to_full = (capacity - q) / dq if dq > 0 else np.inf
        to_empty = q / -dq if dq < 0 else np.inf
        dt = min(to_start, to_finish, to_full, to_empty)
        now, s, q = now + dt, s + speed * dt, min(capacity, max(0.0, q + dq * dt))
        # land exactly on the event so that it is taken now and not in a sliver of a step later
        if dt == to_start:
            now = float(start[order[nxt]])
        if dt == to_finish:
            s = active[0][0]
        if dt == to_full:
            q = capacity
        if dt == to_empty:
            q = 0.0
        while active and active[0][0] <= s:
            i = heapq.heappop(active)[1]
            demand -= rate[i]
            finish[i], q_end[i] = now, q
    t_iss = finish - start
    return pd.DataFrame(dict(start_us=start, volume=vol, t_iss0_us=t0, t_iss_us=t_iss,
                             stall_us=np.where(vol > 0, t_iss - t0, 0.0), q_end_bytes=q_end))


def steady_state(burst: Burst, drain_rate: float, capacity: float, bursts: int = 400) -> dict:
    """Issue time and period of ``burst`` repeated until the queue settles (the last burst)."""
    last = simulate([burst] * bursts, drain_rate, capacity).iloc[-1]
    return {"t_iss_us": float(last["t_iss_us"]), "period_us": float(last["period_us"])}


def predict_gap_sweep(points: pd.DataFrame, t_iss0: dict, drain_rate: float,
                      capacity: dict, loop_gap_us: float) -> pd.DataFrame:
    """The simulator's steady state for each measured (K, B, G) of a periodic gap sweep, with the
    same inputs as the closed-form prediction (T_iss^0 plateau, R, Q(K), the loop's own gap)."""
    out = points.copy()
    sims = [steady_state(Burst(k * b, t_iss0[kb_key(k, b)], g + loop_gap_us),
                         drain_rate, capacity[int(k)])
            for k, b, g in zip(points["producers"], points["burst_bytes"], points["gap_us"])]
    out["t_iss_sim_us"] = [s["t_iss_us"] for s in sims]
    out["period_sim_us"] = [s["period_us"] for s in sims]
    return out


def tile_schedule_bursts(kinds: Sequence[str], mainloop_us: dict[str, float],
                         burst_volume: dict[str, float], t_iss0: dict[str, float]) -> list[Burst]:
    """A fused kernel's tile order as bursts: each tile's mainloop runs, then its epilogue issues
    its remote-store volume (``burst_volume[kind]``, 0 for tiles that store locally), so the gap
    after a burst is every mainloop up to the next burst's epilogue. The first entry is an empty
    burst whose gap is the work before the first epilogue. E.g. MoE ``["L1", "L2", "L2", ...]``
    with Linear-2's Combine volume (§4.2), or attention output tiles with the Q-loop (§4.3)."""
    bursts = [Burst(0.0, 1.0, 0.0)]
    for kind in kinds:
        last = bursts[-1]
        bursts[-1] = Burst(last.volume, last.t_iss0, last.gap + mainloop_us[kind])
        if burst_volume[kind] > 0:
            bursts.append(Burst(burst_volume[kind], t_iss0[kind], 0.0))
    return bursts


def gap_sweep_error(predicted: pd.DataFrame) -> dict:
    """Median |error| (%) of the simulator against the measured issue times and periods."""
    rel = lambda sim, meas: float(np.median(np.abs(predicted[sim] / predicted[meas] - 1)) * 100)
    return {"t_iss_err_pct": rel("t_iss_sim_us", "t_iss_us"),
            "period_err_pct": rel("period_sim_us", "period_us")}


def moe_orders(l1_per_l2: int, l2_tiles: int) -> dict[str, list[str]]:
    """One program's tiles in the two orders of §4.2: Expert-Wave (the Linear-1 tiles, then the
    Linear-2 tiles back to back) and Interleaved (``l1_per_l2`` Linear-1 tiles before each
    Linear-2 tile). Same tiles, same traffic."""
    return {"Expert-Wave": ["L1"] * (l1_per_l2 * l2_tiles) + ["L2"] * l2_tiles,
            "Interleaved": (["L1"] * l1_per_l2 + ["L2"]) * l2_tiles}


def schedule_summary(traces: dict[str, pd.DataFrame], t_iss0: float) -> pd.DataFrame:
    """Per schedule: the issue stall beyond T_iss^0 summed over its bursts, and when its last
    burst's issue ends."""
    return pd.DataFrame({
        name: {"total issue stall (µs)": float((t["t_iss_us"] - t_iss0).clip(lower=0).sum()),
               "last issue ends (µs)": float(t["start_us"].iloc[-1] + t["t_iss_us"].iloc[-1])}
        for name, t in traces.items()})


def check_gap_sweep(cal, predicted: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """The simulator on a calibration's remote gap sweep (``calibration.calibrate``'s predicted
    table), with its errors beside the closed form's."""
    platform = cal.platform_model()
    sim = predict_gap_sweep(predicted[predicted["path"] == "remote"], cal.t_iss0_us,
                            cal.drain_rate_GBps, platform.capacity, cal.loop_gap_us)
    errors = {**{f"simulator_{k}": v for k, v in gap_sweep_error(sim).items()},
              "closed_form_t_iss_err_pct": cal.gap_issue_err_pct,
              "closed_form_period_err_pct": cal.gap_period_err_pct}
    return sim, errors


def moe_schedules(cal, t_l1_mma_us: float, t_l2_mma_us: float, l2_tile_bytes: int,
                  producers: int, l1_per_l2: int, l2_tiles: int) -> dict:
    """Expert-Wave and Interleaved orders of the same Linear-1/Linear-2 tiles played on a
    calibrated platform: per-burst traces, T_iss^0 of a Linear-2 burst, and whether eq. 14 says
    interleaving suffices."""
    from .model import interleaving_sufficient

    platform = cal.platform_model()
    volume, t0 = producers * l2_tile_bytes, platform.t_iss0_at(producers, l2_tile_bytes)
    mainloop = {"L1": t_l1_mma_us, "L2": t_l2_mma_us}
    burst, floor = {"L1": 0.0, "L2": volume}, {"L1": 1.0, "L2": t0}
    traces = {name: simulate(tile_schedule_bursts(order, mainloop, burst, floor),
                             cal.drain_rate_GBps, platform.capacity_at(producers))
              for name, order in moe_orders(l1_per_l2, l2_tiles).items()}
    return {"traces": traces, "t_iss0_us": t0,
            "sufficient": interleaving_sufficient(volume, t0, cal.drain_rate_GBps, t_l2_mma_us,
                                                  t_l1_mma_us, l1_per_l2, 1)}
