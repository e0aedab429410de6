"""Combine (paper §2.2): the Combine buffers the fused kernel's Linear-2 epilogues store into
(one per source rank, reached through a peer pointer table) and the end of Combine on the source
rank, the top-k weighted sum of its ``[T * top_k, hidden]`` rows."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import triton

from ...kernel_sources import load_kernel_module
from ...platform import ALIGN_BYTES, check_mapped_host, symmetric_buffer
from ..launcher import Launcher
from .call_args import allocate_args, triton_dtype, write_args
from .shapes import MoEContractError


WEIGHTED_SUM_BLOCK_H = 1024  # columns per program of kernels/moe_combine.py: 16-byte accesses
_WEIGHTED_SUM: dict[tuple, Launcher] = {}  # (top_k, weights' dtype) -> its launcher


def combine_weighted_sum(combine_rows: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The end of Combine on the source rank: ``out[t] = sum_j w[t, j] * rows[t * k + j]`` in
    fp32, one bf16 rounding (``kernels/moe_combine.py``, its tensors' addresses written into an
    argument block of its own first: two launches; on CPU tensors outside the interpreter
    ``weighted_sum_reference``). ``combine_rows`` bf16 ``[>= T k, H]``, 16-byte aligned,
    ``topk_weights`` float ``[T, k]``, both on one device. Returns bf16 ``[T, H]``."""
    t, k = topk_weights.shape
    if combine_rows.dtype != torch.bfloat16 or combine_rows.dim() != 2 or \
            combine_rows.shape[0] < t * k:
        raise MoEContractError(f"Combine rows must be bf16 [>= {t * k}, H], got "
                               f"{combine_rows.dtype} {list(combine_rows.shape)}")
    if not topk_weights.is_floating_point() or combine_rows.device != topk_weights.device:
        raise MoEContractError("topk_weights must be floating point, on the rows' device")
    launch = weighted_sum_launch(k, topk_weights.dtype)
    if combine_rows.device.type != "cuda" and not launch.interpreted:
        return weighted_sum_reference(combine_rows, topk_weights)
    hidden = combine_rows.shape[1]
    out = torch.empty(t, hidden, dtype=torch.bfloat16, device=combine_rows.device)
    if t:
        # an argument block per call: a call on another stream never sees this one's addresses
        args = allocate_args(out.device)
        # held until the launches are queued: the kernel reads them through their addresses
        rows, weights = combine_rows.contiguous(), topk_weights.contiguous()
        write_args(args, combine_rows=rows, topk_weights=weights, out=out)
        launch(weighted_sum_grid(t, hidden), args=args, HIDDEN=hidden)
    return out


def weighted_sum_launch(top_k: int, weights_dtype: torch.dtype) -> Launcher:
    """The weighted sum's launch for ``top_k`` picks weighted in ``weights_dtype`` (bound once):
    ``launch(weighted_sum_grid(T, H), args=args, HIDDEN=H)`` over the Combine rows, top-k
    weights and output whose addresses ``args`` holds (``call_args.write_args``)."""
    key = (top_k, weights_dtype)
    launch = _WEIGHTED_SUM.get(key)
    if launch is None:
        launch = _WEIGHTED_SUM[key] = Launcher(
            load_kernel_module("moe_combine").weighted_sum, TOP_K=top_k,
            BLOCK_H=WEIGHTED_SUM_BLOCK_H, WEIGHT_DTYPE=triton_dtype(weights_dtype))
    return launch


def weighted_sum_grid(tokens: int, hidden: int) -> tuple[int, int]:
    """One program per token and slab of ``WEIGHTED_SUM_BLOCK_H`` columns."""
    return tokens, triton.cdiv(hidden, WEIGHTED_SUM_BLOCK_H)


def weighted_sum_reference(combine_rows: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The reference of ``combine_weighted_sum``: the same sum by torch ops in fp32."""
    t, k = topk_weights.shape
    rows = combine_rows[: t * k].view(t, k, -1).float()
    return (rows * topk_weights[..., None].float()).sum(dim=1).to(torch.bfloat16)


@dataclass(frozen=True)
class CombinePeers:
    """The pointer table of the contract: base address of every rank's bf16 ``[slots, hidden]``
    Combine buffer, as this rank may store to it, plus the int64 device copy the kernel reads."""

    ptrs: tuple[int, ...]
    table: torch.Tensor
    slots: int
    hidden: int
    # the buffers behind ``ptrs`` where this process allocated them: a launch prepared with these
    # peers keeps them alive (the table holds bare addresses)
    owners: tuple = field(default=(), repr=False, compare=False)

    def __post_init__(self):
        if len(self.ptrs) < 1 or any(p == 0 for p in self.ptrs):
            raise MoEContractError(f"every peer needs a mapped Combine buffer, got {self.ptrs}")
        if any(p % ALIGN_BYTES for p in self.ptrs):
            raise MoEContractError(f"Combine buffers must be {ALIGN_BYTES}-byte aligned "
                                   f"({ALIGN_BYTES}-byte remote stores)")
        if self.table.dtype != torch.int64 or tuple(self.table.shape) != (len(self.ptrs),):
            raise MoEContractError("the peer table must be int64 [P]")

    @property
    def world(self) -> int:
        return len(self.ptrs)


def local_combine_peers(buffers: Sequence[torch.Tensor]) -> CombinePeers:
    """Peers that are ordinary tensors of this process (one per simulated rank; CPU tests)."""
    b0 = buffers[0]
    for b in buffers:
        if b.dtype != torch.bfloat16 or b.dim() != 2 or b.shape != b0.shape or not b.is_contiguous():
            raise MoEContractError("Combine buffers must be contiguous bf16 [slots, hidden], all alike")
    ptrs = tuple(b.data_ptr() for b in buffers)
    return CombinePeers(ptrs, torch.tensor(ptrs, dtype=torch.int64, device=b0.device), b0.shape[0],
                        b0.shape[1], tuple(buffers))


def local_store_control(peers: CombinePeers, local: torch.Tensor) -> CombinePeers:
    """The local-store control of §5.2.3: a peer table of the same layout whose entry for source
    rank r points at ``local[r]``, a ``[P, slots, hidden]`` bf16 buffer on the issuing GPU. The
    kernel runs unchanged; its Combine stores go to local HBM instead of over NVLink (one region
    per source, so no two rows collide)."""
    if local.dtype != torch.bfloat16 or not local.is_contiguous() or \
            tuple(local.shape) != (peers.world, peers.slots, peers.hidden):
        raise MoEContractError(f"local control buffer must be contiguous bf16 "
                               f"[{peers.world}, {peers.slots}, {peers.hidden}]")
    if local.device != peers.table.device:
        raise MoEContractError(f"local control buffer on {local.device}, peer table on "
                               f"{peers.table.device}")
    return local_combine_peers(list(local.unbind(0)))


def host_combine_peers(local: torch.Tensor, host: Sequence[torch.Tensor]) -> CombinePeers:
    """The host link's Combine (issue 26): a peer table of ``local``'s layout (``[P, slots,
    hidden]`` bf16 on the issuing GPU) whose entries for source ranks 0 .. h − 1 point at the h
    buffers ``host`` instead, pinned host memory that the kernel stores into over PCIe (checked
    mapped: under unified addressing a pinned buffer's host address is its device address). On a
    CPU device (tests) the host buffers are ordinary tensors."""
    if len(host) > local.shape[0]:
        raise MoEContractError(f"{len(host)} host buffers for {local.shape[0]} source ranks")
    for b in host:
        if b.dtype != torch.bfloat16 or tuple(b.shape) != tuple(local.shape[1:]) or \
                not b.is_contiguous() or b.device.type != "cpu":
            raise MoEContractError(f"host Combine buffers must be contiguous bf16 CPU tensors "
                                   f"{list(local.shape[1:])}")
        if local.device.type == "cuda":
            if not b.is_pinned():
                raise MoEContractError("host Combine buffers must be pinned memory")
            check_mapped_host(b.data_ptr())
    buffers = (*host, *list(local.unbind(0))[len(host):])
    ptrs = tuple(b.data_ptr() for b in buffers)
    return CombinePeers(ptrs, torch.tensor(ptrs, dtype=torch.int64, device=local.device),
                        local.shape[1], local.shape[2], buffers)


class SymmetricCombine:
    """One symmetric-memory Combine buffer per rank holding ``capacity`` bf16 elements, viewed per
    call as ``[slots, hidden]`` (``platform.symmetric_buffer``: torch ``_symmetric_memory``; stores
    go through the peers' base addresses; NVLink multicast is never used). Collective over
    ``group``."""

    def __init__(self, capacity: int, *, group=None):
        self.symmetric = symmetric_buffer(capacity, torch.bfloat16, group)

    def rows(self, slots: int, hidden: int) -> torch.Tensor:
        """This rank's own buffer as ``[slots, hidden]``."""
        buffer = self.symmetric.tensor
        if slots * hidden > buffer.numel():
            raise MoEContractError(f"[{slots}, {hidden}] exceeds the {buffer.numel()} elements "
                                   "allocated")
        return buffer[: slots * hidden].view(slots, hidden)

    def peers(self, slots: int, hidden: int) -> CombinePeers:
        self.rows(slots, hidden)
        return CombinePeers(self.symmetric.ptrs, self.symmetric.table, slots, hidden)

    def barrier(self) -> None:
        """Stream-ordered barrier over the group (``SymmetricBuffer.barrier``): earlier stores
        (this rank's remote ones included) are visible to every peer's later work."""
        self.symmetric.barrier()
