"""SPMD benchmark of Ulysses attention with its post-attention All-to-All (paper §5.3, Table 3).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
    torchrun --standalone --nproc_per_node=P -m xstage_lab.experiments.attention.bench \\
        (--out FILE | --root DIR) [--seq 8192,16384,32768,49152,65536] [--heads 24]
        [--head-dim 128] [--trials 20] [--iters 10] [--chunk I/N]
    python -m xstage_lab.experiments.attention.bench --fa-only (--out FILE | --root DIR)
        # one GPU, no torchrun; the record's experiment is fa_tuning

Two ``Experiment``s run by ``experiments.harness``: ``UlyssesAttention`` (``fa_a2a``, one process
per GPU) and ``FaTuning`` (``fa_tuning``, ``--fa-only``); each declares its shapes as a ``Sweep``
over M at the fixed heads H and head dim d (``shape_sweep``).

One process per GPU. Per sequence length M:
1. Correctness first, on fresh random inputs with every output poisoned (NaN) before its run:
   Fused and Fused-fenced (issue 8: each tile's remote stores made visible system-wide before
   the next tile) bitwise equal to Serial (the same kernel, then NCCL ``all_to_all_single``);
   FA-only, Serial, Fused and SDPA+NCCL within bf16 tolerance of a float32 reference; the
   remote-store A2A bitwise equal to the NCCL A2A. Any failure on any rank stops every rank
   before timing, with no output.
2. Timing as §5.1 describes: each method is captured ``iters`` times back to back in one CUDA
   graph; a trial aligns all ranks (``dist_timing.time_methods``), replays the graph between CUDA
   events on every rank, and takes the maximum over ranks; rows report the median over trials
   and the IQR. Method order rotates across trials. Clocks may not be locked, so DVFS is
   measured and paired out instead: ``--settle-s`` seconds of FA-only precede each M's trials,
   each trial records every method's SM clock, and E_res is also reported as the median of
   per-trial differences (Fused and FA-only run back to back in one rotation) and over the
   clock-matched trials alone (``model.paired_difference``).
   The boundary is sender-visible: remote-store methods synchronize remote visibility once after
   the replay, outside the timed window; NCCL methods include their own completion.
Rank 0 writes the output: rows (Table 3 quantities), and a header with the per-trial raw times.

``--fa-only`` (one process, one GPU): the FA-only configurations (``fa_only_candidates``) against
torch SDPA on cuDNN, each checked first (float32 reference; REMOTE epilogue, fenced and not,
bitwise equal to LOCAL), then timed in one rotation with the SM clock per trial.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np
import torch
import torch.distributed as dist
import triton

from ...checks import bitwise_equal, poisoned, relative_error
from ...dist_timing import (all_gather_objects, read_sm_clock_mhz, require_safe_env, rotated_order,
                           time_methods)
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment, Run
from ...ops import attention as att
from ...analysis.attention.model import paired_difference

DEFAULT_SEQ = (8192, 16384, 32768, 49152, 65536)
# fa, fused, fused_fenced and the same-code controls are neighbours so that each trial's rotation
# runs them back to back (apart from the trials where the rotation splits them): their per-trial
# differences, E_res, are taken within one clock state.
METHODS = ("fa", "fused", "fused_fenced", "fa_same_code_fenced", "fa_same_code", "sdpa",
           "a2a_nccl", "a2a_remote", "serial", "sdpa_nccl")
REMOTE_METHODS = ("a2a_remote", "fused", "fused_fenced")
SETTLE_S = 2.0        # FA-only back to back before each M's trials: DVFS settles under the load
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
    The ``_fenced`` quantities are the same for the completion-coupled epilogue (issue 8); its
    same-code control is the fenced kernel storing into local destinations."""
    flops = attention_flops(seq_len, heads, head_dim, world)
    fa, fused, serial = med["fa"], med["fused"], med["serial"]
    fenced = med["fused_fenced"]
    row = dict(M=seq_len, heads=heads, head_dim=head_dim, P=world,
               **{f"{m}_us": med[m] for m in METHODS},
               speedup=serial / fused,
               hiding_ratio=1 - (fused - fa) / (serial - fa),
               e_res_us=fused - fa,
               e_res_same_code_us=fused - med["fa_same_code"],
               speedup_fenced=serial / fenced,
               hiding_ratio_fenced=1 - (fenced - fa) / (serial - fa),
               e_res_fenced_us=fenced - fa,
               e_res_fenced_same_code_us=fenced - med["fa_same_code_fenced"],
               fa_tflops=flops / fa / 1e6,
               cudnn_tflops=flops / med["sdpa"] / 1e6,
               speedup_over_sdpa_nccl=med["sdpa_nccl"] / fused,
               **{f"{m}_iqr_us": iqr[m] for m in METHODS})
    row["fa_over_cudnn"] = row["fa_tflops"] / row["cudnn_tflops"]
    return row


# ``--fa-only``: the kernel configurations timed against cuDNN on one GPU (no NCCL, no peers),
# besides the table's CANDIDATES. ctas_per_sm is the occupancy of the sm_90 build (Triton 3.6,
# ptxas; checked by the tests). The 4-warp d=128 tiles fit two CTAs per SM (128 x 64 at s2: 255
# registers, 96 KiB of shared memory, one program per tile: its persistent build spills; 128 x 32
# at s4: 212-249 registers, 96 KiB), so each SM holds two independent warpgroups whose softmax and
# MMAs can interleave; one 8-warp CTA synchronizes its two warpgroups with three CTA barriers per
# KV tile. The pipelined Q-loop (softmax under the PV wgmma) keeps one more score tile live, so
# its candidates give each warpgroup 64 rows (128 x 64 at 8 warps: 157 registers; 64 x 32 at 4
# warps: 119 registers, three CTAs per SM); at 128 rows per warpgroup it spills.
def _candidate(bm, bn, warps, stages, persistent, ctas_per_sm, **keys) -> dict:
    return dict(kernel="triton", BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
                persistent=persistent, ctas_per_sm=ctas_per_sm, **keys)


# gluon_ws at b_n = 64 beside its b_n = 128 candidates (``attention.WS_CANDIDATES``).
GLUON_WS_BN64 = dict(kernel="gluon_ws", BLOCK_N=64, num_stages=3)
FA_ONLY_CANDIDATES = {
    128: [_candidate(128, 128, 8, 3, True, 1), _candidate(128, 128, 8, 3, False, 1),
          _candidate(256, 64, 8, 3, False, 1), _candidate(256, 64, 8, 4, False, 1),
          _candidate(128, 64, 8, 3, True, 1), _candidate(128, 64, 8, 4, True, 1),
          _candidate(128, 64, 4, 2, False, 2), _candidate(128, 32, 4, 4, True, 2),
          _candidate(128, 32, 4, 4, False, 2), _candidate(128, 32, 4, 3, True, 2),
          _candidate(128, 64, 4, 2, False, 2, output_cache=".cs"),
          _candidate(256, 64, 8, 4, False, 1, output_cache=".cs"),
          _candidate(128, 64, 8, 2, False, 1, pipelined=True),
          _candidate(128, 64, 8, 3, False, 1, pipelined=True),
          _candidate(128, 128, 8, 2, False, 1, pipelined=True),
          _candidate(64, 64, 4, 2, False, 2, pipelined=True),
          _candidate(64, 32, 4, 3, False, 3, pipelined=True), GLUON_WS_BN64],
    64: [_candidate(128, 128, 8, 3, True, 1), _candidate(128, 128, 8, 4, True, 1),
         GLUON_WS_BN64],
}
FA_ONLY_SEQ = (16384, 32768, 65536)
FA_ONLY_HEADS = 12  # H/P local heads of the Table 3 case, H = 24 on P = 2


def fa_only_candidates(head_dim: int) -> list[dict]:
    """The configurations ``--fa-only`` times: ``FA_ONLY_CANDIDATES`` plus the table's
    ``CANDIDATES``, each once."""
    out = []
    for cfg in FA_ONLY_CANDIDATES[head_dim] + att.flash_attention_candidates(head_dim):
        cfg = att.flash_attention_config(head_dim, cfg)
        if cfg not in out:
            out.append(cfg)
    return out


def config_name(cfg: dict) -> str:
    """A short method name for a configuration, e.g. ``128x64_w8_s3_persistent1``, with ``_cs``
    for streaming output stores and ``_pipe`` for the pipelined Q-loop; ``gluon_ws_128x128_s2``
    for the warp-specialized kernel with 128-row K/V tiles in two-stage rings."""
    if cfg.get("kernel") == "gluon_ws":
        return f"gluon_ws_{cfg['BLOCK_M']}x{cfg['BLOCK_N']}_s{cfg['num_stages']}"
    return (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}_w{cfg['num_warps']}_s{cfg['num_stages']}_"
            + (f"persistent{cfg['ctas_per_sm']}" if cfg["persistent"] else "grid")
            + ("_cs" if cfg.get("output_cache") == ".cs" else "")
            + ("_pipe" if cfg.get("pipelined") else ""))


def fa_only_ratios(timing: dict, flops: int, baseline: str = "cudnn") -> dict:
    """Per method of one ``time_methods`` result: TF/s at its median, the ratio of its TF/s to
    the baseline's (median over median), and the median over trials of the per-trial ratio
    (baseline time / method time within one rotation: both ran in the same clock state)."""
    base = np.asarray(timing[baseline]["trials_us"])
    out = {}
    for name, t in timing.items():
        trials = np.asarray(t["trials_us"])
        out[name] = dict(median_us=t["median_us"], p25_us=t["p25_us"], p75_us=t["p75_us"],
                         tflops=flops / t["median_us"] / 1e6,
                         over_cudnn=timing[baseline]["median_us"] / t["median_us"],
                         over_cudnn_paired=float(np.median(base / trials)),
                         sm_clock_mhz=t.get("sm_clock_mhz"))
    return out


def remote_epilogue_checks(q, k, v, out_fa, cfg, world: int = 2) -> dict:
    """The REMOTE epilogue of ``cfg``, unfenced and fenced, into P = ``world`` receive buffers on
    this GPU (rank 0's tiles; the addressing of a P-rank run): each bitwise equal to the LOCAL
    output ``out_fa`` where it lands, so Fused and Serial share this configuration's code."""
    M, h, d = q.shape
    out = {}
    for fenced in (False, True):
        print(f"[attention.bench --fa-only] remote epilogue, fenced={fenced}", file=sys.stderr,
              flush=True)
        recv, table = local_destination(M, h * world, d, world)
        recv.fill_(float("nan"))
        att.fused_attention_a2a(q, k, v, table, 0, world, config=cfg, fenced=fenced)
        # buffer j holds rows [j*M/P, (j+1)*M/P); rank 0's heads are its first h
        got = recv[:, :, :h].reshape(M, h, d)
        out[f"remote{'_fenced' if fenced else ''}_bitwise_fa"] = bitwise_equal(got, out_fa)
    return out


def add_shape_arguments(p: argparse.ArgumentParser, seq=DEFAULT_SEQ, heads: int = 24,
                        heads_help: str = "total heads H (divisible by P)") -> None:
    """The attention shape's options (the sweep's M, heads and head dim)."""
    p.add_argument("--seq", default=",".join(map(str, seq)),
                   help="comma-separated sequence lengths M")
    p.add_argument("--heads", type=int, default=heads, help=heads_help)
    p.add_argument("--head-dim", type=int, default=128, choices=att.HEAD_DIMS)


def check_shape_args(a: argparse.Namespace) -> None:
    """``--seq`` as a list of positive lengths, each a multiple of every candidate
    configuration's tiles, and ``--heads`` >= 1; ``ValueError`` names the first mistake. Whether
    P divides them is the ranks' ``validate``."""
    try:
        a.seq = [int(s) for s in a.seq.split(",") if s]
    except ValueError:
        raise ValueError(f"--seq must list integers, got {a.seq!r}") from None
    if not a.seq or min(a.seq) <= 0:
        raise ValueError(f"--seq must list positive lengths, got {a.seq}")
    if a.heads < 1:
        raise ValueError(f"--heads must be >= 1, got {a.heads}")
    # Tiles are powers of two: a multiple of the largest suits every candidate configuration.
    tile = max(max(c["BLOCK_M"], c["BLOCK_N"]) for c in att.flash_attention_candidates(a.head_dim))
    for m in a.seq:
        if m % tile:
            raise ValueError(f"sequence length M={m} must be a multiple of the {tile}-row tiles")


def add_timing_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--iters", type=int, default=10, help="back-to-back calls per CUDA graph")
    p.add_argument("--seed", type=int, default=0)


def check_timing_args(a: argparse.Namespace) -> None:
    if a.trials < 1 or a.iters < 1:
        raise ValueError("--trials and --iters must be >= 1")


def shape_sweep(args, name: str) -> Sweep:
    """The attention shapes as a declared sweep: sequence length M over ``--seq``, at the fixed
    heads H and head dim d (one configuration, tuned for them, serves every point); one pass
    (each point's repeats are its timing trials)."""
    return Sweep(name, (Axis("M", args.seq),), fixed=dict(heads=args.heads, head_dim=args.head_dim),
                 repeats=1, warmup=0)


def random_qkv(seq_len: int, h_local: int, head_dim: int, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(seq_len, h_local, head_dim, generator=g, device=DEVICE,
                        dtype=torch.float32).to(att.DTYPE) for _ in range(3)]


@dataclass
class Case:
    """One attention shape on this rank: its fresh q, k, v [M, H/P, d]; after ``check_case``,
    FA-only's output, the local destination buffers and their table of the same-code FA-only
    control, and every rank's check metrics."""

    point: dict
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out_fa: torch.Tensor | None = None
    local: tuple = ()
    checks: list = field(default_factory=list)


def check_case(case: Case, cfg, buf, group) -> tuple[dict, list[str]]:
    """Correctness of every path at one M (step 1), every output poisoned first; sets
    ``case.out_fa`` and ``case.local``. Returns this rank's metrics and failures (the caller
    stops every rank on any rank's)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = case.q, case.k, case.v
    seq_len, heads, head_dim = case.point["M"], case.point["heads"], case.point["head_dim"]
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
    att.fused_attention_a2a(q, k, v, buf.peer_ptrs, rank, world, config=cfg, fenced=True)
    buf.barrier()
    fenced_equal = bitwise_equal(recv, serial)

    recv.fill_(float("nan"))
    buf.barrier()
    att.remote_store_a2a(out_fa, buf.peer_ptrs, rank, world)
    buf.barrier()
    a2a_equal = bitwise_equal(recv, serial)

    # FA-only through the fused kernel's own code, unfenced and fenced: its epilogue stores every
    # tile, as Fused does, but through a table of P buffers on this GPU (the local control of
    # §3.1); the fenced one separates the fence's effect on the compiled Q-loop from its effect on
    # the remote stores.
    local = local_destination(seq_len, heads, head_dim, world)
    local_recv, local_table = local
    h = heads // world
    same_code_equal = {}
    for fenced in (False, True):
        local_recv.fill_(float("nan"))
        att.fused_attention_a2a(q, k, v, local_table, rank, world, config=cfg, fenced=fenced)
        same_code_equal[fenced] = bitwise_equal(
            local_recv[:, :, rank * h:(rank + 1) * h].reshape(out_fa.shape), out_fa)

    sdpa = att.sdpa_nccl(q, k, v, group, out=poisoned(recv_shape, att.DTYPE, DEVICE))
    metrics = dict(fa_rel_err=relative_error(out_fa, ref),
                   serial_rel_err=relative_error(serial, ref_recv),
                   fused_rel_err=fused_err, sdpa_nccl_rel_err=relative_error(sdpa, ref_recv),
                   fused_bitwise_serial=fused_equal, fused_fenced_bitwise_serial=fenced_equal,
                   a2a_remote_bitwise_nccl=a2a_equal,
                   fa_same_code_bitwise_fa=same_code_equal[False],
                   fa_same_code_fenced_bitwise_fa=same_code_equal[True])
    failures = [f"{name}={value:.3g} (tolerance {REL_TOL})" for name, value in metrics.items()
                if name.endswith("_rel_err") and not value < REL_TOL]
    failures += [f"{name} is False" for name, value in metrics.items() if value is False]
    case.out_fa, case.local = out_fa, local
    return metrics, failures


def local_destination(seq_len, heads, head_dim, world):
    """P receive buffers [M/P, H, d] on this GPU and the pointer table that names them (keep the
    buffers referenced as long as the table is used)."""
    recv = torch.empty((world, seq_len // world, heads, head_dim), dtype=att.DTYPE, device=DEVICE)
    table = torch.tensor([recv[j].data_ptr() for j in range(world)], dtype=torch.int64,
                         device=DEVICE)
    return recv, table


def tune(args, group) -> tuple[dict, list]:
    """Time each candidate configuration (``ulysses.flash_attention_candidates``, both
    kernels) FA-only at one M and keep the fastest (max over ranks, median over trials).
    Candidates whose kernel does not run on this GPU (``ulysses.kernel_unsupported``), that do
    not fit the hardware or that miss the float32 reference on any rank are skipped on every
    rank."""
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
        reason = att.kernel_unsupported(cfg["kernel"], q.device)
        try:
            if reason is None:
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


def settle(fn, seconds: float) -> None:
    """Run ``fn`` back to back for ``seconds`` (at least once) so the SM clock reaches the state
    this load holds it in before any trial is timed (DVFS; clocks may not be locked)."""
    end = time.perf_counter() + seconds
    while True:
        fn()
        torch.cuda.synchronize()
        if time.perf_counter() >= end:
            return


def paired_row(trials_us: dict, clocks_mhz: dict) -> dict:
    """The Table 3 residuals from paired trials (``model.paired_difference``): E_res of
    the decoupled (fused) and completion-coupled (fused_fenced) epilogues against FA-only and
    the same-code FA-only, each the median of per-trial differences, with the clock-matched
    median and the SM clock spread over all trials."""
    out = {}
    for method, base in (("fused", "fa"), ("fused", "fa_same_code"), ("fused_fenced", "fa"),
                         ("fused_fenced", "fa_same_code"), ("fused_fenced", "fa_same_code_fenced")):
        tag = f"{'e_res_fenced' if method == 'fused_fenced' else 'e_res'}_paired_{base}"
        r = paired_difference(trials_us[method], trials_us[base], clocks_mhz[method],
                              clocks_mhz[base])
        out |= {f"{tag}_us": r["median_us"], f"{tag}_p25_us": r["p25_us"],
                f"{tag}_p75_us": r["p75_us"], f"{tag}_matched_us": r["matched_median_us"],
                f"{tag}_matched_trials": r["matched_trials"]}
    known = [c for m in clocks_mhz for c in clocks_mhz[m] if c is not None]
    out["sm_clock_min_mhz"] = min(known) if known else None
    out["sm_clock_max_mhz"] = max(known) if known else None
    return out


def run_case(case: Case, args, cfg, buf, group) -> tuple[dict, dict]:
    """Step 2 at one checked M: the Table 3 row and the raw trials."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    seq_len, H, d = case.point["M"], case.point["heads"], case.point["head_dim"]
    # local = (buffers, table): the lambda below holds the tuple, so the buffers outlive the graph
    q, k, v, out_fa, local = case.q, case.k, case.v, case.out_fa, case.local
    fns = {
        "fa": lambda: att.flash_attention(q, k, v, out=out_fa, config=cfg),
        "fa_same_code": lambda: att.fused_attention_a2a(q, k, v, local[1], rank, world,
                                                        config=cfg),
        "fa_same_code_fenced": lambda: att.fused_attention_a2a(q, k, v, local[1], rank, world,
                                                               config=cfg, fenced=True),
        "sdpa": lambda: att.sdpa_cudnn(q, k, v),
        "a2a_nccl": lambda: att.nccl_a2a(out_fa, group),
        "a2a_remote": lambda: att.remote_store_a2a(out_fa, buf.peer_ptrs, rank, world),
        "serial": lambda: att.nccl_a2a(att.flash_attention(q, k, v, config=cfg), group),
        "fused": lambda: att.fused_attention_a2a(q, k, v, buf.peer_ptrs, rank, world, config=cfg),
        "fused_fenced": lambda: att.fused_attention_a2a(q, k, v, buf.peer_ptrs, rank, world,
                                                        config=cfg, fenced=True),
        "sdpa_nccl": lambda: att.sdpa_nccl(q, k, v, group),
    }
    settle(fns["fa"], args.settle_s)
    clocks_before = all_gather_objects(read_sm_clock_mhz(), group)
    # Remote-store methods make their stores visible once per replay, outside the timed window.
    timing = time_methods(fns, trials=args.trials, warmup=1, graph_iters=args.iters, group=group,
                          eager=frozenset(args.eager),
                          after={m: buf.barrier for m in REMOTE_METHODS}, clocks=True)
    clocks_after = all_gather_objects(read_sm_clock_mhz(), group)
    torch.cuda.empty_cache()

    row = table3_row(seq_len, H, d, world, {m: timing[m]["median_us"] for m in METHODS},
                     {m: timing[m]["p75_us"] - timing[m]["p25_us"] for m in METHODS})
    row |= paired_row({m: timing[m]["trials_us"] for m in METHODS},
                      {m: timing[m]["sm_clock_mhz"] for m in METHODS})
    raw = dict(M=seq_len, checks_by_rank=case.checks,
               order=[rotated_order(list(METHODS), t) for t in range(args.trials)],
               max_us={m: timing[m]["trials_us"] for m in METHODS},
               per_rank_us={m: timing[m]["per_rank_us"] for m in METHODS},
               sm_clock_mhz={m: timing[m]["sm_clock_mhz"] for m in METHODS},
               sm_clock_mhz_before=clocks_before, sm_clock_mhz_after=clocks_after)
    return row, raw



TIMING = ("sender-visible steady state: per method, `iters` back-to-back calls in one CUDA graph "
          "replayed between CUDA events on every rank after a rank alignment; per trial the "
          "maximum over ranks; rows hold the median over trials and the IQR, in µs per call. "
          "Remote-store methods synchronize once after the replay, outside the timed window "
          "(§5.1); NCCL methods include their own completion. Clocks are not locked: before each "
          "M, `settle_s` seconds of FA-only; every trial records the SM clock of every method "
          "(lowest over ranks); E_res is also the median of per-trial differences (paired, same "
          "rotation) and of the clock-matched trials only.")
LAYOUT = "q, k, v [M, H/P, d] on every rank (heads rank*H/P...); receive [M/P, H, d]"


class UlyssesAttention(Experiment):
    """Table 3: FA-only, Fused (decoupled and fenced), Serial and their controls per M."""

    name = "fa_a2a"
    in_measure_all = True
    paper = "§5.3, Table 3; timing §5.1"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_shape_arguments(p)
        add_timing_arguments(p)
        p.add_argument("--settle-s", type=float, default=SETTLE_S,
                       help="seconds of FA-only back to back before each M's trials (DVFS settles)")
        p.add_argument("--no-tune", action="store_true",
                       help="use the configuration table as is instead of timing its candidates")
        p.add_argument("--eager", default="",
                       help="comma-separated methods launched back to back without a CUDA graph "
                            "(for a method that cannot be captured); recorded in the metadata")

    def check_args(self, a: argparse.Namespace) -> None:
        check_shape_args(a)
        check_timing_args(a)
        a.eager = [s for s in a.eager.split(",") if s]
        unknown = set(a.eager) - set(METHODS)
        if unknown:
            raise ValueError(f"--eager names unknown methods {sorted(unknown)}; methods: {METHODS}")
        a.tune = not a.no_tune

    def sweeps(self, args) -> list[Sweep]:
        return [shape_sweep(args, self.name)]

    def start(self, run: Run) -> None:
        a = run.args
        self.group = dist.group.WORLD
        self.buf = att.symmetric_receive_buffer(max(a.seq) // run.world * a.heads * a.head_dim,
                                                self.group)
        self.cfg, self.tuning, self.raw = None, [], []

    def validate(self, point: dict, run: Run) -> None:
        att.check_ulysses_shape(point["M"], point["heads"], run.world)

    def prepare(self, point: dict, run: Run) -> Case:
        """The run's configuration (tuned at the first point: tuning launches kernels, so every
        point is validated first) and the point's fresh q, k, v."""
        self.cfg, self.tuning = run.resource("config", lambda: self.configure(run))
        M, H, d = point["M"], point["heads"], point["head_dim"]
        q, k, v = random_qkv(M, H // run.world, d, run.args.seed + 1000 * M + run.rank)
        return Case(point, q, k, v)

    def configure(self, run: Run) -> tuple[dict, list]:
        """The kernel configuration: the fastest candidate (``tune``) or the table's."""
        a = run.args
        cfg, tuning = (tune(a, self.group) if a.tune
                       else (att.flash_attention_config(a.head_dim, device=DEVICE), []))
        if run.rank == 0:
            print(f"[{type(self).__module__.removeprefix('xstage_lab.experiments.')}] "
                  f"P={run.world} H={a.heads} d={a.head_dim} config={cfg}", file=sys.stderr,
                  flush=True)
        return cfg, tuning

    def check(self, case: Case, run: Run) -> list[str]:
        metrics, failures = check_case(case, self.cfg, self.buf, self.group)
        case.checks = run.gather(metrics)
        return failures

    def measure(self, case: Case, run: Run) -> dict:
        row, raw = run_case(case, run.args, self.cfg, self.buf, self.group)
        self.raw.append(raw)
        return row

    def progress_line(self, rows) -> str:
        row = rows.iloc[0]
        return (f"[attention.bench] M={row['M']}: "
                + ", ".join(f"{m}={row[m + '_us']:.1f}us" for m in METHODS)
                + f", speedup={row['speedup']:.3f}, H={row['hiding_ratio']:.2f}, "
                f"FA/cuDNN={row['fa_over_cudnn']:.2f}")

    def metadata(self, run: Run) -> dict:
        a = run.args
        return dict(
            params=dict(seq=a.seq, heads=a.heads, head_dim=a.head_dim, P=run.world,
                        trials=a.trials, iters=a.iters, seed=a.seed, rel_tol=REL_TOL,
                        tuned=a.tune, eager_methods=a.eager, settle_s=a.settle_s),
            config=self.cfg, tuning=self.tuning, timing=TIMING, layout=LAYOUT,
            versions=dict(torch=torch.__version__, triton=triton.__version__,
                          cuda=torch.version.cuda,
                          nccl=".".join(map(str, torch.cuda.nccl.version())),
                          cudnn=torch.backends.cudnn.version()),
            raw=self.raw)


@dataclass
class FaOnlyCase:
    """One M of ``--fa-only``: fresh q, k, v and their float32 reference; after ``check``, the
    methods it times, the output each candidate writes (``outputs``) and ``epilogue`` (the P = 2
    receive buffers on this GPU that ``+remote`` methods store into, kept as long as their table
    is used)."""

    point: dict
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ref: torch.Tensor | None
    methods: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    epilogue: tuple = ()


class FaTuning(Experiment):
    """``--fa-only`` (one process, one GPU): FA-only (LOCAL epilogue) of every
    ``fa_only_candidates`` configuration against torch SDPA on cuDNN, H = ``--heads`` local heads.

    Per M: fresh random q, k, v; each candidate's output (poisoned with NaN first) and cuDNN's
    within ``REL_TOL`` of the float32 reference, else the candidate is skipped with the reason
    (cuDNN failing aborts), as is one whose kernel does not run on this GPU
    (``ulysses.kernel_unsupported``). Then one ``time_methods`` over the candidates and cuDNN:
    CUDA graphs of ``iters`` calls, rotated order, ``trials`` trials, the SM clock read per trial.
    Rows: one per M and method."""

    name = "fa_tuning"
    paper = "issue 3: FA-only configurations against cuDNN on one GPU; timing §5.1"
    launch = "in_process"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--fa-only", action="store_true",
                       help="this mode: one process, no torchrun: time the FA-only "
                            "configurations against cuDNN")
        add_shape_arguments(p, FA_ONLY_SEQ, FA_ONLY_HEADS, "heads on the GPU")
        p.add_argument("--configs", default="",
                       help="comma-separated configuration names (``config_name``) to time "
                            "instead of all")
        p.add_argument("--epilogues", action="store_true",
                       help="also time each configuration's REMOTE epilogue, fenced and not, into "
                            "P = 2 receive buffers on the same GPU (``+remote``, "
                            "``+remote_fenced``)")
        add_timing_arguments(p)

    def check_args(self, a: argparse.Namespace) -> None:
        check_shape_args(a)
        check_timing_args(a)
        known = {config_name(c): c for c in fa_only_candidates(a.head_dim)}
        a.configs = [s for s in a.configs.split(",") if s]
        unknown = set(a.configs) - set(known)
        if unknown:
            raise ValueError(f"--configs names unknown configurations {sorted(unknown)}; "
                             f"known at d={a.head_dim}: {sorted(known)}")
        a.candidates = {name: known[name] for name in a.configs} if a.configs else known

    def sweeps(self, args) -> list[Sweep]:
        return [shape_sweep(args, self.name)]

    def start(self, run: Run) -> None:
        require_safe_env()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        self.candidates = run.args.candidates
        self.checks, self.skipped, self.raw = [], {}, []

    def prepare(self, point: dict, run: Run) -> FaOnlyCase:
        M, H, d = point["M"], point["heads"], point["head_dim"]
        q, k, v = random_qkv(M, H, d, run.args.seed + M)
        return FaOnlyCase(point, q, k, v, att.reference_attention(q, k, v))

    def check(self, case: FaOnlyCase, run: Run) -> list[str]:
        """Each candidate into a poisoned output against the float32 reference (at the first M,
        its REMOTE epilogue against LOCAL too): a failing one is skipped; cuDNN failing fails."""
        args, skipped, checks = run.args, self.skipped, self.checks
        q, k, v, ref = case.q, case.k, case.v, case.ref
        seq_len, H, d = case.point["M"], case.point["heads"], case.point["head_dim"]
        if args.epilogues:
            case.epilogue = local_destination(seq_len, 2 * H, d, 2)
            table = case.epilogue[1]
        methods = case.methods
        for name, cfg in self.candidates.items():
            if name in skipped:
                continue
            if seq_len % max(cfg["BLOCK_M"], cfg["BLOCK_N"]):
                continue
            unsupported = att.kernel_unsupported(cfg["kernel"], q.device)
            if unsupported:
                skipped[name] = unsupported
                continue
            out = poisoned(q.shape, att.DTYPE, DEVICE)
            # progress first: a launch that never returns leaves its name as the last line
            print(f"[attention.bench --fa-only] M={seq_len}: checking {name}", file=sys.stderr,
                  flush=True)
            try:
                att.flash_attention(q, k, v, out=out, config=cfg)
                err = relative_error(out, ref)
            except triton.runtime.errors.OutOfResources as e:
                skipped[name] = f"out of resources: {e}"
                continue
            check = dict(M=seq_len, method=name, rel_err=err)
            if seq_len == args.seq[0]:
                check |= remote_epilogue_checks(q, k, v, out, cfg)
            checks.append(check)
            failed = [key for key, ok in check.items() if ok is False]
            if not err < REL_TOL or failed:
                skipped[name] = (f"M={seq_len}: relative error {err:.3g} against float32, "
                                 f"failed {failed}")
                continue
            methods[name] = (lambda out=out, cfg=cfg: att.flash_attention(q, k, v, out=out,
                                                                          config=cfg))
            case.outputs[name] = out
            if args.epilogues:
                # the Fused kernel's code (REMOTE epilogue, fenced or not) storing into P = 2
                # receive buffers on this GPU: its time against LOCAL's is the codegen's share
                # of any Fused-versus-FA difference, with no peer traffic
                for fenced in (False, True):
                    methods[f"{name}+remote{'_fenced' if fenced else ''}"] = (
                        lambda cfg=cfg, fenced=fenced: att.fused_attention_a2a(
                            q, k, v, table, 0, 2, config=cfg, fenced=fenced))
        err = relative_error(att.sdpa_cudnn(q, k, v), ref)
        checks.append(dict(M=seq_len, method="cudnn", rel_err=err))
        case.ref = None  # the float32 reference is not kept through the timing
        if not err < REL_TOL:
            return [f"cuDNN SDPA misses the float32 reference at M={seq_len}: relative error "
                    f"{err:.3g}"]
        methods["cudnn"] = lambda: att.sdpa_cudnn(q, k, v)
        return []

    def recheck(self, case: FaOnlyCase, run: Run) -> list[str]:
        """After the timing: each timed candidate once more into its output, poisoned first, and
        cuDNN, against the float32 reference (made again: ``check`` does not keep it)."""
        ref = att.reference_attention(case.q, case.k, case.v)
        failures = []
        for name, out in case.outputs.items():
            out.fill_(float("nan"))
            case.methods[name]()
            err = relative_error(out, ref)
            if not err < REL_TOL:
                failures.append(f"{name}: relative error {err:.3g} against float32 after timing")
        err = relative_error(att.sdpa_cudnn(case.q, case.k, case.v), ref)
        if not err < REL_TOL:
            failures.append(f"cuDNN SDPA: relative error {err:.3g} against float32 after timing")
        return failures

    def measure(self, case: FaOnlyCase, run: Run) -> list[dict]:
        args, methods = run.args, case.methods
        seq_len, H, d = case.point["M"], case.point["heads"], case.point["head_dim"]
        timing = time_methods(methods, trials=args.trials, warmup=1, graph_iters=args.iters,
                              clocks=True)
        flops = attention_flops(seq_len, H, d, 1)
        rows = [dict(M=seq_len, method=name, **r)
                for name, r in fa_only_ratios(timing, flops).items()]
        self.raw.append(dict(M=seq_len, order=[rotated_order(list(methods), t)
                                               for t in range(args.trials)],
                             trials_us={m: timing[m]["trials_us"] for m in methods},
                             sm_clock_mhz={m: timing[m]["sm_clock_mhz"] for m in methods}))
        torch.cuda.empty_cache()
        return rows

    def progress_line(self, rows) -> str:
        ours = rows[rows["method"].isin(list(self.candidates))]
        best = ours.loc[ours["tflops"].idxmax()]
        return (f"[attention.bench --fa-only] M={best['M']}: best {best['method']} "
                f"{best['tflops']:.0f} TF/s = {best['over_cudnn']:.3f} of cuDNN "
                f"(paired {best['over_cudnn_paired']:.3f})")

    def metadata(self, run: Run) -> dict:
        a = run.args
        return dict(created_utc=datetime.now(timezone.utc).isoformat(),  # tuning_records' order
                    params=dict(seq=a.seq, heads=a.heads, head_dim=a.head_dim, trials=a.trials,
                                iters=a.iters, seed=a.seed, rel_tol=REL_TOL,
                                epilogues=a.epilogues),
                    candidates=a.candidates, skipped=self.skipped, checks=self.checks,
                    raw=self.raw,
                    versions=dict(torch=torch.__version__, triton=triton.__version__,
                                  cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version()))


EXPERIMENT = UlyssesAttention()
FA_TUNING = FaTuning()


def experiment(argv: list[str]) -> Experiment:
    """What a command line runs: ``--fa-only`` the one-GPU ``FA_TUNING``, else Table 3."""
    return FA_TUNING if "--fa-only" in argv else EXPERIMENT


if __name__ == "__main__":
    harness.main(experiment(sys.argv[1:]))
