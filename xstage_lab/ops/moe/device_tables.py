"""Routing to tile tables on the device (``kernels/moe_routing.py``): the Dispatch layout and both
schedules' tile tables built from the router's output by three small Triton launches (two up to
``scan_chunk_bound`` chunks of arrivals, one where the arrivals fit ``TINY_ARRIVALS``, or
an EP rank's bound ``TINY_RECEIVED``), plus one that quantizes bf16 activations for an FP8 layer
(up to ``QUANT_IN_HISTOGRAM_ROWS`` rows, the first launch's own programs, the scales by the rows
of ``x``), with no device-to-host copy, in buffers sized by static bounds.
The activations are not moved: each layout row names the row of ``x`` it reads (``row_origin``),
which the fused kernel gathers. The router's output and the activations reach the kernels through
the call's argument block (``call_args``), so a CUDA graph captured once replays them on new
tensors.

``table_reference.host_tables`` is the reference they equal entry for entry:
``dispatch.build_layout`` and the host schedules (``schedules.expert_wave_schedule``,
``interleaved_schedule``, ``tile_table``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import triton

from ...kernel_sources import load_kernel_module
from ..launcher import Launcher
from .call_args import (a_rows_view, allocate_args, check_address_params, slot_addresses,
                        slot_names, triton_dtype)
from .schedules import WAVE_FILL, MoEProblem, leads_from_expert, tile_work
from .shapes import FP8_SCALE_BLOCK, MoEContractError
from .tiles import TileConfig

CHUNK = 128        # arrivals per program of the histogram and scatter passes
# route_offsets' scan: experts per program, and counts (chunks x experts) per step of it. Its
# steps run one after another, about 1.8 µs each on an H200 (moe_layer's per-kernel profile:
# 32 experts a program took 5 steps over Qwen3.5's 640 chunks at 8192 tokens, 14 µs); four
# experts a program scan 1024 chunks a step: every shape at 8192 tokens per rank in one step
SCAN_EXPERTS = 4
SCAN_TILE = 4096
# Up to this many chunks in the arrivals' bound, route_histogram's last program does route_offsets'
# work alone (every expert's column of counts at once, SCAN_ONE_TILE counts a step: at most two
# steps at 512 experts), one launch and one kernel boundary fewer than the three launches; above
# it the steps run one after another in one program. Measured on one H200, both paths on the
# same arrivals in one rotation (route_small_probe/h200-x1/20261204T041058Z-8d242df5d1, every
# model, 8 to 512 tokens, SM clock 1980 MHz): the routing 1.10-1.28x faster on the EP = 8 rank
# at 8 and 64 tokens (1.8-1.9 µs less, medians), 0.99-1.27x at EP = 1 (0.7-0.9 µs less; 0.99 at
# DeepSeek-V4-Pro's 512 tokens, two steps over 512 experts), the cells above the bound (the same
# launches both ways) 0.99-1.03x; in the layer (moe_layer/h200-x1/20261204T035951Z-13459df91e)
# the graphed call within 5% of the kernel in six cells more than before (beyond it where one
# step scans every chunk: scan_chunk_bound). route_rows (and the quantization) in that launch
# too, its programs waiting on a flag for the last histogram program's layout, took longer than
# the two launches (8d81d14, reverted; moe_layer/h200-x1/20261204T161539Z-d99d182ef5 against
# …161751Z-58a86fc67b, one job, per-kernel profiles): 1.28-1.44x on the EP = 8 rank at 8 and 64
# tokens, 1.31-2.01x at EP = 1
SCAN_IN_HISTOGRAM_CHUNKS = 32
SCAN_ONE_TILE = 8192
# the histogram's scan steps: SCAN_ONE_TILE counts from this many experts, SCAN_TILE below
SCAN_WIDE_EXPERTS = 64  # (ptxas spilled 8192 over 2-32 experts: sm_90 builds, Triton 3.6)
# An EP rank's arrivals' bound is P times what balanced routing sends it (any source's picks may
# all land there), and the last program scans only the chunks it received: up to this many steps
# of that scan over the bound's chunks (its worst case, about one route_offsets launch), the scan
# stays there, a launch and a kernel boundary fewer where the rows received take about one step;
# only in its narrow steps (SCAN_TILE counts, below SCAN_WIDE_EXPERTS experts). Measured on one
# H200, ab of 5a758c7 against three launches (b4d2a3f), the EP = 8 rank at 512 tokens (the
# bound's 192-320 chunks in 2-3 steps of 128): 32 experts or fewer, the graphed call 0.968-0.995x
# in 8 cells (the table passes' device time 0.84-0.96x); DeepSeek-V4-Pro's 48 and Qwen3.5's 64
# experts in wide steps, 1.003-1.017x (1.16-1.34x) (moe_layer/h200-x1/20261206T072545Z against
# …072515Z and …072609Z, the latter retired)
RECEIVED_SCAN_STEPS = 3
# Up to these bounds (never above block_m), one launch (route_tiny) writes every table from the
# arrivals held in registers: at EP = 1 every slot of the bound is an arrival (TINY_ARRIVALS), on an
# EP rank the received rows are a share of the bound (TINY_RECEIVED). Its tiles written side by side
# (ROW_BLOCKS_TINY), measured on one H200 against the two launches (the scan in route_histogram),
# same arrivals (route_small_probe/h200-x1/20261204T145754Z-06d1045785, EP = 1, 8 and 12 tokens):
# up to 64 arrivals 4.7-7.2 µs against 8.2-12.0 (1.67-1.79x faster), at 72-120 12.2-13.3 against
# 10.7-12.9 (0.84-1.03x: all pairs of 128 arrivals in every program). With the tiles in one
# program it had been 1.05-2.07x faster at EP = 1 up to 16 arrivals, 0.40-0.63x at 48-80
# (…20261203T111717Z-813ff70976, 7f3255b); 1.20-2.07x on EP ranks with bounds of 16-128 (2-17
# received rows). It replaced route_small (the launches' passes as loops of one program, through
# memory: 8-15 µs at one token, route_small_probe/h200-x1/20261202T175738Z-780d73f25b)
TINY_ARRIVALS = 64
TINY_RECEIVED = 128
# ... and where an EP rank's count on the device is at most this, each of its programs holds this
# many arrivals instead of the bound's (``route_tiny``'s ``A_FEW``): the bound is about eight times
# the rows a rank receives. Against the bound's, in one job on one H200 (moe_layer/h200-x1/
# 20261204T155607Z-15a50c7345, then …155651Z, retired; per-kernel profiles), on the EP = 8 rank
# at one token route_tiny took 0.76x the time (geometric mean; Qwen3.5 7.2 -> 3.3 µs, 128
# arrivals' bound), at eight tokens of DiT-MoE 6.0 -> 2.7 µs. At EP = 1 (the bound's arrivals, as
# before) 0.94-0.99x at 1 and 8 tokens, every shape (route_small_probe/h200-x1/
# 20261204T162838Z-174531a604 against 1812817's …162918Z-83f3739b18, one job)
TINY_FEW_RECEIVED = 32
# route_tiny's row blocks per program of its tiles (programs side by side, each from the arrivals
# held in registers). Against one program writing them all, 16 row blocks a step, in one job on one
# H200 (moe_layer/h200-x1/20261204T151107Z, then the earlier routing's …151440Z, retired; per-kernel
# profiles, every shape, both precisions): at one token route_tiny took 2.1-3.9 µs at EP = 1
# against 3.5-5.1 (0.60x, geometric mean), 2.3-7.2 µs on the EP = 8 rank against 4.2-9.3 (0.73x);
# the graphed call 2.1 and 2.6 µs less (medians). With TINY_ARRIVALS 64, eight tokens at EP = 1
# take it instead of two or three launches: the table passes 0.61x, the graphed call 4.7 µs less
ROW_BLOCKS_TINY = 4
TINY_TABLE_PROGRAMS = 2  # route_tiny's programs before its tiles' (the arrivals', the experts')
# A row's activation scales narrower than this (HIDDEN below 4096) share lines with the next
# row's: route_quantize lays them out by layout row (scales_by_layout_row)
SCALE_LINE_BYTES = 128
# Rows of x per program of the FP8 quantization, each program one 128-column block of them
# (``_quantize_block`` says what that measured from 4096 tokens). At one token, EP = 1, the pass
# (then a gather into the layout as well) took 6.8-7.0 µs where a program stepped through 1024
# columns and 1.7 µs in 128-column ones, in one session on one H200 (moe_layer/h200-x1/
# 20261202T203004Z and …203438Z, per-kernel profile; both retired)
QUANT_ROWS = 32
# Up to this many rows of x, route_histogram's launch quantizes them too (programs after its
# chunks', as route_tiny's; the scales by the rows of x), one launch fewer; above it
# route_quantize's launch, whose pass over HBM (10-94 µs at 8192 tokens) the profile then keeps
# apart from the table passes. Against route_quantize's launch at EP = 1 (ab, every shape, base
# runs on either side): the graphed call 0.996x at 64 and 512 tokens, Qwen3.5's 8 tokens 0.994x
# (moe_layer/h200-x1/20261205T045739Z-bdf29c1056; base runs retired, bytes at 57a863b)
QUANT_IN_HISTOGRAM_ROWS = 512
SCHEDULES = ("wave", "interleaved")


@dataclass(frozen=True)
class TableBounds:
    """The static bounds every buffer of one op is sized by (paper §4.2 terms).

    ``capacity``: arrivals at most, ``T * top_k * P`` (at EP = 1, ``P = 1``); ``num_experts``:
    E_loc; ``block_m``: rows per row block; ``l1_n_blocks``/``l2_n_blocks``: the tables' Linear-1
    and Linear-2 entries per row block, P_1 and P_2 (times ``l2_splits``, the K splits of each
    Linear-2 tile: ``l2_split_count``); ``num_programs``: G; ``lead_rows``: the Interleaved lead
    D, counted from the end of each Linear-2 tile's expert where ``expert_lead`` (by default
    ``schedules.leads_from_expert``), else from its row. Row blocks in use are at most
    ``row_blocks_in_use`` (each expert's last row block padded)."""

    capacity: int
    num_experts: int
    block_m: int
    l1_n_blocks: int
    l2_n_blocks: int
    num_programs: int
    lead_rows: int
    expert_lead: bool
    l2_splits: int = 1

    def __post_init__(self):
        for name in ("capacity", "num_experts", "block_m", "l1_n_blocks", "l2_n_blocks",
                     "num_programs", "lead_rows", "l2_splits"):
            if getattr(self, name) < 1:
                raise MoEContractError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def of(cls, capacity: int, num_experts: int, hidden: int, intermediate: int,
           config: TileConfig, num_programs: int, lead_rows: int,
           expert_lead: bool | None = None, split_k: bool = False) -> TableBounds:
        """``split_k``: Linear-2 tiles split along K where ``l2_split_count`` says (the kernel
        must take them: ``kernels/moe_fused_ws.py``'s ``SPLIT_K`` build)."""
        p1, p2 = intermediate // config.block_n1, hidden // config.block_n2
        splits = (l2_split_count(row_blocks_in_use(capacity, num_experts, config.block_m) * p2,
                                 num_programs, intermediate // config.block_k)
                  if split_k else 1)
        return cls(capacity, num_experts, config.block_m, p1, p2 * splits, num_programs,
                   lead_rows, leads_from_expert(p1, p2 * splits) if expert_lead is None
                   else expert_lead, splits)

    @property
    def row_blocks(self) -> int:
        return row_blocks_in_use(self.capacity, self.num_experts, self.block_m)

    @property
    def rows(self) -> int:
        return self.row_blocks * self.block_m

    @property
    def chunks(self) -> int:
        return triton.cdiv(self.capacity, CHUNK)

    @property
    def max_tiles(self) -> int:
        """Entries per program of either table: the Interleaved bound covers Expert-Wave's
        ``ceil(row_blocks (P_1 + P_2) / G)``. Its Linear-2 stream is strided; its Linear-1 deal
        (``schedules.l1_deal``) gives a program at most ``ceil(n_1 / G) + u`` Linear-1 tiles
        (``u = w_2 div w_1``: the early rounds that skip the programs holding a Linear-2 tile
        more), and ``n_1 <= row_blocks P_1``."""
        g = self.num_programs
        w1, w2 = tile_work(MoEProblem((), self.l1_n_blocks, self.l2_n_blocks))
        return (triton.cdiv(self.row_blocks * self.l1_n_blocks, g) + w2 // w1
                + triton.cdiv(self.row_blocks * self.l2_n_blocks, g))


def row_blocks_in_use(capacity: int, num_experts: int, block_m: int) -> int:
    """The row blocks a layout of at most ``capacity`` arrivals over ``num_experts`` experts
    fills at most, from block 0 on: ``sum_e ceil(c_e / block_m) <= capacity div block_m +
    min(E, capacity)`` (one partial block per expert that has rows)."""
    return capacity // block_m + min(num_experts, capacity)


def l2_split_count(l2_tiles: int, num_programs: int, k_blocks: int) -> int:
    """K splits of each Linear-2 tile where a call has at most ``l2_tiles`` of them: 1 unless
    they fill at most half the ``num_programs``, else as many as the programs take
    (``num_programs div l2_tiles``), each split at least one of the ``k_blocks`` and none empty
    (splits of ``ceil(k_blocks / splits)`` blocks). One CTA streams a tile's weights at about
    50 GB/s (moe_layer/h200-x1's traces at one token): a 22-tile Linear-2, DiT-MoE's at one
    token, reads them at a quarter of an H200's HBM rate. Tiles that need a second round they
    do not fill stay unsplit: split so (the fewest splits of the fewest rounds, 8ceb2af), the
    one-token call of Qwen3.5, GLM-5.x and DeepSeek-V4-Pro at EP = 1 was slower on an H100,
    unsplit 0.84-0.97x its graphed time (moe_layer/h100-80gb-hbm3-x1/20261205T124833Z, bytes at
    93a4e5d, against …124705Z and …124935Z, bytes at cfa70a7: all three retired)."""
    splits = min(num_programs // max(l2_tiles, 1), k_blocks)
    if splits < 2:
        return 1
    return triton.cdiv(k_blocks, triton.cdiv(k_blocks, splits))


@dataclass
class DeviceTables:
    """The buffers of one op's routing, allocated once (``allocate_tables``) and rewritten by
    every ``route_to_tables``. Entries past the counts on the device are stale and never read:
    the fused kernel walks ``num_tiles[g]`` entries of program g's row."""

    bounds: TableBounds
    chunk_counts: torch.Tensor     # int32 [chunks, E]: arrivals of each expert per chunk
    chunk_start: torch.Tensor      # int32 [chunks, E]: ... in the chunks before
    expert_counts: torch.Tensor    # int32 [E]: routed rows of each local expert
    scan_done: torch.Tensor        # int32 [1]: the scan's ticket, 0 between calls
    expert_offsets: torch.Tensor   # int32 [E + 1]: padded first row of each expert; rows in use
    # int32 [E]: first row block of each expert's wave, one past its last; written only where an
    # expert holds more than one row block (else route_rows finds each wave in closed form)
    wave_lo: torch.Tensor
    wave_hi: torch.Tensor
    wave_jumps: torch.Tensor       # int32 [levels, E_pad + 1]: scratch, next wave start^(2^k)
    meta: torch.Tensor             # int32 [2]: row blocks in use, tiles in use
    arrival_rows: torch.Tensor     # int32 [capacity]: the padded row of each arrival (-1: none)
    row_src: torch.Tensor          # int32 [rows]
    row_slot: torch.Tensor         # int32 [rows]: -1 on padding rows
    row_origin: torch.Tensor       # int32 [rows]: the row of x each row reads, -1 on padding
    x_quant: torch.Tensor | None   # e4m3 [source rows, H]: bf16 x quantized (fp8 layers)
    # fp32 [rows, H / 128]: by layout row (route_quantize where scales_by_layout_row), else by
    # source row
    x_quant_scale: torch.Tensor | None
    tiles: dict                    # schedule -> int32 [G, max_tiles, 4]
    num_tiles: dict                # schedule -> int32 [G]
    row_ready: torch.Tensor        # int32 [row blocks]: the fused kernel's Linear-1 counters
    error: torch.Tensor            # int32 [1]: ids out of range (and the kernel's spin flag)
    args: torch.Tensor             # int64 [ARGS]: the call's argument block (call_args)
    tiny_arrivals: int             # up to this many arrivals, route_tiny (TINY_ARRIVALS) ...
    tiny_received: int             # ... and on an EP rank up to this bound (TINY_RECEIVED)
    fp8: bool                      # an FP8 layer's (e4m3 activations with 1 x 128 scales)
    scan_chunks: int               # up to this many chunks, the scan in route_histogram
    quant_rows: int                # up to this many rows, the first launch quantizes them
    received_scan_steps: int       # on an EP rank, the scan there up to this many steps too
    # (received, quantize, id dtype, zeroed hidden) -> RoutingLaunches, bound on first use
    launches: dict = field(default_factory=dict, repr=False)

    @property
    def row_blocks(self) -> torch.Tensor:
        return self.meta[:1]

    @property
    def a_rows(self) -> torch.Tensor:
        """The fused kernel's ``a_rows``: the slots of ``args`` the routing points at the rows
        Linear-1 reads (``x``'s own, or ``x_quant``) and their scales, and the scales' layout."""
        return a_rows_view(self.args)

    def routing(self, received: bool, quantize: bool, id_dtype: torch.dtype,
                zeroed_hidden: int = 0) -> RoutingLaunches:
        """The routing launches over these tables for arrivals of this kind (bound once)."""
        key = (received, quantize, id_dtype, zeroed_hidden)
        launch = self.launches.get(key)
        if launch is None:
            launch = self.launches[key] = RoutingLaunches(self, received, quantize, id_dtype,
                                                          zeroed_hidden)
        return launch


def allocate_tables(bounds: TableBounds, hidden: int, precision: str, device,
                    error: torch.Tensor | None = None, tiny_arrivals: int | None = None,
                    source_rows: int | None = None, tiny_received: int | None = None,
                    scan_chunks: int | None = None, quant_rows: int | None = None,
                    received_scan_steps: int | None = None) -> DeviceTables:
    """Every buffer of ``bounds`` on ``device``; ``error`` shared with the fused kernel where
    given; ``tiny_arrivals``, ``tiny_received``: ``TINY_ARRIVALS``, ``TINY_RECEIVED`` where None
    (either way at most ``block_m``); ``scan_chunks``: ``scan_chunk_bound`` where None;
    ``quant_rows``: ``QUANT_IN_HISTOGRAM_ROWS`` where None; ``received_scan_steps``:
    ``RECEIVED_SCAN_STEPS`` where None;
    ``source_rows``: the bf16 rows of ``x`` an FP8 layer quantizes
    at most (``x_quant``'s), ``bounds.capacity`` where None (an EP rank's received rows; at EP = 1
    the tokens, ``capacity / top_k``); 0: none, the layer takes e4m3 rows with their scales only (an
    EP rank whose Dispatch sends FP8)."""
    dev = torch.device(device)
    i32 = dict(dtype=torch.int32, device=dev)
    e, g = bounds.num_experts, bounds.num_programs
    fp8 = precision == "fp8"
    sources = bounds.capacity if source_rows is None else source_rows
    return DeviceTables(
        bounds, torch.zeros(bounds.chunks, e, **i32), torch.zeros(bounds.chunks, e, **i32),
        torch.zeros(e, **i32), torch.zeros(1, **i32), torch.zeros(e + 1, **i32),
        torch.zeros(e, **i32), torch.zeros(e, **i32),
        torch.zeros(_jump_levels(e), _pow2(e) + 1, **i32),
        torch.zeros(2, **i32), torch.full((bounds.capacity,), -1, **i32),
        torch.zeros(bounds.rows, **i32), torch.full((bounds.rows,), -1, **i32),
        torch.full((bounds.rows,), -1, **i32),
        (torch.zeros(sources, hidden, dtype=torch.float8_e4m3fn, device=dev)
         if fp8 and sources else None),
        # by layout row (route_quantize's, scales_by_layout_row) the bound's rows, else by source
        (torch.zeros(max(sources, bounds.rows) if scales_by_layout_row(hidden) else sources,
                     hidden // FP8_SCALE_BLOCK, dtype=torch.float32, device=dev)
         if fp8 and sources else None),
        {s: torch.zeros(g, bounds.max_tiles, 4, **i32) for s in SCHEDULES},
        {s: torch.zeros(g, **i32) for s in SCHEDULES}, torch.zeros(bounds.row_blocks, **i32),
        torch.zeros(1, **i32) if error is None else error, allocate_args(dev),
        min(TINY_ARRIVALS if tiny_arrivals is None else tiny_arrivals, bounds.block_m),
        min(TINY_RECEIVED if tiny_received is None else tiny_received, bounds.block_m), fp8,
        scan_chunk_bound(e) if scan_chunks is None else scan_chunks,
        QUANT_IN_HISTOGRAM_ROWS if quant_rows is None else quant_rows,
        RECEIVED_SCAN_STEPS if received_scan_steps is None else received_scan_steps)


def scan_chunk_bound(num_experts: int) -> int:
    """Up to this many chunks, ``route_histogram``'s last program scans their counts (``SCAN``):
    ``SCAN_IN_HISTOGRAM_CHUNKS``, or the more one step takes, where ``route_offsets`` would split
    that step and add a launch. Above 32 (DiT-MoE's EP = 8 rank from 512 tokens, EP = 1 from
    4096; Qwen3.5's rank at 64) the graphed call took 0.967-0.996x its time over three launches
    (ab, base runs on either side: moe_layer/h200-x1/20261205T050105Z and the change run
    …050209Z, both retired, then …050333Z)."""
    return max(SCAN_IN_HISTOGRAM_CHUNKS, scan_step_rows(_pow2(num_experts)))


def scan_step_rows(e_pad: int) -> int:
    """Chunks per step of that scan over ``e_pad`` experts (counts: ``SCAN_WIDE_EXPERTS``)."""
    return (SCAN_ONE_TILE if e_pad >= SCAN_WIDE_EXPERTS else SCAN_TILE) // e_pad


def tiny_warps(a_pad: int) -> int:
    """``route_tiny``'s warps over ``a_pad`` arrivals: each of its programs holds all pairs of
    them, ``a_pad**2 / (32 warps)`` a thread. At 128 arrivals in 8 warps ptxas gives a thread 255
    registers (the most it has), in 16 warps 128; at 64 in 8 warps, 123. At 128, 16 warps took
    route_tiny 0.92-0.94x the device time of 8 (0.5-0.8 µs less; the EP rank's 80 over 64
    experts, with the scan, 1.006x), in one job on one H200 (route_small_probe/h200-x1/
    20261204T152912Z-3f049f4838, then 8 warps' …152938Z-6b9cf5641c; per-kernel profiles)."""
    return max(8, a_pad // 8)


def scales_by_layout_row(hidden: int) -> bool:
    """Whether ``route_quantize`` (above ``QUANT_IN_HISTOGRAM_ROWS`` rows; up to them the first
    launch quantizes, by the rows of ``x``) stores each token's 1 x 128 scales at its arrivals'
    layout rows (and the fused kernel reads them there) rather than once at its row of ``x``:
    where a row's scales are narrower than a line (``SCALE_LINE_BYTES``), so that a row block's
    tokens, lying apart in ``x``, would each take a line of scales. DiT-MoE's 44 bytes read
    through its tokens took its FP8 kernel 1.021x and 1.018x the time of the host-scheduled
    launch at 4096 and 8192 tokens, by layout row 1.006x and 0.998x (paired; moe_layer/h200-x1/
    20261204T181620Z-f0fdda4cd7 against …181527Z-9fd98b7c50, one job; moe_gather_probe
    …180629Z-0a56654b8d). Scales of a line or more (HIDDEN from 4096) gained nothing by layout
    row, while route_quantize, storing each token's scales top-k times, took 1.1-2.6 µs more at
    64 and 512 tokens (…182146Z-ce84581d84 against …181902Z-0cd7c38d53). On one H100, Hy3's
    scales of one line read through its tokens cost its kernel 2% at 4096 tokens
    (moe_gather_probe/h100-80gb-hbm3-x1 20261206T003605Z-97115ee498), but by layout row up to a
    line the graphed call took 0.998x over the four models of H = 4096 at 4096 and 8192 tokens and
    the schedule kernels 1.23x (moe_layer …003930Z and …004239Z, retired, bytes at 0e0fed2,
    against …004028Z and …004141Z): the bound stays below a line."""
    return hidden // FP8_SCALE_BLOCK * 4 < SCALE_LINE_BYTES


def quant_grid(rows: int, hidden: int) -> tuple[int, int]:
    """The quantizing programs over ``rows`` rows of ``x`` (``route_quantize``'s grid; as many
    of ``route_tiny``'s beside its tables): blocks of ``QUANT_ROWS`` rows by 128 columns."""
    return triton.cdiv(rows, QUANT_ROWS), hidden // FP8_SCALE_BLOCK


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, n))


def _jump_levels(num_experts: int) -> int:
    """Powers of the next-wave-start map that binary lifting needs: 2**levels > E + 1 starts."""
    return (num_experts + 1).bit_length()


def route_to_tables(tables: DeviceTables, expert_ids: torch.Tensor, x: torch.Tensor,
                    x_scale: torch.Tensor | None = None, *, top_k: int = 1,
                    n_arrivals: torch.Tensor | None = None, arrival_src: torch.Tensor | None = None,
                    arrival_slot: torch.Tensor | None = None) -> None:
    """Rewrite ``tables`` for one call, on the current stream, without a host sync; the row
    counters ``tables.row_ready`` zeroed for the fused kernel: the routing launches
    (``RoutingLaunches``), the first of them writing the argument block.

    EP = 1 (``n_arrivals`` None): ``expert_ids`` is ``topk_ids.reshape(-1)`` (``T * top_k <=
    capacity`` arrivals, slot ``i``, source 0, token ``i // top_k``) and ``x`` the bf16 tokens
    ``[T, H]``; in fp8 they are quantized per 1 x 128 into ``tables.x_quant`` here. EP rank:
    ``expert_ids``, ``arrival_src`` and ``arrival_slot`` are ``[capacity]`` (received rows
    source by source, local expert ids), ``n_arrivals`` int32 ``[1]`` their count on the device,
    ``x`` the received rows ``[capacity, H]`` as Dispatch moved them (bf16, or e4m3 with
    ``x_scale``). The fused kernel reads ``x`` (or its quantized copy) in place, so it must
    stay unchanged until that launch has run. Ids out of range add to ``tables.error`` and get
    no row. Shapes and dtypes are the caller's contract (``FusedMoE`` checks them); ``x`` starts
    16-byte aligned (MoEContractError before any launch)."""
    if x.dtype == torch.float8_e4m3fn and x_scale is None:
        raise MoEContractError("e4m3 activations need their 1 x 128 scales (x_scale)")
    if x.dtype == torch.bfloat16 and tables.x_quant is None and tables.fp8:
        raise MoEContractError("these FP8 tables quantize no bf16 rows (allocated with "
                               "source_rows=0): pass e4m3 rows with their scales")
    addresses = slot_addresses(tables.args, expert_ids=expert_ids, x=x,
                               **({} if x_scale is None else {"x_scale": x_scale}))
    received = n_arrivals is not None
    quantize = tables.x_quant is not None and x.dtype == torch.bfloat16
    tables.routing(received, quantize, expert_ids.dtype)(
        tables.bounds.capacity if received else expert_ids.numel(), top_k, addresses,
        n_arrivals=n_arrivals, arrival_src=arrival_src, arrival_slot=arrival_slot)


class RoutingLaunches:
    """The routing launches over one ``DeviceTables``, their static arguments bound once
    (``launcher.Launcher``): the router's output and the activations are read from the tables'
    argument block (``tables.args``, written before), so per call only the arrivals' count and,
    on an EP rank, their sources and slots are launch arguments. ``received``: an EP rank's
    arrivals; ``quantize``: bf16 activations into an FP8 layer (``route_quantize``);
    ``id_dtype``: the expert ids' (int32 or int64). Up to ``tables.tiny_arrivals`` arrivals (an EP
    rank: up to a bound of ``tables.tiny_received``), ``route_tiny``; else the histogram, the scan,
    and the scatter with the tiles. ``zeroed_hidden`` > 0 (EP = 1): the first launch also zeroes
    the output, bf16 ``[T, zeroed_hidden]``, for a fused kernel that adds its rows into it
    (``fused.InKernelSum.atomic``)."""

    def __init__(self, tables: DeviceTables, received: bool, quantize: bool,
                 id_dtype: torch.dtype, zeroed_hidden: int = 0):
        k = load_kernel_module("moe_routing")
        b, t = tables.bounds, tables
        e_pad = _pow2(b.num_experts)
        hidden = t.x_quant.shape[1] if quantize else 0
        if zeroed_hidden and received:
            raise MoEContractError("an EP rank's routing has no output to zero")
        self.tables, self.received, self.quantize = tables, received, quantize
        self.zeroed_hidden = zeroed_hidden
        # the first launch's programs that zero the output (route_histogram's or route_tiny's)
        zero = dict(ZERO_OUT=True, OUT_HIDDEN=zeroed_hidden) if zeroed_hidden else {}
        self.by_row = by_row = quantize and scales_by_layout_row(hidden)
        self.kernels = k
        # where the quantization writes; the fused kernel reads them through args' a_rows slots
        # (unquantized, any pointer stands in)
        quant = dict(x_quant=t.x_quant if quantize else t.meta,
                     x_quant_scale=t.x_quant_scale if quantize else t.meta, QUANTIZE=quantize)
        for kernel in (k.route_histogram, k.route_tiny):
            check_address_params(kernel)
        self.slots = slot_names()
        self.hidden = hidden
        scan_experts = min(SCAN_EXPERTS, e_pad)
        self.scan_programs = e_pad // scan_experts
        ids = triton_dtype(id_dtype)
        wave_min_l1 = WAVE_FILL * b.num_programs  # a wave's Linear-1 tiles at least
        # what the scan and the layout take, in route_offsets or route_histogram's last program
        layout = dict(
            chunk_counts=t.chunk_counts, chunk_start=t.chunk_start,
            expert_counts=t.expert_counts, scan_done=t.scan_done,
            expert_offsets=t.expert_offsets, wave_lo=t.wave_lo,
            wave_hi=t.wave_hi, wave_jumps=t.wave_jumps, meta=t.meta,
            wave_num_tiles=t.num_tiles["wave"], inter_num_tiles=t.num_tiles["interleaved"],
            NUM_EXPERTS=b.num_experts, G=b.num_programs, P1=b.l1_n_blocks, P2=b.l2_n_blocks,
            WAVE_MIN_L1=wave_min_l1, RECEIVED=received, BLOCK_M=b.block_m,
            E_PAD=e_pad, G_PAD=_pow2(b.num_programs), CHUNK=CHUNK,
            E_LOG2=e_pad.bit_length() - 1, JUMP_LEVELS=t.wave_jumps.shape[0],
            JUMP_STRIDE=t.wave_jumps.shape[1], JUMP_PAD=_pow2(b.num_experts + 1), num_warps=8)
        histogram = dict(args=t.args, error=t.error, ID_DTYPE=ids, arrival_rows=t.arrival_rows,
                         HIDDEN=hidden, QUANT_ROWS=QUANT_ROWS, **quant, **zero)
        self.wide_scan = e_pad >= SCAN_WIDE_EXPERTS  # its steps SCAN_ONE_TILE counts each
        self.scan_rows = scan_rows = min(_pow2(max(min(t.scan_chunks, b.chunks), 1)),
                                         scan_step_rows(e_pad))
        # by (scan, scales by layout row): the latter only where route_quantize lays them out
        self.histograms = {
            (scan, rows): Launcher(k.route_histogram, SCAN=scan, SCALES_BY_ROW=rows,
                                   CHUNK_ROWS=scan_rows if scan else 1,
                                   **{**layout, "num_warps": 8 if scan else 4}, **histogram)
            for scan in (False, True) for rows in {False, by_row}}
        self.offsets = Launcher(k.route_offsets, E_BLOCK=scan_experts,
                                CHUNK_ROWS=SCAN_TILE // scan_experts, **layout)
        self.quantizer = Launcher(
            k.route_quantize, args=t.args, x_quant=t.x_quant, x_quant_scale=t.x_quant_scale,
            arrival_rows=t.arrival_rows, HIDDEN=hidden, RECEIVED=received, BY_ROW=by_row,
            ROWS=QUANT_ROWS) if quantize else None
        tables_static = dict(
            expert_counts=t.expert_counts, expert_offsets=t.expert_offsets, row_src=t.row_src,
            row_slot=t.row_slot, row_origin=t.row_origin, row_ready=t.row_ready,
            wave_tiles=t.tiles["wave"], inter_tiles=t.tiles["interleaved"],
            NUM_EXPERTS=b.num_experts, G=b.num_programs, P1=b.l1_n_blocks, P2=b.l2_n_blocks,
            WAVE_MIN_L1=wave_min_l1, LEAD=b.lead_rows, MAX_TILES=b.max_tiles,
            BLOCK_M=b.block_m, E_PAD=e_pad, P_PAD=_pow2(max(b.l1_n_blocks, b.l2_n_blocks)))
        self.rows = Launcher(k.route_rows, args=t.args, chunk_start=t.chunk_start, meta=t.meta,
                             arrival_rows=t.arrival_rows, RECEIVED=received, CHUNK=CHUNK,
                             ID_DTYPE=ids, EXPERT_LEAD=b.expert_lead, wave_lo=t.wave_lo,
                             wave_hi=t.wave_hi, **tables_static)
        # one per power of two of the arrivals, bound on first use: A_PAD (and ROW_BLOCKS with
        # it) are constexprs
        self.tiny_static = dict(
            args=t.args, meta=t.meta, wave_num_tiles=t.num_tiles["wave"],
            inter_num_tiles=t.num_tiles["interleaved"], arrival_rows=t.arrival_rows,
            error=t.error, RECEIVED=received, G_PAD=_pow2(b.num_programs), ID_DTYPE=ids,
            HIDDEN=hidden, QUANT_ROWS=QUANT_ROWS, **quant, **zero, **tables_static)
        self.tiny: dict[int, Launcher] = {}

    def __call__(self, capacity: int, top_k: int, addresses: tuple[int, ...], *,
                 n_arrivals: torch.Tensor | None = None, arrival_src: torch.Tensor | None = None,
                 arrival_slot: torch.Tensor | None = None) -> None:
        """The launches on the current stream over ``capacity`` arrivals (at EP = 1 ``T *
        top_k``, each launch's arguments then fixed by ``T``: what a graph captures), the first
        (``first``) taking the call's ``addresses`` (``call_args.slot_addresses``) and writing
        them into the argument block.

        Plain stream order between them: with programmatic dependent launch (each launch
        letting the next one start at once and waiting for the previous one on the device, the
        fused kernel waiting after its setup) the whole matrix measured no better and the host
        slower (retired moe_layer records 20261203T060649Z and …060956Z, their reason). Nor
        did Hopper's bulk L2 prefetch of the first touched experts' Linear-1 weights (half of
        L2) on a side stream beside these launches, joined before the fused kernel: spread over
        256 KiB programs it took 3-8 µs, yet the graphed call took 1.015x its time and the
        graphed routing 1.21x (retired records 20261203T091721Z to …093618Z, 5e8073e-c1db3fd)."""
        t = self.tables
        # EP = 1 reads no count, sources, slots or scales: any pointer stands in
        n_ptr = n_arrivals if self.received else t.meta
        src = arrival_src if self.received else t.meta
        slot = arrival_slot if self.received else t.meta
        fanout = self.fanout(top_k)
        first, grid = self.first(capacity, top_k)
        addressed = dict(zip(self.slots, addresses))
        if self.tiny_at(capacity):
            first(grid, **addressed, arrival_src=src, arrival_slot=slot, n_arrivals_ptr=n_ptr,
                  CAPACITY=capacity, TOP_K=fanout)
            return
        first(grid, **addressed, n_arrivals_ptr=n_ptr, CAPACITY=capacity, TOP_K=fanout)
        if not self.scanned_first(capacity):
            self.offsets((self.scan_programs,), n_arrivals_ptr=n_ptr, CAPACITY=capacity)
        self.rows((triton.cdiv(capacity, CHUNK) + t.bounds.row_blocks,), arrival_src=src,
                  arrival_slot=slot, n_arrivals_ptr=n_ptr, CAPACITY=capacity, TOP_K=fanout)
        if self.quantize and not self.quantized_first(capacity, top_k):
            self.quantizer(quant_grid(capacity // fanout, self.hidden), n_arrivals_ptr=n_ptr,
                           CAPACITY=capacity, TOP_K=fanout)

    def fanout(self, top_k: int) -> int:
        """Arrivals per row of ``x``: an EP rank's arrivals are its rows, one each."""
        return 1 if self.received else top_k

    def tiny_at(self, capacity: int) -> bool:
        """Whether ``capacity`` arrivals take ``route_tiny``."""
        t = self.tables
        return capacity <= (t.tiny_received if self.received else t.tiny_arrivals)

    def scanned_first(self, capacity: int) -> bool:
        """Whether ``route_histogram``'s last program over ``capacity`` arrivals scans the
        counts (up to ``tables.scan_chunks`` chunks; on an EP rank in narrow steps, up to
        ``tables.received_scan_steps`` steps of ``scan_rows`` chunks), else ``route_offsets``'
        launch does."""
        t = self.tables
        chunks = triton.cdiv(capacity, CHUNK)
        return chunks <= t.scan_chunks or (
            self.received and not self.wide_scan
            and triton.cdiv(chunks, self.scan_rows) <= t.received_scan_steps)

    def quantized_first(self, capacity: int, top_k: int) -> bool:
        """Whether the first launch over ``capacity`` arrivals quantizes ``x`` too (its scales
        by the rows of ``x``): ``route_tiny`` does, and ``route_histogram`` up to
        ``tables.quant_rows`` rows."""
        return self.quantize and (self.tiny_at(capacity) or
                                  capacity // self.fanout(top_k) <= self.tables.quant_rows)

    def first(self, capacity: int, top_k: int) -> tuple[Launcher, tuple[int]]:
        """The first launch over ``capacity`` arrivals and its grid: the one that takes the
        call's addresses (a graph's node of it is given each call's). Up to the tiny bound,
        ``route_tiny``: two programs the arrivals' rows and the experts' tables, one per
        ``ROW_BLOCKS_TINY`` row blocks the tiles (the row blocks: one per routed expert at
        most). Else ``route_histogram``, up to ``tables.scan_chunks`` chunks with
        ``route_offsets``' work in its last program, one program a chunk. Either, where it zeroes
        the output, one program more per ``ZERO_BLOCK`` of its elements, then, where it quantizes
        (``quantized_first``), one more per block of ``_quantize_block`` (``quant_grid``), so no
        launch of its own quantizes them."""
        t = self.tables
        quantizes = self.quantized_first(capacity, top_k)
        quant = math.prod(quant_grid(capacity // self.fanout(top_k), self.hidden)) \
            if quantizes else 0
        after = triton.cdiv(capacity // top_k * self.zeroed_hidden,
                            self.kernels.ZERO_BLOCK.value) + quant
        if not self.tiny_at(capacity):
            return (self.histograms[self.scanned_first(capacity), self.by_row and not quantizes],
                    (triton.cdiv(capacity, CHUNK) + after,))
        a_pad = _pow2(capacity)
        row_blocks = min(ROW_BLOCKS_TINY, a_pad)
        tile_programs = triton.cdiv(min(a_pad, t.bounds.num_experts), row_blocks)
        launch = self.tiny.get(a_pad)
        if launch is None:
            few = min(TINY_FEW_RECEIVED, a_pad) if self.received else a_pad
            launch = self.tiny[a_pad] = Launcher(self.kernels.route_tiny, A_PAD=a_pad, A_FEW=few,
                                                 ROW_BLOCKS=row_blocks,
                                                 TILE_PROGRAMS=tile_programs,
                                                 num_warps=tiny_warps(a_pad), **self.tiny_static)
        return launch, (TINY_TABLE_PROGRAMS + tile_programs + after,)
