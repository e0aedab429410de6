"""Launches that precede the fused MoE kernel in the call probe (issue 27): what else a kernel can
leave on the SMs for the next one, with nothing of the MoE call in it.

Device code only; the host side (grids, the check of ``straight_line``'s words against the same
steps on the host) is ``xstage_lab/experiments/probes/moe_call.py``.

``one_store``: a program's one 4-byte store: a launch whose code is a few instructions.
``straight_line``: ``STEPS`` unrolled steps of an xorshift-multiply on one word per thread, so
that each program runs about ``3 STEPS`` instructions of straight-line code (about 48 bytes a step
of SASS), never a loop: the instruction caches of each SM it runs on fill with its code, as they
would with a larger kernel's. The multiplier is a launch argument, so that the compiler cannot
fold the steps into fewer.
"""
import triton
import triton.language as tl


@triton.jit
def one_store(out):
    """Program ``p`` writes ``p`` into ``out[p]``."""
    p = tl.program_id(0)
    tl.store(out + p, p)


@triton.jit
def straight_line(out, mul, STEPS: tl.constexpr, WIDTH: tl.constexpr):
    """Program ``p``'s ``WIDTH`` words start at ``p WIDTH + i`` (uint32), each step ``x ^= x >>
    13; x *= mul`` (mod 2^32); the words into ``out[p WIDTH ..]``."""
    p = tl.program_id(0)
    i = p * WIDTH + tl.arange(0, WIDTH)
    x = i.to(tl.uint32)
    m = mul.to(tl.uint32)
    for _ in tl.static_range(STEPS):
        x = (x ^ (x >> 13)) * m
    tl.store(out + i, x)
