"""``launcher.Launcher`` on a GPU (skipped elsewhere: CI has no GPU): its fast path (the bound
argument list handed to the driver) gives what Triton's own launch gives, for new tensors of the
same specialization, for a misaligned tensor (a second binding), on the current stream and
inside a captured CUDA graph; every output poisoned with -1 first."""
from __future__ import annotations

import pytest
import torch

from xstage_lab.kernel_sources import load_kernel_module
from xstage_lab.ops.launcher import Launcher

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

# the writer's slots, in its parameters' order (``call_args``; the block's last two are the
# routing's)
SLOTS = ("expert_ids", "x", "x_scale", "combine_rows", "topk_weights", "out")


def _launcher() -> Launcher:
    """``moe_args.write_args``: a tensor (the block) and six integers vary at every call."""
    return Launcher(load_kernel_module("moe_args").write_args)


def _block(offset: int = 0) -> torch.Tensor:
    """An argument block poisoned with -1, ``offset`` int64 elements into its allocation."""
    return torch.full((len(SLOTS) + offset,), -1, dtype=torch.int64, device="cuda")[offset:]


def _values(seed: int) -> dict:
    """Odd 64-bit integers: one specialization (the launcher keys on width, 1 and 16 | value)."""
    g = torch.Generator().manual_seed(seed)
    return {s: 2**40 + 2 * v + 1
            for s, v in zip(SLOTS, torch.randint(0, 2**60, (len(SLOTS),), generator=g).tolist())}


def _run(launch: Launcher, block: torch.Tensor, values: dict) -> torch.Tensor:
    launch((1,), args=block, **values)
    return block


def test_fast_path_matches_and_rebinds_on_a_new_specialization():
    launch = _launcher()
    for seed in range(3):  # the first call binds, the next two take the fast path
        values = _values(seed)
        assert _run(launch, _block(), values).tolist() == list(values.values())
    assert len(launch._bound) == 1
    shifted = _block(offset=1)  # 8 bytes in: not 16-byte aligned
    assert shifted.data_ptr() % 16
    values = _values(9)
    assert _run(launch, shifted, values).tolist() == list(values.values())
    assert len(launch._bound) == 2


def test_fast_path_runs_on_the_current_stream_and_in_a_graph():
    launch = _launcher()
    _run(launch, _block(), _values(0))  # bind
    block, values = _block(), _values(1)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            launch((1,), args=block, **values)
    for _ in range(2):
        block.fill_(-1)
        graph.replay()
        assert block.tolist() == list(values.values())
