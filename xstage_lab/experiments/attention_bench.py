"""SPMD benchmark of Ulysses attention with its post-attention All-to-All (paper §5.3, Table 3).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
    torchrun --standalone --nproc_per_node=P -m xstage_lab.experiments.attention_bench --out FILE \\
        [--seq 8192,16384,32768,49152,65536] [--heads 24] [--head-dim 128] [--trials 20] [--iters 10]

One process per GPU. Per sequence length M:
1. Correctness first, on fresh random inputs with every output poisoned (NaN) before its run:
   Fused bitwise equal to Serial (the same kernel, then NCCL ``all_to_all_single``) on every rank;
   FA-only, Serial, Fused and SDPA+NCCL within bf16 tolerance of a float32 reference; the
   remote-store A2A bitwise equal to the NCCL A2A. Any failure aborts every rank before timing.
2. Timing as §5.1 describes: each method is captured ``iters`` times back to back in one CUDA
   graph; a trial aligns all ranks (``dist_timing.time_methods``), replays the graph between CUDA
   events on every rank, and takes the maximum over ranks; rows report the median over trials
   and the IQR. Method order rotates across trials; SM clocks are read before and after each M.
   The boundary is sender-visible: remote-store methods synchronize remote visibility once after
   the replay, outside the timed window; NCCL methods include their own completion.
Rank 0 writes one JSON file: rows (Table 3 quantities), per-trial raw times and metadata.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.distributed as dist
import triton

from ..checks import bitwise_equal, poisoned, relative_error
from ..dist_timing import (all_gather_objects, read_sm_clock_mhz, require_safe_env, rotated_order,
                           time_methods)
from ..platform import provenance
from . import attention as att

DEFAULT_SEQ = (8192, 16384, 32768, 49152, 65536)
METHODS = ("fa", "fa_same_code", "sdpa", "a2a_nccl", "a2a_remote", "serial", "fused", "sdpa_nccl")
REMOTE_METHODS = ("a2a_remote", "fused")
REL_TOL = 1e-2        # relative Frobenius error allowed against the float32 reference (bf16 output)
TUNE_TRIALS = 3
TUNE_MAX_SEQ = 16384  # configurations are timed at the largest swept M up to this
DEVICE = "cuda"       # the current CUDA device of this rank


def attention_flops(seq_len: int, heads: int, head_dim: int, world: int) -> int:
    """Per-rank FLOPs of non-causal attention forward: QK^T and PV over H/P heads, 4 M^2 d H/P."""
    return 4 * seq_len * seq_len * head_dim * heads // world


def table3_row(seq_len: int, heads: int, head_dim: int, world: int, med: dict, iqr: dict) -> dict:
    """One Table 3 row from per-method medians and IQRs (µs per call).

    speedup = T_serial / T_fused; E_res = T_fused - T_FA (§5.3); hiding ratio
    H = 1 - (T_fused - T_FA) / (T_serial - T_FA) (eq. 21); TF/s from ``attention_flops``.
    ``e_res_same_code_us`` is E_res against FA-only run through the fused kernel's own code with
    local destinations, which separates the remote stores from the two epilogues' code.
    """
    flops = attention_flops(seq_len, heads, head_dim, world)
    fa, fused, serial = med["fa"], med["fused"], med["serial"]
    row = dict(M=seq_len, heads=heads, head_dim=head_dim, P=world,
               **{f"{m}_us": med[m] for m in METHODS},
               speedup=serial / fused,
               hiding_ratio=1 - (fused - fa) / (serial - fa),
               e_res_us=fused - fa,
               e_res_same_code_us=fused - med["fa_same_code"],
               fa_tflops=flops / fa / 1e6,
               cudnn_tflops=flops / med["sdpa"] / 1e6,
               speedup_over_sdpa_nccl=med["sdpa_nccl"] / fused,
               **{f"{m}_iqr_us": iqr[m] for m in METHODS})
    row["fa_over_cudnn"] = row["fa_tflops"] / row["cudnn_tflops"]
    return row


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="JSON file written by rank 0")
    p.add_argument("--seq", default=",".join(map(str, DEFAULT_SEQ)),
                   help="comma-separated sequence lengths M")
    p.add_argument("--heads", type=int, default=24, help="total heads H (divisible by P)")
    p.add_argument("--head-dim", type=int, default=128, choices=att.HEAD_DIMS)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--iters", type=int, default=10, help="back-to-back calls per CUDA graph")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tune", action="store_true",
                   help="use the configuration table as is instead of timing its candidates")
    p.add_argument("--eager", default="",
                   help="comma-separated methods launched back to back without a CUDA graph "
                        "(for a method that cannot be captured); recorded in the metadata")
    args = p.parse_args(argv)
    args.seq = [int(s) for s in args.seq.split(",") if s]
    args.eager = [s for s in args.eager.split(",") if s]
    return args


def validate(args, world: int) -> None:
    """Raise ValueError before any launch (the same verdict on every rank)."""
    if not args.seq or min(args.seq) <= 0:
        raise ValueError(f"--seq must list positive lengths, got {args.seq}")
    if args.heads < 1:
        raise ValueError(f"--heads must be >= 1, got {args.heads}")
    # Tiles are powers of two: a multiple of the largest suits every candidate configuration.
    tile = max(max(c["BLOCK_M"], c["BLOCK_N"]) for c in att.flash_attention_candidates(args.head_dim))
    for m in args.seq:
        att.check_ulysses_shape(m, args.heads, world)
        if m % tile:
            raise ValueError(f"sequence length M={m} must be a multiple of the {tile}-row tiles")
    if args.trials < 1 or args.iters < 1:
        raise ValueError("--trials and --iters must be >= 1")
    unknown = set(args.eager) - set(METHODS)
    if unknown:
        raise ValueError(f"--eager names unknown methods {sorted(unknown)}; methods: {METHODS}")


def random_qkv(seq_len: int, h_local: int, head_dim: int, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(seq_len, h_local, head_dim, generator=g, device=DEVICE,
                        dtype=torch.float32).to(att.DTYPE) for _ in range(3)]


def check_case(seq_len, heads, head_dim, cfg, buf, group, seed):
    """Correctness of every path at one M (step 1); returns (metrics, q, k, v, FA output, local
    destination buffers and their table for the same-code FA-only control).

    Raises RuntimeError on every rank if any check fails on any rank.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = random_qkv(seq_len, heads // world, head_dim, seed)
    out_fa = att.flash_attention(q, k, v, out=poisoned(q.shape, att.DTYPE, DEVICE), config=cfg)
    ref = att.reference_attention(q, k, v)
    ref_recv = att.nccl_a2a(ref, group)  # float32: what this rank must receive (§4.3 layout)
    recv_shape = (seq_len // world, heads, head_dim)
    serial = att.nccl_a2a(out_fa, group, out=poisoned(recv_shape, att.DTYPE, DEVICE))

    recv = buf.view(seq_len, heads, head_dim)
    recv.fill_(float("nan"))
    buf.barrier()  # every rank poisoned its buffer before any peer stores into it
    att.fused_attention_a2a(q, k, v, buf.peer_ptrs, rank, world, config=cfg)
    buf.barrier()
    fused_equal, fused_err = bitwise_equal(recv, serial), relative_error(recv, ref_recv)

    recv.fill_(float("nan"))
    buf.barrier()
    att.remote_store_a2a(out_fa, buf.peer_ptrs, rank, world)
    buf.barrier()
    a2a_equal = bitwise_equal(recv, serial)

    # FA-only through the fused kernel's own code: its epilogue stores every tile, as Fused does,
    # but through a table of P buffers on this GPU (the local control of §3.1).
    local = local_destination(seq_len, heads, head_dim, world)
    local_recv, local_table = local
    local_recv.fill_(float("nan"))
    att.fused_attention_a2a(q, k, v, local_table, rank, world, config=cfg)
    h = heads // world
    same_code_equal = bitwise_equal(local_recv[:, :, rank * h:(rank + 1) * h].reshape(out_fa.shape),
                                    out_fa)

    sdpa = att.sdpa_nccl(q, k, v, group, out=poisoned(recv_shape, att.DTYPE, DEVICE))
    metrics = dict(fa_rel_err=relative_error(out_fa, ref),
                   serial_rel_err=relative_error(serial, ref_recv),
                   fused_rel_err=fused_err, sdpa_nccl_rel_err=relative_error(sdpa, ref_recv),
                   fused_bitwise_serial=fused_equal, a2a_remote_bitwise_nccl=a2a_equal,
                   fa_same_code_bitwise_fa=same_code_equal)
    failures = [f"{name}={value:.3g} (tolerance {REL_TOL})" for name, value in metrics.items()
                if name.endswith("_rel_err") and not value < REL_TOL]
    failures += [f"{name} is False" for name, value in metrics.items() if value is False]
    per_rank = all_gather_objects((metrics, failures), group)
    bad = {r: f for r, (_, f) in enumerate(per_rank) if f}
    if bad:
        raise RuntimeError(f"correctness check failed at M={seq_len}, H={heads}, d={head_dim}, "
                           f"P={world}; nothing was timed. Failures by rank: {bad}")
    return [m for m, _ in per_rank], q, k, v, out_fa, local


def local_destination(seq_len, heads, head_dim, world):
    """P receive buffers [M/P, H, d] on this GPU and the pointer table that names them (keep the
    buffers referenced as long as the table is used)."""
    recv = torch.empty((world, seq_len // world, heads, head_dim), dtype=att.DTYPE, device=DEVICE)
    table = torch.tensor([recv[j].data_ptr() for j in range(world)], dtype=torch.int64,
                         device=DEVICE)
    return recv, table


def tune(args, group) -> tuple[dict, list]:
    """Time each candidate configuration's FA-only at one M and keep the fastest (max over ranks,
    median over trials). Candidates that do not fit the hardware or miss the float32 reference
    on any rank are skipped on every rank."""
    d, world = args.head_dim, dist.get_world_size(group)
    fitting = [m for m in args.seq if m <= TUNE_MAX_SEQ]
    seq_len = max(fitting) if fitting else min(args.seq)
    q, k, v = random_qkv(seq_len, args.heads // world, d, args.seed + 7)
    ref = att.reference_attention(q, k, v)
    out = torch.empty_like(q)
    results = []
    for cfg in att.flash_attention_candidates(d):
        # validate() made every M a multiple of every candidate's tiles
        entry = dict(config=cfg, M=seq_len)
        try:
            out.fill_(float("nan"))
            att.flash_attention(q, k, v, out=out, config=cfg)
            err = relative_error(out, ref)
            reason = None if err < REL_TOL else f"relative error {err:.3g} against float32"
        except triton.runtime.errors.OutOfResources as e:
            reason = f"out of resources: {e}"
        # a candidate any rank cannot run is skipped on every rank, so all stay in step
        reasons = [r for r in all_gather_objects(reason, group) if r]
        if reasons:
            entry["skipped"] = reasons[0]
        else:
            timing = time_methods({"fa": lambda: att.flash_attention(q, k, v, out=out, config=cfg)},
                                  trials=TUNE_TRIALS, warmup=1, graph_iters=args.iters,
                                  group=group, eager=frozenset(args.eager))
            entry["fa_us"] = timing["fa"]["median_us"]
        results.append(entry)
    timed = [e for e in results if "fa_us" in e]
    if not timed:
        raise RuntimeError(f"no FlashAttention configuration fits at d={d}: {results}")
    return min(timed, key=lambda e: e["fa_us"])["config"], results


def run_case(seq_len, args, cfg, buf, group) -> tuple[dict, dict]:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    H, d = args.heads, args.head_dim
    # local = (buffers, table): the lambda below holds the tuple, so the buffers outlive the graph
    checks, q, k, v, out_fa, local = check_case(seq_len, H, d, cfg, buf, group,
                                                seed=args.seed + 1000 * seq_len + rank)
    fns = {
        "fa": lambda: att.flash_attention(q, k, v, out=out_fa, config=cfg),
        "fa_same_code": lambda: att.fused_attention_a2a(q, k, v, local[1], rank, world,
                                                        config=cfg),
        "sdpa": lambda: att.sdpa_cudnn(q, k, v),
        "a2a_nccl": lambda: att.nccl_a2a(out_fa, group),
        "a2a_remote": lambda: att.remote_store_a2a(out_fa, buf.peer_ptrs, rank, world),
        "serial": lambda: att.nccl_a2a(att.flash_attention(q, k, v, config=cfg), group),
        "fused": lambda: att.fused_attention_a2a(q, k, v, buf.peer_ptrs, rank, world, config=cfg),
        "sdpa_nccl": lambda: att.sdpa_nccl(q, k, v, group),
    }
    clocks_before = all_gather_objects(read_sm_clock_mhz(), group)
    # Remote-store methods make their stores visible once per replay, outside the timed window.
    timing = time_methods(fns, trials=args.trials, warmup=1, graph_iters=args.iters, group=group,
                          eager=frozenset(args.eager),
                          after={m: buf.barrier for m in REMOTE_METHODS})
    clocks_after = all_gather_objects(read_sm_clock_mhz(), group)
    torch.cuda.empty_cache()

    row = table3_row(seq_len, H, d, world, {m: timing[m]["median_us"] for m in METHODS},
                     {m: timing[m]["p75_us"] - timing[m]["p25_us"] for m in METHODS})
    raw = dict(M=seq_len, checks_by_rank=checks,
               order=[rotated_order(list(METHODS), t) for t in range(args.trials)],
               max_us={m: timing[m]["trials_us"] for m in METHODS},
               per_rank_us={m: timing[m]["per_rank_us"] for m in METHODS},
               sm_clock_mhz_before=clocks_before, sm_clock_mhz_after=clocks_after)
    return row, raw


def main(argv=None) -> int:
    args = parse_args(argv)
    require_safe_env()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        validate(args, world)
        started = time.time()
        buf = att.symmetric_receive_buffer(max(args.seq) // world * args.heads * args.head_dim, group)
        if args.no_tune:
            cfg, tuning = att.flash_attention_config(args.head_dim), []
        else:
            cfg, tuning = tune(args, group)
        if rank == 0:
            print(f"[attention_bench] P={world} H={args.heads} d={args.head_dim} config={cfg}",
                  file=sys.stderr, flush=True)
        rows, raws = [], []
        for seq_len in args.seq:
            row, raw = run_case(seq_len, args, cfg, buf, group)
            rows.append(row)
            raws.append(raw)
            if rank == 0:
                print(f"[attention_bench] M={seq_len}: " + ", ".join(
                    f"{m}={row[m + '_us']:.1f}us" for m in METHODS)
                    + f", speedup={row['speedup']:.3f}, H={row['hiding_ratio']:.2f}, "
                    f"FA/cuDNN={row['fa_over_cudnn']:.2f}", file=sys.stderr, flush=True)
        if rank == 0:
            write_result(args, world, cfg, tuning, rows, raws, time.time() - started)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def write_result(args, world, cfg, tuning, rows, raws, elapsed_s) -> None:
    meta = dict(
        experiment="fa_a2a",
        created_utc=datetime.now(timezone.utc).isoformat(),
        params=dict(seq=args.seq, heads=args.heads, head_dim=args.head_dim, P=world,
                    trials=args.trials, iters=args.iters, seed=args.seed, rel_tol=REL_TOL,
                    tuned=not args.no_tune, eager_methods=args.eager),
        config=cfg,
        tuning=tuning,
        timing=("sender-visible steady state: per method, `iters` back-to-back calls in one CUDA "
                "graph replayed between CUDA events on every rank after a rank alignment; per "
                "trial the maximum over ranks; rows hold the median over trials and the IQR, in "
                "µs per call. Remote-store methods synchronize once after the replay, outside the "
                "timed window (§5.1); NCCL methods include their own completion."),
        layout="q, k, v [M, H/P, d] on every rank (heads rank*H/P...); receive [M/P, H, d]",
        versions=dict(torch=torch.__version__, triton=triton.__version__,
                      cuda=torch.version.cuda, nccl=".".join(map(str, torch.cuda.nccl.version())),
                      cudnn=torch.backends.cudnn.version()),
        gpu_name=torch.cuda.get_device_name(),
        elapsed_s=elapsed_s,
        provenance=provenance(),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta, rows=rows, raw=raws), indent=1))
    print(f"[attention_bench] wrote {args.out}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
