"""The host's time of an op's calls (``layer_bench``'s ``host_*_us`` columns): per call with
nothing waited for, and the machine's own launch floors beside which a call's is read."""
from __future__ import annotations

import statistics
import time

import torch

from ...ops.moe.call_args import (FIRST_ADDRESS_PARAM, allocate_args, slot_packer,
                                  write_addresses, writer_function)
from ...ops.graph_launch import GraphCache
from ...ops.moe.op import CALL_TENSORS

FLOOR_GRAPH_NODES = (1, 8)  # a graph of one kernel, and of as many as a FusedMoE call's
FLOOR_HOLD_CYCLES = 100_000_000  # about 50 ms at H200 clocks: a round of calls queues behind it
FLOOR_BUSY_COPIES = 100  # device copies of HBM_COPY_BYTES, about 50 ms on an H200
HBM_COPY_BYTES = 1 << 30


def host_call_times_us(fn, calls: int = 10, repeats: int = 5,
                       hold=None) -> tuple[list[float], list[list[float]]]:
    """Host time of each eager call, nothing waited for (the queue holds every launch):
    ``repeats`` runs, each queued behind what ``hold()`` launches where given (untimed), the
    device synchronized between runs. A run's first call, the host back from waiting for the
    device, is timed apart (``first``); then ``calls`` calls back to back, as a forward issues
    its layers (``runs``). On an H200 machine the first call took up to 240 µs where the wait
    had lasted tens of ms, and 7-23 µs the calls after it (moe_layer/h200-x1/20261203T074100Z
    and …074246Z, ``host_first_call_us`` and ``host_call_median_us``; both retired, their bytes
    at 4df92bf)."""
    fn()
    torch.cuda.synchronize()
    first, runs = [], []
    for _ in range(repeats):
        if hold is not None:
            hold()
        stamps = [time.perf_counter()]
        for _ in range(calls + 1):
            fn()
            stamps.append(time.perf_counter())
        times = [(b - a) * 1e6 for a, b in zip(stamps, stamps[1:])]
        first.append(times[0])
        runs.append(times[1:])
        torch.cuda.synchronize()
    return first, runs


def host_overhead_us(fn, calls: int = 10, repeats: int = 5, hold=None) -> float:
    """Host time per eager call: the median over runs of a run's mean per call
    (``host_call_times_us``, its first call apart)."""
    return call_statistics_us(*host_call_times_us(fn, calls, repeats, hold))["overhead"]


def call_statistics_us(first: list[float], runs: list[list[float]]) -> dict:
    """Of ``host_call_times_us``' calls: ``overhead``, the median over runs of a run's mean per
    call; ``call_median``, the median single call; ``call_max``, the slowest; ``first_call``,
    the median over runs of a run's first call, timed apart."""
    calls = [c for r in runs for c in r]
    return {"overhead": statistics.median(statistics.fmean(r) for r in runs),
            "call_median": statistics.median(calls), "call_max": max(calls),
            "first_call": statistics.median(first)}


def launch_floor_us(device) -> float:
    """Host time of one bare kernel launch (a one-element ``add_``), nothing waited for: what
    every launch of a call costs the host on this machine at least."""
    t = torch.zeros(1, device=device)
    return host_overhead_us(lambda: t.add_(1), calls=100)


def launch_floors_us(device) -> dict:
    """The host's own launch costs, beside which a call's are read (columns
    ``host_floor_<what>_us``): a captured graph of n one-element ``add_`` kernels launched as a
    call launches its graph (``GraphCache``, ``graph_launch.GraphLauncher``), n one and as many
    as a call's graph holds (``FLOOR_GRAPH_NODES``), with the GPU idle (``graph<n>_idle``), with
    every round of calls queued behind a long kernel that touches no memory (``graph<n>_queued``)
    and behind device copies that keep HBM busy as long (``graph<n>_busy``); the graph of as many
    nodes whose first is the argument writer, its addresses rewritten at every launch as a call
    rewrites them (``graph<n>_rewrite_<state>``: what the rewrite adds to a graph's launch); and
    one bare ``add_`` queued behind the long kernel (``kernel_queued``; idle:
    ``host_launch_floor_us``)."""
    t = torch.zeros(1, device=device)
    src = torch.empty(HBM_COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def sleep():
        torch.cuda._sleep(FLOOR_HOLD_CYCLES)

    def copies():
        for _ in range(FLOOR_BUSY_COPIES):
            dst.copy_(src)

    stream, graphs = torch.cuda.current_stream(device).cuda_stream, GraphCache(device)
    floors = {"host_floor_kernel_queued_us": host_overhead_us(lambda: t.add_(1), hold=sleep)}
    n = FLOOR_GRAPH_NODES[-1]
    args = allocate_args(device)
    addresses = slot_packer(args, *CALL_TENSORS)(*[dst] * len(CALL_TENSORS))  # never read

    def rewritten():
        write_addresses(args, addresses)
        for _ in range(n - 1):
            t.add_(1)
    rewritten()  # the writer launched once: its function is known
    timed = [(f"graph{m}", graphs.capture(m, lambda: [t.add_(1) for _ in range(m)]), ())
             for m in FLOOR_GRAPH_NODES]
    timed.append((f"graph{n}_rewrite", graphs.capture(
        "rewrite", rewritten, (writer_function(), FIRST_ADDRESS_PARAM, addresses)), addresses))
    for name, graph, words in timed:
        for state, hold in (("idle", None), ("queued", sleep), ("busy", copies)):
            floors[f"host_floor_{name}_{state}_us"] = host_overhead_us(
                lambda: graph(stream, words), hold=hold)
    return floors
