"""Ulysses attention fused with its post-attention All-to-All through remote stores (paper §4.3, §5.3).

Ulysses layout (§4.3, Fig. 5). P ranks, H heads, head dim d, M tokens:
  before attention, rank r holds q, k, v  [M, H/P, d] bf16: all tokens, heads [r*H/P, (r+1)*H/P);
  after the All-to-All, rank j holds      [M/P, H, d] bf16: tokens [j*M/P, (j+1)*M/P), all heads,
  with head index r*H/P + h for local head h of rank r. ``ulysses_gather`` states this mapping.

Paths, all producing the same [M/P, H, d] result on every rank:
  ``flash_attention``      the FlashAttention forward (FA-only), output [M, H/P, d] locally;
  ``fused_attention_a2a``  X-Stage-Fused: the same kernel, each output tile stored into its owning
                           rank's symmetric buffer at the tile boundary (Fig. 7);
  Serial                   ``flash_attention`` then ``nccl_a2a`` (NCCL ``all_to_all_single``);
  ``remote_store_a2a``     the All-to-All alone by remote stores, after any attention backend;
  ``sdpa_nccl``            what users run today: torch SDPA (cuDNN backend) then NCCL.
Remote stores are not awaited by the kernels: the consumer completes them with one barrier per
launch (``ReceiveBuffer.barrier``), as the paper's sender-side boundary assumes (§5.1).

Device code: ``kernels/flash_attention.py`` (Triton) and ``kernels/flash_attention_ws.py`` (Gluon,
warp-specialized, sm_90); a configuration's ``kernel`` names the one that runs.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.runtime.interpreter import InterpretedFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from ..kernel_sources import load_kernel_module
from ..platform import ALIGN_BYTES, SymmetricBuffer, symmetric_buffer

_kernels = load_kernel_module("flash_attention")
_ws_kernels = load_kernel_module("flash_attention_ws")

DTYPE = torch.bfloat16
HEAD_DIMS = (64, 128)
LOG2E = 1.4426950408889634
# The output stores' cache operators: write-back, or streaming (PTX st.cs: lines allocated
# evict-first, so output tiles leave the K and V tiles in L2).
OUTPUT_CACHES = ("", ".cs")
# What ``config["kernel"]`` selects: "triton" (any power-of-two tiles, persistent grids, the
# pipelined Q-loop; runs under TRITON_INTERPRET=1) or "gluon_ws" (warp-specialized, one 128-row
# tile per CTA, sm_90 GPUs only). Both have an instrumented build.
KERNELS = ("triton", "gluon_ws")
# The default per head dim: the faster one against cuDNN on H200 (the measurements are quoted
# beside ``WS_CONFIGS``), where it runs (``kernel_unsupported``).
DEFAULT_KERNEL = {64: "gluon_ws", 128: "gluon_ws"}

# The Triton kernel's (``kernels/flash_attention.py``) Hopper (sm_90) launch configurations keyed
# by head dim: b_m x b_n tiles, TMA loads pipelined num_stages deep. persistent: a grid of SMs x
# ctas_per_sm programs walking the tiles, else one program per tile; ctas_per_sm is the occupancy
# from the registers and shared memory of the sm_90 build (Triton 3.6, ptxas -v). wgmma is issued
# per warpgroup (4 warps). One 8-warp CTA puts two warpgroups on an SM, but its KV pipeline holds
# them in step with three CTA barriers per KV tile, so their softmax and MMAs do not interleave;
# two 4-warp CTAs per SM (128 x 64 at two stages: 255 registers, 96 KiB of shared memory each)
# run independently and do. TRITON_CONFIGS holds the fastest FA-only configuration of this kernel
# measured against cuDNN on H200 by ``attention.bench --fa-only`` (one GPU, H = 12 local heads,
# M = 16K..64K); TRITON_CANDIDATES are what the Table 3 benchmark times once per head dim before
# its sweep, beside the warp-specialized kernel's WS_CANDIDATES, and the configuration it picks
# serves FA-only, Serial and Fused alike. Triton 3.6's ``tl.range(..., warp_specialize=True)`` is
# left out: on sm_90 it hung at run time (one program per tile) or failed to compile (persistent
# grid); the warp-specialized kernel is written in Gluon instead.
TRITON_CONFIGS = {
    64: dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3, ctas_per_sm=2, persistent=True,
             output_cache="", pipelined=False),
    128: dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2, ctas_per_sm=2, persistent=False,
              output_cache="", pipelined=False),
}
TRITON_CANDIDATES = {
    64: [TRITON_CONFIGS[64],
         dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=4, ctas_per_sm=2, persistent=True),
         dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, ctas_per_sm=1, persistent=True),
         dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, ctas_per_sm=1,
              persistent=False)],
    128: [TRITON_CONFIGS[128],
          dict(BLOCK_M=256, BLOCK_N=64, num_warps=8, num_stages=4, ctas_per_sm=1, persistent=False),
          dict(BLOCK_M=256, BLOCK_N=64, num_warps=8, num_stages=3, ctas_per_sm=1, persistent=False),
          dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, ctas_per_sm=1,
               persistent=False)],
}
# Remote-store copy kernel: a [BLOCK_ROWS, d] tile per head and step, 16-byte stores.
COPY_CONFIG = dict(BLOCK_ROWS=32, num_warps=4)
# The warp-specialized kernel's (``kernels/flash_attention_ws.py``, ``kernel="gluon_ws"``) launch
# configurations. Its partitioning fixes WS_FIXED: b_m, the warps per consumer warpgroup, one CTA
# per SM and per tile. BLOCK_N (b_n, at most MAX_BLOCK_N: S takes b_n/2 registers per consumer
# thread, and at 256 ptxas spills and serializes the wgmmas) and num_stages (the K and V rings'
# depth, within the 227 KiB of shared memory of an H100/H200 CTA) are tunable. WS_CONFIGS holds
# the fastest against cuDNN on one H200; WS_CANDIDATES is what the Table 3 benchmark times beside
# the Triton kernel's candidates:
#   d = 128: b_n = 128 at two stages (176 KiB; three do not fit). fa_tuning records of h200-x1
#            from 2310d68: 0.99-1.08 of cuDNN's TF/s at M = 16K-64K with 12 and 6 local heads,
#            the Triton kernel 0.70-0.86.
#   d = 64:  b_n = 128 at three stages (128 KiB): twice the QK^T and PV work per barrier of
#            b_n = d. fa_tuning record 20261201T051325Z-b221c26726 (042a287, 12 heads): 0.94-0.99
#            of cuDNN at M = 16K-64K; two stages 0.91-0.98, b_n = 64 0.87-0.92, the Triton
#            kernel 0.88-0.93. Four stages (144 KiB) are slower: 0.91-0.97 against 0.95-0.99 for
#            three in one run (record 20261201T100119Z-bbef306559, d05d9ec).
WS_FIXED = dict(kernel="gluon_ws", BLOCK_M=128, num_warps=4, ctas_per_sm=1, persistent=False,
                output_cache="", pipelined=False)
WS_CONFIGS = {64: dict(WS_FIXED, BLOCK_N=128, num_stages=3),
              128: dict(WS_FIXED, BLOCK_N=128, num_stages=2)}
WS_CANDIDATES = {64: [WS_CONFIGS[64], dict(WS_CONFIGS[64], num_stages=2)],
                 128: [WS_CONFIGS[128]]}
MAX_BLOCK_N = 128


def kernel_unsupported(kernel: str, device) -> str | None:
    """Why ``kernel`` cannot run on ``device``, or None where it can: the gluon_ws kernel's
    warpgroup MMAs and register reallocation are sm_90 instructions, so it needs a Hopper GPU;
    the Triton kernel runs on any CUDA GPU, and on the CPU under TRITON_INTERPRET=1."""
    device = torch.device(device)
    if kernel == "gluon_ws" and (device.type != "cuda"
                                 or torch.cuda.get_device_capability(device)[0] != 9):
        return (f"the gluon_ws kernel needs an sm_90 (Hopper) GPU, not {device}: its warpgroup "
                "MMAs and register reallocation are sm_90 instructions; use kernel='triton' "
                "elsewhere, and under TRITON_INTERPRET=1")
    return None


def flash_attention_config(head_dim: int, config: dict | None = None, device=None) -> dict:
    """The launch configuration for ``head_dim``: ``config`` over the defaults of its kernel
    (``config["kernel"]``, else ``DEFAULT_KERNEL[head_dim]``, or the Triton kernel where that
    does not run on ``device``, when one is given).

    Keys: kernel (``KERNELS``), BLOCK_M (b_m, rows of an output tile), BLOCK_N (b_n, rows of a KV
    tile), num_warps, num_stages (the depth of the K/V pipeline), ctas_per_sm (programs resident
    per SM: the persistent grid's size per SM), persistent (a grid of SMs x ctas_per_sm programs
    walking the tiles, or one program per tile), output_cache (the output stores' cache operator,
    ``OUTPUT_CACHES``), pipelined (the Q-loop with PV one KV tile behind QK^T, softmax overlapping
    the PV wgmma). Tiles must be powers of two >= 16 (``tl.dot``). The gluon_ws kernel fixes every
    key but BLOCK_N (at most ``MAX_BLOCK_N``) and num_stages (``WS_FIXED``; its defaults per
    head dim: ``WS_CONFIGS``).
    """
    _check_head_dim(head_dim)
    config = config or {}
    kernel = config.get("kernel")
    if kernel is None:
        kernel = DEFAULT_KERNEL[head_dim]
        if device is not None and kernel_unsupported(kernel, device):
            kernel = "triton"
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} must be one of {KERNELS}")
    base = WS_CONFIGS if kernel == "gluon_ws" else TRITON_CONFIGS
    cfg = {**base[head_dim], **config, "kernel": kernel}
    unknown = set(cfg) - {"kernel", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages",
                          "ctas_per_sm", "persistent", "output_cache", "pipelined"}
    if unknown:
        raise ValueError(f"unknown configuration keys {sorted(unknown)}")
    for key in ("BLOCK_M", "BLOCK_N"):
        b = cfg[key]
        if b < 16 or b & (b - 1):
            raise ValueError(f"{key}={b} must be a power of two >= 16")
    for key in ("persistent", "pipelined"):
        if not isinstance(cfg[key], bool):
            raise ValueError(f"{key}={cfg[key]!r} must be True or False")
    if cfg["ctas_per_sm"] < 1:
        raise ValueError(f"ctas_per_sm={cfg['ctas_per_sm']} must be >= 1")
    if cfg["num_stages"] < 1:
        raise ValueError(f"num_stages={cfg['num_stages']} must be >= 1")
    if cfg["output_cache"] not in OUTPUT_CACHES:
        raise ValueError(f"output_cache={cfg['output_cache']!r} must be one of {OUTPUT_CACHES}")
    if kernel == "gluon_ws":
        fixed = WS_FIXED
        changed = sorted(k for k in fixed if cfg[k] != fixed[k])
        if changed:
            raise ValueError(f"the gluon_ws kernel fixes {changed} to "
                             f"{[fixed[k] for k in changed]} (its warp partitions); other "
                             "tiles, grids and Q-loops are kernel='triton' configurations")
        if cfg["BLOCK_N"] > MAX_BLOCK_N:
            raise ValueError(f"BLOCK_N={cfg['BLOCK_N']} exceeds the gluon_ws kernel's "
                             f"{MAX_BLOCK_N} (its score tile's registers)")
    return cfg


def flash_attention_candidates(head_dim: int) -> list[dict]:
    """The Hopper configurations worth timing for ``head_dim``: the gluon_ws kernel's
    ``WS_CANDIDATES``, then the Triton kernel's ``TRITON_CANDIDATES``."""
    _check_head_dim(head_dim)
    return [flash_attention_config(head_dim, c) for c in WS_CANDIDATES[head_dim]] + [
        flash_attention_config(head_dim, dict(c, kernel="triton"))
        for c in TRITON_CANDIDATES[head_dim]]


def check_ulysses_shape(seq_len: int, heads: int, world: int) -> None:
    """Raise ValueError unless P = ``world`` divides both the heads and the sequence (§4.3, Fig. 5)."""
    if world < 1:
        raise ValueError(f"world size P={world} must be >= 1")
    if heads % world:
        raise ValueError(f"heads H={heads} are not divisible by P={world}")
    if seq_len % world:
        raise ValueError(f"sequence length M={seq_len} is not divisible by P={world}")


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    out: torch.Tensor | None = None, config: dict | None = None,
                    num_programs: int | None = None) -> torch.Tensor:
    """FA-only: non-causal softmax(q k^T / sqrt(d)) v per head, output on this rank.

    Contract: q, k, v bf16 [M, H/P, d], contiguous, on one device, d in {64, 128}, M a multiple of
    the configuration's b_m and b_n; fp32 accumulation. ``out`` (bf16 [M, H/P, d], contiguous) is
    written in place when given, else allocated. ``num_programs`` given: a persistent grid of
    that many programs, whatever the configuration says (default: the configuration's grid, SMs x
    ``ctas_per_sm`` programs when persistent). Returns the output [M, H/P, d].
    """
    M, cfg = _check_qkv(q, k, v, config)
    if out is None:
        out = torch.empty_like(q)
    else:
        _check_tensor("out", out, q.shape, q.device)
    _launch_flash_attention(q, k, v, out, rows_per_rank=M, rank=0, world=1, remote=False,
                            fenced=False, cfg=cfg, num_programs=num_programs)
    return out


def fused_attention_a2a(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        peer_ptrs: torch.Tensor, rank: int, world: int, *,
                        config: dict | None = None, num_programs: int | None = None,
                        fenced: bool = False, trace: torch.Tensor | None = None) -> None:
    """X-Stage-Fused Ulysses attention: FlashAttention whose epilogue stores each output tile into
    the owning rank's receive buffer and resumes with the next tile (§4.3, Fig. 7).

    ``fenced`` (issue 8): after each tile's remote stores the program waits until they are visible
    system-wide (a release fence at system scope) before its next tile, the completion-coupled
    epilogue (eq. 17) against which X-Stage's decoupled one (eqs. 18-19) is measured.

    Contract: q, k, v as for ``flash_attention`` (this rank's heads [rank*H/P, (rank+1)*H/P));
    ``peer_ptrs`` int64 [P] on q's device, entry j the base address of rank j's receive buffer
    bf16 [M/P, H, d] (``ReceiveBuffer.peer_ptrs``); P = ``world`` divides M. Returns at launch:
    receivers must synchronize once (``ReceiveBuffer.barrier``) before reading. The values stored
    are bitwise those of ``nccl_a2a(flash_attention(q, k, v))`` with the same configuration.

    ``trace`` (int64 [``trace_tiles``, ``TRACE_FIELDS``] on q's device) selects the instrumented
    build: with b = ``trace_block_m`` rows per trace row, row t (rows [(t % (M/b))·b, +b) of local
    head t // (M/b)) receives %globaltimer at entry, epilogue start and epilogue end (every store
    issued), then the SM id (``trace`` reads it). Its barriers make it a build of its
    own: compare it with itself.
    """
    M, cfg = _check_qkv(q, k, v, config)
    _check_peer_ptrs(peer_ptrs, q.device, rank, world, M)
    if trace is not None:
        _check_tensor("trace", trace, (trace_tiles(q, cfg), TRACE_FIELDS), q.device, torch.int64)
    _launch_flash_attention(q, k, v, peer_ptrs, rows_per_rank=M // world, rank=rank, world=world,
                            remote=True, fenced=fenced, cfg=cfg, num_programs=num_programs,
                            trace=trace)


TRACE_FIELDS = int(_kernels.TRACE_FIELDS)  # entry, epilogue start, epilogue end (ns), SM id


def trace_block_m(config: dict) -> int:
    """Output rows one trace row covers under a configuration (``flash_attention_config``): a
    tile of the Triton kernel, one consumer warpgroup's half tile of gluon_ws."""
    return int(_ws_kernels.HALF_ROWS) if config["kernel"] == "gluon_ws" else config["BLOCK_M"]


def trace_tiles(q: torch.Tensor, config: dict | None = None) -> int:
    """The rows of a ``fused_attention_a2a`` trace of one launch on q [M, H/P, d]: its output
    tiles (half tiles for gluon_ws)."""
    M, h_local, d = q.shape
    return M // trace_block_m(flash_attention_config(d, config, q.device)) * h_local


def remote_store_a2a(out_local: torch.Tensor, peer_ptrs: torch.Tensor, rank: int, world: int,
                     *, block_rows: int | None = None) -> None:
    """The post-attention All-to-All by remote stores, usable after any attention backend.

    Contract: ``out_local`` bf16 [M, H/P, d] contiguous (this rank's attention output, heads
    [rank*H/P, (rank+1)*H/P)), d in {64, 128}; ``peer_ptrs`` as for ``fused_attention_a2a``;
    P = ``world`` divides M. Rank j's buffer receives rows [j*M/P, (j+1)*M/P) at head offset
    rank*H/P. Returns at launch; receivers synchronize once (``ReceiveBuffer.barrier``).
    """
    if not isinstance(out_local, torch.Tensor) or out_local.dim() != 3:
        raise ValueError("out_local must be a tensor [M, H/P, d]")
    M, h_local, d = out_local.shape
    _check_head_dim(d)
    _check_tensor("out_local", out_local, out_local.shape, out_local.device)
    _check_peer_ptrs(peer_ptrs, out_local.device, rank, world, M)
    block_rows = block_rows or COPY_CONFIG["BLOCK_ROWS"]
    if block_rows & (block_rows - 1):
        raise ValueError(f"block_rows={block_rows} must be a power of two")
    _check_launchable(out_local.device)
    _kernels.remote_store_a2a_kernel[(triton.cdiv(M, block_rows),)](
        out_local, peer_ptrs, M, M // world, rank, world,
        H_LOCAL=h_local, HEAD_DIM=d, BLOCK_ROWS=block_rows,
        num_warps=COPY_CONFIG["num_warps"])


def nccl_a2a(out_local: torch.Tensor, group: dist.ProcessGroup | None = None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The post-attention All-to-All through ``dist.all_to_all_single`` (Serial, A2A-only, and the
    SDPA baseline, as yunchang, xDiT and DeepSpeed do it).

    Contract: ``out_local`` [M, H/P, d] contiguous, this rank's heads; P = group size divides M.
    Row block j of ``out_local`` goes to rank j unchanged (no send-side permute); the received
    [P, M/P, H/P, d] (source rank first) is permuted to [M/P, P*H/P, d]. Returns it, in ``out``
    (contiguous [M/P, H, d]) when given.
    """
    world = dist.get_world_size(group)
    if out_local.dim() != 3 or not out_local.is_contiguous():
        raise ValueError("out_local must be a contiguous tensor [M, H/P, d]")
    M, h_local, d = out_local.shape
    check_ulysses_shape(M, h_local * world, world)
    shape = (M // world, world * h_local, d)
    if out is not None:
        _check_tensor("out", out, shape, out_local.device, dtype=out_local.dtype)
    recv = torch.empty_like(out_local)
    dist.all_to_all_single(recv, out_local, group=group)
    received = recv.view(world, M // world, h_local, d).permute(1, 0, 2, 3)
    if out is None:
        return received.reshape(shape)
    out.view(M // world, world, h_local, d).copy_(received)
    return out


def sdpa_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """torch SDPA, non-causal, forced onto its cuDNN backend; [M, H/P, d] in and out (contiguous).

    Inputs are passed as [1, H/P, M, d] views of the Ulysses layout, as users do; the kernel raises
    if cuDNN attention is unavailable rather than falling back to another backend.
    """
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        o = F.scaled_dot_product_attention(*(t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)))
    return o[0].transpose(0, 1).contiguous()


def sdpa_nccl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              group: dist.ProcessGroup | None = None, *,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The baseline users run today: ``sdpa_cudnn`` then ``nccl_a2a``. Returns [M/P, H, d]."""
    return nccl_a2a(sdpa_cudnn(q, k, v), group, out=out)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        max_scores: int = 1 << 28) -> torch.Tensor:
    """Float32 non-causal attention per head, [M, H/P, d] in, float32 [M, H/P, d] out.

    Query rows are processed in chunks so at most ``max_scores`` fp32 scores exist at once; TF32 is
    disabled for the duration.
    """
    M, h_local, d = q.shape
    qh, kh, vh = (t.float().transpose(0, 1) for t in (q, k, v))  # [H/P, M, d]
    out = torch.empty(h_local, M, d, dtype=torch.float32, device=q.device)
    chunk = max(1, max_scores // (h_local * M))
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        for i in range(0, M, chunk):
            s = qh[:, i:i + chunk] @ kh.transpose(1, 2) / math.sqrt(d)
            out[:, i:i + chunk] = torch.softmax(s, dim=-1) @ vh
    finally:
        torch.set_float32_matmul_precision(precision)
    return out.transpose(0, 1).contiguous()


def ulysses_gather(local_outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What every rank must receive, from all P ranks' attention outputs [M, H/P, d] (§4.3, Fig. 5):
    element j is [M/P, H, d], rows [j*M/P, (j+1)*M/P) with rank r's heads at [r*H/P, (r+1)*H/P)."""
    world = len(local_outputs)
    full = torch.cat(list(local_outputs), dim=1)  # [M, H, d], heads in rank order
    check_ulysses_shape(full.shape[0], full.shape[1], world)
    return [c.contiguous() for c in full.chunk(world, dim=0)]


def reference_ulysses(q_all: Sequence[torch.Tensor], k_all: Sequence[torch.Tensor],
                      v_all: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Float32 reference of the whole Ulysses post-attention path: from every rank's q, k, v
    [M, H/P, d] (index = rank), the float32 [M/P, H, d] that each rank must receive."""
    if not len(q_all) == len(k_all) == len(v_all):
        raise ValueError("q_all, k_all and v_all must hold one tensor per rank")
    return ulysses_gather([reference_attention(q, k, v) for q, k, v in zip(q_all, k_all, v_all)])


@dataclass(frozen=True)
class ReceiveBuffer:
    """The receive buffer of every rank, one bf16 ``SymmetricBuffer`` sized for the largest case.

    ``view(M, heads, d)`` is its [M/P, H, d] prefix, and ``peer_ptrs`` (int64 [P], on this rank's
    device) the base addresses of that prefix on every rank, for the REMOTE epilogue and
    ``remote_store_a2a``.
    """

    symmetric: SymmetricBuffer

    @property
    def peer_ptrs(self) -> torch.Tensor:
        return self.symmetric.table

    def view(self, seq_len: int, heads: int, head_dim: int) -> torch.Tensor:
        buffer, world = self.symmetric.tensor, self.symmetric.world
        check_ulysses_shape(seq_len, heads, world)
        n = seq_len // world * heads * head_dim
        if n > buffer.numel():
            raise ValueError(f"[{seq_len // world}, {heads}, {head_dim}] exceeds the receive "
                             f"buffer of {buffer.numel()} elements")
        return buffer[:n].view(seq_len // world, heads, head_dim)

    def barrier(self) -> None:
        """Consumer-side completion, once per launch (``SymmetricBuffer.barrier``)."""
        self.symmetric.barrier()


def symmetric_receive_buffer(numel: int, group: dist.ProcessGroup | None = None) -> ReceiveBuffer:
    """Allocate ``numel`` bf16 of torch symmetric memory on every rank and exchange the pointers
    (``platform.symmetric_buffer``: refuses, before allocating, ranks on several hosts, GPUs
    without peer access and NVLink multicast left on). Collective over ``group``."""
    return ReceiveBuffer(symmetric_buffer(numel, DTYPE, group))


def _check_head_dim(d: int) -> None:
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim d={d} is not supported (supported: {HEAD_DIMS})")


def _check_tensor(name: str, t: torch.Tensor, shape, device: torch.device,
                  dtype: torch.dtype = DTYPE) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.data_ptr() % ALIGN_BYTES:
        raise ValueError(f"{name} must be {ALIGN_BYTES}-byte aligned")


def _check_qkv(q, k, v, config):
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError("q must be a tensor [M, H/P, d]")
    M, _, d = q.shape
    _check_head_dim(d)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, q.shape, q.device)
    cfg = flash_attention_config(d, config, q.device)
    if M % cfg["BLOCK_M"] or M % cfg["BLOCK_N"]:
        raise ValueError(f"sequence length M={M} must be a multiple of the tile sizes "
                         f"b_m={cfg['BLOCK_M']} and b_n={cfg['BLOCK_N']} (head dim {d})")
    return M, cfg


def _check_peer_ptrs(peer_ptrs: torch.Tensor, device: torch.device, rank: int, world: int,
                     seq_len: int) -> None:
    """Metadata only: reading device entries would synchronize (and break CUDA-graph capture);
    ``platform.symmetric_buffer`` validates the entries when it builds the table."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} must be in [0, P={world})")
    if seq_len % world:
        raise ValueError(f"sequence length M={seq_len} is not divisible by P={world}")
    if not isinstance(peer_ptrs, torch.Tensor) or peer_ptrs.dtype != torch.int64:
        raise ValueError("peer_ptrs must be an int64 tensor of receive-buffer addresses")
    if tuple(peer_ptrs.shape) != (world,):
        raise ValueError(f"peer_ptrs must hold one pointer per rank: shape [{world}], "
                         f"got {list(peer_ptrs.shape)}")
    if peer_ptrs.device != device or not peer_ptrs.is_contiguous():
        raise ValueError(f"peer_ptrs must be contiguous on {device}, got {peer_ptrs.device}")


def _check_launchable(device: torch.device) -> None:
    interpreted = isinstance(_kernels.flash_attention_kernel, InterpretedFunction)
    if device.type != "cuda" and not interpreted:
        raise ValueError(f"tensors on {device}: the kernels run on CUDA devices "
                         "(CPU tensors only under TRITON_INTERPRET=1)")


_FENCE_FLAGS: dict[torch.device, torch.Tensor] = {}


def _fence_flag(device: torch.device) -> torch.Tensor:
    """The int32 the FENCED epilogue releases on: one per device, never read, allocated at the
    first launch on that device (the benchmarks make it outside CUDA-graph capture)."""
    if device not in _FENCE_FLAGS:
        _FENCE_FLAGS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _FENCE_FLAGS[device]


def _launch_flash_attention(q, k, v, dst, *, rows_per_rank, rank, world, remote, fenced, cfg,
                            num_programs, trace=None):
    if cfg["kernel"] == "gluon_ws":
        _launch_flash_attention_ws(q, k, v, dst, rows_per_rank=rows_per_rank, rank=rank,
                                   world=world, remote=remote, fenced=fenced, cfg=cfg,
                                   num_programs=num_programs, trace=trace)
        return
    M, h_local, d = q.shape
    _check_launchable(q.device)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    # Heads are column blocks of the [M, H/P * d] matrix, so one descriptor serves all heads.
    descs = [TensorDescriptor(t.view(M, h_local * d), [M, h_local * d], [h_local * d, 1], [rows, d])
             for t, rows in ((q, bm), (k, bn), (v, bn))]
    tiles = M // bm * h_local
    if num_programs is not None and num_programs < 1:
        raise ValueError(f"num_programs={num_programs} must be >= 1")
    persistent = cfg["persistent"] or num_programs is not None
    if num_programs is None:
        num_programs = (torch.cuda.get_device_properties(q.device).multi_processor_count
                        * cfg["ctas_per_sm"] if q.device.type == "cuda" and persistent else tiles)
    _kernels.flash_attention_kernel[(min(tiles, num_programs),)](
        # without a trace the fence flag stands in for the unused pointer
        *descs, dst, _fence_flag(q.device), _fence_flag(q.device) if trace is None else trace,
        M, rows_per_rank, rank, world, LOG2E / math.sqrt(d),
        H_LOCAL=h_local, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, REMOTE=remote, FENCED=fenced,
        PERSISTENT=persistent, OUTPUT_CACHE=cfg["output_cache"], PIPELINED=cfg["pipelined"],
        INSTRUMENT=trace is not None, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _launch_flash_attention_ws(q, k, v, dst, *, rows_per_rank, rank, world, remote, fenced, cfg,
                               num_programs, trace):
    """``flash_attention_ws_kernel``: one CTA per 128-row tile, Q in two 64-row halves (one per
    consumer warpgroup), K and V in [b_n, d] tiles."""
    if num_programs is not None:
        raise ValueError("the gluon_ws kernel has no persistent grid: use a kernel='triton' "
                         "configuration for num_programs")
    reason = kernel_unsupported("gluon_ws", q.device)
    if reason:
        raise ValueError(reason)
    M, h_local, d = q.shape
    half, bn = int(_ws_kernels.HALF_ROWS), cfg["BLOCK_N"]
    descs = [GluonTensorDescriptor(t.view(M, h_local * d), [M, h_local * d], [h_local * d, 1],
                                   [rows, d],
                                   gl.NVMMASharedLayout.get_default_for([rows, d], gl.bfloat16))
             for t, rows in ((q, half), (k, bn), (v, bn))]
    _ws_kernels.flash_attention_ws_kernel[(M // cfg["BLOCK_M"] * h_local,)](
        # without a trace the fence flag stands in for the unused pointer
        *descs, dst, _fence_flag(q.device), _fence_flag(q.device) if trace is None else trace,
        M, rows_per_rank, rank, world, LOG2E / math.sqrt(d), H_LOCAL=h_local, HEAD_DIM=d,
        BLOCK_N=bn, REMOTE=remote, FENCED=fenced, STAGES=cfg["num_stages"],
        INSTRUMENT=trace is not None, num_warps=cfg["num_warps"])
