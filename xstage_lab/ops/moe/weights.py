"""Expert weights: the seeded bf16 master weights of every global expert, the local experts of
a rank in the fused kernels' layout, and the FP8 recipe (1 x 128 activation and 128 x 128 weight
blocks of e4m3 with fp32 scales, as in DeepSeek-V3)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .routing import generator
from .shapes import (E4M3_MAX, FP8_SCALE_BLOCK, MoEContractError, MoEShape,
                     check_expert_parallel, check_precision, check_scale_blocks)


# what from_projections casts to bf16 or quantizes
FLOATING = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


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
    """The local experts of one rank, in the kernel's layout (see ``kernels/moe_fused.py``): E_loc
    experts, each ``w1 [2I, H]`` (Linear-1: the gate's I rows, then the up projection's) and ``w2
    [H, I]`` (Linear-2), bf16, or e4m3 with fp32 scales per 128 x 128 block. Built from a model's
    own experts by ``from_projections``; seeded ones by ``local_expert_weights``. Construction
    checks the structure; ``fused.check_expert_weights`` the rest, against a kernel's tiles."""

    precision: str
    w1: torch.Tensor                     # [E_loc, 2I, H] bf16 or e4m3
    w2: torch.Tensor                     # [E_loc, H, I]
    w1_scale: torch.Tensor | None = None  # [E_loc, 2I/128, H/128] fp32 (fp8 only)
    w2_scale: torch.Tensor | None = None  # [E_loc, H/128, I/128]

    def __post_init__(self):
        check_precision(self.precision)
        for name in ("w1", "w2"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise MoEContractError(f"{name} must be a 3-D tensor [E_loc, ...], got "
                                       f"{getattr(t, 'shape', type(t).__name__)}")
        (e1, n1, k1), (e2, n2, k2) = self.w1.shape, self.w2.shape
        if e1 != e2 or n1 != 2 * k2 or k1 != n2:
            raise MoEContractError(f"w1 [E, 2I, H] and w2 [E, H, I] disagree: w1 "
                                   f"{list(self.w1.shape)}, w2 {list(self.w2.shape)}")
        fp8 = self.precision == "fp8"
        if (self.w1_scale is not None) != fp8 or (self.w2_scale is not None) != fp8:
            raise MoEContractError(f"{self.precision} weights take "
                                   f"{'w1_scale and w2_scale' if fp8 else 'no scales'}")

    @classmethod
    def from_projections(cls, gate, up, down, precision: str = "bf16", *, gate_scale=None,
                         up_scale=None, down_scale=None, device=None,
                         scale_block: int = FP8_SCALE_BLOCK) -> ExpertWeights:
        """A model's SwiGLU experts, ``down(silu(gate(x)) * up(x))``, in the kernels' layout.

        ``gate``, ``up``: each expert's ``[I, H]`` and ``down`` its ``[H, I]``, as
        ``nn.Linear`` holds them (out x in: Qwen3-MoE's and DeepSeek-V3's ``gate_proj``,
        ``up_proj``, ``down_proj``; Mixtral's ``w1``, ``w3``, ``w2``), stacked ``[E, ...]`` or
        sequences of E tensors. bf16: floating weights, cast. fp8: floating weights quantized per
        ``scale_block`` square (``quantize_blocks_fp8``); or e4m3 weights with their fp32 scales
        (``*_scale``: ``[I/128, H/128]``, ``[H/128, I/128]`` per expert, the factor that
        dequantizes, as DeepSeek-V3's ``weight_scale_inv``), taken as they are. On ``device``
        (default: the weights'), one expert converted at a time."""
        projections = {"gate": gate, "up": up, "down": down}
        scales = {"gate": gate_scale, "up": up_scale, "down": down_scale}
        shapes, quantized = _projection_shapes(projections, scales, precision, scale_block)
        weights = None
        with torch.no_grad():  # an nn.Module's parameters: the copies hold no autograd graph
            for e in range(len(gate)):
                parts = {n: _expert_part(v, e, n, shapes[n], gate[0].dtype)
                         for n, v in projections.items()}
                where = torch.device(device) if device is not None else parts["gate"].device
                w1 = torch.cat([parts["gate"], parts["up"]]).to(where)
                w2 = parts["down"].to(where)
                if quantized:
                    s = {n: _expert_part(v, e, f"{n}_scale",
                                         tuple(d // scale_block for d in shapes[n]),
                                         torch.float32) for n, v in scales.items()}
                    expert = (w1, w2, torch.cat([s["gate"], s["up"]]).to(where),
                              s["down"].to(where))
                else:
                    expert = _in_kernel_layout(w1, w2, precision, scale_block)
                weights = _put(weights, e, len(gate), precision, expert)
        return weights


def _projection_shapes(projections: dict, scales: dict, precision: str, scale_block: int
                       ) -> tuple[dict, bool]:
    """``from_projections``' contract before any expert is read: each projection's per-expert
    shape (gate's first ``[I, H]`` sets I and H) and whether the weights come quantized."""
    check_precision(precision)
    gate = projections["gate"]
    num = len(gate)
    if num < 1 or any(len(v) != num for v in projections.values()):
        raise MoEContractError(f"gate, up and down must hold the same experts (at least one), got "
                               f"{[len(v) for v in projections.values()]}")
    dtype = gate[0].dtype
    quantized = dtype == torch.float8_e4m3fn
    if not quantized and dtype not in FLOATING:
        raise MoEContractError(f"expert weights must be one of {FLOATING}, or e4m3 with scales, "
                               f"got {dtype}")
    given = [v is not None for v in scales.values()]
    if quantized and (precision != "fp8" or not all(given)):
        raise MoEContractError("e4m3 weights need precision='fp8' and gate_scale, up_scale and "
                               "down_scale")
    if quantized and any(len(v) != num for v in scales.values()):
        raise MoEContractError(f"gate_scale, up_scale and down_scale must hold the {num} experts, "
                               f"got {[len(v) for v in scales.values()]}")
    if not quantized and any(given):
        raise MoEContractError("scales come with e4m3 weights only; floating ones are quantized "
                               "here")
    if gate[0].dim() != 2:
        raise MoEContractError(f"gate[0] must be [I, H], got {list(gate[0].shape)}")
    inter, hidden = gate[0].shape
    if precision == "fp8":
        check_scale_blocks(hidden, inter, scale_block)
    return {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}, quantized


def _expert_part(stack, e: int, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s ``name`` of ``stack``, checked to be ``dtype`` ``shape``."""
    t = stack[e]
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise MoEContractError(f"{name}[{e}] must be {dtype} {list(shape)}, got {t.dtype} "
                               f"{list(t.shape)}")
    return t


def _in_kernel_layout(w1: torch.Tensor, w2: torch.Tensor, precision: str, scale_block: int
                      ) -> tuple[torch.Tensor, ...]:
    """One expert's floating ``w1 [2I, H]`` and ``w2 [H, I]`` in the kernels' precision: bf16, or
    e4m3 and the scales of each ``scale_block`` square."""
    if precision == "bf16":
        return w1.to(torch.bfloat16), w2.to(torch.bfloat16)
    (q1, s1), (q2, s2) = quantize_blocks_fp8(w1, scale_block), quantize_blocks_fp8(w2, scale_block)
    return q1, q2, s1, s2


def _put(weights: ExpertWeights | None, e: int, num: int, precision: str,
         expert: tuple[torch.Tensor, ...]) -> ExpertWeights:
    """``weights`` (allocated at the first of ``num`` experts: None) with expert ``e`` in place:
    the stacks filled in place, never two copies of them at once."""
    if weights is None:
        weights = ExpertWeights(precision, *(torch.empty(num, *t.shape, dtype=t.dtype,
                                                         device=t.device) for t in expert))
    for stack, t in zip((weights.w1, weights.w2, weights.w1_scale, weights.w2_scale), expert):
        stack[e].copy_(t)
    return weights


def local_expert_weights(shape: MoEShape, rank: int, world: int, precision: str, *, seed: int,
                         device="cpu", scale_block: int = FP8_SCALE_BLOCK) -> ExpertWeights:
    """Experts ``rank * E_loc .. (rank + 1) * E_loc - 1`` (contiguous placement), quantized per
    128 x 128 block for fp8."""
    check_precision(precision)
    per_rank = check_expert_parallel(shape.routed_experts, world)
    if precision == "fp8":
        check_scale_blocks(shape.hidden, shape.intermediate, scale_block)
    weights = None
    for e in range(per_rank):
        w1, w2 = expert_master_weights(shape, rank * per_rank + e, seed=seed, device=device)
        weights = _put(weights, e, per_rank, precision,
                       _in_kernel_layout(w1, w2, precision, scale_block))
    return weights
