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
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ...checks import bitwise_equal, poisoned, relative_error
from ...dist_timing import TIMING_METHOD, time_methods
from ...records import read_output
from ...ops.moe.combine import CombinePeers, combine_weighted_sum, local_combine_peers
from ...ops.moe.dispatch import DispatchLayout, build_layout, plan_send
from ...ops.moe.fused import DEFAULT_MAX_SPIN_ITERS, prepare_fused_moe
from ...ops.moe.reference import expert_rows_reference
from ...ops.moe.routing import HOT_EXPERT_FRACTION, HOT_LOGIT_BIAS, router_logits, router_topk
from ...ops.moe.schedules import (L1, L2, MoEProblem, d_knee, expert_wave_schedule,
                                  interleaved_schedule, tile_table, wave_starts)
from ...ops.moe.shapes import (E4M3_MAX, MoEShape, PRECISIONS, ROUTINGS, check_expert_parallel,
                               load_shapes)
from ...ops.moe.tiles import KERNELS, TileConfig, default_tile_config, kernel_device
from ...ops.moe.unfused import (GroupedWeights, UNFUSED_FP8_RECIPE, UNFUSED_IMPL, group_offsets,
                                grouped_expert_ffn, unfused_activations, unfused_expert_weights,
                                unfused_impl)
from ...ops.moe.weights import ExpertWeights, local_expert_weights, quantize_rows_fp8
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment, Run
from ...analysis.moe import trace as moe_trace
from .bench import TOLERANCE, cell_seed
from ...analysis.moe.kernel_view import KernelView, latest_view

EP = 8          # the paper's eight-GPU setting
RANK = 0        # the rank this GPU plays: local experts 0 .. E/8 - 1
DEFAULT_TOKENS = (4096, 8192)  # per source rank
DEFAULT_TRIALS = 20
SMOKE = {"models": ["DeepSeek-V4-Flash"], "precisions": ["bf16", "fp8"], "routing": ["balanced"],
         "tokens": [512], "trials": 5}
OVERHEAD_TOKENS = 1
# Every routed row must also lie within this multiple of moe_bench.TOLERANCE (which bounds the
# error over all rows): a dropped or misplaced row errs by ~1 (or stays NaN), while a correct
# row's error spreads around the aggregate (fp8 against the quantization-matched reference:
# rows up to 0.019 at an aggregate of 0.0037 over 3061 rows, one H200, smoke run).
ROW_TOLERANCE_FACTOR = 2
OVERHEAD_ROUTING = "balanced"

# One rank's forward ends with the top-k weighted sum of its own Combine buffer; the other seven
# buffers' sums belong to the other ranks' forwards, so a timed call sums source rank 0's buffer
# only (summing all eight would charge this rank 8x its share).
TIMED = {
    "kernel_wave": "the fused kernel alone, Expert-Wave: row counters zeroed + launch; "
                   "CUDA-graph replay",
    "kernel_interleaved": "the fused kernel alone, Interleaved (lead D_knee); CUDA-graph replay",
    "call_wave": "the whole fused call, eager: row counters zeroed, kernel (Combine into the "
                 "eight buffers), top-k weighted sum of source rank 0's buffer",
    "call_interleaved": "the same with the Interleaved schedule",
    "cublas_dense": "the ceiling: cuBLAS dense GEMMs of the same padded rows (DENSE_CEILING); "
                    "CUDA-graph replay",
    "grouped_mm": "the unfused expert FFN alone: grouped GEMM, SwiGLU (fp8: h re-quantized per "
                  "row), grouped GEMM (grouped_expert_ffn); CUDA-graph replay",
    "unfused": "the whole unfused call, eager: grouped_mm + Combine (rows scattered into the "
               "eight buffers by row_src/row_slot) + top-k weighted sum of source rank 0's buffer",
}
EAGER = frozenset({"call_wave", "call_interleaved", "unfused"})
OVERHEAD_METHODS = ("kernel_wave", "kernel_interleaved", "call_wave", "call_interleaved")
DENSE_CEILING = {
    "bf16": "torch.matmul: [rows, H] x [H, 2I], then [rows, I] x [I, H]; bf16 operands and output",
    "fp8": "torch._scaled_mm, the same shapes: e4m3 operands with one fp32 scale per tensor (the "
           "recipe torch sends to cuBLASLt; its rowwise recipe runs a CUTLASS kernel), bf16 "
           "output, use_fast_accum=False",
}
FLOPS = ("2 * rows * hidden * 2 * intermediate (Linear-1, gate and up) + 2 * rows * intermediate "
         "* hidden (Linear-2); *_tflops with the routed rows, *_tflops_padded with the rows "
         "padded to block_m per expert")


# ---------------------------------------------------------------------------------- the sweep

def kernel_sweep(args) -> Sweep:
    """Model x precision x cell: each (routing, tokens) of the options (``kind`` ``cell``), then
    the one-token call (``call_overhead``); one pass (each cell's repeats are its timing trials).
    Model and precision outermost: their weights are made once for their cells."""
    cells = [{"kind": "cell", "routing": r, "tokens": t} for r in args.routing for t in args.tokens]
    one_token = {"kind": "call_overhead", "routing": OVERHEAD_ROUTING, "tokens": OVERHEAD_TOKENS}
    return Sweep("moe_kernel", (Axis("model", args.models), Axis("precision", args.precisions),
                                Axis("cell", [*cells, one_token])), repeats=1, warmup=0)


# ------------------------------------------------------------------------------------ workload

@dataclass
class Workload:
    """What one destination rank's local experts receive from every source rank."""

    shape: MoEShape
    rank: int
    tokens: int                     # per source rank
    x: list[torch.Tensor]           # per source: bf16 [T, H]
    topk_ids: list[torch.Tensor]    # per source: global experts [T, top_k]
    topk_w: list[torch.Tensor]      # per source: routing weights [T, top_k]
    recv_x: torch.Tensor            # bf16 [N, H]: the received rows, source by source
    recv_slot: torch.Tensor         # int64 [N]: slot t * top_k + j on its source
    recv_expert: torch.Tensor       # int64 [N]: local expert
    recv_counts: tuple[int, ...]    # rows from each source

    @property
    def world(self) -> int:
        return len(self.x)

    @property
    def experts_per_rank(self) -> int:
        return self.shape.routed_experts // self.world

    @property
    def rows(self) -> int:
        """Routed rows (unpadded)."""
        return self.recv_x.shape[0]

    @property
    def slots(self) -> int:
        """Rows of each source's Combine buffer."""
        return self.tokens * self.shape.top_k

    def layout(self, x: torch.Tensor, x_scale: torch.Tensor | None,
               block_m: int) -> DispatchLayout:
        """The received rows ``x`` (``recv_x`` as some path quantizes it) laid out by expert."""
        return build_layout(x, x_scale, self.recv_slot, self.recv_expert, self.recv_counts,
                                self.experts_per_rank, block_m)


def build_workload(shape: MoEShape, routing: str, tokens: int, *, seed: int, rank: int = RANK,
                   world: int = EP, device="cpu") -> Workload:
    """Every source rank's tokens and router, and the (token, k) picks that land on ``rank``'s
    experts, in the order Dispatch delivers them: source by source, each source's picks sorted by
    expert then slot (``plan_send``)."""
    per_rank = check_expert_parallel(shape.routed_experts, world)
    device = torch.device(device)
    xs, ids, ws, recv_x, recv_slot, recv_expert, counts = [], [], [], [], [], [], []
    for r in range(world):
        g = torch.Generator(device=device).manual_seed(seed * 1009 + r)
        xs.append(torch.randn(tokens, shape.hidden, generator=g, device=device).to(torch.bfloat16))
        i, w = router_topk(router_logits(tokens, shape.routed_experts, routing, seed=seed,
                                                 rank=r, device=device), shape.top_k)
        ids.append(i)
        ws.append(w)
        plan = plan_send(i, shape.routed_experts, world)
        lo = sum(plan.counts[:rank])
        sent = slice(lo, lo + plan.counts[rank])  # the picks source r sends to ``rank``
        recv_x.append(xs[-1][plan.order[sent] // shape.top_k])
        recv_slot.append(plan.order[sent])
        recv_expert.append(plan.experts[sent] - rank * per_rank)
        counts.append(plan.counts[rank])
    return Workload(shape, rank, tokens, xs, ids, ws, torch.cat(recv_x), torch.cat(recv_slot),
                    torch.cat(recv_expert), tuple(counts))


def fused_layout(wl: Workload, precision: str, block_m: int) -> DispatchLayout:
    """The fused kernel's rows: bf16, or e4m3 with 1 x 128 scales (``quantize_rows_fp8``)."""
    x = quantize_rows_fp8(wl.recv_x) if precision == "fp8" else (wl.recv_x, None)
    return wl.layout(*x, block_m)


def unfused_layout(wl: Workload, precision: str, block_m: int) -> DispatchLayout:
    """The unfused path's rows (``unfused_activations``), padded like the fused layout so
    that both compute the same rows."""
    return wl.layout(*unfused_activations(wl.recv_x, precision), block_m)


def combine_index(layout: DispatchLayout, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, dest)``: the padded rows that hold the received rows (arrival order) and the row of
    the eight stacked ``[slots, H]`` Combine buffers that each one's result goes to
    (``row_src * slots + row_slot``, as the kernel addresses it)."""
    rows = layout.arrival_rows
    return rows, layout.row_src[rows].long() * slots + layout.row_slot[rows].long()


def moe_flops(rows: int, hidden: int, intermediate: int) -> int:
    """FLOPs of ``rows`` through one expert FFN: Linear-1 (gate and up) and Linear-2."""
    return 2 * rows * hidden * 2 * intermediate + 2 * rows * intermediate * hidden


def tflops(flops: int, us: float) -> float:
    return flops / (us * 1e6) if us > 0 else math.nan


def row_errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """Relative Frobenius error over all rows and the largest relative error of one row; inf
    where ``got`` holds a NaN or an infinity (an unwritten, still poisoned row)."""
    if got.numel() == 0:
        return 0.0, 0.0
    total = relative_error(got, want)
    if not math.isfinite(total):
        return math.inf, math.inf
    per_row = (got.float() - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30)
    return total, per_row.max().item()


def dense_ceiling(rows: int, hidden: int, intermediate: int, precision: str, *, seed: int,
                  device) -> Callable[[], None]:
    """cuBLAS dense GEMMs of the FFN's shapes over ``rows`` rows (``DENSE_CEILING``), on seeded
    random operands; B operands are ``[N, K]`` contiguous passed transposed (column-major)."""
    g = torch.Generator(device=torch.device(device)).manual_seed(seed)

    def rand(*s):
        return torch.randn(*s, generator=g, device=device).to(torch.bfloat16)

    a, h = rand(rows, hidden), rand(rows, intermediate)
    w1, w2 = rand(2 * intermediate, hidden), rand(hidden, intermediate)
    if precision == "bf16":
        return lambda: (torch.matmul(a, w1.t()), torch.matmul(h, w2.t()))
    def quantize(t):  # one scale for the whole tensor
        scale = t.float().abs().amax().clamp_min(1e-12) / E4M3_MAX
        return (t.float() / scale).to(torch.float8_e4m3fn), scale

    (aq, sa), (hq, sh), (w1q, s1), (w2q, s2) = (quantize(t) for t in (a, h, w1, w2))
    return lambda: (
        torch._scaled_mm(aq, w1q.t(), scale_a=sa, scale_b=s1, out_dtype=torch.bfloat16),
        torch._scaled_mm(hq, w2q.t(), scale_a=sh, scale_b=s2, out_dtype=torch.bfloat16))


# ----------------------------------------------------------------------------------- one cell

@dataclass
class Cell:
    """One cell's workload, layouts, Combine buffers and prepared calls."""

    shape: MoEShape
    precision: str
    routing: str
    workload: Workload
    cfg: TileConfig
    layout: DispatchLayout
    programs: int
    knee: int
    problem: MoEProblem
    calls: dict               # "wave" / "interleaved" -> FusedMoECall
    combine: torch.Tensor     # bf16 [EP, slots, H]: the eight sources' Combine buffers
    rows: torch.Tensor        # int64: padded rows of the received rows (arrival order)
    dest: torch.Tensor        # int64: their rows of combine.view(-1, H)
    weights: ExpertWeights
    peers: CombinePeers

    @property
    def flat(self) -> torch.Tensor:
        return self.combine.view(-1, self.shape.hidden)

    def weighted_sum(self) -> torch.Tensor:
        """End of Combine on source rank 0 (see ``TIMED``)."""
        return combine_weighted_sum(self.combine[0], self.workload.topk_w[0])

    def whole_call(self, schedule: str) -> Callable[[], None]:
        """What a forward runs each step from the dispatched layout: the fused call (row
        counters zeroed, kernel), then the weighted sum."""
        return lambda: (self.calls[schedule](), self.weighted_sum())


def setup_cell(shape: MoEShape, precision: str, routing: str, tokens: int,
               weights: ExpertWeights, cfg: TileConfig, args, *, seed: int,
               programs: int, device) -> Cell:
    """Workload, the fused layout, both schedules (built as ``moe_bench.setup_config`` builds
    them) and their launches into eight local Combine buffers."""
    wl = build_workload(shape, routing, tokens, seed=seed, device=device)
    layout = fused_layout(wl, precision, cfg.block_m)
    problem = MoEProblem(layout.blocks_per_expert, shape.intermediate // cfg.block_n1,
                         shape.hidden // cfg.block_n2)
    knee = d_knee(2 * cfg.block_n1, programs, shape.intermediate)
    schedules = {"wave": expert_wave_schedule(problem, programs),
                 "interleaved": interleaved_schedule(problem, programs, knee)}
    combine = poisoned((EP, wl.slots, shape.hidden), torch.bfloat16, device)
    peers = local_combine_peers(list(combine.unbind(0)))
    calls = {name: prepare_fused_moe(layout, weights, s, peers, config=cfg,
                                         max_spin_iters=args.max_spin)
             for name, s in schedules.items()}
    rows, dest = combine_index(layout, wl.slots)
    return Cell(shape, precision, routing, wl, cfg, layout, programs, knee, problem, calls,
                combine, rows, dest, weights, peers)


def check_cell(cell: Cell, *, weight_seed: int,
               unfused: Callable[[], None] | None) -> tuple[dict, list[str]]:
    """Run each schedule (and ``unfused``, which stores into the Combine buffers) once on poisoned
    buffers and compare (module docstring, step 1); ``weight_seed`` regenerates the master weights
    for the reference. Returns the spin errors, stray rows and errors (columns of a row) and the
    failures."""
    wl, precision = cell.workload, cell.precision
    first = None
    spin = {}
    for name, call in cell.calls.items():
        cell.combine.fill_(float("nan"))
        call()
        spin[name] = call.error_count()
        if first is None:
            first = cell.combine.clone()
    bitwise = bitwise_equal(first, cell.combine)
    del first
    expected = torch.zeros(cell.flat.shape[0], dtype=torch.bool, device=cell.combine.device)
    expected[cell.dest] = True
    stray = int(((~torch.isnan(cell.flat)).any(-1) & ~expected).sum())
    got = cell.flat.index_select(0, cell.dest)
    experts = wl.recv_expert + wl.rank * wl.experts_per_rank
    ref = expert_rows_reference(wl.recv_x, experts, cell.shape, seed=weight_seed,
                                    precision=precision)
    errors = {}
    for kind, want in ref.items():
        errors[f"rel_err_{kind}"], errors[f"max_row_rel_err_{kind}"] = row_errors(got, want)
    tol = TOLERANCE[precision]
    failures = [f"spin errors {spin}"] if any(spin.values()) else []
    if not bitwise:
        failures.append("Expert-Wave and Interleaved Combine buffers differ")
    if stray:
        failures.append(f"{stray} Combine rows written that no routed row names")
    failures += [f"{kind} error {errors[f'rel_err_{kind}']:.3g} > {bound}"
                 for kind, bound in tol.items() if not errors[f"rel_err_{kind}"] <= bound]
    failures += [f"max row {kind} error {errors[f'max_row_rel_err_{kind}']:.3g} > "
                 f"{ROW_TOLERANCE_FACTOR * bound}" for kind, bound in tol.items()
                 if not errors[f"max_row_rel_err_{kind}"] <= ROW_TOLERANCE_FACTOR * bound]
    if unfused is not None:
        cell.combine.fill_(float("nan"))
        unfused()
        got = cell.flat.index_select(0, cell.dest)
        total, worst = row_errors(got, ref["fp32"])
        errors["rel_err_unfused_fp32"], errors["max_row_rel_err_unfused_fp32"] = total, worst
        if not total <= tol["fp32"] or not worst <= ROW_TOLERANCE_FACTOR * tol["fp32"]:
            failures.append(f"unfused fp32 error {total:.3g} (max row {worst:.3g}) beyond "
                            f"{tol['fp32']} ({ROW_TOLERANCE_FACTOR * tol['fp32']} a row)")
    return {"spin_errors": spin, "stray_rows": stray, **errors}, failures


def traced_tiles(cell: Cell, schedule: str) -> pd.DataFrame:
    """One launch of the instrumented build of ``schedule`` (after a warm-up launch), its
    per-tile stamps as ``moe_trace.tile_frame`` reads them; raises on a spin error."""
    call = cell.calls[schedule]
    traced = prepare_fused_moe(cell.layout, cell.weights, call.schedule, cell.peers,
                                   config=cell.cfg, instrument=True)
    for _ in range(2):
        traced()
    if traced.error_count():
        raise SystemExit(f"spin errors in the traced {schedule} launch")
    table, counts = tile_table(call.schedule)
    return moe_trace.tile_frame(traced.trace.cpu().numpy(), table, counts)


def burst_gaps(tiles: pd.DataFrame) -> pd.Series:
    """The gap between consecutive Linear-2 bursts of a program: from one Linear-2 tile's
    epilogue end (every Combine store issued) to the next Linear-2 tile's epilogue start, in
    %globaltimer µs (G of eq. 12 as the kernel ran it)."""
    gaps = []
    for _, prog in tiles[tiles["kind"] == L2].groupby("program"):
        prog = prog.sort_values("position")
        gaps.append(prog["t2_us"].to_numpy()[1:] - prog["t3_us"].to_numpy()[:-1])
    return pd.Series(np.concatenate(gaps) if gaps else [], dtype=float)


def trace_columns(cell: Cell) -> dict:
    """Per-tile times of both schedules (item 5 of the issue): the median Linear-1 and Linear-2
    mainloops, the Linear-2 span (every Combine store local here), the median gap between
    Linear-2 bursts, and the tiles per program that the forecast plays."""
    out = {}
    for schedule in cell.calls:
        tiles = traced_tiles(cell, schedule)
        stats = moe_trace.run_stats(tiles)
        gaps = burst_gaps(tiles)
        prefix = "wave" if schedule == "wave" else "int"
        out.update({f"{prefix}_mainloop_l1_us": stats["mainloop_l1_us"],
                    f"{prefix}_mainloop_l2_us": stats["mainloop_l2_us"],
                    f"{prefix}_epilogue_l1_us": stats["epilogue_l1_us"],
                    f"{prefix}_span_l2_us": stats["span_l2_us"],
                    f"{prefix}_wait_l2_us": stats["wait_l2_median_us"],
                    f"{prefix}_gap_l2_us": float(gaps.median()) if len(gaps) else math.nan,
                    f"{prefix}_trace_clock_mhz": stats["clock_mhz"]})
    per_program = [sum(t.kind == k for t in p) for k in (L1, L2)
                   for p in cell.calls["wave"].schedule.programs]
    n = cell.programs
    out.update({"mainloop_l1_us": out["wave_mainloop_l1_us"],
                "mainloop_l2_us": out["wave_mainloop_l2_us"],
                "g_wave_us": out["wave_gap_l2_us"],
                "l1_tiles_per_program": float(np.mean(per_program[:n])),
                "l2_tiles_per_program": float(np.mean(per_program[n:])),
                "waves": len(wave_starts(cell.problem, cell.programs))})
    return out


def timing_columns(timing: dict, names, flops: int, flops_padded: int) -> dict:
    """Median, p25/p75 and TF/s (routed and padded rows) of each method; the median SM clock of
    its trials (None where NVML did not answer)."""
    out = {}
    clocks = {}
    for m in names:
        t = timing[m]
        out.update({f"{m}_us": t["median_us"], f"{m}_p25_us": t["p25_us"],
                    f"{m}_p75_us": t["p75_us"], f"{m}_tflops": tflops(flops, t["median_us"]),
                    f"{m}_tflops_padded": tflops(flops_padded, t["median_us"])})
        known = [c for c in t.get("sm_clock_mhz", []) if c is not None]
        clocks[m] = float(np.median(known)) if known else None
    known = [c for c in clocks.values() if c is not None]
    out["sm_clock_mhz"] = clocks
    out["sm_clock_mhz_min"] = min(known) if known else None
    out["trials_us"] = {m: timing[m]["trials_us"] for m in names}
    return out


def cell_row_base(cell: Cell) -> dict:
    shape, wl = cell.shape, cell.workload
    return {"model": shape.model, "variant": shape.variant, "precision": cell.precision,
            "routing": cell.routing, "tokens": wl.tokens, "ep": wl.world, "rank": wl.rank,
            "local_experts": wl.experts_per_rank, "hidden": shape.hidden,
            "intermediate": shape.intermediate, "routed_experts": shape.routed_experts,
            "top_k": shape.top_k, "rows": wl.rows, "padded_rows": cell.layout.num_rows,
            "tokens_per_expert": list(cell.layout.tokens_per_expert),
            "kernel": cell.cfg.kernel, "tile_config": dataclasses.asdict(cell.cfg),
            "num_programs": cell.programs, "lead_rows": cell.knee, "d_knee": cell.knee,
            "wave_starts": list(wave_starts(cell.problem, cell.programs))}


def host_costs(cell: Cell, calls: int = 50) -> dict:
    """Host time of a call, where a one-token call spends it: ``host_launch_us``, the Python side
    of one whole Expert-Wave call (counters zeroed, launch with its TMA descriptors, weighted sum)
    over ``calls`` back-to-back calls, none waited for; ``host_prepare_us``, building this batch's
    Expert-Wave schedule and its checked launch (``prepare_fused_moe``), which a forward repeats
    whenever the routing changes; the median of five."""
    call = cell.whole_call("wave")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    launch = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    prepare = []
    for _ in range(5):
        start = time.perf_counter()
        prepare_fused_moe(cell.layout, cell.weights,
                              expert_wave_schedule(cell.problem, cell.programs), cell.peers,
                              config=cell.cfg)
        prepare.append((time.perf_counter() - start) * 1e6)
    return {"host_launch_us": launch, "host_prepare_us": float(np.median(prepare))}


@dataclass
class KernelStep:
    """One point on this GPU: its cell and, for a cell of the matrix (not the one-token call),
    the unfused path: ``expert_ffn`` (the grouped GEMMs) and ``combine_unfused`` (them, then
    Combine into the eight buffers); ``checked``: the check's columns of the row."""

    point: dict
    cell: Cell
    seed: int
    expert_ffn: Callable[[], torch.Tensor] | None = None
    combine_unfused: Callable[[], None] | None = None
    checked: dict = dataclasses.field(default_factory=dict)


def prepare_step(point: dict, shape: MoEShape, weights: ExpertWeights,
                 uweights: GroupedWeights, cfg: TileConfig, args, *, programs: int,
                 device) -> KernelStep:
    """The point's cell on fresh seeded activations (the one-token call: ``OVERHEAD_TOKENS`` on
    every source rank) and, for a cell of the matrix with rows, its unfused path."""
    one_token = point["kind"] == "call_overhead"
    precision = point["precision"]
    key = ("call_overhead",) if one_token else (point["routing"], point["tokens"])
    seed = cell_seed(args.seed, shape.model, precision, *key)
    cell = setup_cell(shape, precision, point["routing"], point["tokens"], weights, cfg, args,
                      seed=seed, programs=programs, device=device)
    step = KernelStep(point, cell, seed)
    if one_token or cell.workload.rows == 0:  # no unfused path; no rows: the check refuses it
        return step
    ulayout = (cell.layout if precision == "bf16"
               else unfused_layout(cell.workload, precision, cfg.block_m))
    offs = group_offsets(ulayout)

    def expert_ffn():
        return grouped_expert_ffn(ulayout, uweights, offs)

    def combine_unfused():
        cell.flat.index_copy_(0, cell.dest, expert_ffn().index_select(0, cell.rows))

    step.expert_ffn, step.combine_unfused = expert_ffn, combine_unfused
    return step


def cell_row(step: KernelStep, args, device) -> dict:
    """Timing of one checked cell of the matrix: its result row."""
    cell = step.cell
    shape, precision = cell.shape, cell.precision
    methods = {"kernel_wave": cell.calls["wave"], "kernel_interleaved": cell.calls["interleaved"],
               "call_wave": cell.whole_call("wave"),
               "call_interleaved": cell.whole_call("interleaved"),
               "cublas_dense": dense_ceiling(cell.layout.num_rows, shape.hidden, shape.intermediate,
                                             precision, seed=step.seed + 1, device=device),
               "grouped_mm": step.expert_ffn,
               "unfused": lambda: (step.combine_unfused(), cell.weighted_sum())}
    timing = time_methods(methods, trials=args.trials, warmup=args.warmup,
                          graph_iters=args.graph_iters, eager=EAGER, clocks=True)
    traces = trace_columns(cell) if args.trace else {}
    host = host_costs(cell) if device.type == "cuda" else {}
    flops = moe_flops(cell.workload.rows, shape.hidden, shape.intermediate)
    padded = moe_flops(cell.layout.num_rows, shape.hidden, shape.intermediate)
    cols = timing_columns(timing, list(TIMED), flops, padded)
    return {**cell_row_base(cell), **cols,
            "tflops": cols["kernel_wave_tflops"], "tflops_padded": cols["kernel_wave_tflops_padded"],
            "ratio_to_cublas": cols["cublas_dense_us"] / cols["kernel_wave_us"],
            "ratio_to_cublas_interleaved": cols["cublas_dense_us"] / cols["kernel_interleaved_us"],
            "fused_vs_unfused": cols["unfused_us"] / cols["call_wave_us"],
            "speedup": cols["kernel_wave_us"] / cols["kernel_interleaved_us"],
            **step.checked, **traces, **host,
            "unfused_impl": unfused_impl(device, precision)}


def overhead_row(step: KernelStep, args, device) -> dict:
    """The fixed per-call cost: the checked one-token call, the kernel alone and the whole call
    timed; where the time goes: the host's share (``host_costs``) and the tiles'
    (``trace_columns``: one Linear-1 tile's mainloop, then the Linear-2 tile that waits for it)."""
    cell = step.cell
    shape = cell.shape
    methods = {"kernel_wave": cell.calls["wave"], "kernel_interleaved": cell.calls["interleaved"],
               "call_wave": cell.whole_call("wave"),
               "call_interleaved": cell.whole_call("interleaved")}
    timing = time_methods(methods, trials=args.trials, warmup=args.warmup,
                          graph_iters=args.graph_iters, eager=EAGER, clocks=True)
    flops = moe_flops(cell.workload.rows, shape.hidden, shape.intermediate)
    padded = moe_flops(cell.layout.num_rows, shape.hidden, shape.intermediate)
    traces = trace_columns(cell) if args.trace else {}
    return {**cell_row_base(cell), **timing_columns(timing, OVERHEAD_METHODS, flops, padded),
            **step.checked, **(host_costs(cell) if device.type == "cuda" else {}), **traces}


# ------------------------------------------------------------------------------ the experiment

class MoEKernel(Experiment):
    """The fused MoE kernel on one GPU against cuBLAS and the unfused path (issue 18)."""

    name = "moe_kernel"
    in_measure_all = True
    paper = "§4.2, §5.2; issue 18 items 2-4; timing §5.1"
    launch = "in_process"

    def __init__(self, device=None):
        self.device = device  # None: this process's CUDA GPU, checked to run --kernel

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        shapes = load_shapes()
        p.add_argument("--models", nargs="+", default=None, help=f"default: all of {list(shapes)}")
        p.add_argument("--precisions", nargs="+", default=None,
                       help=f"default: {list(PRECISIONS)}")
        p.add_argument("--routing", nargs="+", default=None, help=f"default: {list(ROUTINGS)}")
        p.add_argument("--tokens", nargs="+", type=int, default=None,
                       help=f"tokens per source rank (default: {list(DEFAULT_TOKENS)})")
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
        for name, given, allowed in (("model", a.models, shapes),
                                     ("precision", a.precisions, PRECISIONS),
                                     ("routing", a.routing, ROUTINGS),
                                     ("kernel", [a.kernel], KERNELS)):
            bad = [g for g in given if g not in allowed]
            if bad:
                raise ValueError(f"unknown {name} {bad}; choose from {list(allowed)}")
        if min(a.tokens) < 1 or a.trials < 1 or a.graph_iters < 1 or a.max_spin < 1:
            raise ValueError("--tokens, --trials, --graph-iters and --max-spin must be >= 1")
        if a.warmup < 0 or (a.programs is not None and a.programs < 1):
            raise ValueError("--warmup must be >= 0 and --programs >= 1")
        for m in a.models:
            if shapes[m].routed_experts % EP:
                raise ValueError(f"{m}: EP = {EP} ranks must divide its "
                                 f"{shapes[m].routed_experts} experts")

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
