"""Warp-specialized FlashAttention forward for Hopper (sm_90), in Gluon, with the LOCAL and REMOTE
epilogues of ``flash_attention.py`` (paper §4.3, Figs. 5-7; the Ulysses layout is described there).

Device code only: loaded by path through ``xstage_lab.kernel_sources.load_kernel_module``; the
launchers, their contracts and launch configurations: ``xstage_lab/experiments/attention/ulysses.py``.

Why a second kernel: the Triton kernel cannot warp-specialize on sm_90 (Triton 3.6's
``tl.range(warp_specialize=True)`` hangs or fails to compile there), and ncu shows cuDNN's
kernel, which is warp-specialized, keeping the tensor pipe 75% busy against 59% for the Triton
kernel (M = 16384, 12 heads, d = 128, one H200: data/records/fa_ncu; this kernel: 81%). Gluon,
Triton's lower-level language, exposes the warp partitions, mbarriers, TMA and wgmma that this
needs.

One CTA per 128-row output tile of one head, tiles numbered as in ``flash_attention_kernel``
(m blocks fastest). Three partitions:
  consumer 0, consumer 1   one warpgroup each, rows [64·half, 64·half + 64) of the tile: S = Q K^T
                           and O += P V by wgmma (P from registers), S_j issued together with the
                           PV of the tile before it, online softmax in between, then the tile
                           half's epilogue;
  producer                 one warp: Q once, then K and V tiles by TMA into STAGES-deep rings that
                           both consumers read (a K or V stage is refilled once both have
                           released it).
S is [64, b_n] and O is [64, d]: two wgmma layouts whose rows sit in the same threads, so moving
the softmax's row statistics from one to the other moves no data (no shared-memory round trip in
the sm_90 PTX).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)

# One addressing for every remote epilogue, and one trace format: the Triton kernel's, which the
# CPU tests run in Triton's interpreter (Gluon kernels do not run there).
from .flash_attention import TRACE_FIELDS, trace_sm, trace_stamp, ulysses_destination

# Registers per thread of the consumer warpgroups and of the producer (setmaxnreg).
CONSUMER_REGS = gl.constexpr(232)
PRODUCER_REGS = gl.constexpr(40)
HALF_ROWS = gl.constexpr(64)  # rows per consumer warpgroup: wgmma's M per warpgroup


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
              v_empty, row0, col, M, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The TMA producer warp: the tile's two Q halves, then every K and V tile of column block
    ``col`` into their rings, each stage once both consumers have released it."""
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row0, col], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [row0 + HALF_ROWS, col], q_bar, q_smem.index(1))
    for j in range(M // BLOCK_N):
        s = j % STAGES
        # a fresh mbarrier passes a wait on the phase before its first: the first STAGES
        # tiles go straight in; K_j (V_j) waits for both releases of K (V) of tile j - STAGES
        mbarrier.wait(k_empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [j * BLOCK_N, col], k_ready.index(s),
                                        k_smem.index(s))
        mbarrier.wait(v_empty.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [j * BLOCK_N, col], v_ready.index(s),
                                        v_smem.index(s))


@gluon.jit(noinline=True)
def _release_system(fence_flag):
    """The FENCED epilogue's system-scope release (one thread of the calling warpgroup, after
    its barrier), as a call: inlined, the atomic changes ptxas's schedule of the Q-loop before it
    (the loop's sm_90 SASS 0.81 similar to the LOCAL build's, against 0.99 as a call). Storing
    on its own GPU, the fenced build then ran 7.8-8.9% slower than LOCAL at d = 128 (M = 16K-64K),
    against -0.2 to +2.4% as a call; at d = 64, 0.2% inlined and 1.9% as a call (paired, one
    H200: data/records/fa_kernel_probe, record 20261201T054236Z-1c869b8634)."""
    gl.atomic_add(fence_flag, 0, sem="release", scope="sys")


@gluon.jit
def _consumer(half: gl.constexpr, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
              v_empty, dst, fence_flag, trace, tile, row0, head, M, rows_per_rank, rank, world,
              qk_scale, H_LOCAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, REMOTE: gl.constexpr, FENCED: gl.constexpr,
              INSTRUMENT: gl.constexpr):
    """Q-loop of rows [64·half, 64·half + 64) of the tile (Fig. 6), then their epilogue: the
    same online softmax as ``flash_attention._q_loop`` (scores scaled by log2(e)/sqrt(d), exp2,
    normalized after the loop) and the same stores as ``flash_attention._store_tile``.
    INSTRUMENT: trace row 2·tile + half stamped as ``flash_attention._output_tile`` stamps a
    tile's row, each stamp after a barrier of this warpgroup."""
    rec = trace + (2 * tile + half) * TRACE_FIELDS
    if INSTRUMENT:
        trace_stamp(rec, 0)
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_N, 16])
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, mma_o)
    acc = gl.zeros([HALF_ROWS, HEAD_DIM], gl.float32, layout=mma_o)
    zero = gl.zeros([HALF_ROWS, BLOCK_N], gl.float32, layout=mma_s)
    mbarrier.wait(q_bar, 0)
    q = q_smem.index(half)
    n_kv = M // BLOCK_N
    # KV tile 0: S_0 and its softmax, before the loop that pairs each S_j with PV_{j-1}
    mbarrier.wait(k_ready.index(0), 0)
    qk = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk, ))
    mbarrier.arrive(k_empty.index(0))
    m_i = gl.max(qk, 1) * qk_scale
    p = gl.exp2(qk * qk_scale - m_i[:, None])
    l_i = gl.sum(p, 1)
    p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    alpha = gl.full([HALF_ROWS], 1.0, gl.float32, layout=gl.SliceLayout(1, mma_s))
    for j in range(1, n_kv):
        # FlashAttention-3's intra-warpgroup overlap: S_j = Q K_j^T and O += P_{j-1} V_{j-1} are
        # issued back to back, so the PV is queued behind the QK^T, and the softmax of S_j starts
        # once S_j alone has retired (one group left in flight). In the sm_90 SASS only its row
        # maxima run under the PV: ptxas places the exponentials after the PV's wait. Against
        # the loop that waited each wgmma before the next, same outputs bitwise: 1.10-1.18x at
        # d = 128, 1.11x at d = 64 (data/records/fa_kernel_probe, one H200).
        s = j % STAGES
        s_prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(s), (j // STAGES) & 1)
        qk = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
        # O's rescale for tile j-1's maximum, before PV_{j-1} adds to it
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        mbarrier.wait(v_ready.index(s_prev), ((j - 1) // STAGES) & 1)
        acc = warpgroup_mma(p16, v_smem.index(s_prev), acc, is_async=True)
        qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk, ))
        mbarrier.arrive(k_empty.index(s))
        m_ij = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
        p = gl.exp2(qk * qk_scale - m_ij[:, None])
        alpha = gl.exp2(m_i - m_ij)
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_ij
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(s_prev))
        p16 = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    s_last = (n_kv - 1) % STAGES
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    mbarrier.wait(v_ready.index(s_last), ((n_kv - 1) // STAGES) & 1)
    acc = warpgroup_mma(p16, v_smem.index(s_last), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(v_empty.index(s_last))
    # 16-byte stores: 8 bf16 per thread along d
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    o = gl.convert_layout((acc / gl.convert_layout(l_i, o_rows)[:, None]).to(gl.bfloat16),
                          out_layout)
    if INSTRUMENT:
        trace_stamp(rec, 1)
    rows = (row0 + half * HALF_ROWS
            + gl.arange(0, HALF_ROWS, layout=gl.SliceLayout(1, out_layout))).to(gl.int64)
    d_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out_layout))
    if REMOTE:
        owner, dst_row = ulysses_destination(rows, rows_per_rank, rank, world, H_LOCAL)
        base = gl.multiple_of(gl.load(dst + owner).to(gl.pointer_type(gl.bfloat16)), 16)
        gl.store(base[:, None] + ((dst_row + head) * HEAD_DIM)[:, None] + d_cols[None, :], o)
        if FENCED:
            # as in flash_attention._store_tile: the warpgroup's stores, then a cumulative
            # release at system scope that returns once all of them are visible to every GPU
            gl.thread_barrier()
            _release_system(fence_flag)
    else:
        gl.store(dst + ((rows * H_LOCAL + head) * HEAD_DIM)[:, None] + d_cols[None, :], o)
    if INSTRUMENT:
        trace_stamp(rec, 2)
        trace_sm(rec)


@gluon.jit
def flash_attention_ws_kernel(q_desc, k_desc, v_desc, dst, fence_flag, trace, M, rows_per_rank,
                              rank, world, qk_scale, H_LOCAL: gl.constexpr,
                              HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                              REMOTE: gl.constexpr, FENCED: gl.constexpr, STAGES: gl.constexpr,
                              INSTRUMENT: gl.constexpr):
    """FlashAttention forward over the M/128 x H_LOCAL output tiles of one rank, one per CTA.

    ``q_desc`` is a TMA descriptor over [M, H_LOCAL*d] with [64, d] blocks (a consumer's half
    tile), ``k_desc``/``v_desc`` the same with [BLOCK_N, d] blocks; head h is column block h.
    ``dst``, ``fence_flag``, REMOTE and FENCED as in ``flash_attention.flash_attention_kernel``: the
    epilogue stores the same bf16 values whatever it is, so Fused equals Serial bitwise.
    INSTRUMENT: ``trace`` is int64 [2·tiles, TRACE_FIELDS], a row per consumer warpgroup's half
    tile (``_consumer``); a separate build, compared only with itself.
    """
    num_m_blocks = M // (2 * HALF_ROWS)
    tile = gl.program_id(0)
    head = tile // num_m_blocks
    row0 = (tile % num_m_blocks) * (2 * HALF_ROWS)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, HALF_ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        # one release per consumer warpgroup; K's stage is released when S_j retires, V's when
        # PV_j does, a tile later
        mbarrier.init(k_empty.index(s), count=2)
        mbarrier.init(v_empty.index(s), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (0, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, dst,
                     fence_flag, trace, tile, row0, head, M, rows_per_rank, rank, world,
                     qk_scale, H_LOCAL, HEAD_DIM, BLOCK_N, STAGES, REMOTE, FENCED, INSTRUMENT)),
        (_consumer, (1, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, dst,
                     fence_flag, trace, tile, row0, head, M, rows_per_rank, rank, world,
                     qk_scale, H_LOCAL, HEAD_DIM, BLOCK_N, STAGES, REMOTE, FENCED, INSTRUMENT)),
        (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready,
                     k_empty, v_empty, row0, head * HEAD_DIM, M, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
