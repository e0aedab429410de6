"""SPMD benchmark of the fused MoE kernel's two schedules and the unfused path (paper §5.2.1).

    torchrun --nproc_per_node=4 -m xstage_lab.experiments.moe.bench --out FILE \\
        [--models M1,M2] [--precisions bf16,fp8] [--routing balanced,skewed] [--tokens N1,N2]
        [--matrix data/moe_matrix.json]

For every (model shape, precision, routing), on fresh seeded inputs:

1. Correctness first. Each schedule runs once into a Combine buffer poisoned with NaN; both must
   leave the spin-error flag at zero and produce bitwise-identical Combine buffers on every rank;
   the combined output must match the float32 reference (``reference_moe``) within ``TOLERANCE``
   (relative Frobenius error), and so must the unfused path. Any failure on any rank aborts the
   run before timing, with a non-zero exit and no output file.
2. Timing (``xstage_lab.dist_timing``, §5.1): Expert-Wave, Interleaved and unfused, barrier-aligned
   trials, the maximum over ranks per trial, median and p25/p75 over trials, order rotated.

What a timed call covers, for all three methods alike: expert compute, Combine into the source
ranks' buffers and the top-k weighted sum. Dispatch (NCCL all-to-all) runs once before, outside the
timing. A fused call is: symmetric barrier (the previous call's readers are done), zero the row
counters, the kernel, symmetric barrier (every peer's stores are visible), weighted sum. The
unfused path is torch's grouped GEMMs (``layer.grouped_expert_ffn``); in FP8 it takes rows quantized
by its own recipe (``layer.UNFUSED_FP8_RECIPE``), so it has its own Dispatch of those rows.

Rank 0 writes one JSON: ``{"metadata": {...}, "rows": [{model, precision, routing, tokens, wave_us,
interleaved_us, unfused_us, speedup (= wave / interleaved), spreads, ...}]}``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ...checks import relative_error
from ...dist_timing import (TIMING_METHOD, all_gather_objects, read_sm_clock_mhz, start_rank,
                           time_methods)
from ...sweep import Axis, Sweep
from ..output import write_output
from . import layer as moe
from .schedules import MoEProblem, d_knee, expert_wave_schedule, \
    interleaved_schedule

DEFAULT_TOKENS = 4096  # per rank
# Relative Frobenius error bounds against reference_moe. bf16: inputs are exact bf16, h and the
# Combine rows are rounded to bf16 once each (unit roundoff 2**-9, ~2e-3 per rounding), so a correct
# kernel lands near 3e-3-6e-3; 1e-2 leaves margin. fp8 vs the unquantized float32 layer: e4m3 keeps
# 3 mantissa bits; x, both weights and h are each quantized once, which on Gaussian data gives
# 6.4% for every model shape (measured with the emulated reference); 0.1 is ~1.6x that, so a wrong
# scale or a dropped block (errors >= 1) cannot pass. fp8 vs the reference that emulates the same
# quantization: only accumulation order, bf16 output rounding and rare e4m3 rounding flips of h
# remain, ~4e-3; 2e-2 bounds it.
TOLERANCE = {"bf16": {"fp32": 1e-2}, "fp8": {"fp32": 0.1, "fp8_emulated": 2e-2}}


def matrix_sweep(args) -> Sweep:
    """The configuration matrix as a declared sweep: model shape × precision × routing × tokens
    per rank, one pass (each cell's repeats are its timing trials)."""
    return Sweep("moe", (Axis("model", args.models), Axis("precision", args.precisions),
                         Axis("routing", args.routing), Axis("tokens", args.tokens)),
                 repeats=1, warmup=0)


def matrix_cells(args) -> list[tuple[str, str, str, int]]:
    """(model, precision, routing, tokens) of every cell of ``matrix_sweep``, in run order; with
    ``--chunk I/N`` only the I-th of N contiguous, near-equal pieces."""
    cells = [(p["model"], p["precision"], p["routing"], p["tokens"])
             for p in matrix_sweep(args).points()]
    if args.chunk is None:
        return cells
    i, n = args.chunk
    return cells[i * len(cells) // n:(i + 1) * len(cells) // n]


def parse_args(argv=None) -> argparse.Namespace:
    shapes = moe.load_shapes()
    p = argparse.ArgumentParser(prog="python -m xstage_lab.experiments.moe.bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="JSON written by rank 0")
    p.add_argument("--models", default=",".join(shapes), help=f"comma list of {list(shapes)}")
    p.add_argument("--precisions", default=",".join(moe.PRECISIONS))
    p.add_argument("--routing", default=",".join(moe.ROUTINGS))
    p.add_argument("--tokens", default=str(DEFAULT_TOKENS), help="comma list of tokens per rank")
    p.add_argument("--matrix", type=Path, default=None,
                   help="a JSON declaring models, precisions, routing and tokens_per_rank "
                        "(e.g. data/moe_matrix.json); it replaces those four options")
    p.add_argument("--chunk", default=None, metavar="I/N",
                   help="run only the I-th of N contiguous chunks of the cells (0-based), so a "
                        "long matrix can run as resumable pieces, each its own record")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--graph-iters", type=int, default=None,
                   help="time CUDA-graph replays of this many back-to-back calls")
    p.add_argument("--programs", type=int, default=None, help="persistent programs (default: SMs)")
    p.add_argument("--lead", type=int, default=None, help="lead D in rows (default: D_knee, eq. 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-spin", type=int, default=moe.DEFAULT_MAX_SPIN_ITERS)
    p.add_argument("--kernel", default=None, choices=moe.KERNELS,
                   help="fused kernel (default: gluon_ws on sm_90 GPUs, triton elsewhere)")
    a = p.parse_args(argv)
    if a.matrix is not None:
        matrix = json.loads(a.matrix.read_text())
        models = matrix["models"]
        a.models = ",".join(shapes) if models == "all" else ",".join(models)
        a.precisions, a.routing = ",".join(matrix["precisions"]), ",".join(matrix["routing"])
        a.tokens = ",".join(str(t) for t in matrix["tokens_per_rank"])
    a.models = [m for m in a.models.split(",") if m]
    a.precisions = [x for x in a.precisions.split(",") if x]
    a.routing = [x for x in a.routing.split(",") if x]
    try:
        a.tokens = [int(t) for t in a.tokens.split(",") if t]
    except ValueError:
        p.error(f"--tokens must list integers, got {a.tokens!r}")
    for name, given, allowed in (("model", a.models, shapes), ("precision", a.precisions, moe.PRECISIONS),
                                 ("routing", a.routing, moe.ROUTINGS)):
        bad = [g for g in given if g not in allowed]
        if bad or not given:
            p.error(f"unknown {name} {bad}; choose from {list(allowed)}")
    if not a.tokens or min(a.tokens) < 1 or a.trials < 1 or a.max_spin < 1:
        p.error("--tokens, --trials and --max-spin must be >= 1")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    if a.chunk is not None:
        try:
            i, n = (int(v) for v in a.chunk.split("/"))
        except ValueError:
            p.error(f"--chunk must be I/N, got {a.chunk!r}")
        if not 0 <= i < n:
            p.error(f"--chunk {a.chunk}: need 0 <= I < N")
        a.chunk = (i, n)
    for name in ("graph_iters", "programs", "lead"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


@dataclass
class ConfigSetup:
    """One configuration's inputs, Dispatch, schedules and prepared launches on this rank."""

    shape: moe.MoEShape
    precision: str
    cfg: moe.TileConfig
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_w: torch.Tensor
    plan: moe.SendPlan
    layout: moe.DispatchLayout
    problem: MoEProblem
    programs: int
    knee: int
    lead: int
    schedules: dict
    peers: moe.CombinePeers
    rows_view: torch.Tensor
    calls: dict


def setup_config(shape: moe.MoEShape, precision: str, routing: str, tokens: int,
                 weights: moe.ExpertWeights, combine: moe.SymmetricCombine, args,
                 config_seed: int) -> ConfigSetup:
    """Fresh seeded inputs, router, Dispatch, both schedules (lead ``args.lead`` or D_knee) and
    their launches of the timing kernel (uninstrumented, unfenced)."""
    import torch.distributed as dist
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    # the kernel asked for, else the device's default (gluon_ws on sm_90, Triton elsewhere)
    cfg = moe.default_tile_config(precision, args.kernel, hidden=shape.hidden, device=device)
    moe.check_tile_config(cfg, precision, shape.hidden, shape.intermediate)
    k, hidden, inter = shape.top_k, shape.hidden, shape.intermediate
    programs = args.programs or torch.cuda.get_device_properties(device).multi_processor_count

    g = torch.Generator(device=device).manual_seed(config_seed * 1009 + rank)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)
    logits = moe.router_logits(tokens, shape.routed_experts, routing, seed=config_seed, rank=rank,
                               device=device)
    topk_ids, topk_w = moe.router_topk(logits, k)
    x_q, x_scale = moe.quantize_rows_fp8(x) if precision == "fp8" else (x, None)
    plan, layout = moe.dispatch(x_q, x_scale, topk_ids, num_experts=shape.routed_experts,
                                block_m=cfg.block_m)
    problem = MoEProblem(layout.blocks_per_expert, inter // cfg.block_n1, hidden // cfg.block_n2)
    knee = d_knee(2 * cfg.block_n1, programs, inter)
    lead = knee if args.lead is None else args.lead
    schedules = {"wave": expert_wave_schedule(problem, programs),
                 "interleaved": interleaved_schedule(problem, programs, lead)}
    peers = combine.peers(tokens * k, hidden)
    rows_view = combine.rows(tokens * k, hidden)
    calls = {name: moe.prepare_fused_moe(layout, weights, s, peers, config=cfg,
                                         max_spin_iters=args.max_spin)
             for name, s in schedules.items()}
    return ConfigSetup(shape, precision, cfg, x, topk_ids, topk_w, plan, layout, problem, programs,
                       knee, lead, schedules, peers, rows_view, calls)


def combine_output(setup: ConfigSetup, combine: moe.SymmetricCombine, call) -> torch.Tensor:
    """Run ``call`` once into this rank's Combine buffer poisoned with NaN; a copy of the buffer."""
    setup.rows_view.fill_(float("nan"))
    combine.barrier()
    call()
    combine.barrier()
    return setup.rows_view.clone()


def abort_on_failures(failures: list[str], what: str) -> None:
    """Gather every rank's failures; any failure anywhere aborts the run (rank 0 says which)."""
    import torch.distributed as dist
    all_failures = all_gather_objects(failures)
    if any(all_failures):
        if dist.get_rank() == 0:
            for r, f in enumerate(all_failures):
                if f:
                    print(f"[{what}] rank {r}: {'; '.join(f)}", file=sys.stderr)
        raise SystemExit(f"correctness failed for {what}; not timing")


def run_config(shape: moe.MoEShape, precision: str, routing: str, tokens: int,
               weights: moe.ExpertWeights, uweights: moe.GroupedWeights,
               combine: moe.SymmetricCombine, args, config_seed: int) -> dict:
    """Correctness, then timing, of one configuration (``uweights``: the unfused path's);
    returns rank 0's result row."""
    import torch.distributed as dist
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    setup = setup_config(shape, precision, routing, tokens, weights, combine, args, config_seed)
    cfg, calls, layout, plan = setup.cfg, setup.calls, setup.layout, setup.plan
    topk_w, rows_view = setup.topk_w, setup.rows_view
    k, hidden, inter = shape.top_k, shape.hidden, shape.intermediate
    programs, knee, lead, problem = setup.programs, setup.knee, setup.lead, setup.problem

    # 1. correctness, on a poisoned Combine buffer
    combined = {name: combine_output(setup, combine, call) for name, call in calls.items()}
    spin_errors = {name: call.error_count() for name, call in calls.items()}
    bitwise = torch.equal(combined["wave"], combined["interleaved"])
    out = moe.combine_weighted_sum(combined["interleaved"], topk_w)
    ref = moe.reference_moe(setup.x, setup.topk_ids, topk_w, shape, seed=args.seed,
                            precision=precision)
    errors = {f"rel_err_{kind}": relative_error(out, want) for kind, want in ref.items()}
    uplan, ulayout = (plan, layout) if precision == "bf16" else moe.dispatch(
        *moe.unfused_activations(setup.x, precision), setup.topk_ids,
        num_experts=shape.routed_experts, block_m=cfg.block_m)
    unfused_out = moe.unfused_moe(ulayout, uplan, uweights, topk_w)
    errors["rel_err_unfused_fp32"] = relative_error(unfused_out, ref["fp32"])
    tol = TOLERANCE[precision]
    failures = [f"spin errors {spin_errors}"] if any(spin_errors.values()) else []
    if not bitwise:
        failures.append("Expert-Wave and Interleaved Combine buffers differ")
    failures += [f"{key} = {errors[f'rel_err_{key}']:.3g} > {bound}" for key, bound in tol.items()
                 if not errors[f"rel_err_{key}"] <= bound]
    if not errors["rel_err_unfused_fp32"] <= tol["fp32"]:
        failures.append(f"unfused rel_err_fp32 = {errors['rel_err_unfused_fp32']:.3g} > {tol['fp32']}")
    abort_on_failures(failures, f"{shape.model} {precision} {routing} {tokens}")

    # 2. timing
    def fused(call):
        def run():
            combine.barrier()
            call()
            combine.barrier()
            moe.combine_weighted_sum(rows_view, topk_w)
        return run

    methods = {"wave": fused(calls["wave"]), "interleaved": fused(calls["interleaved"]),
               "unfused": lambda: moe.unfused_moe(ulayout, uplan, uweights, topk_w)}
    timing = time_methods(methods, trials=args.trials, warmup=args.warmup,
                          graph_iters=args.graph_iters)
    late_errors = sum(call.error_count() for call in calls.values())
    per_rank = all_gather_objects({"rows": layout.num_rows, "tokens_per_expert": layout.tokens_per_expert,
                        "errors": errors, "spin_errors_after_timing": late_errors,
                        "unfused_impl": moe.unfused_impl(device, precision)})
    received = [p["rows"] for p in per_rank]
    w, i = timing["wave"]["median_us"], timing["interleaved"]["median_us"]
    return {
        "model": shape.model, "variant": shape.variant, "precision": precision, "routing": routing,
        "tokens": tokens, "world_size": world, "hidden": hidden, "intermediate": inter,
        "routed_experts": shape.routed_experts, "top_k": k,
        "wave_us": w, "interleaved_us": i, "unfused_us": timing["unfused"]["median_us"],
        "speedup": w / i, "fused_vs_unfused": timing["unfused"]["median_us"] / i,
        "spreads": {m: {"p25_us": t["p25_us"], "p75_us": t["p75_us"]} for m, t in timing.items()},
        "trials_us": {m: t["trials_us"] for m, t in timing.items()},
        "lead_rows": lead, "d_knee": knee, "num_programs": programs,
        "wave_starts": list(setup.schedules["wave"].wave_starts),
        "padded_rows_per_rank": received,
        "rank_load_max_over_mean": max(received) / (sum(received) / world) if sum(received) else 1.0,
        "max_rel_err": {key: max(p["errors"][key] for p in per_rank) for key in errors},
        "spin_errors_after_timing": sum(p["spin_errors_after_timing"] for p in per_rank),
        "unfused_impl": sorted({p["unfused_impl"] for p in per_rank}),
        "tile_config": cfg.__dict__,
    }


def init_expert_parallel(models: list[str]) -> tuple[int, int, int, dict[str, moe.MoEShape]]:
    """Start this torchrun rank of an expert-parallel run: NVLink multicast off, its GPU, the NCCL
    process group, float32 matmuls without TF32 (the reference is float32, not TF32), and every
    model's routed experts checked to split over the ranks. Returns ``(local_rank, rank, world,
    shapes)``."""
    local_rank, rank, world = start_rank()
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = moe.load_shapes()
    for m in models:
        moe.check_expert_parallel(shapes[m].routed_experts, world)
    return local_rank, rank, world, shapes


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch.distributed as dist
    local_rank, rank, world, shapes = init_expert_parallel(args.models)
    capacity = max(args.tokens) * max(shapes[m].top_k * shapes[m].hidden for m in args.models)
    combine = moe.SymmetricCombine(capacity)
    clocks_start = all_gather_objects(read_sm_clock_mhz())
    started = time.time()
    rows = []
    cells = matrix_cells(args)
    for model in args.models:
        shape = shapes[model]
        for precision in args.precisions:
            mine = [(r, t) for m, p, r, t in cells if (m, p) == (model, precision)]
            if not mine:
                continue
            weights = moe.local_expert_weights(shape, rank, world, precision, seed=args.seed,
                                               device=torch.device("cuda", local_rank))
            # bf16: the grouped GEMMs take the kernel's weights as they are (same master weights).
            uweights = (moe.GroupedWeights(precision, weights.w1, weights.w2) if precision == "bf16"
                        else moe.unfused_expert_weights(shape, rank, world, precision,
                                                        seed=args.seed, device=weights.w1.device))
            for routing, tokens in mine:
                # Fresh inputs per configuration, reproducible whatever subset is run.
                config_seed = args.seed + 1 + zlib.crc32(
                    f"{model}|{precision}|{routing}|{tokens}".encode())
                row = run_config(shape, precision, routing, tokens, weights, uweights, combine,
                                 args, config_seed)
                rows.append(row)
                if rank == 0:
                    print(f"{model:18s} {precision:4s} {routing:8s} {tokens:6d} wave "
                          f"{row['wave_us']:9.1f} us  interleaved {row['interleaved_us']:9.1f} us  "
                          f"unfused {row['unfused_us']:9.1f} us  speedup {row['speedup']:.3f}",
                          flush=True)
            del weights, uweights
            torch.cuda.empty_cache()
    clocks_end = all_gather_objects(read_sm_clock_mhz())
    if rank == 0:
        from ...platform import provenance
        meta = {
            "experiment": "moe_fused_schedules", "paper": "§4.2, §5.2.1; timing §5.1",
            "world_size": world, "tokens_per_rank": args.tokens, "trials": args.trials,
            "warmup": args.warmup, "graph_iters": args.graph_iters, "seed": args.seed,
            "chunk": None if args.chunk is None else f"{args.chunk[0]}/{args.chunk[1]}",
            "lead_rows": "d_knee (eq. 16)" if args.lead is None else args.lead,
            "max_spin_iters": args.max_spin, "tolerance": TOLERANCE,
            "unfused_fp8_recipe": moe.UNFUSED_FP8_RECIPE,
            "skew": {"hot_expert_fraction": moe.HOT_EXPERT_FRACTION, "hot_logit_bias": moe.HOT_LOGIT_BIAS},
            "timed_call": "expert compute + Combine into source buffers + top-k weighted sum; "
                          "Dispatch (NCCL all_to_all_single) runs before, untimed",
            "timing": TIMING_METHOD,
            "sm_clock_mhz_start": clocks_start, "sm_clock_mhz_end": clocks_end,
            "wall_s": time.time() - started, "provenance": provenance(),
        }
        write_output(args.out, meta, rows, indent=1, default=str)
        print(f"wrote {args.out} ({len(rows)} configurations, {time.time() - started:.0f} s)")
    dist.barrier(device_ids=[local_rank])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
