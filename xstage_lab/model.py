"""The X-Stage Burst–Gap model (paper §3.2–3.5, eqs. 1–7) as plain functions.

Units throughout: volumes in bytes, times in microseconds, the drain rate R in GB/s (1e9 B/s).
Functions accept scalars or NumPy arrays. ``t_iss0`` is the backpressure-free issue time
T_iss^0(K, V); ``burst_volume`` is the aggregate burst volume V = K·B; ``gap`` is the producer-side
gap G; ``capacity`` is the effective outstanding capacity Q(K).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_BYTES_PER_US_PER_GBPS = 1e3  # 1 GB/s moves 1e3 bytes per microsecond


def drain_time(burst_volume, drain_rate):
    """V/R in µs: the steady-state period of the drain-dominated regime (eq. 1)."""
    return np.asarray(burst_volume, dtype=float) / (np.asarray(drain_rate, dtype=float)
                                                     * _BYTES_PER_US_PER_GBPS)


def issue_time(gap, burst_volume, t_iss0, drain_rate):
    """Sender-visible issue time T_iss(G; K, V) = max(T_iss^0, V/R − G) (eq. 3)."""
    return np.maximum(t_iss0, drain_time(burst_volume, drain_rate) - np.asarray(gap, dtype=float))


def issue_overhead(gap, burst_volume, t_iss0, drain_rate):
    """Backpressure overhead ΔT_iss = [V/R − G − T_iss^0]_+ (eq. 4)."""
    return np.maximum(0.0, drain_time(burst_volume, drain_rate) - gap - np.asarray(t_iss0))


def period(gap, burst_volume, t_iss0, drain_rate):
    """Start-to-start period T_period = T_iss + G = max(T_iss^0 + G, V/R) (eqs. 1–3): the max law."""
    return issue_time(gap, burst_volume, t_iss0, drain_rate) + np.asarray(gap, dtype=float)


def period_completion_coupled(gap, burst_volume, drain_rate):
    """The completion-coupled sum law T_period^cc = G + V/R (§3.4), for contrast with the max law."""
    return np.asarray(gap, dtype=float) + drain_time(burst_volume, drain_rate)


def recovery_gap(burst_volume, t_iss0, drain_rate):
    """Minimum recovery gap G* = [V/R − T_iss^0]_+ (eq. 5)."""
    return np.maximum(0.0, drain_time(burst_volume, drain_rate) - np.asarray(t_iss0))


def peak_outstanding(burst_volume, t_iss0, drain_rate):
    """Peak outstanding volume without a capacity limit, q_peak^0 = [V − R·T_iss^0]_+ (eq. 6)."""
    drained = np.asarray(drain_rate, dtype=float) * _BYTES_PER_US_PER_GBPS * np.asarray(t_iss0)
    return np.maximum(0.0, np.asarray(burst_volume, dtype=float) - drained)


def isolated_issue_time(burst_volume, t_iss0, capacity, drain_rate):
    """Issue time of an isolated burst, T_iss^iso = max(T_iss^0, (V − Q)/R) (eq. 7)."""
    excess = np.asarray(burst_volume, dtype=float) - np.asarray(capacity, dtype=float)
    return np.maximum(t_iss0, drain_time(excess, drain_rate))


def capacity_from_knee(knee_volume, t_iss0_at_knee, drain_rate):
    """Q from the isolated-burst knee: the volume still outstanding when issue of the knee burst
    ends, V_knee − R·T_iss^0(V_knee) (eq. 6 at the knee, §3.5)."""
    return peak_outstanding(knee_volume, t_iss0_at_knee, drain_rate)


@dataclass(frozen=True)
class IssueFloor:
    """Backpressure-free issue time of K producers as a function of volume: an affine fit
    T_iss^0(K, V) = fixed_us + V / (issue_rate·1e3), from the isolated bursts under the knee."""

    producers: int
    fixed_us: float
    issue_rate_GBps: float

    def __call__(self, burst_volume):
        return self.fixed_us + drain_time(burst_volume, self.issue_rate_GBps)


@dataclass(frozen=True)
class PlatformModel:
    """M_X = (T_iss^0(K, V), R, Q(K)) (§3.6): the three numbers that describe a platform."""

    drain_rate: float                        # R, GB/s
    t_iss0: dict[tuple[int, int], float]     # (K, B) -> measured plateau T_iss^0, µs
    capacity: dict[int, float]               # K -> Q(K), bytes
    issue_floor: dict[int, IssueFloor]       # K -> affine T_iss^0(K, V)

    def t_iss0_at(self, producers: int, burst_bytes: int) -> float:
        """T_iss^0 for K producers of B bytes: the measured plateau if there is one, else the
        affine floor of the nearest calibrated K (the smallest at or above K, else the largest)
        at the same B, since the isolated floors of every K coincide at equal B (Fig. 3c)."""
        if (producers, burst_bytes) in self.t_iss0:
            return self.t_iss0[(producers, burst_bytes)]
        k = _nearest(producers, self.issue_floor, "backpressure-free issue time")
        return float(self.issue_floor[k](k * burst_bytes))

    def capacity_at(self, producers: int) -> float:
        """Q for K producers: the nearest calibrated K at or above K (Q grows with K, so this
        bounds it from above), else the largest."""
        return self.capacity[_nearest(producers, self.capacity, "capacity")]


def _nearest(producers: int, table: dict, what: str) -> int:
    if not table:
        raise KeyError(f"no {what} calibrated for K={producers}")
    ks = sorted(table)
    return next((k for k in ks if k >= producers), ks[-1])


# FlashAttention–A2A (§4.3): each output tile's epilogue is a burst of B_t = b_m·d·s_out bytes per
# producer, separated by the next tile's full Q-loop.

def tile_burst_bytes(block_m: int, head_dim: int, out_bytes: int = 2) -> int:
    """Per-producer burst of one output tile, B_t = b_m·d·s_out (§4.3)."""
    return block_m * head_dim * out_bytes


def critical_path_stall(issue_stall, cover):
    """Δt′ = [Δt − G_QK]_+ (eq. 19): the epilogue stall that outlasts the double-buffer cover.
    Δt itself is eq. 18, ``issue_overhead`` with the Q-loop as the gap. The same form is the MoE
    per-tile stall Δt = [T_RS − T_cover^mma]_+ (eq. 15) with the measured remote-store span T_RS
    and the successor's mainloop as the cover (``analysis.moe.trace``)."""
    return np.maximum(0.0, np.asarray(issue_stall, dtype=float) - cover)


def completion_coupled_stall(burst_volume, drain_rate, cover, completion_latency=0.0):
    """Δt_cc = [V/R + T_lat − T_cover]_+ (eq. 17): the exposure per aligned burst of an issuer
    that must wait for remote visibility."""
    return np.maximum(0.0, drain_time(burst_volume, drain_rate) + completion_latency - cover)


def convergence_bound(recovery_gap_us, kv_tile_us, block_n: int) -> int:
    """M*_ub = b_n·⌈G*/σ⌉ (eq. 20): the sequence length past which the Q-loop always covers the
    drain, from the Q-loop time per KV tile σ."""
    return int(block_n * np.ceil(recovery_gap_us / kv_tile_us))


# The design test (§4.1, eq. 10) and the MoE interleaving condition (§4.2, eqs. 12–14).

@dataclass(frozen=True)
class DesignTest:
    """Eq. 10 for a recurring burst of ``burst_volume`` bytes followed by ``gap`` µs: the
    long-term injection-rate bound V/R ≤ T_iss^0 + G and the single-burst capacity bound
    [V − R·T_iss^0]_+ ≤ Q. Both hold: piggyback on the existing computation; else reshape."""

    rate_bound: bool
    capacity_bound: bool
    issue_overhead_us: float       # eq. 4 at this gap
    recovery_gap_us: float         # eq. 5
    peak_outstanding_bytes: float  # eq. 6
    isolated_issue_us: float       # eq. 7: one burst from empty

    @property
    def action(self) -> str:
        return "piggyback" if self.rate_bound and self.capacity_bound else "reshape"


def design_test(burst_volume, gap, t_iss0, drain_rate, capacity) -> DesignTest:
    """The design test of eq. 10 with the overhead and recovery it predicts (eqs. 4–7)."""
    q_peak = float(peak_outstanding(burst_volume, t_iss0, drain_rate))
    return DesignTest(
        rate_bound=bool(drain_time(burst_volume, drain_rate) <= t_iss0 + gap),
        capacity_bound=bool(q_peak <= capacity),
        issue_overhead_us=float(issue_overhead(gap, burst_volume, t_iss0, drain_rate)),
        recovery_gap_us=float(recovery_gap(burst_volume, t_iss0, drain_rate)),
        peak_outstanding_bytes=q_peak,
        isolated_issue_us=float(isolated_issue_time(burst_volume, t_iss0, capacity, drain_rate)))


def interleaved_gap(t_l2_mma, t_l1_mma=0.0, n1: float = 0, n2: float = 1):
    """Natural gap between Linear-2 bursts (eq. 12): T_L2^mma under Expert-Wave (n1 = 0), plus
    (n1/n2)·T_L1^mma of Linear-1 work interleaved per Linear-2 tile."""
    return t_l2_mma + n1 / n2 * t_l1_mma


def interleaving_sufficient(burst_volume, t_iss0, drain_rate, t_l2_mma, t_l1_mma, n1, n2) -> bool:
    """Condition 1 (eq. 14): n2·V/R ≤ n2·(T_iss^0 + T_L2^mma) + n1·T_L1^mma, i.e. interleaving
    the available Linear-1 work makes the gap reach G* (independent of the lead D)."""
    return bool(n2 * drain_time(burst_volume, drain_rate)
                <= n2 * (t_iss0 + t_l2_mma) + n1 * t_l1_mma)


def verdict_agrees(action: str, excess_us: float, tolerance_us: float) -> bool:
    """Whether a design-test verdict (eq. 10) agrees with a measurement: "piggyback" predicts no
    backpressure cost, so the measured excess over a backpressure-free control must stay at or
    below ``tolerance_us`` (the measurement's own spread); "reshape" predicts a cost, so the
    excess must exceed it. One-sided: an excess below −tolerance is no cost either."""
    return bool(excess_us > tolerance_us) == (action == "reshape")
