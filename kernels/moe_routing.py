"""Routing to tile tables on the device (paper §2.2, §4.2): the Dispatch layout and both schedules'
tile tables of the fused MoE kernels, built from the router's output without a host sync.

Device code only; the host side is ``xstage_lab/ops/moe/device_tables.py``, the reference the
tables equal entry for entry is ``xstage_lab/ops/moe/dispatch.py`` (``build_layout``) and
``schedules.py`` (``expert_wave_schedule``, ``interleaved_schedule``, ``tile_table``).

Arrivals are the rows the layer computes, in the order the reference lays them out: at EP = 1
the (token, k) picks of ``topk_ids`` (arrival ``i`` = slot ``i`` = ``t * top_k + j``, source 0,
token ``i // top_k``); for an EP rank (``RECEIVED``) the received rows, source by source, with
their local expert, source rank and slot, and their count on the device. Every buffer is sized by
a static bound, every grid by the arrivals' capacity; programs past the counts return at once.
An EP rank's count is on the device: each arrival's id, source and slot are read up to the
capacity, so their loads are issued beside the count's, not after it. On the EP = 8 rank at 1, 8
and 64 tokens that took the table passes' kernels 0.89-0.91x their time before (geometric means
per token count, every shape, two runs on either side of one with the earlier kernels: 0.6-1.0
µs less), the graphed call 0.7-1.4 µs less (medians; moe_layer/h200-x1/20261204T135607Z and
…135703Z against …135639Z).

The first launch takes the call's addresses (the router's output, the activations, the weighted
sum's tensors) as its parameters, by value, and writes them into the call's argument block
(``moe_args.py``), through which every later launch reads them: a CUDA graph captured once replays
the launches on new tensors of the same shape, that one node given each call's addresses. A writer
launch of its own cost a kernel boundary and 0.7-0.8 µs of kernel (``write_args`` in the
per-kernel profiles of the retired moe_layer/h200-x1 records 20261203T082033Z to …111957Z). With
it gone, at EP = 1 up to 512 tokens, the graphed call's time over the kernel's fell by a median
of 2.1-3.1 µs per token count (…124752Z, …125239Z against those records; on the EP rank it moved
within the runs' spread, -1.0 to +2.2 µs). No pass moves the activations into the layout: each
layout row names the row of ``x`` it reads (``row_origin``: the token at EP = 1, the received row
on an EP rank), which the fused kernel's Linear-1 gathers as it loads.

Three launches, each needing the one before it complete, and, where bf16 activations feed an FP8
layer, ``route_quantize`` (for at most ``BLOCK_M`` arrivals one launch, ``route_tiny``: programs
that each hold them all in registers, and beside them the quantizing programs; up to
``device_tables.QUANT_IN_HISTOGRAM_ROWS`` rows of ``x``, programs of ``route_histogram`` after its
chunks' quantize them instead, the scales by the rows of ``x``):
  ``route_histogram``  per chunk of ``CHUNK`` arrivals, the count of each local expert
                       (``tl.histogram``); an id outside ``0 .. E - 1`` adds 1 to ``error`` and is
                       left out of the layout; program 0 writes the argument block
                       (``_write_block``);
  ``route_offsets``    per block of experts the exclusive scan of their chunk counts (where a
                       chunk's rows of the expert start) and their counts; then, in the last
                       program to finish, every expert's row blocks and padded first row (the
                       scan over experts), the Expert-Wave waves by counted rows where an expert
                       holds more than one row block (else ``route_rows`` has them in closed
                       form), the tile count of every program of both schedules and the used
                       row blocks. Where the arrivals' bound has few chunks
                       (``device_tables.scan_chunk_bound``)
                       ``route_histogram``'s last program does all of it instead (``SCAN``): two
                       launches;
  ``route_rows``       two passes, independent given the offsets, side by side in one grid:
                       the scatter, per chunk: each arrival's rank among its expert's arrivals
                       (stable: by arrival), its padded row, ``row_src``/``row_slot``/
                       ``row_origin``; the tiles, per row block: its fused-kernel counter
                       zeroed, ``row_slot = -1`` and ``row_origin = -1`` on its padding rows,
                       and its Linear-1 and Linear-2 tiles written into both tables at their
                       closed-form positions;
  ``route_quantize``   per block of rows of ``x`` and 128 columns: e4m3 with one fp32 scale
                       per 1 x 128 block, into the tables' copy (``x_quant``); where a row's
                       scales are narrower than a line (``device_tables.scales_by_layout_row``)
                       each scale at the layout rows of the row's arrivals (after
                       ``route_rows``, whose ``arrival_rows`` it reads; the quantizing
                       programs of ``route_tiny`` and ``route_histogram``, beside their tables',
                       store them by the rows of ``x``).

Tile positions (``G`` programs, ``P_1``/``P_2`` tiles per row block, ``n_1``/``n_2`` the streams'
lengths; ``G``, ``P_1`` and ``P_2``, a layer's constants, are constexprs, so each division by them
compiles to a multiply and shift: route_tiny on the EP = 8 rank at one token had taken 2.3-3.7 µs,
more the more tiles per row block its programs place (moe_layer/h200-x1/20261204T211110Z); not yet
timed so on a GPU). Expert-Wave: the merged stream holds, per wave of row blocks ``[lo, hi)``, its
Linear-1 tiles then its Linear-2 tiles, so Linear-1 tile ``(p, n)`` is item ``lo (P_1 + P_2) + (p -
lo) P_1 + n`` and Linear-2 tile ``(p, n)`` item ``lo (P_1 + P_2) + (hi - lo) P_1 + (p - lo) P_2 +
n``; item ``k`` goes to program ``k mod G`` at position ``k div G``. Interleaved (Algorithm 1, lead
``D``): the Linear-2 stream is dealt with stride G, the Linear-1 stream by work
(``schedules.l1_deal``, in closed form: ``_l1_program``); program ``g`` merges its two streams by
key (a Linear-1 tile of row ``p_1`` by ``p_1``, a Linear-2 tile of row ``p_2`` by ``p_2 + D``,
Linear-2 first on ties), so a tile's position is its index in its own stream plus program ``g``'s
tiles of the other stream that lie before stream index ``X``: ``X = min((p_1 - D + 1) P_2, n_2)``
for Linear-1 (counted by ``_programs_below``), ``X = min((p_2 + D) P_1, n_1)`` for Linear-2 (by
``_l1_below``). With the lead counted from the expert (``EXPERT_LEAD``), ``p_2`` in the key is the
last row of its expert, and the Linear-2 rows before a Linear-1 tile are those of the experts
ending by ``p_1 - D + 1``.
"""
import triton
import triton.language as tl

from .moe_args import ARG_A_ROWS, ARG_EXPERT_IDS, ARG_X, arg_pointer, store_slots
from .moe_fused import _round_to_e4m3

TILE_L1 = tl.constexpr(0)
TILE_L2 = tl.constexpr(1)
TILE_FIELDS = tl.constexpr(4)
META_ROW_BLOCKS = tl.constexpr(0)  # meta[0]: row blocks in use; meta[1]: tiles in use
META_TILES = tl.constexpr(1)
SCALE_BLOCK = tl.constexpr(128)
E4M3_MAX = tl.constexpr(448.0)
# Up to this many arrivals (a token's picks) route_tiny's per-expert program counts each expert's
# arrivals and the routed experts below it from all (expert, arrival) pairs, not with tl.histogram
# and a scan over the experts: at one token at EP = 1 route_tiny took 3.7 µs over 512 padded
# experts (Qwen3.5, DeepSeek-V4-Pro), 2.0-2.6 µs over 256 or fewer (moe_layer/h200-x1/
# 20261204T210540Z, 20261205T041719Z), and in the sm_90 build the histogram's shared-memory
# atomics grow from 8 a thread at 256 bins to 32 at 512, every warp adding into the same bins.
# Over 64 arrivals all pairs unroll to 8400 instructions, 435 of them shared-memory stores.
PAIR_COUNT_ARRIVALS = tl.constexpr(16)
ZERO_BLOCK = tl.constexpr(2048)  # the first launch's ZERO_OUT: output elements a program zeroes


@triton.jit
def _num_arrivals(n_arrivals_ptr, CAPACITY, RECEIVED: tl.constexpr):
    """The arrivals of this call: on the device for an EP rank, the capacity at EP = 1."""
    if RECEIVED:
        return tl.load(n_arrivals_ptr)
    else:
        return CAPACITY


@triton.jit
def _zero_programs(CAPACITY, TOP_K, OUT_HIDDEN, ZERO_OUT: tl.constexpr):
    """The first launch's programs that zero the output (``_zero_out``): none unless
    ``ZERO_OUT``."""
    if ZERO_OUT:
        return tl.cdiv((CAPACITY // TOP_K) * OUT_HIDDEN, ZERO_BLOCK)
    else:
        return 0


@triton.jit
def _zero_out(z, out, CAPACITY, TOP_K, OUT_HIDDEN):
    """Program ``z`` of ``_zero_programs``: its ``ZERO_BLOCK`` elements of the output ``out``
    (bf16 ``[CAPACITY / TOP_K, OUT_HIDDEN]``, the last block partial) set to zero, for the fused
    kernel's Linear-2 epilogues to add their weighted rows into (``SUM_ATOMIC`` of
    ``moe_fused_ws.py``)."""
    at = z * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
    tl.store(out.to(tl.pointer_type(tl.bfloat16)) + at, tl.zeros([ZERO_BLOCK], tl.bfloat16),
             mask=at < (CAPACITY // TOP_K) * OUT_HIDDEN)


@triton.jit
def _write_block(args, expert_ids, x, x_scale, combine_rows, topk_weights, out, x_quant,
                 x_quant_scale, QUANTIZE: tl.constexpr, SCALES_BY_ROW: tl.constexpr):
    """The call's argument block, by the first routing launch (``moe_args``): each address
    (int64, by value) into its slot, and the fused kernel's ``a_rows`` slots: the addresses of
    the quantized copy (``x_quant``, ``x_quant_scale``) where ``QUANTIZE``, else of the
    activations and their scales as the call passed them; whether the scales lie by layout row
    (``SCALES_BY_ROW``: ``route_quantize`` lays them out so), else by the rows of ``x``."""
    store_slots(args, expert_ids, x, x_scale, combine_rows, topk_weights, out)
    if QUANTIZE:
        tl.store(args + ARG_A_ROWS, x_quant.to(tl.int64))
        tl.store(args + ARG_A_ROWS + 1, x_quant_scale.to(tl.int64))
    else:
        tl.store(args + ARG_A_ROWS, x)
        tl.store(args + ARG_A_ROWS + 1, x_scale)
    tl.store(args + ARG_A_ROWS + 2, SCALES_BY_ROW)


# The first launch's varying integers are never specialized either: one kernel per arrivals' bound
# and dtypes, whose node in a captured graph is found by its function (``call_args``).
@triton.jit(do_not_specialize=["expert_ids", "x", "x_scale", "combine_rows", "topk_weights",
                               "out", "CAPACITY", "TOP_K"])
def route_histogram(args, expert_ids, x, x_scale, combine_rows, topk_weights, out,
                    n_arrivals_ptr, chunk_counts, error, x_quant, x_quant_scale, chunk_start,
                    expert_counts, scan_done, expert_offsets, wave_lo, wave_hi, wave_jumps, meta,
                    wave_num_tiles, inter_num_tiles, arrival_rows, CAPACITY, NUM_EXPERTS,
                    G: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, WAVE_MIN_L1, TOP_K,
                    HIDDEN, RECEIVED: tl.constexpr,
                    QUANTIZE: tl.constexpr, SCALES_BY_ROW: tl.constexpr, E_PAD: tl.constexpr,
                    CHUNK: tl.constexpr, ID_DTYPE: tl.constexpr,
                    SCAN: tl.constexpr, BLOCK_M: tl.constexpr, G_PAD: tl.constexpr,
                    E_LOG2: tl.constexpr, CHUNK_ROWS: tl.constexpr, JUMP_LEVELS: tl.constexpr,
                    JUMP_STRIDE: tl.constexpr, JUMP_PAD: tl.constexpr, QUANT_ROWS: tl.constexpr,
                    OUT_HIDDEN=0, ZERO_OUT: tl.constexpr = False):
    """``chunk_counts[c, e]`` (int32 ``[chunks, NUM_EXPERTS]``): arrivals of chunk ``c`` routed to
    local expert ``e``. ``expert_ids``: the address of ``ID_DTYPE`` (int32/int64) ``[CAPACITY]``,
    the local expert of each arrival; it and the call's other addresses (``moe_args``' slots)
    by value. Program 0: ``_write_block``. ``SCAN``: the last of the chunks' programs to finish
    (a ticket on ``scan_done``, set back to 0 for the next call) then does ``route_offsets``'
    work alone, every expert's column of counts at once (``_scan_chunk_counts``, ``CHUNK_ROWS``
    chunks a step), then ``_offsets_and_waves``: where the arrivals' bound has few chunks, one
    launch and one kernel boundary fewer. Without it the scan's arguments are not read.
    ``ZERO_OUT`` (EP = 1): the programs after the chunks' zero the output (``_zero_out``), as in
    ``route_tiny``. ``QUANTIZE`` with the scales by the rows of ``x`` (not ``SCALES_BY_ROW``): the
    programs after those, where the grid has any, are ``_quantize_block``'s blocks of
    ``QUANT_ROWS`` rows and 128 columns of ``x`` (of ``HIDDEN``; ``TOP_K`` arrivals a row),
    row-major, as in ``route_tiny``: no launch of its own quantizes them."""
    c = tl.program_id(0)
    chunks = tl.cdiv(CAPACITY, CHUNK)
    first_quant = chunks + _zero_programs(CAPACITY, TOP_K, OUT_HIDDEN, ZERO_OUT)
    if c >= first_quant:
        # a runtime branch compiles both sides: the quantizing call only in a build that quantizes
        if QUANTIZE and not SCALES_BY_ROW:
            _quantize_program(c - first_quant, x, n_arrivals_ptr, x_quant, x_quant_scale,
                              arrival_rows, CAPACITY, HIDDEN, TOP_K, RECEIVED, QUANT_ROWS)
    elif c >= chunks:
        if ZERO_OUT:
            _zero_out(c - chunks, out, CAPACITY, TOP_K, OUT_HIDDEN)
    else:
        if c == 0:
            _write_block(args, expert_ids, x, x_scale, combine_rows, topk_weights, out,
                         x_quant, x_quant_scale, QUANTIZE, SCALES_BY_ROW)
        n = _num_arrivals(n_arrivals_ptr, CAPACITY, RECEIVED)
        # the chunk's ids read before the branch on the count: their load beside the count's
        e, _, valid = _flagged_experts(expert_ids.to(tl.pointer_type(ID_DTYPE)),
                                       c * CHUNK + tl.arange(0, CHUNK), n, error, NUM_EXPERTS,
                                       CAPACITY)
        if c * CHUNK < n:
            counts = tl.histogram(tl.where(valid, e, 0), E_PAD, mask=valid)
            es = tl.arange(0, E_PAD)
            tl.store(chunk_counts + c * NUM_EXPERTS + es, counts, mask=es < NUM_EXPERTS)
        if SCAN:
            tl.debug_barrier()  # every thread's counts stored before the ticket releases them
            if tl.atomic_add(scan_done, 1) == chunks - 1:  # acq_rel: the other chunks' counts
                tl.store(scan_done, 0)
                # every expert's count: the layout's, in registers
                counts = _scan_chunk_counts(chunk_counts, chunk_start, expert_counts,
                                            tl.arange(0, E_PAD), tl.cdiv(n, CHUNK),
                                            NUM_EXPERTS, CHUNK_ROWS)
                _offsets_and_waves(counts, expert_offsets, wave_lo, wave_hi, wave_jumps,
                                   meta, wave_num_tiles, inter_num_tiles, NUM_EXPERTS, G, P1,
                                   P2, WAVE_MIN_L1, BLOCK_M, E_PAD, G_PAD, E_LOG2, JUMP_LEVELS,
                                   JUMP_STRIDE, JUMP_PAD)


@triton.jit
def _arrival_experts(expert_ids, i, n, NUM_EXPERTS, CAPACITY):
    """Arrivals ``i``' local experts (int32, -1 past the count ``n``), whether each is below the
    count (``live``) and names an expert in ``0 .. NUM_EXPERTS - 1`` (``valid``). The ids are read
    up to ``CAPACITY`` (every buffer of the arrivals holds that many), so on an EP rank their
    load is in flight with the count's instead of after it."""
    return _live_experts(_load_ids(expert_ids, i, CAPACITY), i, n, NUM_EXPERTS)


@triton.jit
def _load_ids(expert_ids, i, CAPACITY):
    """Arrivals ``i``' ids as int32, up to ``CAPACITY``."""
    return tl.load(expert_ids + i, mask=i < CAPACITY, other=-1).to(tl.int32)


@triton.jit
def _live_experts(e, i, n, NUM_EXPERTS):
    """``_arrival_experts`` of the ids ``e`` of arrivals ``i``, loaded."""
    live = i < n
    e = tl.where(live, e, -1)
    return e, live, live & (e >= 0) & (e < NUM_EXPERTS)


@triton.jit
def _flagged_experts(expert_ids, i, n, error, NUM_EXPERTS, CAPACITY):
    """``_arrival_experts``, the live ones out of range added to ``error``."""
    e, live, valid = _arrival_experts(expert_ids, i, n, NUM_EXPERTS, CAPACITY)
    _flag(live, valid, error)
    return e, live, valid


@triton.jit
def _flag(live, valid, error):
    """The live arrivals whose id is out of range, added to ``error``."""
    bad = tl.sum((live & ~valid).to(tl.int32))
    if bad > 0:
        tl.atomic_add(error, bad)


@triton.jit
def _programs_below(limit, g, G):
    """``#{i >= 0 : g + i G < limit}`` elementwise: the items of program ``g``'s stride-``G``
    walk that lie before stream index ``limit``."""
    return tl.maximum(limit - g + G - 1, 0) // G


@triton.jit
def _l1_deal(row_blocks, G, P1, P2):
    """The parameters of ``schedules.l1_deal``'s closed form: ``r_2 = n_2 mod G`` (the programs
    holding one Linear-2 tile more), ``n_B = G - r_2``, ``u = w_2 div w_1`` and ``f = w_2 mod w_1``
    with ``w_1 = 2 P_2``, ``w_2 = P_1`` (``schedules.tile_work``)."""
    r2 = (row_blocks * P2) % G
    return r2, G - r2, P1 // (2 * P2), P1 % (2 * P2)


@triton.jit
def _l1_program(k, G, r2, nb, u, f):
    """Linear-1 stream index ``k`` (>= 0) -> its program and its index in that program's
    Linear-1 tiles: the first ``u n_B`` tiles round-robin over programs ``r_2 .. G-1``, then
    round-robin over all, in program order where ``f = 0``, else ``r_2 .. G-1`` first."""
    pre = k < u * nb
    rest = tl.maximum(k - u * nb, 0)
    pos = rest % G
    late = tl.where(f == 0, pos, tl.where(pos < nb, r2 + pos, pos - nb))
    g = tl.where(pre, r2 + k % nb, late)
    return g, tl.where(pre, k // nb, rest // G + tl.where(late >= r2, u, 0))


@triton.jit
def _l1_below(limit, g, G, r2, nb, u, f):
    """``#{k < limit : _l1_program(k) is g}`` elementwise: program ``g``'s Linear-1 tiles before
    stream index ``limit``, its ``u`` early ones (programs ``r_2 .. G-1`` only) and its later
    ones, one per round of ``G`` at its rank in the round."""
    late_b = g >= r2
    early = tl.where(late_b, tl.minimum(tl.maximum(limit - (g - r2) + nb - 1, 0) // nb, u), 0)
    rank = tl.where(f == 0, g, tl.where(late_b, g - r2, nb + g))
    return early + tl.maximum(limit - u * nb - rank + G - 1, 0) // G


@triton.jit
def route_offsets(chunk_counts, chunk_start, n_arrivals_ptr, expert_counts, scan_done,
                  expert_offsets, wave_lo, wave_hi, wave_jumps, meta, wave_num_tiles,
                  inter_num_tiles, CAPACITY, NUM_EXPERTS, G: tl.constexpr, P1: tl.constexpr,
                  P2: tl.constexpr, WAVE_MIN_L1, RECEIVED: tl.constexpr, BLOCK_M: tl.constexpr,
                  E_PAD: tl.constexpr,
                  E_BLOCK: tl.constexpr, G_PAD: tl.constexpr, E_LOG2: tl.constexpr,
                  CHUNK: tl.constexpr, CHUNK_ROWS: tl.constexpr, JUMP_LEVELS: tl.constexpr,
                  JUMP_STRIDE: tl.constexpr, JUMP_PAD: tl.constexpr):
    """``E_PAD / E_BLOCK`` programs, program ``b`` scanning the chunk counts of experts ``b E_BLOCK
    ..``: ``chunk_start[c, e]``, the arrivals of expert ``e`` in chunks before ``c``, and
    ``expert_counts[e]``. The last program to finish (a ticket on ``scan_done``, which it sets back
    to 0 for the next call) then lays out every expert (``_offsets_and_waves``)."""
    n = _num_arrivals(n_arrivals_ptr, CAPACITY, RECEIVED)
    _scan_chunk_counts(chunk_counts, chunk_start, expert_counts,
                       tl.program_id(0) * E_BLOCK + tl.arange(0, E_BLOCK), tl.cdiv(n, CHUNK),
                       NUM_EXPERTS, CHUNK_ROWS)
    tl.debug_barrier()  # every thread's counts stored before the ticket releases them
    if tl.atomic_add(scan_done, 1) == tl.num_programs(0) - 1:  # acq_rel: the others' counts
        tl.store(scan_done, 0)
        es = tl.arange(0, E_PAD)
        # stored by the other programs: read past this SM's L1
        counts = tl.load(expert_counts + es, mask=es < NUM_EXPERTS, other=0, cache_modifier=".cg")
        _offsets_and_waves(counts, expert_offsets, wave_lo, wave_hi, wave_jumps, meta,
                           wave_num_tiles, inter_num_tiles, NUM_EXPERTS, G, P1, P2, WAVE_MIN_L1,
                           BLOCK_M, E_PAD, G_PAD, E_LOG2, JUMP_LEVELS, JUMP_STRIDE, JUMP_PAD)


@triton.jit
def _scan_chunk_counts(chunk_counts, chunk_start, expert_counts, es, chunks, NUM_EXPERTS,
                       CHUNK_ROWS: tl.constexpr):
    """For the experts ``es``: ``chunk_start[c, e]``, the arrivals of expert ``e`` in chunks
    before ``c`` (of the ``chunks`` in use), and ``expert_counts[e]``, ``CHUNK_ROWS`` chunks a
    step; returns the counts (0 past ``NUM_EXPERTS``). The chunks' counts are read at L2
    (``.cg``): other programs stored them, in this launch or the one before."""
    in_e = es < NUM_EXPERTS
    carry = tl.zeros(es.shape, dtype=tl.int32)
    # each step loads the next rows of counts before it scans its own: the loads' latency, not
    # the scan, sets a step's time
    cs = tl.arange(0, CHUNK_ROWS)
    offs = cs[:, None] * NUM_EXPERTS + es[None, :]
    mask = (cs < chunks)[:, None] & in_e[None, :]
    h = tl.load(chunk_counts + offs, mask=mask, other=0, cache_modifier=".cg")
    for c0 in range(0, chunks, CHUNK_ROWS):
        cs_next = c0 + CHUNK_ROWS + tl.arange(0, CHUNK_ROWS)
        offs_next = cs_next[:, None] * NUM_EXPERTS + es[None, :]
        mask_next = (cs_next < chunks)[:, None] & in_e[None, :]
        h_next = tl.load(chunk_counts + offs_next, mask=mask_next, other=0, cache_modifier=".cg")
        tl.store(chunk_start + offs, carry[None, :] + tl.cumsum(h, axis=0) - h, mask=mask)
        carry += tl.sum(h, axis=0)
        h, offs, mask = h_next, offs_next, mask_next
    tl.store(expert_counts + es, carry, mask=in_e)
    return carry


@triton.jit
def _offsets_and_waves(counts, expert_offsets, wave_lo, wave_hi, wave_jumps, meta,
                       wave_num_tiles, inter_num_tiles, NUM_EXPERTS, G, P1, P2, WAVE_MIN_L1,
                       BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, G_PAD: tl.constexpr,
                       E_LOG2: tl.constexpr, JUMP_LEVELS: tl.constexpr,
                       JUMP_STRIDE: tl.constexpr, JUMP_PAD: tl.constexpr):
    """One program, from every expert's count (``counts``, int32 ``[E_PAD]``, 0 past
    ``NUM_EXPERTS``): ``expert_offsets[e]`` the padded first row of
    expert ``e`` (int32 ``[NUM_EXPERTS + 1]``, the last entry the rows in use); ``wave_lo/hi[e]``:
    the row blocks of expert ``e``'s Expert-Wave wave (``schedules.wave_starts``: a wave closes
    once its Linear-1 tiles reach ``WAVE_MIN_L1 = WAVE_FILL * G`` and routed rows remain);
    ``meta``; the tile count of each program of both schedules (``wave_num_tiles``,
    ``inter_num_tiles``: int32 ``[G]``). The waves only where an expert holds more than one row
    block (``_jump_waves``: binary lifting, its levels through ``wave_jumps``, int32 scratch
    ``[JUMP_LEVELS, JUMP_STRIDE]``, ``JUMP_STRIDE > E``, ``2**JUMP_LEVELS > E``, ``JUMP_PAD >=
    E + 1``); else ``route_rows`` has each row block's in closed form (``_one_block_wave``).
    ``E_PAD = 2**E_LOG2``. Against the binary lifting everywhere, in one job on one H200
    (route_small_probe/h200-x1/20261204T171320Z-623afeda57 against …171512Z-bd3ce01ad0, 8 and
    64 tokens, every shape), the table passes took 0.87x the time at EP = 1 (0.5-2.2 µs less,
    the most over Qwen3.5's 512 experts) and 0.92x on the EP = 8 rank (0.3-0.9 µs); at 512
    tokens 0.88x and 0.98x (moe_layer/h200-x1/20261204T172256Z-233416c4b0 against …172435Z,
    retired; per-kernel profiles). With ``route_rows``' per-expert loads hoisted above its
    row-block count as well, and the scatter's offsets gathered in registers, route_rows took
    up to 0.7 µs more (…171407Z-4fd74235de: c4e803b)."""
    es = tl.arange(0, E_PAD)
    in_e = es < NUM_EXPERTS
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    last_block = tl.cumsum(blocks, axis=0)  # inclusive: one past each expert's last row block
    first_block = last_block - blocks
    row_blocks = tl.sum(blocks)
    tl.store(expert_offsets + es, first_block * BLOCK_M, mask=in_e)
    tl.store(expert_offsets + NUM_EXPERTS, row_blocks * BLOCK_M)
    if tl.max(blocks) > 1:  # else route_rows has each wave in closed form (_one_block_wave)
        _jump_waves(first_block, last_block, row_blocks, expert_offsets, wave_lo, wave_hi,
                    wave_jumps, es, in_e, NUM_EXPERTS, P1, WAVE_MIN_L1, BLOCK_M, E_PAD, E_LOG2,
                    JUMP_LEVELS, JUMP_STRIDE, JUMP_PAD)
    _store_row_blocks(row_blocks, meta, wave_num_tiles, inter_num_tiles, G, P1, P2, G_PAD)


@triton.jit
def _one_block_wave(ps, row_blocks, w):
    """The Expert-Wave wave ``[lo, hi)`` of the row blocks ``ps`` in use where no expert holds
    more than one: a wave closes at its ``w``-th routed expert, ``w = cdiv(WAVE_MIN_L1, P1)``,
    so every wave holds ``w`` row blocks and the last the rest (``schedules.wave_starts``)."""
    lo = ps // w * w  # below row_blocks: never past the last wave
    return lo, tl.minimum(lo + w, row_blocks)


@triton.jit
def _jump_waves(first_block, last_block, row_blocks, expert_offsets, wave_lo, wave_hi, wave_jumps,
                es, in_e, NUM_EXPERTS, P1, WAVE_MIN_L1, BLOCK_M: tl.constexpr,
                E_PAD: tl.constexpr, E_LOG2: tl.constexpr, JUMP_LEVELS: tl.constexpr,
                JUMP_STRIDE: tl.constexpr, JUMP_PAD: tl.constexpr):
    """``wave_lo/hi`` of the experts ``es`` from their row blocks (``first_block``, and
    ``last_block`` one past their last) whatever their sizes, ``expert_offsets`` stored."""
    # Expert-Wave: from wave start s, the wave ends after the first expert e_fill(s) (<= E - 2)
    # whose blocks since s reach WAVE_MIN_L1 / P1, if row blocks remain after it; else at the last
    # expert. last_block is sorted, so e_fill(s) = #{e : last_block[e] < first_block[s] +
    # ceil(WAVE_MIN_L1 / P1)} (every e < s counts), a binary search per s; next(s), the start
    # after s, for every s at once. The starts are the orbit of 0 under next, found by binary
    # lifting over next's powers: log E gathers in registers, not one pass per wave. The levels
    # go through global memory: the orbit doubled in registers instead (three gathers a level)
    # took 1.09x the time in route_offsets (retired moe_layer records 20261203T062321Z, …062530Z),
    # and the orbit walked wave by wave where the row blocks allow at most 16 waves (two
    # reductions a wave) 1.01x (…074613Z, …074834Z)
    need = first_block + tl.cdiv(WAVE_MIN_L1, P1)
    sorted_last = tl.where(in_e, last_block, 1 << 30)
    e_fill = tl.zeros([E_PAD], dtype=tl.int32)
    for k in tl.static_range(E_LOG2, -1, -1):  # steps E_PAD, E_PAD / 2, ..., 1
        cand = e_fill + (1 << k)
        probe = tl.gather(sorted_last, tl.minimum(cand, E_PAD) - 1, 0)
        e_fill = tl.where((cand <= E_PAD) & (probe < need), cand, e_fill)
    fill_blocks = tl.gather(last_block, tl.minimum(e_fill, E_PAD - 1), 0)
    nxt = tl.where((e_fill <= NUM_EXPERTS - 2) & (row_blocks > fill_blocks), e_fill + 1,
                   NUM_EXPERTS)
    at = tl.arange(0, JUMP_PAD)
    jump = tl.where(at < NUM_EXPERTS, tl.gather(nxt, tl.minimum(at, E_PAD - 1), 0),
                    NUM_EXPERTS)  # E is its own next
    tl.store(wave_jumps + at, jump, mask=at <= NUM_EXPERTS)
    for k in tl.static_range(1, JUMP_LEVELS):  # jumps[k][s] = next^(2^k)(s)
        jump = tl.gather(jump, jump, 0)
        tl.store(wave_jumps + k * JUMP_STRIDE + at, jump, mask=at <= NUM_EXPERTS)
    tl.debug_barrier()  # the levels and expert_offsets, read back below
    start = tl.zeros([E_PAD], dtype=tl.int32)  # the last start <= e: 0 is one
    for k in tl.static_range(JUMP_LEVELS - 1, -1, -1):
        ahead = tl.load(wave_jumps + k * JUMP_STRIDE + start)
        start = tl.where(ahead <= es, ahead, start)
    end = tl.load(wave_jumps + start)
    tl.store(wave_lo + es, tl.load(expert_offsets + start) // BLOCK_M, mask=in_e)
    tl.store(wave_hi + es, tl.load(expert_offsets + end) // BLOCK_M, mask=in_e)


@triton.jit
def _store_row_blocks(row_blocks, meta, wave_num_tiles, inter_num_tiles, G, P1, P2,
                      G_PAD: tl.constexpr):
    """``meta`` (the row blocks and tiles in use) and the tile count of each of the ``G``
    programs in both schedules, from the row blocks in use."""
    n1 = row_blocks * P1
    n2 = row_blocks * P2
    tl.store(meta + META_ROW_BLOCKS, row_blocks)
    tl.store(meta + META_TILES, n1 + n2)
    gs = tl.arange(0, G_PAD)
    tl.store(wave_num_tiles + gs, _programs_below(n1 + n2, gs, G), mask=gs < G)
    r2, nb, u, f = _l1_deal(row_blocks, G, P1, P2)
    tl.store(inter_num_tiles + gs, _l1_below(n1, gs, G, r2, nb, u, f)
             + _programs_below(n2, gs, G), mask=gs < G)


@triton.jit
def _scatter_chunk(c, n, expert_ids, arrival_src, arrival_slot, chunk_start, expert_offsets,
                   arrival_rows, row_src, row_slot, row_origin, NUM_EXPERTS, TOP_K, CAPACITY,
                   RECEIVED: tl.constexpr, CHUNK: tl.constexpr):
    """The scatter of chunk ``c`` of the ``n`` arrivals (``route_rows``): the chunk's ids and
    sources read before the branch on the count, beside its load. The chunk sorted by (expert,
    arrival): an arrival's rank among its expert's arrivals before it is its place in its
    expert's run, so each sorted place stores its arrival's row (``_sorted_ranks``)."""
    local = tl.arange(0, CHUNK)
    i = c * CHUNK + local
    e, _, valid = _arrival_experts(expert_ids, i, n, NUM_EXPERTS, CAPACITY)
    src, slot, origin = _arrival_sources(i, arrival_src, arrival_slot, CAPACITY, TOP_K, RECEIVED)
    if c * CHUNK < n:
        at, e, rank = _sorted_ranks(tl.where(valid, e, -1), local, CHUNK)
        valid = e >= 0
        safe_e = tl.where(valid, e, 0)
        row = (tl.load(expert_offsets + safe_e, mask=valid, other=0)
               + tl.load(chunk_start + c * NUM_EXPERTS + safe_e, mask=valid, other=0) + rank)
        _store_arrival_rows(c * CHUNK + at, row, c * CHUNK + at < n, valid,
                            tl.gather(src, at, 0), tl.gather(slot, at, 0),
                            tl.gather(origin, at, 0), arrival_rows, row_src, row_slot,
                            row_origin)


@triton.jit
def _sorted_ranks(e, local, CHUNK: tl.constexpr):
    """The ``CHUNK`` arrivals of a chunk (their experts ``e``, -1 where not valid, and places
    ``local``) sorted by (expert, place): per sorted place, the arrival's place in the chunk, its
    expert and its rank among the arrivals of that expert before it (invalid ones: a run of their
    own, first). All pairs compared at once instead held ``CHUNK`` flags per thread: 138
    registers, three ``route_rows`` programs per SM, 1300 instructions a warp (Nsight Compute on
    one H200, Qwen3.5 at EP = 1 and 8192 tokens: 15.8 µs, 63% of its warps' instructions;
    ``route_ncu``). Sorted: 36 registers, and ``route_rows`` took 0.39-0.91x the time at 4096
    and 8192 tokens (four shapes, both settings; 0.39-0.78x at 8192), the whole routing
    0.64-0.96x, in one job (route_small_probe/h200-x1/20261204T195341Z-f567ecc776 and
    …195437Z-d3ccbfc09f against …195412Z-c0cdef97db). Counting against 16 or 8 of the chunk's
    arrivals a step instead of all (72 and 61 registers) took the EP rank's 0.65-0.76x at 8192
    tokens but EP = 1's 0.94-1.21x (…194419Z to …194602Z)."""
    key = tl.sort((e + 1) * CHUNK + local)
    e = key // CHUNK - 1
    run_start = (local == 0) | (e != tl.gather(e, tl.maximum(local - 1, 0), 0))
    first = tl.associative_scan(tl.where(run_start, local, 0), 0, _maximum)
    return key % CHUNK, e, local - first


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _arrival_sources(i, arrival_src, arrival_slot, CAPACITY, TOP_K, RECEIVED: tl.constexpr):
    """Arrivals ``i``' source rank, slot and row of ``x`` (``row_origin``): source 0, slot ``i``
    and token ``i // TOP_K`` at EP = 1; on an EP rank the received row's source and slot (read
    up to ``CAPACITY``, so their loads need neither the count nor the ids) and row ``i``."""
    if RECEIVED:
        in_bound = i < CAPACITY
        src = tl.load(arrival_src + i, mask=in_bound, other=0).to(tl.int32)
        slot = tl.load(arrival_slot + i, mask=in_bound, other=0).to(tl.int32)
        origin = i
    else:
        src = tl.zeros_like(i)
        slot = i
        origin = i // TOP_K
    return src, slot, origin


@triton.jit
def _store_arrival_rows(i, row, live, valid, src, slot, origin, arrival_rows, row_src, row_slot,
                        row_origin):
    """Arrivals ``i`` (``live``: below the count; ``valid``: their id in range) at their padded
    ``row``: ``arrival_rows[i]`` (-1 where not valid), and that row's ``row_src``/``row_slot``/
    ``row_origin``, ``_arrival_sources``' ``src``, ``slot`` and ``origin``."""
    tl.store(arrival_rows + i, tl.where(valid, row, -1), mask=live)
    tl.store(row_src + row, src, mask=valid)
    tl.store(row_slot + row, slot, mask=valid)
    tl.store(row_origin + row, origin, mask=valid)


@triton.jit
def route_quantize(args, n_arrivals_ptr, x_quant, x_quant_scale, arrival_rows, CAPACITY, HIDDEN,
                   TOP_K, RECEIVED: tl.constexpr, BY_ROW: tl.constexpr, ROWS: tl.constexpr):
    """Program ``(r, h)``: ``_quantize_block`` ``(r, h)`` of ``args``' activations ``x``, after
    ``route_rows``: ``BY_ROW``, each scale stored at the layout rows of the row's arrivals
    (``arrival_rows``), so that the fused kernel reads a row block's scales together."""
    _quantize_block(tl.program_id(0), tl.program_id(1), arg_pointer(args, ARG_X, tl.bfloat16, True),
                    n_arrivals_ptr, x_quant, x_quant_scale, arrival_rows, CAPACITY, HIDDEN, TOP_K,
                    RECEIVED, BY_ROW, ROWS)


@triton.jit
def _quantize_program(b, x, n_arrivals_ptr, x_quant, x_quant_scale, arrival_rows, CAPACITY,
                      HIDDEN, TOP_K, RECEIVED: tl.constexpr, QUANT_ROWS: tl.constexpr):
    """A first launch's quantizing program ``b`` (after its tables' programs):
    ``_quantize_block``'s blocks of ``x`` (the call's address, by value) row-major, the scales
    by the rows of ``x``."""
    blocks = HIDDEN // SCALE_BLOCK
    _quantize_block(b // blocks, b % blocks, tl.multiple_of(x.to(tl.pointer_type(tl.bfloat16)), 16),
                    n_arrivals_ptr, x_quant, x_quant_scale, arrival_rows, CAPACITY, HIDDEN, TOP_K,
                    RECEIVED, False, QUANT_ROWS)


@triton.jit
def _quantize_block(r, h, x, n_arrivals_ptr, x_quant, x_quant_scale, arrival_rows, CAPACITY,
                    HIDDEN, TOP_K, RECEIVED: tl.constexpr, BY_ROW: tl.constexpr,
                    ROWS: tl.constexpr):
    """Rows ``r ROWS ..`` and scale block ``h`` (columns ``h 128 ..``) of the bf16 activations
    ``x`` (the ``CAPACITY // TOP_K`` tokens at EP = 1, the received rows on an EP rank) to e4m3
    ``x_quant`` with one fp32 scale per 1 x 128 block (``x_quant_scale``: at the row of ``x``, or
    ``BY_ROW`` at the layout row of each of its ``TOP_K`` arrivals, ``arrival_rows``, none where
    an arrival has no row), as ``weights.quantize_rows_fp8``, bitwise: the scale times the
    reciprocal of the e4m3 maximum (torch's CUDA division by a scalar does so), the values times
    the IEEE reciprocal of the scale (div_rn: Triton's `/` is the approximate div.full.f32).
    Every block independent: one per program, so that many programs share an SM and their loads
    are in flight together. Against programs of eight blocks one after another (from 4096
    tokens, where they made as many programs as SMs), the pass took 0.81x the time on DiT-MoE
    (1408 columns) and 0.92-0.97x on Qwen3.5 (4096) at 4096 and 8192 tokens, 1.04x on GLM-5.x
    (6144) and DeepSeek-V4-Pro (7168) at 8192 (per-kernel profiles; moe_layer/h200-x1/
    20261204T183803Z-63b2bf9dea against …183850Z-9c19123ed0, …184307Z-6613df5091 against
    …184400Z-6669c9fbcd, one job each; …183850Z and …184400Z retired, their bytes at 4c1757f)."""
    i = r * ROWS + tl.arange(0, ROWS)
    # an EP rank's arrivals are its rows (TOP_K 1); at EP = 1 each token is TOP_K arrivals
    n = _num_arrivals(n_arrivals_ptr, CAPACITY, RECEIVED) // TOP_K
    if r * ROWS < n:
        live = i < n
        rows64 = i.to(tl.int64)
        k_scales = HIDDEN // SCALE_BLOCK
        cols = h * SCALE_BLOCK + tl.arange(0, SCALE_BLOCK)
        at = rows64[:, None] * HIDDEN + cols[None, :]
        v = tl.load(x + at, mask=live[:, None]).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-12) * (1.0 / E4M3_MAX)
        inv = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), scale)
        q = _round_to_e4m3(v * inv[:, None]).to(tl.float8e4nv)
        tl.store(x_quant + at, q, mask=live[:, None])
        if BY_ROW:
            for j in range(TOP_K):
                row = tl.load(arrival_rows + rows64 * TOP_K + j, mask=live, other=-1)
                tl.store(x_quant_scale + row.to(tl.int64) * k_scales + h, scale, mask=row >= 0)
        else:
            tl.store(x_quant_scale + rows64 * k_scales + h, scale, mask=live)


@triton.jit
def _store_entries(at, kind: tl.constexpr, expert, row_block, n_block, mask):
    """Table entries ``(kind, expert, row_block, n_block)`` at the entry pointers ``at`` (the
    fields broadcast to its shape)."""
    zero = tl.zeros(at.shape, tl.int32)
    tl.store(at, zero + kind, mask=mask)
    tl.store(at + 1, zero + expert, mask=mask)
    tl.store(at + 2, zero + row_block, mask=mask)
    tl.store(at + 3, zero + n_block, mask=mask)


@triton.jit
def route_rows(args, arrival_src, arrival_slot, n_arrivals_ptr, chunk_start, expert_counts,
               expert_offsets, wave_lo, wave_hi, meta, arrival_rows, row_src, row_slot,
               row_origin, row_ready, wave_tiles, inter_tiles, CAPACITY, NUM_EXPERTS, TOP_K,
               G: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, WAVE_MIN_L1, LEAD, MAX_TILES,
               RECEIVED: tl.constexpr, CHUNK: tl.constexpr,
               ID_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
               P_PAD: tl.constexpr, EXPERT_LEAD: tl.constexpr):
    """The scatter and the tiles, independent once the offsets are laid out, in one launch.
    Program ``c`` below ``cdiv(CAPACITY, CHUNK)``: chunk ``c`` of the arrivals (``_scatter_chunk``:
    ``arrival_rows[i]`` = ``expert_offsets[e] + chunk_start[c, e]`` + the arrivals of ``e``
    before ``i`` in its chunk; ``row_src``/``row_slot`` of that row, source 0 and slot ``i`` at
    EP = 1, and ``row_origin``, token ``i // TOP_K`` at EP = 1, received row ``i`` on an EP
    rank; out-of-range ids get no row, ``route_histogram`` flagged them). Each program after
    them: one row block ``p`` (up to the row blocks' bound), its fused-kernel counter
    ``row_ready[p]`` zeroed (its Linear-1 tiles count into it) and ``_row_block_tiles`` where
    ``p`` is in use. The two write disjoint rows: the scatter the routed ones, the tiles the
    padding."""
    q = tl.program_id(0)
    chunks = tl.cdiv(CAPACITY, CHUNK)
    if q < chunks:
        # the ids' address and the count loaded side by side
        ids = arg_pointer(args, ARG_EXPERT_IDS, ID_DTYPE, False)
        _scatter_chunk(q, _num_arrivals(n_arrivals_ptr, CAPACITY, RECEIVED), ids, arrival_src,
                       arrival_slot, chunk_start, expert_offsets, arrival_rows, row_src,
                       row_slot, row_origin, NUM_EXPERTS, TOP_K, CAPACITY, RECEIVED, CHUNK)
    else:
        p = q - chunks
        tl.store(row_ready + p, 0)
        row_blocks = tl.load(meta + META_ROW_BLOCKS)
        # a program past the rows in use returns here: the grid is the capacity's bound (an EP
        # rank's, about eight times its arrivals), and the expert search over every expert
        # costs each program the same (Qwen3.5's EP rank at 8192 tokens on one H200: 13.1-13.3
        # µs without this exit, moe_layer/h200-x1/20261202T212234Z; 4.6-4.7 µs with it,
        # …212723Z; both retired)
        if p < row_blocks:
            _row_block_tiles(p + tl.arange(0, 1), row_blocks, expert_counts, expert_offsets,
                             wave_lo, wave_hi, row_src, row_slot, row_origin, wave_tiles,
                             inter_tiles, NUM_EXPERTS, G, P1, P2, WAVE_MIN_L1, LEAD, MAX_TILES,
                             BLOCK_M, E_PAD, P_PAD, EXPERT_LEAD)


@triton.jit
def _row_block_tiles(ps, row_blocks, expert_counts, expert_offsets, wave_lo, wave_hi, row_src,
                     row_slot, row_origin, wave_tiles, inter_tiles, NUM_EXPERTS, G, P1, P2,
                     WAVE_MIN_L1, LEAD, MAX_TILES, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                     P_PAD: tl.constexpr, EXPERT_LEAD: tl.constexpr):
    """Each row block ``p`` of ``ps`` below ``row_blocks``: its expert ``e(p)`` (``first_row[e]
    <= p * BLOCK_M < first_row[e] + blocks[e] * BLOCK_M``), its wave (``wave_lo/hi[e(p)]``, or
    in closed form where no expert holds more than one row block: ``_one_block_wave``), the
    Interleaved merge keys, then ``_write_row_blocks``. ``EXPERT_LEAD``: the lead counted from
    the end of each Linear-2 tile's expert (``schedules.leads_from_expert``), so a Linear-2 tile
    of row ``p`` waits for the Linear-1 tiles of rows below ``end(e(p)) - 1 + LEAD``, and a
    Linear-1 tile of row ``p`` follows the Linear-2 tiles of every expert whose end is at most
    ``p - LEAD + 1`` (the ends rise with the experts, so those rows are a prefix)."""
    used = ps < row_blocks
    es = tl.arange(0, E_PAD)
    in_e = es < NUM_EXPERTS
    first = tl.load(expert_offsets + es, mask=in_e, other=0) // BLOCK_M
    count = tl.load(expert_counts + es, mask=in_e, other=0)
    last = first + (count + BLOCK_M - 1) // BLOCK_M
    owns = in_e[None, :] & (first[None, :] <= ps[:, None]) & (ps[:, None] < last[None, :])
    e = tl.sum(tl.where(owns, es[None, :], 0), axis=1)
    first_row = tl.sum(tl.where(owns, first[None, :], 0), axis=1) * BLOCK_M
    rows_used = tl.sum(tl.where(owns, count[None, :], 0), axis=1)
    if tl.max(count) <= BLOCK_M:
        lo, hi = _one_block_wave(ps, row_blocks, tl.cdiv(WAVE_MIN_L1, P1))
    else:
        lo = tl.load(wave_lo + e, mask=used, other=0)
        hi = tl.load(wave_hi + e, mask=used, other=0)
    if EXPERT_LEAD:
        l2_key = tl.sum(tl.where(owns, last[None, :], 0), axis=1) - 1 + LEAD
        done = in_e[None, :] & (last[None, :] <= (ps - LEAD + 1)[:, None])
        l2_before = tl.max(tl.where(done, last[None, :], 0), axis=1)
    else:
        l2_key = ps + LEAD
        l2_before = ps - LEAD + 1
    _write_row_blocks(ps, used, e, first_row, rows_used, lo, hi, row_blocks, l2_key, l2_before,
                      row_src, row_slot, row_origin, wave_tiles, inter_tiles, G, P1, P2,
                      MAX_TILES, BLOCK_M, P_PAD)


@triton.jit
def _write_row_blocks(ps, used, e, first_row, rows_used, lo, hi, row_blocks, l2_key, l2_before,
                      row_src, row_slot, row_origin, wave_tiles, inter_tiles, G, P1, P2,
                      MAX_TILES, BLOCK_M: tl.constexpr, P_PAD: tl.constexpr):
    """Each row block ``p`` of ``ps`` where ``used`` (expert ``e``, whose rows start at
    ``first_row`` and hold ``rows_used`` routed rows; its Expert-Wave wave the row blocks ``[lo,
    hi)``): ``row_slot = -1``, ``row_origin = -1`` and ``row_src = 0`` on its rows past the
    expert's count, and its ``P1`` Linear-1 and ``P2`` Linear-2 entries ``(kind, e, p, n)`` in the
    Expert-Wave table ``wave_tiles`` and the Interleaved table ``inter_tiles`` (int32 ``[G,
    MAX_TILES, 4]``) at their positions. Interleaved's merge: its Linear-2 tiles follow the
    Linear-1 tiles of rows below ``l2_key`` (the row lead: ``p + D``), its Linear-1 tiles the
    Linear-2 tiles of rows below ``l2_before`` (``p - D + 1``)."""
    r = ps[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    pad = used[:, None] & (r - first_row[:, None] >= rows_used[:, None])
    tl.store(row_slot + r, tl.full(r.shape, -1, tl.int32), mask=pad)
    tl.store(row_origin + r, tl.full(r.shape, -1, tl.int32), mask=pad)
    tl.store(row_src + r, tl.zeros(r.shape, dtype=tl.int32), mask=pad)
    lo = lo[:, None]
    hi = hi[:, None]
    p = ps[:, None]
    n1 = row_blocks * P1
    n2 = row_blocks * P2
    r2, nb, u, f = _l1_deal(row_blocks, G, P1, P2)
    ns = tl.arange(0, P_PAD)[None, :]
    for kind in tl.static_range(2):
        if kind == 0:
            n_blocks = P1
            k = p * P1 + ns  # index in the Linear-1 stream
            wave_k = lo * (P1 + P2) + (p - lo) * P1 + ns
            g, own = _l1_program(k, G, r2, nb, u, f)
            other = _programs_below(tl.minimum(l2_before[:, None] * P2, n2), g, G)
        else:
            n_blocks = P2
            k = p * P2 + ns
            wave_k = lo * (P1 + P2) + (hi - lo) * P1 + (p - lo) * P2 + ns
            g, own = k % G, k // G
            other = _l1_below(tl.minimum(l2_key[:, None] * P1, n1), g, G, r2, nb, u, f)
        live = used[:, None] & (ns < n_blocks)
        _store_entries(wave_tiles + ((wave_k % G) * MAX_TILES + wave_k // G) * TILE_FIELDS,
                       kind, e[:, None], p, ns, live)
        _store_entries(inter_tiles + (g * MAX_TILES + own + other) * TILE_FIELDS, kind,
                       e[:, None], p, ns, live)


@triton.jit(do_not_specialize=["expert_ids", "x", "x_scale", "combine_rows", "topk_weights",
                               "out", "CAPACITY", "TOP_K"])
def route_tiny(args, expert_ids, x, x_scale, combine_rows, topk_weights, out, arrival_src,
               arrival_slot, n_arrivals_ptr, expert_counts, expert_offsets, meta, wave_num_tiles,
               inter_num_tiles, arrival_rows, row_src, row_slot, row_origin, row_ready,
               wave_tiles, inter_tiles, error, x_quant, x_quant_scale, CAPACITY, NUM_EXPERTS,
               G: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, WAVE_MIN_L1, LEAD, MAX_TILES,
               TOP_K, HIDDEN, RECEIVED: tl.constexpr,
               QUANTIZE: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
               A_PAD: tl.constexpr, A_FEW: tl.constexpr, G_PAD: tl.constexpr,
               ID_DTYPE: tl.constexpr, P_PAD: tl.constexpr, ROW_BLOCKS: tl.constexpr,
               TILE_PROGRAMS: tl.constexpr, QUANT_ROWS: tl.constexpr, OUT_HIDDEN=0,
               ZERO_OUT: tl.constexpr = False):
    """Every table of the three launches, for at most ``BLOCK_M`` arrivals (``CAPACITY <= A_PAD
    <= BLOCK_M``, a power of two), from the arrivals held in registers, with no pass and no step
    through memory between them. So few arrivals give each expert at most one row block, which
    makes every step closed-form. Programs side by side, each reading the ids:
      program 0  the argument block (``_write_block``, from the call's addresses by value, as in
                 ``route_histogram``), then each arrival's row (``_tiny_layout``);
      program 1  ``_tiny_experts``: the per-expert tables (counts, padded offsets), the
                 tile count of every program of both schedules and the row counters in use
                 zeroed, which no later step of the call waits for;
      programs 2 .. 2 + TILE_PROGRAMS - 1  ``_tiny_tiles``: ``ROW_BLOCKS`` row blocks each,
                 their tiles and padding rows (``TILE_PROGRAMS`` cover the row blocks' bound,
                 one per routed expert: at most ``min(A_PAD, E_PAD)``).
    Each holds ``A_PAD`` arrivals, or ``A_FEW`` (a power of two, at most ``A_PAD``) where the
    count is at most that: an EP rank's count is on the device, under a bound of about eight
    times the rows it receives (``_tiny_tables``).
    One program doing the tables took 10.9 µs at one token of Qwen3.5 (512 experts) and 6.8 µs of
    GLM-5.x (256), each step of the per-expert scan, its reductions and its broadcasts into the
    row blocks' experts a round of barriers among its warps (moe_layer/h200-x1/
    20261203T124752Z-aee52a93dd; Nsight Compute: 23 k cycles over 14 k warp instructions).
    Ids out of range add to ``error`` and get no row, as in ``route_histogram``. ``ZERO_OUT``
    (EP = 1): the programs after those zero the output (``_zero_out``). ``QUANTIZE``: the
    programs after those are ``_quantize_block``'s blocks of ``QUANT_ROWS`` rows and 128
    columns of ``x``, row-major (the fused kernel's quantized rows, ``x_quant``, without
    a launch of their own)."""
    q = tl.program_id(0)
    first_zero = 2 + TILE_PROGRAMS
    first_quant = first_zero + _zero_programs(CAPACITY, TOP_K, OUT_HIDDEN, ZERO_OUT)
    if q >= first_quant:
        if QUANTIZE:
            _quantize_program(q - first_quant, x, n_arrivals_ptr, x_quant, x_quant_scale,
                              arrival_rows, CAPACITY, HIDDEN, TOP_K, RECEIVED, QUANT_ROWS)
    elif q >= first_zero:
        if ZERO_OUT:
            _zero_out(q - first_zero, out, CAPACITY, TOP_K, OUT_HIDDEN)
    else:
        n = _num_arrivals(n_arrivals_ptr, CAPACITY, RECEIVED)
        ids = expert_ids.to(tl.pointer_type(ID_DTYPE))
        few = _load_ids(ids, tl.arange(0, A_FEW), CAPACITY)  # in flight with the count
        many = False
        if A_FEW < A_PAD:
            many = n > A_FEW
        if many:
            _tiny_tables(q, n, _load_ids(ids, tl.arange(0, A_PAD), CAPACITY), args, expert_ids,
                         x, x_scale, combine_rows, topk_weights, out, arrival_src, arrival_slot,
                         expert_counts, expert_offsets, meta, wave_num_tiles, inter_num_tiles,
                         arrival_rows, row_src, row_slot, row_origin, row_ready, wave_tiles,
                         inter_tiles, error, x_quant, x_quant_scale, CAPACITY, NUM_EXPERTS, G,
                         P1, P2, WAVE_MIN_L1, LEAD, MAX_TILES, TOP_K, RECEIVED, QUANTIZE,
                         BLOCK_M, E_PAD, A_PAD, G_PAD, P_PAD, ROW_BLOCKS)
        else:
            _tiny_tables(q, n, few, args, expert_ids, x, x_scale, combine_rows, topk_weights,
                         out, arrival_src, arrival_slot, expert_counts, expert_offsets, meta,
                         wave_num_tiles, inter_num_tiles, arrival_rows, row_src, row_slot,
                         row_origin, row_ready, wave_tiles, inter_tiles, error, x_quant,
                         x_quant_scale, CAPACITY, NUM_EXPERTS, G, P1, P2, WAVE_MIN_L1, LEAD,
                         MAX_TILES, TOP_K, RECEIVED, QUANTIZE, BLOCK_M, E_PAD, A_FEW, G_PAD,
                         P_PAD, ROW_BLOCKS)


@triton.jit
def _tiny_tables(q, n, ids, args, expert_ids, x, x_scale, combine_rows, topk_weights, out,
                 arrival_src, arrival_slot, expert_counts, expert_offsets, meta, wave_num_tiles,
                 inter_num_tiles, arrival_rows, row_src, row_slot, row_origin, row_ready,
                 wave_tiles, inter_tiles, error, x_quant, x_quant_scale, CAPACITY, NUM_EXPERTS,
                 G, P1, P2, WAVE_MIN_L1, LEAD, MAX_TILES, TOP_K, RECEIVED: tl.constexpr,
                 QUANTIZE: tl.constexpr, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                 A: tl.constexpr, G_PAD: tl.constexpr, P_PAD: tl.constexpr,
                 ROW_BLOCKS: tl.constexpr):
    """``route_tiny``'s program ``q`` (one of its tables') over the ``n`` arrivals, at most
    ``A``, whose ids it holds (``ids``: ``_load_ids`` of the first ``A``). On the EP = 8 rank
    all pairs of a bound of 128 arrivals took route_tiny 6.4 µs where DiT-MoE's eight tokens
    had sent it 17 rows, 7.2 µs where Qwen3.5's one token 11; a bound of 16 (DiT-MoE, one
    token, 2 rows) took 2.3 µs (per-kernel profiles, moe_layer/h200-x1/
    20261204T151107Z-559641b29b)."""
    i = tl.arange(0, A)
    e, live, valid = _live_experts(ids, i, n, NUM_EXPERTS)
    if q == 1:  # the one program that flags bad ids
        _flag(live, valid, error)
        _tiny_experts(e, valid, expert_counts, expert_offsets, meta, wave_num_tiles,
                      inter_num_tiles, row_ready, NUM_EXPERTS, G, P1, P2, BLOCK_M, E_PAD, G_PAD,
                      A)
    else:
        e = tl.where(valid, e, -1)
        rank, first, block, rows_of, row_blocks = _tiny_layout(i, e, valid, A, E_PAD)
        if q == 0:
            # An EP rank's sources and slots loaded beside the ids instead, before the layout's
            # reductions, took route_tiny as long on the EP = 8 rank on one H100 (0.998x at one
            # token, 1.001x at eight: moe_layer/h100-80gb-hbm3-x1/20261206T090836Z,
            # retired, bytes at 0b5060f): program 0 is not its longest path
            src, slot, origin = _arrival_sources(i, arrival_src, arrival_slot, CAPACITY,
                                                 TOP_K, RECEIVED)
            # its quantizing programs run beside the layout's: the scales by the rows of x
            _write_block(args, expert_ids, x, x_scale, combine_rows, topk_weights, out,
                         x_quant, x_quant_scale, QUANTIZE, False)
            _store_arrival_rows(i, block * BLOCK_M + rank, live, valid, src, slot, origin,
                                arrival_rows, row_src, row_slot, row_origin)
        else:
            _tiny_tiles((q - 2) * ROW_BLOCKS + tl.arange(0, ROW_BLOCKS), e, first, block,
                        rows_of, row_blocks, tl.cdiv(WAVE_MIN_L1, P1), row_src, row_slot,
                        row_origin, wave_tiles, inter_tiles, G, P1, P2, LEAD, MAX_TILES, BLOCK_M,
                        P_PAD)


@triton.jit
def _tiny_layout(i, e, valid, A_PAD: tl.constexpr, E_PAD: tl.constexpr):
    """The layout of the arrivals ``i`` (their experts ``e``, -1 where not ``valid``): each
    arrival's rank among its expert's arrivals (stable: by arrival, from all pairs), whether it
    is its expert's first, its expert's row block (the distinct routed experts below it) and
    routed rows, and the row blocks in use. Each expert's row block and routed rows come from all
    pairs of arrivals where they are fewer than the experts, else from the scan over experts.
    At EP = 1 and one token, with the tiles one program's, ``route_tiny`` took 3.5-5.4 µs, 0.39-0.88
    of the one-program kernel's time (moe_layer/h200-x1/20261203T144356Z-0c9720c057 against
    …124752Z-aee52a93dd); on an EP rank's 128 received rows over 64 local experts or fewer, with
    the scan, 0.91-1.14 (…144229Z-0c8c01d917 against …124542Z-44ce83fd5a), where all pairs had
    taken 1.08-1.58 (…142223Z, retired)."""
    same, rank, first = _pair_ranks(i, e, valid)
    if A_PAD <= E_PAD:
        block = tl.sum((first[None, :] & (e[None, :] < e[:, None])).to(tl.int32), axis=1)
        rows_of = tl.sum(same.to(tl.int32), axis=1)
        row_blocks = tl.sum(first.to(tl.int32))
    else:
        safe_e = tl.where(valid, e, 0)
        count = tl.histogram(safe_e, E_PAD, mask=valid)
        blocks = (count > 0).to(tl.int32)
        block = tl.gather(tl.cumsum(blocks, axis=0) - blocks, safe_e, 0)
        rows_of = tl.gather(count, safe_e, 0)
        row_blocks = tl.sum(blocks)
    return rank, first, block, rows_of, row_blocks


@triton.jit
def _pair_ranks(i, e, valid):
    """From all pairs of the arrivals ``i`` (their experts ``e``): whether two share an expert,
    both ``valid`` (``same``); each arrival's rank among its expert's arrivals (stable: by
    arrival); whether it is its expert's first."""
    same = (e[:, None] == e[None, :]) & valid[:, None] & valid[None, :]
    rank = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
    return same, rank, valid & (rank == 0)


@triton.jit
def _tiny_tiles(ps, e, first, block, rows_of, row_blocks, w, row_src, row_slot, row_origin,
                wave_tiles, inter_tiles, G, P1, P2, LEAD, MAX_TILES, BLOCK_M: tl.constexpr,
                P_PAD: tl.constexpr):
    """``route_tiny``'s row blocks ``ps`` (``_tiny_layout``'s arrivals): a row block's expert and
    routed rows are those of the first arrival in it; its wave ``_one_block_wave``'s; the tiles
    and padding rows, as in ``route_rows``, of those in use (``_write_row_blocks``)."""
    if tl.min(ps) < row_blocks:
        starts = first[None, :] & (block[None, :] == ps[:, None])
        lo, hi = _one_block_wave(ps, row_blocks, w)
        # every expert holds one row block: the lead counted from its end is the row lead
        _write_row_blocks(ps, ps < row_blocks, tl.sum(tl.where(starts, e[None, :], 0), axis=1),
                          ps * BLOCK_M, tl.sum(tl.where(starts, rows_of[None, :], 0), axis=1),
                          lo, hi, row_blocks, ps + LEAD, ps - LEAD + 1, row_src, row_slot,
                          row_origin, wave_tiles, inter_tiles, G, P1, P2, MAX_TILES, BLOCK_M,
                          P_PAD)


@triton.jit
def _tiny_experts(e, valid, expert_counts, expert_offsets, meta, wave_num_tiles, inter_num_tiles,
                  row_ready, NUM_EXPERTS, G, P1, P2, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr,
                  G_PAD: tl.constexpr, A_PAD: tl.constexpr):
    """``route_tiny``'s program 1: every expert's count and padded first row (at most one row
    block each: the tiles' programs find each wave in closed form, ``_one_block_wave``);
    ``meta`` and the tile counts of both schedules; the fused kernel's counters of the row
    blocks in use zeroed (one per routed expert: at most ``A_PAD``, the arrivals' bound). The
    counts and first rows from all pairs up to ``PAIR_COUNT_ARRIVALS`` arrivals (an arrival is
    its expert's first where no earlier one shares it), else by histogram and scan."""
    es = tl.arange(0, E_PAD)
    in_e = es < NUM_EXPERTS
    if A_PAD <= PAIR_COUNT_ARRIVALS:
        _, _, first = _pair_ranks(tl.arange(0, A_PAD), e, valid)
        count = tl.sum(((e[None, :] == es[:, None]) & valid[None, :]).to(tl.int32), axis=1)
        first_block = tl.sum((first[None, :] & (e[None, :] < es[:, None])).to(tl.int32), axis=1)
        row_blocks = tl.sum(first.to(tl.int32))
    else:
        count = tl.histogram(tl.where(valid, e, 0), E_PAD, mask=valid)
        blocks = (count > 0).to(tl.int32)
        first_block = tl.cumsum(blocks, axis=0) - blocks
        row_blocks = tl.sum(blocks)
    tl.store(expert_counts + es, count, mask=in_e)
    tl.store(expert_offsets + es, first_block * BLOCK_M, mask=in_e)
    tl.store(expert_offsets + NUM_EXPERTS, row_blocks * BLOCK_M)
    _store_row_blocks(row_blocks, meta, wave_num_tiles, inter_num_tiles, G, P1, P2, G_PAD)
    ps = tl.arange(0, A_PAD)
    tl.store(row_ready + ps, tl.zeros([A_PAD], tl.int32), mask=ps < row_blocks)
