"""The moe_kernel benchmark's workload and its checked cell: one rank (``RANK``) of the paper's
eight-GPU setting (``EP``) on one GPU, the rows every source rank routes to its experts laid out as
Dispatch lays them out, both schedules' launches into eight local Combine buffers, and the check
against the float32 reference (``kernel_bench`` step 1; ``host_bench`` and ``host_forecast`` use
them too)."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...checks import bitwise_equal, poisoned, relative_error
from ...ops.moe.combine import CombinePeers, combine_weighted_sum, local_combine_peers
from ...ops.moe.dispatch import DispatchLayout, build_layout, plan_send
from ...ops.moe.fused import prepare_fused_moe
from ...ops.moe.reference import expert_rows_reference
from ...ops.moe.routing import router_logits, router_topk
from ...ops.moe.schedules import (MoEProblem, d_knee, derived_lead, expert_wave_schedule,
                                  interleaved_schedule)
from ...ops.moe.shapes import PRECISIONS, ROUTINGS, MoEShape, check_expert_parallel
from ...ops.moe.tiles import KERNELS, TileConfig, default_tile_config
from ...ops.moe.unfused import unfused_activations
from ...ops.moe.weights import ExpertWeights, local_expert_weights, quantize_rows_fp8
from .bench import TOLERANCE, cell_seed

EP = 8          # the paper's eight-GPU setting
RANK = 0        # the rank this GPU plays: local experts 0 .. E/8 - 1


def check_cells(shapes: dict, models, precisions, routings, kernel: str) -> None:
    """ValueError unless every name of the options is known (``shapes``: the model shapes;
    ``PRECISIONS``, ``ROUTINGS``, ``KERNELS``) and EP ranks divide every model's experts: the
    options of the benches that run this workload, checked before any CUDA work."""
    for name, given, allowed in (("model", models, shapes), ("precision", precisions, PRECISIONS),
                                 ("routing", routings, ROUTINGS), ("kernel", [kernel], KERNELS)):
        bad = [g for g in given if g not in allowed]
        if bad:
            raise ValueError(f"unknown {name} {bad}; choose from {list(allowed)}")
    for m in models:
        if shapes[m].routed_experts % EP:
            raise ValueError(f"{m}: EP = {EP} ranks must divide its "
                             f"{shapes[m].routed_experts} experts")
# Every routed row must also lie within this multiple of moe_bench.TOLERANCE (which bounds the
# error over all rows): a dropped or misplaced row errs by ~1 (or stays NaN), while a correct
# row's error spreads around the aggregate (fp8 against the quantization-matched reference:
# rows up to 0.019 at an aggregate of 0.0037 over 3061 rows, one H200, smoke run).
ROW_TOLERANCE_FACTOR = 2


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


def arrival_sources(wl: Workload) -> torch.Tensor:
    """Each received row's source rank (int64), in arrival order."""
    device = wl.recv_x.device
    return torch.repeat_interleave(torch.arange(wl.world, device=device),
                                   torch.tensor(wl.recv_counts, device=device))


def receive_buffers(wl: Workload, x: torch.Tensor, x_scale: torch.Tensor | None,
                    capacity: int) -> dict:
    """The received rows as an EP rank's receive buffers of ``capacity`` rows hold them, in
    ``device_tables.route_to_tables``' arguments: ``x`` (``recv_x`` as sent: bf16, or e4m3 with
    its scales ``x_scale``), the local expert ids, sources and slots in arrival order at the front
    of each buffer (the rest 0, scales 1), and their count on the device."""
    n = wl.rows

    def buffer(t: torch.Tensor, fill=0) -> torch.Tensor:
        out = torch.full((capacity, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
        out[:n] = t
        return out

    return {"expert_ids": buffer(wl.recv_expert.int()),
            "x": buffer(x.view(torch.uint8)).view(x.dtype),  # e4m3 has no fill of its own
            "x_scale": None if x_scale is None else buffer(x_scale, 1.0),
            "n_arrivals": torch.tensor([n], dtype=torch.int32, device=x.device),
            "arrival_src": buffer(arrival_sources(wl).int()),
            "arrival_slot": buffer(wl.recv_slot.int())}


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
    def derived_lead(self) -> int:
        """Interleaved's derived lead D for the cell (``schedules.derived_lead``)."""
        return derived_lead(self.knee, self.programs, self.problem.l1_n_blocks,
                            self.problem.l2_n_blocks)

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


def checked_cell(shape: MoEShape, precision: str, routing: str, tokens: int, args, run, *,
                 programs: int, device) -> tuple[Cell, dict, list[str]]:
    """``setup_cell`` of the default tile configuration over the experts of (shape, precision)
    the run holds (``run.resource``, made from ``args.seed``), on the activations of the cell's
    seed (``bench.cell_seed``), then ``check_cell`` without an unfused path: the cell, its check
    columns and its failures (``host_bench`` and ``probes.moe_schedule``)."""
    cfg = default_tile_config(precision, args.kernel, hidden=shape.hidden)
    weights = run.resource((shape.model, precision), lambda: local_expert_weights(
        shape, RANK, EP, precision, seed=args.seed, device=device))
    cell = setup_cell(shape, precision, routing, tokens, weights, cfg, args,
                      seed=cell_seed(args.seed, shape.model, precision, routing, tokens),
                      programs=programs, device=device)
    return (cell, *check_cell(cell, weight_seed=args.seed, unfused=None))


def check_cell(cell: Cell, *, weight_seed: int,
               unfused: Callable[[], None] | None) -> tuple[dict, list[str]]:
    """Run each schedule (and ``unfused``, which stores into the Combine buffers) once on poisoned
    buffers and compare (``kernel_bench`` step 1); ``weight_seed`` regenerates the master weights
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


