"""SPMD per-tile trace of the X-Stage-fused attention epilogue (issue 6: the attention kernel's
measured burst schedule, for the design test and the simulator; ``trace`` reads it).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
    torchrun --standalone --nproc_per_node=P -m xstage_lab.experiments.attention.trace_bench \\
        --out FILE [--seq 8192,...,65536] [--heads 24] [--head-dim 128] [--launches 3]

One process per GPU, the configuration of the Table 3 benchmark (the default kernel, or the fastest
candidate with ``--tune``); a trace row is an output tile (a consumer warpgroup's half tile for
the gluon_ws kernel, ``ulysses.trace_block_m``).
Per sequence length M:
1. ``bench.check_case`` (every path against float32 and Serial, outputs poisoned), then
   the instrumented build itself: Fused into the peers' buffers and the local control (the same
   code storing into P buffers on this GPU, §3.1) with their outputs and traces poisoned, Fused
   bitwise equal to Serial, the control to FA-only, every trace row stamped and ordered.
2. ``--settle-s`` of FA-only, then ``--launches`` rounds of the two instrumented launches, the
   order alternating per round (``--repeat-build``: each after an untraced launch of itself;
   ``--prime-copy``: Fused after the remote-store All-to-All to the same addresses); each launch is eager, between CUDA events, with the SM clock read
   after it; Fused's stores are made visible (one barrier) after its timed launch.
Rank 0 writes one JSON file: a row per (M, rank, build, launch) with the per-tile times as lists,
in ns from the launch's first tile entry.
"""
from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import triton

from ...checks import bitwise_equal
from ...dist_timing import all_gather_objects, read_sm_clock_mhz, start_rank
from ...platform import provenance
from ..output import write_output
from . import ulysses as att
from .bench import (DEFAULT_SEQ, DEVICE, SETTLE_S, check_case, settle, shape_sweep, tune,
                    validate)

BUILDS = ("fused", "control")  # remote stores to the peers; the same code storing on this GPU
POISON_STAMP = -1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m xstage_lab.experiments.attention.trace_bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="JSON file written by rank 0")
    p.add_argument("--seq", default=",".join(map(str, DEFAULT_SEQ)),
                   help="comma-separated sequence lengths M")
    p.add_argument("--heads", type=int, default=24, help="total heads H (divisible by P)")
    p.add_argument("--head-dim", type=int, default=128, choices=att.HEAD_DIMS)
    p.add_argument("--launches", type=int, default=3, help="traced launches per build and M")
    p.add_argument("--settle-s", type=float, default=SETTLE_S,
                   help="seconds of FA-only back to back before each M's launches")
    p.add_argument("--repeat-build", action="store_true",
                   help="launch each build once untraced right before its traced launch, so the "
                        "traced launch follows itself instead of the other build (what the first "
                        "wave meets: the same destination pages and cache state, or the other's)")
    p.add_argument("--prime-copy", action="store_true",
                   help="before each traced Fused launch, the remote-store All-to-All "
                        "(``remote_store_a2a``) writes the same receive-buffer addresses: is what "
                        "the first wave meets the destinations' state or the kernel's")
    p.add_argument("--tune", action="store_true",
                   help="time the candidate configurations first (as attention.bench does)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.seq = [int(s) for s in args.seq.split(",") if s]
    # attention.bench.validate's fields
    args.trials, args.iters, args.eager = 1, 1, []
    return args


def check_trace(trace: np.ndarray, name: str) -> list[str]:
    """Every row stamped (no poison left) and ordered: entry <= epilogue start <= epilogue end."""
    entry, start, end = trace[:, 0], trace[:, 1], trace[:, 2]
    failures = []
    unstamped = int((trace[:, :3] == POISON_STAMP).any(axis=1).sum())
    if unstamped:
        failures.append(f"{name}: {unstamped} tiles not stamped")
    elif not ((entry <= start) & (start <= end)).all():
        failures.append(f"{name}: stamps out of order")
    return failures


def trace_launch(build: str, q, k, v, cfg, buf, local_table, rank, world, trace,
                 repeat_build: bool = False, prime: torch.Tensor | None = None) -> tuple:
    """One instrumented launch between CUDA events: (trace on the host, µs, SM clock after);
    ``repeat_build``: after an untraced launch of the same build; ``prime`` (an attention output
    [M, H/P, d]): a Fused launch after the remote-store All-to-All of it."""
    table = buf.peer_ptrs if build == "fused" else local_table
    if repeat_build:
        att.fused_attention_a2a(q, k, v, table, rank, world, config=cfg)
        if build == "fused":
            buf.barrier()
    if prime is not None and build == "fused":
        att.remote_store_a2a(prime, buf.peer_ptrs, rank, world)
        buf.barrier()
    trace.fill_(POISON_STAMP)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    att.fused_attention_a2a(q, k, v, table, rank, world, config=cfg, trace=trace)
    stop.record()
    stop.synchronize()
    clock = read_sm_clock_mhz()
    if build == "fused":
        buf.barrier()  # sender-visible boundary: the stores complete outside the timed window
    return trace.cpu().numpy(), start.elapsed_time(stop) * 1e3, clock


def trace_case(seq_len, args, cfg, buf, group) -> list[dict]:
    """Step 1 (correctness, including the instrumented build) and step 2 at one M; this rank's
    rows."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    H, d = args.heads, args.head_dim
    _, q, k, v, out_fa, (local_recv, local_table) = check_case(
        seq_len, H, d, cfg, buf, group, seed=args.seed + 1000 * seq_len + rank)
    trace = torch.empty((att.trace_tiles(q, cfg), att.TRACE_FIELDS), dtype=torch.int64,
                        device=DEVICE)
    serial = att.nccl_a2a(out_fa, group)
    recv = buf.view(seq_len, H, d)
    recv.fill_(float("nan"))
    local_recv.fill_(float("nan"))
    buf.barrier()
    h = H // world
    failures = []
    for build in BUILDS:
        stamps, _, _ = trace_launch(build, q, k, v, cfg, buf, local_table, rank, world, trace)
        failures += check_trace(stamps, build)
    if not bitwise_equal(recv, serial):
        failures.append("instrumented Fused differs from Serial")
    if not bitwise_equal(local_recv[:, :, rank * h:(rank + 1) * h].reshape(out_fa.shape), out_fa):
        failures.append("instrumented local control differs from FA-only")
    bad = {r: f for r, f in enumerate(all_gather_objects(failures, group)) if f}
    if bad:
        raise RuntimeError(f"instrumented build failed its checks at M={seq_len}; nothing was "
                           f"traced. Failures by rank: {bad}")

    settle(lambda: att.flash_attention(q, k, v, out=out_fa, config=cfg), args.settle_s)
    rows = []
    for launch in range(args.launches):
        for build in BUILDS if launch % 2 == 0 else BUILDS[::-1]:
            dist.barrier(group)
            stamps, kernel_us, clock = trace_launch(build, q, k, v, cfg, buf, local_table, rank,
                                                    world, trace, args.repeat_build,
                                                    out_fa if args.prime_copy else None)
            t0 = int(stamps[:, 0].min())
            # %globaltimer stamps: integer ns (multiples of its 32 ns step in the committed
            # records), so there is no float resolution to declare; a lean record keeps these
            # lists exactly, as integer lists (records._lean)
            rows.append(dict(M=seq_len, heads=H, head_dim=d, P=world, rank=rank, build=build,
                             launch=launch, kernel_us=kernel_us, sm_clock_mhz=clock,
                             entry_ns=(stamps[:, 0] - t0).tolist(),
                             q_loop_ns=(stamps[:, 1] - stamps[:, 0]).tolist(),
                             epilogue_ns=(stamps[:, 2] - stamps[:, 1]).tolist(),
                             smid=stamps[:, 3].tolist()))
    del local_recv
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    _, rank, world = start_rank()
    group = dist.group.WORLD
    try:
        validate(args, world)
        if args.launches < 1:
            raise ValueError(f"--launches must be >= 1, got {args.launches}")
        started = time.time()
        buf = att.symmetric_receive_buffer(max(args.seq) // world * args.heads * args.head_dim,
                                           group)
        cfg, tuning = (tune(args, group) if args.tune
                       else (att.flash_attention_config(args.head_dim, device=DEVICE), []))
        rows = []
        for seq_len in (p["M"] for p in shape_sweep(args, "fa_trace").points()):
            mine = trace_case(seq_len, args, cfg, buf, group)
            rows += [r for per_rank in all_gather_objects(mine, group) for r in per_rank]
            if rank == 0:
                us = {b: np.median([r["kernel_us"] for r in mine if r["build"] == b])
                      for b in BUILDS}
                print(f"[attention.trace_bench] M={seq_len}: " + ", ".join(
                    f"{b}={t:.1f}us" for b, t in us.items()), file=sys.stderr, flush=True)
        if rank == 0:
            write_result(args, world, cfg, tuning, rows, time.time() - started)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def write_result(args, world, cfg, tuning, rows, elapsed_s) -> None:
    meta = dict(
        experiment="fa_trace",
        created_utc=datetime.now(timezone.utc).isoformat(),
        params=dict(seq=args.seq, heads=args.heads, head_dim=args.head_dim, P=world,
                    launches=args.launches, settle_s=args.settle_s, seed=args.seed,
                    tuned=args.tune, repeat_build=args.repeat_build,
                    prime_copy=args.prime_copy, trace_block_m=att.trace_block_m(cfg)),
        config=cfg,
        tuning=tuning,
        timing=("per trace row (an output tile; a consumer warpgroup's half tile for gluon_ws), "
                "%globaltimer (ns) at entry, epilogue start and epilogue end (every store "
                "issued), each after a barrier of the CTA (the warpgroup), in the instrumented "
                "build; "
                "entry_ns from the launch's first tile entry, q_loop_ns = epilogue start - entry, "
                "epilogue_ns = epilogue end - epilogue start; kernel_us from CUDA events around "
                "one eager launch; builds alternate in order per round"),
        layout=("trace row t, b = params.trace_block_m rows: rows [(t % (M/b))·b, +b) of local "
                "head t // (M/b); they belong to rank (t % (M/b)) * b // (M/P)"),
        versions=dict(torch=torch.__version__, triton=triton.__version__,
                      cuda=torch.version.cuda),
        gpu_name=torch.cuda.get_device_name(),
        elapsed_s=elapsed_s,
        provenance=provenance(),
    )
    write_output(args.out, meta, rows)
    print(f"[attention.trace_bench] wrote {args.out}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
