"""The router (softmax over expert logits, top-k, weights renormalised over the k picks) and the
seeded routings the benchmarks draw: ``balanced`` (i.i.d. logits) and ``skewed`` (seeded hot
experts, the same on every rank, get a logit bias: persistent hot experts, paper §1)."""
from __future__ import annotations

import torch

from .shapes import ROUTINGS, MoEContractError

# Skewed routing: 1/16 of the experts are hot with this logit bias (6-14x the mean load at top-6..10).
HOT_EXPERT_FRACTION = 1 / 16
HOT_LOGIT_BIAS = 2.0


def generator(seed: int, device) -> torch.Generator:
    return torch.Generator(device=torch.device(device)).manual_seed(int(seed))


def hot_experts(num_experts: int, seed: int) -> torch.Tensor:
    """The seeded hot experts of skewed routing; identical on every rank (seed only)."""
    count = max(1, round(num_experts * HOT_EXPERT_FRACTION))
    return torch.randperm(num_experts, generator=generator(seed, "cpu"))[:count]


def router_logits(num_tokens: int, num_experts: int, routing: str, *, seed: int, rank: int = 0,
                  device="cpu") -> torch.Tensor:
    """float32 ``[num_tokens, num_experts]`` logits of one rank's tokens (fresh per rank)."""
    if routing not in ROUTINGS:
        raise MoEContractError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    g = generator(seed * 7919 + rank + 1, device)
    logits = torch.randn(num_tokens, num_experts, generator=g, device=device)
    if routing == "skewed":
        logits[:, hot_experts(num_experts, seed).to(device)] += HOT_LOGIT_BIAS
    return logits


def router_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts (int64 ``[T, k]``) and their softmax weights renormalised to sum to one."""
    num_experts = logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise MoEContractError(f"top_k={top_k} must be in 1..{num_experts} (the routed experts)")
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True)
