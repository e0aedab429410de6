"""SPMD mechanism experiments of the fused MoE kernel (paper §5.2.2–5.2.3, issue 8 part 4).

    torchrun --nproc_per_node=2 -m xstage_lab.experiments.moe.trace_bench --out FILE \\
        [--models M1,M2] [--local-models ...] [--d-sweep-models ...] [--precision fp8]
        [--routing skewed] [--tokens 4096]

For every model shape (default: all seven, W8A8, skewed routing, as Table 2), on fresh seeded
inputs (the same seeds as ``bench`` for the same cell):

1. Correctness first, on Combine buffers poisoned with NaN: the timing kernel under both schedules
   (spin errors zero, bitwise-equal buffers, float32 reference within ``bench.TOLERANCE``); the
   instrumented and the fenced variants bitwise equal to it; the local-store control (every peer
   table entry pointed at a local buffer) writing exactly the rows the peers received. Any failure
   on any rank aborts before timing, with no output file.
2. Instrumentation (``INSTRUMENT``): one traced launch (after warm-up launches) per schedule, with
   remote stores and, for ``--local-models``, with the local-store control. Per launch and rank:
   median T_RS, mainloops, dependency waits, the eq. 15 prediction and the measured stall
   (``moe_trace``), the Tensor-Core activity time line (Fig. 9) and a seeded sample of tiles (the
   Fig. 10 distributions); the record keeps the rank with the most tiles (the critical rank).
3. Completion-coupled counterfactual (``FENCE``): Expert-Wave, Interleaved and both fenced, timed
   together (``dist_timing.time_methods``: ratios from one run).
4. D sweep (``--d-sweep-models``): Interleaved at D = ``--d-factors`` x D_knee (clamped >= 1) beside
   Expert-Wave, timed together, each with one traced launch for its dependency-wait (starvation)
   time.

5. Regressions (``--regressions`` moe_bench outputs): every matrix cell with speedup below 1 (the
   worst ``--max-regressions``), both schedules instrumented, with the component of SM time that
   grows under Interleaved (dependency wait, mainloops, epilogues): the measured cause.
6. The knee sweep (``--knee-models``): a SYNTHETIC kernel (``layer.synthetic_k_blocks``: a fraction
   of every mainloop's K blocks, every Combine store kept) per fraction, both schedules checked
   and timed, Expert-Wave traced with remote stores and with the local-store control.

Rank 0 writes one JSON ``{"metadata", "rows"}``; ``rows[i]["kind"]`` is ``trace``, ``fenced``,
``d_sweep``, ``knee_sweep`` or ``regression``. Import it with ``python -m xstage_lab import-bench FILE --experiment moe_trace``.
"""
from __future__ import annotations

import argparse
import json
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from ...checks import relative_error
from ...dist_timing import TIMING_METHOD, all_gather_objects, read_sm_clock_mhz, time_methods
from ...records import read_record
from ..output import write_output
from . import layer as moe, trace as moe_trace
from .bench import (TOLERANCE, abort_on_failures, combine_output, init_expert_parallel,
                        setup_config)
from .schedules import check_schedule, interleaved_schedule, tile_table

DEFAULT_K_FRACTIONS = (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125)
DEFAULT_D_SWEEP = ("DiT-MoE", "Qwen3.5", "DeepSeek-V4-Flash")
DEFAULT_D_FACTORS = (0.25, 0.5, 1, 2, 4, 8)
TRACED_WARMUP = 2  # instrumented launches before the traced one (compile, caches, clocks up)


def parse_args(argv=None) -> argparse.Namespace:
    shapes = moe.load_shapes()
    p = argparse.ArgumentParser(prog="python -m xstage_lab.experiments.moe.trace_bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, type=Path, help="JSON written by rank 0")
    p.add_argument("--models", default=",".join(shapes))
    p.add_argument("--local-models", default=None,
                   help="shapes that also get the local-store control (default: --models)")
    p.add_argument("--d-sweep-models", default=",".join(DEFAULT_D_SWEEP))
    p.add_argument("--d-factors", default=",".join(str(f) for f in DEFAULT_D_FACTORS))
    p.add_argument("--precision", default="fp8", choices=moe.PRECISIONS)
    p.add_argument("--routing", default="skewed", choices=moe.ROUTINGS)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--regressions", type=Path, nargs="+", default=[],
                   help="moe_bench JSON outputs or moe records: trace both schedules of every cell whose "
                        "speedup is below 1 (the worst --max-regressions), for measured causes")
    p.add_argument("--max-regressions", type=int, default=24)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--samples", type=int, default=2000, help="Linear-2 tiles kept per traced launch")
    p.add_argument("--bins", type=int, default=200, help="time bins of the activity time line")
    p.add_argument("--programs", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-spin", type=int, default=moe.DEFAULT_MAX_SPIN_ITERS)
    p.add_argument("--kernel", default=None, choices=moe.KERNELS,
                   help="fused kernel (default: gluon_ws on sm_90 GPUs, triton elsewhere)")
    p.add_argument("--knee-models", default="",
                   help="comma list of shapes for the knee sweep: a SYNTHETIC kernel (gluon_ws) "
                        "that runs a fraction of every mainloop's K blocks and keeps every "
                        "Combine store, never the MoE layer")
    p.add_argument("--k-fractions", default=",".join(str(f) for f in DEFAULT_K_FRACTIONS),
                   help="the knee sweep's fractions of K blocks")
    a = p.parse_args(argv)
    a.models = [m for m in a.models.split(",") if m]
    a.local_models = a.models if a.local_models is None else [m for m in a.local_models.split(",") if m]
    a.d_sweep_models = [m for m in a.d_sweep_models.split(",") if m]
    a.knee_models = [m for m in a.knee_models.split(",") if m]
    try:
        a.d_factors = [float(f) for f in a.d_factors.split(",") if f]
        a.k_fractions = sorted({float(f) for f in a.k_fractions.split(",") if f}, reverse=True)
    except ValueError:
        p.error(f"--d-factors and --k-fractions must list numbers, got {a.d_factors!r}, "
                f"{a.k_fractions!r}")
    if any(not 0 < f <= 1 for f in a.k_fractions):
        p.error("--k-fractions must lie in (0, 1]")
    if a.knee_models and a.kernel == "triton":
        p.error("the knee sweep's synthetic kernel is gluon_ws's")
    for name, given in (("model", a.models), ("local model", a.local_models),
                        ("d-sweep model", a.d_sweep_models), ("knee model", a.knee_models)):
        bad = [g for g in given if g not in shapes]
        if bad:
            p.error(f"unknown {name} {bad}; choose from {list(shapes)}")
    if not a.models or a.tokens < 1 or a.trials < 1 or a.samples < 1 or a.bins < 1 or \
            a.max_spin < 1 or a.warmup < 0 or any(f <= 0 for f in a.d_factors):
        p.error("need models, and positive --tokens, --trials, --samples, --bins, --max-spin, "
                "--d-factors; --warmup >= 0")
    if a.programs is not None and a.programs < 1:
        p.error("--programs must be >= 1")
    if a.max_regressions < 0:
        p.error("--max-regressions must be >= 0")
    a.regression_cells = regression_cells(a.regressions, a.max_regressions, shapes)
    a.lead = None  # setup_config's lead: D_knee
    return a


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


def sweep_leads(knee: int, factors) -> list[int]:
    """D = factor x D_knee, rounded, clamped >= 1, without repeats, in ascending order."""
    return sorted({max(1, round(knee * f)) for f in factors})


def traced_run(call, combine: moe.SymmetricCombine, schedule):
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


def run_model(shape: moe.MoEShape, weights, combine, args, local_buf_elems: int) -> list[dict]:
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    precision, routing, tokens = args.precision, args.routing, args.tokens
    config_seed = args.seed + 1 + zlib.crc32(f"{shape.model}|{precision}|{routing}|{tokens}".encode())
    setup = setup_config(shape, precision, routing, tokens, weights, combine, args, config_seed)
    what = f"{shape.model} {precision} {routing} {tokens}"
    # The schedules were checked by setup_config; the variants launch the same ones.
    prep = dict(config=setup.cfg, max_spin_iters=args.max_spin, verify_schedule=False)
    slots, hidden = tokens * shape.top_k, shape.hidden
    local_buf = torch.empty(local_buf_elems, dtype=torch.bfloat16, device=setup.x.device)
    local = local_buf[: world * slots * hidden].view(world, slots, hidden)
    local_peers = moe.local_store_control(setup.peers, local)
    variants = {}
    for name, sched in setup.schedules.items():
        variants[name] = setup.calls[name]
        variants[f"{name}_instrumented"] = moe.prepare_fused_moe(
            setup.layout, weights, sched, setup.peers, instrument=True, **prep)
        variants[f"{name}_fenced"] = moe.prepare_fused_moe(
            setup.layout, weights, sched, setup.peers, fence=True, **prep)
        variants[f"{name}_local"] = moe.prepare_fused_moe(
            setup.layout, weights, sched, local_peers, instrument=True, **prep)

    # 1. correctness
    out = {n: combine_output(setup, combine, c) for n, c in variants.items() if not n.endswith("_local")}
    failures = []
    for name in setup.schedules:
        for v in ("_instrumented", "_fenced"):
            if not torch.equal(out[name + v], out[name]):
                failures.append(f"{name}{v} differs from the timing kernel")
    if not torch.equal(out["wave"], out["interleaved"]):
        failures.append("Expert-Wave and Interleaved Combine buffers differ")
    ref = moe.reference_moe(setup.x, setup.topk_ids, setup.topk_w, shape, seed=args.seed,
                            precision=precision)
    combined = moe.combine_weighted_sum(out["interleaved"], setup.topk_w)
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
    abort_on_failures(failures, what)

    base = {"model": shape.model, "variant": shape.variant, "precision": precision,
            "routing": routing, "tokens": tokens, "world_size": world, "d_knee": setup.knee,
            "hidden": shape.hidden, "intermediate": shape.intermediate, "top_k": shape.top_k,
            "tile_config": setup.cfg.__dict__,
            "num_programs": setup.programs, "padded_rows": all_gather_objects(setup.layout.num_rows),
            "max_rel_err": max(all_gather_objects(errors), key=lambda e: e["fp32"])}
    rows = []

    # 2. traces: local control first (its floors are the remote runs' cover windows)
    def trace_row(name: str, sched, path: str, variant: str, local_tiles):
        """One traced launch of ``variant``; its tiles and the critical rank's ``trace`` row."""
        tiles = traced_run(variants[f"{name}_{variant}"], combine, sched)
        per_rank = all_gather_objects(summarize(tiles, local_tiles, args.samples, args.bins, args.seed))
        r, s = critical(per_rank)
        return tiles, {**base, "kind": "trace", "schedule": name, "path": path,
                       "lead_rows": sched.lead_rows, "rank": r, **s["stats"],
                       "stats_per_rank": [p["stats"] for p in per_rank],
                       "sample": s["sample"], "timeline": s["timeline"]}

    for name, sched in setup.schedules.items():
        local_tiles = None
        if shape.model in args.local_models:
            local_tiles, row = trace_row(name, sched, "local", "local", None)
            rows.append(row)
        rows.append(trace_row(name, sched, "remote", "instrumented", local_tiles)[1])

    # 3. completion-coupled counterfactual, timed beside the decoupled schedules
    def fused(call):
        def run():
            combine.barrier()
            call()
            combine.barrier()
            moe.combine_weighted_sum(setup.rows_view, setup.topk_w)
        return run

    timed = {n: fused(variants[n]) for n in ("wave", "interleaved", "wave_fenced", "interleaved_fenced")}
    t = time_methods(timed, trials=args.trials, warmup=args.warmup)
    rows.append({**base, "kind": "fenced", "lead_rows": setup.lead,
                 **{f"{n}_us": t[n]["median_us"] for n in timed},
                 "spreads": {n: {"p25_us": t[n]["p25_us"], "p75_us": t[n]["p75_us"]} for n in timed},
                 "trials_us": {n: t[n]["trials_us"] for n in timed},
                 "spin_errors_after_timing": sum(all_gather_objects(
                     sum(variants[n].error_count() for n in timed)))})

    # 4. D sweep around D_knee (eq. 16)
    if shape.model in args.d_sweep_models:
        leads = sweep_leads(setup.knee, args.d_factors)
        calls, traced, fails = {}, {}, []
        for d in leads:
            sched = interleaved_schedule(setup.problem, setup.programs, d)
            check_schedule(setup.problem, sched)
            calls[d] = moe.prepare_fused_moe(setup.layout, weights, sched, setup.peers, **prep)
            traced[d] = (moe.prepare_fused_moe(setup.layout, weights, sched, setup.peers,
                                               instrument=True, **prep), sched)
            if not torch.equal(combine_output(setup, combine, calls[d]), out["wave"]):
                fails.append(f"interleaved D={d} differs from Expert-Wave")
            if calls[d].error_count():
                fails.append(f"interleaved D={d}: spin errors")
        abort_on_failures(fails, f"{what} D sweep")
        t = time_methods({"wave": fused(setup.calls["wave"]),
                          **{f"D={d}": fused(calls[d]) for d in leads}},
                         trials=args.trials, warmup=args.warmup)
        for d in leads:
            tiles = traced_run(traced[d][0], combine, traced[d][1])
            per_rank = all_gather_objects(moe_trace.run_stats(tiles))
            r = max(range(world), key=lambda i: per_rank[i]["tiles_l1"] + per_rank[i]["tiles_l2"])
            rows.append({**base, "kind": "d_sweep", "lead_rows": d, "d_factor": d / setup.knee,
                         "interleaved_us": t[f"D={d}"]["median_us"], "wave_us": t["wave"]["median_us"],
                         "speedup": t["wave"]["median_us"] / t[f"D={d}"]["median_us"],
                         "spreads": {"interleaved": {"p25_us": t[f"D={d}"]["p25_us"],
                                                     "p75_us": t[f"D={d}"]["p75_us"]},
                                     "wave": {"p25_us": t["wave"]["p25_us"],
                                              "p75_us": t["wave"]["p75_us"]}},
                         "rank": r, **per_rank[r], "stats_per_rank": per_rank})
    # 5. the knee sweep: a SYNTHETIC kernel with shorter mainloops, every Combine store kept
    if shape.model in args.knee_models:
        rows += knee_sweep(setup, weights, combine, local, local_peers, base, prep, args, what)
    if rank == 0:
        for row in rows:
            if row["kind"] == "knee_sweep":
                print(f"{shape.model:18s} synthetic s={row['k_fraction']:.3f} T_RS remote "
                      f"{row['span_l2_remote_us']:.2f} local {row['span_l2_local_us']:.2f} us  "
                      f"L2 mainloop {row['mainloop_l2_us']:.2f} us  speedup "
                      f"{row['speedup']:.3f}", flush=True)
            elif row["kind"] == "trace":
                print(f"{shape.model:18s} {row['schedule']:11s} {row['path']:6s} T_RS "
                      f"{row['span_l2_us']:.2f} us  L2 mainloop {row['mainloop_l2_us']:.2f} us  "
                      f"L2 wait {row['wait_l2_median_us']:.2f} us", flush=True)
            elif row["kind"] == "fenced":
                print(f"{shape.model:18s} wave {row['wave_us']:.1f} int {row['interleaved_us']:.1f} "
                      f"wave_fenced {row['wave_fenced_us']:.1f} int_fenced "
                      f"{row['interleaved_fenced_us']:.1f} us", flush=True)
            else:
                print(f"{shape.model:18s} D={row['lead_rows']:3d} speedup {row['speedup']:.3f} "
                      f"L2 wait share {row['wait_l2_share']:.3f}", flush=True)
    return rows


def knee_sweep(setup, weights, combine, local, local_peers, base: dict, prep: dict, args,
               what: str) -> list[dict]:
    """The X-Stage inside the fused kernel: per fraction s of K blocks
    (``layer.synthetic_k_blocks``; a synthetic kernel, not the MoE layer), Expert-Wave and
    Interleaved checked (bitwise equal, the local-store control equal to the remote run, no spin
    errors), timed side by side, and Expert-Wave traced with remote stores and with the local-store
    control: its Linear-2 span T_RS and mainloops (the gap between bursts) against s. Rows
    ``knee_sweep``."""
    import torch.distributed as dist
    world, slots = dist.get_world_size(), setup.rows_view.shape[0]
    rows = []
    for s in args.k_fractions:
        calls = {name: moe.prepare_fused_moe(setup.layout, weights, sched, setup.peers,
                                             synthetic_k_fraction=s, **prep)
                 for name, sched in setup.schedules.items()}
        sched = setup.schedules["wave"]
        traced = {path: moe.prepare_fused_moe(setup.layout, weights, sched, peers,
                                              synthetic_k_fraction=s, instrument=True, **prep)
                  for path, peers in (("remote", setup.peers), ("local", local_peers))}
        out = {n: combine_output(setup, combine, c) for n, c in calls.items()}
        failures = [] if torch.equal(out["wave"], out["interleaved"]) else \
            [f"s={s}: Expert-Wave and Interleaved differ"]
        local.fill_(float("nan"))
        traced["local"]()
        torch.cuda.synchronize()
        failures += check_local_control(local, out["wave"], slots, f"s={s} local")
        if any(c.error_count() for c in (*calls.values(), *traced.values())):
            failures.append(f"s={s}: spin errors")
        abort_on_failures(failures, f"{what} knee sweep (synthetic)")

        def fused(call):
            def run():
                combine.barrier()
                call()
                combine.barrier()
            return run

        t = time_methods({n: fused(c) for n, c in calls.items()}, trials=args.trials,
                         warmup=args.warmup)
        stats = {path: all_gather_objects(moe_trace.run_stats(traced_run(c, combine, sched)))
                 for path, c in traced.items()}
        r = max(range(world), key=lambda i: stats["remote"][i]["tiles_l2"])
        remote, ctrl = stats["remote"][r], stats["local"][r]
        rows.append({**base, "kind": "knee_sweep", "synthetic": True, "k_fraction": s,
                     "k_blocks": list(calls["wave"].args[-2:]), "rank": r,
                     "wave_us": t["wave"]["median_us"],
                     "interleaved_us": t["interleaved"]["median_us"],
                     "speedup": t["wave"]["median_us"] / t["interleaved"]["median_us"],
                     "spreads": {n: {"p25_us": t[n]["p25_us"], "p75_us": t[n]["p75_us"]}
                                 for n in t},
                     "span_l2_remote_us": remote["span_l2_us"],
                     "span_l2_remote_p75_us": remote["span_l2_p75_us"],
                     "span_l2_local_us": ctrl["span_l2_us"],
                     "span_l2_local_p25_us": ctrl["span_l2_p25_us"],
                     "span_l2_local_p75_us": ctrl["span_l2_p75_us"],
                     "mainloop_l1_us": ctrl["mainloop_l1_us"],
                     "mainloop_l2_us": ctrl["mainloop_l2_us"],
                     "mainloop_l2_remote_us": remote["mainloop_l2_us"],
                     "stats_per_rank": stats})
    return rows


def run_regression_cell(cell: dict, shape: moe.MoEShape, weights, combine, args) -> dict:
    """Both schedules of one regressing matrix cell (same seeds as ``bench``), instrumented:
    bitwise equal to the timing kernel first, then one traced launch each; the component of SM
    time that grows under Interleaved (``moe_trace.regression_cause``) on the critical rank."""
    precision, routing, tokens = cell["precision"], cell["routing"], cell["tokens"]
    config_seed = args.seed + 1 + zlib.crc32(f"{shape.model}|{precision}|{routing}|{tokens}".encode())
    setup = setup_config(shape, precision, routing, tokens, weights, combine, args, config_seed)
    prep = dict(config=setup.cfg, max_spin_iters=args.max_spin, verify_schedule=False)
    traced = {name: moe.prepare_fused_moe(setup.layout, weights, sched, setup.peers,
                                          instrument=True, **prep)
              for name, sched in setup.schedules.items()}
    failures = []
    plain = {name: combine_output(setup, combine, c) for name, c in setup.calls.items()}
    if not torch.equal(plain["wave"], plain["interleaved"]):
        failures.append("Expert-Wave and Interleaved Combine buffers differ")
    for name, call in traced.items():
        if not torch.equal(combine_output(setup, combine, call), plain[name]):
            failures.append(f"instrumented {name} differs from the timing kernel")
    spin = {n: c.error_count() for n, c in [*setup.calls.items(), *traced.items()]}
    if any(spin.values()):
        failures.append(f"spin errors {spin}")
    abort_on_failures(failures, f"{shape.model} {precision} {routing} {tokens} (regression)")
    stats = {name: all_gather_objects(moe_trace.run_stats(traced_run(call, combine, setup.schedules[name])))
             for name, call in traced.items()}
    r = max(range(len(stats["wave"])), key=lambda i: stats["wave"][i]["tiles_l1"] + stats["wave"][i]["tiles_l2"])
    cause = moe_trace.regression_cause(stats["wave"][r], stats["interleaved"][r])
    return {"kind": "regression", **{k: v for k, v in cell.items() if k != "speedup"},
            "matrix_speedup": cell["speedup"], "variant": shape.variant,
            "d_knee": setup.knee, "lead_rows": setup.lead, "rank": r, **cause,
            "wave": stats["wave"][r], "interleaved": stats["interleaved"][r],
            "stats_per_rank": stats}


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


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch.distributed as dist
    local_rank, rank, world, shapes = init_expert_parallel(args.models)
    per_call = max([args.tokens * shapes[m].top_k * shapes[m].hidden for m in args.models] +
                   [c["tokens"] * shapes[c["model"]].top_k * shapes[c["model"]].hidden
                    for c in args.regression_cells])
    combine = moe.SymmetricCombine(per_call)
    clocks_start = all_gather_objects(read_sm_clock_mhz())
    started = time.time()
    rows = []
    for model in args.models:
        weights = moe.local_expert_weights(shapes[model], rank, world, args.precision,
                                           seed=args.seed, device=torch.device("cuda", local_rank))
        rows += run_model(shapes[model], weights, combine, args, world * per_call)
        del weights
        torch.cuda.empty_cache()
    by_weights: dict[tuple, list] = {}
    for cell in args.regression_cells:
        by_weights.setdefault((cell["model"], cell["precision"]), []).append(cell)
    for (model, precision), cells in by_weights.items():
        weights = moe.local_expert_weights(shapes[model], rank, world, precision, seed=args.seed,
                                           device=torch.device("cuda", local_rank))
        for cell in cells:
            row = run_regression_cell(cell, shapes[model], weights, combine, args)
            rows.append(row)
            if rank == 0:
                print(f"regression {model:18s} {precision} {cell['routing']:8s} {cell['tokens']:5d} "
                      f"speedup {cell['speedup']:.3f}: {row['cause']} "
                      f"{max(row['delta_per_sm_us'].values()):+.1f} us/SM", flush=True)
        del weights
        torch.cuda.empty_cache()
    clocks_end = all_gather_objects(read_sm_clock_mhz())
    if rank == 0:
        from ...platform import provenance
        meta = {
            "experiment": "moe_trace", "paper": "§5.2.2 (Fig. 9), §5.2.3 (Fig. 10, Table 2, eq. 15), "
                                                "§4.2 (eq. 16 D sweep); issue 8 part 4 (fenced)",
            "world_size": world, "precision": args.precision, "routing": args.routing,
            "tokens_per_rank": args.tokens, "trials": args.trials, "warmup": args.warmup,
            "traced_warmup_launches": TRACED_WARMUP, "samples": args.samples, "bins": args.bins,
            "local_models": args.local_models, "d_sweep_models": args.d_sweep_models,
            "d_factors": args.d_factors, "seed": args.seed, "max_spin_iters": args.max_spin,
            "knee_models": args.knee_models, "k_fractions": args.k_fractions,
            "knee_sweep": "SYNTHETIC kernel: each mainloop runs ceil(s x its K blocks), every "
                          "Combine store kept (moe.synthetic_k_blocks); not the MoE layer",
            "regression_sources": [str(p) for p in args.regressions],
            "max_regressions": args.max_regressions,
            "tolerance": TOLERANCE,
            "definitions": moe_trace.__doc__,
            "fenced": "each Linear-2 tile: CTA barrier, atomic add 0 with sem=release scope=sys "
                      "(fence.acq_rel.sys), CTA barrier, after its Combine stores",
            "timing": TIMING_METHOD,
            "sm_clock_mhz_start": clocks_start, "sm_clock_mhz_end": clocks_end,
            "wall_s": time.time() - started, "provenance": provenance(),
        }
        write_output(args.out, meta, rows, default=_plain)
        print(f"wrote {args.out} ({len(rows)} rows, {args.out.stat().st_size / 2**20:.1f} MiB, "
              f"{time.time() - started:.0f} s)")
    dist.barrier(device_ids=[local_rank])
    dist.destroy_process_group()


def _plain(v):
    return v.item() if hasattr(v, "item") else str(v)


if __name__ == "__main__":
    main()
