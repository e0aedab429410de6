"""The Burst–Gap model (paper §3.2–3.5, eqs. 1–7) against hand-worked values.

Units: bytes, microseconds, R in GB/s (1 GB/s = 1e3 bytes per µs).
Running example: V = 4 MiB = 4194304 B, R = 400 GB/s = 400e3 B/µs
    → V/R = 4194304 / 400e3 = 10.48576 µs.
"""
from __future__ import annotations

import numpy as np
import pytest

from xstage_lab import model

MIB = 1024 * 1024
V = 4 * MIB          # 4194304 bytes
R = 400.0            # GB/s
V_OVER_R = 10.48576  # 4194304 / 400e3 µs


def test_drain_time_eq1_hand_value():
    # V/R = 4194304 / (400 * 1e3) = 10.48576 µs
    assert model.drain_time(V, R) == pytest.approx(V_OVER_R, rel=1e-12)
    # 1 GB/s moves 1e3 bytes per µs: 1e6 bytes at 1 GB/s take 1000 µs
    assert model.drain_time(1e6, 1.0) == pytest.approx(1000.0, rel=1e-12)
    # halving R doubles the drain time: 4194304 / 200e3 = 20.97152 µs
    assert model.drain_time(V, 200.0) == pytest.approx(20.97152, rel=1e-12)


def test_issue_time_eq3_drain_branch():
    # G = 2 µs, T_iss^0 = 1 µs: V/R − G = 10.48576 − 2 = 8.48576 > 1 → the drain branch
    assert model.issue_time(2.0, V, 1.0, R) == pytest.approx(8.48576, rel=1e-12)


def test_issue_time_eq3_floor_branch():
    # G = 10 µs, T_iss^0 = 1 µs: V/R − G = 0.48576 < 1 → issue cannot beat the floor: 1 µs
    assert model.issue_time(10.0, V, 1.0, R) == pytest.approx(1.0, rel=1e-12)
    # G = 12 µs: V/R − G = −1.51424 (negative) → still the floor, T_iss^0 = 0.7 µs
    assert model.issue_time(12.0, V, 0.7, R) == pytest.approx(0.7, rel=1e-12)


def test_issue_overhead_eq4_and_clamp():
    # ΔT = [V/R − G − T0]_+ : G = 2, T0 = 1 → 10.48576 − 2 − 1 = 7.48576
    assert model.issue_overhead(2.0, V, 1.0, R) == pytest.approx(7.48576, rel=1e-12)
    # G = 10, T0 = 1 → 10.48576 − 10 − 1 = −0.51424 → clamped to exactly 0
    assert model.issue_overhead(10.0, V, 1.0, R) == 0.0
    # overhead is issue time minus the floor (eqs. 3, 4), on both branches
    for g in (0.0, 2.0, 9.0, 9.48576, 10.0, 50.0):
        assert model.issue_overhead(g, V, 1.0, R) == pytest.approx(
            model.issue_time(g, V, 1.0, R) - 1.0, abs=1e-12)


def test_recovery_gap_eq5():
    # G* = [V/R − T0]_+ : T0 = 1 → 10.48576 − 1 = 9.48576 µs
    g_star = model.recovery_gap(V, 1.0, R)
    assert g_star == pytest.approx(9.48576, rel=1e-12)
    # at G*, issue is back on the floor with no overhead; just below it, overhead is positive
    assert model.issue_time(g_star, V, 1.0, R) == pytest.approx(1.0, rel=1e-12)
    assert model.issue_overhead(g_star, V, 1.0, R) == pytest.approx(0.0, abs=1e-12)
    assert model.issue_overhead(g_star - 0.5, V, 1.0, R) == pytest.approx(0.5, rel=1e-9)
    # T0 = 12 > V/R = 10.48576: no gap needed, G* = 0 (clamp)
    assert model.recovery_gap(V, 12.0, R) == 0.0


def test_peak_outstanding_eq6():
    # q_peak^0 = [V − R·T0]_+ : R·T0 = 400e3 B/µs · 1 µs = 400000 B → 4194304 − 400000 = 3794304
    assert model.peak_outstanding(V, 1.0, R) == pytest.approx(3794304.0, rel=1e-12)
    # T0 = 20 µs drains 8e6 B > V: nothing outstanding (clamp)
    assert model.peak_outstanding(V, 20.0, R) == 0.0


def test_isolated_issue_time_eq7_both_branches():
    Q = 2 * MIB  # 2097152 B
    # (V − Q)/R = 2097152 / 400e3 = 5.24288 µs > T0 = 1 → the capacity (drain) branch
    assert model.isolated_issue_time(V, 1.0, Q, R) == pytest.approx(5.24288, rel=1e-12)
    # T0 = 6 > 5.24288 → the floor branch
    assert model.isolated_issue_time(V, 6.0, Q, R) == pytest.approx(6.0, rel=1e-12)
    # Q ≥ V: the burst fits, (V − Q)/R ≤ 0 → floor
    assert model.isolated_issue_time(V, 0.8, 8 * MIB, R) == pytest.approx(0.8, rel=1e-12)


def test_capacity_from_knee_inverts_eq7_knee():
    # eq. 7's branches meet where T0 = (V_knee − Q)/R → V_knee = Q + R·T0.
    # Q = 2097152 B, T0 = 1 µs, R = 400 GB/s → V_knee = 2097152 + 400000 = 2497152 B
    Q, t0 = 2 * MIB, 1.0
    v_knee = 2497152.0
    assert model.isolated_issue_time(v_knee, t0, Q, R) == pytest.approx(t0, rel=1e-12)
    # (2497152 − 2097152) / 400e3 = 1.0: both branches equal at the knee
    assert model.drain_time(v_knee - Q, R) == pytest.approx(t0, rel=1e-12)
    assert model.capacity_from_knee(v_knee, t0, R) == pytest.approx(Q, rel=1e-12)
    # past the knee the drain branch rises: V_knee + 400000 B → 2.0 µs
    assert model.isolated_issue_time(v_knee + 400000, t0, Q, R) == pytest.approx(2.0, rel=1e-12)
    # the paper's §3.5 numbers: K = 148, knee 33 KiB per producer (148·33792 = 5001216 B ≈ 4.77 MiB),
    # T0 ≈ 0.76 µs, R ≈ 717 GB/s → Q = 5001216 − 717e3·0.76 = 5001216 − 544920 = 4456296 B ≈ 4.25 MiB
    q = model.capacity_from_knee(148 * 33 * 1024, 0.76, 717.0)
    assert q == pytest.approx(4456296.0, rel=1e-12)
    assert q / MIB == pytest.approx(4.25, abs=0.005)


def test_period_is_max_law_not_sum_law():
    # T_period = T_iss + G = max(T0 + G, V/R)
    # G = 2, T0 = 1: max(3, 10.48576) = 10.48576 (drain plateau)
    assert model.period(2.0, V, 1.0, R) == pytest.approx(V_OVER_R, rel=1e-12)
    # G = 20, T0 = 1: max(21, 10.48576) = 21 (issue + gap branch)
    assert model.period(20.0, V, 1.0, R) == pytest.approx(21.0, rel=1e-12)
    # completion-coupled sum: G + V/R = 2 + 10.48576 = 12.48576 and 20 + 10.48576 = 30.48576
    assert model.period_completion_coupled(2.0, V, R) == pytest.approx(12.48576, rel=1e-12)
    assert model.period_completion_coupled(20.0, V, R) == pytest.approx(30.48576, rel=1e-12)
    gaps = np.linspace(0.0, 40.0, 81)
    for t0 in (0.3, 1.0, 5.0):
        per = model.period(gaps, V, t0, R)
        np.testing.assert_allclose(per, np.maximum(t0 + gaps, V_OVER_R), rtol=1e-12)
        # eq. 2: period − gap is the issue time
        np.testing.assert_allclose(per - gaps, model.issue_time(gaps, V, t0, R), rtol=1e-12)
        # the sum law is never below the max law, and strictly above it whenever G > 0
        cc = model.period_completion_coupled(gaps, V, R)
        assert np.all(cc[1:] > per[1:])


def test_arrays_broadcast():
    gaps = np.array([0.0, 5.0, 20.0])                  # shape (3,)
    vols = np.array([[1 * MIB], [4 * MIB]], float)     # shape (2, 1)
    t0 = 1.0
    out = model.issue_time(gaps, vols, t0, R)
    assert out.shape == (2, 3)
    # 1 MiB: V/R = 1048576 / 400e3 = 2.62144 → [2.62144, 1, 1]
    # 4 MiB: V/R = 10.48576 → [10.48576, 5.48576, 1]
    np.testing.assert_allclose(out, [[2.62144, 1.0, 1.0], [10.48576, 5.48576, 1.0]], rtol=1e-12)
    np.testing.assert_allclose(model.issue_overhead(gaps, vols, t0, R),
                               [[1.62144, 0.0, 0.0], [9.48576, 4.48576, 0.0]], rtol=1e-12)
    np.testing.assert_allclose(model.period(gaps, vols, t0, R),
                               [[2.62144, 6.0, 21.0], [10.48576, 10.48576, 21.0]], rtol=1e-12)
    # per-element drain rates broadcast too: 4 MiB at 400 and 800 GB/s
    np.testing.assert_allclose(model.drain_time(4 * MIB, np.array([400.0, 800.0])),
                               [10.48576, 5.24288], rtol=1e-12)
    # vector T0 in eq. 5 and eq. 6
    np.testing.assert_allclose(model.recovery_gap(V, np.array([1.0, 12.0]), R), [9.48576, 0.0],
                               rtol=1e-12)
    np.testing.assert_allclose(model.peak_outstanding(V, np.array([1.0, 20.0]), R),
                               [3794304.0, 0.0], rtol=1e-12)


def test_issue_floor_affine():
    # T0(V) = fixed + V/(rate·1e3): 0.25 + 1081344 / 5940e3 = 0.25 + 0.182044... = 0.432044...
    floor = model.IssueFloor(132, 0.25, 5940.0)
    assert floor(132 * 8192) == pytest.approx(0.25 + 1081344 / 5.94e6, rel=1e-12)
    assert floor(132 * 8192) == pytest.approx(0.4320444, rel=1e-6)
    assert floor(0) == pytest.approx(0.25)


def test_platform_model_t_iss0_at():
    pm = model.PlatformModel(drain_rate=700.0, t_iss0={(132, 8192): 0.5},
                             capacity={132: 4 * MIB},
                             issue_floor={132: model.IssueFloor(132, 0.25, 5940.0)})
    # a measured plateau wins over the floor (floor would give 0.432)
    assert pm.t_iss0_at(132, 8192) == 0.5
    # no plateau for B = 16384 → floor: 0.25 + 2162688 / 5940e3 = 0.25 + 0.364089 = 0.614089
    assert pm.t_iss0_at(132, 16384) == pytest.approx(0.25 + 2162688 / 5.94e6, rel=1e-12)
    assert isinstance(pm.t_iss0_at(132, 16384), float)
    # no floor for K = 7: the nearest calibrated K (132) at the same B: 0.25 + 132·8192/5940e3
    assert pm.t_iss0_at(7, 8192) == pytest.approx(0.25 + 1081344 / 5.94e6, rel=1e-12)
    assert pm.capacity_at(7) == 4 * MIB and pm.capacity_at(200) == 4 * MIB
    # a plateau alone serves its own (K, B); with no floor at all, other B raise
    pm2 = model.PlatformModel(700.0, {(16, 4096): 0.3}, {}, {})
    assert pm2.t_iss0_at(16, 4096) == 0.3
    with pytest.raises(KeyError, match="K=16"):
        pm2.t_iss0_at(16, 8192)
    with pytest.raises(KeyError):
        pm2.capacity_at(16)


def test_attention_tile_burst_and_eqs_17_to_20_hand_worked():
    # B_t = b_m·d·s_out = 128·128·2 = 32768 bytes
    assert model.tile_burst_bytes(128, 128) == 32768
    # V = 132·32768 = 4325376 B at R = 400 GB/s: V/R = 4325376/400e3 = 10.81344 µs
    v = 132 * 32768
    # eq. 17: [V/R + T_lat − T_cover]_+ = 10.81344 + 1 − 2 = 9.81344; clamps at 0 for a big cover
    assert model.completion_coupled_stall(v, 400.0, 2.0, 1.0) == pytest.approx(9.81344)
    assert model.completion_coupled_stall(v, 400.0, 20.0) == 0.0
    # eq. 19: [Δt − G_QK]_+ = [3 − 1]_+ = 2, and [0.5 − 1]_+ = 0
    assert model.critical_path_stall(3.0, 1.0) == 2.0
    assert model.critical_path_stall(0.5, 1.0) == 0.0
    # eq. 20: G* = 10.0 µs, σ = 2.3 µs per KV tile: ⌈10/2.3⌉ = 5 KV tiles of b_n = 128 → 640
    assert model.convergence_bound(10.0, 2.3, 128) == 640
    assert model.convergence_bound(9.2, 2.3, 128) == 512  # exactly 4 KV tiles


def test_design_test_eq_10_hand_worked():
    # V = 4 MiB, R = 400 GB/s: V/R = 10.48576 µs; T_iss^0 = 1 µs
    v = 4 * 1024 * 1024
    ok = model.design_test(v, gap=10.0, t_iss0=1.0, drain_rate=400.0, capacity=4e6)
    # rate bound: 10.48576 <= 1 + 10; capacity: [4194304 − 400e3·1]_+ = 3794304 <= 4e6
    assert ok.rate_bound and ok.capacity_bound and ok.action == "piggyback"
    assert ok.issue_overhead_us == 0.0 and ok.recovery_gap_us == pytest.approx(9.48576)
    assert ok.peak_outstanding_bytes == pytest.approx(3794304)
    short = model.design_test(v, gap=5.0, t_iss0=1.0, drain_rate=400.0, capacity=4e6)
    assert not short.rate_bound and short.action == "reshape"
    assert short.issue_overhead_us == pytest.approx(10.48576 - 5 - 1)
    small_q = model.design_test(v, gap=20.0, t_iss0=1.0, drain_rate=400.0, capacity=3e6)
    assert small_q.rate_bound and not small_q.capacity_bound and small_q.action == "reshape"
    # eq. 7 from empty: (4194304 − 3e6)/400e3 = 2.98576 µs
    assert small_q.isolated_issue_us == pytest.approx(2.98576)


def test_interleaving_condition_eqs_12_to_14_hand_worked():
    # G_wave = T_L2 = 2 µs; with n1/n2 = 3 Linear-1 tiles of 1.5 µs per Linear-2: 2 + 4.5 = 6.5
    assert model.interleaved_gap(2.0) == 2.0
    assert model.interleaved_gap(2.0, 1.5, n1=3, n2=1) == pytest.approx(6.5)
    # V = 2 MiB at 400 GB/s: V/R = 5.24288; T_iss^0 = 0.5: needs T_L2 + (n1/n2)·T_L1 >= 4.74288
    v = 2 * 1024 * 1024
    assert not model.interleaving_sufficient(v, 0.5, 400.0, 2.0, 1.5, n1=1, n2=1)  # 2+1.5 = 3.5
    assert model.interleaving_sufficient(v, 0.5, 400.0, 2.0, 1.5, n1=2, n2=1)      # 2+3.0 = 5.0


def test_eq_14_spreads_linear_1_work_over_n2_linear_2_tiles():
    """n2 > 1: each Linear-2 gap gains (n1/n2)·T_L1^mma, not n1·T_L1^mma; n2 on either side of
    eq. 14 matters. Same V/R = 5.24288, T_iss^0 = 0.5, T_L2 = 2, T_L1 = 1.5 as above."""
    assert model.interleaved_gap(2.0, 1.5, n1=3, n2=2) == pytest.approx(4.25)  # 2 + 1.5·3/2
    v = 2 * 1024 * 1024
    # 0.5 + 2 + 1.5·3/2 = 4.75 < 5.24288 (without n2: 7.0, sufficient)
    assert not model.interleaving_sufficient(v, 0.5, 400.0, 2.0, 1.5, n1=3, n2=2)
    # 0.5 + 2 + 1.5·4/2 = 5.5 >= 5.24288 (n2 on the left only: 10.49 > 2.5 + 6, not sufficient)
    assert model.interleaving_sufficient(v, 0.5, 400.0, 2.0, 1.5, n1=4, n2=2)
    # eq. 14 holds exactly where eq. 12's gap reaches G* = V/R − T_iss^0 (eq. 5)
    g_star = float(model.recovery_gap(v, 0.5, 400.0))
    for n1, n2 in [(1, 2), (3, 2), (4, 2), (7, 4), (8, 4), (11, 3)]:
        assert model.interleaving_sufficient(v, 0.5, 400.0, 2.0, 1.5, n1, n2) == \
            (model.interleaved_gap(2.0, 1.5, n1, n2) >= g_star), (n1, n2)


def test_verdict_agrees_with_a_measured_excess_beyond_its_tolerance():
    # piggyback: no cost predicted, so the excess must stay at or below the tolerance
    assert model.verdict_agrees("piggyback", 0.1, 0.2)
    assert model.verdict_agrees("piggyback", -0.5, 0.2)  # one-sided: faster is no cost either
    assert not model.verdict_agrees("piggyback", 0.3, 0.2)
    # reshape: a cost predicted, so the excess must exceed the tolerance
    assert model.verdict_agrees("reshape", 0.3, 0.2)
    assert not model.verdict_agrees("reshape", 0.2, 0.2)
    assert not model.verdict_agrees("reshape", -1.0, 0.2)
