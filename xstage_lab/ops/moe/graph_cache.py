"""The CUDA graphs of one op's calls (``GraphCache``), captured once per key without a sync and
launched with new addresses (``graph_launch.GraphLauncher``): a FusedMoE's and an
``MoEWorkspace``'s."""
from __future__ import annotations

import gc
from collections import OrderedDict

import torch
from triton.runtime import driver

from ..graph_launch import GraphLauncher

# Captured graphs a FusedMoE or MoEWorkspace keeps, least recently launched from Python dropped
# first (one still in flight is freed by the driver when it completes; a FusedMoE's compiled path
# does not reorder them): a graph holds no device memory of its own (a call allocates only its
# output, outside the graph), but each is a driver object of up to eight kernel nodes, and a
# server's token counts are unbounded.
GRAPHS_PER_LAYER = 16

class GraphCache:
    """The CUDA graphs of one op's calls, keyed by what fixes their launches, at most
    ``GRAPHS_PER_LAYER``, the least recently launched dropped first. ``capture`` records a
    call's launches into a new graph, nothing run and nothing synchronized
    (``torch.cuda.graph`` would synchronize the device first): on a side stream joined to the
    current one both ways (capture needs a stream other than the default), in ``thread_local``
    mode (other threads' CUDA calls cannot break it; this thread makes none: every launch of
    the key was bound by a direct call before)."""

    def __init__(self, device: torch.device, on_capture=None, on_drop=None):
        """``on_capture(key, launcher)`` / ``on_drop(key)``: told of each graph captured and of
        each dropped (before its launcher is released)."""
        self.device = device
        self.on_capture, self.on_drop = on_capture, on_drop
        self.graphs: OrderedDict[tuple, GraphLauncher] = OrderedDict()
        self.stream: torch.cuda.Stream | None = None  # made at the first capture
        # the current CUstream's getter, looked up once (Triton's driver resolves attributes at
        # every access); off CUDA nothing launches a graph
        self.current_stream = (driver.active.get_current_stream if device.type == "cuda"
                               else None)

    def __len__(self) -> int:
        return len(self.graphs)

    def __iter__(self):
        return iter(self.graphs)

    def __contains__(self, key: tuple) -> bool:
        return key in self.graphs

    def get(self, key: tuple) -> GraphLauncher | None:
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
        return graph

    def call(self, key: tuple, launches, addresses: tuple[int, ...] = (), rewrite=None) -> None:
        """One call of ``launches()``: directly where no graph launches (``launching_graphs``);
        else ``key``'s graph launched with ``addresses``, captured after a direct call at the
        key's first call (which binds every launch new at the key). ``rewrite()``, evaluated at
        a capture only, gives what ``GraphLauncher`` takes as ``rewrite``."""
        if not launching_graphs(self.device):
            launches()
            return
        graph = self.get(key)
        if graph is None:
            launches()
            self.capture(key, launches, rewrite() if rewrite is not None else None)
        else:
            graph(self.current_stream(self.device.index), addresses)

    def capture(self, key: tuple, launches, rewrite=None) -> GraphLauncher:
        """``launches()`` captured as ``key``'s graph; ``rewrite`` as ``GraphLauncher`` takes it."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        here, side = torch.cuda.current_stream(self.device), self.stream
        side.wait_stream(here)
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        # no cyclic collection inside the capture: it may free other graphs (a destroyed graph
        # frees its memory, which a capture forbids); torch.cuda.graph collects before instead,
        # after synchronizing
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    launches()
                finally:
                    graph.capture_end()
        finally:
            if collecting:
                gc.enable()
        here.wait_stream(side)
        launcher = self.graphs[key] = GraphLauncher(graph, rewrite)
        if len(self.graphs) > GRAPHS_PER_LAYER:
            dropped = next(iter(self.graphs))
            if self.on_drop is not None:
                self.on_drop(dropped)
            del self.graphs[dropped]
        if self.on_capture is not None:
            self.on_capture(key, launcher)
        return launcher


def launching_graphs(device: torch.device) -> bool:
    """Whether a call on ``device`` launches its graph (eagerly on CUDA), else launches directly
    (off CUDA, or while the current stream is being captured: into the user's graph)."""
    return device.type == "cuda" and not torch.cuda.is_current_stream_capturing()
