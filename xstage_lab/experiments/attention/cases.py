"""The attention shapes and their checks, shared by ``bench``'s two experiments (``fa_a2a``,
``fa_tuning``), ``trace_bench`` and the probes: the shape and timing options, the ``Sweep`` over M
(``shape_sweep``), fresh random inputs, local destination buffers, and the correctness checks
(step 1 of ``bench``) against the float32 reference and Serial."""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...checks import bitwise_equal, poisoned, relative_error
from ...cli import list_option
from ...sweep import Axis, Sweep
from ...ops import attention as att

DEFAULT_SEQ = (8192, 16384, 32768, 49152, 65536)
REL_TOL = 1e-2        # relative Frobenius error allowed against the float32 reference (bf16 output)
DEVICE = "cuda"       # the current CUDA device of this rank


def attention_flops(seq_len: int, heads: int, head_dim: int, world: int) -> int:
    """Per-rank FLOPs of non-causal attention forward: QK^T and PV over H/P heads, 4 M^2 d H/P."""
    return 4 * seq_len * seq_len * head_dim * heads // world


def add_shape_arguments(p: argparse.ArgumentParser, seq=DEFAULT_SEQ, heads: int = 24,
                        heads_help: str = "total heads H (divisible by P)") -> None:
    """The attention shape's options (the sweep's M, heads and head dim)."""
    p.add_argument("--seq", **list_option(int, default=list(seq), help="sequence lengths M"))
    p.add_argument("--heads", type=int, default=heads, help=heads_help)
    p.add_argument("--head-dim", type=int, default=128, choices=att.HEAD_DIMS)


def check_shape_args(a: argparse.Namespace) -> None:
    """``--seq`` positive lengths, each a multiple of every candidate configuration's tiles, and
    ``--heads`` >= 1; ``ValueError`` names the first mistake. Whether P divides them is the ranks'
    ``validate``."""
    if not a.seq or min(a.seq) <= 0:
        raise ValueError(f"--seq must list positive lengths, got {a.seq}")
    if a.heads < 1:
        raise ValueError(f"--heads must be >= 1, got {a.heads}")
    # Tiles are powers of two: a multiple of the largest suits every candidate configuration.
    tile = max(max(c["BLOCK_M"], c["BLOCK_N"]) for c in att.flash_attention_candidates(a.head_dim))
    for m in a.seq:
        if m % tile:
            raise ValueError(f"sequence length M={m} must be a multiple of the {tile}-row tiles")


def add_timing_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--iters", type=int, default=10, help="back-to-back calls per CUDA graph")
    p.add_argument("--seed", type=int, default=0)


def check_timing_args(a: argparse.Namespace) -> None:
    if a.trials < 1 or a.iters < 1:
        raise ValueError("--trials and --iters must be >= 1")


def shape_sweep(args, name: str) -> Sweep:
    """The attention shapes as a declared sweep: sequence length M over ``--seq``, at the fixed
    heads H and head dim d (one configuration, tuned for them, serves every point); one pass
    (each point's repeats are its timing trials)."""
    return Sweep(name, (Axis("M", args.seq),), fixed=dict(heads=args.heads, head_dim=args.head_dim),
                 repeats=1, warmup=0)


def random_qkv(seq_len: int, h_local: int, head_dim: int, seed: int):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(seq_len, h_local, head_dim, generator=g, device=DEVICE,
                        dtype=torch.float32).to(att.DTYPE) for _ in range(3)]


@dataclass
class Case:
    """One attention shape on this rank: its fresh q, k, v [M, H/P, d]; after ``check_case``,
    FA-only's output, the local destination buffers and their table of the same-code FA-only
    control, and every rank's check metrics."""

    point: dict
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out_fa: torch.Tensor | None = None
    local: tuple = ()
    checks: list = field(default_factory=list)


def check_case(case: Case, cfg, buf, group) -> tuple[dict, list[str]]:
    """Correctness of every path at one M (step 1), every output poisoned first; sets
    ``case.out_fa`` and ``case.local``. Returns this rank's metrics and failures (the caller
    stops every rank on any rank's)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = case.q, case.k, case.v
    seq_len, heads, head_dim = case.point["M"], case.point["heads"], case.point["head_dim"]
    out_fa = att.flash_attention(q, k, v, out=poisoned(q.shape, att.DTYPE, DEVICE), config=cfg)
    ref = att.reference_attention(q, k, v)
    ref_recv = att.nccl_a2a(ref, group)  # float32: what this rank must receive (§4.3 layout)
    recv_shape = (seq_len // world, heads, head_dim)
    serial = att.nccl_a2a(out_fa, group, out=poisoned(recv_shape, att.DTYPE, DEVICE))

    recv = buf.view(seq_len, heads, head_dim)
    recv.fill_(float("nan"))
    buf.barrier()  # every rank poisoned its buffer before any peer stores into it
    att.fused_attention_a2a(q, k, v, buf.peer_ptrs, rank, world, config=cfg)
    buf.barrier()
    fused_equal, fused_err = bitwise_equal(recv, serial), relative_error(recv, ref_recv)

    recv.fill_(float("nan"))
    buf.barrier()
    att.fused_attention_a2a(q, k, v, buf.peer_ptrs, rank, world, config=cfg, fenced=True)
    buf.barrier()
    fenced_equal = bitwise_equal(recv, serial)

    recv.fill_(float("nan"))
    buf.barrier()
    att.remote_store_a2a(out_fa, buf.peer_ptrs, rank, world)
    buf.barrier()
    a2a_equal = bitwise_equal(recv, serial)

    # FA-only through the fused kernel's own code, unfenced and fenced: its epilogue stores every
    # tile, as Fused does, but through a table of P buffers on this GPU (the local control of
    # §3.1); the fenced one separates the fence's effect on the compiled Q-loop from its effect on
    # the remote stores.
    local = local_destination(seq_len, heads, head_dim, world)
    local_recv, local_table = local
    h = heads // world
    same_code_equal = {}
    for fenced in (False, True):
        local_recv.fill_(float("nan"))
        att.fused_attention_a2a(q, k, v, local_table, rank, world, config=cfg, fenced=fenced)
        same_code_equal[fenced] = bitwise_equal(
            local_recv[:, :, rank * h:(rank + 1) * h].reshape(out_fa.shape), out_fa)

    sdpa = att.sdpa_nccl(q, k, v, group, out=poisoned(recv_shape, att.DTYPE, DEVICE))
    metrics = dict(fa_rel_err=relative_error(out_fa, ref),
                   serial_rel_err=relative_error(serial, ref_recv),
                   fused_rel_err=fused_err, sdpa_nccl_rel_err=relative_error(sdpa, ref_recv),
                   fused_bitwise_serial=fused_equal, fused_fenced_bitwise_serial=fenced_equal,
                   a2a_remote_bitwise_nccl=a2a_equal,
                   fa_same_code_bitwise_fa=same_code_equal[False],
                   fa_same_code_fenced_bitwise_fa=same_code_equal[True])
    failures = [f"{name}={value:.3g} (tolerance {REL_TOL})" for name, value in metrics.items()
                if name.endswith("_rel_err") and not value < REL_TOL]
    failures += [f"{name} is False" for name, value in metrics.items() if value is False]
    case.out_fa, case.local = out_fa, local
    return metrics, failures


def local_destination(seq_len, heads, head_dim, world):
    """P receive buffers [M/P, H, d] on this GPU and the pointer table that names them (keep the
    buffers referenced as long as the table is used)."""
    recv = torch.empty((world, seq_len // world, heads, head_dim), dtype=att.DTYPE, device=DEVICE)
    table = torch.tensor([recv[j].data_ptr() for j in range(world)], dtype=torch.int64,
                         device=DEVICE)
    return recv, table


def remote_epilogue_checks(q, k, v, out_fa, cfg, world: int = 2) -> dict:
    """The REMOTE epilogue of ``cfg``, unfenced and fenced, into P = ``world`` receive buffers on
    this GPU (rank 0's tiles; the addressing of a P-rank run): each bitwise equal to the LOCAL
    output ``out_fa`` where it lands, so Fused and Serial share this configuration's code."""
    M, h, d = q.shape
    out = {}
    for fenced in (False, True):
        print(f"[attention.bench --fa-only] remote epilogue, fenced={fenced}", file=sys.stderr,
              flush=True)
        recv, table = local_destination(M, h * world, d, world)
        recv.fill_(float("nan"))
        att.fused_attention_a2a(q, k, v, table, 0, world, config=cfg, fenced=fenced)
        # buffer j holds rows [j*M/P, (j+1)*M/P); rank 0's heads are its first h
        got = recv[:, :, :h].reshape(M, h, d)
        out[f"remote{'_fenced' if fenced else ''}_bitwise_fa"] = bitwise_equal(got, out_fa)
    return out


