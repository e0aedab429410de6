"""The fluid X-Stage simulator on hand-worked schedules, against the closed forms and records."""
import pytest

from xstage_lab import model, simulator
from xstage_lab.simulator import Burst


def test_two_bursts_hand_worked():
    # R = 1000 GB/s = 1e6 B/µs, Q = 1e6 B.
    # Burst 1: V = 3e6 B in T0 = 1 µs (inject 3e6 B/µs) from empty: q reaches Q after
    # 1e6 / (3e6 − 1e6) = 0.5 µs having injected 1.5e6; the other 1.5e6 go at R: 1.5 µs → 2.0 µs.
    # Gap 0.4 µs drains 0.4e6: q = 0.6e6.
    # Burst 2: V = 1e6 in T0 = 0.5 (inject 2e6 B/µs): Q after 0.4e6 / 1e6 = 0.4 µs with 0.8e6
    # injected; the last 0.2e6 at R: 0.2 µs → 0.6 µs, q back at Q.
    out = simulator.simulate([Burst(3e6, 1.0, 0.4), Burst(1e6, 0.5, 1.0)], 1000.0, 1e6)
    assert out["t_iss_us"].tolist() == pytest.approx([2.0, 0.6])
    assert out["q_end_bytes"].tolist() == pytest.approx([1e6, 1e6])
    assert out["start_us"].tolist() == pytest.approx([0.0, 2.4])
    assert out["period_us"].tolist() == pytest.approx([2.4, 1.6])


def test_slow_injection_never_backpressures():
    # inject 0.5e6 B/µs below R = 1e6 B/µs: issue takes V/inject, and the queue never goes negative
    out = simulator.simulate([Burst(1e6, 2.0, 0.0)] * 3, 1000.0, 1e3)
    assert out["t_iss_us"].tolist() == pytest.approx([2.0, 2.0, 2.0])
    assert (out["q_end_bytes"] == 0).all()


@pytest.mark.parametrize("volume", [1e6, 3e6, 8e6])
def test_isolated_burst_is_eq_7(volume):
    t0, R, Q = 0.5, 400.0, 2e6
    sim = simulator.simulate([Burst(volume, t0, 0.0)], R, Q)["t_iss_us"].iloc[0]
    assert sim == pytest.approx(float(model.isolated_issue_time(volume, t0, Q, R)))


@pytest.mark.parametrize("gap", [0.0, 1.0, 3.0, 5.0, 20.0])
def test_periodic_steady_state_is_eq_3(gap):
    # V/R = 5 µs, G* = 4.6 µs; Q above V − R·T0 = 1.84e6, so one burst alone is not backpressured
    v, t0, R, Q = 2e6, 0.4, 400.0, 1.9e6
    ss = simulator.steady_state(Burst(v, t0, gap), R, Q)
    assert ss["t_iss_us"] == pytest.approx(float(model.issue_time(gap, v, t0, R)), rel=1e-6)
    assert ss["period_us"] == pytest.approx(float(model.period(gap, v, t0, R)), rel=1e-6)


def test_tile_schedule_gaps_come_from_the_next_mainloops():
    # L2 epilogues store 1e6 B remotely; the gap after a burst runs to the next burst's
    # epilogue: every mainloop in between, its own included (3 + 3 + 2 after the first); the
    # empty first entry carries the work before the first epilogue (3 + 2)
    bursts = simulator.tile_schedule_bursts(["L1", "L2", "L1", "L1", "L2", "L2"],
                                            {"L1": 3.0, "L2": 2.0}, {"L1": 0.0, "L2": 1e6},
                                            {"L1": 1.0, "L2": 0.5})
    assert [(b.volume, b.gap) for b in bursts] == [(0.0, 5.0), (1e6, 8.0), (1e6, 2.0), (1e6, 0.0)]


def test_interleaving_removes_the_stall_the_wave_order_has():
    # V/R = 2.5 µs per L2 burst against a 1 µs L2 mainloop: back to back they backpressure;
    # an L1 tile of 2 µs between them covers the drain (eq. 14 holds)
    volume, R, Q = 1e6, 400.0, 1e6  # Q above V − R·T0 = 0.92e6: no burst backpressures itself
    main, vol, t0 = {"L1": 2.0, "L2": 1.0}, {"L1": 0.0, "L2": volume}, {"L1": 1.0, "L2": 0.2}
    wave = simulator.simulate(simulator.tile_schedule_bursts(["L1"] * 8 + ["L2"] * 8, main, vol, t0),
                              R, Q)
    inter = simulator.simulate(simulator.tile_schedule_bursts(["L1", "L2"] * 8, main, vol, t0), R, Q)
    assert model.interleaving_sufficient(volume, 0.2, R, 1.0, 2.0, n1=1, n2=1)
    assert inter["t_iss_us"].max() == pytest.approx(0.2)
    assert wave["t_iss_us"].iloc[-2] > 1.0  # drain-limited: V/R − G = 1.5 µs


def test_gap_sweep_of_synthetic_records_is_reproduced():
    from tests.synthetic import KNOWN, capacity, synthetic_table
    from xstage_lab.calibration import calibrate

    cal, predicted = calibrate(synthetic_table(), "synthetic", "rec")
    remote = predicted[predicted["path"] == "remote"]
    out = simulator.predict_gap_sweep(remote, cal.t_iss0_us, cal.drain_rate_GBps,
                                      {KNOWN["sm_count"]: capacity(KNOWN["sm_count"])},
                                      cal.loop_gap_us)
    err = simulator.gap_sweep_error(out)
    assert err["t_iss_err_pct"] < 0.5 and err["period_err_pct"] < 0.5


def test_bad_bursts_are_refused():
    with pytest.raises(ValueError):
        Burst(1e6, 0.0, 1.0)
    with pytest.raises(ValueError):
        Burst(-1, 1.0, 1.0)
    with pytest.raises(ValueError):
        simulator.simulate([Burst(1e6, 1.0, 0.0)], 0.0, 1e6)
