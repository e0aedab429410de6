"""FlashAttention forward fused with the Ulysses post-attention All-to-All (paper §4.3, Figs. 5-7).

Device code only: loaded by path through ``xstage_lab.kernel_sources.load_kernel_module``; the
launchers, their contracts and launch configurations: ``xstage_lab/experiments/attention/ulysses.py``.

Ulysses layout (§4.3, Fig. 5), P ranks, H heads, head dim d, M tokens, H/P = H_LOCAL, M/P = rows per rank:
  input on rank r      q, k, v  [M, H_LOCAL, d] bf16: every token, heads [r*H_LOCAL, (r+1)*H_LOCAL)
  LOCAL epilogue       out      [M, H_LOCAL, d] bf16, the layout of q
  REMOTE epilogue      recv_j   [M/P, H, d] bf16 on rank j: token rows [j*M/P, (j+1)*M/P), all heads;
                       rank r writes recv_j[i, r*H_LOCAL + h, :] = O_r[j*M/P + i, h, :]
The receive layout is the sequence-parallel [tokens, heads, d] layout the output projection reads.
In both layouts one token's H_LOCAL heads from one rank are H_LOCAL*d contiguous elements.
"""
import triton
import triton.language as tl

# INSTRUMENT: per output tile, %globaltimer at tile entry, epilogue start (the Q-loop's output
# converted, before its first store) and epilogue end (every warp has issued its stores), then
# %smid; each stamp follows a CTA barrier.
TRACE_FIELDS = tl.constexpr(4)


@triton.jit
def trace_stamp(rec, point: tl.constexpr):
    """%globaltimer into ``rec[point]`` once every warp of the CTA (of the warp partition, in
    ``flash_attention_ws.py``) got here."""
    tl.debug_barrier()
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                    is_pure=False, pack=1)
    tl.store(rec + point, now)


@triton.jit
def trace_sm(rec):
    """The SM id into ``rec[3]``, the last of the TRACE_FIELDS."""
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                     is_pure=True, pack=1)
    tl.store(rec + 3, smid.to(tl.int64))


@triton.jit
def _q_loop(q, k_desc, v_desc, col, M, qk_scale,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One output tile: the Q-loop over all ceil(M/b_n) KV tiles (Fig. 6) with online softmax.

    Non-causal; scores are scaled by ``qk_scale`` = log2(e)/sqrt(d) so exp2 gives softmax, and
    normalized once after the loop. Returns the fp32 tile O = softmax(Q K^T / sqrt(d)) V.
    """
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 1.0, tl.float32)  # multiplied by alpha = 0 on the first KV tile
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in tl.range(0, M, BLOCK_N):
        k = k_desc.load([start_n, col]).T
        qk = tl.dot(q, k)
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        acc = acc * alpha[:, None]
        v = v_desc.load([start_n, col])
        acc = tl.dot(p.to(v.dtype), v, acc)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_ij
    return acc / l_i[:, None]


@triton.jit
def _q_loop_pipelined(q, k_desc, v_desc, col, M, qk_scale,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """``_q_loop`` with the PV product one KV tile behind QK^T (FlashAttention-3's intra-warpgroup
    overlap): each step issues S_j = Q K_j^T, then O += P_{j-1} V_{j-1}, and computes the softmax
    of S_j while that wgmma runs, rescaling O once it has landed. The same sums in another order:
    O holds sum_{i<j} P_i V_i at the running max m_j, and the last P V follows the loop."""
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk = tl.dot(q, k_desc.load([0, col]).T)
    m_i = tl.max(qk, 1) * qk_scale
    p = tl.math.exp2(qk * qk_scale - m_i[:, None])
    l_i = tl.sum(p, 1)
    for start_n in tl.range(BLOCK_N, M, BLOCK_N):
        qk = tl.dot(q, k_desc.load([start_n, col]).T)
        v = v_desc.load([start_n - BLOCK_N, col])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        m_i = m_ij
    v = v_desc.load([M - BLOCK_N, col])
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc / l_i[:, None]


@triton.jit
def ulysses_destination(rows, rows_per_rank, rank, world, H_LOCAL: tl.constexpr):
    """The REMOTE epilogue's addressing (Fig. 5), shared by every kernel that stores remotely
    (``flash_attention_ws.py`` too): for token rows ``rows`` (int64) of this rank's output, the
    rank that owns each, and the row of that rank's receive buffer [M/P, H, d] holding this rank's
    local head 0 (local head h is h rows further)."""
    owner = rows // rows_per_rank
    return owner, (rows - owner * rows_per_rank) * (H_LOCAL * world) + rank * H_LOCAL


@triton.jit
def _store_tile(o, dst, fence_flag, row0, head, rows_per_rank, rank, world,
                H_LOCAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                REMOTE: tl.constexpr, FENCED: tl.constexpr, OUTPUT_CACHE: tl.constexpr):
    """The epilogue of one output tile (rows row0.., head ``head``): LOCAL or REMOTE (see
    ``flash_attention_kernel``); FENCED makes the tile's remote stores visible system-wide first.
    OUTPUT_CACHE is the stores' cache operator: "" (write-back) or ".cs" (streaming: the lines
    are allocated evict-first, so output tiles do not push the K and V tiles out of L2)."""
    d_cols = tl.arange(0, HEAD_DIM)
    rows = row0 + tl.arange(0, BLOCK_M).to(tl.int64)
    if REMOTE:
        owner, dst_row = ulysses_destination(rows, rows_per_rank, rank, world, H_LOCAL)
        base = tl.multiple_of(tl.load(dst + owner).to(tl.pointer_type(o.dtype)), 16)
        tl.store(base[:, None] + ((dst_row + head) * HEAD_DIM)[:, None] + d_cols[None, :], o,
                 cache_modifier=OUTPUT_CACHE)
        if FENCED:
            # Every warp's stores precede the barrier; the release at system scope that follows
            # is cumulative, so it waits until all of them are visible to every GPU (measured on
            # H200 in session 1) before the program may start its next tile.
            tl.debug_barrier()
            tl.atomic_add(fence_flag, 0, sem="release", scope="sys")
    else:
        tl.store(dst + ((rows * H_LOCAL + head) * HEAD_DIM)[:, None] + d_cols[None, :], o,
                 cache_modifier=OUTPUT_CACHE)


@triton.jit
def flash_attention_kernel(q_desc, k_desc, v_desc, dst, fence_flag, trace, M, rows_per_rank, rank,
                           world, qk_scale, H_LOCAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, REMOTE: tl.constexpr,
                           FENCED: tl.constexpr, PERSISTENT: tl.constexpr,
                           OUTPUT_CACHE: tl.constexpr, PIPELINED: tl.constexpr,
                           INSTRUMENT: tl.constexpr):
    """FlashAttention forward over the M/b_m x H_LOCAL output tiles of one rank.

    ``q_desc``/``k_desc``/``v_desc`` are TMA descriptors over [M, H_LOCAL*d]; head h is the column
    block [h*d, (h+1)*d). Tile t is m block t % (M/b_m) of head t // (M/b_m): m blocks vary
    fastest so concurrent tiles share a head's K and V in L2. PERSISTENT: each program walks tiles
    pid, pid + num_programs, ...; otherwise one program per tile (grid = tiles).

    Epilogue (the ``REMOTE`` constexpr switch):
      LOCAL   ``dst`` is out [M, H_LOCAL, d]; the tile is stored there.
      REMOTE  ``dst`` is an int64 table of the P ranks' receive-buffer base addresses (symmetric
              memory); each row of the tile is stored straight into its owning rank's buffer
              (row // rows_per_rank) and the program goes on with its next tile: the tile drains
              through X-Stage during the next Q-loop (Fig. 7, eq. 18) with no communication warp,
              CTA or SM. Completion is not awaited here; the consumer synchronizes once per launch.
              FENCED (issue 8): after each tile's stores a release at system scope on
              ``fence_flag`` (an int32 on this GPU) waits for them to complete before the next
              tile: the completion-coupled epilogue of eq. 17.
    Every epilogue stores the same bf16 values, so Fused (fenced or not) equals Serial bitwise.
    INSTRUMENT: ``trace`` is int64 [tiles, TRACE_FIELDS], row ``tile`` stamped as TRACE_FIELDS
    says; the barriers before the stamps make this a separate build, compared only with itself.
    """
    num_m_blocks = M // BLOCK_M
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), num_m_blocks * H_LOCAL, tl.num_programs(0)):
            _output_tile(tile, num_m_blocks, q_desc, k_desc, v_desc, dst, fence_flag, trace, M,
                         rows_per_rank, rank, world, qk_scale, H_LOCAL, HEAD_DIM, BLOCK_M,
                         BLOCK_N, REMOTE, FENCED, OUTPUT_CACHE, PIPELINED, INSTRUMENT)
    else:
        _output_tile(tl.program_id(0), num_m_blocks, q_desc, k_desc, v_desc, dst, fence_flag,
                     trace, M, rows_per_rank, rank, world, qk_scale, H_LOCAL, HEAD_DIM, BLOCK_M,
                     BLOCK_N, REMOTE, FENCED, OUTPUT_CACHE, PIPELINED, INSTRUMENT)


@triton.jit
def _output_tile(tile, num_m_blocks, q_desc, k_desc, v_desc, dst, fence_flag, trace, M,
                 rows_per_rank, rank, world, qk_scale, H_LOCAL: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 REMOTE: tl.constexpr, FENCED: tl.constexpr, OUTPUT_CACHE: tl.constexpr,
                 PIPELINED: tl.constexpr, INSTRUMENT: tl.constexpr):
    """Output tile ``tile`` of ``flash_attention_kernel``: its Q-loop, then its epilogue."""
    rec = trace + tile * TRACE_FIELDS  # tiles < 2**29: int32 suffices
    if INSTRUMENT:
        trace_stamp(rec, 0)
    head = tile // num_m_blocks
    row0 = (tile % num_m_blocks) * BLOCK_M
    q = q_desc.load([row0, head * HEAD_DIM])
    if PIPELINED:
        o = _q_loop_pipelined(q, k_desc, v_desc, head * HEAD_DIM, M, qk_scale, BLOCK_M, BLOCK_N,
                              HEAD_DIM).to(q.dtype)
    else:
        o = _q_loop(q, k_desc, v_desc, head * HEAD_DIM, M, qk_scale, BLOCK_M, BLOCK_N,
                    HEAD_DIM).to(q.dtype)
    if INSTRUMENT:
        trace_stamp(rec, 1)
    _store_tile(o, dst, fence_flag, row0, head, rows_per_rank, rank, world, H_LOCAL, HEAD_DIM,
                BLOCK_M, REMOTE, FENCED, OUTPUT_CACHE)
    if INSTRUMENT:
        trace_stamp(rec, 2)
        trace_sm(rec)


@triton.jit
def remote_store_a2a_kernel(src, peer_ptrs, M, rows_per_rank, rank, world,
                            H_LOCAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_ROWS: tl.constexpr):
    """Post-attention All-to-All by remote stores, after any attention backend.

    ``src`` is this rank's attention output [M, H_LOCAL, d]; ``peer_ptrs`` the int64 table of the P
    ranks' receive buffers [M/P, H, d] (symmetric memory). Program i copies token rows
    [i*BLOCK_ROWS, (i+1)*BLOCK_ROWS), one head at a time, into their owning ranks' buffers at the
    addresses of the REMOTE epilogue of ``flash_attention_kernel``. No completion wait here.
    """
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
    in_range = rows < M
    owner, dst_row = ulysses_destination(rows, rows_per_rank, rank, world, H_LOCAL)
    base = tl.multiple_of(tl.load(peer_ptrs + owner, mask=in_range, other=0)
                          .to(tl.pointer_type(src.dtype.element_ty)), 16)
    d_cols = tl.arange(0, HEAD_DIM)
    for head in tl.static_range(H_LOCAL):
        x = tl.load(src + ((rows * H_LOCAL + head) * HEAD_DIM)[:, None] + d_cols[None, :],
                    mask=in_range[:, None])
        tl.store(base[:, None] + ((dst_row + head) * HEAD_DIM)[:, None] + d_cols[None, :], x,
                 mask=in_range[:, None])
