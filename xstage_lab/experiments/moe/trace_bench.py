"""SPMD mechanism experiments of the fused MoE kernel (paper §5.2.2–5.2.3, issue 8 part 4).

    torchrun --nproc_per_node=2 -m xstage_lab.experiments.moe.trace_bench (--out FILE | --root DIR) \\
        [--models M1,M2] [--local-models ...] [--d-sweep-models ...] [--knee-models ...]
        [--precision fp8] [--routing skewed] [--tokens 4096] [--regressions FILE ...] [--chunk I/N]

An ``Experiment`` run by ``experiments.harness``: its one ``Sweep`` walks steps, the dict values of
one axis ``step`` (``trace_steps``): per model of ``--models`` its traced cell's ``trace`` and
``fenced`` steps, ``d_sweep`` and one ``knee_sweep`` step per fraction where asked, then one
``regression`` step per regressing cell. A step's ``kind`` is its rows' ``kind``. A model's expert
weights are made once for its consecutive steps (``Run.resource``), and so is its traced cell.

For every model shape (default: all seven, W8A8, skewed routing, as Table 2), on fresh seeded
inputs (the same seeds as ``bench`` for the same cell):

1. Correctness first, on Combine buffers poisoned with NaN, before the first step of a model is
   timed: the timing kernel under both schedules (spin errors zero, bitwise-equal buffers, float32
   reference within ``bench.TOLERANCE``); the instrumented and the fenced variants bitwise equal to
   it; the local-store control (every peer table entry pointed at a local buffer) writing exactly
   the rows the peers received. Each D sweep, knee-sweep fraction and regression cell checks its
   own launches likewise before it is timed, and every step checks them all again after its runs
   (the spin-error flags count every run since a launch was prepared). Any failure on any rank
   aborts the run with no output.
2. Instrumentation (``INSTRUMENT``, step ``trace``): one traced launch (after warm-up launches) per
   schedule, with remote stores and, for ``--local-models``, with the local-store control (traced
   first: its floors are the remote runs' cover windows). Per launch and rank: median T_RS,
   mainloops, dependency waits, the eq. 15 prediction and the measured stall (``moe_trace``), the
   Tensor-Core activity time line (Fig. 9) and a seeded sample of tiles (the Fig. 10
   distributions); the record keeps the rank with the most tiles (the critical rank).
3. Completion-coupled counterfactual (``FENCE``, step ``fenced``): Expert-Wave, Interleaved and
   both fenced, timed together (``dist_timing.time_methods``: ratios from one run).
4. D sweep (``--d-sweep-models``): Interleaved at D = ``--d-factors`` x D_knee (clamped >= 1) beside
   Expert-Wave, timed together, each with one traced launch for its dependency-wait (starvation)
   time.
5. Regressions (``--regressions`` moe_bench outputs): every matrix cell with speedup below 1 (the
   worst ``--max-regressions``), both schedules instrumented, with the component of SM time that
   grows under Interleaved (dependency wait, mainloops, epilogues): the measured cause.
6. The knee sweep (``--knee-models``): a SYNTHETIC kernel (``ops.moe.fused.synthetic_k_blocks``: a fraction
   of every mainloop's K blocks, every Combine store kept) per fraction, both schedules checked
   and timed, Expert-Wave traced with remote stores and with the local-store control.

Rows: ``kind`` is ``trace``, ``fenced``, ``d_sweep``, ``knee_sweep`` or ``regression``. A ``--out``
JSON imports with ``python -m xstage_lab import-bench FILE --experiment moe_trace``.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...checks import relative_error
from ...dist_timing import TIMING_METHOD, time_methods
from ...ops.moe.combine import (CombinePeers, SymmetricCombine, combine_weighted_sum,
                                local_store_control)
from ...ops.moe.fused import prepare_fused_moe
from ...ops.moe.reference import reference_moe
from ...ops.moe.schedules import check_schedule, interleaved_schedule, tile_table
from ...ops.moe.shapes import MoEShape, PRECISIONS, ROUTINGS, load_shapes
from ...ops.moe.weights import ExpertWeights, local_expert_weights
from ...loading import read as read_record
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment, Run
from ...analysis.moe import trace as moe_trace
from .bench import (TOLERANCE, ConfigSetup, add_layer_arguments, cell_seed, check_layer_args,
                    combine_output, setup_config, start_expert_parallel)

DEFAULT_K_FRACTIONS = (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125)
DEFAULT_D_SWEEP = ("DiT-MoE", "Qwen3.5", "DeepSeek-V4-Flash")
DEFAULT_D_FACTORS = (0.25, 0.5, 1, 2, 4, 8)
TRACED_WARMUP = 2  # instrumented launches before the traced one (compile, caches, clocks up)
CELL = ("model", "precision", "routing", "tokens")


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def regression_cells(paths, limit: int, shapes) -> list[dict]:
    """The cells of ``bench`` outputs (its JSON, or the ``moe`` record made from it) with
    speedup (wave / interleaved) below 1, worst first, at most ``limit``: {model, precision,
    routing, tokens, speedup}."""
    cells = []
    for path in map(Path, paths):
        rows = (read_record(path).table.to_dict("records") if path.suffix == ".parquet"
                else json.loads(path.read_text())["rows"])
        for row in rows:
            if row["speedup"] < 1 and row["model"] in shapes:
                cells.append({k: row[k] for k in ("model", "precision", "routing", "tokens", "speedup")})
    return sorted(cells, key=lambda c: c["speedup"])[:limit]


def trace_steps(args) -> list[dict]:
    """Every step in run order: per model its traced cell's ``trace``, ``fenced``, ``d_sweep``
    (``--d-sweep-models``) and per fraction ``knee_sweep`` (``--knee-models``) steps; then the
    ``regression`` cells, grouped by their weights (model, precision), worst first within a
    group."""
    steps = []
    for m in args.models:
        cell = {"model": m, "precision": args.precision, "routing": args.routing,
                "tokens": args.tokens}
        kinds = ["trace", "fenced"] + (["d_sweep"] if m in args.d_sweep_models else [])
        steps += [{"kind": k, **cell} for k in kinds]
        if m in args.knee_models:
            steps += [{"kind": "knee_sweep", **cell, "k_fraction": s} for s in args.k_fractions]
    by_weights: dict[tuple, list] = {}
    for c in args.regression_cells:
        by_weights.setdefault((c["model"], c["precision"]), []).append(c)
    steps += [{"kind": "regression", **{k: c[k] for k in CELL}, "matrix_speedup": c["speedup"]}
              for cells in by_weights.values() for c in cells]
    return steps


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


@dataclass
class ModelWeights:
    """A model's expert weights on this rank in one precision, and its traced cell once a step
    has asked for it."""

    weights: ExpertWeights
    traced: TracedCell | None = None


def progress(row: dict) -> str:
    """The line rank 0 prints for one row."""
    if row["kind"] == "knee_sweep":
        return (f"{row['model']:18s} synthetic s={row['k_fraction']:.3f} T_RS remote "
                f"{row['span_l2_remote_us']:.2f} local {row['span_l2_local_us']:.2f} us  "
                f"L2 mainloop {row['mainloop_l2_us']:.2f} us  speedup {row['speedup']:.3f}")
    if row["kind"] == "trace":
        return (f"{row['model']:18s} {row['schedule']:11s} {row['path']:6s} T_RS "
                f"{row['span_l2_us']:.2f} us  L2 mainloop {row['mainloop_l2_us']:.2f} us  "
                f"L2 wait {row['wait_l2_median_us']:.2f} us")
    if row["kind"] == "fenced":
        return (f"{row['model']:18s} wave {row['wave_us']:.1f} int {row['interleaved_us']:.1f} "
                f"wave_fenced {row['wave_fenced_us']:.1f} int_fenced "
                f"{row['interleaved_fenced_us']:.1f} us")
    if row["kind"] == "regression":
        return (f"regression {row['model']:18s} {row['precision']} {row['routing']:8s} "
                f"{row['tokens']:5d} speedup {row['matrix_speedup']:.3f}: {row['cause']} "
                f"{max(row['delta_per_sm_us'].values()):+.1f} us/SM")
    return (f"{row['model']:18s} D={row['lead_rows']:3d} speedup {row['speedup']:.3f} "
            f"L2 wait share {row['wait_l2_share']:.3f}")


class MoETrace(Experiment):
    """The fused MoE kernel traced, its completion-coupled counterfactual, the D and knee sweeps
    and the regressing cells' causes (§5.2.2–5.2.3, issue 8 part 4)."""

    name = "moe_trace"
    in_measure_all = True
    paper = ("§5.2.2 (Fig. 9), §5.2.3 (Fig. 10, Table 2, eq. 15), §4.2 (eq. 16 D sweep); "
             "issue 8 part 4 (fenced)")

    def measure_all_args(self, written, root) -> list[str]:
        """The MoE record whose regressing cells it explains: the one this run wrote, else the
        latest of this platform under ``root`` (none: no regression traces)."""
        from ...loading import record_paths
        from ...platform import platform_name

        moe = written.get("moe") or next(reversed(record_paths("moe", platform_name(), root)),
                                         None)
        return ["--regressions", str(moe)] if moe else []

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        shapes = load_shapes()
        p.add_argument("--models", default=",".join(shapes))
        p.add_argument("--local-models", default=None,
                       help="shapes that also get the local-store control (default: --models)")
        p.add_argument("--d-sweep-models", default=",".join(DEFAULT_D_SWEEP))
        p.add_argument("--d-factors", default=",".join(str(f) for f in DEFAULT_D_FACTORS))
        p.add_argument("--precision", default="fp8", choices=PRECISIONS)
        p.add_argument("--routing", default="skewed", choices=ROUTINGS)
        p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
        p.add_argument("--regressions", type=Path, nargs="+", default=[],
                       help="moe_bench JSON outputs or moe records: trace both schedules of every "
                            "cell whose speedup is below 1 (the worst --max-regressions), for "
                            "measured causes")
        p.add_argument("--max-regressions", type=int, default=24)
        p.add_argument("--samples", type=int, default=2000,
                       help="Linear-2 tiles kept per traced launch")
        p.add_argument("--bins", type=int, default=200, help="time bins of the activity time line")
        p.add_argument("--knee-models", default="",
                       help="comma list of shapes for the knee sweep: a SYNTHETIC kernel "
                            "(gluon_ws) that runs a fraction of every mainloop's K blocks and "
                            "keeps every Combine store, never the MoE layer")
        p.add_argument("--k-fractions", default=",".join(str(f) for f in DEFAULT_K_FRACTIONS),
                       help="the knee sweep's fractions of K blocks")
        add_layer_arguments(p)

    def check_args(self, a: argparse.Namespace) -> None:
        shapes = load_shapes()
        a.models = _names(a.models)
        a.local_models = a.models if a.local_models is None else _names(a.local_models)
        a.d_sweep_models, a.knee_models = _names(a.d_sweep_models), _names(a.knee_models)
        try:
            a.d_factors = [float(f) for f in a.d_factors.split(",") if f]
            a.k_fractions = sorted({float(f) for f in a.k_fractions.split(",") if f}, reverse=True)
        except ValueError:
            raise ValueError(f"--d-factors and --k-fractions must list numbers, got "
                             f"{a.d_factors!r}, {a.k_fractions!r}") from None
        if any(not 0 < f <= 1 for f in a.k_fractions):
            raise ValueError("--k-fractions must lie in (0, 1]")
        if a.knee_models and a.kernel == "triton":
            raise ValueError("the knee sweep's synthetic kernel is gluon_ws's")
        check_layer_args(a, "models")
        for name, given in (("local model", a.local_models), ("d-sweep model", a.d_sweep_models),
                            ("knee model", a.knee_models)):
            bad = [g for g in given if g not in shapes]
            if bad:
                raise ValueError(f"unknown {name} {bad}; choose from {list(shapes)}")
        if a.tokens < 1 or a.samples < 1 or a.bins < 1 or any(f <= 0 for f in a.d_factors):
            raise ValueError("need positive --tokens, --samples, --bins, --d-factors")
        if a.max_regressions < 0:
            raise ValueError("--max-regressions must be >= 0")
        a.regression_cells = regression_cells(a.regressions, a.max_regressions, shapes)

    def sweeps(self, args) -> list[Sweep]:
        return [Sweep("moe_trace", (Axis("step", trace_steps(args)),), repeats=1, warmup=0)]

    def start(self, run: Run) -> None:
        """Every model's experts split over the ranks; one symmetric Combine buffer for the
        largest cell."""
        args = run.args
        cells = [{"model": m, "tokens": args.tokens} for m in args.models] + args.regression_cells
        self.shapes = start_expert_parallel(list(dict.fromkeys(c["model"] for c in cells)))
        self.combine = SymmetricCombine(max(
            c["tokens"] * self.shapes[c["model"]].top_k * self.shapes[c["model"]].hidden
            for c in cells))

    def prepare(self, point: dict, run: Run) -> Step:
        """The step's launches on its cell's fresh seeded inputs; the model's weights (made once
        for its consecutive steps) and traced cell (made once for its steps)."""
        args, shape, precision = run.args, self.shapes[point["model"]], point["precision"]
        seed = cell_seed(args.seed, *(point[k] for k in CELL))

        def make_weights():
            return ModelWeights(local_expert_weights(
                shape, run.rank, run.world, precision, seed=args.seed,
                device=torch.device("cuda", run.local_rank)))

        model = run.resource((shape.model, precision), make_weights)
        if point["kind"] == "regression":
            setup = setup_config(shape, precision, point["routing"], point["tokens"],
                                 model.weights, self.combine, args, seed)
            prep = dict(config=setup.cfg, max_spin_iters=args.max_spin, verify_schedule=False)
            return Step(point, setup=setup, traced={
                name: prepare_fused_moe(setup.layout, model.weights, sched, setup.peers,
                                            instrument=True, **prep)
                for name, sched in setup.schedules.items()})
        if model.traced is None:
            model.traced = traced_cell(shape, model.weights, self.combine, args, run.world, seed)
        step = Step(point, cell=model.traced, setup=model.traced.setup)
        if point["kind"] == "d_sweep":
            prepare_d_sweep(step, args)
        elif point["kind"] == "knee_sweep":
            prepare_knee(step)
        return step

    def check(self, step: Step, run: Run) -> list[str]:
        """The traced cell's check before its model's first step is timed (step 1 of the module
        docstring), then the step's own launches'."""
        return self._check(step, run, cell=step.cell is not None and step.cell.base is None)

    def recheck(self, step: Step, run: Run) -> list[str]:
        """After the step's runs: the traced cell's check again (each launch's spin-error flag
        counts every run since it was prepared), then the step's own launches'."""
        return self._check(step, run, cell=step.cell is not None)

    def _check(self, step: Step, run: Run, cell: bool) -> list[str]:
        kind = step.point["kind"]
        if kind == "regression":
            return check_regression(step, self.combine)
        failures = check_traced_cell(step.cell, self.combine, run) if cell else []
        if kind == "d_sweep":
            failures += check_d_sweep(step, self.combine)
        elif kind == "knee_sweep":
            failures += check_knee(step, self.combine)
        return failures

    def measure(self, step: Step, run: Run) -> list[dict]:
        kind = step.point["kind"]
        if kind == "trace":
            return trace_rows(step.cell, self.combine, run,
                              step.point["model"] in run.args.local_models)
        if kind == "fenced":
            return [fenced_row(step.cell, self.combine, run)]
        if kind == "d_sweep":
            return d_sweep_rows(step, self.combine, run)
        if kind == "knee_sweep":
            return [knee_row(step, self.combine, run)]
        return [regression_row(step, self.combine, run)]

    def progress_line(self, rows) -> str:
        return "\n".join(progress(row) for row in rows.to_dict("records"))

    def metadata(self, run: Run) -> dict:
        args = run.args
        return {
            "precision": args.precision, "routing": args.routing,
            "tokens_per_rank": args.tokens, "trials": args.trials, "warmup": args.warmup,
            "traced_warmup_launches": TRACED_WARMUP, "samples": args.samples, "bins": args.bins,
            "local_models": args.local_models, "d_sweep_models": args.d_sweep_models,
            "d_factors": args.d_factors, "seed": args.seed, "max_spin_iters": args.max_spin,
            "lead_rows": "d_knee (eq. 16)" if args.lead is None else args.lead,
            "knee_models": args.knee_models, "k_fractions": args.k_fractions,
            "knee_sweep": "SYNTHETIC kernel: each mainloop runs ceil(s x its K blocks), every "
                          "Combine store kept (synthetic_k_blocks); not the MoE layer",
            "regression_sources": [str(p) for p in args.regressions],
            "max_regressions": args.max_regressions,
            "tolerance": TOLERANCE,
            "definitions": moe_trace.__doc__,
            "fenced": "each Linear-2 tile: CTA barrier, atomic add 0 with sem=release scope=sys "
                      "(fence.acq_rel.sys), CTA barrier, after its Combine stores",
            "timing": TIMING_METHOD,
        }


EXPERIMENT = MoETrace()


if __name__ == "__main__":
    harness.main(EXPERIMENT)
