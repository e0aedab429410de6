"""``dist_timing.exclusive_times_us``: the per-kernel attribution ``kernel_times_us`` applies to
the profiler's spans (its GPU side is ``test_kernel_times_gpu.py``)."""
import pytest

from xstage_lab.dist_timing import exclusive_times_us


def test_a_kernel_started_early_is_counted_from_the_end_of_the_one_it_waited_for():
    # b launched at 2 (programmatic dependent launch) waited for a until 5, then ran to 7;
    # c started after b ended, with a gap
    spans = [("b", 2.0, 7.0), ("a", 0.0, 5.0), ("c", 8.0, 9.5)]
    assert exclusive_times_us(spans, calls=1) == pytest.approx({"a": 5.0, "b": 2.0, "c": 1.5})


def test_times_are_per_call_summed_over_the_calls_and_zero_spans_are_left_out():
    spans = [("a", 0.0, 4.0), ("b", 1.0, 3.0), ("a", 10.0, 12.0), ("b", 11.0, 13.0)]
    # b's first span lies inside a's: nothing of it is its own
    assert exclusive_times_us(spans, calls=2) == pytest.approx({"a": 3.0, "b": 0.5})
    assert exclusive_times_us([("a", 0.0, 2.0), ("b", 0.5, 1.0)], calls=1) == {"a": 2.0}
