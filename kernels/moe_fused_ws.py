"""Persistent, warp-specialized fused MoE kernel for Hopper (sm_90), in Gluon (paper §2.2, §4.2).

Device code only, beside the portable Triton kernel ``moe_fused.py`` (which the interpreter tests
run): the same tile table ``(kind, expert, row_block, n_block)`` drives both, so Expert-Wave and
Interleaved (Algorithm 1) run unchanged; the host side is ``xstage_lab/ops/moe/``.

Tiles of ``BLOCK_M`` = 128 rows, or 256 (bf16; ``tiles.WS_ROW_TILES``): there each consumer
warpgroup takes 128 rows over Linear-1 tiles of 64 gate and 64 up columns (one m64n128 wgmma
group, split in registers for SwiGLU) and Linear-2 tiles of 128 columns, the same accumulator
registers and stage bytes as at 128 rows, so each weight block a CTA streams serves twice the
rows. With 192 routed rows an expert (DeepSeek-V4-Flash bf16 at 8192 tokens) the 128-row kernel
read 1.90x the expert weights' bytes from DRAM, with 256 rows an expert 2.34x: the L2 cache
keeps little of an expert's weights for its next row block, whatever the tiles' order
(``data/records/moe_ncu/README.md``). At 256 rows the kernel took 0.65x and 0.74x the time there
(one ab job on one H100; where the layer takes 256-row tiles: ``tiles.ws_tile_rows``).

One CTA per SM walks its program's row of the table. Three partitions:
  consumer 0, consumer 1   one warpgroup each, the tile's rows from half · BLOCK_M / 2:
                           wgmma on the shared-memory ring, then the tile's epilogue; a half
                           of padding rows only (an expert's last row block with at most
                           BLOCK_M/2 routed rows, the rule at small T) issues no wgmma and no
                           stores and its A rows are not loaded (at one token the kernel took
                           0.83-0.99x the time of the build without this, every shape, both
                           settings, one session on one H200: moe_layer/h200-x1/
                           20261202T203004Z against …203438Z, both retired);
  producer                 one warpgroup: the A tile and the B tile (expert weights) of every K
                           block into a STAGES-deep ring, a stage refilled once both consumers
                           released it. B, and Linear-2's A (the intermediate ``h``), by TMA from
                           one thread; Linear-1's A gathered by every thread with 16-byte
                           ``cp.async`` through ``row_origin`` (each layout row's row of ``x``:
                           the token, or the received row), so no pass ahead of the kernel copies
                           the routed rows into the layout (Hopper's TMA has no row gather).
                           Against TMA loads of rows moved into place beforehand the kernel
                           takes 1.00-1.05x the time (moe_gather_probe/h200-x1, three runs; the
                           move it saves took 200-360 µs at 8192 tokens per rank).
                           Before the first load of a Linear-2 tile it acquire-spins (bounded) on
                           the row block's counter until every Linear-1 slice of those rows is
                           visible. Issuing the tile's first STAGES weight blocks before the spin
                           (streaming during Linear-1) measured no better at 1 and 8 tokens, every
                           shape, in two runs of opposite order: 0.973 and 0.997 of this kernel's
                           time (geometric means; moe_layer/h200-x1/20261204T133957Z against
                           …133749Z, …134526Z against …134823Z), the process order moving cells
                           more than the change.

Linear-1 (``TILE_L1``): gate and up of ``BLOCK_N1`` intermediate columns (two wgmma chains on
one A tile), SwiGLU in the epilogue, ``h`` stored (bf16, or e4m3 with a 1 x 128 scale per row),
then each consumer warpgroup release-adds 1 to the row block's counter: a row block is complete at
``2 · INTER / BLOCK_N1``.
Linear-2 (``TILE_L2``): ``BLOCK_N2`` hidden columns; the epilogue stores each result row straight
into the Combine buffer of the row's source rank through the peer pointer table (row -> (source,
slot); slot -1 is padding), 16-byte stores, and moves on: the remote-store burst of the paper.
Split K (the ``SPLIT_K`` build with ``l2_splits`` > 1, where a call's Linear-2 tiles are far
fewer than the SMs, as at one token: one CTA streams a tile's weights at about 50 GB/s, so a
22-tile Linear-2 runs at a quarter of HBM's rate): a tile's table entry names one of
``l2_splits`` contiguous ranges of its K blocks (``_l2_split``). Each split stores its fp32
partial of the routed rows into ``l2_partial`` and release-adds 1 to the tile half's counter in
``l2_ready``; the warpgroup that finds every split there sums the partials in split order (the
result does not depend on which split came last), stores the Combine rows and resets the counter
for the next launch.

Memory ordering across proxies: ``h`` is written by generic stores and read by TMA (the async
proxy) on another SM, so the writer fences ``proxy.async.global`` before its release and the
reader after its acquire. ``cp.async`` lands in shared memory through the generic proxy and wgmma
reads it through the async proxy: a consumer fences ``proxy.async.shared::cta`` after its wait on
a Linear-1 stage.

``FP8``: W8A8 with fp32 scales, 1 x 128 for activations (``x``, ``h``: per row and K block) and
128 x 128 for weights, as in DeepSeek-V3. Each K block of 128 is one wgmma group into a temporary
accumulator, waited, then promoted into the fp32 accumulator with its two scales, while the other
consumer warpgroup's wgmma keeps the tensor cores busy (DeepGEMM's SM90 scheme). Promoting a
block under this warpgroup's own next wgmma needs a second temporary: 4 x 64 registers with
Linear-1's two accumulators, above the 224 a consumer thread has; at Linear-2's 3 x 64 ptxas
spilled and serialized every wgmma of the kernel (sm_90 build of this kernel, Triton 3.6), so
both wait. Halving the temporaries instead (each 128-column half as two m64n64 groups, the first
promoted while the second runs: 4 x 32 + 2 x 32 registers) did not fit either: ptxas spilled
444 bytes in the 128-wide FP8 build and 712 in the 256-wide one, which grew from 74 to 81 KiB
(Linear-1's loop alone; Triton 3.6, not run). Where a tile's second half is padding (a few
tokens), pairing the warpgroups instead (the ring of one A half; each warpgroup 64 gate and 64
up columns of the first half's rows, their maxima for h's scales exchanged at a named barrier,
and 128 columns of a 256-wide Linear-2 tile) built without spills but measured no better on one
H100: DiT-MoE FP8 at one token in both settings and eight at EP = 1, the graphed call
0.979-1.007x and the kernel alone's device time 1.005-1.021x, the unchanged build of eight
tokens on the EP rank 1.013x and 1.009x (8f8a43d, reverted; moe_layer/h100-80gb-hbm3-x1
…114628Z against …114552Z and …114656Z, all retired). Its groups still waited block
by block; issuing a block's before the previous block's promotion made ptxas serialize every
wgmma (compiled only, not kept).

Code size: the kernel is timed after other kernels in a call, whose code takes the SMs'
instruction caches. The FP8 builds at 81-91 KiB of SASS then took up to 1.24x their time after
straight-line code on every SM and up to 1.11x in a call (moe_call_probe/h200-x1/
20261204T204939Z, …205903Z); with the SiLU and the FP8 re-quantization free of the fix-ups that
``exp`` and division compile to (``_silu``), at 64-74 KiB, 1.08x and 1.013x, and the kernel in a
call 0.971x its earlier time (geometric mean, twelve FP8 cells, one job: …210002Z).

The weighted sum at EP = 1 (``SUM_TOP_K``): every consumer warpgroup of the launch, once its
Combine rows are stored, arrives at one counter (release); the first warpgroup of each program
then waits (acquire, a bounded spin) for all of them and sums its program's share of the tokens'
rows (``_weighted_sum_share``), so that the layer's call needs no launch of its own for the sum
(nor its kernel boundary) where one pass of the programs covers the tokens. What the sum needs
comes from a control block in shared memory, written at the start (``_sum_control_store``):
held in registers across the mainloops, four values more made ptxas spill in the FP8 consumers'
mainloops (sm_90 builds, Triton 3.6). With ``SUM_ATOMIC`` nothing waits: each Linear-2
epilogue adds its rows, times their top-k weights, into the tokens' output rows by bf16
reductions at L2 (``_add_rows``), which the routing zeroed; the sum's order of addition is
then the epilogues' (the bits may differ from call to call, within bf16's rounding).

``ONE_HALF`` (a separate build, for calls whose bound keeps every expert's routed rows within a
tile's first half, as at a few tokens): the ring holds one A half a stage, which leaves room for
a deeper ring (``tiles.default_tile_config``). A tile whose second half holds a routed row adds
1 to ``error``; its consumer then reads the first half's rows, and the call's output is invalid.

``FENCE`` builds the completion-coupled counterfactual of §2.3 (each Linear-2 tile waits until
its Combine stores are visible system-wide), ``INSTRUMENT`` the traced build (``_consumer``); both
leave every result unchanged.

Bounded spins: a producer that polls ``max_spin`` times without the row block completing adds 1
to ``error`` and loads anyway; the tile's output is then invalid and the call reports the error,
so an unsatisfiable schedule ends instead of hanging. Deadlock freedom assumes every program is
resident (at most one per SM).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

TILE_L1 = gl.constexpr(0)
TILE_L2 = gl.constexpr(1)
TILE_FIELDS = gl.constexpr(4)
SCALE_BLOCK = gl.constexpr(128)
E4M3_MAX = gl.constexpr(448.0)
NEG_LOG2E = gl.constexpr(-1.4426950408889634)
TRACE_FIELDS = gl.constexpr(10)  # clock64 x 4, globaltimer x 4, smid, spins: moe_fused.py's
# Registers per thread of the consumer warpgroups and of the producer warpgroup (setmaxnreg),
# by the rows of a tile: 2 x 128 x 224 + 128 x 56 of the SM's 65536 at 128; at 256, where the
# producer gathers 128 rows a half and holds their origins across the K loop, 2 x 128 x 208 +
# 128 x 96 (sm_90 build, Triton 3.6: 224 + 56, 224 + 64 and 216 + 80 spilled 8-20 bytes).
CONSUMER_REGS = gl.constexpr(224)
PRODUCER_REGS = gl.constexpr(56)
TALL_CONSUMER_REGS = gl.constexpr(208)
TALL_PRODUCER_REGS = gl.constexpr(96)
PRODUCER_WARPS = gl.constexpr(4)
COPY_BYTES = gl.constexpr(16)  # one cp.async
L2_EARLY_BLOCKS = gl.constexpr(4)  # a Linear-2 tile's weight blocks issued before its rows
# a split tile's sum: fp32 elements of one split's partial per load, 16 a thread (SUM_ROWS =
# PARTIAL_ELEMENTS / N rows), 4-wide vectors, a warp's 32 threads over SUM_THREAD_COLS columns
PARTIAL_ELEMENTS = gl.constexpr(2048)
SUM_THREAD_COLS = gl.constexpr(32)
SPLIT_LOADS = gl.constexpr(3)  # a split tile's partials loaded together, each step of its sum
SUM_COLS = gl.constexpr(1024)  # the in-kernel weighted sum's columns per step: 8 bf16 a thread
# the slots of its control block in shared memory (_sum_control_store)
CONTROL_ARRIVALS = gl.constexpr(0)
CONTROL_EVERYONE = gl.constexpr(1)
CONTROL_ARGS = gl.constexpr(2)
CONTROL_TOKENS = gl.constexpr(3)
CONTROL_MAX_SPIN = gl.constexpr(4)
SUM_CONTROL = gl.constexpr(8)  # slots: a power of two


@gluon.jit
def _fence_proxy_async_global():
    """Order this thread's generic-proxy global accesses with its async-proxy (TMA) ones."""
    gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _silu(g):
    """``g / (1 + exp(-g))`` as ``g · rcp(1 + 2^(-g log2 e))`` with the approximate ``ex2`` and
    ``rcp`` that flush denormals (``.ftz``): without the fix-ups for denormal and huge operands
    that ``exp`` and ``/`` (the approximate ``div.full``) compile to, a predicated sequence per
    element. The same bits where ``1 + exp(-g)`` is below 2^126 (g above -87): an ``exp`` under
    2^-126 adds nothing to 1 either way."""
    e = gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [g * NEG_LOG2E],
                                  dtype=gl.float32, is_pure=True, pack=1)
    r = gl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + e],
                                  dtype=gl.float32, is_pure=True, pack=1)
    return g * r


@gluon.jit
def _load_acquire(counter):
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [counter],
                                     dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _load_acquire_b64(counter):
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b64 $0, [$1];", "=l,l", [counter],
                                     dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _spin_until(counter, needed, error, max_spin, WIDE: gl.constexpr):
    """Acquire-spin until ``counter`` (int32, or int64 where ``WIDE``) reaches ``needed``, at most
    ``max_spin`` polls (then count an error and go on). Returns the number of polls after the
    first."""
    ready = _load_acquire_b64(counter) if WIDE else _load_acquire(counter)
    spins = 0
    while (ready < needed) & (spins < max_spin):
        ready = _load_acquire_b64(counter) if WIDE else _load_acquire(counter)
        spins += 1
    if ready < needed:
        gl.atomic_add(error, 1)
    return spins


@gluon.jit
def _wait_rows_ready(counter, needed, error, max_spin):
    """``_spin_until`` the row block's counter reaches ``needed``, then make the released ``h``
    visible to this thread's TMA loads. Returns the number of polls after the first."""
    spins = _spin_until(counter, needed, error, max_spin, False)
    _fence_proxy_async_global()
    return spins


@gluon.jit
def _stamp(rec, point: gl.constexpr):
    """Stamp ``point`` (0..3) of a tile record as ``moe_fused._stamp`` does: ``%clock64`` at
    ``rec[point]``, ``%globaltimer`` at ``rec[4 + point]``, once every warp of this warpgroup got
    here (its barrier)."""
    gl.thread_barrier()
    clk = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64,
                                    is_pure=False, pack=1)
    now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64,
                                    is_pure=False, pack=1)
    gl.store(rec + point, clk)
    gl.store(rec + 4 + point, now)


@gluon.jit
def _l2_split(n_block, l2_k_blocks, l2_splits, HIDDEN, BLOCK_N2: gl.constexpr,
              SPLIT_K: gl.constexpr):
    """A Linear-2 table entry's ``n_block`` read as (K split, column block) of the tile's
    ``HIDDEN / BLOCK_N2`` column blocks: the column block, the split, its first K block and its
    K blocks (the K blocks cut in ``l2_splits`` ranges of ``ceil(l2_k_blocks / l2_splits)``, the
    last one shorter; the host keeps every range non-empty). Without ``SPLIT_K``: the whole
    tile."""
    if not SPLIT_K:
        return n_block, 0, 0, l2_k_blocks
    p2 = HIDDEN // BLOCK_N2
    split = n_block // p2
    per = gl.cdiv(l2_k_blocks, l2_splits)
    k0 = split * per
    return n_block % p2, split, k0, gl.minimum(per, l2_k_blocks - k0)


@gluon.jit
def _a_slot(a_smem, s, half: gl.constexpr, STAGES: gl.constexpr):
    """The ring's slot of stage ``s``'s A half ``half``: the halves side by side, or, where the
    ring holds one half a stage (``ONE_HALF``: ``STAGES`` slots), the stage's."""
    if a_smem.shape[0] == STAGES:
        return s
    else:
        return 2 * s + half


@gluon.jit
def _load_a(desc, row0, k, bar, a_smem, s, second_half, HALF_ROWS: gl.constexpr,
            STAGES: gl.constexpr):
    """The halves of an A tile (one per consumer warpgroup) into stage ``s``: the second only
    where ``second_half`` (it holds a routed row; else its consumer reads nothing)."""
    tma.async_copy_global_to_shared(desc, [row0, k], bar, a_smem.index(_a_slot(a_smem, s, 0,
                                                                                STAGES)))
    if a_smem.shape[0] != STAGES:
        tma.async_copy_global_to_shared(desc, [row0 + HALF_ROWS, k], bar,
                                        a_smem.index(_a_slot(a_smem, s, 1, STAGES)),
                                        pred=second_half)


@gluon.jit
def _load_w2(desc, w_row, k, it, ready, empty, b_smem, BLOCK_N2: gl.constexpr,
             STAGES: gl.constexpr):
    """The Linear-2 weight block of K block ``it`` of this program into its stage, once the
    consumers have released it. It may land before the stage's expect-tx: the phase cannot
    complete before that arrival (the barrier's one), and the bytes already counted off leave its
    tx-count below zero until then, as a peer's multicast TMA does."""
    s = it % STAGES
    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
    tma.async_copy_global_to_shared(desc, [w_row, k], ready.index(s),
                                    b_smem.index(s).slice(0, BLOCK_N2))


@gluon.jit
def _origin_rows(row_origin, row_base, layout: gl.constexpr, HALF_ROWS: gl.constexpr):
    """``row_origin`` of the ``HALF_ROWS`` layout rows from ``row_base``, in ``layout``'s row
    slice."""
    rows = row_base + gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, layout))
    return gl.load(row_origin + rows)


@gluon.jit
def _gather_half(x_rows, origin, k, smem, HIDDEN, layout: gl.constexpr, BLOCK_K: gl.constexpr):
    """``cp.async`` of one half of a Linear-1 A block: layout row ``r``'s K block ``k`` from
    row ``origin[r]`` of ``x_rows`` in 16-byte vectors, padding rows (origin -1) zero-filled."""
    cols = k + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    src = x_rows + (gl.maximum(origin, 0).to(gl.int64) * HIDDEN)[:, None] + cols[None, :]
    async_copy.async_copy_global_to_shared(smem, src, mask=(origin >= 0)[:, None])


@gluon.jit
def _expect_stage(bar, a_half_bytes: gl.constexpr, b_bytes: gl.constexpr, second_half):
    """The producer's arrival on a stage's ``ready`` barrier with the bytes its loads bring: the
    count is an immediate, so one of two predicated arrivals."""
    mbarrier.expect(bar, 2 * a_half_bytes + b_bytes, pred=second_half)
    mbarrier.expect(bar, a_half_bytes + b_bytes, pred=~second_half)


@gluon.jit
def _routed_half(row_slot, row_base):
    """Whether the half's rows from ``row_base`` hold a routed row. An expert's padding rows (slot
    -1) follow its routed rows, so a half whose first row is padding is padding throughout."""
    return gl.load(row_slot + row_base) >= 0


@gluon.jit
def _producer(tiles, n_tiles, a_rows, row_origin, w1_desc, h_desc, w2_desc, a_smem, b_smem, ready,
              empty, row_ready, row_slot, error, max_spin, num_experts, trace, HIDDEN, INTER,
              l1_k_blocks, l2_k_blocks, l2_splits, FP8: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N1: gl.constexpr, BLOCK_N2: gl.constexpr, BLOCK_K: gl.constexpr,
              STAGES: gl.constexpr, INSTRUMENT: gl.constexpr, SPLIT_K: gl.constexpr):
    """The loading warpgroup: every K block of every tile of this program, in table order (a tile
    whose expert is not one of the ``num_experts`` is skipped, as the consumers skip it). The A
    tile's second half is loaded only where it holds a routed row (``_routed_half``).

    A Linear-1 stage completes on two counts: each thread's ``cp.async`` arrival (which first adds
    one pending arrival to the phase, then arrives once its copies land) and the expect-tx arrival
    of the B bytes; the warpgroup's barrier between them keeps the B arrival from ending the phase
    before every thread has added its own. Each stage's weights (B) are issued before its A, and a
    Linear-2 tile's first ``L2_EARLY_BLOCKS`` weight blocks (at most ``STAGES``) before its wait
    on the row block (``_load_w2``): at a few tokens the weights are the whole stream, and the
    first ones had waited for the rows' loads, or the row block's Linear-1 tiles, before they
    were asked for. INSTRUMENT: a Linear-2 tile's spin count into its trace record."""
    HALF_ROWS: gl.constexpr = BLOCK_M // 2
    ONE_HALF: gl.constexpr = a_smem.shape[0] == STAGES  # a ring of one A half a stage
    vec: gl.constexpr = COPY_BYTES if FP8 else COPY_BYTES // 2
    gather: gl.constexpr = gl.BlockedLayout([1, vec], [32 * vec // BLOCK_K, BLOCK_K // vec],
                                            [PRODUCER_WARPS, 1], [1, 0])
    x_rows = gl.multiple_of(gl.load(a_rows).to(gl.pointer_type(h_desc.dtype)), 16)
    it = 0  # K blocks issued by this program so far: stage it % STAGES, phase (it // STAGES) & 1
    for i in range(n_tiles):
        kind = gl.load(tiles + i * TILE_FIELDS)
        expert = gl.load(tiles + i * TILE_FIELDS + 1)
        row0 = gl.load(tiles + i * TILE_FIELDS + 2) * BLOCK_M
        n_block = gl.load(tiles + i * TILE_FIELDS + 3)
        if (expert >= 0) & (expert < num_experts):
            second_half = _routed_half(row_slot, row0 + HALF_ROWS)
            if ONE_HALF:
                # a ring of one A half a stage, for calls whose bound keeps every
                # expert's rows in its first half: a routed second half is an error, never loaded
                # (its consumer reads the first half's rows: the call's output is invalid)
                if second_half:
                    gl.atomic_add(error, 1)
            if kind == TILE_L1:
                gate_row = expert * (2 * INTER) + n_block * BLOCK_N1
                origin0 = _origin_rows(row_origin, row0, gather, HALF_ROWS)
                origin1 = _origin_rows(row_origin, row0 + HALF_ROWS, gather, HALF_ROWS)
                for kk in range(l1_k_blocks):
                    k = kk * BLOCK_K
                    s = it % STAGES
                    # a fresh mbarrier passes a wait on the phase before its first: the first
                    # STAGES K blocks go straight in
                    mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                    # the weights first: they need none of the rows' loads (origin, slot) that
                    # the gather waits for
                    tma.async_copy_global_to_shared(w1_desc, [gate_row, k], ready.index(s),
                                                    b_smem.index(s).slice(0, BLOCK_N1))
                    tma.async_copy_global_to_shared(w1_desc, [gate_row + INTER, k],
                                                    ready.index(s),
                                                    b_smem.index(s).slice(BLOCK_N1, BLOCK_N1))
                    _gather_half(x_rows, origin0, k,
                                 a_smem.index(_a_slot(a_smem, s, 0, STAGES)), HIDDEN, gather,
                                 BLOCK_K)
                    if not ONE_HALF:
                        if second_half:
                            _gather_half(x_rows, origin1, k,
                                         a_smem.index(_a_slot(a_smem, s, 1, STAGES)), HIDDEN,
                                         gather, BLOCK_K)
                    async_copy.mbarrier_arrive(ready.index(s))
                    gl.thread_barrier()
                    mbarrier.expect(ready.index(s), 2 * w1_desc.block_type.nbytes)
                    it += 1
            else:
                n2, split, k0, n_k = _l2_split(n_block, l2_k_blocks, l2_splits, HIDDEN, BLOCK_N2,
                                               SPLIT_K)
                w_row = expert * HIDDEN + n2 * BLOCK_N2
                # the first stages' weights before the wait on the row block's Linear-1 tiles,
                # which they do not need: they stream while those run. At most L2_EARLY_BLOCKS:
                # ONE_HALF's 5 (DiT-MoE bf16) took the kernel 1.03x its time at one token at
                # EP = 1, where Linear-1 streams at HBM's rate (ab on one H100, README)
                early = gl.minimum(n_k, L2_EARLY_BLOCKS if STAGES > L2_EARLY_BLOCKS else STAGES)
                for e in range(early):
                    _load_w2(w2_desc, w_row, (k0 + e) * BLOCK_K, it + e, ready, empty, b_smem,
                             BLOCK_N2, STAGES)
                spins = _wait_rows_ready(row_ready + row0 // BLOCK_M, 2 * (INTER // BLOCK_N1),
                                         error, max_spin)
                if INSTRUMENT:
                    gl.store(trace + i * TRACE_FIELDS + 9, spins.to(gl.int64))
                for kk in range(n_k):
                    k = (k0 + kk) * BLOCK_K
                    s = it % STAGES
                    if kk >= early:
                        _load_w2(w2_desc, w_row, k, it, ready, empty, b_smem, BLOCK_N2, STAGES)
                    if ONE_HALF:
                        mbarrier.expect(ready.index(s),
                                        h_desc.block_type.nbytes + w2_desc.block_type.nbytes)
                    else:
                        _expect_stage(ready.index(s), h_desc.block_type.nbytes,
                                      w2_desc.block_type.nbytes, second_half)
                    _load_a(h_desc, row0, k, ready.index(s), a_smem, s, second_half, HALF_ROWS,
                            STAGES)
                    it += 1


@gluon.jit
def _fp8_halves_mainloop(half: gl.constexpr, it, a_smem, b_smem, ready, empty, a_scales,
                         b0_scales, b1_scales, n_k, LINEAR1: gl.constexpr, STAGES: gl.constexpr,
                         HALF_ROWS: gl.constexpr):
    """FP8 accumulators of a stage's two 128-row B halves (Linear-1: gate and up; a 256-wide
    Linear-2 tile: its two scale blocks of columns) for this warpgroup's rows, each K block's
    wgmma group promoted with its scales: ``a_scales`` per row (this warpgroup's row pointers;
    Linear-2's read at L2, where other SMs released them), ``b0_scales``/``b1_scales`` per K
    block. ``LINEAR1``: A came by ``cp.async`` (``_wait_stage``)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, SCALE_BLOCK, 32])
    a_scales = gl.convert_layout(a_scales, gl.SliceLayout(1, mma))
    acc0 = gl.zeros([HALF_ROWS, SCALE_BLOCK], gl.float32, layout=mma)
    acc1 = gl.zeros([HALF_ROWS, SCALE_BLOCK], gl.float32, layout=mma)
    t = gl.zeros([HALF_ROWS, SCALE_BLOCK], gl.float32, layout=mma)
    for kk in range(n_k):
        s = _wait_stage(it, ready, LINEAR1, STAGES)
        a = a_smem.index(_a_slot(a_smem, s, half, STAGES))
        b = b_smem.index(s)
        t = warpgroup_mma(a, b.slice(0, SCALE_BLOCK).permute((1, 0)), t, use_acc=False,
                          is_async=True)
        # scale loads in flight under the wgmma
        if LINEAR1:
            a_s = gl.load(a_scales + kk)
        else:
            a_s = gl.load(a_scales + kk, cache_modifier=".cg")
        s0 = gl.load(b0_scales + kk)
        s1 = gl.load(b1_scales + kk)
        t = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
        acc0 += t * (a_s * s0)[:, None]
        t = warpgroup_mma(a, b.slice(SCALE_BLOCK, SCALE_BLOCK).permute((1, 0)), t,
                          use_acc=False, is_async=True)
        t = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
        mbarrier.arrive(empty.index(s))
        acc1 += t * (a_s * s1)[:, None]
        it += 1
    return acc0, acc1, it


@gluon.jit
def _wait_stage(it, ready, LINEAR1: gl.constexpr, STAGES: gl.constexpr):
    """Wait until stage ``it % STAGES`` is filled; returns the stage. ``LINEAR1``: its A rows came
    by ``cp.async`` (generic proxy), so this thread fences before wgmma (async proxy) reads them."""
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    if LINEAR1:
        fence_async_shared()
    return s


@gluon.jit
def _linear1_mainloop(half: gl.constexpr, it, a_smem, b_smem, ready, empty, a_rows, row_origin,
                      w1_scale, row_base, expert, n_block, HIDDEN, INTER, n_k, FP8: gl.constexpr,
                      BLOCK_N1: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                      HALF_ROWS: gl.constexpr):
    """Gate and up accumulators ``[HALF_ROWS, BLOCK_N1]`` of this warpgroup's rows; the next
    ``it``."""
    if FP8:
        k_scales = HIDDEN // SCALE_BLOCK
        # each row's scales: its own row's where the routing laid them out by layout row (a_rows'
        # third slot), else its origin row's in x's (padding rows: any row's, never stored).
        # Scales read through the rows' tokens took DiT-MoE's FP8 kernel at EP = 1 and 8192
        # tokens 2.4% longer than by layout row, the rows still read through their tokens
        # (moe_gather_probe/h200-x1/20261204T180629Z-0a56654b8d): a row block's tokens lie about
        # eight apart there, so each row's 44 bytes of scales take a line of their own
        per_row: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [4, 1], [1, 0])
        origin = _origin_rows(row_origin, row_base, per_row, HALF_ROWS)
        own = row_base + gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, per_row))
        x_scale = gl.load(a_rows + 1).to(gl.pointer_type(gl.float32))
        by_row = gl.load(a_rows + 2) != 0
        a_scales = x_scale + gl.where(by_row, own, gl.maximum(origin, 0)).to(gl.int64) * k_scales
        # the tile's gate (up) columns lie in one 128 x 128 weight scale block (BLOCK_N1 == 128)
        g_scales = w1_scale + (expert * (2 * INTER // SCALE_BLOCK) + n_block) * k_scales
        acc_g, acc_u, it = _fp8_halves_mainloop(half, it, a_smem, b_smem, ready, empty,
                                                a_scales, g_scales,
                                                g_scales + (INTER // SCALE_BLOCK) * k_scales, n_k,
                                                True, STAGES, HALF_ROWS)
    elif BLOCK_N1 == 64:
        # 256-row tiles: gate and up as one m64n128k16 group (the stage's B rows hold them side
        # by side), 6 KiB of shared memory read where two m64n64k16 groups read 8 KiB (A twice).
        # On one H100 the 256-row kernels took 0.964-1.015x the time of two groups (geometric
        # mean 0.985; 12 cells, 25 measurements in three ab jobs: moe_layer/h100-80gb-hbm3-x1/
        # …171756Z, …172332Z, …173153Z, retired). At 128 rows one m64n256 group instead of two
        # m64n128 gained nothing measurable (the graphed call 0.987-1.070x; 18 cells, 23
        # measurements in two of those jobs), so those stay two
        acc, it = _one_group_mainloop(half, it, a_smem, b_smem, ready, empty, n_k, 2 * BLOCK_N1,
                                      True, STAGES, HALF_ROWS)
        # a thread holds column c and c + BLOCK_N1 of its rows: the split moves no data
        acc_g, acc_u = acc.reshape([HALF_ROWS, 2, BLOCK_N1]).permute((0, 2, 1)).split()
    else:
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N1, 16])
        acc_g = gl.zeros([HALF_ROWS, BLOCK_N1], gl.float32, layout=mma)
        acc_u = gl.zeros([HALF_ROWS, BLOCK_N1], gl.float32, layout=mma)
        # one K block's gate and up groups stay in flight while the next block's are issued;
        # a stage is released once the groups that read it have retired
        s = _wait_stage(it, ready, True, STAGES)
        b = b_smem.index(s)
        a = a_smem.index(_a_slot(a_smem, s, half, STAGES))
        acc_g = warpgroup_mma(a, b.slice(0, BLOCK_N1).permute((1, 0)), acc_g, use_acc=False,
                              is_async=True)
        acc_u = warpgroup_mma(a,
                              b.slice(BLOCK_N1, BLOCK_N1).permute((1, 0)), acc_u, use_acc=False,
                              is_async=True)
        # waits for nothing (two groups in flight): turns the tokens into loop-carried tensors
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
        prev = s
        it += 1
        for kk in range(1, n_k):
            s = _wait_stage(it, ready, True, STAGES)
            a = a_smem.index(_a_slot(a_smem, s, half, STAGES))
            b = b_smem.index(s)
            acc_g = warpgroup_mma(a, b.slice(0, BLOCK_N1).permute((1, 0)), acc_g, is_async=True)
            acc_u = warpgroup_mma(a, b.slice(BLOCK_N1, BLOCK_N1).permute((1, 0)), acc_u,
                                  is_async=True)
            acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
            mbarrier.arrive(empty.index(prev))
            prev = s
            it += 1
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
        mbarrier.arrive(empty.index(prev))
    return acc_g, acc_u, it


@gluon.jit
def _linear2_mainloop(half: gl.constexpr, it, a_smem, b_smem, ready, empty, h_scale, w2_scale,
                      rows, expert, n_block, k0, HIDDEN, INTER, n_k, FP8: gl.constexpr,
                      BLOCK_N2: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                      HALF_ROWS: gl.constexpr):
    """The ``[HALF_ROWS, BLOCK_N2]`` accumulator of this warpgroup's rows over the ``n_k`` K
    blocks from ``k0``; the next ``it``."""
    if FP8:
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N2, 32])
        acc = gl.zeros([HALF_ROWS, BLOCK_N2], gl.float32, layout=mma)
        k_scales = INTER // SCALE_BLOCK
        # .cg: h's scales were released by other SMs; read them at L2
        h_scales = h_scale + gl.convert_layout(rows, gl.SliceLayout(1, mma)) * k_scales + k0
        w_scales = w2_scale + (expert * (HIDDEN // SCALE_BLOCK) + n_block) * k_scales + k0
        t = gl.zeros([HALF_ROWS, BLOCK_N2], gl.float32, layout=mma)
        for kk in range(n_k):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            t = warpgroup_mma(a_smem.index(_a_slot(a_smem, s, half, STAGES)),
                              b_smem.index(s).slice(0, BLOCK_N2).permute((1, 0)), t,
                              use_acc=False, is_async=True)
            # loaded a block ahead instead (block 0's after its stage's wait), these scales took
            # the traced Linear-2 mainloop of DiT-MoE FP8 at one token 1.04-1.08x its time, the
            # graphed call 0.98-1.01x at 1, 8 and 4096 tokens (b9d26db, reverted; ab on one
            # H100: moe_layer/h100-80gb-hbm3-x1 …123417Z against …123337Z, both retired, and
            # …123447Z), though Nsight Compute sampled the product waiting on them (moe_ncu)
            scale = gl.load(h_scales + kk, cache_modifier=".cg") * gl.load(w_scales + kk)
            t = warpgroup_mma_wait(num_outstanding=0, deps=(t, ))
            mbarrier.arrive(empty.index(s))
            acc += t * scale[:, None]
            it += 1
    else:
        acc, it = _one_group_mainloop(half, it, a_smem, b_smem, ready, empty, n_k, BLOCK_N2, False,
                                      STAGES, HALF_ROWS)
    return acc, it


@gluon.jit
def _one_group_mainloop(half: gl.constexpr, it, a_smem, b_smem, ready, empty, n_k,
                        N: gl.constexpr, LINEAR1: gl.constexpr, STAGES: gl.constexpr,
                        HALF_ROWS: gl.constexpr):
    """bf16: the ``[HALF_ROWS, N]`` accumulator of this warpgroup's rows over the stage's first
    ``N`` B rows and ``n_k`` K blocks, one wgmma group in flight while the next block's is issued,
    a stage released once the group that read it has retired; the next ``it``. ``LINEAR1``: the
    A rows came by ``cp.async`` (``_wait_stage``)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, N, 16])
    acc = gl.zeros([HALF_ROWS, N], gl.float32, layout=mma)
    s = _wait_stage(it, ready, LINEAR1, STAGES)
    acc = warpgroup_mma(a_smem.index(_a_slot(a_smem, s, half, STAGES)),
                        b_smem.index(s).slice(0, N).permute((1, 0)), acc, use_acc=False,
                        is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))  # waits for nothing: a tensor
    prev = s
    it += 1
    for kk in range(1, n_k):
        s = _wait_stage(it, ready, LINEAR1, STAGES)
        acc = warpgroup_mma(a_smem.index(_a_slot(a_smem, s, half, STAGES)),
                            b_smem.index(s).slice(0, N).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index(prev))
        prev = s
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index(prev))
    return acc, it


@gluon.jit
def _linear1_epilogue(acc_g, acc_u, h, h_scale, row_ready, row_block, row_base, n_block, INTER,
                      FP8: gl.constexpr, BLOCK_N1: gl.constexpr, HALF_ROWS: gl.constexpr):
    """SwiGLU, ``h`` stored with 16-byte stores (re-quantized per row in FP8), then this
    warpgroup's release of its rows to the row block's counter."""
    hv = _silu(acc_g) * acc_u
    if FP8:
        # BLOCK_N1 == 128: the tile holds exactly one activation scale block per row
        scale = gl.maximum(gl.max(gl.abs(hv), axis=1), 1e-12) / E4M3_MAX
        # one reciprocal a row: div.full is x · rcp(y), the same bits while y is below 2^126
        q = (hv * (1.0 / scale)[:, None]).to(gl.float8e4nv)
        out_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // BLOCK_N1, BLOCK_N1 // 16],
                                                    [4, 1], [1, 0])
        q = gl.convert_layout(q, out_layout)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N1, 32 if FP8 else 16])
        scale_rows = row_base + gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, mma))
        gl.store(h_scale + scale_rows.to(gl.int64) * (INTER // SCALE_BLOCK) + n_block, scale)
    else:
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N1, BLOCK_N1 // 8],
                                                    [4, 1], [1, 0])
        q = gl.convert_layout(hv.to(gl.bfloat16), out_layout)
    rows = (row_base + gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, out_layout))).to(gl.int64)
    cols = n_block * BLOCK_N1 + gl.arange(0, BLOCK_N1, layout=gl.SliceLayout(0, out_layout))
    gl.store(h + rows[:, None] * INTER + cols[None, :], q)
    _release_rows(row_ready, row_block)


@gluon.jit
def _release_rows(row_ready, row_block):
    """This warpgroup's share of a Linear-1 tile released to the row block's counter: every
    thread's ``h`` stores, then (CTA barrier + release cumulativity) the counter."""
    _fence_proxy_async_global()
    gl.thread_barrier()
    gl.atomic_add(row_ready + row_block, 1, sem="release", scope="gpu")


@gluon.jit
def _pass_stages(it, ready, empty, n_k, STAGES: gl.constexpr):
    """A padding half's pass over a tile's K blocks: each stage waited for and released unread
    (its wait keeps this warpgroup's releases in the ring's phase); the next ``it``."""
    for kk in range(n_k):
        s = it % STAGES
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        mbarrier.arrive(empty.index(s))
        it += 1
    return it


@gluon.jit
def _combine_rows(row_src, row_slot, combine_ptrs, row_base, HIDDEN, layout: gl.constexpr,
                  ROWS: gl.constexpr):
    """Where the ``ROWS`` layout rows from ``row_base`` (``layout``'s row slice) go: each row's
    row of its source rank's Combine buffer (``row_src``) at its slot (``row_slot``), and whether
    it is routed (slot -1 is padding)."""
    rows = row_base + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    slot = gl.load(row_slot + rows)
    src = gl.load(row_src + rows)
    # Buffers are 16-byte aligned (host contract): the stores go out as vectors up to 16 bytes
    base = gl.multiple_of(gl.load(combine_ptrs + src).to(gl.pointer_type(gl.bfloat16)), 16)
    return base + slot.to(gl.int64) * HIDDEN, slot >= 0


@gluon.jit
def _pick_weights(row_slot, row_base, sum_args, layout: gl.constexpr, ROWS: gl.constexpr,
                  SUM_WEIGHT_DTYPE: gl.constexpr):
    """The top-k weight of each of the ``ROWS`` layout rows from ``row_base`` (``layout``: their
    slice), fp32, 0 on padding: at EP = 1 a row's slot is its pick's index in ``topk_weights``
    (``sum_args[1]``'s address)."""
    slot = gl.load(row_slot + row_base + gl.arange(0, ROWS, layout=layout))
    weights = gl.load(sum_args + 1).to(gl.pointer_type(SUM_WEIGHT_DTYPE))
    return gl.load(weights + slot, mask=slot >= 0, other=0.0).to(gl.float32)


@gluon.jit
def _add_rows(rows, row_slot, row_base, cols, sum_args, HIDDEN, layout: gl.constexpr,
              ROWS: gl.constexpr, SUM_TOP_K: gl.constexpr):
    """``SUM_ATOMIC`` (EP = 1): ``rows`` (bf16 ``[ROWS, N]`` in ``layout``: the ``ROWS`` layout
    rows from ``row_base``, columns ``cols``, already times their top-k weights:
    ``_pick_weights``) added into their tokens' rows of the output instead of stored into
    their Combine rows: relaxed bf16 adds at L2 (slot ``i`` is token ``i // SUM_TOP_K``'s pick;
    ``sum_args[2]`` the output's address, zeroed by the routing; padding rows skipped), so no
    pass after the kernel sums them. No wait for them: the X-Stage drains them."""
    slot = gl.load(row_slot + row_base + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout)))
    out = gl.multiple_of(gl.load(sum_args + 2).to(gl.pointer_type(gl.bfloat16)), 16)
    dst = out + (slot // SUM_TOP_K).to(gl.int64) * HIDDEN
    gl.atomic_add(dst[:, None] + cols[None, :], rows, mask=(slot >= 0)[:, None], sem="relaxed",
                  scope="gpu")


@gluon.jit
def _linear2_combine_epilogue(acc, row_src, row_slot, combine_ptrs, row_base, n_block, sum_args,
                              HIDDEN, BLOCK_N2: gl.constexpr, HALF_ROWS: gl.constexpr,
                              SUM_TOP_K: gl.constexpr, SUM_WEIGHT_DTYPE: gl.constexpr,
                              SUM_ATOMIC: gl.constexpr):
    """Each result row into its source rank's Combine buffer, 16-byte stores; padding rows
    are skipped. No wait for the stores: the X-Stage drains them. ``SUM_ATOMIC``: each row
    times its top-k weight added into the output instead (``_add_rows``)."""
    if SUM_ATOMIC:
        acc = acc * _pick_weights(row_slot, row_base, sum_args, gl.SliceLayout(1, acc.type.layout),
                                  HALF_ROWS, SUM_WEIGHT_DTYPE)[:, None]
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_N2, BLOCK_N2 // 8],
                                                [4, 1], [1, 0])
    out = gl.convert_layout(acc.to(gl.bfloat16), out_layout)
    if SUM_ATOMIC:
        cols = n_block * BLOCK_N2 + gl.arange(0, BLOCK_N2, layout=gl.SliceLayout(0, out_layout))
        _add_rows(out, row_slot, row_base, cols, sum_args, HIDDEN, out_layout, HALF_ROWS,
                  SUM_TOP_K)
    else:
        dst, routed = _combine_rows(row_src, row_slot, combine_ptrs, row_base, HIDDEN,
                                    out_layout, HALF_ROWS)
        cols = n_block * BLOCK_N2 + gl.arange(0, BLOCK_N2, layout=gl.SliceLayout(0, out_layout))
        gl.store(dst[:, None] + cols[None, :], out, mask=routed[:, None])


@gluon.jit
def _store_partial(acc, l2_partial, row_slot, prow, row_base, col0, HIDDEN, N: gl.constexpr,
                   FP8: gl.constexpr, HALF_ROWS: gl.constexpr):
    """A split's fp32 partial ``[HALF_ROWS, N]`` of this warpgroup's rows, in its wgmma layout (no
    conversion), into rows ``prow ..`` of ``l2_partial`` at columns ``col0 ..``: routed rows
    only."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, N, 32 if FP8 else 16])
    r = gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, mma))
    routed = gl.load(row_slot + row_base + r) >= 0
    cols = col0 + gl.arange(0, N, layout=gl.SliceLayout(0, mma))
    gl.store(l2_partial + ((prow + r).to(gl.int64) * HIDDEN)[:, None] + cols[None, :], acc,
             mask=routed[:, None])


@gluon.jit
def _last_split(counter, l2_splits, EXCLUSIVE: gl.constexpr):
    """This warpgroup's split released to its tile half's ``counter`` after every thread's
    partial stores, then whether every split has arrived, read alike by the whole warpgroup (the
    lowest count its threads acquire): true for the warpgroup that sums. Two may both find every
    split there and both sum; they store the same rows. ``EXCLUSIVE`` (sums added into the
    output: two would add them twice): only the warpgroup whose add was the last."""
    gl.thread_barrier()
    before = gl.atomic_add(counter, 1, sem="release", scope="gpu")
    gl.thread_barrier()
    threads: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    seen = _load_acquire(counter + gl.zeros([128], gl.int32, layout=threads))
    last = gl.min(seen, axis=0) == l2_splits
    if EXCLUSIVE:
        last = last & (before == l2_splits - 1)
    return last


@gluon.jit
def _combine_split_sums(l2_partial, row_src, row_slot, combine_ptrs, prow0, row_base, col0,
                        l2_splits, sum_args, HIDDEN, N: gl.constexpr, BLOCK_M: gl.constexpr,
                        SUM_TOP_K: gl.constexpr, SUM_WEIGHT_DTYPE: gl.constexpr,
                        SUM_ATOMIC: gl.constexpr):
    """The Combine rows of a split tile's half: the splits' partials (split ``s`` at rows
    ``prow0 + s · BLOCK_M ..`` of ``l2_partial``) summed in split order, read at L2 (``.cg``:
    other SMs wrote them), into their Combine rows (``_combine_rows``; ``SUM_ATOMIC``: weighted
    and added into the output instead, ``_add_rows``). Only the rows up to the
    half's last routed one, ``SUM_ROWS`` of them at a time, all ``N`` columns: at a few tokens a
    half holds one or two routed rows, one group. ``SPLIT_LOADS`` splits' loads a step, issued
    together and needing nothing but the rows in use (the Combine rows' addresses load beside
    them): a 6-split tile waits two L2 round trips a group. Summed over all 64 rows, 64 columns
    a step, two splits a step, it had waited four a step: eight in all over DiT-MoE's 128-wide
    tiles (sixteen over 256-wide ones), where DiT-MoE at one token spent 3.8-6.1 us after its
    last Linear-2 mainloop (moe_layer/h200-x1/20261205T134536Z-8c78544a6b, …134317Z,
    ``trace_l2_tail_us``; unsplit shapes 0.8-1.0 us). On an H100, DiT-MoE at one token at
    EP = 1, one ab job (base, this, base): that time 2.5 us against 4.0-4.3 (bf16) and 3.7
    against 6.0-6.2 (FP8); the graphed call 0.949x in bf16 and 1.021x in FP8, the kernel's
    device time in the call 0.969x and 0.976x (moe_layer/h100-80gb-hbm3-x1 …142515Z; it and the
    base runs retired, its bytes at 93a4e5d). Two more such jobs there, DiT-MoE at 1
    and 8 tokens in both settings: the graphed call faster than both base runs in five of the
    eight cells (0.916-0.988x), within them in one (FP8 at one token at EP = 1, 1.006x), slower
    in two (FP8 at 8 tokens at EP = 1, 1.019x; bf16 at 8 tokens on the EP = 8 rank, 1.031x);
    that time at one token 2.6-3.8 us against 3.8-6.9 (…145704Z, …145918Z: they and the base
    runs retired, their bytes at 93a4e5d)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // SUM_THREAD_COLS, SUM_THREAD_COLS],
                                            [4, 1], [1, 0])
    SUM_ROWS: gl.constexpr = PARTIAL_ELEMENTS // N
    half_rows = gl.arange(0, BLOCK_M // 2, layout=gl.SliceLayout(1, layout))
    # one past the half's last routed row: the rows summed
    in_use = gl.max(gl.where(gl.load(row_slot + row_base + half_rows) >= 0, half_rows + 1, 0),
                    axis=0)
    r = gl.arange(0, SUM_ROWS, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, N, layout=gl.SliceLayout(0, layout))
    split_rows = BLOCK_M * HIDDEN
    for r0 in range(0, in_use, SUM_ROWS):
        rows = (r0 + r < in_use)[:, None]
        part = l2_partial + ((prow0 + r0 + r).to(gl.int64) * HIDDEN)[:, None] + cols[None, :]
        total = gl.full([SUM_ROWS, N], -0.0, gl.float32, layout=layout)  # x + -0.0 is x
        for s0 in range(0, l2_splits, SPLIT_LOADS):
            for j in gl.static_range(SPLIT_LOADS):
                is_split = s0 + j < l2_splits
                partial = gl.load(part + (s0 + j) * split_rows, mask=rows & is_split,
                                  cache_modifier=".cg")
                total = gl.where(is_split, total + partial, total)
        if SUM_ATOMIC:
            total = total * _pick_weights(row_slot, row_base + r0, sum_args,
                                          gl.SliceLayout(1, layout), SUM_ROWS,
                                          SUM_WEIGHT_DTYPE)[:, None]
            _add_rows(total.to(gl.bfloat16), row_slot, row_base + r0, cols, sum_args, HIDDEN,
                      layout, SUM_ROWS, SUM_TOP_K)
        else:
            dst, routed = _combine_rows(row_src, row_slot, combine_ptrs, row_base + r0, HIDDEN,
                                        layout, SUM_ROWS)
            gl.store(dst[:, None] + cols[None, :], total.to(gl.bfloat16), mask=routed[:, None])


@gluon.jit(noinline=True)
def _release_system(flag):
    """FENCE's system-scope release (one thread of the calling warpgroup, after its barrier), as
    a call: inlined, an atomic can reshape ptxas's schedule of the mainloop before it (seen in
    flash_attention_ws.py's fenced epilogue)."""
    gl.atomic_add(flag, 0, sem="release", scope="sys")


@gluon.jit
def _sum_control_store(control, sum_args, sum_arrivals, sum_tokens, max_spin):
    """The weighted sum's control block (int64 [SUM_CONTROL] in shared memory), written once at
    the launch's start: where the arrivals are counted, the count at which every consumer
    warpgroup of this launch has arrived (two a program: the launches before arrived in full,
    and this program's have not yet, so the count read now lies in this launch's span), the
    addresses' block, the tokens and the spin bound. The partitions read it after their
    mainloops: nothing of the sum stays in registers across them."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    slot = gl.arange(0, SUM_CONTROL, layout=layout)
    parties = 2 * gl.num_programs(0)
    everyone = (_load_acquire_b64(sum_arrivals) // parties + 1) * parties
    value = gl.where(slot == CONTROL_ARRIVALS, sum_arrivals.to(gl.int64),
                     gl.where(slot == CONTROL_EVERYONE, everyone,
                              gl.where(slot == CONTROL_ARGS, sum_args.to(gl.int64),
                                       gl.where(slot == CONTROL_TOKENS, sum_tokens, max_spin))))
    control.store(value.to(gl.int64))


@gluon.jit
def _sum_control(control, slot: gl.constexpr):
    """Slot ``slot`` of the control block (``_sum_control_store``), alike in every thread."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    return gl.max(control.slice(slot, 1).load(layout), axis=0)


@gluon.jit
def _arrive(control):
    """This warpgroup's arrival (after its barrier: a release of every thread's Combine stores)."""
    arrivals = _sum_control(control, CONTROL_ARRIVALS).to(gl.pointer_type(gl.int64))
    gl.thread_barrier()
    gl.atomic_add(arrivals, 1, sem="release", scope="gpu")


@gluon.jit(noinline=True)
def _weighted_sum_share(control, error, HIDDEN, TOP_K: gl.constexpr, WEIGHT_DTYPE: gl.constexpr):
    """The top-k weighted sum of ``moe_combine.weighted_sum`` (EP = 1), shared by the launch's
    programs once every consumer warpgroup arrived (``_arrive``) with its Combine rows stored:
    this warpgroup acquire-spins (bounded: ``_spin_until``) until the count reaches this
    launch's (``_sum_control_store``), then sums its program's share of the (token, ``SUM_COLS``
    columns) pieces: ``out[t] = sum_j w[t, j] * rows[t * TOP_K + j]`` in fp32, the picks added in
    order ``j = 0 .. TOP_K - 1``, rounded once to bf16. The addresses' block holds those of the
    Combine rows, of the top-k weights (``WEIGHT_DTYPE``) and of the output. Not inlined: it runs
    once, after the mainloops."""
    arrivals = _sum_control(control, CONTROL_ARRIVALS).to(gl.pointer_type(gl.int64))
    everyone = _sum_control(control, CONTROL_EVERYONE)
    _spin_until(arrivals, everyone, error, _sum_control(control, CONTROL_MAX_SPIN), True)
    sum_args = _sum_control(control, CONTROL_ARGS).to(gl.pointer_type(gl.int64))
    tokens = _sum_control(control, CONTROL_TOKENS).to(gl.int32)
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])
    rows = gl.multiple_of(gl.load(sum_args).to(gl.pointer_type(gl.bfloat16)), 16)
    weights = gl.load(sum_args + 1).to(gl.pointer_type(WEIGHT_DTYPE))
    out = gl.multiple_of(gl.load(sum_args + 2).to(gl.pointer_type(gl.bfloat16)), 16)
    pieces = gl.cdiv(HIDDEN, SUM_COLS)
    for piece in range(gl.program_id(0), tokens * pieces, gl.num_programs(0)):
        t = (piece // pieces).to(gl.int64)
        cols = (piece % pieces) * SUM_COLS + gl.arange(0, SUM_COLS, layout=layout)
        live = cols < HIDDEN
        acc = gl.zeros([SUM_COLS], gl.float32, layout=layout)
        for j in gl.static_range(TOP_K):
            w = gl.load(weights + t * TOP_K + j).to(gl.float32)
            # .cg: other SMs stored them
            v = gl.load(rows + (t * TOP_K + j) * HIDDEN + cols, mask=live, other=0.0,
                        cache_modifier=".cg")
            acc += w * v.to(gl.float32)
        gl.store(out + t * HIDDEN + cols, acc.to(gl.bfloat16), mask=live)


@gluon.jit
def _consumer(half: gl.constexpr, tiles, n_tiles, a_smem, b_smem, ready, empty, a_rows,
              row_origin, w1_scale, w2_scale, h, h_scale, row_ready, row_src, row_slot,
              combine_ptrs, error, num_experts, trace, HIDDEN, INTER, l1_k_blocks, l2_k_blocks,
              l2_splits, l2_partial, l2_ready, sum_control, sum_args, FP8: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N1: gl.constexpr, BLOCK_N2: gl.constexpr,
              BLOCK_K: gl.constexpr, STAGES: gl.constexpr, INSTRUMENT: gl.constexpr,
              FENCE: gl.constexpr, SPLIT_K: gl.constexpr, SUM_TOP_K: gl.constexpr,
              SUM_WEIGHT_DTYPE: gl.constexpr, SUM_ATOMIC: gl.constexpr):
    """Rows [half·BLOCK_M/2, (half + 1)·BLOCK_M/2) of every tile of this program, in table order.

    INSTRUMENT (consumer 0 only, each stamp after its warpgroup's barrier): entry (0); the
    tile's first K block in shared memory (1: for Linear-2 after the producer's acquire-spin, so
    0 -> 1 is the wait for Linear-1 inputs, as in ``moe_fused.py``, plus any TMA latency the ring
    did not hide); mainloop end (2); every store of the epilogue issued (3: for Linear-2, the
    sender-visible span T_RS of the tile's Combine burst); ``%smid``. SUM_TOP_K: after the
    tiles, this warpgroup's arrival, then consumer 0's share of the weighted sum (none with
    SUM_ATOMIC: each Linear-2 epilogue added its rows into the output)."""
    stamped: gl.constexpr = INSTRUMENT and half == 0
    HALF_ROWS: gl.constexpr = BLOCK_M // 2
    row_layout: gl.constexpr = gl.SliceLayout(1, gl.BlockedLayout([1, 1], [32, 1], [4, 1],
                                                                  [1, 0]))
    it = 0
    for i in range(n_tiles):
        kind = gl.load(tiles + i * TILE_FIELDS)
        expert = gl.load(tiles + i * TILE_FIELDS + 1)
        row_block = gl.load(tiles + i * TILE_FIELDS + 2)
        n_block = gl.load(tiles + i * TILE_FIELDS + 3)
        if (expert < 0) | (expert >= num_experts):
            # an expert id out of range (a table built from bad routing): skipped by every
            # partition, counted once, never a load or store through it
            if half == 0:
                gl.atomic_add(error, 1)
        else:
            row_base = row_block * BLOCK_M + half * HALF_ROWS
            rows = (row_base + gl.arange(0, HALF_ROWS, layout=row_layout)).to(gl.int64)
            rec = trace + i * TRACE_FIELDS
            if stamped:
                _stamp(rec, 0)
                smid = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32,
                                                 is_pure=False, pack=1)
                gl.store(rec + 8, smid.to(gl.int64))
                # the first stage's data (a second wait on the same phase returns at once)
                mbarrier.wait(ready.index(it % STAGES), (it // STAGES) & 1)
                _stamp(rec, 1)
            n2, split, k0, l2_n_k = _l2_split(n_block, l2_k_blocks, l2_splits, HIDDEN, BLOCK_N2,
                                              SPLIT_K)
            if not _routed_half(row_slot, row_base):
                # padding rows only (half 1 of a row block with at most BLOCK_M / 2 routed rows,
                # as at small T): no wgmma, no stores; Linear-1 still counts its release
                if kind == TILE_L1:
                    it = _pass_stages(it, ready, empty, l1_k_blocks, STAGES)
                    _release_rows(row_ready, row_block)
                else:
                    it = _pass_stages(it, ready, empty, l2_n_k, STAGES)
            elif kind == TILE_L1:
                acc_g, acc_u, it = _linear1_mainloop(half, it, a_smem, b_smem, ready, empty,
                                                     a_rows, row_origin, w1_scale, row_base,
                                                     expert, n_block, HIDDEN, INTER, l1_k_blocks,
                                                     FP8, BLOCK_N1, BLOCK_K, STAGES, HALF_ROWS)
                if stamped:
                    _stamp(rec, 2)
                _linear1_epilogue(acc_g, acc_u, h, h_scale, row_ready, row_block, row_base,
                                  n_block, INTER, FP8, BLOCK_N1, HALF_ROWS)
            else:
                # split K: this split's partial rows, the splits of the tile's half stacked
                prow0 = row_block * l2_splits * BLOCK_M + half * HALF_ROWS
                prow = prow0 + split * BLOCK_M
                col0 = n2 * BLOCK_N2
                if FP8 and BLOCK_N2 == 2 * SCALE_BLOCK:
                    # two 128-column halves, as Linear-1's gate and up: one temporary fits the
                    # registers
                    k_scales = INTER // SCALE_BLOCK
                    w_scales = (w2_scale
                                + (expert * (HIDDEN // SCALE_BLOCK) + 2 * n2) * k_scales + k0)
                    acc0, acc1, it = _fp8_halves_mainloop(half, it, a_smem, b_smem, ready, empty,
                                                          h_scale + rows * k_scales + k0,
                                                          w_scales, w_scales + k_scales, l2_n_k,
                                                          False, STAGES, HALF_ROWS)
                    if stamped:
                        _stamp(rec, 2)
                    if not SPLIT_K:
                        _linear2_combine_epilogue(acc0, row_src, row_slot, combine_ptrs,
                                                  row_base, 2 * n2, sum_args, HIDDEN,
                                                  SCALE_BLOCK, HALF_ROWS, SUM_TOP_K,
                                                  SUM_WEIGHT_DTYPE, SUM_ATOMIC)
                        _linear2_combine_epilogue(acc1, row_src, row_slot, combine_ptrs,
                                                  row_base, 2 * n2 + 1, sum_args, HIDDEN,
                                                  SCALE_BLOCK, HALF_ROWS, SUM_TOP_K,
                                                  SUM_WEIGHT_DTYPE, SUM_ATOMIC)
                    else:
                        _store_partial(acc0, l2_partial, row_slot, prow, row_base, col0, HIDDEN,
                                       SCALE_BLOCK, FP8, HALF_ROWS)
                        _store_partial(acc1, l2_partial, row_slot, prow, row_base,
                                       col0 + SCALE_BLOCK, HIDDEN, SCALE_BLOCK, FP8, HALF_ROWS)
                else:
                    acc, it = _linear2_mainloop(half, it, a_smem, b_smem, ready, empty, h_scale,
                                                w2_scale, rows, expert, n2, k0, HIDDEN, INTER,
                                                l2_n_k, FP8, BLOCK_N2, BLOCK_K, STAGES,
                                                HALF_ROWS)
                    if stamped:
                        _stamp(rec, 2)
                    if not SPLIT_K:
                        _linear2_combine_epilogue(acc, row_src, row_slot, combine_ptrs, row_base,
                                                  n2, sum_args, HIDDEN, BLOCK_N2, HALF_ROWS,
                                                  SUM_TOP_K, SUM_WEIGHT_DTYPE, SUM_ATOMIC)
                    else:
                        _store_partial(acc, l2_partial, row_slot, prow, row_base, col0, HIDDEN,
                                       BLOCK_N2, FP8, HALF_ROWS)
                if SPLIT_K:
                    counter = l2_ready + (row_block * (HIDDEN // BLOCK_N2) + n2) * 2 + half
                    if _last_split(counter, l2_splits, SUM_ATOMIC):
                        _combine_split_sums(l2_partial, row_src, row_slot, combine_ptrs, prow0,
                                            row_base, col0, l2_splits, sum_args, HIDDEN,
                                            BLOCK_N2, BLOCK_M, SUM_TOP_K, SUM_WEIGHT_DTYPE,
                                            SUM_ATOMIC)
                        gl.store(counter, 0)
                if FENCE:
                    # completion-coupled (§2.3): the warpgroup's Combine stores, then a cumulative
                    # system-scope release that returns once all of them are visible to every GPU
                    gl.thread_barrier()
                    _release_system(error)
            if stamped:
                _stamp(rec, 3)
    # A system-scope release after the warpgroup's barrier: every remote Combine store of this
    # warpgroup is performed system-wide before the program exits, ahead of the host's
    # symmetric-memory barrier that tells the source ranks their rows are there.
    gl.thread_barrier()
    gl.atomic_add(error, 0, sem="release", scope="sys")
    if SUM_TOP_K > 0 and not SUM_ATOMIC:
        _arrive(sum_control)
        if half == 0:
            _weighted_sum_share(sum_control, error, HIDDEN, SUM_TOP_K, SUM_WEIGHT_DTYPE)


@gluon.jit(do_not_specialize=["sum_tokens"])
def moe_fused_ws_kernel(tiles, num_tiles, max_tiles, a_rows, row_origin, w1_desc, h_desc, w2_desc,
                        w1_scale, w2_scale, h, h_scale, row_ready, row_src, row_slot,
                        combine_ptrs, error, max_spin, num_experts, trace, HIDDEN, INTER,
                        l1_k_blocks, l2_k_blocks, l2_splits, l2_partial, l2_ready,
                        sum_args, sum_arrivals, sum_tokens, FP8: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N1: gl.constexpr, BLOCK_N2: gl.constexpr,
                        BLOCK_K: gl.constexpr,
                        STAGES: gl.constexpr, INSTRUMENT: gl.constexpr = False,
                        FENCE: gl.constexpr = False, SPLIT_K: gl.constexpr = False,
                        SUM_TOP_K: gl.constexpr = 0,
                        SUM_WEIGHT_DTYPE: gl.constexpr = gl.float32,
                        SUM_ATOMIC: gl.constexpr = False,
                        ONE_HALF: gl.constexpr = False):
    """One persistent program per table row (``tiles`` int32 [programs, max_tiles, 4],
    ``num_tiles`` int32 [programs], read on the device: a table sized by a static bound, its
    entries past ``num_tiles[g]`` never read); the schedule is the table, not this code. A tile
    whose expert lies outside ``0 .. num_experts - 1`` adds 1 to ``error`` and is skipped.

    Linear-1's rows: ``a_rows`` int64 [3] holds the addresses of ``x [N, HIDDEN]`` (16-byte aligned;
    the layout's dtype) and, FP8, of its scales, read on the device (a CUDA graph replays new
    tensors), and where the scales lie; layout row ``r`` is row ``row_origin[r]`` of ``x`` (int32
    [R], -1 on padding), its scales row ``r`` of ``[R, HIDDEN / 128]`` where ``a_rows[2]`` is 1,
    else row ``row_origin[r]`` of ``[N, HIDDEN / 128]``. Descriptors (row-major 2-D views):
    ``h_desc`` over ``h [R, INTER]`` with [BLOCK_M / 2, BLOCK_K] blocks, ``w1_desc`` over
    ``w1 [E·2·INTER, HIDDEN]`` with [BLOCK_N1, BLOCK_K] blocks, ``w2_desc`` over ``w2 [E·HIDDEN,
    INTER]`` with [BLOCK_N2, BLOCK_K] blocks. ``h`` and the scales as in ``moe_fused.py`` (FP8
    only: bf16 launches pass any pointer for the scales). ``BLOCK_M``: the rows of a tile, 128
    or 256 (``tiles.WS_ROW_TILES``), by which the layout pads every expert.
    ``row_ready`` int32 [R / BLOCK_M], zero at launch for the row blocks in use (no other is read).
    INSTRUMENT: ``trace`` is int64 [programs, max_tiles, TRACE_FIELDS] (``_consumer``); a separate
    build, compared only with itself. FENCE: every Linear-2 tile waits after its Combine stores
    until they are visible system-wide (the completion-coupled counterfactual).

    ``l1_k_blocks``/``l2_k_blocks``: the K blocks each Linear-1/Linear-2 mainloop runs,
    ``HIDDEN / BLOCK_K`` and ``INTER / BLOCK_K`` for the MoE layer. Fewer make a *synthetic*
    kernel (the X-Stage knee sweep: shorter mainloops, every Combine store kept) that computes
    the layer over the first K blocks only.

    ``SPLIT_K`` (a separate build, where ``l2_splits`` > 1): ``l2_splits`` K splits of each
    Linear-2 tile; a Linear-2 entry's ``n_block`` is ``split · HIDDEN / BLOCK_N2 + column
    block`` (``_l2_split``), ``l2_partial`` fp32 ``[row blocks · l2_splits · BLOCK_M, HIDDEN]`` (row
    blocks of the layout in use) and ``l2_ready`` int32 ``[row blocks · HIDDEN / BLOCK_N2 · 2]``,
    zero at the first launch and left zero by each. Without it both are never read.

    ``SUM_TOP_K`` > 0 (a separate build, EP = 1 only: every Combine row is this GPU's): the
    launch ends with the top-k weighted sum of its ``sum_tokens`` tokens' Combine rows, shared
    by the programs once every consumer warpgroup stored its rows (``_weighted_sum_share``; the
    weights of ``SUM_WEIGHT_DTYPE``): ``sum_args`` int64 [3] the addresses of the Combine rows,
    the top-k weights and the output, ``sum_arrivals`` int64 [1], zero at the first launch and
    counting two arrivals a program at every launch (never reset: launches of one count of
    programs share it). Without it the three are never read. ``SUM_ATOMIC`` (with
    ``SUM_TOP_K``): each Linear-2 epilogue adds its rows, weighted, into the output that the
    routing zeroed before the launch (``_add_rows``), for any number of tokens; no arrivals,
    no pass at the end, ``sum_arrivals`` and ``sum_tokens`` never read."""
    pid = gl.program_id(0)
    my_tiles = tiles + pid * max_tiles * TILE_FIELDS
    my_trace = trace + pid * max_tiles * TRACE_FIELDS
    n_tiles = gl.load(num_tiles + pid)
    b_rows: gl.constexpr = 2 * BLOCK_N1 if 2 * BLOCK_N1 > BLOCK_N2 else BLOCK_N2
    A_SLOTS: gl.constexpr = STAGES if ONE_HALF else 2 * STAGES
    a_smem = gl.allocate_shared_memory(h_desc.dtype, [A_SLOTS, BLOCK_M // 2, BLOCK_K],
                                       h_desc.layout)
    b_smem = gl.allocate_shared_memory(w1_desc.dtype, [STAGES, b_rows, BLOCK_K], w1_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # one release per consumer warpgroup
    if SUM_TOP_K > 0 and not SUM_ATOMIC:
        sum_control = gl.allocate_shared_memory(gl.int64, [SUM_CONTROL],
                                                gl.SwizzledSharedLayout(1, 1, 1, [0]))
        _sum_control_store(sum_control, sum_args, sum_arrivals, sum_tokens, max_spin)
    else:
        sum_control = ready  # never read
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (0, my_tiles, n_tiles, a_smem, b_smem, ready, empty, a_rows, row_origin,
                     w1_scale, w2_scale, h, h_scale, row_ready, row_src, row_slot, combine_ptrs,
                     error, num_experts, my_trace, HIDDEN, INTER, l1_k_blocks, l2_k_blocks,
                     l2_splits, l2_partial, l2_ready, sum_control, sum_args, FP8, BLOCK_M,
                     BLOCK_N1, BLOCK_N2, BLOCK_K, STAGES, INSTRUMENT, FENCE, SPLIT_K, SUM_TOP_K,
                     SUM_WEIGHT_DTYPE, SUM_ATOMIC)),
        (_consumer, (1, my_tiles, n_tiles, a_smem, b_smem, ready, empty, a_rows, row_origin,
                     w1_scale, w2_scale, h, h_scale, row_ready, row_src, row_slot, combine_ptrs,
                     error, num_experts, my_trace, HIDDEN, INTER, l1_k_blocks, l2_k_blocks,
                     l2_splits, l2_partial, l2_ready, sum_control, sum_args, FP8, BLOCK_M,
                     BLOCK_N1, BLOCK_N2, BLOCK_K, STAGES, INSTRUMENT, FENCE, SPLIT_K, SUM_TOP_K,
                     SUM_WEIGHT_DTYPE, SUM_ATOMIC)),
        (_producer, (my_tiles, n_tiles, a_rows, row_origin, w1_desc, h_desc, w2_desc, a_smem,
                     b_smem, ready, empty, row_ready, row_slot, error, max_spin, num_experts,
                     my_trace, HIDDEN, INTER, l1_k_blocks, l2_k_blocks, l2_splits, FP8, BLOCK_M,
                     BLOCK_N1, BLOCK_N2, BLOCK_K, STAGES, INSTRUMENT, SPLIT_K)),
    ], [4, PRODUCER_WARPS], [CONSUMER_REGS if BLOCK_M == 128 else TALL_CONSUMER_REGS,
                             PRODUCER_REGS if BLOCK_M == 128 else TALL_PRODUCER_REGS])
