"""SPMD benchmark of the fused MoE kernel's two schedules and the unfused path (paper §5.2.1).

    torchrun --nproc_per_node=4 -m xstage_lab.experiments.moe.bench (--out FILE | --root DIR) \\
        [--models M1,M2] [--precisions bf16,fp8] [--routing balanced,skewed] [--tokens N1,N2]
        [--matrix data/moe_matrix.json] [--chunk I/N]

An ``Experiment`` run by ``experiments.harness``: the matrix is its declared ``Sweep``.

For every (model shape, precision, routing), on fresh seeded inputs:

1. Correctness first. Each schedule runs once into a Combine buffer poisoned with NaN; both must
   leave the spin-error flag at zero and produce bitwise-identical Combine buffers on every rank;
   the combined output must match the float32 reference (``reference_moe``) within ``TOLERANCE``
   (relative Frobenius error), and so must the unfused path. Any failure on any rank aborts the
   run before timing, with a non-zero exit and no output file.
2. Timing (``xstage_lab.dist_timing``, §5.1): Expert-Wave, Interleaved and unfused, barrier-aligned
   trials, the maximum over ranks per trial, median and p25/p75 over trials, order rotated.
3. Correctness again after the timing (the harness's ``recheck``: step 1 once more). The
   spin-error flag counts every launch since the cell was prepared, so a spin timeout in any
   timed run fails it too: the run aborts with no output file.

What a timed call covers, for all three methods alike: expert compute, Combine into the source
ranks' buffers and the top-k weighted sum. Dispatch (NCCL all-to-all) runs once before, outside the
timing. A fused call is: symmetric barrier (the previous call's readers are done), zero the row
counters, the kernel, symmetric barrier (every peer's stores are visible), weighted sum. The
unfused path is torch's grouped GEMMs (``ops.moe.unfused.grouped_expert_ffn``); in FP8 it takes rows quantized
by its own recipe (``ops.moe.unfused.UNFUSED_FP8_RECIPE``), so it has its own Dispatch of those rows.

Rows: ``{model, precision, routing, tokens, wave_us, interleaved_us, unfused_us, speedup (= wave /
interleaved), spreads, ...}``, one per cell.
"""
from __future__ import annotations

import argparse
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...checks import relative_error
from ...cli import list_option
from ...dist_timing import TIMING_METHOD, time_methods
from ...ops.moe.combine import CombinePeers, SymmetricCombine, combine_weighted_sum
from ...ops.moe.dispatch import DispatchLayout, SendPlan, dispatch
from ...ops.moe.fused import DEFAULT_MAX_SPIN_ITERS, prepare_fused_moe
from ...ops.moe.reference import reference_moe
from ...ops.moe.routing import HOT_EXPERT_FRACTION, HOT_LOGIT_BIAS, router_logits, router_topk
from ...ops.moe.schedules import (MoEProblem, d_knee, expert_wave_schedule,
                                  interleaved_schedule)
from ...ops.moe.shapes import MoEShape, PRECISIONS, ROUTINGS, check_expert_parallel, load_shapes
from ...ops.moe.tiles import KERNELS, TileConfig, check_tile_config, default_tile_config
from ...ops.moe.unfused import (GroupedWeights, UNFUSED_FP8_RECIPE, unfused_activations,
                                unfused_expert_weights, unfused_impl, unfused_moe)
from ...ops.moe.weights import ExpertWeights, local_expert_weights, quantize_rows_fp8
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment, Run

MOE_MATRIX = Path(__file__).resolve().parents[3] / "data" / "moe_matrix.json"

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


def tolerance_failures(what: str, errors: dict, precision: str) -> list[str]:
    """``what``'s relative errors (``errors``: reference kind -> error) above ``TOLERANCE``."""
    tol = TOLERANCE[precision]
    return [f"{what} {k} error {e:.3g} > {tol[k]}" for k, e in errors.items() if not e <= tol[k]]


def matrix_sweep(args) -> Sweep:
    """The configuration matrix as a declared sweep: model shape × precision × routing × tokens
    per rank, one pass (each cell's repeats are its timing trials). Model outermost: a model's
    weights are made once for its cells."""
    return Sweep("moe", (Axis("model", args.models), Axis("precision", args.precisions),
                         Axis("routing", args.routing), Axis("tokens", args.tokens)),
                 repeats=1, warmup=0)


def add_layer_arguments(p: argparse.ArgumentParser) -> None:
    """The options every MoE layer experiment shares (this bench and ``trace_bench``)."""
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--programs", type=int, default=None, help="persistent programs (default: SMs)")
    p.add_argument("--lead", type=int, default=None, help="lead D in rows (default: D_knee, eq. 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-spin", type=int, default=DEFAULT_MAX_SPIN_ITERS)
    p.add_argument("--kernel", default=None, choices=KERNELS,
                   help="fused kernel (default: gluon_ws on sm_90 GPUs, triton elsewhere)")


def check_layer_args(a: argparse.Namespace, *names: str) -> None:
    """Check ``add_layer_arguments``' options and the lists ``names`` (of ``model``,
    ``precision``, ``routing``) after parsing; ``ValueError`` names the first mistake."""
    allowed = {"models": load_shapes(), "precisions": PRECISIONS, "routing": ROUTINGS}
    for name in names:
        given = getattr(a, name)
        bad = [g for g in given if g not in allowed[name]]
        if bad or not given:
            raise ValueError(f"unknown {name} {bad}; choose from {list(allowed[name])}")
    if a.trials < 1 or a.max_spin < 1:
        raise ValueError("--trials and --max-spin must be >= 1")
    if a.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    for name in ("graph_iters", "programs", "lead"):
        if getattr(a, name, None) is not None and getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


def start_expert_parallel(models: list[str]) -> dict[str, MoEShape]:
    """On a started rank of an expert-parallel run: float32 matmuls without TF32 (the reference is
    float32, not TF32), and every model's routed experts checked to split over the ranks. Returns
    the model shapes."""
    import torch.distributed as dist
    torch.backends.cuda.matmul.allow_tf32 = False
    world = dist.get_world_size() if dist.is_initialized() else 1
    shapes = load_shapes()
    for m in models:
        check_expert_parallel(shapes[m].routed_experts, world)
    return shapes


def cell_seed(seed: int, *key) -> int:
    """Fresh inputs per cell (``key``: model, precision, routing, tokens), reproducible whatever
    subset is run (``trace_bench`` and ``kernel_bench`` use the same)."""
    return seed + 1 + zlib.crc32("|".join(str(k) for k in key).encode())


@dataclass
class ConfigSetup:
    """One configuration's inputs, Dispatch, schedules and prepared launches on this rank."""

    shape: MoEShape
    precision: str
    cfg: TileConfig
    x: torch.Tensor
    topk_ids: torch.Tensor
    topk_w: torch.Tensor
    plan: SendPlan
    layout: DispatchLayout
    problem: MoEProblem
    programs: int
    knee: int
    lead: int
    schedules: dict
    peers: CombinePeers
    rows_view: torch.Tensor
    calls: dict
    point: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)  # relative errors found by the check
    unfused: tuple = ()  # the unfused path's (plan, layout)


def setup_config(shape: MoEShape, precision: str, routing: str, tokens: int,
                 weights: ExpertWeights, combine: SymmetricCombine, args,
                 config_seed: int) -> ConfigSetup:
    """Fresh seeded inputs, router, Dispatch, both schedules (lead ``args.lead`` or D_knee) and
    their launches of the timing kernel (uninstrumented, unfenced)."""
    import torch.distributed as dist
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device())
    # the kernel asked for, else the device's default (gluon_ws on sm_90, Triton elsewhere)
    cfg = default_tile_config(precision, args.kernel, hidden=shape.hidden, device=device)
    check_tile_config(cfg, precision, shape.hidden, shape.intermediate)
    k, hidden, inter = shape.top_k, shape.hidden, shape.intermediate
    programs = args.programs or torch.cuda.get_device_properties(device).multi_processor_count

    g = torch.Generator(device=device).manual_seed(config_seed * 1009 + rank)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16)
    logits = router_logits(tokens, shape.routed_experts, routing, seed=config_seed, rank=rank,
                               device=device)
    topk_ids, topk_w = router_topk(logits, k)
    x_q, x_scale = quantize_rows_fp8(x) if precision == "fp8" else (x, None)
    plan, layout = dispatch(x_q, x_scale, topk_ids, num_experts=shape.routed_experts,
                                block_m=cfg.block_m)
    problem = MoEProblem(layout.blocks_per_expert, inter // cfg.block_n1, hidden // cfg.block_n2)
    knee = d_knee(2 * cfg.block_n1, programs, inter)
    lead = knee if args.lead is None else args.lead
    schedules = {"wave": expert_wave_schedule(problem, programs),
                 "interleaved": interleaved_schedule(problem, programs, lead)}
    peers = combine.peers(tokens * k, hidden)
    rows_view = combine.rows(tokens * k, hidden)
    calls = {name: prepare_fused_moe(layout, weights, s, peers, config=cfg,
                                         max_spin_iters=args.max_spin)
             for name, s in schedules.items()}
    return ConfigSetup(shape, precision, cfg, x, topk_ids, topk_w, plan, layout, problem, programs,
                       knee, lead, schedules, peers, rows_view, calls)


def combine_output(setup: ConfigSetup, combine: SymmetricCombine, call) -> torch.Tensor:
    """Run ``call`` once into this rank's Combine buffer poisoned with NaN; a copy of the buffer."""
    setup.rows_view.fill_(float("nan"))
    combine.barrier()
    call()
    combine.barrier()
    return setup.rows_view.clone()


class MoEMatrix(Experiment):
    """The fused MoE layer's two schedules against the unfused path over the matrix (§5.2.1)."""

    name = "moe"
    in_measure_all = True
    paper = "§4.2, §5.2.1; timing §5.1"

    def measure_all_args(self, written, root) -> list[str]:
        """The declared 84-cell matrix (``data/moe_matrix.json``)."""
        return ["--matrix", str(MOE_MATRIX)]

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        shapes = load_shapes()
        p.add_argument("--models", **list_option(default=list(shapes),
                                                 help=f"default: all of {list(shapes)}"))
        p.add_argument("--precisions", **list_option(default=list(PRECISIONS)))
        p.add_argument("--routing", **list_option(default=list(ROUTINGS)))
        p.add_argument("--tokens", **list_option(int, default=[DEFAULT_TOKENS],
                                                 help="tokens per rank"))
        p.add_argument("--matrix", type=Path, default=None,
                       help="a JSON declaring models, precisions, routing and tokens_per_rank "
                            "(e.g. data/moe_matrix.json); it replaces those four options")
        p.add_argument("--graph-iters", type=int, default=None,
                       help="time CUDA-graph replays of this many back-to-back calls")
        add_layer_arguments(p)

    def check_args(self, a: argparse.Namespace) -> None:
        if a.matrix is not None:
            matrix = json.loads(a.matrix.read_text())
            models = matrix["models"]
            a.models = list(load_shapes()) if models == "all" else list(models)
            a.precisions, a.routing = list(matrix["precisions"]), list(matrix["routing"])
            a.tokens = [int(t) for t in matrix["tokens_per_rank"]]
        if not a.tokens or min(a.tokens) < 1:
            raise ValueError("--tokens must be >= 1")
        check_layer_args(a, "models", "precisions", "routing")

    def sweeps(self, args) -> list[Sweep]:
        return [matrix_sweep(args)]

    def start(self, run: Run) -> None:
        args = run.args
        self.shapes = start_expert_parallel(args.models)
        capacity = max(args.tokens) * max(self.shapes[m].top_k * self.shapes[m].hidden
                                          for m in args.models)
        self.combine = SymmetricCombine(capacity)

    def prepare(self, point: dict, run: Run) -> ConfigSetup:
        """The cell's fresh inputs, Dispatch, schedules and launches; its model's weights (made
        once for the model's cells)."""
        args, shape, precision = run.args, self.shapes[point["model"]], point["precision"]

        def make_weights():
            device = torch.device("cuda", torch.cuda.current_device())
            weights = local_expert_weights(shape, run.rank, run.world, precision,
                                               seed=args.seed, device=device)
            # bf16: the grouped GEMMs take the kernel's weights as they are (same master weights)
            unfused = (GroupedWeights(precision, weights.w1, weights.w2) if precision == "bf16"
                       else unfused_expert_weights(shape, run.rank, run.world, precision,
                                                       seed=args.seed, device=device))
            return weights, unfused

        self.weights, self.unfused_weights = run.resource((shape.model, precision), make_weights)
        setup = setup_config(shape, precision, point["routing"], point["tokens"], self.weights,
                             self.combine, args, cell_seed(args.seed, *(
                                 point[k] for k in ("model", "precision", "routing", "tokens"))))
        setup.point = point
        return setup

    def check(self, setup: ConfigSetup, run: Run) -> list[str]:
        """On a poisoned Combine buffer: spin errors zero, both schedules bitwise equal, the
        layer and the unfused path within ``TOLERANCE`` of the references."""
        shape, precision, args = setup.shape, setup.precision, run.args
        combined = {name: combine_output(setup, self.combine, call)
                    for name, call in setup.calls.items()}
        spin_errors = {name: call.error_count() for name, call in setup.calls.items()}
        out = combine_weighted_sum(combined["interleaved"], setup.topk_w)
        ref = reference_moe(setup.x, setup.topk_ids, setup.topk_w, shape, seed=args.seed,
                                precision=precision)
        errors = {f"rel_err_{kind}": relative_error(out, want) for kind, want in ref.items()}
        setup.unfused = (setup.plan, setup.layout) if precision == "bf16" else dispatch(
            *unfused_activations(setup.x, precision), setup.topk_ids,
            num_experts=shape.routed_experts, block_m=setup.cfg.block_m)
        unfused_out = unfused_moe(setup.unfused[1], setup.unfused[0], self.unfused_weights,
                                      setup.topk_w)
        errors["rel_err_unfused_fp32"] = relative_error(unfused_out, ref["fp32"])
        setup.errors = errors
        tol = TOLERANCE[precision]
        failures = [f"spin errors {spin_errors}"] if any(spin_errors.values()) else []
        if not torch.equal(combined["wave"], combined["interleaved"]):
            failures.append("Expert-Wave and Interleaved Combine buffers differ")
        failures += [f"{key} = {errors[f'rel_err_{key}']:.3g} > {bound}"
                     for key, bound in tol.items() if not errors[f"rel_err_{key}"] <= bound]
        if not errors["rel_err_unfused_fp32"] <= tol["fp32"]:
            failures.append(f"unfused rel_err_fp32 = {errors['rel_err_unfused_fp32']:.3g} > "
                            f"{tol['fp32']}")
        return failures

    def measure(self, setup: ConfigSetup, run: Run) -> dict:
        """The three methods timed together (``dist_timing.time_methods``); rank 0's row."""
        args, combine, shape = run.args, self.combine, setup.shape
        rows_view, topk_w, calls = setup.rows_view, setup.topk_w, setup.calls
        uplan, ulayout = setup.unfused

        def fused(call):
            def run_call():
                combine.barrier()
                call()
                combine.barrier()
                combine_weighted_sum(rows_view, topk_w)
            return run_call

        methods = {"wave": fused(calls["wave"]), "interleaved": fused(calls["interleaved"]),
                   "unfused": lambda: unfused_moe(ulayout, uplan, self.unfused_weights, topk_w)}
        timing = time_methods(methods, trials=args.trials, warmup=args.warmup,
                              graph_iters=args.graph_iters)
        device = torch.device("cuda", torch.cuda.current_device())
        per_rank = run.gather({"rows": setup.layout.num_rows,
                               "tokens_per_expert": setup.layout.tokens_per_expert,
                               "errors": setup.errors,
                               "unfused_impl": unfused_impl(device, setup.precision)})
        received = [p["rows"] for p in per_rank]
        w, i = timing["wave"]["median_us"], timing["interleaved"]["median_us"]
        return {
            "model": shape.model, "variant": shape.variant, "precision": setup.precision,
            "routing": setup.point["routing"], "tokens": setup.point["tokens"],
            "world_size": run.world, "hidden": shape.hidden, "intermediate": shape.intermediate,
            "routed_experts": shape.routed_experts, "top_k": shape.top_k,
            "wave_us": w, "interleaved_us": i, "unfused_us": timing["unfused"]["median_us"],
            "speedup": w / i, "fused_vs_unfused": timing["unfused"]["median_us"] / i,
            "spreads": {m: {"p25_us": t["p25_us"], "p75_us": t["p75_us"]} for m, t in timing.items()},
            "trials_us": {m: t["trials_us"] for m, t in timing.items()},
            "lead_rows": setup.lead, "d_knee": setup.knee, "num_programs": setup.programs,
            "wave_starts": list(setup.schedules["wave"].wave_starts),
            "padded_rows_per_rank": received,
            "rank_load_max_over_mean": (max(received) / (sum(received) / run.world)
                                        if sum(received) else 1.0),
            "max_rel_err": {key: max(p["errors"][key] for p in per_rank) for key in setup.errors},
            "unfused_impl": sorted({p["unfused_impl"] for p in per_rank}),
            "tile_config": setup.cfg.__dict__,
        }

    def progress_line(self, rows) -> str:
        r = rows.iloc[0]
        return (f"{r['model']:18s} {r['precision']:4s} {r['routing']:8s} {r['tokens']:6d} wave "
                f"{r['wave_us']:9.1f} us  interleaved {r['interleaved_us']:9.1f} us  "
                f"unfused {r['unfused_us']:9.1f} us  speedup {r['speedup']:.3f}")

    def metadata(self, run: Run) -> dict:
        args = run.args
        return {
            "tokens_per_rank": args.tokens, "trials": args.trials, "warmup": args.warmup,
            "graph_iters": args.graph_iters, "seed": args.seed,
            "lead_rows": "d_knee (eq. 16)" if args.lead is None else args.lead,
            "max_spin_iters": args.max_spin, "tolerance": TOLERANCE,
            "unfused_fp8_recipe": UNFUSED_FP8_RECIPE,
            "skew": {"hot_expert_fraction": HOT_EXPERT_FRACTION,
                     "hot_logit_bias": HOT_LOGIT_BIAS},
            "timed_call": "expert compute + Combine into source buffers + top-k weighted sum; "
                          "Dispatch (NCCL all_to_all_single) runs before, untimed",
            "timing": TIMING_METHOD,
        }


EXPERIMENT = MoEMatrix()


if __name__ == "__main__":
    harness.main(EXPERIMENT)
