"""An X-Stage simulator that runs on the CPU: a fluid queue fed by any burst schedule.

The queue holds the outstanding volume q (bytes). It drains at R whenever it is not empty. A burst
of volume V injects at its backpressure-free rate V / T_iss^0 while q is below the capacity Q;
at Q the injection can go no faster than the drain (backpressure). A gap injects nothing. This is
the fluid abstraction of §3.2 played out in time rather than solved for steady state: for periodic
bursts it settles on eq. 3 (T_iss = max(T_iss^0, V/R − G)) and for one burst from empty on eq. 7
(max(T_iss^0, (V − Q)/R)), and it takes schedules the closed forms do not: mixed volumes, uneven
gaps, the tile order of a fused kernel. Many producers share the queue too
(``simulate_producers``), each running its own burst–gap loop where they run free
(``simulate_free_running``): the gap sweep's producers drift apart after an aligned first burst,
and ``skewed_launch`` spreads them over the start skew their record measured.

Units as in ``model``: bytes, microseconds, R in GB/s.
"""
from __future__ import annotations

import heapq
import math
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
    begin, finish, q_end = _play(start, vol, t0, drain_rate * _BYTES_PER_US_PER_GBPS, capacity)
    t_iss = finish - start
    return pd.DataFrame(dict(start_us=start, volume=vol, t_iss0_us=t0, t_iss_us=t_iss,
                             stall_us=np.where(vol > 0, t_iss - t0, 0.0), q_end_bytes=q_end))


def _play(start, vol, t0, drain: float, capacity: float, successor=None, delay=None):
    """The event loop of ``simulate_producers`` (``drain`` in bytes per µs). Burst i starts at
    ``start[i]`` where that is finite; a burst named as ``successor[j]`` (>= 0) of burst j starts
    ``delay[j]`` µs after j's issue ends instead. Returns (start, finish, q at finish) per burst."""
    n = len(vol)
    # Python floats and lists throughout: the loop runs once per event (a gap sweep's skewed
    # launches take millions), where NumPy scalars cost several times as much for the same
    # IEEE arithmetic; min and max are written out as the comparisons they make, for speed.
    rate, vol, t0 = (vol / t0).tolist(), vol.tolist(), t0.tolist()
    successor = [-1] * n if successor is None else successor.tolist()
    delay = [0.0] * n if delay is None else delay.tolist()
    drain, capacity = float(drain), float(capacity)
    begin, finish, q_end = [math.nan] * n, [math.nan] * n, [math.nan] * n
    pending = [(t, i) for i, t in enumerate(start.tolist()) if math.isfinite(t)]
    heapq.heapify(pending)  # ties leave in index order, as a stable sort of the starts would
    push, pop, inf = heapq.heappush, heapq.heappop, math.inf

    # Every active burst works through its own T_iss^0 at one common speed (1, or R/D while held
    # at Q), so on a clock s running at that speed burst i finishes at s(its start) + T_iss^0_i.
    active = []  # heap of (s at finish, burst)
    now, s, q, demand = (pending[0][0] if pending else 0.0), 0.0, 0.0, 0.0
    while pending or active:
        while pending and pending[0][0] <= now:
            t, i = pop(pending)
            begin[i] = t
            if vol[i] == 0:  # nothing to issue: it ends where it starts
                finish[i], q_end[i] = now, q
                if successor[i] >= 0:
                    push(pending, (now + delay[i], successor[i]))
            else:
                push(active, (s + t0[i], i))
                demand += rate[i]
        if not active:
            demand = 0.0  # drop what rounding left in the running sum
            if not pending:
                break
        held = q >= capacity and demand > drain
        speed = drain / demand if held else 1.0
        dq = 0.0 if held or (q <= 0 and demand <= drain) else demand - drain
        # dt: the nearest of the next start, finish, full queue and empty queue
        to_start = pending[0][0] - now if pending else inf
        to_finish = (active[0][0] - s) / speed if active else inf
        to_full = (capacity - q) / dq if dq > 0 else inf
        to_empty = q / -dq if dq < 0 else inf
        dt = to_start
        if to_finish < dt:
            dt = to_finish
        if to_full < dt:
            dt = to_full
        if to_empty < dt:
            dt = to_empty
        now, s, q = now + dt, s + speed * dt, q + dq * dt
        q = q if q > 0.0 else 0.0
        q = q if q < capacity else capacity
        # land exactly on the event so that it is taken now and not in a sliver of a step later
        if dt == to_start:
            now = pending[0][0]
        if dt == to_finish:
            s = active[0][0]
        if dt == to_full:
            q = capacity
        if dt == to_empty:
            q = 0.0
        while active and active[0][0] <= s:
            i = pop(active)[1]
            demand -= rate[i]
            finish[i], q_end[i] = now, q
            if successor[i] >= 0:
                push(pending, (now + delay[i], successor[i]))
    return np.array(begin), np.array(finish), np.array(q_end)


def _play_alike(offsets: list, n: int, volume: float, t0: float, delay: float, drain: float,
                capacity: float):
    """``_play`` for ``simulate_free_running``'s bursts, all alike (``volume`` > 0 in ``t0``
    µs, ``delay`` after each): producer p's bursts are p·n … p·n + n − 1, the first at
    ``offsets[p]``. The same events and the same arithmetic, so the same results to the bit
    (tests/test_simulator.py compares them), twice as fast: bursts alike finish in the order
    they start, so the active bursts and the starts to come are FIFO lists read from a head,
    not heaps, and the order among bursts due at one instant changes nothing (they start,
    progress and finish together, and ``demand`` adds and takes the same rate)."""
    inf = math.inf
    rate = volume / t0
    order = sorted(range(len(offsets)), key=lambda p: (offsets[p], p))
    first_t = [float(offsets[p]) for p in order] + [inf]  # the first bursts, in start order
    first_i = [p * n for p in order]
    nf, next_first = 0, first_t[0]
    # the bursts in start order: index, start, s at finish; the j-th to finish is the j-th
    # started; then when each finished and q then
    seq_i, seq_t, fin_s, fin_t, fin_q = [], [], [], [], []
    started = done = 0
    succ_t, succ_i, sh, ns = [], [], 0, 0  # the next bursts (FIFO from head sh of ns)
    last = n - 1
    now, s, q, demand = next_first, 0.0, 0.0, 0.0
    while True:
        while True:  # every start due by now
            if sh < ns and (succ_t[sh] < next_first
                            or (succ_t[sh] == next_first and succ_i[sh] < first_i[nf])):
                t = succ_t[sh]
                if t > now:
                    break
                i = succ_i[sh]
                sh += 1
            else:
                t = next_first
                if t > now:
                    break
                i = first_i[nf]
                nf += 1
                next_first = first_t[nf]
            seq_i.append(i)
            seq_t.append(t)
            fin_s.append(s + t0)
            started += 1
            demand += rate
        if done == started:
            demand = 0.0
            if sh == ns and next_first == inf:
                break
        nstart = succ_t[sh] if sh < ns and succ_t[sh] < next_first else next_first
        to_start = nstart - now
        if q >= capacity and demand > drain:  # held at Q: q stays, the clock runs at R/D
            speed = drain / demand
            to_finish = (fin_s[done] - s) / speed if done < started else inf
            if to_start <= to_finish:
                s = fin_s[done] if to_start == to_finish else s + speed * to_start
                now = nstart
            else:
                now, s = now + to_finish, fin_s[done]
        else:
            dq = 0.0 if q <= 0 and demand <= drain else demand - drain
            to_finish = fin_s[done] - s if done < started else inf
            to_full = (capacity - q) / dq if dq > 0 else inf
            to_empty = q / -dq if dq < 0 else inf
            dt = to_start
            if to_finish < dt:
                dt = to_finish
            if to_full < dt:
                dt = to_full
            if to_empty < dt:
                dt = to_empty
            now, s, q = now + dt, s + dt, q + dq * dt
            q = q if q > 0.0 else 0.0
            q = q if q < capacity else capacity
            if dt == to_start:
                now = nstart
            if dt == to_finish:
                s = fin_s[done]
            if dt == to_full:
                q = capacity
            if dt == to_empty:
                q = 0.0
        while done < started and fin_s[done] <= s:
            i = seq_i[done]
            done += 1
            demand -= rate
            fin_t.append(now)
            fin_q.append(q)
            if i % n != last:
                succ_t.append(now + delay)
                succ_i.append(i + 1)
                ns += 1
    begin, finish, q_end = (np.full(len(offsets) * n, np.nan) for _ in range(3))
    idx = np.array(seq_i, dtype=np.int64)
    begin[idx], finish[idx[:done]], q_end[idx[:done]] = seq_t, fin_t, fin_q
    return begin, finish, q_end


def simulate_free_running(offsets_us, volume: float, t_iss0_us: float, gap_us: float,
                          bursts: int, drain_rate: float, capacity: float) -> pd.DataFrame:
    """Producers that each run their own burst–gap loop through one fluid queue, with no barrier
    between them: producer p's first burst starts at ``offsets_us[p]``, and each of its next
    bursts ``gap_us`` after its own previous issue ends. Every burst is ``volume`` bytes at the
    backpressure-free rate ``volume / t_iss0_us`` (the queue as in ``simulate_producers``).
    Offsets all equal make every burst one aligned aggregate burst; offsets spread apart are the
    drifted producers of a free-running gap sweep (the record's ``start_skew_ns``).

    One row per (producer, burst), in that order: start, issue time, stall beyond T_iss^0,
    period (to the producer's next start; NaN for its last) and the outstanding volume when the
    issue ends."""
    off = np.asarray(offsets_us, dtype=float)
    if off.ndim != 1 or not len(off) or not np.isfinite(off).all():
        raise ValueError("offsets_us must be a non-empty 1-D array of finite start times")
    if not (np.isfinite(volume) and volume >= 0):
        raise ValueError(f"volume must be finite and >= 0, got {volume}")
    if not (np.isfinite(t_iss0_us) and t_iss0_us > 0):
        raise ValueError(f"t_iss0_us must be finite and > 0, got {t_iss0_us}")
    if not (np.isfinite(gap_us) and gap_us >= 0):
        raise ValueError(f"gap_us must be finite and >= 0, got {gap_us}")
    if int(bursts) != bursts or bursts < 1:
        raise ValueError(f"bursts must be a whole number >= 1, got {bursts}")
    if not (np.isfinite(drain_rate) and drain_rate > 0):
        raise ValueError(f"drain_rate must be finite and > 0, got {drain_rate}")
    if not capacity >= 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    k, n = len(off), int(bursts)
    index = np.arange(k * n)
    burst = index % n
    start = np.where(burst == 0, np.repeat(off, n), np.nan)
    successor = np.where(burst < n - 1, index + 1, -1)
    if volume > 0:  # every burst alike: the event loop of _play on FIFO queues
        begin, finish, q_end = _play_alike(off.tolist(), n, float(volume), float(t_iss0_us),
                                           float(gap_us), drain_rate * _BYTES_PER_US_PER_GBPS,
                                           float(capacity))
    else:
        begin, finish, q_end = _play(start, np.full(k * n, float(volume)),
                                     np.full(k * n, float(t_iss0_us)),
                                     drain_rate * _BYTES_PER_US_PER_GBPS, capacity, successor,
                                     np.full(k * n, float(gap_us)))
    period = np.where(burst < n - 1, np.append(begin[1:], np.nan) - begin, np.nan)
    t_iss = finish - begin
    return pd.DataFrame(dict(producer=index // n, burst=burst, start_us=begin, t_iss_us=t_iss,
                             stall_us=np.where(volume > 0, t_iss - t_iss0_us, 0.0),
                             period_us=period, q_end_bytes=q_end))


def window_means(bursts: pd.DataFrame, warmup: int = 1) -> dict:
    """Issue time and period of free-running producers as
    ``ops.remote_store.burst.burst_rows`` takes them from a launch: means over
    the bursts that start inside the window where every producer runs (from the latest start of a
    first burst after ``warmup`` to the earliest start of a last one); over every burst after the
    warm-up where that window is empty."""
    steady = bursts[bursts["burst"] >= warmup]
    lo = steady[steady["burst"] == warmup]["start_us"].max()
    hi = bursts[bursts["burst"] == bursts["burst"].max()]["start_us"].min()
    inside = steady[(steady["start_us"] >= lo) & (steady["start_us"] < hi)]
    if inside.empty:
        inside = steady
    return {"t_iss_us": float(inside["t_iss_us"].mean()),
            "period_us": float(inside["period_us"].mean())}


def skewed_launch(producers: int, burst_bytes: float, t_iss0_us: float, gap_us: float,
                  skew_us: float, drain_rate: float, capacity: float, bursts: int = 96,
                  warmup: int = 16) -> dict:
    """One free-running launch of ``producers`` producers whose starts spread evenly over
    ``skew_us`` (a gap-sweep point's measured start skew), each storing ``burst_bytes`` per burst
    at the aggregate burst's T_iss^0 and then spinning ``gap_us``: ``bursts`` bursts from an empty
    queue, the first ``warmup`` left out, as in the measured launch (``BenchSettings``); issue
    time and period are the launch's ``window_means``.

    A skew of at least one period puts a burst at every phase of the period; the starts then
    spread over one period, the closed form's max(T_iss^0 + G, V/R) (eqs. 1–3). A skew of 0 is
    the aligned aggregate burst of ``steady_state``. The fluid queue shares the drain fairly, so
    the skew stays as given: the simulation takes the measured drift, it does not make it."""
    k = int(producers)
    period = max(t_iss0_us + gap_us, k * burst_bytes / (drain_rate * _BYTES_PER_US_PER_GBPS))
    skew = max(0.0, float(skew_us))
    offsets = np.linspace(0.0, min(skew, period), k, endpoint=skew < period)
    return window_means(simulate_free_running(offsets, burst_bytes, t_iss0_us, gap_us, bursts,
                                              drain_rate, capacity), warmup)


def steady_state(burst: Burst, drain_rate: float, capacity: float, bursts: int = 400) -> dict:
    """Issue time and period of ``burst`` repeated until the queue settles (the last burst)."""
    last = simulate([burst] * bursts, drain_rate, capacity).iloc[-1]
    return {"t_iss_us": float(last["t_iss_us"]), "period_us": float(last["period_us"])}


def predict_gap_sweep(points: pd.DataFrame, t_iss0: dict, drain_rate: float,
                      capacity: dict, loop_gap_us: float, bursts: int = 96,
                      warmup: int = 16) -> pd.DataFrame:
    """The simulator for each measured (K, B, G) of a periodic gap sweep, with the same inputs as
    the closed-form prediction (T_iss^0 plateau, R, Q(K), the loop's own gap): the aligned
    steady state (``t_iss_sim_us``, ``period_sim_us``: every producer's burst at once, one
    aggregate burst) and, where ``points`` has the measured ``start_skew_us``, the launch of
    producers spread over it (``skewed_launch``: ``t_iss_skew_sim_us``, ``period_skew_sim_us``)."""
    out = points.copy()
    sims = [steady_state(Burst(k * b, t_iss0[kb_key(k, b)], g + loop_gap_us),
                         drain_rate, capacity[int(k)])
            for k, b, g in zip(points["producers"], points["burst_bytes"], points["gap_us"])]
    out["t_iss_sim_us"] = [s["t_iss_us"] for s in sims]
    out["period_sim_us"] = [s["period_us"] for s in sims]
    if "start_skew_us" in points:
        skewed = [skewed_launch(k, b, t_iss0[kb_key(k, b)], g + loop_gap_us, skew, drain_rate,
                                capacity[int(k)], bursts, warmup)
                  for k, b, g, skew in zip(points["producers"], points["burst_bytes"],
                                           points["gap_us"], points["start_skew_us"])]
        out["t_iss_skew_sim_us"] = [s["t_iss_us"] for s in skewed]
        out["period_skew_sim_us"] = [s["period_us"] for s in skewed]
    return out


def point_start_skew(table: pd.DataFrame) -> pd.DataFrame:
    """Each measurement point of a ``remote_store`` table with its producers' start skew
    (``start_skew_us``): per launch the median over its steady bursts of the spread of the
    producers' start times (``start_skew_ns``), then the median over the point's launches."""
    from .calibration import POINT_KEYS, launch_means

    launches = launch_means(table)
    return (launches.groupby(POINT_KEYS, dropna=False)["start_skew_ns"].median() / 1e3
            ).rename("start_skew_us").reset_index()


def skew_regime(skew_us, t_iss_us, period_us):
    """Where a free-running point's bursts sit against each other: ``aligned`` where the
    producers' starts spread over less than one burst's issue time (their bursts overlap, one
    aggregate burst), ``staggered`` where they spread over more than that but less than a
    period, ``drifted`` where they spread over a period or more (a burst at every phase)."""
    skew, t, p = (np.asarray(x, dtype=float) for x in (skew_us, t_iss_us, period_us))
    return np.where(skew < t, "aligned", np.where(skew < p, "staggered", "drifted"))


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


def gap_sweep_error(predicted: pd.DataFrame, sim: str = "sim") -> dict:
    """Median |error| (%) of the simulator against the measured issue times and periods:
    ``sim="sim"`` the aligned simulation, ``"skew_sim"`` the skewed one."""
    rel = lambda col, meas: float(np.median(np.abs(predicted[col] / predicted[meas] - 1)) * 100)
    return {"t_iss_err_pct": rel(f"t_iss_{sim}_us", "t_iss_us"),
            "period_err_pct": rel(f"period_{sim}_us", "period_us")}


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


def check_gap_sweep(cal, predicted: pd.DataFrame, record=None) -> tuple[pd.DataFrame, dict]:
    """The simulator on a calibration's remote gap sweep (``calibration.calibrate``'s predicted
    table), with its errors beside the closed form's. With the ``remote_store`` ``record`` the
    sweep came from, also the launch of producers spread over each point's measured start skew
    (``skewed_launch``, the record's bursts per launch), and each point's ``regime``
    (``skew_regime``)."""
    from .calibration import POINT_KEYS
    from .calibration import BenchSettings

    platform = cal.platform_model()
    remote = predicted[predicted["path"] == "remote"]
    launch = {}
    if record is not None:
        remote = remote.merge(point_start_skew(record.table), on=POINT_KEYS, how="left")
        settings = {**BenchSettings().__dict__, **record.params.get("settings", {})}
        launch = {"bursts": settings["periodic_bursts"],
                  "warmup": settings["periodic_warmup_bursts"]}
    sim = predict_gap_sweep(remote, cal.t_iss0_us, cal.drain_rate_GBps, platform.capacity,
                            cal.loop_gap_us, **launch)
    errors = {f"simulator_{k}": v for k, v in gap_sweep_error(sim).items()}
    if "t_iss_skew_sim_us" in sim:
        sim["regime"] = skew_regime(sim["start_skew_us"], sim["t_iss_us"], sim["period_us"])
        errors.update({f"simulator_skewed_{k}": v
                       for k, v in gap_sweep_error(sim, "skew_sim").items()})
    errors.update({"closed_form_t_iss_err_pct": cal.gap_issue_err_pct,
                   "closed_form_period_err_pct": cal.gap_period_err_pct})
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


L1_TILE, L2_TILE = 0, 1


def simulate_tile_table(programs: Sequence[Sequence[tuple[int, int, float]]],
                        l1_tiles_per_row: int, mainloop_us: Sequence[float],
                        epilogue_us: Sequence[float], drain_rate: float,
                        capacity: float) -> dict:
    """Play a fused MoE kernel's tile table on the CPU: every program walks its tiles
    (``(kind, row block, remote bytes)``, kind ``L1_TILE`` or ``L2_TILE``) in order; a tile runs
    its mainloop (``mainloop_us[kind]``) then its epilogue (``epilogue_us[kind]``). A Linear-2
    tile starts only once all ``l1_tiles_per_row`` Linear-1 tiles of its row block have ended
    (the row counter the kernel spins on). A Linear-2 epilogue's remote bytes enter one X-Stage
    that every program shares, FIFO, drained at R: the epilogue's stores are issued once the
    outstanding volume is back under Q, so a burst into a full X-Stage stalls its program by
    (q + V − Q)/R (eqs. 3, 7 for bursts that are small against Q, as a tile's are).

    Returns the makespan, the stall summed over programs and per Linear-2 tile, and the time
    Linear-2 tiles waited for their rows, all in µs (``drain_rate`` in GB/s, bytes)."""
    if drain_rate <= 0 or capacity < 0 or l1_tiles_per_row < 1:
        raise ValueError("drain_rate must be > 0, capacity >= 0, l1_tiles_per_row >= 1")
    drain = drain_rate * _BYTES_PER_US_PER_GBPS
    rows = 1 + max((row for prog in programs for _, row, _ in prog), default=-1)
    remaining = [l1_tiles_per_row] * rows
    row_done = [np.inf] * rows
    parked: list[list[int]] = [[] for _ in range(rows)]
    nxt = [0] * len(programs)
    ready = [0.0] * len(programs)  # when each program was free to start its next tile
    events = [(0.0, g, 0) for g, prog in enumerate(programs) if prog]  # (time, program, phase)
    heapq.heapify(events)
    empty_at = 0.0  # when the X-Stage would be empty (q(t) = R·max(0, empty_at − t))
    makespan = stall = wait = 0.0
    l2_tiles = 0
    while events:
        t, g, phase = heapq.heappop(events)
        kind, row, volume = programs[g][nxt[g]]
        if phase == 0:  # the tile starts, or waits for its row's Linear-1 tiles
            if kind == L2_TILE and remaining[row]:
                parked[row].append(g)
                continue
            start = max(t, row_done[row]) if kind == L2_TILE else t
            wait += start - ready[g]
            heapq.heappush(events, (start + mainloop_us[kind], g, 1))
            continue
        issue = 0.0
        if kind == L2_TILE:
            l2_tiles += 1
            if volume > 0:
                empty_at = max(empty_at, t) + volume / drain
                issue = max(0.0, empty_at - capacity / drain - t)
        end = t + issue + epilogue_us[kind]
        stall += issue
        makespan = max(makespan, end)
        if kind == L1_TILE:
            remaining[row] -= 1
            if not remaining[row]:
                row_done[row] = end
                for waiting in parked[row]:
                    heapq.heappush(events, (end, waiting, 0))
                parked[row].clear()
        nxt[g] += 1
        ready[g] = end
        if nxt[g] < len(programs[g]):
            heapq.heappush(events, (end, g, 0))
    if any(parked):
        raise ValueError("the tile table deadlocks: Linear-2 tiles wait on rows no tile ends")
    return {"makespan_us": makespan, "stall_us": stall,
            "stall_per_l2_us": stall / l2_tiles if l2_tiles else 0.0, "l2_wait_us": wait}
