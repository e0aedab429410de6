"""The L2 prefetch of the experts' weights beside a call's routing (``kernels/moe_prefetch.py``):
``WeightPrefetch`` launches it on a side stream forked after the argument block is written and
joined before the fused kernel, so in a captured CUDA graph it is a branch beside the routing
launches; ``prefetched_experts`` is the host reference of the experts it picks."""
from __future__ import annotations

import torch
import triton

from ...kernel_sources import load_kernel_module
from ..launcher import Launcher
from .call_args import triton_dtype
from .weights import ExpertWeights

# The share of L2 the prefetch fills: the rest keeps what the routing and the fused kernel's
# first tiles write and read besides the weights (tables, gathered rows, h).
L2_SHARE = 0.5
# Above this many arrivals (a call's, or an EP rank's bound) no prefetch: each program's pass
# over the ids grows with them, and the routing is a small part of the call there (about 1% at
# 8192 tokens, issue 27's matrix).
PREFETCH_ARRIVALS = 65536
IDS_BLOCK = 1024  # ids per step of a program's pass
LANES = 128  # bulk prefetches per program, one per thread of its four warps
PREFETCH_ALIGN = 16  # cp.async.bulk: addresses and sizes in multiples of 16 bytes


class WeightPrefetch:
    """The prefetch of ``weights``' Linear-1 rows for one workspace: ``budget`` bytes at most
    (``L2_SHARE`` of the device's L2 by default), the Linear-1 weights of one touched expert per
    program, so ``programs = budget // expert bytes`` (at least one, which then prefetches the
    budget's first bytes of its expert), ``prefetched`` int32 ``[programs]`` the experts each
    call picked. ``issue``: prefetch (sm_90 and later); without it the launch only picks
    (the CPU interpreter's tests)."""

    def __init__(self, weights: ExpertWeights, args: torch.Tensor, budget: int, issue: bool):
        w1 = weights.w1
        expert_bytes = 2 * weights.intermediate * weights.hidden * w1.element_size()
        if budget < LANES * PREFETCH_ALIGN:
            raise ValueError(f"a prefetch budget of {budget} bytes is under one "
                             f"{LANES * PREFETCH_ALIGN}-byte step")
        self.programs = max(1, min(weights.num_experts, budget // expert_bytes))
        lane_bytes = min(expert_bytes, budget) // (LANES * PREFETCH_ALIGN) * PREFETCH_ALIGN
        self.prefetched = torch.full((self.programs,), -1, dtype=torch.int32, device=w1.device)
        self.device = w1.device
        self.stream: torch.cuda.Stream | None = None  # made at the first launch on CUDA
        kernel = load_kernel_module("moe_prefetch").prefetch_weights
        self.launches = {
            (received, ids): Launcher(
                kernel, args=args, w1=w1, prefetched=self.prefetched,
                NUM_EXPERTS=weights.num_experts, RECEIVED=received,
                E_PAD=triton.next_power_of_2(weights.num_experts), BLOCK=IDS_BLOCK,
                EXPERT_BYTES=expert_bytes, LANES=LANES, LANE_BYTES=lane_bytes,
                ID_DTYPE=triton_dtype(ids), ISSUE=issue, num_warps=LANES // 32)
            for received in (False, True) for ids in (torch.int32, torch.int64)}

    @classmethod
    def for_device(cls, weights: ExpertWeights, args: torch.Tensor) -> WeightPrefetch | None:
        """The prefetch where the weights' device has bulk L2 prefetch (CUDA, sm_90 and
        later), ``L2_SHARE`` of its L2; None elsewhere."""
        device = weights.w1.device
        if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
            return None
        l2 = torch.cuda.get_device_properties(device).L2_cache_size
        return cls(weights, args, int(l2 * L2_SHARE), issue=True)

    def launch(self, capacity: int, id_dtype: torch.dtype,
               n_arrivals: torch.Tensor | None = None) -> None:
        """One launch on the current stream over the arrivals of the argument block's ids:
        ``capacity`` of them at EP = 1, ``n_arrivals`` (int32 ``[1]``, on the device) on an EP
        rank."""
        received = n_arrivals is not None
        self.launches[(received, id_dtype)](
            (self.programs,), n_arrivals_ptr=n_arrivals if received else self.prefetched,
            CAPACITY=capacity)

    def beside(self, routing, capacity: int, id_dtype: torch.dtype,
               n_arrivals: torch.Tensor | None = None) -> None:
        """``routing()`` on the current stream with ``launch`` beside it on a side stream,
        forked after what the current stream holds (the argument block written) and joined
        after the routing's launches, so what follows waits for both; above
        ``PREFETCH_ARRIVALS`` arrivals, ``routing()`` alone."""
        if capacity > PREFETCH_ARRIVALS:
            routing()
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        here = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(here)
        with torch.cuda.stream(self.stream):
            self.launch(capacity, id_dtype, n_arrivals)
        routing()
        here.wait_stream(self.stream)


def prefetched_experts(expert_ids: torch.Tensor, num_experts: int, programs: int) -> list[int]:
    """What ``WeightPrefetch.prefetched`` holds after a launch over ``expert_ids`` (the
    arrivals'): the first ``programs`` distinct ids in ``0 .. num_experts - 1``, ascending,
    padded with -1."""
    ids = expert_ids.cpu().long()
    touched = torch.unique(ids[(ids >= 0) & (ids < num_experts)]).tolist()[:programs]
    return touched + [-1] * (programs - len(touched))
