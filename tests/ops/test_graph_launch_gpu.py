"""``graph_launch.GraphLauncher`` on a GPU (skipped elsewhere: CI has no GPU): a graph of
``moe_args.write_args`` and a copy of its block, launched back to back with new addresses while a
long kernel holds the stream, so every launch is queued before any runs: each launch's copy holds
the addresses it was launched with (the driver copied the node's parameters at its launch), the
blocks poisoned with -1 first. A graph whose writer node was captured with other values than the
launcher is told, or with no such node, is refused before any launch."""
from __future__ import annotations

import pytest
import torch

from xstage_lab.kernel_sources import load_kernel_module
from xstage_lab.ops.graph_launch import DriverError, GraphLauncher
from xstage_lab.ops.launcher import Launcher

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

# the writer's slots, in its parameters' order (``call_args``; the block's last two are the
# routing's)
SLOTS = ("expert_ids", "x", "x_scale", "combine_rows", "topk_weights", "out")
LAUNCHES = 6
HOLD_CYCLES = 200_000_000  # about 0.1 s at H200 clocks: every launch is queued behind it


def _values(seed: int) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(2**40 + 16 * v for v in torch.randint(0, 2**50, (len(SLOTS),),
                                                        generator=g).tolist())


def _captured(launch: Launcher, block: torch.Tensor, copy: torch.Tensor, values):
    """A graph: the writer into ``block`` with ``values``, then ``block`` copied into ``copy``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(stream):
        graph.capture_begin()
        launch((1,), args=block, **dict(zip(SLOTS, values)))
        copy.copy_(block)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def test_queued_launches_keep_their_addresses():
    launch = Launcher(load_kernel_module("moe_args").write_args)
    block = torch.full((len(SLOTS),), -1, dtype=torch.int64, device="cuda")
    launch((1,), args=block, **dict(zip(SLOTS, _values(0))))  # bind
    copy = torch.full_like(block, -1)
    captured = _values(1)
    graph = GraphLauncher(_captured(launch, block, copy, captured),
                          (launch.function(), 1, captured))
    snapshots = torch.full((LAUNCHES, len(SLOTS)), -1, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(HOLD_CYCLES)
    stream = torch.cuda.current_stream().cuda_stream
    sent = [_values(10 + i) for i in range(LAUNCHES)]
    for i, values in enumerate(sent):
        graph(stream, values)
        snapshots[i].copy_(copy)
    torch.cuda.synchronize()
    assert [tuple(row) for row in snapshots.tolist()] == sent


def test_a_launcher_refuses_a_node_it_cannot_rewrite():
    launch = Launcher(load_kernel_module("moe_args").write_args)
    block = torch.full((len(SLOTS),), -1, dtype=torch.int64, device="cuda")
    launch((1,), args=block, **dict(zip(SLOTS, _values(0))))
    copy = torch.full_like(block, -1)
    captured = _values(2)
    with pytest.raises(DriverError, match="captured with"):
        GraphLauncher(_captured(launch, block, copy, captured), (launch.function(), 1, _values(3)))
    with pytest.raises(DriverError, match="not one"):
        GraphLauncher(_captured(launch, block, copy, captured), (launch.function() + 1, 1,
                                                                 captured))
