"""Single-GPU benchmark of the fused MoE kernel against cuBLAS and the unfused path (issue 18,
items 2-4; paper §4.2, §5.2).

    python -m xstage_lab.experiments.moe.kernel_bench (--out FILE.json | --root DIR)
        [--models M ...] [--precisions bf16 fp8] [--routing balanced skewed]
        [--tokens 4096 8192] [--kernel gluon_ws|triton] [--trials N] [--smoke] [--chunk I/N]
    python -m xstage_lab.experiments.moe.kernel_bench merge OUT.json IN.json [IN.json ...]

An ``Experiment`` run by ``experiments.harness`` in this process (``launch = "in_process"``: one
GPU, no process group, so ``dist_timing.time_methods`` times it as one process; ``launch.ONE_GPU``
starts it under torchrun with one process, which it ignores). Its one ``Sweep``
(``kernel_sweep``): model x precision x cell, a cell being each (routing, tokens) and then the
one-token call; a model's weights in a precision are made once for its cells.
The workload, its cell and the check are ``kernel_cell``'s; the timing and the rows
``kernel_rows``'s.

The workload is one rank of the paper's eight-GPU setting (EP = 8) on one GPU: rank 0's E/8 local
experts (experts 0 .. E/8 - 1) and every row that the eight source ranks route to them (T tokens
per source rank; source r's router is ``router_logits(..., rank=r)`` + ``router_topk``), laid out
as Dispatch lays them out (``build_layout``: source by source, expert by expert, each expert
padded to ``block_m`` rows). The Combine destinations are eight local bf16 ``[T * top_k, hidden]``
buffers standing for the eight source ranks (``local_combine_peers``), so every Combine store
is local: this measures the kernel's compute, not NVLink.

Per cell (model, precision, routing, tokens), on fresh seeded activations:

1. Correctness first. Expert-Wave and Interleaved (lead D_knee, eq. 16) each run once into Combine
   buffers poisoned with NaN: spin errors zero, both sets of buffers bitwise identical, no slot
   written that no routed row names, the error over all rows within ``moe_bench.TOLERANCE`` of
   the float32 reference (every row within ``ROW_TOLERANCE_FACTOR`` times it) computed per
   expert on the GPU from the bf16 master weights (``expert_rows_reference``; in FP8 also of
   the quantization-matched one). The unfused path
   likewise, against the float32 reference. Any failure aborts the run with a non-zero exit
   before timing and writes nothing.
2. Timing (``dist_timing.time_methods`` in one process: CUDA events, warm-up, median and p25/p75
   over trials, method order rotated per trial, the SM clock read during every trial), the
   methods of ``TIMED`` together. Then the fixed per-call cost: a one-token call (T = 1 on every
   source rank) per model and precision, the kernel alone and the whole call.
3. After a cell's timing (and its one-token call's), step 1 again (the harness's ``recheck``): the
   spin-error flags count every launch since the cell was prepared, so a spin timeout in any
   timed run, or outputs the timed runs left wrong, abort the run and write nothing.

TF/s of every method: ``moe_flops`` of the real routed rows (``*_tflops``) and of the padded rows
the kernel computes (``*_tflops_padded``). ``ratio_to_cublas`` is cuBLAS's time over the kernel's
(Expert-Wave) for the same padded rows: the ratio of their TF/s on either count.

Output: one row per cell; the one-token calls' rows sit in the header (``call_overhead``), so
that a ``--out`` JSON imported with ``python -m xstage_lab import-bench FILE --experiment
moe_kernel``, or a ``--root`` record, keeps them in the record's header. ``kernel_view.kernel_summary``
the rows and that header into the ``moe_kernel`` entry of ``summary --json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import pandas as pd
import torch

from ...cli import list_option
from ...dist_timing import TIMING_METHOD
from ...records import read_output
from ...ops.moe.fused import DEFAULT_MAX_SPIN_ITERS
from ...ops.moe.routing import HOT_EXPERT_FRACTION, HOT_LOGIT_BIAS
from ...ops.moe.shapes import PRECISIONS, ROUTINGS, load_shapes
from ...ops.moe.tiles import KERNELS, default_tile_config, kernel_device
from ...ops.moe.unfused import (GroupedWeights, UNFUSED_FP8_RECIPE, UNFUSED_IMPL,
                                unfused_expert_weights)
from ...ops.moe.weights import local_expert_weights
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment, Run
from ...analysis.moe.kernel_view import KernelView, latest_view
from .bench import TOLERANCE
from .kernel_cell import EP, RANK, check_cell, check_cells
from .kernel_rows import (DENSE_CEILING, EAGER, FLOPS, TIMED, KernelStep, cell_row, overhead_row,
                          prepare_step)

DEFAULT_TOKENS = (4096, 8192)  # per source rank
DEFAULT_TRIALS = 20
SMOKE = {"models": ["DeepSeek-V4-Flash"], "precisions": ["bf16", "fp8"], "routing": ["balanced"],
         "tokens": [512], "trials": 5}
OVERHEAD_TOKENS = 1
OVERHEAD_ROUTING = "balanced"


# ---------------------------------------------------------------------------------- the sweep

def kernel_sweep(args) -> Sweep:
    """Model x precision x cell: each (routing, tokens) of the options (``kind`` ``cell``), then
    the one-token call (``call_overhead``); one pass (each cell's repeats are its timing trials).
    Model and precision outermost: their weights are made once for their cells."""
    cells = [{"kind": "cell", "routing": r, "tokens": t} for r in args.routing for t in args.tokens]
    one_token = {"kind": "call_overhead", "routing": OVERHEAD_ROUTING, "tokens": OVERHEAD_TOKENS}
    return Sweep("moe_kernel", (Axis("model", args.models), Axis("precision", args.precisions),
                                Axis("cell", [*cells, one_token])), repeats=1, warmup=0)


# ------------------------------------------------------------------------------ the experiment

class MoEKernel(Experiment):
    """The fused MoE kernel on one GPU against cuBLAS and the unfused path (issue 18)."""

    name = "moe_kernel"
    in_measure_all = True
    paper = "§4.2, §5.2; issue 18 items 2-4; timing §5.1"
    launch = "in_process"
    links = ("local",)  # one GPU, its own memory

    def __init__(self, device=None):
        self.device = device  # None: this process's CUDA GPU, checked to run --kernel

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        shapes = load_shapes()
        p.add_argument("--models", **list_option(help=f"default: all of {list(shapes)}"))
        p.add_argument("--precisions", **list_option(help=f"default: {list(PRECISIONS)}"))
        p.add_argument("--routing", **list_option(help=f"default: {list(ROUTINGS)}"))
        p.add_argument("--tokens", **list_option(
            int, help=f"tokens per source rank (default: {list(DEFAULT_TOKENS)})"))
        p.add_argument("--kernel", default="gluon_ws",
                       help=f"fused kernel, one of {list(KERNELS)}")
        p.add_argument("--trials", type=int, default=None,
                       help=f"default {DEFAULT_TRIALS} ({SMOKE['trials']} with --smoke)")
        p.add_argument("--warmup", type=int, default=3)
        p.add_argument("--graph-iters", type=int, default=10,
                       help="calls per CUDA-graph replay (and per eager trial)")
        p.add_argument("--programs", type=int, default=None,
                       help="persistent programs (default: SMs)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--max-spin", type=int, default=DEFAULT_MAX_SPIN_ITERS)
        p.add_argument("--no-trace", dest="trace", action="store_false",
                       help="skip the instrumented launches that give per-tile mainloop times and "
                            "the gap between Linear-2 bursts")
        p.add_argument("--smoke", action="store_true",
                       help="two small cells (DeepSeek-V4-Flash, bf16 and fp8, 512 tokens per "
                            "source), few trials: a first check on the GPU")

    def check_args(self, a: argparse.Namespace) -> None:
        """Options, checked before any CUDA work; ``--smoke`` fixes the cells (``SMOKE``)."""
        shapes = load_shapes()
        if a.smoke:
            given = [f"--{k}" for k in ("models", "precisions", "routing", "tokens")
                     if getattr(a, k) is not None]
            if given:
                raise ValueError(f"--smoke fixes the cells; drop {' '.join(given)}")
            a.models, a.precisions = SMOKE["models"], SMOKE["precisions"]
            a.routing, a.tokens = SMOKE["routing"], SMOKE["tokens"]
        a.models = list(shapes) if a.models is None else a.models
        a.precisions = list(PRECISIONS) if a.precisions is None else a.precisions
        a.routing = list(ROUTINGS) if a.routing is None else a.routing
        a.tokens = list(DEFAULT_TOKENS) if a.tokens is None else a.tokens
        a.trials = (SMOKE["trials"] if a.smoke else DEFAULT_TRIALS) if a.trials is None else a.trials
        check_cells(shapes, a.models, a.precisions, a.routing, a.kernel)
        if min(a.tokens) < 1 or a.trials < 1 or a.graph_iters < 1 or a.max_spin < 1:
            raise ValueError("--tokens, --trials, --graph-iters and --max-spin must be >= 1")
        if a.warmup < 0 or (a.programs is not None and a.programs < 1):
            raise ValueError("--warmup must be >= 0 and --programs >= 1")

    def sweeps(self, args) -> list[Sweep]:
        return [kernel_sweep(args)]

    def start(self, run: Run) -> None:
        """This GPU (the reference float32, not TF32), its persistent programs, the run's tile
        configurations and one-token calls."""
        self.on = kernel_device(self.device, run.args.kernel, "moe.kernel_bench")
        self.programs = (run.args.programs
                         or torch.cuda.get_device_properties(self.on).multi_processor_count)
        self.shapes = load_shapes()
        self.tile_configs: dict = {}
        self.call_overhead: list[dict] = []

    def prepare(self, point: dict, run: Run) -> KernelStep:
        """The point's cell; its model's weights in its precision, made once for its cells."""
        args, shape, precision = run.args, self.shapes[point["model"]], point["precision"]
        cfg = default_tile_config(precision, args.kernel, hidden=shape.hidden)
        self.tile_configs.setdefault(shape.model, {})[precision] = dataclasses.asdict(cfg)

        def make_weights():
            weights = local_expert_weights(shape, RANK, EP, precision, seed=args.seed,
                                               device=self.on)
            # bf16: the grouped GEMMs take the kernel's weights as they are (same master weights).
            uweights = (GroupedWeights(precision, weights.w1, weights.w2)
                        if precision == "bf16"
                        else unfused_expert_weights(shape, RANK, EP, precision,
                                                        seed=args.seed, device=self.on))
            return weights, uweights

        weights, uweights = run.resource((shape.model, precision), make_weights)
        return prepare_step(point, shape, weights, uweights, cfg, args, programs=self.programs,
                            device=self.on)

    def check(self, step: KernelStep, run: Run) -> list[str]:
        """Step 1 of the module docstring (the one-token call without the unfused path)."""
        if step.point["kind"] == "cell" and step.cell.workload.rows == 0:
            return ["no row routed to rank 0's experts"]
        step.checked, failures = check_cell(step.cell, weight_seed=run.args.seed,
                                            unfused=step.combine_unfused)
        return failures

    def measure(self, step: KernelStep, run: Run) -> dict:
        """A cell's row; the one-token call's row as one cell (``call_overhead``) that ``finish``
        moves to the header."""
        if step.point["kind"] == "call_overhead":
            return {"call_overhead": overhead_row(step, run.args, self.on)}
        return cell_row(step, run.args, self.on)

    def progress_line(self, rows) -> str | None:
        if "call_overhead" in rows:
            return None
        row = rows.iloc[0]
        return (f"{row['model']:18s} {row['precision']:4s} {row['routing']:8s} "
                f"{row['tokens']:6d}  kernel wave {row['kernel_wave_us']:8.1f} us "
                f"({row['tflops']:6.1f} TF/s, {row['ratio_to_cublas']:.2f} of cuBLAS)  call "
                f"{row['call_wave_us']:8.1f} us  unfused {row['unfused_us']:8.1f} us")

    def finish(self, table: pd.DataFrame, run: Run) -> pd.DataFrame:
        """The cells' rows; the one-token calls' rows, in run order, kept for the header."""
        if table.empty:
            return table
        one_token = table["kind"] == "call_overhead"
        self.call_overhead = list(table.loc[one_token, "call_overhead"]) if one_token.any() else []
        return table[~one_token].drop(columns="call_overhead", errors="ignore") \
            .reset_index(drop=True)

    def derived(self, path: Path, root: Path) -> list[Path]:
        """The EP = 2, 4, 8 forecast from this platform's kernel records, on its calibration
        where it has one."""
        from ...analysis.moe.forecast import write_forecast
        from ...loading import platforms

        platform = path.parent.name
        return ([write_forecast(platform, platform, root)]
                if platform in platforms("calibration", root) else [])

    @classmethod
    def analyse(cls, record, root: Path) -> KernelView:
        """One record read as a ``KernelView`` (``latest_view``: a platform's newest record of
        each precision)."""
        return KernelView(record.platform, (record,))

    @classmethod
    def analyse_platform(cls, platform: str, root: Path) -> KernelView:
        """A platform's newest record of each precision (``latest_view``)."""
        return latest_view(platform, root)

    def metadata(self, run: Run) -> dict:
        args = run.args
        return {
            "workload": f"one rank (rank {RANK}) of EP = {EP} on one GPU: its E/{EP} local "
                        f"experts, the rows all {EP} source ranks route to them, Combine into "
                        f"{EP} local buffers",
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "kernel": args.kernel, "tile_configs": self.tile_configs,
            "unfused_impl": {p: UNFUSED_IMPL[p] for p in args.precisions},
            "unfused_fp8_recipe": UNFUSED_FP8_RECIPE,
            "unfused_layout": "the fused kernel's Dispatch layout: offs end each expert's rows "
                              "padded to block_m",
            "cublas_dense": {p: DENSE_CEILING[p] for p in args.precisions},
            "flops": FLOPS, "timed": TIMED, "tolerance": TOLERANCE,
            "timing": f"{TIMING_METHOD}; one process; {args.graph_iters} calls per trial, graphed "
                      f"except {sorted(EAGER)} (eager, back to back)",
            "skew": {"hot_expert_fraction": HOT_EXPERT_FRACTION,
                     "hot_logit_bias": HOT_LOGIT_BIAS},
            "call_overhead": {"tokens_per_source": OVERHEAD_TOKENS, "routing": OVERHEAD_ROUTING,
                              "rows": self.call_overhead},
        }


EXPERIMENT = MoEKernel()


# --------------------------------------------------------------------------------------- merge

def merge_documents(docs: list[dict]) -> dict:
    """One document from the outputs of several invocations of one run (a device command's time
    limit splits the matrix by model, or into ``--chunk`` pieces): their rows and one-token rows
    in order, the first's header, each invocation's arguments, chunk and run time. Raises unless
    they ran the same kernel with the same tiles on the same kind of GPU from the same commit."""
    if not docs:
        raise ValueError("nothing to merge")
    same = ("kernel", "timing", "tolerance")
    for d in docs[1:]:
        for key in same:
            if d["metadata"][key] != docs[0]["metadata"][key]:
                raise ValueError(f"the outputs differ in {key!r}; they are not one run")
        for key in ("gpu_name", "gpu_count", "git_commit", "versions"):
            if d["metadata"]["provenance"][key] != docs[0]["metadata"]["provenance"][key]:
                raise ValueError(f"the outputs differ in provenance {key!r}")
    meta = json.loads(json.dumps(docs[0]["metadata"]))
    meta["tile_configs"] = {}
    for d in docs:  # a chunk may hold some of a model's precisions
        for m, c in d["metadata"]["tile_configs"].items():
            meta["tile_configs"].setdefault(m, {}).update(c)
    meta["call_overhead"]["rows"] = [r for d in docs for r in d["metadata"]["call_overhead"]["rows"]]
    meta["invocations"] = [{"args": d["metadata"]["args"], "wall_s": d["metadata"]["wall_s"],
                            "date_utc": d["metadata"]["provenance"]["date_utc"]} for d in docs]
    meta["args"] = {k: v for k, v in meta["args"].items()
                    if k not in ("out", "models", "precisions", "chunk")}
    meta["chunk"] = [d["metadata"].get("chunk") for d in docs]
    meta["wall_s"] = sum(d["metadata"]["wall_s"] for d in docs)
    return {"metadata": meta, "rows": [r for d in docs for r in d["rows"]]}


MERGE_USAGE = "python -m xstage_lab.experiments.moe.kernel_bench merge OUT.json IN.json [IN.json ...]"


def _existing(name: str) -> Path:
    if not Path(name).is_file():
        raise ValueError(f"no such file: {name}")
    return Path(name)


def merge(argv: list[str]) -> None:
    """``merge OUT IN [IN ...]``: ``merge_documents`` of the ``--out`` JSONs ``IN``, written to
    ``OUT``; no GPU needed."""
    if len(argv) < 2:
        raise SystemExit(f"usage: {MERGE_USAGE}")
    try:
        doc = merge_documents([read_output(_existing(f)) for f in argv[1:]])
    except ValueError as e:  # a missing or malformed output, or outputs of different runs
        print(f"{MERGE_USAGE.split(' OUT')[0]}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    Path(argv[0]).write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {argv[0]} ({len(doc['rows'])} cells from {len(argv) - 1} outputs)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["merge"]:
        merge(sys.argv[2:])
    else:
        harness.main(EXPERIMENT)
