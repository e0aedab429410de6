"""The end of Combine on the source rank (paper §2.2): the top-k weighted sum of each token's
Combine rows, ``out[t] = sum_j w[t, j] * rows[t * TOP_K + j]``, in fp32 and rounded once to bf16.

Device code only; the host side is ``xstage_lab/ops/moe/combine.py`` (``combine_weighted_sum``),
its reference the float32 sum beside it (``weighted_sum_reference``).

Memory-bound: each row is read once and the output written once, so one program per token and
slab of ``BLOCK_H`` columns, vectorized along the row; the weights are float scalars. The three
tensors' addresses come from the call's argument block (``moe_args.py``), so that a captured
graph replays the sum on new weights into a new output.
"""
import triton
import triton.language as tl

from .moe_args import ARG_COMBINE_ROWS, ARG_OUT, ARG_TOPK_WEIGHTS, arg_pointer


@triton.jit
def weighted_sum(args, HIDDEN, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                 WEIGHT_DTYPE: tl.constexpr):
    """Program ``(t, h)``: columns ``h BLOCK_H ..`` of token ``t``; ``args``' Combine rows bf16
    ``[T TOP_K, HIDDEN]``, top-k weights ``WEIGHT_DTYPE`` ``[T, TOP_K]`` and output bf16 ``[T,
    HIDDEN]``, all contiguous. The picks are added in order ``j = 0 .. TOP_K - 1``."""
    rows = arg_pointer(args, ARG_COMBINE_ROWS, tl.bfloat16, True)
    weights = arg_pointer(args, ARG_TOPK_WEIGHTS, WEIGHT_DTYPE, False)
    out = arg_pointer(args, ARG_OUT, tl.bfloat16, True)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    live = cols < HIDDEN
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(weights + t * TOP_K + j).to(tl.float32)
        v = tl.load(rows + (t * TOP_K + j) * HIDDEN + cols, mask=live, other=0.0)
        acc += w * v.to(tl.float32)
    tl.store(out + t * HIDDEN + cols, acc.to(tl.bfloat16), mask=live)
