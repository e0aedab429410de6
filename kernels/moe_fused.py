"""Persistent expert-parallel MoE kernel with remote-store Combine (paper §2.2, §4.2).

Device code only; the host side (tile tables, preconditions, launch) is
the package ``xstage_lab/ops/moe/`` (the schedules: ``schedules.py`` there).

One program walks its own row of an int32 tile table, entries ``(kind, expert, row_block, n_block)``:

* ``TILE_L1``: Linear-1 of one row block (``BLOCK_M`` dispatched rows of one local expert) for one
  ``BLOCK_N1`` slice of the intermediate dimension: gate and up projections, SwiGLU, the result
  stored to the local intermediate buffer ``h``; then one release-add on the row block's counter.
* ``TILE_L2``: Linear-2 of one row block for one ``BLOCK_N2`` slice of the hidden dimension. It
  acquire-spins until the row block's counter reaches ``INTER // BLOCK_N1`` (every Linear-1 slice of
  those rows is visible); the epilogue stores the result rows straight into the Combine buffer of
  each row's source rank through the peer pointer table (row -> (source rank, slot)): the
  concentrated remote-store burst of the paper. There is no separate combine kernel.

Every spin is bounded: after ``max_spin`` polls the tile is skipped and ``error_ptr`` counts it, so
an unsatisfiable schedule ends with an error instead of a hang (the rows stay poisoned).
Deadlock freedom of a schedule assumes every program is resident (one program per SM at most).

Two constexpr variants, both off for the timing of the two schedules:

* ``INSTRUMENT``: per tile, ``TRACE_FIELDS`` int64 into ``trace_ptr [programs, max_tiles, 10]``:
  ``%clock64`` then ``%globaltimer`` at four points (tile entry; dependency satisfied, i.e. after
  the acquire-spin of a Linear-2 tile, equal to entry for Linear-1; mainloop end = epilogue start;
  epilogue end = every store of the tile issued), then ``%smid`` and the spin count. Each stamp
  follows a CTA barrier (``bar.sync``), so it is read once every warp has issued everything before
  it; the asm is volatile (``is_pure=False``), so neither it nor the barrier moves across the
  stores. The value stored is one thread's. This kernel is not warp-specialized: the same warps run
  mainloop and epilogue, so the epilogue span (stamps 2 -> 3) is the sender-visible remote-store
  span T_RS of the tile's Combine burst, and stores still draining after it delay the *next*
  tile's loads (an SM's memory operations queue behind its outstanding remote stores).
* ``FENCE``: after each Linear-2 tile's Combine stores, a CTA barrier and a system-scope release
  (``fence.acq_rel.sys`` before a no-op add) by which the SM waits until its stores are performed
  system-wide, then a barrier: the completion-coupled issuer of §2.3 (issue 8 counterfactual).

``FP8`` selects W8A8: e4m3 operands with fp32 block scales, 1 x ``SCALE_BLOCK`` for activations
(per row and K block) and ``SCALE_BLOCK`` x ``SCALE_BLOCK`` for weights, applied per K block as in
DeepSeek-V3/DeepGEMM; the Linear-1 epilogue re-quantizes ``h`` per row and ``SCALE_BLOCK`` columns.

Layouts (row-major, no padding inside a row; ``R`` = padded dispatched rows, ``E`` = local experts):
``a_rows_ptr`` int64 ``[3]`` holds the addresses of ``x [N, HIDDEN]`` and (FP8) ``x_scale``,
read on the device, and where the scales lie; layout row ``r`` reads row ``row_origin[r]`` of
``x`` (int32 ``[R]``, -1 on padding: zeros) and its scales at row ``r`` of ``x_scale [R,
HIDDEN/SB]`` where ``a_rows_ptr[2]`` is 1 (laid out by the routing), else at row
``row_origin[r]`` of ``x_scale [N, HIDDEN/SB]``; ``w1 [E, 2*INTER, HIDDEN]`` (gate rows, then
up rows),
``w1_scale [E, 2*INTER/SB, HIDDEN/SB]``, ``w2 [E, HIDDEN, INTER]``, ``w2_scale [E, HIDDEN/SB, INTER/SB]``,
``h [R, INTER]``, ``h_scale [R, INTER/SB]``, ``row_src``/``row_slot`` int32 ``[R]`` (slot -1: padding),
peer table int64 ``[P]`` of 16-byte aligned bf16 ``[slots, HIDDEN]`` Combine buffers.
"""
import triton
import triton.language as tl

TILE_L1 = tl.constexpr(0)
TILE_L2 = tl.constexpr(1)
TRACE_FIELDS = tl.constexpr(10)  # clock64 x 4, globaltimer x 4, smid, spins
E4M3_MAX = tl.constexpr(448.0)
E4M3_MIN_NORMAL = tl.constexpr(0.015625)  # 2**-6; below it e4m3 steps are 2**-9


@triton.jit
def _round_to_e4m3(x):
    """Round fp32 onto the e4m3 grid (nearest, ties to even above 2**-6), saturating at 448.

    The following ``.to(float8e4nv)`` is then exact, so GPU and interpreter agree (the interpreter's
    own fp32 -> fp8 rounding drops the carry into the exponent)."""
    x = tl.minimum(tl.maximum(x, -E4M3_MAX), E4M3_MAX)
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 mantissa bits, RNE
    normal = bits.to(tl.float32, bitcast=True)
    # onto multiples of 2**-9, ties to even: fp32 steps are 2**-9 at 2**14 (floor(v + 0.5)
    # rounded ties up: 6.5 steps became 7 on one H200)
    subnormal = (tl.abs(x) + 16384.0) - 16384.0
    # the sign by its bit: Triton's negation is 0 - s, which turned the -0 of a small negative
    # value into +0 (torch's e4m3 keeps -0; one H200, fp8 routing tables)
    sign = (bits >> 31) << 31
    subnormal = (subnormal.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < E4M3_MIN_NORMAL, subnormal, normal)


@triton.jit
def _stamp(rec, point: tl.constexpr):
    """Stamp point ``point`` (0..3) of a tile record: ``%clock64`` at ``rec[point]``,
    ``%globaltimer`` at ``rec[4 + point]``, after a CTA barrier (every warp got here)."""
    tl.debug_barrier()
    clk = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64,
                                    is_pure=False, pack=1)
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                    is_pure=False, pack=1)
    tl.store(rec + point, clk)
    tl.store(rec + 4 + point, now)


@triton.jit
def _linear1_swiglu_tile(expert, row_block, n_block,
                         a_rows_ptr, row_origin_ptr, w1_ptr, w1_scale_ptr, h_ptr, h_scale_ptr,
                         row_ready_ptr, rec, HIDDEN, INTER,
                         FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N1: tl.constexpr,
                         BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                         INSTRUMENT: tl.constexpr):
    if INSTRUMENT:
        _stamp(rec, 1)  # no dependency to wait for
    rows = (row_block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    origin = tl.load(row_origin_ptr + rows)
    routed = origin >= 0
    origin = tl.maximum(origin, 0).to(tl.int64)
    x_ptr = tl.load(a_rows_ptr).to(tl.pointer_type(tl.float8e4nv if FP8 else tl.bfloat16))
    cols = n_block * BLOCK_N1 + tl.arange(0, BLOCK_N1)
    ks = tl.arange(0, BLOCK_K)
    w_gate = w1_ptr + expert.to(tl.int64) * (2 * INTER) * HIDDEN
    w_up = w_gate + INTER.to(tl.int64) * HIDDEN
    k_scales = HIDDEN // SCALE_BLOCK
    if FP8:
        x_scale_ptr = tl.load(a_rows_ptr + 1).to(tl.pointer_type(tl.float32))
        scale_rows = tl.where(tl.load(a_rows_ptr + 2) != 0, rows, origin)
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N1), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N1), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        a = tl.load(x_ptr + origin[:, None] * HIDDEN + (k0 + ks)[None, :], mask=routed[:, None],
                    other=0.0)
        b_gate = tl.load(w_gate + cols[None, :].to(tl.int64) * HIDDEN + (k0 + ks)[:, None])
        b_up = tl.load(w_up + cols[None, :].to(tl.int64) * HIDDEN + (k0 + ks)[:, None])
        if FP8:
            # One K block lies inside one scale block: promote to fp32 with both scales.
            a_s = tl.load(x_scale_ptr + scale_rows * k_scales + k0 // SCALE_BLOCK, mask=routed,
                          other=0.0)
            w_scales = w1_scale_ptr + expert.to(tl.int64) * (2 * INTER // SCALE_BLOCK) * k_scales
            g_s = tl.load(w_scales + (cols // SCALE_BLOCK) * k_scales + k0 // SCALE_BLOCK)
            u_s = tl.load(w_scales + ((INTER + cols) // SCALE_BLOCK) * k_scales + k0 // SCALE_BLOCK)
            acc_gate += tl.dot(a, b_gate) * (a_s[:, None] * g_s[None, :])
            acc_up += tl.dot(a, b_up) * (a_s[:, None] * u_s[None, :])
        else:
            acc_gate = tl.dot(a, b_gate, acc_gate)
            acc_up = tl.dot(a, b_up, acc_up)
    if INSTRUMENT:
        _stamp(rec, 2)
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up  # SwiGLU: silu(gate) * up
    h_ptrs = h_ptr + rows[:, None] * INTER + cols[None, :]
    if FP8:
        # BLOCK_N1 == SCALE_BLOCK: the tile holds exactly one activation scale block per row.
        amax = tl.max(tl.abs(h), axis=1)
        scale = tl.maximum(amax, 1e-12) / E4M3_MAX
        q = _round_to_e4m3(h / scale[:, None])
        tl.store(h_ptrs, q.to(tl.float8e4nv))
        tl.store(h_scale_ptr + rows * (INTER // SCALE_BLOCK) + n_block, scale)
    else:
        tl.store(h_ptrs, h.to(tl.bfloat16))
    # Every thread's h stores happen-before the release (CTA barrier + release cumulativity).
    tl.debug_barrier()
    tl.atomic_add(row_ready_ptr + row_block, 1, sem="release", scope="gpu")
    if INSTRUMENT:
        _stamp(rec, 3)


@triton.jit
def _linear2_combine_tile(expert, row_block, n_block,
                          h_ptr, h_scale_ptr, w2_ptr, w2_scale_ptr, row_ready_ptr,
                          row_src_ptr, row_slot_ptr, combine_ptrs_ptr, error_ptr, max_spin,
                          rec, HIDDEN, INTER,
                          FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N1: tl.constexpr,
                          BLOCK_N2: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                          INSTRUMENT: tl.constexpr, FENCE: tl.constexpr):
    # Acquire-wait until all INTER // BLOCK_N1 Linear-1 slices of this row block are visible.
    needed = INTER // BLOCK_N1
    ready = tl.atomic_add(row_ready_ptr + row_block, 0, sem="acquire", scope="gpu")
    spins = 0
    while (ready < needed) & (spins < max_spin):
        ready = tl.atomic_add(row_ready_ptr + row_block, 0, sem="acquire", scope="gpu")
        spins += 1
    if INSTRUMENT:
        tl.store(rec + 9, spins.to(tl.int64))
    if ready < needed:
        tl.atomic_add(error_ptr, 1)  # bounded spin expired: report and skip, never hang
    else:
        tl.debug_barrier()  # the acquiring thread's view is ordered before every thread's loads
        if INSTRUMENT:
            _stamp(rec, 1)
        rows = (row_block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = n_block * BLOCK_N2 + tl.arange(0, BLOCK_N2)
        ks = tl.arange(0, BLOCK_K)
        w = w2_ptr + expert.to(tl.int64) * HIDDEN * INTER
        k_scales = INTER // SCALE_BLOCK
        acc = tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            # .cg: read h at L2, where the producers' released stores are.
            a = tl.load(h_ptr + rows[:, None] * INTER + (k0 + ks)[None, :], cache_modifier=".cg")
            b = tl.load(w + cols[None, :].to(tl.int64) * INTER + (k0 + ks)[:, None])
            if FP8:
                a_s = tl.load(h_scale_ptr + rows * k_scales + k0 // SCALE_BLOCK, cache_modifier=".cg")
                w_scales = w2_scale_ptr + expert.to(tl.int64) * (HIDDEN // SCALE_BLOCK) * k_scales
                b_s = tl.load(w_scales + (cols // SCALE_BLOCK) * k_scales + k0 // SCALE_BLOCK)
                acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
            else:
                acc = tl.dot(a, b, acc)
        if INSTRUMENT:
            _stamp(rec, 2)
        # Epilogue: each row goes to its source rank's Combine buffer (remote store burst).
        slot = tl.load(row_slot_ptr + rows)
        src = tl.load(row_src_ptr + rows)
        # Buffers are 16-byte aligned (host contract): lets the stores go out as 16-byte vectors.
        dst = tl.multiple_of(tl.load(combine_ptrs_ptr + src).to(tl.pointer_type(tl.bfloat16)), 16)
        out_ptrs = dst[:, None] + slot.to(tl.int64)[:, None] * HIDDEN + cols[None, :]
        tl.store(out_ptrs, acc.to(tl.bfloat16), mask=(slot >= 0)[:, None])
        if FENCE:
            # Completion-coupled: wait until this tile's stores are visible system-wide (the
            # release fence waits for the SM's outstanding remote stores), every warp with it.
            tl.debug_barrier()
            tl.atomic_add(error_ptr, 0, sem="release", scope="sys")
            tl.debug_barrier()
        if INSTRUMENT:
            _stamp(rec, 3)


@triton.jit
def fused_moe_kernel(tiles_ptr, num_tiles_ptr, max_tiles,
                     a_rows_ptr, row_origin_ptr, w1_ptr, w1_scale_ptr, w2_ptr, w2_scale_ptr,
                     h_ptr, h_scale_ptr, row_ready_ptr,
                     row_src_ptr, row_slot_ptr, combine_ptrs_ptr,
                     error_ptr, max_spin, num_experts, trace_ptr,
                     HIDDEN, INTER,
                     FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N1: tl.constexpr,
                     BLOCK_N2: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                     INSTRUMENT: tl.constexpr = False, FENCE: tl.constexpr = False):
    """One persistent program per table row: ``num_tiles_ptr[g]`` entries of row g, read on the
    device, so a table sized by a static bound works; the schedule is the table, not this code.
    A tile whose expert lies outside ``0 .. num_experts - 1`` adds 1 to ``error_ptr`` and is
    skipped (never a load or store through it)."""
    pid = tl.program_id(0)
    my_tiles = tiles_ptr + pid * max_tiles * 4
    for i in range(0, tl.load(num_tiles_ptr + pid)):
        rec = trace_ptr + (pid * max_tiles + i).to(tl.int64) * TRACE_FIELDS
        if INSTRUMENT:
            _stamp(rec, 0)
            smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                             is_pure=False, pack=1)
            tl.store(rec + 8, smid.to(tl.int64))
        kind = tl.load(my_tiles + i * 4)
        expert = tl.load(my_tiles + i * 4 + 1)
        row_block = tl.load(my_tiles + i * 4 + 2)
        n_block = tl.load(my_tiles + i * 4 + 3)
        if (expert < 0) | (expert >= num_experts):
            tl.atomic_add(error_ptr, 1)
        elif kind == TILE_L1:
            _linear1_swiglu_tile(expert, row_block, n_block,
                                 a_rows_ptr, row_origin_ptr, w1_ptr, w1_scale_ptr, h_ptr,
                                 h_scale_ptr, row_ready_ptr, rec, HIDDEN, INTER,
                                 FP8, BLOCK_M, BLOCK_N1, BLOCK_K, SCALE_BLOCK, INSTRUMENT)
        else:
            _linear2_combine_tile(expert, row_block, n_block,
                                  h_ptr, h_scale_ptr, w2_ptr, w2_scale_ptr, row_ready_ptr,
                                  row_src_ptr, row_slot_ptr, combine_ptrs_ptr, error_ptr, max_spin,
                                  rec, HIDDEN, INTER,
                                  FP8, BLOCK_M, BLOCK_N1, BLOCK_N2, BLOCK_K, SCALE_BLOCK,
                                  INSTRUMENT, FENCE)
    # A system-scope release (a fence.sys in front of a no-op add) after a CTA barrier: every remote
    # Combine store of this program is performed system-wide before the program exits, ahead of
    # the host's symmetric-memory barrier that tells the source ranks their rows are there.
    tl.debug_barrier()
    tl.atomic_add(error_ptr, 0, sem="release", scope="sys")
