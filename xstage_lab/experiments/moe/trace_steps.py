"""The steps of ``trace_bench`` on this rank: the traced cell (both schedules, instrumented,
fenced and the local-store control) and its check, and each step kind's preparation, check and
rows (``trace``, ``fenced``, ``d_sweep``, ``knee_sweep``, ``regression``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ...checks import relative_error
from ...dist_timing import time_methods
from ...ops.moe.combine import (CombinePeers, SymmetricCombine, combine_weighted_sum,
                                local_store_control)
from ...ops.moe.fused import prepare_fused_moe
from ...ops.moe.reference import reference_moe
from ...ops.moe.schedules import check_schedule, interleaved_schedule, tile_table
from ...ops.moe.shapes import MoEShape
from ...ops.moe.weights import ExpertWeights
from ..harness import Run
from ...analysis.moe import trace as moe_trace
from .bench import TOLERANCE, ConfigSetup, combine_output, setup_config

TRACED_WARMUP = 2  # instrumented launches before the traced one (compile, caches, clocks up)
CELL = ("model", "precision", "routing", "tokens")


def sweep_leads(knee: int, factors) -> list[int]:
    """D = factor x D_knee, rounded, clamped >= 1, without repeats, in ascending order."""
    return sorted({max(1, round(knee * f)) for f in factors})


def traced_run(call, combine: SymmetricCombine, schedule):
    """One traced launch after ``TRACED_WARMUP`` others; the tile frame and its summary."""
    for _ in range(TRACED_WARMUP + 1):
        combine.barrier()
        call()
        combine.barrier()
    torch.cuda.synchronize()
    table, counts = tile_table(schedule)
    return moe_trace.tile_frame(call.trace.cpu().numpy(), table, counts)


def summarize(tiles, local, samples: int, bins: int, seed: int) -> dict:
    """This rank's stats, Linear-2 sample (with stall columns where a local control exists) and
    activity time line of one traced launch."""
    stats = moe_trace.run_stats(tiles, local)
    l2 = moe_trace.linear2_stalls(tiles, local) if local is not None else \
        tiles[tiles["kind"] == moe_trace.L2]
    cols = [c for c in ("span_us", "mainloop_us", "wait_us", "next_kind", "next_mainloop_us",
                        "stall_pred_us", "stall_meas_us") if c in l2]
    sample = moe_trace.sample_tiles(l2[cols], samples, seed)
    return {"stats": stats, "tiles": len(tiles),
            "sample": {c: np.round(sample[c].to_numpy(float), 4).tolist() for c in cols},
            "timeline": {k: np.round(v, 4).tolist() for k, v in
                         moe_trace.tensor_core_activity(tiles, bins).items()}}


def critical(per_rank: list[dict]) -> tuple[int, dict]:
    """The rank with the most tiles (the loaded one under skew) and its summary."""
    r = max(range(len(per_rank)), key=lambda i: per_rank[i]["tiles"])
    return r, per_rank[r]


def check_local_control(local: torch.Tensor, plain: torch.Tensor, slots: int, name: str) -> list[str]:
    """Send each source's region of the local control to that source; there, every slot must be
    written by exactly one expert rank, bitwise equal to what the remote run stored."""
    import torch.distributed as dist
    recv = torch.empty_like(local)
    dist.all_to_all_single(recv, local)  # recv[s] = the rows rank s computed for this rank
    written = ~torch.isnan(recv.float()).any(dim=-1)  # [P, slots]
    failures = []
    if not bool((written.sum(dim=0) == 1).all()):
        failures.append(f"{name}: not every slot written exactly once")
    for s in range(recv.shape[0]):
        if not torch.equal(recv[s][written[s]], plain[:slots][written[s]]):
            failures.append(f"{name}: rows from rank {s} differ from the remote run")
    return failures


def timed_layer(combine: SymmetricCombine, setup: ConfigSetup, call):
    """A timed call of the layer (``bench``'s): barrier, ``call``, barrier, weighted sum."""
    def run():
        combine.barrier()
        call()
        combine.barrier()
        combine_weighted_sum(setup.rows_view, setup.topk_w)
    return run


@dataclass
class TracedCell:
    """A model's traced cell (``--precision``, ``--routing``, ``--tokens``) on this rank: its
    setup, every variant of both schedules (the timing kernel, instrumented, fenced, the
    local-store control), the control's buffers; after its check, the timing kernel's
    Expert-Wave Combine buffer and the columns every row of the model shares (``base``)."""

    setup: ConfigSetup
    weights: ExpertWeights
    variants: dict
    local: torch.Tensor  # bf16 [P, slots, hidden]: where the local-store control stores
    local_peers: CombinePeers
    prep: dict  # prepare_fused_moe's options of every variant
    wave_out: torch.Tensor | None = None
    base: dict | None = None


def traced_cell(shape: MoEShape, weights: ExpertWeights, combine: SymmetricCombine,
                args, world: int, config_seed: int) -> TracedCell:
    setup = setup_config(shape, args.precision, args.routing, args.tokens, weights, combine, args,
                         config_seed)
    # The schedules were checked by setup_config; the variants launch the same ones.
    prep = dict(config=setup.cfg, max_spin_iters=args.max_spin, verify_schedule=False)
    local = torch.empty(world, args.tokens * shape.top_k, shape.hidden, dtype=torch.bfloat16,
                        device=setup.x.device)
    local_peers = local_store_control(setup.peers, local)
    variants = {}
    for name, sched in setup.schedules.items():
        variants[name] = setup.calls[name]
        variants[f"{name}_instrumented"] = prepare_fused_moe(
            setup.layout, weights, sched, setup.peers, instrument=True, **prep)
        variants[f"{name}_fenced"] = prepare_fused_moe(
            setup.layout, weights, sched, setup.peers, fence=True, **prep)
        variants[f"{name}_local"] = prepare_fused_moe(
            setup.layout, weights, sched, local_peers, instrument=True, **prep)
    return TracedCell(setup, weights, variants, local, local_peers, prep)


def check_traced_cell(cell: TracedCell, combine: SymmetricCombine, run: Run) -> list[str]:
    """Step 1 of the module docstring for the traced cell; keeps the Expert-Wave Combine buffer
    and sets ``cell.base``."""
    setup, variants, local, args = cell.setup, cell.variants, cell.local, run.args
    shape, precision = setup.shape, setup.precision
    slots = local.shape[1]
    out = {n: combine_output(setup, combine, c) for n, c in variants.items() if not n.endswith("_local")}
    failures = []
    for name in setup.schedules:
        for v in ("_instrumented", "_fenced"):
            if not torch.equal(out[name + v], out[name]):
                failures.append(f"{name}{v} differs from the timing kernel")
    if not torch.equal(out["wave"], out["interleaved"]):
        failures.append("Expert-Wave and Interleaved Combine buffers differ")
    ref = reference_moe(setup.x, setup.topk_ids, setup.topk_w, shape, seed=args.seed,
                            precision=precision)
    combined = combine_weighted_sum(out["interleaved"], setup.topk_w)
    errors = {kind: relative_error(combined, want) for kind, want in ref.items()}
    failures += [f"rel_err_{k} = {errors[k]:.3g} > {b}" for k, b in TOLERANCE[precision].items()
                 if not errors[k] <= b]
    for name in setup.schedules:
        local.fill_(float("nan"))
        variants[f"{name}_local"]()
        torch.cuda.synchronize()
        failures += check_local_control(local, out[name], slots, f"{name}_local")
    spin = {n: c.error_count() for n, c in variants.items()}
    if any(spin.values()):
        failures.append(f"spin errors {spin}")
    cell.wave_out = out["wave"]
    cell.base = {"model": shape.model, "variant": shape.variant, "precision": precision,
                 "routing": args.routing, "tokens": args.tokens,
                 "world_size": run.world, "d_knee": setup.knee, "hidden": shape.hidden,
                 "intermediate": shape.intermediate, "top_k": shape.top_k,
                 "tile_config": setup.cfg.__dict__, "num_programs": setup.programs,
                 "padded_rows": run.gather(setup.layout.num_rows),
                 "max_rel_err": max(run.gather(errors), key=lambda e: e["fp32"])}
    return failures


@dataclass
class Step:
    """One step on this rank: its model's traced cell (None for ``regression``, which has
    ``setup``, the regressing cell's) and the step's own launches (``d_sweep``: lead -> the timing
    kernel and lead -> (instrumented launch, schedule); ``knee_sweep``: schedule -> launch and
    path -> instrumented Expert-Wave; ``regression``: schedule -> instrumented launch)."""

    point: dict
    cell: TracedCell | None = None
    setup: ConfigSetup | None = None
    calls: dict = field(default_factory=dict)
    traced: dict = field(default_factory=dict)


def trace_rows(cell: TracedCell, combine: SymmetricCombine, run: Run,
               local_control: bool) -> list[dict]:
    """Step 2: per schedule, the local-store control's traced launch (``local_control``) and then
    the remote one (the control's tiles give its stalls); the critical rank's ``trace`` rows."""
    args, setup, variants = run.args, cell.setup, cell.variants

    def trace_row(name: str, sched, path: str, variant: str, local_tiles):
        """One traced launch of ``variant``; its tiles and the critical rank's ``trace`` row."""
        tiles = traced_run(variants[f"{name}_{variant}"], combine, sched)
        per_rank = run.gather(summarize(tiles, local_tiles, args.samples, args.bins, args.seed))
        r, s = critical(per_rank)
        return tiles, {**cell.base, "kind": "trace", "schedule": name, "path": path,
                       "lead_rows": sched.lead_rows, "rank": r, **s["stats"],
                       "stats_per_rank": [p["stats"] for p in per_rank],
                       "sample": s["sample"], "timeline": s["timeline"]}

    rows = []
    for name, sched in setup.schedules.items():
        local_tiles = None
        if local_control:
            local_tiles, row = trace_row(name, sched, "local", "local", None)
            rows.append(row)
        rows.append(trace_row(name, sched, "remote", "instrumented", local_tiles)[1])
    return rows


def fenced_row(cell: TracedCell, combine: SymmetricCombine, run: Run) -> dict:
    """Step 3: the completion-coupled counterfactual, timed beside the decoupled schedules."""
    args, setup, variants = run.args, cell.setup, cell.variants
    timed = {n: timed_layer(combine, setup, variants[n])
             for n in ("wave", "interleaved", "wave_fenced", "interleaved_fenced")}
    t = time_methods(timed, trials=args.trials, warmup=args.warmup)
    return {**cell.base, "kind": "fenced", "lead_rows": setup.lead,
            **{f"{n}_us": t[n]["median_us"] for n in timed},
            "spreads": {n: {"p25_us": t[n]["p25_us"], "p75_us": t[n]["p75_us"]} for n in timed},
            "trials_us": {n: t[n]["trials_us"] for n in timed}}


def prepare_d_sweep(step: Step, args) -> None:
    """Step 4's launches: Interleaved at each lead of ``sweep_leads``, timing and instrumented."""
    cell = step.cell
    setup = cell.setup
    for d in sweep_leads(setup.knee, args.d_factors):
        sched = interleaved_schedule(setup.problem, setup.programs, d)
        check_schedule(setup.problem, sched)
        step.calls[d] = prepare_fused_moe(setup.layout, cell.weights, sched, setup.peers,
                                              **cell.prep)
        step.traced[d] = (prepare_fused_moe(setup.layout, cell.weights, sched, setup.peers,
                                                instrument=True, **cell.prep), sched)


def check_d_sweep(step: Step, combine: SymmetricCombine) -> list[str]:
    fails = []
    for d, call in step.calls.items():
        if not torch.equal(combine_output(step.cell.setup, combine, call), step.cell.wave_out):
            fails.append(f"interleaved D={d} differs from Expert-Wave")
        if call.error_count():
            fails.append(f"interleaved D={d}: spin errors")
    return fails


def d_sweep_rows(step: Step, combine: SymmetricCombine, run: Run) -> list[dict]:
    """Step 4: every lead beside Expert-Wave, timed together, then one traced launch each."""
    args, cell = run.args, step.cell
    setup, leads = cell.setup, list(step.calls)
    t = time_methods({"wave": timed_layer(combine, setup, setup.calls["wave"]),
                      **{f"D={d}": timed_layer(combine, setup, step.calls[d]) for d in leads}},
                     trials=args.trials, warmup=args.warmup)
    rows = []
    for d in leads:
        tiles = traced_run(step.traced[d][0], combine, step.traced[d][1])
        per_rank = run.gather(moe_trace.run_stats(tiles))
        r = max(range(run.world), key=lambda i: per_rank[i]["tiles_l1"] + per_rank[i]["tiles_l2"])
        rows.append({**cell.base, "kind": "d_sweep", "lead_rows": d, "d_factor": d / setup.knee,
                     "interleaved_us": t[f"D={d}"]["median_us"], "wave_us": t["wave"]["median_us"],
                     "speedup": t["wave"]["median_us"] / t[f"D={d}"]["median_us"],
                     "spreads": {"interleaved": {"p25_us": t[f"D={d}"]["p25_us"],
                                                 "p75_us": t[f"D={d}"]["p75_us"]},
                                 "wave": {"p25_us": t["wave"]["p25_us"],
                                          "p75_us": t["wave"]["p75_us"]}},
                     "rank": r, **per_rank[r], "stats_per_rank": per_rank})
    return rows


def prepare_knee(step: Step) -> None:
    """Step 6's launches at the step's fraction s of K blocks (``ops.moe.fused.synthetic_k_blocks``; a
    synthetic kernel, not the MoE layer): both schedules, and Expert-Wave instrumented with remote
    stores and with the local-store control."""
    cell, s = step.cell, step.point["k_fraction"]
    setup, weights, prep = cell.setup, cell.weights, cell.prep
    step.calls = {name: prepare_fused_moe(setup.layout, weights, sched, setup.peers,
                                              synthetic_k_fraction=s, **prep)
                  for name, sched in setup.schedules.items()}
    sched = setup.schedules["wave"]
    step.traced = {path: prepare_fused_moe(setup.layout, weights, sched, peers,
                                               synthetic_k_fraction=s, instrument=True, **prep)
                   for path, peers in (("remote", setup.peers), ("local", cell.local_peers))}


def check_knee(step: Step, combine: SymmetricCombine) -> list[str]:
    """Expert-Wave and Interleaved bitwise equal, the local-store control equal to the remote
    run, no spin errors."""
    cell, s, calls, traced = step.cell, step.point["k_fraction"], step.calls, step.traced
    slots = cell.setup.rows_view.shape[0]
    out = {n: combine_output(cell.setup, combine, c) for n, c in calls.items()}
    failures = [] if torch.equal(out["wave"], out["interleaved"]) else \
        [f"s={s}: Expert-Wave and Interleaved differ"]
    cell.local.fill_(float("nan"))
    traced["local"]()
    torch.cuda.synchronize()
    failures += check_local_control(cell.local, out["wave"], slots, f"s={s} local")
    if any(c.error_count() for c in (*calls.values(), *traced.values())):
        failures.append(f"s={s}: spin errors")
    return failures


def knee_row(step: Step, combine: SymmetricCombine, run: Run) -> dict:
    """The X-Stage inside the fused kernel at fraction s: Expert-Wave and Interleaved timed side
    by side, and Expert-Wave traced with remote stores and with the local-store control: its
    Linear-2 span T_RS and mainloops (the gap between bursts) against s. A ``knee_sweep`` row."""
    args, cell, s, calls = run.args, step.cell, step.point["k_fraction"], step.calls
    sched = cell.setup.schedules["wave"]

    def fused(call):
        def run_call():
            combine.barrier()
            call()
            combine.barrier()
        return run_call

    t = time_methods({n: fused(c) for n, c in calls.items()}, trials=args.trials,
                     warmup=args.warmup)
    stats = {path: run.gather(moe_trace.run_stats(traced_run(c, combine, sched)))
             for path, c in step.traced.items()}
    r = max(range(run.world), key=lambda i: stats["remote"][i]["tiles_l2"])
    remote, ctrl = stats["remote"][r], stats["local"][r]
    return {**cell.base, "kind": "knee_sweep", "synthetic": True, "k_fraction": s,
            "k_blocks": list(calls["wave"].args[-2:]), "rank": r,
            "wave_us": t["wave"]["median_us"],
            "interleaved_us": t["interleaved"]["median_us"],
            "speedup": t["wave"]["median_us"] / t["interleaved"]["median_us"],
            "spreads": {n: {"p25_us": t[n]["p25_us"], "p75_us": t[n]["p75_us"]} for n in t},
            "span_l2_remote_us": remote["span_l2_us"],
            "span_l2_remote_p75_us": remote["span_l2_p75_us"],
            "span_l2_local_us": ctrl["span_l2_us"],
            "span_l2_local_p25_us": ctrl["span_l2_p25_us"],
            "span_l2_local_p75_us": ctrl["span_l2_p75_us"],
            "mainloop_l1_us": ctrl["mainloop_l1_us"],
            "mainloop_l2_us": ctrl["mainloop_l2_us"],
            "mainloop_l2_remote_us": remote["mainloop_l2_us"],
            "stats_per_rank": stats}


def check_regression(step: Step, combine: SymmetricCombine) -> list[str]:
    """Both schedules of a regressing cell instrumented: bitwise equal to the timing kernel,
    which is bitwise equal under both schedules; no spin errors."""
    setup = step.setup
    failures = []
    plain = {name: combine_output(setup, combine, c) for name, c in setup.calls.items()}
    if not torch.equal(plain["wave"], plain["interleaved"]):
        failures.append("Expert-Wave and Interleaved Combine buffers differ")
    for name, call in step.traced.items():
        if not torch.equal(combine_output(setup, combine, call), plain[name]):
            failures.append(f"instrumented {name} differs from the timing kernel")
    spin = {n: c.error_count() for n, c in [*setup.calls.items(), *step.traced.items()]}
    if any(spin.values()):
        failures.append(f"spin errors {spin}")
    return failures


def regression_row(step: Step, combine: SymmetricCombine, run: Run) -> dict:
    """Step 5: one traced launch of each schedule of a regressing matrix cell (same seeds as
    ``bench``); the component of SM time that grows under Interleaved
    (``moe_trace.regression_cause``) on the critical rank."""
    setup, point = step.setup, step.point
    stats = {name: run.gather(moe_trace.run_stats(traced_run(call, combine, setup.schedules[name])))
             for name, call in step.traced.items()}
    r = max(range(len(stats["wave"])), key=lambda i: stats["wave"][i]["tiles_l1"] + stats["wave"][i]["tiles_l2"])
    cause = moe_trace.regression_cause(stats["wave"][r], stats["interleaved"][r])
    return {"kind": "regression", **{k: point[k] for k in CELL},
            "matrix_speedup": point["matrix_speedup"], "variant": setup.shape.variant,
            "d_knee": setup.knee, "lead_rows": setup.lead, "rank": r, **cause,
            "wave": stats["wave"][r], "interleaved": stats["interleaved"][r],
            "stats_per_rank": stats}


