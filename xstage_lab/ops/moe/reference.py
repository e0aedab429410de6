"""The float32 torch reference of the MoE layer, independent of Dispatch, the kernels and Combine:
every (token, k) pick's expert regenerated from its seed and applied in float32."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .shapes import FP8_SCALE_BLOCK, MoEShape, check_precision
from .weights import (dequantize_blocks_fp8, dequantize_rows_fp8, expert_master_weights,
                      quantize_blocks_fp8, quantize_rows_fp8)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``[..., 2I]`` rows holding gate then up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def expert_rows_reference(x: torch.Tensor, experts: torch.Tensor, shape: MoEShape, *, seed: int,
                          precision: str, scale_block: int = FP8_SCALE_BLOCK
                          ) -> dict[str, torch.Tensor]:
    """float32 output of each row's expert, before routing weights: row i is expert
    ``experts[i]`` (global id) applied to the bf16 row ``x[i]``, with the expert regenerated from
    its seed (``expert_master_weights``) on ``x``'s device.

    ``"fp32"``: bf16 inputs and master weights in float32. For fp8 also ``"fp8_emulated"``: the
    same with the fused kernel's W8A8 quantization emulated (x per 1 x 128, weights per
    128 x 128, h re-quantized per 1 x 128), which isolates the kernel's own error."""
    check_precision(precision)
    out = {"fp32": torch.zeros(x.shape[0], shape.hidden, dtype=torch.float32, device=x.device)}
    if precision == "fp8":
        out["fp8_emulated"] = torch.zeros_like(out["fp32"])
        xq = dequantize_rows_fp8(*quantize_rows_fp8(x, scale_block))
    xf = x.float()
    for e in torch.unique(experts).tolist():
        rows = (experts == e).nonzero(as_tuple=True)[0]
        w1, w2 = expert_master_weights(shape, e, seed=seed, device=x.device)
        out["fp32"][rows] = swiglu(xf[rows] @ w1.float().t()) @ w2.float().t()
        if precision == "fp8":
            w1q = dequantize_blocks_fp8(*quantize_blocks_fp8(w1, scale_block))
            w2q = dequantize_blocks_fp8(*quantize_blocks_fp8(w2, scale_block))
            h = swiglu(xq[rows] @ w1q.t())
            hq = dequantize_rows_fp8(*quantize_rows_fp8(h, scale_block))
            out["fp8_emulated"][rows] = hq @ w2q.t()
    return out


def reference_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  shape: MoEShape, *, seed: int, precision: str,
                  scale_block: int = FP8_SCALE_BLOCK) -> dict[str, torch.Tensor]:
    """float32 reference of one rank's MoE output ``[T, H]``, independent of Dispatch, the kernel
    and Combine: every (token, k) pick's expert output (``expert_rows_reference``, same keys)
    weighted and summed over the picks of each token."""
    t, k = topk_ids.shape
    tok = torch.arange(t, device=x.device).repeat_interleave(k)
    rows = expert_rows_reference(x[tok], topk_ids.reshape(-1), shape, seed=seed,
                                 precision=precision, scale_block=scale_block)
    w = topk_weights.reshape(-1).float()[:, None]
    return {kind: torch.zeros(t, shape.hidden, dtype=torch.float32, device=x.device)
            .index_add_(0, tok, w * r) for kind, r in rows.items()}
