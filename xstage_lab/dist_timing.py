"""Multi-rank kernel timing as in paper §5.1, shared by every experiment.

One trial of a method: all ranks meet at a host barrier, then an all-reduce on the stream aligns
their device timelines; a CUDA event pair on each rank brackets the method. Per trial the time that
counts is the maximum over ranks (every rank's is gathered): the layer is done when the slowest
rank is. The
reported figure is the median over trials with the p25/p75 spread; the order of the methods
rotates from trial to trial so that no method always runs first (or right after the same one).

Optionally every method is captured once in a CUDA graph of ``graph_iters`` back-to-back calls and
the graph is replayed per trial (per-call time = replay time / ``graph_iters``): the launch gaps
between calls leave the measurement and sustained back-to-back behaviour shows, as for FA4 in §5.3.
A method that cannot be captured is named ``eager`` and launched back to back instead. A trial that
starts on an idle GPU still holds the replay's own launch (the host's ``replay`` and the
submission, before the first kernel: ``graph_iters``-th of it per call); with ``hold_cycles`` each
graphed trial's start is queued behind a kernel that spins that long, so the replay is launched
while the GPU is busy and the window holds the device's time of the calls and the gaps between
them, what a call costs inside a graph that holds more than the call (a model's forward).

Without an initialised process group the same code times a single process (no barriers).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .platform import SAFE_ENV


def require_safe_env() -> None:
    """Set the multicast switches where absent; refuse to run where someone turned them on."""
    for key, value in SAFE_ENV.items():
        if os.environ.setdefault(key, value) != value:
            raise SystemExit(f"{key}={os.environ[key]!r}: this run needs {key}={value} "
                             "(NVLink multicast off)")


def start_rank() -> tuple[int, int, int]:
    """Start this torchrun rank: NVLink multicast off (``require_safe_env``), the GPU of
    ``LOCAL_RANK`` and the NCCL process group bound to it. Returns ``(local_rank, rank, world)``;
    the caller destroys the group."""
    import torch.distributed as dist
    require_safe_env()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    return local_rank, dist.get_rank(), dist.get_world_size()


def all_gather_objects(obj, group=None) -> list:
    """Every rank's ``obj``, in rank order."""
    import torch.distributed as dist
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _distributed() -> bool:
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized()


def _host_barrier(group) -> None:
    import torch.distributed as dist
    if dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)


def graphed(fn: Callable[[], None], iters: int) -> Callable[[], None]:
    """Capture ``iters`` back-to-back calls of ``fn`` (already warmed up) in one CUDA graph."""
    graph = torch.cuda.CUDAGraph()
    # thread_local: NCCL's watchdog thread may query events while this thread captures.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(iters):
            fn()
    return graph.replay


def rotated_order(names: list[str], trial: int) -> list[str]:
    """The method order of trial ``trial``: the list rotated by ``trial`` places."""
    shift = trial % len(names)
    return names[shift:] + names[:shift]


def paired_ratio(numerator_trials_us, denominator_trials_us) -> float:
    """The median over trials of one method's time over another's in the same trial of
    ``time_methods`` (one rotation, the same clock state). A step in the GPU's clocks between
    trials moves both times of a trial together and leaves this ratio alone, where the ratio of
    the two medians can take the step for a difference between the methods."""
    return float(np.median(np.asarray(numerator_trials_us, dtype=float)
                           / np.asarray(denominator_trials_us, dtype=float)))


def median_clock_mhz(timing: dict) -> float:
    """The median SM clock over one method's trials (``time_methods(clocks=True)``), NaN where
    NVML never answered."""
    known = [c for c in timing.get("sm_clock_mhz", []) if c is not None]
    return float(np.median(known)) if known else float("nan")


# How ``time_methods`` times, for a record's metadata.
TIMING_METHOD = ("barrier-aligned trials, CUDA events per rank, max over ranks per trial, "
                 "median and p25/p75 over trials, method order rotated")
# About 50 µs at an H200's 1980 MHz SM clock: five times the host's replay of a layer call's graph
# (5.3-10.1 µs, host_replay_us of the moe_layer/h200-x1 records at one token), so that the replay
# is queued before the hold ends. Started idle, the graphed kernel alone of those records took
# 23.7 µs per trial (median over the 28 one-token cells; quartiles 16.1-32.3) over its device time
# as profiled in another pass.
HOLD_CYCLES = 100_000


def timing_method(graph_iters: int | None = None, hold_cycles: int = 0) -> str:
    """``TIMING_METHOD`` with what ``time_methods`` was given: the calls per trial, and the hold
    that each graphed trial's start was queued behind."""
    parts = [TIMING_METHOD]
    if graph_iters is not None:
        parts.append(f"{graph_iters} calls per trial")
        if hold_cycles:
            parts.append(f"each graphed trial started behind a {hold_cycles}-cycle hold kernel "
                         "(the replay launched while the GPU was busy)")
    return "; ".join(parts)


def time_methods(methods: dict[str, Callable[[], None]], *, trials: int = 20, warmup: int = 3,
                 graph_iters: int | None = None, group=None, eager: frozenset = frozenset(),
                 after: dict[str, Callable[[], None]] | None = None,
                 clocks: bool = False, hold_cycles: int = 0) -> dict[str, dict]:
    """Time each method; returns ``{name: {"median_us", "p25_us", "p75_us", "min_us", "max_us",
    "trials_us", "per_rank_us", "calls_per_trial"}}``, times per call in microseconds, each
    trial's the maximum over ranks (``per_rank_us`` keeps every rank's). Methods named in
    ``eager`` run as plain back-to-back launches where a graph cannot capture them. ``after[name]``
    runs after each invocation of that method (each call in warm-up, each replay of its
    ``graph_iters`` calls when timed), outside the timed window: e.g. a barrier that makes remote
    stores visible once per replay (§5.1). ``clocks``: each trial also reads every rank's SM clock
    (``read_sm_clock_mhz``) while the method runs, right after its launch, into
    ``"sm_clock_mhz"`` (per trial, the lowest over ranks; None where NVML does not answer) and
    ``"per_rank_sm_clock_mhz"``: under DVFS a trial's time is then read beside its clock.
    ``hold_cycles`` > 0 (with ``graph_iters``): each trial of a graphed method (not ``eager``)
    starts behind ``torch.cuda._sleep(hold_cycles)``, queued after the ranks' start line, so its
    window opens when the hold ends, the replay launched by then; ``"unheld_trials"`` counts the
    trials whose start the GPU had passed (on any rank) before the replay's launch returned: their
    window holds part of the launch, and a longer hold would have kept it out. Its clock is read
    once the window is open. Every rank must call this with the same methods in the same order."""
    if not methods:
        raise ValueError("no methods to time")
    if trials < 1 or warmup < 0 or (graph_iters is not None and graph_iters < 1):
        raise ValueError(f"need trials >= 1, warmup >= 0, graph_iters >= 1 or None; got "
                         f"{trials}, {warmup}, {graph_iters}")
    if hold_cycles < 0 or (hold_cycles and graph_iters is None):
        raise ValueError(f"a hold (hold_cycles {hold_cycles}) needs hold_cycles >= 0 and "
                         f"graphed methods (graph_iters {graph_iters})")
    names = list(methods)
    held = {name for name in names if hold_cycles and name not in eager}
    after = after or {}
    distributed = _distributed()

    def call(name, fn):
        fn()
        if name in after:
            after[name]()

    # Warm-up (lazy initialisation, allocator pools) on a side stream when graphs will be captured,
    # as torch.cuda.graph asks.
    warm = torch.cuda.Stream() if graph_iters is not None else torch.cuda.current_stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for name in names:
            for _ in range(warmup):
                call(name, methods[name])
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    fns, calls = dict(methods), 1
    if graph_iters is not None:
        calls = graph_iters
        for name in names:
            fn = methods[name]
            fns[name] = ((lambda fn=fn: [fn() for _ in range(graph_iters)]) if name in eager
                         else graphed(fn, graph_iters))
            call(name, fns[name])  # the first replay uploads the graph
        torch.cuda.synchronize()
    device = torch.device("cuda", torch.cuda.current_device())
    align = torch.zeros(1, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = torch.zeros(trials, len(names), dtype=torch.float64)
    # NaN where the clock is unknown (or not asked for)
    clock = torch.full((trials, len(names)), float("nan"), dtype=torch.float64)
    unheld = torch.zeros((trials, len(names)), dtype=torch.float64)
    for t in range(trials):
        for name in rotated_order(names, t):
            torch.cuda.synchronize()
            if distributed:
                import torch.distributed as dist
                _host_barrier(group)
                dist.all_reduce(align, group=group)  # device-side start line shared by all ranks
            if name in held:
                torch.cuda._sleep(hold_cycles)
            start.record()
            fns[name]()
            end.record()
            if name in held:
                unheld[t, names.index(name)] = float(start.query())
            if clocks:  # the host returns at launch: the GPU is running the method now
                if name in held:
                    start.synchronize()  # held: once the hold has ended and the method runs
                mhz = read_sm_clock_mhz()
                clock[t, names.index(name)] = float("nan") if mhz is None else mhz
            if name in after:
                after[name]()
            torch.cuda.synchronize()
            times[t, names.index(name)] = start.elapsed_time(end) * 1e3 / calls
    per_rank, per_rank_clock, per_rank_unheld = times[None], clock[None], unheld[None]
    if distributed:
        import torch.distributed as dist
        gathered = torch.empty((dist.get_world_size(group), 3, trials, len(names)),
                               dtype=torch.float64, device=device)
        dist.all_gather_into_tensor(gathered, torch.stack([times, clock, unheld]).to(device),
                                    group=group)
        per_rank, per_rank_clock, per_rank_unheld = (gathered[:, i].cpu() for i in range(3))
    worst = per_rank.max(dim=0).values.numpy()  # [trials, methods]: the slowest rank per trial
    out = {}
    for j, name in enumerate(names):
        col = worst[:, j]
        out[name] = {"median_us": float(np.median(col)), "p25_us": float(np.percentile(col, 25)),
                     "p75_us": float(np.percentile(col, 75)), "min_us": float(col.min()),
                     "max_us": float(col.max()), "trials_us": [float(v) for v in col],
                     "per_rank_us": per_rank[:, :, j].tolist(), "calls_per_trial": calls}
        if name in held:
            out[name]["unheld_trials"] = int(per_rank_unheld[:, :, j].amax(dim=0).sum())
        if clocks:
            mhz = per_rank_clock[:, :, j]
            out[name]["per_rank_sm_clock_mhz"] = [[_mhz(v) for v in r] for r in mhz.tolist()]
            out[name]["sm_clock_mhz"] = [_mhz(v) for v in mhz.min(dim=0).values.tolist()]
    return out


def kernel_times_us(fn: Callable[[], None], calls: int = 10) -> dict[str, float]:
    """Device time per call of each kernel (and copy or fill) that ``fn`` launches, by name, as
    torch.profiler's CUDA activity (CUPTI) records it over ``calls`` calls after one unprofiled
    call: where a call's time goes, not a timing to compare (the profiler adds its own cost)."""
    from torch.autograd import DeviceType

    return {e.key: e.self_device_time_total / calls for e in _profiled(fn, calls).key_averages()
            if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0}


def kernel_boundaries_us(fn: Callable[[], None], calls: int = 10) -> dict[str, float]:
    """The device's time from the end of each activity (kernel, copy or fill) that ``fn``
    launches to the start of the next, per pair ``"a -> b"`` of their names (``boundaries_us``),
    as torch.profiler's CUDA activity (CUPTI) stamps them over ``calls`` calls after one
    unprofiled call: what a sequence of launches leaves between its kernels (the pair from one
    call to the next included)."""
    from torch.autograd import DeviceType

    return boundaries_us([(e.time_range.start, e.time_range.end, e.name)
                          for e in _profiled(fn, calls).events()
                          if e.device_type == DeviceType.CUDA])


def _profiled(fn: Callable[[], None], calls: int):
    """torch.profiler's CUDA activity over ``calls`` calls of ``fn`` after one unprofiled call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof


def boundaries_us(activities: Sequence[tuple[float, float, str]]) -> dict[str, float]:
    """Per pair ``"a -> b"`` of activities ``(start_us, end_us, name)`` consecutive by start,
    the median over its occurrences of the next one's start less the previous one's end
    (below zero where they overlapped)."""
    ordered = sorted(activities)
    gaps: dict[str, list[float]] = {}
    for (_, end, before), (start, _, after) in zip(ordered, ordered[1:]):
        gaps.setdefault(f"{before} -> {after}", []).append(start - end)
    return {pair: float(np.median(g)) for pair, g in gaps.items()}


def _mhz(value: float) -> float | None:
    return None if value != value else value  # NaN: the clock was not known


def _clock_errors() -> tuple[type[BaseException], ...]:
    """What reading the clock raises where it cannot be read: pynvml missing (ImportError), the
    driver not loaded (RuntimeError), NVML refusing (NVMLError)."""
    try:
        from pynvml import NVMLError
    except ImportError:
        return ImportError, RuntimeError
    return ImportError, RuntimeError, NVMLError


# Why the SM clock could not be read, the first time since the last ``take_clock_unread`` (None:
# every read answered); the harness writes it into a run's header.
_clock_unread: str | None = None


def read_sm_clock_mhz(device=None) -> int | None:
    """The current SM clock of ``device`` (default: the current one) through NVML, or None where
    it cannot be read (the first reason is kept for ``take_clock_unread`` and said on stderr)."""
    global _clock_unread
    try:
        return int(torch.cuda.clock_rate(device))
    except _clock_errors() as e:
        if _clock_unread is None:
            _clock_unread = f"{type(e).__name__}: {' '.join(str(e).split())}"
            print(f"SM clock not read: {_clock_unread}", file=sys.stderr, flush=True)
        return None


def take_clock_unread() -> str | None:
    """Why the SM clock could not be read since the last call (None: it always was), and forget
    it."""
    global _clock_unread
    reason, _clock_unread = _clock_unread, None
    return reason
