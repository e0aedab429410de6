"""The fluid X-Stage simulator on hand-worked schedules, against the closed forms and records."""
import numpy as np
import pandas as pd
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


# simulate_producers: R = 1000 GB/s = 1e6 B/µs throughout unless said otherwise.

@pytest.mark.parametrize("volume", [1e6, 3e6, 8e6])
def test_one_producer_burst_is_the_single_stream_queue(volume):
    # T0 = 0.5, Q = 2e6: V − R·T0 = 0.5e6 ≤ Q (no backpressure), 2.5e6 and 7.5e6 > Q, where eq. 7
    # gives (V − Q)/R = 1 and 6 µs; the start (3 µs) is not part of the issue time
    t0, R, Q = 0.5, 1000.0, 2e6
    out = simulator.simulate_producers([3.0], [volume], [t0], R, Q)
    single = simulator.simulate([Burst(volume, t0, 0.0)], R, Q).iloc[0]
    assert out["t_iss_us"].iloc[0] == pytest.approx(single["t_iss_us"])
    assert out["q_end_bytes"].iloc[0] == pytest.approx(single["q_end_bytes"])
    assert out["t_iss_us"].iloc[0] == pytest.approx(
        {1e6: 0.5, 3e6: 1.0, 8e6: 6.0}[volume])
    assert out["stall_us"].iloc[0] == pytest.approx(out["t_iss_us"].iloc[0] - t0)


@pytest.mark.parametrize("volume", [0.2e6, 1e6])
def test_aligned_identical_bursts_are_one_aggregate_burst(volume):
    # 4 producers from 1 µs, T0 = 0.5 each: the aggregate is 4V in T0. V = 1e6: 4e6 − R·T0 = 3.5e6
    # > Q = 1e6, so eq. 7 gives (4e6 − 1e6)/R = 3 µs; V = 0.2e6: 0.3e6 ≤ Q, no backpressure
    k, t0, R, Q = 4, 0.5, 1000.0, 1e6
    out = simulator.simulate_producers([1.0] * k, [volume] * k, [t0] * k, R, Q)
    agg = simulator.simulate([Burst(k * volume, t0, 0.0)], R, Q).iloc[0]
    assert out["t_iss_us"].tolist() == pytest.approx([agg["t_iss_us"]] * k)
    assert out["q_end_bytes"].tolist() == pytest.approx([agg["q_end_bytes"]] * k)
    assert agg["t_iss_us"] == pytest.approx({0.2e6: 0.5, 1e6: 3.0}[volume])


def test_bursts_apart_enough_to_drain_are_not_stalled():
    # V = 1.2e6 in T0 = 0.4 (3e6 B/µs) leaves q = 1.2e6 − 0.4e6 = 0.8e6 < Q = 1e6 at 0.4 µs, which
    # drains in 0.8 µs: empty at 1.2 µs, when the next starts. 0.6e6 in 0.3 from 5 µs leaves
    # 0.3e6. The empty burst at 2 µs ends where it starts, half way through the second drain.
    out = simulator.simulate_producers([5.0, 0.0, 2.0, 1.2], [0.6e6, 1.2e6, 0.0, 1.2e6],
                                       [0.3, 0.4, 1.0, 0.4], 1000.0, 1e6)
    assert out["t_iss_us"].tolist() == pytest.approx([0.3, 0.4, 0.0, 0.4])
    assert out["stall_us"].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0], abs=1e-12)
    assert out["q_end_bytes"].tolist() == pytest.approx([0.3e6, 0.8e6, 0.4e6, 0.8e6])
    # Too close: from 0.8 µs q = 0.8e6 − 0.4e6 = 0.4e6 and grows at 2e6, so Q after 0.3 µs with
    # 0.9e6 injected; the last 0.3e6 at R take 0.3 µs: T_iss 0.6, stall 0.2.
    early = simulator.simulate_producers([0.0, 0.8], [1.2e6, 1.2e6], [0.4, 0.4], 1000.0, 1e6)
    assert early["stall_us"].tolist() == pytest.approx([0.0, 0.2], abs=1e-12)


def test_second_producer_joins_a_partly_full_queue_hand_worked():
    # R = 1e6 B/µs, Q = 0.8e6. A: V = 3e6 in T0 = 1 from 0 (3e6 B/µs).
    # B: V = 1.2e6 in T0 = 1.2 from 0.25 (1e6 B/µs).
    # 0 → 0.25: A alone, q grows at 3e6 − 1e6: q = 0.5e6; A has 3e6 − 0.75e6 = 2.25e6 left.
    # 0.25 →: D = 4e6, q grows at 3e6: Q after 0.3e6 / 3e6 = 0.1 µs → 0.35; A has 1.95e6 left,
    #   B 1.2e6 − 0.1e6 = 1.1e6.
    # 0.35 →: held at Q, R shared 3:1: A at 0.75e6, B at 0.25e6 B/µs. A ends after
    #   1.95e6 / 0.75e6 = 2.6 µs → 2.95 (T_iss 2.95, stall 1.95); B has 1.1e6 − 0.65e6 = 0.45e6.
    # 2.95 →: B alone, D = 1e6 = R: own rate, q stays at Q; ends after 0.45 µs → 3.4
    #   (T_iss 3.4 − 0.25 = 3.15, stall 1.95).
    out = simulator.simulate_producers([0.0, 0.25], [3e6, 1.2e6], [1.0, 1.2], 1000.0, 0.8e6)
    assert out["t_iss_us"].tolist() == pytest.approx([2.95, 3.15])
    assert out["stall_us"].tolist() == pytest.approx([1.95, 1.95])
    assert out["q_end_bytes"].tolist() == pytest.approx([0.8e6, 0.8e6])


@pytest.mark.parametrize("args, match", [
    (([0.0, 1.0], [1e6], [1.0]), "one length"),
    (([[0.0]], [[1e6]], [[1.0]]), "1-D"),
    (([np.nan], [1e6], [1.0]), "start_us"),
    (([0.0], [-1.0], [1.0]), "volume"),
    (([0.0], [np.inf], [1.0]), "volume"),
    (([0.0], [1e6], [0.0]), "t_iss0_us"),
    (([0.0], [1e6], [1.0], 0.0), "drain_rate"),
    (([0.0], [1e6], [1.0], 1000.0, -1.0), "capacity"),
    (([0.0], [1e6], [1.0], 1000.0, np.nan), "capacity"),
])
def test_bad_producer_input_is_refused(args, match):
    args = args + (1000.0, 1e6)[len(args) - 3:]
    with pytest.raises(ValueError, match=match):
        simulator.simulate_producers(*args)


def _overlapping_schedule(n, us_per_burst):
    rng = np.random.default_rng(0)
    start = np.round(rng.uniform(0, n * us_per_burst, n), 2)  # rounded: many start together
    volume = rng.choice([0.0, 64e3, 128e3, 256e3], n, p=[0.05, 0.35, 0.35, 0.25])
    return start, volume, rng.uniform(0.5, 2.0, n)


def test_row_order_does_not_matter():
    start, volume, t0 = _overlapping_schedule(400, 0.02)
    perm = np.random.default_rng(1).permutation(len(start))
    out = simulator.simulate_producers(start, volume, t0, 400.0, 2e6)
    shuffled = simulator.simulate_producers(start[perm], volume[perm], t0[perm], 400.0, 2e6)
    assert out["stall_us"].max() > 1.0  # the schedule does backpressure
    for col in out:
        assert shuffled[col].to_numpy() == pytest.approx(out[col].to_numpy()[perm], rel=1e-9,
                                                         abs=1e-9)


def test_many_overlapping_producers_stay_within_the_fluid_bounds():
    # from empty at the first start, all N bytes need at least (ΣV − Q)/R; nothing goes faster
    # than its T_iss^0 and q never leaves [0, Q]. ~131 KB per 0.33 µs is 0.99 of R: about 200
    # bursts active at once, most of them stalled.
    start, volume, t0 = _overlapping_schedule(20000, 0.33)
    R, Q = 400.0, 2e6
    out = simulator.simulate_producers(start, volume, t0, R, Q)
    last = float((out["start_us"] + out["t_iss_us"]).max())
    assert last - start.min() >= (volume.sum() - Q) / (R * 1e3) * (1 - 1e-9)
    assert out["stall_us"].min() > -1e-9
    assert out["q_end_bytes"].between(0, Q).all()
    assert (out["stall_us"] > 0.01).mean() > 0.5


# Free-running producers and their start skew (the gap sweep's drift), R = 1e6 B/µs.

def test_one_free_running_producer_is_the_single_stream_queue():
    # V = 1e6 in T0 = 0.5 (2e6 B/µs): q grows at 1e6 B/µs to 0.5e6 < Q at 0.5 µs, the gap of
    # 1 µs drains it by 1.0: every burst takes T0 and starts 1.5 µs after the one before
    run = simulator.simulate_free_running([2.0], 1e6, 0.5, 1.0, 3, 1000.0, 1e6)
    single = simulator.simulate([Burst(1e6, 0.5, 1.0)] * 3, 1000.0, 1e6)
    assert run["start_us"].tolist() == pytest.approx((single["start_us"] + 2.0).tolist())
    assert run["t_iss_us"].tolist() == pytest.approx([0.5, 0.5, 0.5])
    assert run["period_us"].tolist()[:2] == pytest.approx([1.5, 1.5])
    assert np.isnan(run["period_us"].iloc[-1])


def test_two_free_running_producers_hand_worked():
    # Each burst 1e6 B in T0 = 0.5 (2e6 B/µs), Q = 0.6e6, gap 2 µs; B starts 0.25 µs after A.
    # 0 → 0.25: A alone, q = 0.25e6, A has 0.5e6 left.
    # 0.25 →: D = 4e6, q grows at 3e6: Q after 0.35e6 / 3e6 = 0.11667 µs (t = 0.36667), each has
    #   injected 0.23333e6 more: A has 0.26667e6 left, B 0.76667e6.
    # Held at Q, R shared 1:1: A ends after 0.26667e6 / 0.5e6 = 0.53333 µs, at 0.9 (T_iss 0.9);
    #   B has 0.5e6 left, alone at R (still held): 0.5 µs, ends at 1.4 (T_iss 1.15).
    # q = Q at 1.4 drains by 2.0. A's next burst at 0.9 + 2 = 2.9 from empty: alone, q reaches
    #   0.5e6 < Q at 3.4 (T_iss 0.5). B's next at 1.4 + 2 = 3.4 finds q = 0.5e6: Q after 0.1 µs
    #   with 0.2e6 injected, the last 0.8e6 at R: ends at 4.3 (T_iss 0.9).
    run = simulator.simulate_free_running([0.0, 0.25], 1e6, 0.5, 2.0, 2, 1000.0, 0.6e6)
    assert run[["producer", "burst"]].values.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert run["start_us"].tolist() == pytest.approx([0.0, 2.9, 0.25, 3.4])
    assert run["t_iss_us"].tolist() == pytest.approx([0.9, 0.5, 1.15, 0.9])
    assert run["stall_us"].tolist() == pytest.approx([0.4, 0.0, 0.65, 0.4], abs=1e-9)
    assert run["period_us"].tolist()[::2] == pytest.approx([2.9, 3.15])
    assert run["q_end_bytes"].tolist() == pytest.approx([0.6e6, 0.5e6, 0.6e6, 0.6e6])
    # aligned, the same two bursts are one aggregate burst of 2e6 in 0.5 µs: Q after 0.2 µs with
    # 0.8e6 injected, the other 1.2e6 at R: T_iss 1.4 (eq. 7: max(T0, (V − Q)/R))
    aligned = simulator.simulate_free_running([0.0, 0.0], 1e6, 0.5, 2.0, 1, 1000.0, 0.6e6)
    assert aligned["t_iss_us"].tolist() == pytest.approx([1.4, 1.4])


@pytest.mark.parametrize("args, match", [
    (([], 1e6, 0.5, 1.0, 2), "offsets_us"),
    (([np.nan], 1e6, 0.5, 1.0, 2), "offsets_us"),
    (([0.0], -1.0, 0.5, 1.0, 2), "volume"),
    (([0.0], 1e6, 0.0, 1.0, 2), "t_iss0_us"),
    (([0.0], 1e6, 0.5, -1.0, 2), "gap_us"),
    (([0.0], 1e6, 0.5, 1.0, 0), "bursts"),
    (([0.0], 1e6, 0.5, 1.0, 1.5), "bursts"),
])
def test_bad_free_running_input_is_refused(args, match):
    with pytest.raises(ValueError, match=match):
        simulator.simulate_free_running(*args, 1000.0, 1e6)


def _free_running_by_play(offsets, volume, t0, gap, bursts, drain, capacity):
    """``simulate_free_running``'s launch through the general event loop (``_play``): the
    reference that its own loop for bursts alike must match."""
    k, n = len(offsets), bursts
    index = np.arange(k * n)
    burst = index % n
    start = np.where(burst == 0, np.repeat(np.asarray(offsets, dtype=float), n), np.nan)
    return simulator._play(start, np.full(k * n, volume), np.full(k * n, t0), drain, capacity,
                           np.where(burst < n - 1, index + 1, -1), np.full(k * n, gap))


def test_free_running_bursts_alike_play_as_the_general_loop_to_the_bit():
    """``simulate_free_running`` plays its bursts, all alike, through FIFO queues
    (``_play_alike``): the same begin, finish and q at finish, bit for bit, as the general
    loop with heaps, over random launches held at Q and free, with ties (equal offsets, a zero
    gap, demand equal to the drain) and offsets in any order."""
    rng = np.random.default_rng(28)
    cases = [([0.0, 0.25], 1e6, 0.5, 2.0, 3, 1e6, 0.6e6), ([0.0] * 4, 0.5e6, 0.5, 10.0, 4, 1e6, 0.5e6),
             ([0.0, 1.0, 1.0, 0.5], 1e6, 1.0, 0.0, 5, 1e6, 0.0),  # D = R for one burst, Q = 0
             ([3.0, -1.0, 2.0, 2.0], 2e6, 1.0, 0.5, 6, 2e6, 1e6),
             # a gap-sweep point's launch, shorter: 132 producers over one period, held at Q
             (np.linspace(0.0, 5.14, 132, endpoint=False).tolist(), 2048.0, 0.263, 0.0869, 24,
              52.6e3, 0.3e6)]
    for _ in range(120):
        k, n = int(rng.integers(1, 40)), int(rng.integers(1, 30))
        t0 = float(rng.choice([0.25, 0.5, rng.uniform(0.05, 2.0)]))
        volume = float(rng.choice([1e6, rng.uniform(1e3, 4e6)]))
        drain = float(rng.choice([1e6, volume / t0, rng.uniform(1e4, 5e6)]))
        spread = float(rng.choice([0.0, rng.uniform(0.0, 50.0)]))
        offsets = (rng.integers(0, 4, k) * spread / 4 if rng.random() < 0.3
                   else rng.uniform(0.0, spread, k))
        gap = float(rng.choice([0.0, 0.5, rng.uniform(0.0, 20.0)]))
        capacity = float(rng.choice([0.0, rng.uniform(0.0, 3.0) * k * volume]))
        cases.append((offsets.tolist(), volume, t0, gap, n, drain, capacity))
    for offsets, volume, t0, gap, n, drain, capacity in cases:
        want = _free_running_by_play(offsets, volume, t0, gap, n, drain, capacity)
        got = simulator._play_alike(offsets, n, volume, t0, gap, drain, capacity)
        for g, w in zip(got, want):
            assert np.array_equal(g, w, equal_nan=True), (offsets, volume, t0, gap, n, drain)
    run = simulator.simulate_free_running(*cases[0][:5], cases[0][5] / 1e3, cases[0][6])
    want = _free_running_by_play(*cases[0])
    assert np.array_equal(run["start_us"], want[0]) and np.array_equal(run["q_end_bytes"], want[2])


def test_window_means_take_the_bursts_where_every_producer_runs():
    # producer 0 starts its bursts at 0, 10, 20, 30; producer 1 at 5, 15, 25, 35. After one
    # warm-up burst the window runs from 15 (producer 1's burst 1) to 30 (producer 0's last
    # start): bursts starting at 15, 20 and 25 count.
    rows = pd.DataFrame({"producer": [0] * 4 + [1] * 4, "burst": [0, 1, 2, 3] * 2,
                         "start_us": [0, 10, 20, 30, 5, 15, 25, 35],
                         "t_iss_us": [9, 1, 2, 9, 9, 3, 4, 9],
                         "period_us": [10, 10, 10, np.nan, 10, 12, 14, np.nan]})
    assert simulator.window_means(rows, warmup=1) == pytest.approx(
        {"t_iss_us": 3.0, "period_us": 12.0})


def test_skewed_launch_hand_worked():
    # K = 4 producers of 0.5e6 B (V = 2e6) in T0 = 0.5 µs, gap 10 µs, Q = 0.5e6, R = 1e6 B/µs.
    # Aligned (skew 0): one aggregate burst, eq. 7: (V − Q)/R = 1.5 µs, the gap drains it all.
    # Spread over 3 µs (1 µs apart, under the period max(T0 + G, V/R) = 10.5): each burst alone
    # injects at 1e6 B/µs = R, so nothing builds up: T_iss = T0. Spread over 20 µs, more than a
    # period: the starts spread over one period (2.625 µs apart): T0 again.
    args = dict(producers=4, burst_bytes=0.5e6, t_iss0_us=0.5, gap_us=10.0, drain_rate=1000.0,
                capacity=0.5e6, bursts=6, warmup=1)
    aligned = simulator.skewed_launch(skew_us=0.0, **args)
    assert aligned["t_iss_us"] == pytest.approx(1.5)
    assert aligned["period_us"] == pytest.approx(11.5)
    assert aligned == pytest.approx(simulator.steady_state(Burst(2e6, 0.5, 10.0), 1000.0, 0.5e6))
    for skew in (3.0, 20.0):
        spread = simulator.skewed_launch(skew_us=skew, **args)
        assert spread == pytest.approx({"t_iss_us": 0.5, "period_us": 10.5})


def test_skew_regime_hand_worked():
    # starts spread under one issue time: aligned; under one period: staggered; beyond: drifted
    assert simulator.skew_regime([0.2, 3.0, 12.0], [0.5, 0.5, 0.5], [10.0, 10.0, 10.0]).tolist() == [
        "aligned", "staggered", "drifted"]


def test_point_start_skew_is_the_median_over_launches_in_us():
    from tests.synthetic import synthetic_table

    table = synthetic_table()
    table.loc[table["repeat"] == 0, "start_skew_ns"] = 5000.0  # one launch in three
    skew = simulator.point_start_skew(table)
    assert len(skew) == table.groupby(["sweep", "point"]).ngroups
    assert (skew["start_skew_us"] == 0.05).all()


def test_measured_skew_explains_the_long_gap_plateau():
    """Issue 20: the aligned simulation plateaus at (V − Q)/R for long gaps at B = 32 and 64 KiB,
    far above the measured issue time; with the producers spread over their measured start
    skew it stays at T_iss^0, as measured."""
    from xstage_lab import load

    c = load("remote_store", "h200-x2", backend="replay")[0]
    sim, errors = simulator.check_gap_sweep(c.calibration, c.predicted, c.record)
    assert {"start_skew_us", "t_iss_skew_sim_us", "period_skew_sim_us", "regime"} <= set(sim)
    assert errors["simulator_skewed_t_iss_err_pct"] < errors["simulator_t_iss_err_pct"]
    longest = sim[(sim["burst_bytes"] >= 32 * 1024) & (sim["gap_us"] == sim["gap_us"].max())]
    assert (longest["t_iss_sim_us"] > 4 * longest["t_iss_us"]).all()
    assert np.allclose(longest["t_iss_skew_sim_us"], longest["t_iss_us"], rtol=0.05)
    assert (longest["regime"] != "aligned").all()


# --- the tile table (issue 26 item 3) -------------------------------------------------------------

def test_tile_table_waits_for_rows_and_stalls_on_a_full_x_stage():
    from xstage_lab.simulator import L1_TILE as A, L2_TILE as B, simulate_tile_table

    # program 0: both Linear-1 tiles of row 0; program 1: row 0's Linear-2 tile, which waits
    progs = [[(A, 0, 0.0), (A, 0, 0.0)], [(B, 0, 1e6)]]
    out = simulate_tile_table(progs, 2, [1.0, 2.0], [0.5, 0.5], 1.0, 5e5)
    # row 0 ends at 3.0; the Linear-2 mainloop to 5.0; 1 MB into an empty X-Stage of Q = 0.5 MB
    # at 1 GB/s (1000 B/µs): its stores are in once 0.5 MB remain, 500 µs later
    assert out["l2_wait_us"] == 3.0 and out["stall_us"] == pytest.approx(500.0)
    assert out["makespan_us"] == pytest.approx(505.5)
    # nothing remote: no stall; two bursts within Q: none either
    assert simulate_tile_table(progs, 2, [1.0, 2.0], [0.5, 0.5], 1.0, 2e6)["stall_us"] == 0.0
    # two programs' bursts share the X-Stage: the second, issued while the first drains, waits
    both = [[(B, 0, 1e6)], [(B, 0, 1e6)]]
    shared = simulate_tile_table([[(A, 0, 0.0)], *both], 1, [1.0, 1.0], [0.0, 0.0], 1.0, 1e6)
    assert shared["stall_us"] == pytest.approx(1000.0) and shared["stall_per_l2_us"] == 500.0
    with pytest.raises(ValueError, match="deadlocks"):
        simulate_tile_table([[(B, 0, 0.0)]], 1, [1.0, 1.0], [0.0, 0.0], 1.0, 1.0)

