"""Ulysses attention kernels (issue 3) in Triton's CPU interpreter; run by
``test_attention.py::test_kernels_in_the_interpreter`` in a process started with TRITON_INTERPRET=1.

``@triton.jit`` (Triton's own ``tl.zeros``, ``tl.sum``... included) reads TRITON_INTERPRET when
triton is imported, so the interpreter cannot be switched on inside a process that imported triton
without it: hence a process of its own, and a file pytest does not collect on its own. Peer
"buffers" are P separate CPU tensors whose ``data_ptr()``s form the pointer table, so one process
plays every rank.
"""
import os

import pytest
import torch

from tests.experiments.triton_testing import interpreter_fixes
from xstage_lab.ops import attention as att
from xstage_lab.checks import bitwise_equal, relative_error

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 from process start", allow_module_level=True)

BF16 = torch.bfloat16
REL_TOL = 1e-2
TINY = dict(kernel="triton", BLOCK_M=16, BLOCK_N=16)


@pytest.fixture(autouse=True, scope="module")
def _interpreter_fixes():
    with interpreter_fixes():
        yield


def _qkv(M, h_local, d, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(M, h_local, d, generator=g) for _ in range(3))
    return (q * scale).to(BF16), k.to(BF16), v.to(BF16)


def _peer_buffers(world, M, heads, d):
    """The P ranks' receive buffers [M/P, H, d], poisoned, and their pointer table."""
    bufs = [torch.full((M // world, heads, d), float("nan"), dtype=BF16) for _ in range(world)]
    return bufs, torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)


# FA-only (LOCAL epilogue) against the float32 reference; scale sharpens the softmax so the
# running maximum matters. Fewer programs than tiles exercises the persistent loop.
@pytest.mark.parametrize("M,h_local,d,scale,num_programs", [
    (64, 2, 64, 1.0, 3),
    (128, 1, 64, 4.0, 5),
    (32, 2, 128, 2.0, 2),
])
def test_flash_attention_matches_float32_reference(M, h_local, d, scale, num_programs):
    q, k, v = _qkv(M, h_local, d, seed=M + d, scale=scale)
    out = torch.full_like(q, float("nan"))
    att.flash_attention(q, k, v, out=out, config=TINY, num_programs=num_programs)
    assert relative_error(out, att.reference_attention(q, k, v)) < REL_TOL


# Tile-to-rank addressing of the REMOTE epilogue: every rank's output lands where the reference
# layout says, bitwise equal to the LOCAL output permuted. (2, 96, 32): rows_per_rank = 48, so the
# tile of rows 32..63 straddles ranks 0 and 1; (8, 96, 16): rows_per_rank = 12, every other tile
# straddles two of the 8 ranks, with the 3 local heads of H = 24 on P = 8.
@pytest.mark.parametrize("world,M,block,h_local", [(2, 96, 32, 2), (4, 64, 16, 2), (8, 128, 16, 2),
                                                   (8, 96, 16, 3)])
def test_fused_epilogue_delivers_the_ulysses_layout(world, M, block, h_local):
    d = 64
    cfg = dict(kernel="triton", BLOCK_M=block, BLOCK_N=block)
    inputs = [_qkv(M, h_local, d, seed=10 * world + r) for r in range(world)]
    local = [att.flash_attention(*qkv, config=cfg, num_programs=3) for qkv in inputs]
    bufs, table = _peer_buffers(world, M, h_local * world, d)
    for rank, qkv in enumerate(inputs):
        att.fused_attention_a2a(*qkv, table, rank, world, config=cfg, num_programs=3)
    expected = att.ulysses_gather(local)
    reference = att.reference_ulysses(*zip(*inputs))
    for j in range(world):
        assert bitwise_equal(bufs[j], expected[j]), f"rank {j} received other bits than Serial"
        assert relative_error(bufs[j], reference[j]) < REL_TOL


# The copy kernel after any backend: blocks of 16 rows straddle ranks (rows_per_rank 20, 12, 8
# for P = 2, 4, 8) and the last block is partial.
@pytest.mark.parametrize("world,M,d", [(2, 40, 64), (4, 48, 128), (8, 64, 64)])
def test_remote_store_a2a_delivers_the_ulysses_layout(world, M, d):
    h_local = 3
    g = torch.Generator().manual_seed(world)
    local = [torch.randn(M, h_local, d, generator=g).to(BF16) for _ in range(world)]
    bufs, table = _peer_buffers(world, M, h_local * world, d)
    for rank in range(world):
        att.remote_store_a2a(local[rank], table, rank, world, block_rows=16)
    for j, want in enumerate(att.ulysses_gather(local)):
        assert bitwise_equal(bufs[j], want), f"rank {j} received other bits than the layout says"


# One program per tile (the non-persistent grid) and 2:1 tiles (as the d = 128 table's 256 x 64)
# against the float32 reference.
@pytest.mark.parametrize("M,h_local,d,block_m,block_n", [(64, 2, 64, 32, 16), (64, 1, 128, 16, 32)])
def test_one_program_per_tile_matches_float32_reference(M, h_local, d, block_m, block_n):
    q, k, v = _qkv(M, h_local, d, seed=M + block_m, scale=3.0)
    out = torch.full_like(q, float("nan"))
    att.flash_attention(q, k, v, out=out,
                        config=dict(kernel="triton", BLOCK_M=block_m, BLOCK_N=block_n,
                                    persistent=False))
    assert relative_error(out, att.reference_attention(q, k, v)) < REL_TOL


# Issue 8: the fenced epilogue stores the same bits where the unfenced one does, for P = 2, 4, 8
# (tiles straddle ranks at P = 2), persistent and one program per tile.
@pytest.mark.parametrize("world,M,block,persistent", [(2, 96, 32, True), (4, 64, 16, False),
                                                      (8, 128, 16, True)])
def test_fenced_epilogue_equals_unfenced_bitwise(world, M, block, persistent):
    h_local, d = 2, 64
    cfg = dict(kernel="triton", BLOCK_M=block, BLOCK_N=block, persistent=persistent)
    programs = 3 if persistent else None
    inputs = [_qkv(M, h_local, d, seed=20 * world + r) for r in range(world)]
    plain, plain_table = _peer_buffers(world, M, h_local * world, d)
    fenced, fenced_table = _peer_buffers(world, M, h_local * world, d)
    for rank, qkv in enumerate(inputs):
        att.fused_attention_a2a(*qkv, plain_table, rank, world, config=cfg, num_programs=programs)
        att.fused_attention_a2a(*qkv, fenced_table, rank, world, config=cfg,
                                num_programs=programs, fenced=True)
    for j in range(world):
        assert not torch.isnan(fenced[j].float()).any(), f"rank {j}: fenced left elements unwritten"
        assert bitwise_equal(fenced[j], plain[j]), f"rank {j}: fenced stored other bits"


# The pipelined Q-loop (PV one KV tile behind QK^T) against the float32 reference, sharp softmax
# so the running maximum moves between KV tiles; M = b_n is one KV tile (the loop body never
# runs, the PV after it does all the work).
@pytest.mark.parametrize("M,block_n,scale,persistent", [(16, 16, 3.0, False), (64, 16, 4.0, True),
                                                        (96, 32, 2.0, False)])
def test_pipelined_q_loop_matches_float32_reference(M, block_n, scale, persistent):
    q, k, v = _qkv(M, 2, 64, seed=M + block_n, scale=scale)
    out = torch.full_like(q, float("nan"))
    cfg = dict(kernel="triton", BLOCK_M=16, BLOCK_N=block_n, persistent=persistent, pipelined=True)
    att.flash_attention(q, k, v, out=out, config=cfg, num_programs=3 if persistent else None)
    assert relative_error(out, att.reference_attention(q, k, v)) < REL_TOL
