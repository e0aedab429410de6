"""Dispatch on the host, the path of the benchmarks under torchrun (paper §2.2): each rank sends
every (token, k) slot to the rank owning the expert over NCCL ``all_to_all_single``; the receiver
lays rows out expert by expert, each expert padded to ``block_m`` rows, and keeps for every row
its source rank and slot (``t * top_k + j``). FP8 activations are quantized on the source, so
Dispatch moves e4m3 rows plus 1 x 128 scales. This layout is the reference that
``device_tables`` builds on the GPU without a host sync."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .shapes import MoEContractError, check_expert_parallel


@dataclass(frozen=True)
class SendPlan:
    """Source side of Dispatch: slots ``t * top_k + j`` sorted by destination expert."""

    order: torch.Tensor          # int64 [T * k]: the slot sent in each send position
    experts: torch.Tensor        # int64 [T * k]: global expert of each send position
    counts: tuple[int, ...]      # rows sent to each rank
    top_k: int


def plan_send(topk_ids: torch.Tensor, num_experts: int, world: int) -> SendPlan:
    per_rank = check_expert_parallel(num_experts, world)
    flat = topk_ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise MoEContractError(f"expert ids must lie in 0..{num_experts - 1}")
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    counts = torch.bincount(experts // per_rank, minlength=world)
    return SendPlan(order, experts, tuple(int(c) for c in counts.tolist()), topk_ids.shape[1])


@dataclass
class DispatchLayout:
    """Expert side of Dispatch: the kernel's rows, expert by expert, each padded to ``block_m``.

    ``arrival_rows[i]`` is the padded row of the i-th received row (received rows come source by
    source, ``recv_counts`` of each); padding rows have ``row_slot = -1`` and zero activations."""

    x: torch.Tensor                       # [R, H] bf16 or e4m3
    x_scale: torch.Tensor | None          # [R, H/128] fp32 (fp8)
    row_src: torch.Tensor                 # int32 [R]
    row_slot: torch.Tensor                # int32 [R]
    arrival_rows: torch.Tensor            # int64 [N_recv]
    recv_counts: tuple[int, ...]          # rows received from each source rank
    tokens_per_expert: tuple[int, ...]
    block_m: int
    max_slot: int                         # largest slot of any row (-1 if none)

    @property
    def blocks_per_expert(self) -> tuple[int, ...]:
        return tuple(-(-n // self.block_m) for n in self.tokens_per_expert)

    @property
    def num_rows(self) -> int:
        return self.x.shape[0]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """e4m3 tensors as uint8 for gathers, scatters and NCCL (byte moves need no fp8 kernels)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def build_layout(recv_x: torch.Tensor, recv_x_scale: torch.Tensor | None, recv_slot: torch.Tensor,
                 recv_expert: torch.Tensor, recv_counts: Sequence[int], experts_per_rank: int,
                 block_m: int) -> DispatchLayout:
    """Lay received rows out expert by expert (stable: source, then slot order inside an expert)."""
    n = recv_x.shape[0]
    device = recv_x.device
    src = torch.repeat_interleave(torch.arange(len(recv_counts), device=device),
                                  torch.tensor(list(recv_counts), device=device))
    tokens = torch.bincount(recv_expert, minlength=experts_per_rank)
    tokens_host = [int(v) for v in tokens.tolist()]
    blocks = [-(-t // block_m) for t in tokens_host]
    padded_start = torch.tensor(np.concatenate(([0], np.cumsum(blocks)[:-1])) * block_m,
                                dtype=torch.int64, device=device)
    sorted_start = torch.cumsum(tokens, 0) - tokens
    perm = torch.argsort(recv_expert, stable=True)
    e_sorted = recv_expert[perm]
    rank_in_expert = torch.arange(n, device=device) - sorted_start[e_sorted]
    arrival_rows = torch.empty(n, dtype=torch.int64, device=device)
    arrival_rows[perm] = padded_start[e_sorted] + rank_in_expert
    rows = sum(blocks) * block_m
    x = torch.zeros(rows, recv_x.shape[1], dtype=_bytes(recv_x).dtype, device=device)
    x[arrival_rows] = _bytes(recv_x)
    x = x.view(recv_x.dtype)
    x_scale = None
    if recv_x_scale is not None:
        x_scale = torch.zeros(rows, recv_x_scale.shape[1], dtype=recv_x_scale.dtype, device=device)
        x_scale[arrival_rows] = recv_x_scale
    row_src = torch.zeros(rows, dtype=torch.int32, device=device)
    row_slot = torch.full((rows,), -1, dtype=torch.int32, device=device)
    row_src[arrival_rows] = src.to(torch.int32)
    row_slot[arrival_rows] = recv_slot.to(torch.int32)
    return DispatchLayout(x, x_scale, row_src, row_slot, arrival_rows, tuple(recv_counts),
                          tuple(tokens_host), block_m, int(recv_slot.max()) if n else -1)


def dispatch(x: torch.Tensor, x_scale: torch.Tensor | None, topk_ids: torch.Tensor, *,
             num_experts: int, block_m: int, group=None) -> tuple[SendPlan, DispatchLayout]:
    """Dispatch over NCCL ``all_to_all_single`` (a step before the fused kernel). ``x`` is this
    rank's ``[T, H]`` tokens (bf16, or e4m3 with ``x_scale [T, H/128]``). One host sync: the
    receiver learns its row counts, which the host needs to build the tile schedule."""
    import torch.distributed as dist
    world = dist.get_world_size(group)
    plan = plan_send(topk_ids, num_experts, world)
    per_rank = num_experts // world
    send_counts = torch.tensor(plan.counts, dtype=torch.int64, device=x.device)
    recv_counts_t = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts_t, send_counts, group=group)
    recv_counts = [int(v) for v in recv_counts_t.tolist()]
    n_recv = sum(recv_counts)

    def exchange(send: torch.Tensor) -> torch.Tensor:
        out = torch.empty((n_recv, *send.shape[1:]), dtype=send.dtype, device=send.device)
        dist.all_to_all_single(out, send.contiguous(), output_split_sizes=recv_counts,
                               input_split_sizes=list(plan.counts), group=group)
        return out

    tokens = plan.order // plan.top_k
    recv_x = exchange(_bytes(x)[tokens]).view(x.dtype)
    recv_scale = exchange(x_scale[tokens]) if x_scale is not None else None
    meta = exchange(torch.stack((plan.order, plan.experts % per_rank), dim=1))
    return plan, build_layout(recv_x, recv_scale, meta[:, 0], meta[:, 1], recv_counts, per_rank,
                              block_m)
