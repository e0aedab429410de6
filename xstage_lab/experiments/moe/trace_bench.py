"""SPMD mechanism experiments of the fused MoE kernel (paper §5.2.2–5.2.3, issue 8 part 4).

    torchrun --nproc_per_node=2 -m xstage_lab.experiments.moe.trace_bench (--out FILE | --root DIR) \\
        [--models M1,M2] [--local-models ...] [--d-sweep-models ...] [--knee-models ...]
        [--precision fp8] [--routing skewed] [--tokens 4096] [--regressions FILE ...] [--chunk I/N]

An ``Experiment`` run by ``experiments.harness``: its one ``Sweep`` walks steps, the dict values of
one axis ``step`` (``trace_steps``): per model of ``--models`` its traced cell's ``trace`` and
``fenced`` steps, ``d_sweep`` and one ``knee_sweep`` step per fraction where asked, then one
``regression`` step per regressing cell. A step's ``kind`` is its rows' ``kind``. A model's expert
weights are made once for its consecutive steps (``Run.resource``), and so is its traced cell.
The steps themselves (prepare, check, rows) are ``trace_steps``'s.

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
from dataclasses import dataclass
from pathlib import Path

import torch

from ...cli import list_option
from ...dist_timing import TIMING_METHOD
from ...ops.moe.combine import SymmetricCombine
from ...ops.moe.fused import prepare_fused_moe
from ...ops.moe.shapes import PRECISIONS, ROUTINGS, load_shapes
from ...ops.moe.weights import ExpertWeights, local_expert_weights
from ...loading import read as read_record
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment, Run
from ...analysis.moe import trace as moe_trace
from .bench import (TOLERANCE, add_layer_arguments, cell_seed, check_layer_args, setup_config,
                    start_expert_parallel)
from .trace_steps import (CELL, TRACED_WARMUP, Step, TracedCell, check_d_sweep, check_knee,
                          check_regression, check_traced_cell, d_sweep_rows, fenced_row, knee_row,
                          prepare_d_sweep, prepare_knee, regression_row, trace_rows, traced_cell)

DEFAULT_K_FRACTIONS = (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125)
DEFAULT_D_SWEEP = ("DiT-MoE", "Qwen3.5", "DeepSeek-V4-Flash")
DEFAULT_D_FACTORS = (0.25, 0.5, 1, 2, 4, 8)


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
        p.add_argument("--models", **list_option(default=list(shapes)))
        p.add_argument("--local-models", **list_option(
            default=None, nargs="*",
            help="shapes that also get the local-store control (default: --models)"))
        p.add_argument("--d-sweep-models", **list_option(default=list(DEFAULT_D_SWEEP), nargs="*",
                                                         help="none: no D sweep"))
        p.add_argument("--d-factors", **list_option(float, default=[float(f) for f in
                                                                    DEFAULT_D_FACTORS]))
        p.add_argument("--precision", default="fp8", choices=PRECISIONS)
        p.add_argument("--routing", default="skewed", choices=ROUTINGS)
        p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
        p.add_argument("--regressions", **list_option(
            Path, default=[], help="moe_bench JSON outputs or moe records: trace both schedules "
                                   "of every cell whose speedup is below 1 (the worst "
                                   "--max-regressions), for measured causes"))
        p.add_argument("--max-regressions", type=int, default=24)
        p.add_argument("--samples", type=int, default=2000,
                       help="Linear-2 tiles kept per traced launch")
        p.add_argument("--bins", type=int, default=200, help="time bins of the activity time line")
        p.add_argument("--knee-models", **list_option(
            default=[], nargs="*",
            help="shapes for the knee sweep: a SYNTHETIC kernel (gluon_ws) that runs a fraction of "
                 "every mainloop's K blocks and keeps every Combine store, never the MoE layer"))
        p.add_argument("--k-fractions", **list_option(float, default=list(DEFAULT_K_FRACTIONS),
                                                      help="the knee sweep's fractions of K blocks"))
        add_layer_arguments(p)

    def check_args(self, a: argparse.Namespace) -> None:
        shapes = load_shapes()
        a.local_models = a.models if a.local_models is None else a.local_models
        a.k_fractions = sorted(set(a.k_fractions), reverse=True)
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
