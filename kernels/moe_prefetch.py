"""The expert weights a fused MoE call reads first, brought into L2 while its routing runs (issue 27).

Device code only; the host side is ``xstage_lab/ops/moe/prefetch.py``. At small T the routing's
launches (``moe_routing.py``) take 12-30 µs in which HBM is idle, and the fused kernel that follows
is bound by reading the touched experts' weights. Launched on a side stream beside the routing,
this kernel finds the experts the call touches from the router's output itself (read through the
argument block, ``moe_args.py``) and issues Hopper's bulk L2 prefetch of the Linear-1 weights of
the first of them, in expert order: both schedules deal Linear-1 tiles by row block, and row
blocks lie in expert order, so these are the bytes the fused kernel's first tiles load. The
prefetch completes in L2 on its own; nothing waits for it, and no result depends on it.
"""
import triton
import triton.language as tl

from .moe_args import ARG_EXPERT_IDS, arg_pointer
from .moe_routing import _num_arrivals


@triton.jit
def _prefetch_l2(address, nbytes):
    """``cp.async.bulk.prefetch.L2`` of ``nbytes`` from each ``address`` (both multiples of 16)."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n mov.u32 $0, 0;",
                              "=r,l,r", [address, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _touched_expert(touched, rank, k, E_PAD: tl.constexpr):
    """The ``k``-th (0-based) touched expert in id order, -1 past the last."""
    return tl.max(tl.where(touched & (rank == k + 1), tl.arange(0, E_PAD), -1), 0)


@triton.jit(do_not_specialize=["CAPACITY"])
def prefetch_weights(args, n_arrivals_ptr, w1, prefetched, CAPACITY, NUM_EXPERTS: tl.constexpr,
                     RECEIVED: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr,
                     EXPERT_BYTES: tl.constexpr, LANES: tl.constexpr, LANE_BYTES: tl.constexpr,
                     ID_DTYPE: tl.constexpr, ISSUE: tl.constexpr):
    """Program ``p``: bytes ``p P .. (p + 1) P`` (``P = LANES * LANE_BYTES``, at most
    ``EXPERT_BYTES``) of the touched experts' Linear-1 weights laid end to end in id order
    (``w1`` rows ``e 2I .. (e + 1) 2I``, ``EXPERT_BYTES`` apart), so the prefetch is spread over
    many SMs; ``prefetched[p]``: the expert its first byte lies in (-1: past the touched ones),
    and with ``ISSUE`` one bulk L2 prefetch of ``LANE_BYTES`` (a divisor of ``EXPERT_BYTES``) per
    lane. Arrivals as in ``moe_routing.route_histogram``: ``CAPACITY`` ids at EP = 1, an EP rank's
    count on the device; ids out of range are left out (the routing flags them)."""
    p = tl.program_id(0)
    n = _num_arrivals(n_arrivals_ptr, CAPACITY, RECEIVED)
    ids = arg_pointer(args, ARG_EXPERT_IDS, ID_DTYPE, False)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        e = tl.load(ids + i, mask=i < n, other=-1).to(tl.int32)
        valid = (e >= 0) & (e < NUM_EXPERTS)
        counts += tl.histogram(tl.where(valid, e, 0), E_PAD, mask=valid)
    touched = counts > 0
    rank = tl.cumsum(touched.to(tl.int32), 0)
    first = p.to(tl.int64) * (LANES * LANE_BYTES)
    k0 = first // EXPERT_BYTES  # a program's bytes lie in at most two experts
    e0 = _touched_expert(touched, rank, k0, E_PAD)
    tl.store(prefetched + p, e0)
    if ISSUE:
        if e0 >= 0:
            e1 = _touched_expert(touched, rank, k0 + 1, E_PAD)
            offset = first + tl.arange(0, LANES).to(tl.int64) * LANE_BYTES
            expert = tl.where(offset // EXPERT_BYTES == k0, e0, e1)
            live = expert >= 0
            # lanes past the last touched expert prefetch 16 bytes of its first one
            address = w1.to(tl.int64) + tl.where(
                live, expert.to(tl.int64) * EXPERT_BYTES + offset % EXPERT_BYTES,
                e0.to(tl.int64) * EXPERT_BYTES)
            _prefetch_l2(address, tl.where(live, LANE_BYTES, 16))
