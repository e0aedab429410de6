"""The unfused path users run instead of the fused kernel: torch's grouped GEMMs
(``torch._grouped_mm``, ``torch._scaled_grouped_mm``), SwiGLU, NCCL all-to-all back to the
sources, weighted sum."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .combine import combine_weighted_sum
from .dispatch import DispatchLayout, SendPlan
from .reference import swiglu
from .routing import generator
from .shapes import MoEContractError, MoEShape, check_expert_parallel, check_precision
from .weights import ExpertShapes, expert_master_weights, quantize_rows_fp8

# The baseline is what a user runs without the fused kernel: torch's own grouped GEMMs over the
# dispatched rows (one group per local expert), SwiGLU between them. In FP8 that is the scale
# recipe torch._scaled_grouped_mm supports on sm_90, not the kernel's 1 x 128 / 128 x 128 blocks,
# so the unfused path quantizes its own activations and weights (``unfused_activations``,
# ``unfused_expert_weights``).
UNFUSED_FP8_RECIPE = ("rowwise: activations (x, and h after SwiGLU) e4m3 with one fp32 scale "
                      "per row (row amax / 448), scale_a [M_total]; each expert's weights e4m3 "
                      "with one fp32 scale per output column (row amax / 448 of w1 [2I, H] and "
                      "w2 [H, I]), scale_b [E, N]; torch._scaled_grouped_mm(A [M_total, K] "
                      "row-major, w.transpose(1, 2) of a contiguous [E, N, K], offs, "
                      "out_dtype=bf16, use_fast_accum=False)")
# The op behind each precision, recorded with every result.
UNFUSED_IMPL = {"bf16": "torch._grouped_mm", "fp8": "torch._scaled_grouped_mm rowwise"}
_UNFUSED_CHECKED: set[tuple[str, str]] = set()


class UnfusedPathError(RuntimeError):
    """torch's grouped GEMM is missing or gives wrong results on this device: there is no unfused
    baseline to compare with (a per-expert loop is not what users run, so none stands in)."""


@dataclass
class GroupedWeights(ExpertShapes):
    """The local experts as the unfused path's grouped GEMMs take them. Weights stay
    ``[E, N, K]`` contiguous and are passed as ``w.transpose(1, 2)``: the column-major B the
    grouped GEMMs want."""

    precision: str
    w1: torch.Tensor                      # [E_loc, 2I, H] bf16 or e4m3
    w2: torch.Tensor                      # [E_loc, H, I]
    w1_scale: torch.Tensor | None = None  # [E_loc, 2I] fp32 (fp8): one per output column
    w2_scale: torch.Tensor | None = None  # [E_loc, H]


def _quantize_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one fp32 scale per row of the last dimension: scales ``[..., 1]``."""
    return quantize_rows_fp8(t, t.shape[-1])


def unfused_activations(x: torch.Tensor,
                        precision: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """bf16 rows ``[..., H]`` as the unfused path takes them: as they are (bf16), or e4m3 with one
    fp32 scale per row, ``[..., 1]`` (fp8, ``UNFUSED_FP8_RECIPE``). Row by row, so quantizing the
    source tokens before Dispatch and the dispatched rows after give the same values."""
    check_precision(precision)
    return (x, None) if precision == "bf16" else _quantize_rowwise(x)


def unfused_expert_weights(shape: MoEShape, rank: int, world: int, precision: str, *, seed: int,
                           device="cpu") -> GroupedWeights:
    """Experts ``rank * E_loc .. (rank + 1) * E_loc - 1`` from the same bf16 master weights as the
    fused kernel's (``expert_master_weights``); fp8 quantized per output column."""
    check_precision(precision)
    per_rank = check_expert_parallel(shape.routed_experts, world)
    parts = {"w1": [], "w2": [], "w1_scale": [], "w2_scale": []}
    for e in range(rank * per_rank, (rank + 1) * per_rank):
        for name, w in zip(("w1", "w2"), expert_master_weights(shape, e, seed=seed, device=device)):
            if precision == "fp8":
                w, s = _quantize_rowwise(w)
                parts[f"{name}_scale"].append(s.squeeze(-1))
            parts[name].append(w)
    return GroupedWeights(precision, **{k: torch.stack(v) if v else None for k, v in parts.items()})


def group_offsets(layout: DispatchLayout) -> torch.Tensor:
    """int32 ``offs`` of the grouped GEMMs: the end of each local expert's padded rows."""
    ends = np.cumsum(layout.blocks_per_expert, dtype=np.int64) * layout.block_m
    return torch.tensor(ends, dtype=torch.int32, device=layout.x.device)


def _grouped_linear(x: torch.Tensor, x_scale: torch.Tensor | None, w: torch.Tensor,
                    w_scale: torch.Tensor | None, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of ``x [M, K]`` times ``w[e] [N, K]`` transposed: bf16
    ``[M, N]``."""
    if w_scale is None:
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    return torch._scaled_grouped_mm(x, w.transpose(1, 2), x_scale.view(-1), w_scale, offs=offs,
                                    out_dtype=torch.bfloat16)


def _probe_error(device: torch.device, precision: str) -> float:
    """Relative error of the grouped GEMM on three groups of 64, 0 and 64 rows (an idle expert in
    the middle) against a float32 loop over the same (quantized) operands."""
    g = generator(0, device)
    a = torch.randn(128, 256, generator=g, device=device).to(torch.bfloat16)
    w = torch.randn(3, 256, 256, generator=g, device=device).to(torch.bfloat16)
    offs = torch.tensor([64, 64, 128], dtype=torch.int32, device=device)
    (aq, a_s), (wq, w_s) = (unfused_activations(a, precision),
                            unfused_activations(w, precision))
    w_s = None if w_s is None else w_s.squeeze(-1)
    got = _grouped_linear(aq, a_s, wq, w_s, offs).float()
    af = aq.float() * (1 if a_s is None else a_s)
    wf = wq.float() * (1 if w_s is None else w_s[..., None])
    want = torch.cat([af[:64] @ wf[0].t(), af[64:] @ wf[2].t()])
    return ((got - want).norm() / want.norm()).item()


def unfused_impl(device: torch.device, precision: str) -> str:
    """The op behind the unfused path (``UNFUSED_IMPL``), once checked on a small probe per device
    type and precision; raises UnfusedPathError where it is missing or wrong."""
    check_precision(precision)
    key = (device.type, precision)
    if key not in _UNFUSED_CHECKED:
        try:
            err = _probe_error(device, precision)
        except (RuntimeError, ValueError, AttributeError, TypeError) as e:  # missing op or kernel
            raise UnfusedPathError(f"{UNFUSED_IMPL[precision]} does not run on {device}: "
                                   f"{type(e).__name__}: {e}") from e
        # bf16 output rounding ~2e-3; 1e-2 (bf16) and 2e-2 (fp8: a few e4m3 flips) leave margin.
        bound = 1e-2 if precision == "bf16" else 2e-2
        if not err <= bound:
            raise UnfusedPathError(f"{UNFUSED_IMPL[precision]} on {device} is wrong on a probe: "
                                   f"relative error {err:.3g} > {bound}")
        _UNFUSED_CHECKED.add(key)
    return UNFUSED_IMPL[precision]


def grouped_expert_ffn(layout: DispatchLayout, weights: GroupedWeights,
                       offs: torch.Tensor | None = None) -> torch.Tensor:
    """Linear-1, SwiGLU, Linear-2 of every local expert as two grouped GEMMs: bf16 ``[R, H]`` over
    the layout's rows (padding rows included, as in the fused kernel). ``layout`` holds the
    unfused path's activations (``unfused_activations``: bf16, or fp8 with ``x_scale [R, 1]``).
    ``offs`` (``group_offsets(layout)``) may be passed to keep its host-to-device copy out of a
    timed or graph-captured region."""
    precision = weights.precision
    unfused_impl(layout.x.device, precision)
    wdt = torch.bfloat16 if precision == "bf16" else torch.float8_e4m3fn
    want_scale = None if precision == "bf16" else (layout.num_rows, 1)
    got_scale = None if layout.x_scale is None else tuple(layout.x_scale.shape)
    if layout.x.dtype != wdt or got_scale != want_scale:
        raise MoEContractError(f"the unfused {precision} path takes {wdt} rows with x_scale "
                               f"{want_scale} (unfused_activations), got {layout.x.dtype} rows "
                               f"with x_scale {got_scale}")
    if len(layout.tokens_per_expert) != weights.num_experts:
        raise MoEContractError(f"layout has {len(layout.tokens_per_expert)} experts, weights "
                               f"{weights.num_experts}")
    offs = group_offsets(layout) if offs is None else offs
    h = swiglu(_grouped_linear(layout.x, layout.x_scale, weights.w1, weights.w1_scale, offs))
    h, h_scale = unfused_activations(h, precision)
    return _grouped_linear(h, h_scale, weights.w2, weights.w2_scale, offs)


def unfused_moe(layout: DispatchLayout, plan: SendPlan, weights: GroupedWeights,
                topk_weights: torch.Tensor, *, group=None) -> torch.Tensor:
    """The path users run instead of the fused kernel: grouped expert GEMMs
    (``grouped_expert_ffn``), NCCL all-to-all Combine back to the source ranks, scatter into slots,
    weighted sum. ``layout`` and ``plan`` come from a Dispatch of ``unfused_activations``. Returns
    bf16 ``[T, H]``."""
    import torch.distributed as dist
    y = grouped_expert_ffn(layout, weights)
    back = torch.empty(sum(plan.counts), weights.hidden, dtype=y.dtype, device=y.device)
    dist.all_to_all_single(back, y[layout.arrival_rows], output_split_sizes=list(plan.counts),
                           input_split_sizes=list(layout.recv_counts), group=group)
    combine = torch.empty(topk_weights.numel(), weights.hidden, dtype=y.dtype, device=y.device)
    combine[plan.order] = back
    return combine_weighted_sum(combine, topk_weights)


GROUP_ALIGN = 16  # rows each group of the sync-free unfused path is padded to (grouped GEMM tiles)


def unfused_rows(x: torch.Tensor, expert_ids: torch.Tensor, weights: GroupedWeights,
                 capacity: int) -> torch.Tensor:
    """The unfused path without a host sync: rows ``x [N, H]`` (bf16), row ``i`` through local
    expert ``expert_ids[i]``, by torch ops: a stable sort by expert, counts by ``index_add_``,
    each expert's rows padded to ``GROUP_ALIGN`` in a buffer of the static ``capacity`` rows
    (``N + E (GROUP_ALIGN - 1)`` at least), the grouped GEMMs with SwiGLU between them
    (``UNFUSED_FP8_RECIPE`` in fp8), the results back in row order: bf16 ``[N, H]``."""
    n, e = expert_ids.numel(), weights.num_experts
    ids = expert_ids.reshape(-1).long()
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(e, dtype=torch.int64, device=x.device).index_add_(
        0, ids, torch.ones_like(ids))
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    ends = torch.cumsum(padded, 0)
    sorted_ids = ids[order]
    rank = torch.arange(n, device=x.device) - (torch.cumsum(counts, 0) - counts)[sorted_ids]
    rows = torch.empty(n, dtype=torch.int64, device=x.device)
    rows[order] = (ends - padded)[sorted_ids] + rank
    xa, xs = unfused_activations(x, weights.precision)
    a = torch.zeros(capacity, x.shape[1], dtype=xa.dtype, device=x.device)
    a.view(torch.uint8 if xa.dtype == torch.float8_e4m3fn else xa.dtype)[rows] = (
        xa.view(torch.uint8) if xa.dtype == torch.float8_e4m3fn else xa)
    a_s = None
    if xs is not None:
        a_s = torch.ones(capacity, 1, dtype=torch.float32, device=x.device)
        a_s[rows] = xs
    offs = ends.to(torch.int32)
    h = swiglu(_grouped_linear(a, a_s, weights.w1, weights.w1_scale, offs))
    h, h_s = unfused_activations(h, weights.precision)
    return _grouped_linear(h, h_s, weights.w2, weights.w2_scale, offs)[rows]


def unfused_layer(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  weights: GroupedWeights, capacity: int) -> torch.Tensor:
    """The layer at EP = 1 by torch ops, from the router's output: ``unfused_rows`` of every
    (token, k) pick, then the weighted sum. bf16 ``[T, H]``."""
    k = topk_ids.shape[1]
    rows = unfused_rows(x.repeat_interleave(k, dim=0), topk_ids, weights, capacity)
    return combine_weighted_sum(rows, topk_weights)
