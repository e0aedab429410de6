"""``launcher.Launcher`` on a GPU (skipped elsewhere: CI has no GPU): its fast path (the bound
argument list handed to the driver) gives what Triton's own launch gives, for new tensors of the
same specialization, for a misaligned tensor (a second binding), on the current stream and
inside a captured CUDA graph; every output poisoned with NaN first."""
from __future__ import annotations

import pytest
import torch
import triton

from xstage_lab.kernel_sources import load_kernel_module
from xstage_lab.ops.launcher import Launcher
from xstage_lab.ops.moe.combine import weighted_sum_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

TOP_K, BLOCK_H = 4, 256


def _launcher() -> Launcher:
    return Launcher(load_kernel_module("moe_combine").weighted_sum, TOP_K=TOP_K, BLOCK_H=BLOCK_H)


def _run(launch: Launcher, rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.full((w.shape[0], rows.shape[1]), float("nan"), dtype=torch.bfloat16,
                     device="cuda")
    launch((w.shape[0], triton.cdiv(rows.shape[1], BLOCK_H)), rows=rows, weights=w, out=out,
           HIDDEN=rows.shape[1])
    return out


def _inputs(tokens: int, hidden: int, seed: int):
    g = torch.Generator("cuda").manual_seed(seed)
    rows = torch.randn(tokens * TOP_K + 1, hidden, generator=g, device="cuda").to(torch.bfloat16)
    return rows, torch.rand(tokens, TOP_K, generator=g, device="cuda")


def test_fast_path_matches_and_rebinds_on_a_new_specialization():
    launch = _launcher()
    for seed in range(3):  # the first call binds, the next two take the fast path
        rows, w = _inputs(7, 1024, seed)
        torch.testing.assert_close(_run(launch, rows, w), weighted_sum_reference(rows, w),
                                   rtol=2 ** -7, atol=1e-6)
    assert len(launch._bound) == 1
    rows, w = _inputs(5, 1004, 9)
    shifted = rows[1:]  # 2008 bytes in: not 16-byte aligned
    assert shifted.data_ptr() % 16
    torch.testing.assert_close(_run(launch, shifted, w), weighted_sum_reference(shifted, w),
                               rtol=2 ** -7, atol=1e-6)
    assert len(launch._bound) == 2


def test_fast_path_runs_on_the_current_stream_and_in_a_graph():
    launch = _launcher()
    rows, w = _inputs(9, 512, 1)
    _run(launch, rows, w)  # bind
    out = torch.empty(9, 512, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            launch((9, 2), rows=rows, weights=w, out=out, HIDDEN=512)
    for seed in (2, 3):
        new_rows, new_w = _inputs(9, 512, seed)
        rows.copy_(new_rows)
        w.copy_(new_w)
        out.fill_(float("nan"))
        graph.replay()
        torch.testing.assert_close(out, weighted_sum_reference(rows, w), rtol=2 ** -7, atol=1e-6)
