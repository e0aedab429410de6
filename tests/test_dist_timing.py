"""``dist_timing``'s CPU side: the rotation of methods over trials, the paired ratio, the time
between consecutive device activities, a hold's arguments and how a record names the method."""
import pytest

from xstage_lab.dist_timing import (TIMING_METHOD, boundaries_us, paired_ratio, rotated_order,
                                    time_methods, timing_method)


def test_each_method_leads_in_turn():
    assert [rotated_order(["a", "b", "c"], t) for t in range(4)] == \
        [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_a_clock_step_between_trials_leaves_the_paired_ratio_alone():
    """The clocks step down during the fourth trial, between the two methods' runs: ``a`` runs
    3% slower from the fourth trial on, ``b`` (1% faster than ``a`` in the same clock state) from
    the fifth. The ratio of the medians reads 4% between them, the paired ratio the 1%."""
    a, b = [100.0] * 3 + [103.0] * 4, [99.0] * 4 + [101.97] * 3
    assert sorted(b)[3] / sorted(a)[3] == pytest.approx(99 / 103)
    assert paired_ratio(b, a) == pytest.approx(0.99)
    assert paired_ratio([2.0, 4.0, 9.0], [1.0, 1.0, 1.0]) == 4.0


def test_boundaries_pair_activities_in_start_order_each_pairs_median():
    """Two calls of route -> kernel -> sum, listed out of order: each boundary the next start
    less the previous end, the median over a pair's occurrences; the call-to-call pair too."""
    calls = [(0.0, 2.0, "route"), (3.0, 10.0, "kernel"), (10.5, 12.0, "sum"),
             (20.0, 22.0, "route"), (26.0, 33.0, "kernel"), (33.5, 35.0, "sum"),
             (35.0, 36.0, "route"), (40.0, 44.0, "kernel"), (43.0, 45.0, "sum")]
    gaps = boundaries_us(calls[::-1])
    assert gaps == {"route -> kernel": 4.0, "kernel -> sum": 0.5, "sum -> route": 4.0}
    assert boundaries_us(calls[:1]) == {}


@pytest.mark.parametrize("kwargs", [dict(hold_cycles=-1, graph_iters=5),
                                    dict(hold_cycles=1000)])
def test_a_hold_needs_graphed_methods_and_is_refused_before_any_launch(kwargs):
    """A hold only opens a graphed trial's window (without graphs each call's launch is part of
    what it costs): refused before anything touches a device, which this machine lacks."""
    with pytest.raises(ValueError, match="hold"):
        time_methods({"m": lambda: None}, **kwargs)


def test_a_records_timing_names_the_calls_per_trial_and_the_hold():
    assert timing_method() == TIMING_METHOD
    assert timing_method(5) == f"{TIMING_METHOD}; 5 calls per trial"
    held = timing_method(5, 100_000)
    assert held.startswith(f"{TIMING_METHOD}; 5 calls per trial; ") and "100000-cycle hold" in held
