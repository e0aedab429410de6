"""Correctness checks shared by the experiments: every kernel output is compared with a reference
on fresh inputs, its destination poisoned first (NaN, never zeros)."""
from __future__ import annotations

import math

import torch


def poisoned(shape, dtype, device) -> torch.Tensor:
    """A tensor of NaN: an element the kernel does not write fails every later comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error ``||got − want|| / ||want||``; inf where ``got`` holds a NaN or an
    infinity (an unwritten or poisoned element), so no tolerance accepts it."""
    got, want = got.float(), want.float()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (NaN payloads included, so a poisoned element never matches a
    written one)."""
    return (a.shape == b.shape and a.dtype == b.dtype
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
