"""Multi-rank kernel timing as in paper §5.1, shared by every experiment.

One trial of a method: all ranks meet at a host barrier, then an all-reduce on the stream aligns
their device timelines; a CUDA event pair on each rank brackets the method. Per trial the time that
counts is the maximum over ranks (all-reduce MAX): the layer is done when the slowest rank is. The
reported figure is the median over trials with the p25/p75 spread; the order of the methods
rotates from trial to trial so that no method always runs first (or right after the same one).

Optionally every method is captured once in a CUDA graph of ``graph_iters`` back-to-back calls and
the graph is replayed per trial (per-call time = replay time / ``graph_iters``): launch overhead
leaves the measurement and sustained back-to-back behaviour shows, as for FA4 in §5.3. Methods must
then be capturable.

Without an initialised process group the same code times a single process (no barriers).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def _distributed() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _host_barrier(group) -> None:
    import torch.distributed as dist
    if dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def _graphed(fn: Callable[[], None], iters: int) -> Callable[[], None]:
    """Capture ``iters`` back-to-back calls of ``fn`` (already warmed up) in one CUDA graph."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    return graph.replay


def time_methods(methods: dict[str, Callable[[], None]], *, trials: int = 20, warmup: int = 3,
                 graph_iters: int | None = None, group=None) -> dict[str, dict]:
    """Time each method; returns ``{name: {"median_us", "p25_us", "p75_us", "min_us", "max_us",
    "trials_us", "calls_per_trial"}}``, times per call in microseconds, each trial the maximum
    over ranks. Every rank must call this with the same methods in the same order."""
    if not methods:
        raise ValueError("no methods to time")
    if trials < 1 or warmup < 0 or (graph_iters is not None and graph_iters < 1):
        raise ValueError(f"need trials >= 1, warmup >= 0, graph_iters >= 1 or None; got "
                         f"{trials}, {warmup}, {graph_iters}")
    names = list(methods)
    distributed = _distributed()
    fns = dict(methods)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    torch.cuda.synchronize()
    calls = 1
    if graph_iters is not None:
        fns = {name: _graphed(fns[name], graph_iters) for name in names}
        calls = graph_iters
        for name in names:  # first replay uploads the graph
            fns[name]()
        torch.cuda.synchronize()
    device = torch.device("cuda", torch.cuda.current_device())
    align = torch.zeros(1, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = torch.zeros(trials, len(names), dtype=torch.float64)
    for t in range(trials):
        shift = t % len(names)
        for name in names[shift:] + names[:shift]:
            torch.cuda.synchronize()
            if distributed:
                import torch.distributed as dist
                _host_barrier(group)
                dist.all_reduce(align, group=group)  # device-side start line shared by all ranks
            start.record()
            fns[name]()
            end.record()
            end.synchronize()
            times[t, names.index(name)] = start.elapsed_time(end) * 1e3 / calls
    if distributed:
        import torch.distributed as dist
        per_trial = times.to(device)
        dist.all_reduce(per_trial, op=dist.ReduceOp.MAX, group=group)
        times = per_trial.cpu()
    out = {}
    for j, name in enumerate(names):
        col = times[:, j].numpy()
        out[name] = {"median_us": float(np.median(col)), "p25_us": float(np.percentile(col, 25)),
                     "p75_us": float(np.percentile(col, 75)), "min_us": float(col.min()),
                     "max_us": float(col.max()), "trials_us": [float(v) for v in col],
                     "calls_per_trial": calls}
    return out


def read_sm_clock_mhz(device=None) -> int | None:
    """The current SM clock of ``device`` (default: the current one) through NVML, or None where
    pynvml is not importable or NVML does not answer."""
    try:
        import pynvml  # noqa: F401  (torch.cuda.clock_rate reads NVML through it)
    except ImportError:
        return None
    try:
        return int(torch.cuda.clock_rate(device))
    except Exception:  # NVML missing or refusing on this machine: the clock is unknown
        return None
