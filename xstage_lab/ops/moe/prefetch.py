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
# Bytes per bulk prefetch: a divisor of every expert's Linear-1 bytes (2 I H, I and H multiples of
# 128), so no lane straddles two experts. A program's 256 KiB: the budget over a hundred-odd
# programs, one SM each. One program per expert (the budget on one to four SMs) ended 35-228 µs
# after its launch on one H200, the fused kernel waiting for it (retired moe_layer/h200-x1
# records 20261203T091721Z to …092642Z, their reason).
LANE_BYTES = 2048
PIECE = LANES * LANE_BYTES


class WeightPrefetch:
    """The prefetch of ``weights``' Linear-1 rows for one workspace: the first ``budget`` bytes
    (``L2_SHARE`` of the device's L2 by default) of the touched experts' Linear-1 weights end to
    end in id order, ``PIECE`` bytes a program, so ``programs = budget // PIECE``;
    ``prefetched`` int32 ``[programs]``: the expert each program's bytes start in at the last
    call. ``issue``: prefetch (sm_90 and later); without it the launch only picks (the CPU
    interpreter's tests). Raises ValueError where an expert's Linear-1 weights are fewer than
    ``PIECE`` bytes or the budget is."""

    def __init__(self, weights: ExpertWeights, args: torch.Tensor, budget: int, issue: bool):
        w1 = weights.w1
        expert_bytes = 2 * weights.intermediate * weights.hidden * w1.element_size()
        if min(budget, expert_bytes) < PIECE or expert_bytes % LANE_BYTES:
            raise ValueError(f"a prefetch budget of {budget} bytes over experts of {expert_bytes} "
                             f"Linear-1 bytes: both must hold {PIECE}, the experts' a multiple "
                             f"of {LANE_BYTES}")
        self.programs = budget // PIECE
        self.expert_bytes = expert_bytes
        self.prefetched = torch.full((self.programs,), -1, dtype=torch.int32, device=w1.device)
        self.device = w1.device
        self.stream: torch.cuda.Stream | None = None  # made at the first launch on CUDA
        kernel = load_kernel_module("moe_prefetch").prefetch_weights
        self.launches = {
            (received, ids): Launcher(
                kernel, args=args, w1=w1, prefetched=self.prefetched,
                NUM_EXPERTS=weights.num_experts, RECEIVED=received,
                E_PAD=triton.next_power_of_2(weights.num_experts), BLOCK=IDS_BLOCK,
                EXPERT_BYTES=expert_bytes, LANES=LANES, LANE_BYTES=LANE_BYTES,
                ID_DTYPE=triton_dtype(ids), ISSUE=issue, num_warps=LANES // 32)
            for received in (False, True) for ids in (torch.int32, torch.int64)}

    @classmethod
    def for_device(cls, weights: ExpertWeights, args: torch.Tensor) -> WeightPrefetch | None:
        """The prefetch where the weights' device has bulk L2 prefetch (CUDA, sm_90 and
        later), ``L2_SHARE`` of its L2; None elsewhere, and for experts under ``PIECE`` bytes."""
        device = weights.w1.device
        if (device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9
                or 2 * weights.intermediate * weights.hidden * weights.w1.element_size() < PIECE):
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


def prefetched_experts(expert_ids: torch.Tensor, num_experts: int,
                       prefetch: WeightPrefetch) -> list[int]:
    """What ``prefetch.prefetched`` holds after a launch over ``expert_ids`` (the arrivals'):
    per program, the touched expert (the distinct ids in ``0 .. num_experts - 1``, ascending)
    its first byte lies in, -1 past the last."""
    ids = expert_ids.cpu().long()
    touched = torch.unique(ids[(ids >= 0) & (ids < num_experts)]).tolist()
    starts = [p * PIECE // prefetch.expert_bytes for p in range(prefetch.programs)]
    return [touched[k] if k < len(touched) else -1 for k in starts]
