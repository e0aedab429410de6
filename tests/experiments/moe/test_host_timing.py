"""``host_timing``: what a record says of an eager call's host time."""
import pytest

from xstage_lab.experiments.moe.host_timing import call_statistics_us


def test_call_statistics_keep_the_first_call_apart():
    # each run's first call came back from waiting for the device; then calls of 10-12 µs,
    # one of which blocked
    first = [240.0, 15.0, 100.0]
    runs = [[10.0, 10.0, 10.0, 10.0], [40.0, 12.0, 12.0, 12.0], [11.0, 11.0, 11.0, 11.0]]
    s = call_statistics_us(first, runs)
    assert s["overhead"] == pytest.approx(11.0)  # the run means 10, 19, 11: their median
    assert s["call_median"] == pytest.approx(11.0)
    assert s["call_max"] == pytest.approx(40.0)
    assert s["first_call"] == pytest.approx(100.0)  # the first calls' median
