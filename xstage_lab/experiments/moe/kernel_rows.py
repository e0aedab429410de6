"""The moe_kernel benchmark's timing and result rows (``kernel_bench`` steps 2 and 3): the timed
methods (``TIMED``), the cuBLAS ceiling, per-tile traces, host costs, and one row per checked cell
or one-token call."""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from ...dist_timing import time_methods
from ...ops.moe.fused import prepare_fused_moe
from ...ops.moe.schedules import L1, L2, expert_wave_schedule, tile_table, wave_starts
from ...ops.moe.shapes import E4M3_MAX, MoEShape
from ...ops.moe.tiles import TileConfig
from ...ops.moe.unfused import GroupedWeights, group_offsets, grouped_expert_ffn, unfused_impl
from ...ops.moe.weights import ExpertWeights
from ...analysis.moe import trace as moe_trace
from .bench import cell_seed
from .kernel_cell import Cell, setup_cell, unfused_layout

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


def moe_flops(rows: int, hidden: int, intermediate: int) -> int:
    """FLOPs of ``rows`` through one expert FFN: Linear-1 (gate and up) and Linear-2."""
    return 2 * rows * hidden * 2 * intermediate + 2 * rows * intermediate * hidden


def tflops(flops: int, us: float) -> float:
    return flops / (us * 1e6) if us > 0 else math.nan


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
    """The point's cell on fresh seeded activations (the one-token call: the point's tokens,
    ``kernel_bench.OVERHEAD_TOKENS``, on every source rank) and, for a cell of the matrix with
    rows, its unfused path."""
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


