"""Expert-parallel MoE layer around the fused kernel (paper §2.2, §4.2): host side.

Pipeline of one layer over P ranks (SPMD under torchrun, one GPU per rank):

1. Router: softmax over expert logits, top-k, weights renormalised over the k picks.
   ``balanced``: i.i.d. logits; ``skewed``: seeded hot experts, the same on every rank, get a
   logit bias (persistent hot experts, §1).
2. Dispatch: a separate step *before* the fused kernel (MegaMoE fuses it; here it is NCCL
   ``all_to_all_single``). Each rank sends every (token, k) slot to the rank owning the expert; the
   receiver lays rows out expert by expert, each expert padded to ``block_m`` rows, and keeps for
   every row its source rank and slot (``t * top_k + j``). FP8 activations are quantized on the
   source, so Dispatch moves e4m3 rows plus 1 x 128 scales.
3. The fused kernel (``kernels/moe_fused_ws.py``, warp-specialized Gluon, on sm_90 GPUs; the
   portable Triton ``kernels/moe_fused.py`` elsewhere: ``default_tile_config``) runs Linear-1 +
   SwiGLU and Linear-2 tiles over the local experts in the order of a tile table; each Linear-2 epilogue stores its rows straight into
   the source ranks' symmetric Combine buffers.
4. Combine ends on the source rank with the top-k weighted sum of its ``[T * top_k, hidden]`` buffer,
   after a symmetric-memory barrier has made every peer's stores visible.

The unfused path users run instead: torch's grouped GEMMs (``torch._grouped_mm``,
``torch._scaled_grouped_mm``), SwiGLU, NCCL all-to-all back to the sources, weighted sum. ``reference_moe`` is the float32 torch reference.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

from ...kernel_sources import load_kernel_module
from ...platform import ALIGN_BYTES, check_mapped_host, symmetric_buffer
from .schedules import L1, L2, MoEProblem, Schedule, check_schedule, tile_table

SHAPES_PATH = Path(__file__).resolve().parents[3] / "data" / "moe_shapes.json"
PRECISIONS = ("bf16", "fp8")
ROUTINGS = ("balanced", "skewed")
E4M3_MAX = 448.0
FP8_SCALE_BLOCK = 128  # DeepSeek-style 1 x 128 activation and 128 x 128 weight scale blocks
# About seconds of polling on an H200, far above any legitimate wait (a whole call is milliseconds).
DEFAULT_MAX_SPIN_ITERS = 1 << 22
# Skewed routing: 1/16 of the experts are hot with this logit bias (6-14x the mean load at top-6..10).
HOT_EXPERT_FRACTION = 1 / 16
HOT_LOGIT_BIAS = 2.0


class MoEContractError(ValueError):
    """Bad input for the fused MoE path, raised before anything is launched."""


# ----------------------------------------------------------------------------------------- shapes

@dataclass(frozen=True)
class MoEShape:
    model: str
    variant: str
    hidden: int
    intermediate: int
    routed_experts: int
    top_k: int
    source: str


def load_shapes(path: Path = SHAPES_PATH) -> dict[str, MoEShape]:
    """The model shapes of ``data/moe_shapes.json``, keyed by model name."""
    doc = json.loads(Path(path).read_text())
    shapes = {}
    for m in doc["models"]:
        s = MoEShape(**m)
        for f in ("hidden", "intermediate", "routed_experts", "top_k"):
            if not isinstance(getattr(s, f), int) or getattr(s, f) < 1:
                raise ValueError(f"{path}: {s.model}.{f} must be a positive integer")
        shapes[s.model] = s
    return shapes


KERNELS = ("gluon_ws", "triton")
# gluon_ws (kernels/moe_fused_ws.py): what its partitioning fixes, and the shared memory of one
# CTA on an H100/H200 that the ring and the epilogues' layout conversions share.
WS_BLOCK_M = 128
WS_BLOCK_N1 = 128
WS_BLOCK_K = {"bf16": 64, "fp8": FP8_SCALE_BLOCK}
HOPPER_SMEM_PER_CTA = 227 * 1024


@dataclass(frozen=True)
class TileConfig:
    """Kernel and tile sizes. An L1 tile is ``block_m`` rows x ``block_n1`` intermediate columns
    (gate and up); an L2 tile is ``block_m`` rows x ``block_n2`` hidden columns. ``num_stages``
    is the depth of the K pipeline (gluon_ws: of its shared-memory ring); ``num_warps`` applies
    to the Triton kernel (gluon_ws has two consumer warpgroups and a producer warp)."""

    block_m: int = 64
    block_n1: int = 128
    block_n2: int = 128
    block_k: int = 64
    scale_block: int = FP8_SCALE_BLOCK
    num_warps: int = 8  # two 64 x 128 fp32 accumulators (gate, up) fit without spills at 8 warps
    num_stages: int = 3
    kernel: str = "triton"


def kernel_unsupported(kernel: str, device) -> str | None:
    """Why ``kernel`` cannot run on ``device``, or None where it can: gluon_ws issues wgmma and
    TMA (sm_90 instructions); the Triton kernel runs on any CUDA GPU and in the interpreter."""
    if kernel not in KERNELS:
        return f"kernel must be one of {KERNELS}, got {kernel!r}"
    device = torch.device(device)
    if kernel == "gluon_ws" and (device.type != "cuda"
                                 or torch.cuda.get_device_capability(device)[0] != 9):
        return (f"the gluon_ws MoE kernel needs an sm_90 (Hopper) GPU, not {device}: wgmma and "
                "TMA are sm_90 instructions; use kernel='triton' elsewhere")
    return None


def default_tile_config(precision: str, kernel: str | None = None, *, hidden: int | None = None,
                        device=None) -> TileConfig:
    """The tiles of ``kernel`` (default: gluon_ws where ``device`` is a Hopper GPU, else the Triton
    kernel). Triton, bf16: K blocks of 64 keep three pipeline stages of gate + up + A tiles in
    shared memory; fp8: K blocks equal the 128-wide scale block (one scale pair per K block).
    gluon_ws: 128-row tiles; Linear-2 tiles 256 columns wide where ``hidden`` allows it (in bf16
    one accumulator as large as Linear-1's gate and up, in fp8 two 128-column halves promoted as
    gate and up are: faster than 128-wide fp8 tiles in each of eight cells compared in one run
    on one H200, a development comparison kept in no record), else 128; the deepest ring that
    fits a CTA."""
    _check_precision(precision)
    if kernel is None:
        kernel = "triton" if device is None or kernel_unsupported("gluon_ws", device) else "gluon_ws"
    if kernel not in KERNELS:
        raise MoEContractError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "triton":
        return TileConfig() if precision == "bf16" else TileConfig(block_k=FP8_SCALE_BLOCK)
    wide = hidden is None or hidden % 256 == 0
    block_n2 = 256 if wide else 128
    stages = max(s for s in range(2, 5) if ws_shared_memory_bytes(
        precision, block_n2, WS_BLOCK_K[precision], s) <= HOPPER_SMEM_PER_CTA)
    return TileConfig(block_m=WS_BLOCK_M, block_n1=WS_BLOCK_N1, block_n2=block_n2,
                      block_k=WS_BLOCK_K[precision], num_warps=4, num_stages=stages,
                      kernel="gluon_ws")


def ws_shared_memory_bytes(precision: str, block_n2: int, block_k: int, stages: int) -> int:
    """Shared memory of a gluon_ws CTA: the ring (an A tile of 128 rows and a B tile of
    max(2 block_n1, block_n2) rows per stage), the epilogues' layout conversion (one 64-row half
    of the widest output tile: the compiler's scratch, shared by the partitions) and the ring's
    mbarriers with 64 bytes of alignment slack."""
    elem = 2 if precision == "bf16" else 1
    ring = stages * (WS_BLOCK_M + max(2 * WS_BLOCK_N1, block_n2)) * block_k * elem
    conversion = (WS_BLOCK_M // 2) * max(block_n2 * 2, WS_BLOCK_N1 * elem)
    return ring + conversion + 2 * stages * 8 + 64


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise MoEContractError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def check_tile_config(config: TileConfig, precision: str, hidden: int, intermediate: int) -> None:
    """Raise MoEContractError unless the shapes divide into the tiles (the kernel has no masks
    along N or K)."""
    _check_precision(precision)
    for name in ("block_m", "block_n1", "block_n2", "block_k"):
        v = getattr(config, name)
        if v < 16 or v & (v - 1):
            raise MoEContractError(f"{name}={v} must be a power of two >= 16 (tl.dot tiles)")
    for dim, dim_name, blocks in ((hidden, "hidden", ("block_k", "block_n2")),
                                  (intermediate, "intermediate", ("block_k", "block_n1"))):
        for b in blocks:
            if dim % getattr(config, b):
                raise MoEContractError(f"{dim_name}={dim} is not divisible by {b}="
                                       f"{getattr(config, b)}; pick another tile")
    if precision == "fp8":
        sb = config.scale_block
        if hidden % sb or intermediate % sb:
            raise MoEContractError(f"fp8 needs hidden={hidden} and intermediate={intermediate} "
                                   f"divisible by the scale block {sb}")
        if config.block_n1 != sb:
            raise MoEContractError(f"fp8 needs block_n1 == scale_block ({config.block_n1} != {sb}):"
                                   " the Linear-1 epilogue quantizes h one scale block per tile")
        if sb % config.block_k:
            raise MoEContractError(f"fp8 needs block_k={config.block_k} to divide scale_block={sb}")
    if config.kernel not in KERNELS:
        raise MoEContractError(f"kernel must be one of {KERNELS}, got {config.kernel!r}")
    if config.kernel == "gluon_ws":
        _check_ws_tiles(config, precision)


def _check_ws_tiles(config: TileConfig, precision: str) -> None:
    """The tile contract of kernels/moe_fused_ws.py: two 64-row consumer warpgroups, gate and up
    in one 256-row B stage, K blocks that are 128 bytes of a row (TMA's 128-byte swizzle; in
    fp8 one scale block), Linear-2 accumulators that fit a consumer's registers, a ring that fits
    a CTA's shared memory."""
    fixed = dict(block_m=WS_BLOCK_M, block_n1=WS_BLOCK_N1, block_k=WS_BLOCK_K[precision],
                 scale_block=FP8_SCALE_BLOCK)
    wrong = {k: getattr(config, k) for k, v in fixed.items() if getattr(config, k) != v}
    if wrong:
        raise MoEContractError(f"the gluon_ws kernel fixes {fixed} in {precision}, got {wrong}")
    widths = (128, 256)
    if config.block_n2 not in widths:
        raise MoEContractError(f"gluon_ws block_n2 must be one of {widths} in {precision} (its "
                               f"accumulator's registers), got {config.block_n2}")
    smem = ws_shared_memory_bytes(precision, config.block_n2, config.block_k, config.num_stages)
    if config.num_stages < 2 or smem > HOPPER_SMEM_PER_CTA:
        raise MoEContractError(f"gluon_ws needs 2 or more stages within {HOPPER_SMEM_PER_CTA} B "
                               f"of shared memory; {config.num_stages} stages take {smem} B")


# ---------------------------------------------------------------------------------------- routing

def _generator(seed: int, device) -> torch.Generator:
    return torch.Generator(device=torch.device(device)).manual_seed(int(seed))


def hot_experts(num_experts: int, seed: int) -> torch.Tensor:
    """The seeded hot experts of skewed routing; identical on every rank (seed only)."""
    count = max(1, round(num_experts * HOT_EXPERT_FRACTION))
    return torch.randperm(num_experts, generator=_generator(seed, "cpu"))[:count]


def router_logits(num_tokens: int, num_experts: int, routing: str, *, seed: int, rank: int = 0,
                  device="cpu") -> torch.Tensor:
    """float32 ``[num_tokens, num_experts]`` logits of one rank's tokens (fresh per rank)."""
    if routing not in ROUTINGS:
        raise MoEContractError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    g = _generator(seed * 7919 + rank + 1, device)
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


# ---------------------------------------------------------------------------------------- weights

def quantize_rows_fp8(x: torch.Tensor, block: int = FP8_SCALE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """1 x ``block`` e4m3 quantization of ``[..., K]``: values and fp32 scales ``[..., K / block]``."""
    *lead, k = x.shape
    xf = x.float().reshape(*lead, k // block, block)
    scale = xf.abs().amax(-1).clamp_min(1e-12) / E4M3_MAX
    q = (xf / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(*lead, k), scale


def dequantize_rows_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(q.shape[-1] // scale.shape[-1], dim=-1)


def quantize_blocks_fp8(w: torch.Tensor, block: int = FP8_SCALE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``block`` x ``block`` e4m3 quantization of ``[..., N, K]``: scales ``[..., N/block, K/block]``."""
    *lead, n, k = w.shape
    wf = w.float().reshape(*lead, n // block, block, k // block, block)
    scale = wf.abs().amax(dim=(-3, -1)).clamp_min(1e-12) / E4M3_MAX
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
    g = _generator(seed * 1_000_003 + expert, device)
    h, i = shape.hidden, shape.intermediate
    w1 = (torch.randn(2 * i, h, generator=g, device=device) * h ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(h, i, generator=g, device=device) * i ** -0.5).to(torch.bfloat16)
    return w1, w2


class _ExpertShapes:
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
class ExpertWeights(_ExpertShapes):
    """The local experts of one rank, in the kernel's layout (see ``kernels/moe_fused.py``)."""

    precision: str
    w1: torch.Tensor                     # [E_loc, 2I, H] bf16 or e4m3
    w2: torch.Tensor                     # [E_loc, H, I]
    w1_scale: torch.Tensor | None = None  # [E_loc, 2I/128, H/128] fp32 (fp8 only)
    w2_scale: torch.Tensor | None = None  # [E_loc, H/128, I/128]


def check_expert_parallel(num_experts: int, world: int) -> int:
    """Experts per rank; raises unless P divides the routed experts."""
    if world < 1 or num_experts % world:
        raise MoEContractError(f"P={world} ranks must divide the {num_experts} routed experts")
    return num_experts // world


def local_expert_weights(shape: MoEShape, rank: int, world: int, precision: str, *, seed: int,
                         device="cpu", scale_block: int = FP8_SCALE_BLOCK) -> ExpertWeights:
    """Experts ``rank * E_loc .. (rank + 1) * E_loc - 1`` (contiguous placement), quantized per
    128 x 128 block for fp8."""
    _check_precision(precision)
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


# --------------------------------------------------------------------------------------- dispatch

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


def combine_weighted_sum(combine_rows: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The end of Combine on the source rank: ``out[t] = sum_j w[t, j] * rows[t * k + j]`` in fp32."""
    t, k = topk_weights.shape
    rows = combine_rows[: t * k].view(t, k, -1).float()
    return (rows * topk_weights[..., None].float()).sum(dim=1).to(torch.bfloat16)


# -------------------------------------------------------------------------------- Combine buffers

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


# ------------------------------------------------------------------------------------ fused path

TRACE_FIELDS = 10  # kernels/moe_fused.py: clock64 x 4, globaltimer x 4, smid, spins per tile
# kernel name -> (kernels/ module, entry point)
KERNEL_ENTRIES = {"triton": ("moe_fused", "fused_moe_kernel"),
                  "gluon_ws": ("moe_fused_ws", "moe_fused_ws_kernel")}


@dataclass
class FusedMoECall:
    """A prepared launch of the fused kernel for one schedule; calling it zeroes the row counters
    (and, instrumented, poisons the trace with -1) and launches. ``error_count()`` reads the
    spin-timeout flag (synchronizes). ``trace`` is int64 ``[programs, max_tiles, TRACE_FIELDS]``
    for an instrumented call (see ``kernels/moe_fused.py``), else None."""

    schedule: Schedule
    args: tuple
    constexprs: dict
    grid: tuple[int]
    row_ready: torch.Tensor
    error: torch.Tensor
    trace: torch.Tensor | None = None
    kernel: str = "triton"
    synthetic_k_fraction: float | None = None  # not the MoE layer where set (knee sweep)
    owners: tuple = ()  # the Combine buffers its peer table points into (CombinePeers.owners)

    def __call__(self) -> None:
        self.row_ready.zero_()
        if self.trace is not None:
            self.trace.fill_(-1)
        module, entry = KERNEL_ENTRIES[self.kernel]
        getattr(load_kernel_module(module), entry)[self.grid](*self.args, **self.constexprs)

    def error_count(self) -> int:
        return int(self.error.item())


def _expect(t: torch.Tensor | None, name: str, shape: tuple, dtype: torch.dtype, device) -> None:
    if t is None:
        raise MoEContractError(f"{name} is required")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise MoEContractError(f"{name} must be {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    if t.device != device or not t.is_contiguous():
        raise MoEContractError(f"{name} must be contiguous on {device}")


def _check_table_bounds(table: np.ndarray, counts: np.ndarray, problem: MoEProblem,
                        num_experts: int) -> None:
    """Every used entry names a tile kind, a local expert, a row and an N tile that exist (also
    for schedules launched without ``check_schedule``): the kernel indexes memory with them."""
    used = np.concatenate([table[g, :c] for g, c in enumerate(counts)] + [np.zeros((0, 4), np.int32)])
    kind, expert, row, n = used.T
    n_limit = np.where(kind == L1, problem.l1_n_blocks, problem.l2_n_blocks)
    if (~np.isin(kind, (L1, L2))).any() or ((expert < 0) | (expert >= num_experts)).any() or \
            ((row < 0) | (row >= problem.num_rows)).any() or ((n < 0) | (n >= n_limit)).any():
        raise MoEContractError("tile table entry outside the layout's experts, rows or N tiles")
    rows_expert = np.asarray(problem.row_expert, dtype=np.int64)
    if len(row) and (rows_expert[row] != expert).any():
        raise MoEContractError("tile table entry names an expert that does not own its row")


def prepare_fused_moe(layout: DispatchLayout, weights: ExpertWeights, schedule: Schedule,
                      peers: CombinePeers, *, config: TileConfig,
                      max_spin_iters: int = DEFAULT_MAX_SPIN_ITERS,
                      verify_schedule: bool = True, instrument: bool = False,
                      fence: bool = False,
                      synthetic_k_fraction: float | None = None) -> FusedMoECall:
    """Check the contract of the fused kernel and build its launch; nothing runs on the device.

    Contract: ``weights`` in the kernel layout for ``weights.precision``; ``layout`` from the same
    ``block_m``; every shape divisible by its tile (``check_tile_config``); a peer table of P
    mapped bf16 ``[slots >= max slot + 1, hidden]`` buffers, P covering every ``row_src``; a
    schedule over exactly this layout's tiles (``check_schedule``: each tile once, dependencies,
    lead D, no deadlock with all programs resident) with at most one program per SM (persistent
    programs must all be resident). ``verify_schedule=False`` skips only the schedule rules (the
    bounded-spin test launches a deliberately unsatisfiable schedule). ``instrument``: per-tile
    stamps into ``FusedMoECall.trace``; ``fence``: every Linear-2 tile waits until its Combine
    stores are visible system-wide (the completion-coupled variant). Both leave the results
    unchanged. ``synthetic_k_fraction`` (gluon_ws only; the X-Stage knee sweep, never the MoE
    layer): every mainloop runs only that fraction of its K blocks (``synthetic_k_blocks``) while
    every Combine store is kept; the result is the layer over those K blocks."""
    precision, device = weights.precision, weights.w1.device
    e_loc, hidden, inter = weights.num_experts, weights.hidden, weights.intermediate
    check_tile_config(config, precision, hidden, inter)
    wdt = torch.bfloat16 if precision == "bf16" else torch.float8_e4m3fn
    _expect(weights.w1, "w1", (e_loc, 2 * inter, hidden), wdt, device)
    _expect(weights.w2, "w2", (e_loc, hidden, inter), wdt, device)
    if precision == "fp8":
        sb = config.scale_block
        _expect(weights.w1_scale, "w1_scale", (e_loc, 2 * inter // sb, hidden // sb), torch.float32, device)
        _expect(weights.w2_scale, "w2_scale", (e_loc, hidden // sb, inter // sb), torch.float32, device)
    if layout.block_m != config.block_m:
        raise MoEContractError(f"layout padded to block_m={layout.block_m}, tiles use {config.block_m}")
    if len(layout.tokens_per_expert) != e_loc:
        raise MoEContractError(f"layout has {len(layout.tokens_per_expert)} experts, weights {e_loc}")
    rows = layout.num_rows
    if rows != config.block_m * sum(layout.blocks_per_expert):
        raise MoEContractError(f"layout rows {rows} != block_m * row blocks")
    _expect(layout.x, "x", (rows, hidden), wdt, device)
    if precision == "fp8":
        _expect(layout.x_scale, "x_scale", (rows, hidden // config.scale_block), torch.float32, device)
    _expect(layout.row_src, "row_src", (rows,), torch.int32, device)
    _expect(layout.row_slot, "row_slot", (rows,), torch.int32, device)
    if peers.world != len(layout.recv_counts):
        raise MoEContractError(f"peer table has {peers.world} ranks, Dispatch had {len(layout.recv_counts)}")
    if peers.hidden != hidden or peers.slots <= layout.max_slot:
        raise MoEContractError(f"Combine buffers [{peers.slots}, {peers.hidden}] cannot take slot "
                               f"{layout.max_slot} of hidden {hidden}")
    if peers.table.device != device:
        raise MoEContractError(f"peer table on {peers.table.device}, kernel on {device}")
    problem = MoEProblem(layout.blocks_per_expert, inter // config.block_n1, hidden // config.block_n2)
    if verify_schedule:
        check_schedule(problem, schedule)
    table, counts = tile_table(schedule)
    _check_table_bounds(table, counts, problem, e_loc)
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if schedule.num_programs > sms:
            raise MoEContractError(f"{schedule.num_programs} persistent programs exceed the {sms} SMs:"
                                   " waiting programs could keep later ones from ever starting")
    if max_spin_iters < 1:
        raise MoEContractError("max_spin_iters must be >= 1")
    k_blocks = synthetic_k_blocks(synthetic_k_fraction, config, hidden, inter)
    if config.kernel == "gluon_ws":
        reason = kernel_unsupported("gluon_ws", device)
        if reason:
            raise MoEContractError(reason)
        for name, t in (("x", layout.x), ("w1", weights.w1), ("w2", weights.w2)):
            if t.data_ptr() % ALIGN_BYTES:
                raise MoEContractError(f"{name} must start {ALIGN_BYTES}-byte aligned (TMA)")
    h = torch.empty(rows, inter, dtype=wdt, device=device)
    h_scale = (torch.empty(rows, inter // config.scale_block, dtype=torch.float32, device=device)
               if precision == "fp8" else None)
    row_ready = torch.zeros(max(1, problem.num_rows), dtype=torch.int32, device=device)
    error = torch.zeros(1, dtype=torch.int32, device=device)
    tiles = torch.from_numpy(table).to(device)
    if config.kernel == "gluon_ws":
        return _prepare_ws_call(layout, weights, schedule, peers, config, table, counts, tiles, h,
                                h_scale, row_ready, error, max_spin_iters, instrument, fence,
                                k_blocks, synthetic_k_fraction)
    # Uninstrumented, the kernel never touches the trace: one element stands in for the pointer.
    trace = torch.full((*table.shape[:2], TRACE_FIELDS) if instrument else (1,), -1,
                       dtype=torch.int64, device=device)
    args = (tiles, torch.from_numpy(counts).to(device), table.shape[1],
            layout.x, layout.x_scale, weights.w1, weights.w1_scale, weights.w2, weights.w2_scale,
            h, h_scale, row_ready, layout.row_src, layout.row_slot, peers.table,
            error, max_spin_iters, trace, hidden, inter)
    constexprs = dict(FP8=precision == "fp8", BLOCK_M=config.block_m, BLOCK_N1=config.block_n1,
                      BLOCK_N2=config.block_n2, BLOCK_K=config.block_k,
                      SCALE_BLOCK=config.scale_block, INSTRUMENT=bool(instrument),
                      FENCE=bool(fence), num_warps=config.num_warps,
                      num_stages=config.num_stages)
    return FusedMoECall(schedule, args, constexprs, (schedule.num_programs,), row_ready, error,
                        trace if instrument else None, owners=peers.owners)


def synthetic_k_blocks(fraction: float | None, config: TileConfig, hidden: int,
                       intermediate: int) -> tuple[int, int]:
    """The K blocks a Linear-1 and a Linear-2 mainloop run: all of them for the MoE layer
    (``fraction`` None), else ``ceil(fraction · blocks)`` of each, at least one (a synthetic
    kernel, gluon_ws only)."""
    full = (hidden // config.block_k, intermediate // config.block_k)
    if fraction is None:
        return full
    if config.kernel != "gluon_ws":
        raise MoEContractError("a synthetic K fraction needs the gluon_ws kernel")
    if not 0 < fraction <= 1:
        raise MoEContractError(f"synthetic_k_fraction must lie in (0, 1], got {fraction}")
    return tuple(max(1, math.ceil(fraction * n)) for n in full)


def _ws_descriptor(t: torch.Tensor, block: list[int]) -> GluonTensorDescriptor:
    """A TMA descriptor over the row-major 2-D ``t`` with ``block`` tiles, 128-byte swizzled."""
    dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float8e4nv
    return GluonTensorDescriptor(t, list(t.shape), [t.shape[1], 1], block,
                                 gl.NVMMASharedLayout.get_default_for(block, dtype))


def _prepare_ws_call(layout, weights, schedule, peers, config, table, counts, tiles, h, h_scale,
                     row_ready, error, max_spin_iters, instrument, fence, k_blocks,
                     synthetic_k_fraction) -> FusedMoECall:
    """The launch of kernels/moe_fused_ws.py (contract checked by ``prepare_fused_moe``)."""
    e_loc, hidden, inter = weights.num_experts, weights.hidden, weights.intermediate
    half, bk = config.block_m // 2, config.block_k
    fp8 = weights.precision == "fp8"
    unused = error  # bf16 launches read no scales: any pointer stands in
    args = (tiles, torch.from_numpy(counts).to(tiles.device), table.shape[1],
            _ws_descriptor(layout.x, [half, bk]),
            _ws_descriptor(weights.w1.view(e_loc * 2 * inter, hidden), [config.block_n1, bk]),
            _ws_descriptor(h, [half, bk]),
            _ws_descriptor(weights.w2.view(e_loc * hidden, inter), [config.block_n2, bk]),
            layout.x_scale if fp8 else unused, weights.w1_scale if fp8 else unused,
            weights.w2_scale if fp8 else unused, h, h_scale if fp8 else unused, row_ready,
            layout.row_src, layout.row_slot, peers.table, error, max_spin_iters)
    # Uninstrumented, the kernel never touches the trace: one element stands in for the pointer.
    trace = torch.full((*table.shape[:2], TRACE_FIELDS) if instrument else (1,), -1,
                       dtype=torch.int64, device=tiles.device)
    constexprs = dict(FP8=fp8, BLOCK_N1=config.block_n1, BLOCK_N2=config.block_n2, BLOCK_K=bk,
                      STAGES=config.num_stages, INSTRUMENT=bool(instrument), FENCE=bool(fence),
                      num_warps=4)
    return FusedMoECall(schedule, (*args, trace, hidden, inter, *k_blocks), constexprs,
                        (schedule.num_programs,), row_ready, error,
                        trace if instrument else None, kernel="gluon_ws",
                        synthetic_k_fraction=synthetic_k_fraction, owners=peers.owners)


# ---------------------------------------------------------------------------------- unfused path

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


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass
class GroupedWeights(_ExpertShapes):
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
    _check_precision(precision)
    return (x, None) if precision == "bf16" else _quantize_rowwise(x)


def unfused_expert_weights(shape: MoEShape, rank: int, world: int, precision: str, *, seed: int,
                           device="cpu") -> GroupedWeights:
    """Experts ``rank * E_loc .. (rank + 1) * E_loc - 1`` from the same bf16 master weights as the
    fused kernel's (``expert_master_weights``); fp8 quantized per output column."""
    _check_precision(precision)
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
    g = _generator(0, device)
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
    _check_precision(precision)
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
    h = _swiglu(_grouped_linear(layout.x, layout.x_scale, weights.w1, weights.w1_scale, offs))
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


# ------------------------------------------------------------------------------------- reference

def expert_rows_reference(x: torch.Tensor, experts: torch.Tensor, shape: MoEShape, *, seed: int,
                          precision: str, scale_block: int = FP8_SCALE_BLOCK
                          ) -> dict[str, torch.Tensor]:
    """float32 output of each row's expert, before routing weights: row i is expert
    ``experts[i]`` (global id) applied to the bf16 row ``x[i]``, with the expert regenerated from
    its seed (``expert_master_weights``) on ``x``'s device.

    ``"fp32"``: bf16 inputs and master weights in float32. For fp8 also ``"fp8_emulated"``: the
    same with the fused kernel's W8A8 quantization emulated (x per 1 x 128, weights per
    128 x 128, h re-quantized per 1 x 128), which isolates the kernel's own error."""
    _check_precision(precision)
    out = {"fp32": torch.zeros(x.shape[0], shape.hidden, dtype=torch.float32, device=x.device)}
    if precision == "fp8":
        out["fp8_emulated"] = torch.zeros_like(out["fp32"])
        xq = dequantize_rows_fp8(*quantize_rows_fp8(x, scale_block))
    xf = x.float()
    for e in torch.unique(experts).tolist():
        rows = (experts == e).nonzero(as_tuple=True)[0]
        w1, w2 = expert_master_weights(shape, e, seed=seed, device=x.device)
        out["fp32"][rows] = _swiglu(xf[rows] @ w1.float().t()) @ w2.float().t()
        if precision == "fp8":
            w1q = dequantize_blocks_fp8(*quantize_blocks_fp8(w1, scale_block))
            w2q = dequantize_blocks_fp8(*quantize_blocks_fp8(w2, scale_block))
            h = _swiglu(xq[rows] @ w1q.t())
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
