"""SPMD per-tile trace of the X-Stage-fused attention epilogue (issue 6: the attention kernel's
measured burst schedule, for the design test and the simulator; ``trace`` reads it).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
    torchrun --standalone --nproc_per_node=P -m xstage_lab.experiments.attention.trace_bench \\
        (--out FILE | --root DIR) [--seq 8192,...,65536] [--heads 24] [--head-dim 128]
        [--launches 3] [--chunk I/N]

An ``Experiment`` run by ``experiments.harness``: ``attention.bench``'s (its ``Sweep`` over M at
the fixed heads and head dim, its inputs and checks) with traced launches for its timing.

One process per GPU, the configuration of the Table 3 benchmark (the default kernel, or the fastest
candidate with ``--tune``); a trace row is an output tile (a consumer warpgroup's half tile for
the gluon_ws kernel, ``ulysses.trace_block_m``).
Per sequence length M:
1. ``cases.check_case`` (every path against float32 and Serial, outputs poisoned), then
   the instrumented build itself: Fused into the peers' buffers and the local control (the same
   code storing into P buffers on this GPU, §3.1) with their outputs and traces poisoned, Fused
   bitwise equal to Serial, the control to FA-only, every trace row stamped and ordered. Any
   failure on any rank stops every rank before anything is traced.
2. ``--settle-s`` of FA-only, then ``--launches`` rounds of the two instrumented launches, the
   order alternating per round (``--repeat-build``: each after an untraced launch of itself;
   ``--prime-copy``: Fused after the remote-store All-to-All to the same addresses); each launch
   is eager, between CUDA events, with the SM clock read after it; Fused's stores are made
   visible (one barrier) after its timed launch.
Rank 0 writes the output: a row per (M, rank, build, launch) with the per-tile times as lists, in
ns from the launch's first tile entry.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist
import triton

from ...checks import bitwise_equal
from ...dist_timing import read_sm_clock_mhz
from .. import harness
from ..harness import Run
from ...ops import attention as att
from .bench import UlyssesAttention
from .cases import DEVICE, add_shape_arguments, check_shape_args
from .table3 import SETTLE_S, settle

BUILDS = ("fused", "control")  # remote stores to the peers; the same code storing on this GPU
POISON_STAMP = -1


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


def check_instrumented(case, cfg, buf, group) -> list[str]:
    """The instrumented build at one checked M (``cases.check_case`` first): Fused and the local
    control with their outputs and traces poisoned, Fused bitwise equal to Serial, the control to
    FA-only, every trace row stamped and ordered; sets ``case.trace``. This rank's failures."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    seq_len, H, d = case.point["M"], case.point["heads"], case.point["head_dim"]
    q, k, v, out_fa, (local_recv, local_table) = case.q, case.k, case.v, case.out_fa, case.local
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
    case.trace = trace
    return failures


def trace_case(case, args, cfg, buf, group) -> list[dict]:
    """Step 2 at one checked M: this rank's rows."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    seq_len, H, d = case.point["M"], case.point["heads"], case.point["head_dim"]
    q, k, v, out_fa, local_table, trace = (case.q, case.k, case.v, case.out_fa, case.local[1],
                                           case.trace)
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
    torch.cuda.empty_cache()
    return rows


TIMING = ("per trace row (an output tile; a consumer warpgroup's half tile for gluon_ws), "
          "%globaltimer (ns) at entry, epilogue start and epilogue end (every store issued), each "
          "after a barrier of the CTA (the warpgroup), in the instrumented build; entry_ns from "
          "the launch's first tile entry, q_loop_ns = epilogue start - entry, epilogue_ns = "
          "epilogue end - epilogue start; kernel_us from CUDA events around one eager launch; "
          "builds alternate in order per round")
LAYOUT = ("trace row t, b = params.trace_block_m rows: rows [(t % (M/b))·b, +b) of local head "
          "t // (M/b); they belong to rank (t % (M/b)) * b // (M/P)")


class AttentionTrace(UlyssesAttention):
    """The Table 3 run's shapes, inputs and checks; per M, traced launches of Fused and the local
    control instead of the timed methods."""

    name = "fa_trace"
    in_measure_all = True
    paper = "issue 6: the attention epilogue's burst schedule (§3.1 local control)"

    def measure_all_args(self, written, root) -> list[str]:
        """Each build launched once untraced before its traced launch: the state the Table 3
        replays run in (notebook 04)."""
        return ["--repeat-build"]

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_shape_arguments(p)
        p.add_argument("--launches", type=int, default=3, help="traced launches per build and M")
        p.add_argument("--settle-s", type=float, default=SETTLE_S,
                       help="seconds of FA-only back to back before each M's launches")
        p.add_argument("--repeat-build", action="store_true",
                       help="launch each build once untraced right before its traced launch, so "
                            "the traced launch follows itself instead of the other build (what "
                            "the first wave meets: the same destination pages and cache state, "
                            "or the other's)")
        p.add_argument("--prime-copy", action="store_true",
                       help="before each traced Fused launch, the remote-store All-to-All "
                            "(``remote_store_a2a``) writes the same receive-buffer addresses: is "
                            "what the first wave meets the destinations' state or the kernel's")
        p.add_argument("--tune", action="store_true",
                       help="time the candidate configurations first (as attention.bench does)")
        p.add_argument("--seed", type=int, default=0)

    def check_args(self, a: argparse.Namespace) -> None:
        check_shape_args(a)
        if a.launches < 1:
            raise ValueError(f"--launches must be >= 1, got {a.launches}")
        a.iters, a.eager = 1, []  # what ``tune`` times: one call per graph, none eager

    def check(self, case, run: Run) -> list[str]:
        # every path first: the instrumented build runs only where they all pass on every rank
        run.require(super().check(case, run), f"M={case.point['M']}")
        return check_instrumented(case, self.cfg, self.buf, self.group)

    def measure(self, case, run: Run) -> list[dict]:
        """Every rank's rows (rank 0 writes them)."""
        mine = trace_case(case, run.args, self.cfg, self.buf, self.group)
        return [row for rows in run.gather(mine) for row in rows]

    def progress_line(self, rows) -> str:
        mine = rows[rows["rank"] == 0]
        return f"[attention.trace_bench] M={mine['M'].iloc[0]}: " + ", ".join(
            f"{b}={mine.loc[mine['build'] == b, 'kernel_us'].median():.1f}us" for b in BUILDS)

    def metadata(self, run: Run) -> dict:
        a, cfg = run.args, self.cfg
        return dict(
            params=dict(seq=a.seq, heads=a.heads, head_dim=a.head_dim, P=run.world,
                        launches=a.launches, settle_s=a.settle_s, seed=a.seed, tuned=a.tune,
                        repeat_build=a.repeat_build, prime_copy=a.prime_copy,
                        trace_block_m=None if cfg is None else att.trace_block_m(cfg)),
            config=cfg, tuning=self.tuning, timing=TIMING, layout=LAYOUT,
            versions=dict(torch=torch.__version__, triton=triton.__version__,
                          cuda=torch.version.cuda))


EXPERIMENT = AttentionTrace()


if __name__ == "__main__":
    harness.main(EXPERIMENT)
