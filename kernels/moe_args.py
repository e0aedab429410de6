"""The argument block of one fused MoE call (issue 27): the addresses of the tensors that change
between calls of the same shape, which the routing kernels and the weighted sum read from device
memory instead of taking them as launch arguments. A CUDA graph captured once per token count
then replays a call on new tensors: the block is rewritten in stream order, before any kernel
reads it, by the call's first launch, which takes the addresses as its parameters right after the
block (by value, never specialized: a graph's node of that launch is given each call's): the
first routing launch of the fused MoE (``moe_routing``), or ``write_args`` where nothing routes
(the weighted sum alone).

Device code only; the host side is ``xstage_lab/ops/moe/call_args.py``. The block is int64
``[ARGS]``, one address per slot; a reader casts its slot to the pointer type it needs
(``arg_pointer``). ``x``, ``combine_rows`` and ``out`` are 16-byte aligned (the host checks it),
so their loads and stores stay vectorized.
"""
import triton
import triton.language as tl

ARG_EXPERT_IDS = tl.constexpr(0)  # the arrivals' local expert ids (topk_ids at EP = 1)
ARG_X = tl.constexpr(1)           # the activations: the tokens at EP = 1, the received rows
ARG_X_SCALE = tl.constexpr(2)     # their 1 x 128 scales (received e4m3 rows)
ARG_COMBINE_ROWS = tl.constexpr(3)  # the Combine rows the weighted sum reads
ARG_TOPK_WEIGHTS = tl.constexpr(4)
ARG_OUT = tl.constexpr(5)         # the weighted sum's output, the layer's y
# The rows the fused kernel's Linear-1 reads, their scales and where each layout row's scales lie
# (its ``a_rows``, three slots: 1 by the layout row, 0 by the row it reads): the activations' own,
# or their quantized copy. Written by the routing (``moe_routing``), not here.
ARG_A_ROWS = tl.constexpr(6)
A_ROWS_SLOTS = tl.constexpr(3)
ARGS = tl.constexpr(ARG_A_ROWS.value + A_ROWS_SLOTS.value)


@triton.jit(do_not_specialize=["expert_ids", "x", "x_scale", "combine_rows", "topk_weights",
                               "out"])
def write_args(args, expert_ids, x, x_scale, combine_rows, topk_weights, out):
    """One program: each address (int64, by value) into its slot of ``args``."""
    store_slots(args, expert_ids, x, x_scale, combine_rows, topk_weights, out)


@triton.jit
def store_slots(args, expert_ids, x, x_scale, combine_rows, topk_weights, out):
    """Each address (int64, by value) into its slot of ``args``."""
    tl.store(args + ARG_EXPERT_IDS, expert_ids)
    tl.store(args + ARG_X, x)
    tl.store(args + ARG_X_SCALE, x_scale)
    tl.store(args + ARG_COMBINE_ROWS, combine_rows)
    tl.store(args + ARG_TOPK_WEIGHTS, topk_weights)
    tl.store(args + ARG_OUT, out)


@triton.jit
def arg_pointer(args, slot: tl.constexpr, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    """The address in ``slot`` of ``args`` as a pointer to ``dtype`` (16-byte aligned where
    ``ALIGNED``: the host checked it)."""
    p = tl.load(args + slot).to(tl.pointer_type(dtype))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p
