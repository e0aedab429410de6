"""One program's own row of the fused MoE's tile table, derived on the program from the router's
ids, in Gluon: what each program of ``moe_fused_ws.py``'s routed entry computes before its tiles
(issue 27), so that a call of at most ``BLOCK_M`` arrivals (every routed expert one row block;
``xstage_lab/ops/moe/routed.py``) needs no routing launch.

Device code only. The host reference is ``xstage_lab/ops/moe/table_reference.program_tiles``
(each row equal to the schedules' own, ``tests/ops/moe/test_table_reference.py``); the closed
forms are ``moe_routing.py``'s, solved for the tiles of one program instead of the program of
each tile, so each program computes a few entries, not the whole table:
  Expert-Wave   stream items ``g + j G``; a wave holds ``w = cdiv(WAVE_MIN_L1, P_1)`` row blocks
                (the last the rest), its Linear-1 tiles then its Linear-2 tiles;
  Interleaved   Linear-2 stream indices ``g + j G`` at position ``j`` plus the program's
                Linear-1 tiles below ``min((p_2 + D) P_1, n_1)``; Linear-1 indices
                (``schedules.l1_deal`` in closed form) ``(g - r_2) + j n_B`` for ``j < u`` where
                ``g >= r_2``, then ``u n_B + rank_g + m G``, at their own index plus the
                program's Linear-2 tiles below ``min((p_1 - D + 1) P_2, n_2)``.
A row block is a routed expert, in ascending order: row block ``p`` is the expert with ``p``
routed experts below it. Ids out of range get no row block and add to ``error`` (program 0).

Each program holds the ``A`` ids along the second axis of one blocked layout and ``PAIR_ROWS`` of
them at a time along the first, so that the pairwise counts reduce to either axis without a
layout conversion; a program's entries lie along the first axis, ``J`` at a time, and find their
row blocks' experts among the arrivals. Every program writes the row maps of its own tiles' row
blocks (the same values where programs share a row block), so that no program reads another's.
An FP8 layer's bf16 rows: each program quantizes those its Linear-1 tiles read
(``quantize_rows``), as the routing's quantizing programs do, bitwise.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

TILE_L1 = gl.constexpr(0)
TILE_L2 = gl.constexpr(1)
TILE_FIELDS = gl.constexpr(4)
BLOCK_M = gl.constexpr(128)  # rows of a row block: the fused kernel's
SCALE_BLOCK = gl.constexpr(128)
E4M3_MAX = gl.constexpr(448.0)
# scale blocks of a row quantized at a time: a block a warp, its maximum within the warp, 4
# values a thread (with 8, the 256-wide FP8 build spilled 12 bytes at 32 arrivals too)
QUANT_STEP = gl.constexpr(4)
# the default partition's four warps, before the persistent kernel specializes them
PAIRS = gl.constexpr(gl.BlockedLayout([1, 1], [1, 32], [4, 1], [1, 0]))
PAIR_ROWS = gl.constexpr(32)  # arrivals paired with all the others at a time (routed_experts)


@gluon.jit
def _ids(ids, start, n, NUM_EXPERTS, axis: gl.constexpr, A: gl.constexpr):
    """The arrivals ``start .. start + A - 1`` along ``axis`` of ``PAIRS``: their expert ids
    (int32, -1 past the count ``n``), whether each is below the count (``live``) and names an
    expert in ``0 .. NUM_EXPERTS - 1`` (``valid``)."""
    i = start + gl.arange(0, A, layout=gl.SliceLayout(1 - axis, PAIRS))
    live = i < n
    e = gl.load(ids + i, mask=live, other=-1).to(gl.int32)
    return i, e, live, live & (e >= 0) & (e < NUM_EXPERTS)


@gluon.jit
def routed_experts(ids, n, error, flag, NUM_EXPERTS, A: gl.constexpr):
    """From the first ``n`` of at most ``A`` ids, along ``PAIRS``' second axis, of each arrival:
    its expert, whether it is its expert's first (the one that names its row block), its row
    block, its rank among its expert's arrivals (stable: by arrival) and whether its id is valid
    (routed); and the row blocks in use. The pairs of arrivals ``PAIR_ROWS`` rows at a time, so
    that a program holds ``PAIR_ROWS * A / 128`` of them a thread, whatever ``A``. Where
    ``flag``, the live ids out of range added to ``error``."""
    i_c, e_c, live_c, valid_c = _ids(ids, 0, n, NUM_EXPERTS, 1, A)
    bad = gl.sum((live_c & ~valid_c).to(gl.int32), axis=0)
    if flag & (bad > 0):
        gl.atomic_add(error, bad)
    rank_c = gl.zeros_like(i_c)
    block_c = gl.zeros_like(i_c)
    rows: gl.constexpr = PAIR_ROWS if PAIR_ROWS < A else A
    for r0 in range(0, A, rows):
        i_r, e_r, live_r, valid_r = _ids(ids, r0, n, NUM_EXPERTS, 0, rows)
        same = (e_r[:, None] == e_c[None, :]) & valid_r[:, None] & valid_c[None, :]
        # an arrival is its expert's first where no earlier one shares it; its row block, the
        # routed experts below its own
        rank_c += gl.sum((same & (i_r[:, None] < i_c[None, :])).to(gl.int32), axis=0)
        first_r = valid_r & (gl.sum((same & (i_c[None, :] < i_r[:, None])).to(gl.int32),
                                    axis=1) == 0)
        block_c += gl.sum((first_r[:, None] & (e_r[:, None] < e_c[None, :])).to(gl.int32),
                          axis=0)
    first_c = valid_c & (rank_c == 0)
    return (gl.where(valid_c, e_c, -1), first_c, block_c, rank_c, valid_c,
            gl.sum(first_c.to(gl.int32), axis=0))


@gluon.jit
def arrival_sources(arrival_src, arrival_slot, CAPACITY, TOP_K, RECEIVED: gl.constexpr,
                    A: gl.constexpr):
    """Each arrival's source rank, slot and row of ``x`` (along ``PAIRS``' second axis): source
    0, slot ``i`` and token ``i // TOP_K`` at EP = 1; on an EP rank the received row's source and
    slot (read up to ``CAPACITY``) and row ``i``."""
    i = gl.arange(0, A, layout=gl.SliceLayout(0, PAIRS))
    if RECEIVED:
        src = gl.load(arrival_src + i, mask=i < CAPACITY, other=0).to(gl.int32)
        slot = gl.load(arrival_slot + i, mask=i < CAPACITY, other=0).to(gl.int32)
        origin = i
    else:
        src = gl.zeros_like(i)
        slot = i
        origin = i // TOP_K
    return src, slot, origin


@gluon.jit
def _row_block_maps(p, block_c, rank_c, valid_c, src, slot, origin, row_src, row_slot,
                    row_origin):
    """The rows of row block ``p``: ``row_src``/``row_slot``/``row_origin`` of its routed rows
    (the arrival's source, slot and row of ``x``, from the arrivals' side) and of its padding
    rows (0, -1, -1). One row block at a time, in vectors of the arrivals and of its rows: the
    program holds few registers before its partitions take them."""
    routed = valid_c & (block_c == p)
    rows = gl.sum(routed.to(gl.int32), axis=0)
    at = p * BLOCK_M + rank_c
    gl.store(row_src + at, src, mask=routed)
    gl.store(row_slot + at, slot, mask=routed)
    gl.store(row_origin + at, origin, mask=routed)
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, PAIRS))
    pad = r >= rows
    at = p * BLOCK_M + r
    gl.store(row_src + at, gl.zeros_like(r), mask=pad)
    gl.store(row_slot + at, gl.full_like(r, -1), mask=pad)
    gl.store(row_origin + at, gl.full_like(r, -1), mask=pad)


@gluon.jit
def _programs_below(limit, g, G):
    """``#{j >= 0 : g + j G < limit}``: program ``g``'s stride-``G`` items before ``limit``."""
    return gl.maximum(limit - g + G - 1, 0) // G


@gluon.jit
def _l1_deal(row_blocks, g, G, P1, P2):
    """``l1_deal``'s closed form seen from program ``g``: ``r_2 = n_2 mod G``, ``n_B = G -
    r_2``, ``u = P_1 div 2 P_2`` early tiles (programs ``r_2 .. G-1`` only), ``f = P_1 mod 2
    P_2``, and ``g``'s rank in each later round of ``G``."""
    r2 = (row_blocks * P2) % G
    nb = G - r2
    u = P1 // (2 * P2)
    f = P1 % (2 * P2)
    rank = gl.where(f == 0, g, gl.where(g >= r2, g - r2, nb + g))
    return r2, nb, u, rank


@gluon.jit
def _l1_below(limit, g, G, r2, nb, u, rank):
    """``#{k < limit : the Linear-1 stream index k is program g's}``: its early tiles, then one
    per round of ``G`` at its rank."""
    early = gl.where(g >= r2, gl.minimum(gl.maximum(limit - (g - r2) + nb - 1, 0) // nb, u), 0)
    return early + gl.maximum(limit - u * nb - rank + G - 1, 0) // G


@gluon.jit
def _wave_item(k, row_blocks, w, P1, P2):
    """Expert-Wave stream item ``k``: whether it is a Linear-1 tile, its row block and its N
    tile (waves of ``w`` row blocks, the last the rest)."""
    lo = k // (w * (P1 + P2)) * w
    in_wave = gl.minimum(lo + w, row_blocks) - lo
    o = k - lo * (P1 + P2)
    linear1 = o < in_wave * P1
    o2 = o - in_wave * P1
    return linear1, gl.where(linear1, lo + o // P1, lo + o2 // P2), gl.where(linear1, o % P1,
                                                                          o2 % P2)


@gluon.jit
def _l1_index(j, g, G, r2, nb, u, rank):
    """Program ``g``'s ``j``-th Linear-1 stream index (``_l1_deal``'s closed form)."""
    return gl.where((g >= r2) & (j < u), (g - r2) + j * nb,
                    u * nb + rank + (j - gl.where(g >= r2, u, 0)) * G)


@gluon.jit
def _store_entries(tiles, at, kind, expert, first_c, block_c, row, n, mask):
    """Entries ``(kind, expert of row, row, n)`` at positions ``at`` (along ``PAIRS``' first
    axis) of a program's row ``tiles``; a row block's expert that of the first arrival in it
    (``expert``, ``first_c``, ``block_c``: ``routed_experts``')."""
    entry = tiles + at * TILE_FIELDS
    named = first_c[None, :] & (block_c[None, :] == row[:, None])
    gl.store(entry, gl.zeros_like(at) + kind, mask=mask)
    gl.store(entry + 1, gl.sum(gl.where(named, expert[None, :], 0), axis=1), mask=mask)
    gl.store(entry + 2, row, mask=mask)
    gl.store(entry + 3, n, mask=mask)


@gluon.jit
def program_row(g, tiles, expert, first_c, block_c, rank_c, valid_c, row_blocks, src, slot,
                origin, row_src, row_slot, row_origin, G, P1, P2, LEAD, WAVE_MIN_L1,
                WAVE: gl.constexpr, J: gl.constexpr):
    """Program ``g``'s entries of the Expert-Wave (``WAVE``) or Interleaved table, from
    ``routed_experts``' row blocks, stored into its row ``tiles`` (int32 ``[.., 4]``) at their
    positions, ``J`` at a time. Then, tile by tile, the row maps of their row blocks
    (``_row_block_maps``, from ``arrival_sources``' ``src``, ``slot``, ``origin``): a
    program's partitions read the maps of its own tiles' rows, some before any wait (whether a
    half holds a routed row), so each program writes those it reads; the programs together
    write every routed and padding row in use. Returns its tile count and which arrivals its
    Linear-1 tiles read (along ``PAIRS``' second axis)."""
    n1 = row_blocks * P1
    n2 = row_blocks * P2
    read = valid_c & False
    if WAVE:
        count = _programs_below(n1 + n2, g, G)
        w = gl.cdiv(WAVE_MIN_L1, P1)
        for j0 in range(0, count, J):
            j = j0 + gl.arange(0, J, layout=gl.SliceLayout(1, PAIRS))
            linear1, row, n = _wave_item(g + j * G, row_blocks, w, P1, P2)
            _store_entries(tiles, j, gl.where(linear1, TILE_L1, TILE_L2), expert, first_c,
                           block_c, row, n, j < count)
        for j in range(count):
            linear1, row, _ = _wave_item(g + j * G, row_blocks, w, P1, P2)
            _row_block_maps(row, block_c, rank_c, valid_c, src, slot, origin, row_src,
                            row_slot, row_origin)
            read = read | (valid_c & (block_c == row) & linear1)
    else:
        r2, nb, u, rank = _l1_deal(row_blocks, g, G, P1, P2)
        count2 = _programs_below(n2, g, G)
        for j0 in range(0, count2, J):
            j = j0 + gl.arange(0, J, layout=gl.SliceLayout(1, PAIRS))
            k2 = g + j * G
            row2 = k2 // P2
            _store_entries(tiles, j + _l1_below(gl.minimum((row2 + LEAD) * P1, n1), g, G, r2, nb,
                                                u, rank),
                           TILE_L2, expert, first_c, block_c, row2, k2 % P2, j < count2)
        count1 = _l1_below(n1, g, G, r2, nb, u, rank)
        for j0 in range(0, count1, J):
            j = j0 + gl.arange(0, J, layout=gl.SliceLayout(1, PAIRS))
            k1 = _l1_index(j, g, G, r2, nb, u, rank)
            row1 = k1 // P1
            _store_entries(tiles, j + _programs_below(gl.minimum((row1 - LEAD + 1) * P2, n2), g,
                                                      G),
                           TILE_L1, expert, first_c, block_c, row1, k1 % P1, j < count1)
        for j in range(count1):
            row = _l1_index(j, g, G, r2, nb, u, rank) // P1
            _row_block_maps(row, block_c, rank_c, valid_c, src, slot, origin, row_src,
                            row_slot, row_origin)
            read = read | (valid_c & (block_c == row))
        for j in range(count2):
            _row_block_maps((g + j * G) // P2, block_c, rank_c, valid_c, src, slot, origin,
                            row_src, row_slot, row_origin)
        count = count1 + count2
    return count, read


@gluon.jit
def rows_read(read, origin):
    """The rows of ``x`` that the arrivals ``read`` read (``origin``; at most ``BLOCK_M`` of
    them), as the bits of two int64: rows 0 to 63, rows 64 to 127."""
    one = gl.full_like(origin, 1).to(gl.int64)
    low = gl.reduce_or(gl.where(read & (origin < 64), one << origin, 0), axis=0)
    high = gl.reduce_or(gl.where(read & (origin >= 64), one << (origin - 64), 0), axis=0)
    return low, high


@gluon.jit(noinline=True)
def quantize_rows(low, high, x, x_quant, x_quant_scale, ROWS, HIDDEN):
    """Each of the ``ROWS`` rows of the bf16 activations ``x`` whose bit ``low`` or ``high``
    holds (``rows_read``) to e4m3 ``x_quant`` with one fp32 scale per 1 x 128 block
    (``x_quant_scale``, by the rows of ``x``), as ``weights.quantize_rows_fp8``, bitwise
    (``moe_routing._quantize_block``'s arithmetic: the scale times the reciprocal of the e4m3
    maximum, the values times the IEEE reciprocal of the scale, clamped, rounded to nearest),
    ``QUANT_STEP`` scale blocks at a time. A call: its rows as scalars, the code apart from the
    partitions'."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    k_scales = HIDDEN // SCALE_BLOCK
    for t in range(ROWS):
        if ((gl.where(t < 64, low, high) >> (t % 64)) & 1) != 0:
            for h0 in range(0, k_scales, QUANT_STEP):
                h = h0 + gl.arange(0, QUANT_STEP, layout=gl.SliceLayout(1, layout))
                live = h < k_scales
                at = t * HIDDEN + h[:, None] * SCALE_BLOCK + gl.arange(
                    0, SCALE_BLOCK, layout=gl.SliceLayout(0, layout))[None, :]
                v = gl.load(x + at, mask=live[:, None], other=0.0).to(gl.float32)
                scale = gl.maximum(gl.max(gl.abs(v), axis=1), 1e-12) * (1.0 / E4M3_MAX)
                q = v * gl.div_rn(gl.full_like(scale, 1.0), scale)[:, None]
                q = gl.minimum(gl.maximum(q, -E4M3_MAX), E4M3_MAX)
                gl.store(x_quant + at, q.to(gl.float8e4nv), mask=live[:, None])
                gl.store(x_quant_scale + t * k_scales + h, scale, mask=live)


@gluon.jit
def route_program(g, ids, n_arrivals, arrival_src, arrival_slot, tiles, num_tiles, row_src,
                  row_slot, row_origin, error, x, x_quant, x_quant_scale, NUM_EXPERTS, CAPACITY,
                  TOP_K, G, P1, P2, LEAD, WAVE_MIN_L1, HIDDEN, RECEIVED: gl.constexpr,
                  WAVE: gl.constexpr, A: gl.constexpr, J: gl.constexpr,
                  QUANTIZE: gl.constexpr):
    """Program ``g`` of ``G``: its own row ``tiles`` of the table and its count
    (``num_tiles[g]``, returned too), and the row maps of its tiles' row blocks, from the ids
    (at most ``A`` of them: the call's ``CAPACITY``, or on an EP rank (``RECEIVED``) the count
    at ``n_arrivals``), and where ``QUANTIZE`` the rows of ``x`` (bf16, ``HIDDEN`` columns) its
    Linear-1 tiles read into ``x_quant``/``x_quant_scale``: what each program of the routed
    fused kernel does before its tiles."""
    if RECEIVED:
        n = gl.load(n_arrivals)
    else:
        n = CAPACITY
    expert, first_c, block_c, rank_c, valid_c, row_blocks = routed_experts(
        ids, n, error, g == 0, NUM_EXPERTS, A)
    src, slot, origin = arrival_sources(arrival_src, arrival_slot, CAPACITY, TOP_K, RECEIVED, A)
    count, read = program_row(g, tiles, expert, first_c, block_c, rank_c, valid_c, row_blocks,
                              src, slot, origin, row_src, row_slot, row_origin, G, P1, P2, LEAD,
                              WAVE_MIN_L1, WAVE, J)
    gl.store(num_tiles + g, count)
    if QUANTIZE:
        low, high = rows_read(read, origin)
        quantize_rows(low, high, x, x_quant, x_quant_scale, CAPACITY // TOP_K, HIDDEN)
    return count


@gluon.jit
def program_tables_kernel(ids, n_arrivals, arrival_src, arrival_slot, tiles, num_tiles, row_src,
                          row_slot, row_origin, error, x, x_quant, x_quant_scale, NUM_EXPERTS,
                          CAPACITY, TOP_K, MAX_TILES, G, P1, P2, LEAD, WAVE_MIN_L1, HIDDEN,
                          RECEIVED: gl.constexpr, WAVE: gl.constexpr, A: gl.constexpr,
                          J: gl.constexpr, QUANTIZE: gl.constexpr):
    """``route_program`` in every program of ``G``, into its row of ``tiles`` (int32 ``[G,
    MAX_TILES, 4]``), as the routed fused kernel's programs do it before their tiles: the unit
    the tests check against the host reference."""
    g = gl.program_id(0)
    route_program(g, ids, n_arrivals, arrival_src, arrival_slot,
                  tiles + g * MAX_TILES * TILE_FIELDS, num_tiles, row_src, row_slot, row_origin,
                  error, x, x_quant, x_quant_scale, NUM_EXPERTS, CAPACITY, TOP_K, G, P1, P2,
                  LEAD, WAVE_MIN_L1, HIDDEN, RECEIVED, WAVE, A, J, QUANTIZE)
