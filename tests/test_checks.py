"""The shared correctness checks fail on what they must fail on."""
import math

import torch

from xstage_lab.checks import bitwise_equal, poisoned, relative_error


def test_poison_fails_every_check():
    ref = torch.randn(8, 4)
    out = poisoned((8, 4), torch.float32, "cpu")
    assert math.isinf(relative_error(out, ref))
    assert not bitwise_equal(out, ref)
    out[:7] = ref[:7]  # one unwritten row is enough
    assert math.isinf(relative_error(out, ref)) and not bitwise_equal(out, ref)


def test_relative_error_hand_worked_and_bitwise():
    want = torch.tensor([3.0, 4.0])            # ||want|| = 5
    got = torch.tensor([3.0, 4.5])             # ||got − want|| = 0.5
    assert abs(relative_error(got, want) - 0.1) < 1e-7  # float32 arithmetic
    a = torch.randn(16).to(torch.bfloat16)
    assert bitwise_equal(a, a.clone())
    assert not bitwise_equal(a, a.float())     # same values, other dtype
    b = a.clone()
    b[3] = -b[3] if b[3] != 0 else 1.0
    assert not bitwise_equal(a, b)
