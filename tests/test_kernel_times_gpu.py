"""``dist_timing.kernel_times_us`` on a GPU (skipped elsewhere: CI has no GPU): every kernel a call
launches is named with its device time per call, and a longer kernel shows a longer time."""
import pytest
import torch

from xstage_lab.dist_timing import kernel_times_us

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_each_kernel_of_a_call_is_named_with_its_time():
    small = torch.randn(1 << 10, device="cuda")
    big = torch.randn(1 << 26, device="cuda")
    times = kernel_times_us(lambda: (small.mul_(1.0), big.add_(1.0)))
    assert len(times) >= 2 and all(t > 0 for t in times.values())
    add = [t for k, t in times.items() if "add" in k.lower() or "Add" in k]
    mul = [t for k, t in times.items() if "mul" in k.lower()]
    assert add and mul and max(add) > 10 * max(mul)  # 64 Mi elements against 1 Ki
