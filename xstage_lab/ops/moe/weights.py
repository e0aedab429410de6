"""Expert weights: the seeded bf16 master weights of every global expert, the local experts of
a rank in the fused kernels' layout, and the FP8 recipe (1 x 128 activation and 128 x 128 weight
blocks of e4m3 with fp32 scales, as in DeepSeek-V3)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .routing import generator
from .shapes import E4M3_MAX, FP8_SCALE_BLOCK, MoEShape, check_expert_parallel, check_precision


def quantize_rows_fp8(x: torch.Tensor, block: int = FP8_SCALE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """1 x ``block`` e4m3 quantization of ``[..., K]``: values and fp32 scales ``[..., K / block]``."""
    *lead, k = x.shape
    xf = x.float().reshape(*lead, k // block, block)
    # products with reciprocals, the same bitwise on the CPU and on the GPU (torch's CUDA division
    # by a scalar multiplies by its reciprocal anyway) and in kernels/moe_routing.py, where one
    # division per 1 x 128 block instead of one per value keeps the quantizing gather at HBM speed
    scale = xf.abs().amax(-1).clamp_min(1e-12) * (1.0 / E4M3_MAX)
    q = (xf * scale.reciprocal()[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(*lead, k), scale


def dequantize_rows_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(q.shape[-1] // scale.shape[-1], dim=-1)


def quantize_blocks_fp8(w: torch.Tensor, block: int = FP8_SCALE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``block`` x ``block`` e4m3 quantization of ``[..., N, K]``: scales ``[..., N/block, K/block]``."""
    *lead, n, k = w.shape
    wf = w.float().reshape(*lead, n // block, block, k // block, block)
    scale = wf.abs().amax(dim=(-3, -1)).clamp_min(1e-12) * (1.0 / E4M3_MAX)  # as above
    q = (wf / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(*lead, n, k), scale


def dequantize_blocks_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    block = q.shape[-1] // scale.shape[-1]
    return q.float() * scale.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)


def expert_master_weights(shape: MoEShape, expert: int, *, seed: int,
                          device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 weights of global expert ``expert``: ``w1 [2I, H]`` (gate rows, then up rows) and
    ``w2 [H, I]``, N(0, 1/fan_in). Deterministic per (seed, expert, device type), so every rank and
    the reference regenerate the same expert without holding all experts."""
    g = generator(seed * 1_000_003 + expert, device)
    h, i = shape.hidden, shape.intermediate
    w1 = (torch.randn(2 * i, h, generator=g, device=device) * h ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(h, i, generator=g, device=device) * i ** -0.5).to(torch.bfloat16)
    return w1, w2


class ExpertShapes:
    """E_loc, H and I of stacked expert weights ``w1 [E_loc, 2I, H]``, ``w2 [E_loc, H, I]``."""

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden(self) -> int:
        return self.w1.shape[2]

    @property
    def intermediate(self) -> int:
        return self.w2.shape[2]


@dataclass
class ExpertWeights(ExpertShapes):
    """The local experts of one rank, in the kernel's layout (see ``kernels/moe_fused.py``)."""

    precision: str
    w1: torch.Tensor                     # [E_loc, 2I, H] bf16 or e4m3
    w2: torch.Tensor                     # [E_loc, H, I]
    w1_scale: torch.Tensor | None = None  # [E_loc, 2I/128, H/128] fp32 (fp8 only)
    w2_scale: torch.Tensor | None = None  # [E_loc, H/128, I/128]


def local_expert_weights(shape: MoEShape, rank: int, world: int, precision: str, *, seed: int,
                         device="cpu", scale_block: int = FP8_SCALE_BLOCK) -> ExpertWeights:
    """Experts ``rank * E_loc .. (rank + 1) * E_loc - 1`` (contiguous placement), quantized per
    128 x 128 block for fp8."""
    check_precision(precision)
    per_rank = check_expert_parallel(shape.routed_experts, world)
    w1s, w2s, s1s, s2s = [], [], [], []
    for e in range(rank * per_rank, (rank + 1) * per_rank):
        w1, w2 = expert_master_weights(shape, e, seed=seed, device=device)
        if precision == "fp8":
            (w1, s1), (w2, s2) = quantize_blocks_fp8(w1, scale_block), quantize_blocks_fp8(w2, scale_block)
            s1s.append(s1)
            s2s.append(s2)
        w1s.append(w1)
        w2s.append(w2)
    if precision == "bf16":
        return ExpertWeights(precision, torch.stack(w1s), torch.stack(w2s))
    return ExpertWeights(precision, torch.stack(w1s), torch.stack(w2s), torch.stack(s1s), torch.stack(s2s))
