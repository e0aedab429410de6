"""Table 3's timing at one checked M (step 2 of ``bench``): the timed methods, the kernel
configuration tuned first (``tune``), the settling run before the trials, and the row with its
paired residuals."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import triton

from ...checks import relative_error
from ...dist_timing import all_gather_objects, read_sm_clock_mhz, rotated_order, time_methods
from ...ops import attention as att
from ...analysis.attention.model import paired_difference
from .cases import REL_TOL, Case, attention_flops, random_qkv

# fa, fused, fused_fenced and the same-code controls are neighbours so that each trial's rotation
# runs them back to back (apart from the trials where the rotation splits them): their per-trial
# differences, E_res, are taken within one clock state.
METHODS = ("fa", "fused", "fused_fenced", "fa_same_code_fenced", "fa_same_code", "sdpa",
           "a2a_nccl", "a2a_remote", "serial", "sdpa_nccl")
REMOTE_METHODS = ("a2a_remote", "fused", "fused_fenced")
SETTLE_S = 2.0        # FA-only back to back before each M's trials: DVFS settles under the load
TUNE_TRIALS = 3
TUNE_MAX_SEQ = 16384  # configurations are timed at the largest swept M up to this


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


