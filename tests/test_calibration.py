"""Calibration of M_X (paper §3.3–3.6): the fits recover the parameters that made the synthetic
records of tests/synthetic.py, follow them when they change, and reject what they must."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from tests import synthetic
from tests.synthetic import KNOWN, synthetic_table
from xstage_lab import model
from xstage_lab.calibration import (
    MIB, Calibration, IsolatedFit, calibrate, calibration_from_dict, calibration_to_dict,
    fit_drain_rate, fit_isolated, launch_means)

KIB = 1024
ISO_KS = (33, 66, 132)  # characterization_sweeps(132, ...)["isolated"]: Ks[-3:] of {16, 33, 66, 132}


def _rel(a, b):
    return abs(a / b - 1)


@pytest.fixture(scope="module")
def clean():
    return calibrate(synthetic_table(noise=0.0), "synthetic", "rec-clean")


@pytest.fixture(scope="module")
def noisy():
    return calibrate(synthetic_table(noise=0.02, seed=1), "synthetic", "rec-noisy")


# --- noise-free recovery ---------------------------------------------------------------------

def test_clean_drain_rate_recovered(clean):
    cal, _ = clean
    assert _rel(cal.drain_rate_GBps, KNOWN["drain_rate"]) < 0.005
    assert cal.drain_rate_p25 <= cal.drain_rate_GBps * 1.005
    assert cal.drain_rate_p75 >= cal.drain_rate_GBps * 0.995
    # the free-running window rate cross-checks R
    assert _rel(cal.window_rate_GBps, KNOWN["drain_rate"]) < 0.01


def test_clean_capacity_per_producer_count(clean):
    cal, _ = clean
    assert sorted(int(k) for k in cal.isolated) == list(ISO_KS)
    for k in ISO_KS:
        fit = cal.isolated[str(k)]
        assert fit["capacity_bytes"] is not None
        assert _rel(fit["capacity_bytes"], KNOWN["capacity_per_producer"] * k) < 0.03
        # Q = V_knee − R·T0(V_knee) holds at the fitted knee (eq. 6 at the knee)
        floor = model.IssueFloor(k, fit["fixed_us"], fit["issue_rate_GBps"])
        knee = fit["knee_volume_bytes"]
        assert model.capacity_from_knee(knee, floor(knee), fit["drain_rate_GBps"]) == \
            pytest.approx(fit["capacity_bytes"], rel=1e-6)


def test_clean_affine_issue_floor(clean):
    cal, _ = clean
    for k in ISO_KS:
        fit = cal.isolated[str(k)]
        assert _rel(fit["fixed_us"], KNOWN["fixed_us"]) < 0.03
        assert _rel(fit["issue_rate_GBps"], KNOWN["issue_rate_per_producer_GBps"] * k) < 0.03


def test_clean_plateau_loop_gap_and_no_refit_prediction(clean):
    cal, predicted = clean
    assert cal.loop_gap_us == pytest.approx(KNOWN["loop_gap_us"], rel=1e-9)
    # plateau of K=132, B=8 KiB is the synthetic floor:
    # T0 = 0.25 + 132·8192 / (45·132·1e3) = 0.25 + 1081344 / 5.94e6 = 0.432044 µs
    t0 = cal.t_iss0_us["K=132,B=8192"]
    assert t0 == pytest.approx(0.25 + 1081344 / 5.94e6, rel=1e-6)
    # G* = V/R − T0 = 1081344 / 700e3 − 0.432044 = 1.544777 − 0.432044 = 1.112733 µs
    assert cal.recovery_gap_us["K=132,B=8192"] == pytest.approx(1081344 / 7e5 - t0, rel=1e-6)
    assert cal.gap_issue_err_pct == pytest.approx(0.0, abs=1e-6)
    assert cal.gap_period_err_pct == pytest.approx(0.0, abs=1e-6)
    assert cal.gap_drain_branch_err_pct == pytest.approx(0.0, abs=1e-6)
    assert cal.local_tiss_spread_pct == pytest.approx(0.0, abs=1e-9)
    assert cal.sm_count == KNOWN["sm_count"]
    remote = predicted[predicted["path"] == "remote"]
    np.testing.assert_allclose(remote["t_iss_pred_us"], remote["t_iss_us"], rtol=1e-6)
    np.testing.assert_allclose(remote["period_pred_us"], remote["period_us"], rtol=1e-6)
    # the completion-coupled sum law is worse than the max law wherever G > 0
    assert (remote["period_cc_us"] > remote["period_us"] * 1.001).all()


# --- with noise ------------------------------------------------------------------------------

def test_noisy_fits_within_looser_bounds(noisy):
    cal, _ = noisy
    assert _rel(cal.drain_rate_GBps, KNOWN["drain_rate"]) < 0.02
    for k in ISO_KS:
        fit = cal.isolated[str(k)]
        assert _rel(fit["capacity_bytes"], KNOWN["capacity_per_producer"] * k) < 0.05
        assert _rel(fit["fixed_us"], KNOWN["fixed_us"]) < 0.06
        assert _rel(fit["issue_rate_GBps"], KNOWN["issue_rate_per_producer_GBps"] * k) < 0.05
    assert 0.0 < cal.gap_issue_err_pct < 3.0
    assert 0.0 < cal.local_tiss_spread_pct < 15.0


def test_noisy_table_is_deterministic_and_really_noisy():
    a = synthetic_table(noise=0.02, seed=1)
    pd.testing.assert_frame_equal(a, synthetic_table(noise=0.02, seed=1))
    assert not np.allclose(a["t_iss_us"], synthetic_table(noise=0.0)["t_iss_us"], rtol=1e-3)


# --- the fits follow the truth ---------------------------------------------------------------

def test_fit_follows_perturbed_drain_rate(monkeypatch):
    rate = 450.0
    monkeypatch.setitem(KNOWN, "drain_rate", rate)
    cal, _ = calibrate(synthetic.synthetic_table(), "synthetic", "r")
    assert _rel(cal.drain_rate_GBps, rate) < 0.005
    assert _rel(cal.drain_rate_GBps, 700.0) > 0.3
    for k in ISO_KS:  # Q is recovered at the new R too
        assert _rel(cal.isolated[str(k)]["capacity_bytes"],
                    KNOWN["capacity_per_producer"] * k) < 0.03


def test_fit_follows_perturbed_capacity_and_issue_floor(monkeypatch):
    monkeypatch.setitem(KNOWN, "capacity_per_producer", 24 * KIB)
    monkeypatch.setitem(KNOWN, "fixed_us", 0.5)
    monkeypatch.setitem(KNOWN, "issue_rate_per_producer_GBps", 30.0)
    cal, _ = calibrate(synthetic.synthetic_table(), "synthetic", "r")
    assert _rel(cal.drain_rate_GBps, KNOWN["drain_rate"]) < 0.005
    for k in ISO_KS:
        fit = cal.isolated[str(k)]
        assert _rel(fit["capacity_bytes"], 24 * KIB * k) < 0.03
        assert _rel(fit["fixed_us"], 0.5) < 0.03
        assert _rel(fit["issue_rate_GBps"], 30.0 * k) < 0.03


# --- fit_drain_rate --------------------------------------------------------------------------

def test_fit_drain_rate_exact_line():
    v = np.array([4, 8, 16, 32], float) * MIB
    R, keep = fit_drain_rate(v, v / 700e3)  # T = V/R with R = 700 GB/s = 700e3 B/µs
    assert R == pytest.approx(700.0, rel=1e-12)
    assert keep.all()


def test_fit_drain_rate_rejects_issue_limited_points():
    v = np.array([4, 8, 16, 32], float) * MIB
    t = v / 700e3
    R_clean, _ = fit_drain_rate(v, t)
    # two issue-limited points 30% above V/R, and one only 5% above (inside the 10% tolerance)
    v_issue = np.array([1, 2], float) * MIB
    v_near = np.array([12.0]) * MIB
    vv = np.r_[v, v_issue, v_near]
    tt = np.r_[t, 1.3 * v_issue / 700e3, 1.05 * v_near / 700e3]
    R, keep = fit_drain_rate(vv, tt)
    assert keep.tolist() == [True] * 4 + [False, False] + [True]
    # the kept 5%-high point pulls R down a little; the rejected ones do not count at all
    R_expected, _ = fit_drain_rate(np.r_[v, v_near], np.r_[t, 1.05 * v_near / 700e3])
    assert R == pytest.approx(R_expected, rel=1e-12)
    assert R < R_clean
    # with only the rejected points gone, R is unchanged from the clean fit
    R2, keep2 = fit_drain_rate(np.r_[v, v_issue], np.r_[t, 1.3 * v_issue / 700e3])
    assert keep2.tolist() == [True] * 4 + [False, False]
    assert R2 == pytest.approx(R_clean, rel=1e-12)
    # a plain least squares over every point would have been biased low
    all_R = (vv @ vv) / (vv @ tt) / 1e3
    assert all_R < R_expected


def test_fit_drain_rate_no_points():
    with pytest.raises(ValueError):
        fit_drain_rate(np.array([]), np.array([]))


# --- fit_isolated ----------------------------------------------------------------------------

VOLS = np.array([1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128], float) * KIB * 132


def test_fit_isolated_recovers_eq7():
    # T0(V) = 0.25 + V/5940e3, Q = 4 MiB, R = 700 GB/s.
    # knee: 0.25 + V/5.94e6 = (V − 4194304)/7e5
    #   → V = (0.25 + 4194304/7e5) / (1/7e5 − 1/5.94e6) = 6.241863 / 1.260221e-6 = 4952989.6 B
    floor = model.IssueFloor(132, 0.25, 5940.0)
    t = model.isolated_issue_time(VOLS, floor(VOLS), 4 * MIB, 700.0)
    fit = fit_isolated(132, VOLS, t, 700.0)
    assert isinstance(fit, IsolatedFit)
    assert fit.capacity_bytes == pytest.approx(4 * MIB, rel=1e-3)
    assert fit.knee_volume_bytes == pytest.approx(4952989.6, rel=1e-3)
    assert fit.fixed_us == pytest.approx(0.25, rel=1e-3)
    assert fit.issue_rate_GBps == pytest.approx(5940.0, rel=1e-3)
    np.testing.assert_allclose(fit.predict(VOLS), t, rtol=1e-3)
    # order of the input does not matter
    perm = np.random.default_rng(0).permutation(VOLS.size)
    fit2 = fit_isolated(132, VOLS[perm], t[perm], 700.0)
    assert fit2.capacity_bytes == pytest.approx(fit.capacity_bytes, rel=1e-6)


def test_fit_isolated_no_drain_branch_when_issue_slower_than_drain():
    # issue at 500 GB/s cannot outrun a 700 GB/s drain: no knee, no capacity
    t = 0.25 + VOLS / 500e3
    fit = fit_isolated(132, VOLS, t, 700.0)
    assert fit.capacity_bytes is None
    assert fit.knee_volume_bytes is None
    np.testing.assert_allclose(fit.predict(VOLS), t, rtol=1e-3)


def test_fit_isolated_no_drain_branch_when_range_ends_before_knee():
    # issue (5940 GB/s) outruns the drain (700 GB/s) but Q is so large that every measured burst
    # stays on the floor: the data has no drain-limited branch
    t = 0.25 + VOLS / 5940e3
    fit = fit_isolated(132, VOLS, t, 700.0)
    assert fit.capacity_bytes is None
    assert fit.knee_volume_bytes is None


def test_fit_isolated_needs_four_volumes():
    with pytest.raises(ValueError, match="four"):
        fit_isolated(132, VOLS[:3], 0.25 + VOLS[:3] / 5940e3, 700.0)


# --- launch means ----------------------------------------------------------------------------

def test_launch_means_weights_by_producers_in_window():
    base = dict(sweep="gap", point=0, repeat=0, mode="periodic", path="remote", producers=4,
                burst_bytes=1024, gap_us=0.0, src=0, dst=1, lines="fresh", align="first",
                burst_volume=4096, start_skew_ns=10.0, window_rate_GBps=1.0, sm_clock_mhz=1980.0)
    rows = [
        dict(base, warmup=True, producers_in_window=4, t_iss_us=100.0, period_us=100.0,
             gap_eff_us=0.0),                                      # warm-up: out
        dict(base, warmup=False, producers_in_window=0, t_iss_us=50.0, period_us=50.0,
             gap_eff_us=0.0),                                      # nobody in window: out
        dict(base, warmup=False, producers_in_window=1, t_iss_us=1.0, period_us=3.0,
             gap_eff_us=2.0),
        dict(base, warmup=False, producers_in_window=3, t_iss_us=2.0, period_us=5.0,
             gap_eff_us=3.0),
    ]
    out = launch_means(pd.DataFrame(rows))
    assert len(out) == 1
    # (1·1 + 3·2)/4 = 1.75; (1·3 + 3·5)/4 = 4.5; (1·2 + 3·3)/4 = 2.75
    assert out["t_iss_us"].iloc[0] == pytest.approx(1.75)
    assert out["period_us"].iloc[0] == pytest.approx(4.5)
    assert out["gap_eff_us"].iloc[0] == pytest.approx(2.75)


# --- summary, round trip, platform model -----------------------------------------------------

SUMMARY_KEYS = {"R_GBps", "T_iss0_us", "Q_MiB", "knee_KB_per_producer", "G_star_us",
                "gap_prediction_median_abs_err_pct", "local_control_tiss_spread_pct"}


def test_summary_keys_and_formats(clean):
    cal, _ = clean
    s = cal.summary()
    assert SUMMARY_KEYS <= set(s)
    json.dumps(s)  # plain data
    assert s["R_GBps"] == pytest.approx(KNOWN["drain_rate"], abs=0.1)
    expected_kb = {f"K=132,B={b * KIB}" for b in (8, 16, 32, 64)}
    assert set(s["T_iss0_us"]) == expected_kb
    assert set(s["G_star_us"]) == expected_kb
    assert set(s["Q_MiB"]) == {f"K={k}" for k in ISO_KS}
    assert set(s["knee_KB_per_producer"]) == {f"K={k}" for k in ISO_KS}
    # Q(K=132) = 132 · 32 KiB = 4325376 B = 4.125 MiB
    assert s["Q_MiB"]["K=132"] == pytest.approx(4.125, abs=0.01)
    for k in ISO_KS:
        fit = cal.isolated[str(k)]
        assert s["Q_MiB"][f"K={k}"] == pytest.approx(fit["capacity_bytes"] / MIB, abs=1e-3)
        # knee per producer in KiB (the paper's KB: 148 · 33 KB ≈ 4.77 MiB)
        assert s["knee_KB_per_producer"][f"K={k}"] == pytest.approx(
            fit["knee_volume_bytes"] / k / KIB, abs=0.01)
    assert s["T_iss0_us"]["K=132,B=8192"] == pytest.approx(0.432, abs=1e-3)
    assert s["G_star_us"]["K=132,B=8192"] == pytest.approx(1.113, abs=1e-3)
    assert s["gap_prediction_median_abs_err_pct"] == 0.0
    assert s["sm_count"] == 132
    assert s["source_record"] == "rec-clean"


def test_summary_omits_uncalibrated_capacity(clean):
    cal, _ = clean
    d = calibration_to_dict(cal)
    d["isolated"] = dict(d["isolated"])
    d["isolated"]["33"] = dict(d["isolated"]["33"], capacity_bytes=None, knee_volume_bytes=None)
    s = calibration_from_dict(d).summary()
    assert "K=33" not in s["Q_MiB"] and "K=33" not in s["knee_KB_per_producer"]
    assert "K=66" in s["Q_MiB"]
    assert 33 not in calibration_from_dict(d).platform_model().capacity


def test_round_trip_dict_and_json(clean):
    cal, _ = clean
    d = calibration_to_dict(cal)
    assert calibration_from_dict(d) == cal
    back = calibration_from_dict(json.loads(json.dumps(d)))
    assert isinstance(back, Calibration)
    assert back == cal
    assert back.summary() == cal.summary()
    with pytest.raises(TypeError):
        calibration_from_dict({**d, "unexpected": 1})


def test_platform_model_consistent(clean):
    cal, _ = clean
    pm = cal.platform_model()
    assert isinstance(pm, model.PlatformModel)
    assert pm.drain_rate == cal.drain_rate_GBps
    assert set(pm.t_iss0) == {(132, b * KIB) for b in (8, 16, 32, 64)}
    for key, v in cal.t_iss0_us.items():
        k, b = (int(x.split("=")[1]) for x in key.split(","))
        assert pm.t_iss0_at(k, b) == v
    assert set(pm.capacity) == set(ISO_KS)
    for k in ISO_KS:
        assert pm.capacity[k] == cal.isolated[str(k)]["capacity_bytes"]
    # K = 33 has no plateau: the affine floor, 0.25 + 33·4096 / (45·33·1e3) = 0.25 + 0.091022
    assert pm.t_iss0_at(33, 4096) == pytest.approx(0.25 + 4096 / 45e3, rel=0.03)
    # K = 7 has no floor of its own: K = 33's (the nearest above) at the same B
    assert pm.t_iss0_at(7, 4096) == pytest.approx(0.25 + 4096 / 45e3, rel=0.03)
    # the model predicts the calibration's own G*
    g = model.recovery_gap(132 * 8192, pm.t_iss0_at(132, 8192), pm.drain_rate)
    assert g == pytest.approx(cal.recovery_gap_us["K=132,B=8192"], rel=1e-12)


def test_capacity_spread_from_per_repeat_fits():
    cal, _ = calibrate(synthetic_table(noise=0.02, seed=3), "synth", "rec")
    assert set(cal.capacity_spread) == {k for k, f in cal.isolated.items()
                                        if f["capacity_bytes"] is not None}
    for k, (lo, hi) in cal.capacity_spread.items():
        assert lo <= hi
        # each repeat alone lands near the pooled fit
        assert abs((lo + hi) / 2 / cal.isolated[k]["capacity_bytes"] - 1) < 0.1
    exact, _ = calibrate(synthetic_table(noise=0.0), "synth", "rec")
    for k, (lo, hi) in exact.capacity_spread.items():
        assert hi - lo < 1e-6 * exact.isolated[k]["capacity_bytes"]


def test_fit_completion_recovers_the_latency_and_tells_the_laws_apart():
    # fenced periods made from the sum law with T_lat = 1.5 µs on K = 132, R = 700 GB/s
    from xstage_lab.calibration import fit_completion

    k, R, t_lat, loop = 132, 700.0, 1.5, 0.7
    rows, dec = [], []
    for b in (8192, 16384, 32768):
        v = k * b
        for g in (0.0, 2.0, 8.0, 32.0):
            t_complete = v / (R * 1e3) + t_lat
            rows.append(dict(producers=k, burst_bytes=b, gap_us=g, burst_volume=v,
                             t_iss_us=t_complete, period_us=t_complete + g + loop))
            dec.append(dict(burst_bytes=b, gap_us=g, period_us=max(0.3 + g + loop, v / (R * 1e3))))
    t_iss0 = {f"K={k},B={b}": 0.3 for b in (8192, 16384, 32768)}
    fit = fit_completion(pd.DataFrame(rows), pd.DataFrame(dec), R, t_iss0, loop)
    assert fit.completion_latency_us == pytest.approx(t_lat)
    assert fit.completion_rate_GBps == pytest.approx(R)
    assert fit.sum_law_err_pct == pytest.approx(0.0, abs=1e-9)
    assert fit.max_law_err_pct > 10  # the decoupled model misses the coupled world
    assert {p["B"] for p in fit.periods} == {8192, 16384, 32768}
    assert all(p["period_coupled_us"] > p["period_decoupled_us"] for p in fit.periods)
