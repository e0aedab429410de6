"""``host_timing.call_statistics_us``: what a record says of an eager call's host time."""
import pytest

from xstage_lab.experiments.moe.host_timing import call_statistics_us


def test_call_statistics_tell_few_blocking_calls_from_slow_calls():
    # the first call of runs 0 and 1 blocked; every other call takes 10-12 µs
    runs = [[100.0, 10.0, 10.0, 10.0], [40.0, 12.0, 12.0, 12.0], [11.0, 11.0, 11.0, 11.0]]
    s = call_statistics_us(runs)
    assert s["overhead"] == pytest.approx(19.0)  # the run means 32.5, 19, 11: their median
    assert s["call_median"] == pytest.approx(11.0)
    assert s["first_call"] == pytest.approx(40.0)  # the first calls 100, 40, 11
    assert s["call_max"] == pytest.approx(100.0)
