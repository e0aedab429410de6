"""Tile configurations of the two fused MoE kernels and their contract: ``kernels/moe_fused_ws.py``
(Gluon, warp-specialized, sm_90) and ``kernels/moe_fused.py`` (Triton, any GPU and the
interpreter)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernel_sources import load_kernel_module
from .shapes import FP8_SCALE_BLOCK, MoEContractError, check_precision, check_scale_blocks

KERNELS = ("gluon_ws", "triton")
# gluon_ws (kernels/moe_fused_ws.py): the rows of a tile and its Linear-1 columns that its
# partitioning allows (``WS_ROW_TILES``: 128 rows, one 64-row half a consumer warpgroup; 256 rows,
# bf16 only, one 128-row half a consumer over half the columns, so each weight block a CTA reads
# serves twice the rows in the same accumulator registers), and the shared memory of one CTA on
# an H100/H200 that the ring and the epilogues' layout conversions share.
WS_BLOCK_M = 128
WS_ROW_TILES = {128: dict(block_n1=128, precisions=("bf16", "fp8")),
                256: dict(block_n1=64, precisions=("bf16",))}
WS_BLOCK_K = {"bf16": 64, "fp8": FP8_SCALE_BLOCK}
HOPPER_SMEM_PER_CTA = 227 * 1024
# the routed rows an expert holds on average where ``ws_tile_rows`` takes 256-row tiles: where the
# 128-row kernel's Linear-2 tiles are 256 columns wide (``ws_wide_l2``), and where they are 128
# (from this many rows on, no bound above)
WS_TALL_ROWS_PER_EXPERT = (128, 1024)
WS_TALL_NARROW_ROWS_PER_EXPERT = 1025
WS_WIDE_L2 = 256  # Linear-2 columns of a 128-row tile where the hidden size is a multiple of it
WS_MAX_STAGES = 8  # the deepest ring default_tile_config tries (what fits a CTA is fewer)


@dataclass(frozen=True)
class TileConfig:
    """Kernel and tile sizes. An L1 tile is ``block_m`` rows x ``block_n1`` intermediate columns
    (gate and up); an L2 tile is ``block_m`` rows x ``block_n2`` hidden columns. ``num_stages``
    is the depth of the K pipeline (gluon_ws: of its shared-memory ring); ``num_warps`` applies
    to the Triton kernel (gluon_ws has two consumer warpgroups and a producer warp).
    ``a_halves`` (gluon_ws): the A tile halves a stage of the ring holds, 2, or 1 (the kernel's
    ``ONE_HALF`` build) where no expert's routed rows reach a tile's second half, which leaves
    room for a deeper ring (``default_tile_config``'s ``expert_rows``)."""

    block_m: int = 64
    block_n1: int = 128
    block_n2: int = 128
    block_k: int = 64
    scale_block: int = FP8_SCALE_BLOCK
    num_warps: int = 8  # two 64 x 128 fp32 accumulators (gate, up) fit without spills at 8 warps
    num_stages: int = 3
    kernel: str = "triton"
    a_halves: int = 2


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


def kernel_device(device, kernel: str, who: str) -> torch.device:
    """``device`` where given (the CPU tests'), else this process's CUDA GPU, checked to run
    ``kernel``, with float32 matrix products that are float32 (the reference), not TF32."""
    if device is not None:
        return torch.device(device)
    if not torch.cuda.is_available():
        raise SystemExit(f"{who} needs a CUDA GPU")
    on = torch.device("cuda", torch.cuda.current_device())
    why = kernel_unsupported(kernel, on)
    if why:
        raise SystemExit(why)
    torch.backends.cuda.matmul.allow_tf32 = False
    return on


def ws_wide_l2(hidden: int | None) -> bool:
    """Whether the 128-row gluon_ws kernel's Linear-2 tiles are ``WS_WIDE_L2`` columns wide: where
    ``hidden`` (None: not known) is a multiple of it; else 128, as every 256-row kernel's."""
    return hidden is None or hidden % WS_WIDE_L2 == 0


def ws_tile_rows(precision: str, rows_per_expert: float | None,
                 hidden: int | None = None) -> int:
    """The rows of the gluon_ws kernel's tiles for experts of ``rows_per_expert`` routed rows on
    average (None: not known) and a hidden size ``hidden`` (None: not known): 256 in bf16 from one
    full 128-row block an expert to eight (``WS_TALL_ROWS_PER_EXPERT``) where the 128-row
    kernel's Linear-2 tiles are 256 wide (``ws_wide_l2``), from more than eight
    (``WS_TALL_NARROW_ROWS_PER_EXPERT``) where they are 128 wide; else 128.

    Each row block of an expert streams the expert's weights, and the L2 cache keeps little of
    them for its next row block (``data/records/moe_ncu/README.md``): there the kernel runs at
    the bytes it reads. One ab job on one H100 (tiles of 128, 256, 128 rows; moe_layer/
    h100-80gb-hbm3-x1/…162309Z against …162411Z and …162503Z, retired), bf16, the kernel alone
    at 256 rows over 128: DeepSeek-V4-Flash at EP = 1 0.98x at 96 rows an expert and 0.65x at
    192, MiMo-V2.5 0.77x at 128 and 0.74x at 256; on the EP = 8 rank 0.84x at 768 and 0.93x at
    1024, 1.02x and 1.01x at 1536 and 2048, where an expert's many row blocks run side by side
    and share its weights in the L2 cache. At one and 64 tokens (DiT-MoE, Qwen3.5, both
    settings: a few rows an expert) 256-row tiles took 1.03-1.32x the time of the 128-row
    kernel's records of the same cells (…162612Z against …151021Z, …151355Z and …150538Z: not one
    job; all four retired, the last three's bytes at 93a4e5d). Every bf16 cell of 4096 and 8192
    tokens at EP = 1 and of 512 to 8192 on the rank at these defaults (…163145Z, …163356Z)
    against the 128-row records of the same cells (…151756Z, …150538Z, …150811Z: not one job;
    all five retired, …150538Z's bytes at 93a4e5d, the others' at 0112955):
    where the tiles are 256 rows the kernel took 0.65-1.00x the time in 18 cells, 1.06-1.14x in
    three (DiT-MoE at EP = 1 at 4096 tokens and on the rank at 512, 512 rows an expert; Qwen3.5
    on the rank at 4096, 640), where they stay 128 rows (the same kernel) 1.00-1.07x. In one ab
    job at c5c2e5c (…170605Z to …170755Z, retired; DiT-MoE and Qwen3.5 from 512 to 8192 tokens)
    those three took 1.04x, 1.12x and 1.04x at 256 rows, and DiT-MoE on the rank at 4096 and
    8192 tokens (4096 and 8192 rows an expert) 0.92x. Since then Linear-1's gate and up share one
    wgmma at 256 rows (``kernels/moe_fused_ws.py``: 0.964-1.015x the kernel's time, geometric
    mean 0.985).

    DiT-MoE is the one shape whose hidden size (1408) is not a multiple of 256, so its 128-row
    kernel has 128-wide Linear-2 tiles: a K step's 128 x 128 x 64 products over 32 KiB of A and
    B, three quarters of the others' 128 x 256 x 64 over 48 KiB, which its 256-row tiles (256 x
    128) restore. In one ab job on one H200 at e29796f (tiles of 128, 256, 128 rows; moe_layer/
    h200-x1/…181627Z against …181704Z and …181736Z, retired), bf16, the kernel alone at 256 rows
    over 128: DiT-MoE at EP = 1 1.214x at 512 rows an expert and 1.047x at 1024, on the EP = 8
    rank 0.925x at 4096 and 0.940x at 8192, as the H100 had measured (1.04x, 0.98x, 0.92x,
    0.92x; and 1.12x on the rank at 512; at de81fd5 1.048x at 512 rows, h100-80gb-hbm3-x1/
    …182316Z against …182337Z and …182354Z, retired); Qwen3.5 1.103x at 80 rows, 0.874x at 160,
    1.009x at 640 and 1.035x at 1280. So DiT-MoE's tiles are 256 rows only above eight row
    blocks an expert."""
    if precision != "bf16" or rows_per_expert is None:
        return WS_BLOCK_M
    if ws_wide_l2(hidden):
        low, high = WS_TALL_ROWS_PER_EXPERT
        return 256 if low <= rows_per_expert <= high else WS_BLOCK_M
    return 256 if rows_per_expert >= WS_TALL_NARROW_ROWS_PER_EXPERT else WS_BLOCK_M


def default_tile_config(precision: str, kernel: str | None = None, *, hidden: int | None = None,
                        device=None, block_m: int = WS_BLOCK_M,
                        expert_rows: int | None = None) -> TileConfig:
    """The tiles of ``kernel`` (default: gluon_ws where ``device`` is a Hopper GPU, else the Triton
    kernel). Triton, bf16: K blocks of 64 keep three pipeline stages of gate + up + A tiles in
    shared memory; fp8: K blocks equal the 128-wide scale block (one scale pair per K block).
    gluon_ws: 128-row tiles; Linear-2 tiles 256 columns wide where ``hidden`` allows it (in bf16
    one accumulator as large as Linear-1's gate and up, in fp8 two 128-column halves promoted as
    gate and up are: faster than 128-wide fp8 tiles in each of eight cells compared in one run
    on one H200, a development comparison kept in no record), else 128; the deepest ring that
    fits a CTA (at one token on one H100, the fastest of 2-4 stages or within 4% of it in 16
    cells: moe_ring_probe/h100-80gb-hbm3-x1/20261206T101902Z-af1a2135ca). Where
    ``expert_rows``, the most routed rows an expert can hold in a call, stays within a tile's
    first half, and a ring of one A half a stage fits deeper, that ring (``a_halves`` 1), in
    bf16: there the probe found a one-token Linear-1 stream capped by the ring (DiT-MoE on the
    EP rank), where fp8's did not follow the ring's depth (and its 5-stage build spilled: 12
    bytes stored and 8 reloaded, split 28 and 52; sm_90, Triton 3.6). ``block_m`` (gluon_ws):
    its tile rows, one of ``WS_ROW_TILES`` (256: Linear-1 tiles of 64 columns, Linear-2 tiles of
    128)."""
    check_precision(precision)
    if kernel is None:
        kernel = "triton" if device is None or kernel_unsupported("gluon_ws", device) else "gluon_ws"
    if kernel not in KERNELS:
        raise MoEContractError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "triton":
        return TileConfig() if precision == "bf16" else TileConfig(block_k=FP8_SCALE_BLOCK)
    block_n1 = _ws_rows(block_m, precision)["block_n1"]
    wide = block_m == WS_BLOCK_M and ws_wide_l2(hidden)
    block_n2 = WS_WIDE_L2 if wide else 128
    def deepest(a_halves: int) -> int:
        return max(s for s in range(2, WS_MAX_STAGES + 1) if ws_shared_memory_bytes(
            precision, block_m, block_n1, block_n2, WS_BLOCK_K[precision], s,
            a_halves) <= HOPPER_SMEM_PER_CTA)

    a_halves, stages = 2, deepest(2)
    # 128-row tiles only: the layer takes 256 where experts hold 128 rows or more on average
    if (precision == "bf16" and block_m == WS_BLOCK_M and expert_rows is not None
            and expert_rows <= block_m // 2 and deepest(1) > stages):
        a_halves, stages = 1, deepest(1)
    return TileConfig(block_m=block_m, block_n1=block_n1, block_n2=block_n2,
                      block_k=WS_BLOCK_K[precision], num_warps=4, num_stages=stages,
                      kernel="gluon_ws", a_halves=a_halves)


def ws_shared_memory_bytes(precision: str, block_m: int, block_n1: int, block_n2: int,
                           block_k: int, stages: int, a_halves: int = 2) -> int:
    """Shared memory of a gluon_ws CTA: the ring (``a_halves`` halves of an A tile of
    ``block_m`` rows and a B tile of max(2 block_n1, block_n2) rows per stage), the epilogues'
    layout conversion (one half of the widest output tile: the compiler's scratch, shared by
    the partitions), the ring's mbarriers with 64 bytes of alignment slack, and the weighted
    sum's control block (where the build ends with the sum: ``SUM_CONTROL`` int64 slots)."""
    elem = 2 if precision == "bf16" else 1
    ring = stages * (block_m * a_halves // 2 + max(2 * block_n1, block_n2)) * block_k * elem
    conversion = (block_m // 2) * max(block_n2 * 2, block_n1 * elem)
    sum_control = 8 * load_kernel_module("moe_fused_ws").SUM_CONTROL.value
    return ring + conversion + 2 * stages * 8 + 64 + sum_control


def check_tile_config(config: TileConfig, precision: str, hidden: int, intermediate: int) -> None:
    """Raise MoEContractError unless the shapes divide into the tiles (the kernel has no masks
    along N or K)."""
    check_precision(precision)
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
        check_scale_blocks(hidden, intermediate, sb)
        if config.block_n1 != sb:
            raise MoEContractError(f"fp8 needs block_n1 == scale_block ({config.block_n1} != {sb}):"
                                   " the Linear-1 epilogue quantizes h one scale block per tile")
        if sb % config.block_k:
            raise MoEContractError(f"fp8 needs block_k={config.block_k} to divide scale_block={sb}")
    if config.kernel not in KERNELS:
        raise MoEContractError(f"kernel must be one of {KERNELS}, got {config.kernel!r}")
    if config.kernel == "gluon_ws":
        _check_ws_tiles(config, precision)
    elif config.a_halves != 2:
        raise MoEContractError("a ring of one A half a stage (a_halves=1) is the gluon_ws "
                               "kernel's; the Triton kernel's tiles are whole")


def _ws_rows(block_m: int, precision: str) -> dict:
    """``WS_ROW_TILES``' entry for tiles of ``block_m`` rows in ``precision``; MoEContractError
    where the kernel has none."""
    rows = WS_ROW_TILES.get(block_m)
    if rows is None or precision not in rows["precisions"]:
        raise MoEContractError(f"gluon_ws tiles of block_m={block_m} rows in {precision} are not "
                               f"one of {WS_ROW_TILES}")
    return rows


def _check_ws_tiles(config: TileConfig, precision: str) -> None:
    """The tile contract of kernels/moe_fused_ws.py: two consumer warpgroups, one half of the rows
    each, with the Linear-1 width of their rows (``WS_ROW_TILES``), gate and up in one B stage,
    K blocks that are 128 bytes of a row (TMA's 128-byte swizzle; in fp8 one scale block),
    Linear-2 accumulators that fit a consumer's registers (128 x 128 fp32 at 256 rows), a ring
    that fits a CTA's shared memory."""
    rows = _ws_rows(config.block_m, precision)
    fixed = dict(block_n1=rows["block_n1"], block_k=WS_BLOCK_K[precision],
                 scale_block=FP8_SCALE_BLOCK)
    wrong = {k: getattr(config, k) for k, v in fixed.items() if getattr(config, k) != v}
    if wrong:
        raise MoEContractError(f"the gluon_ws kernel fixes {fixed} at {config.block_m} rows in "
                               f"{precision}, got {wrong}")
    widths = (128, 256) if config.block_m == WS_BLOCK_M else (128,)
    if config.block_n2 not in widths:
        raise MoEContractError(f"gluon_ws block_n2 must be one of {widths} at {config.block_m} "
                               f"rows in {precision} (its accumulator's registers), got "
                               f"{config.block_n2}")
    if config.a_halves not in (1, 2):
        raise MoEContractError(f"gluon_ws stages hold 1 or 2 A tile halves, got {config.a_halves}")
    smem = ws_shared_memory_bytes(precision, config.block_m, config.block_n1, config.block_n2,
                                  config.block_k, config.num_stages, config.a_halves)
    if config.num_stages < 2 or smem > HOPPER_SMEM_PER_CTA:
        raise MoEContractError(f"gluon_ws needs 2 or more stages within {HOPPER_SMEM_PER_CTA} B "
                               f"of shared memory; {config.num_stages} stages take {smem} B")
