"""A GEMM beside a full host X-Stage (issue 26): the host side of the ``under_gemm`` probe. The
store warps of ``kernels/host_store_load.cu`` (split layout, no load warps) take K SMs and store
sustained into pinned host memory (``stores="host"``) or, the control, into the GPU's own memory
(``"local"``), while on another stream torch's bf16 matmul (cuBLAS) runs repeatedly on the SMs
left; ``"none"`` (K = 0): the matmul alone on every SM. What a GEMM's mainloop loses to a
backpressured host link, which the streaming load of ``under_load`` overstates (36x there).

Co-residency: the store kernel's CTAs take all of their SMs' shared memory (``exclusive``), so no
GEMM CTA can share an SM with one; its grid holds every SM until its grid barrier has passed,
then the CTAs past the K that store leave. The host launches the GEMMs only once that barrier
has passed (a mapped host flag, polled with a bound), so the K SMs are taken first and the GEMM
gets the other ``sms - K`` (``gemm_sms``), with the kernel and grid cuBLAS picks for the whole
GPU. Each matmul is timed by CUDA events and
bracketed by ``%globaltimer`` stamps on its stream (``stamp_timer``); only the matmuls whose
stamps lie inside the store warps' window (after the X-Stage filled, before the first store warp
stopped) count. Every launch poisons the GEMM's output first and checks the last matmul's result
against a float32 reference; the stores are checked as ``under_load``'s.

CuPy and torch are imported only when a ``GemmBesideStores`` is made (the cuda backend)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ...platform import Inventory, inventory, mapped_host_buffer
from .burst import HOST, check_choice, check_gpus
from .under_load import HostLoadProbe, LoadSettings, load_rows

MODE = "under_gemm"
STORES = ("host", "local", "none")
# (M, K, N) of the fused MoE's per-expert GEMMs (a rank's 4096 tokens): Linear-1-like, a long K
# into a narrow output, and Linear-2-like, a short K into a wide one (hidden 7168)
GEMMS = {"linear1": (4096, 7168, 2048), "linear2": (4096, 2048, 7168)}
# bf16 result against the float32 reference: bf16's 8-bit mantissa, of the largest |value|
GEMM_TOLERANCE = 2.0 ** -7


@dataclass(frozen=True)
class GemmSettings:
    """Launch settings of the probe, shared by a run's points."""

    warm_us: float = 500.0          # the X-Stage fills before the window opens
    window_us: float = 150_000.0    # the store window: 30 matmuls at up to ~5 ms each
    gemms: int = 30                 # matmuls issued per launch
    min_inside: int = 5             # fewer inside the window: the point measured nothing
    store_buffer_bytes: int = 256 * 1024 * 1024
    barrier_timeout_s: float = 2.0  # the store kernel's grid barrier and the host's wait for it


def validate_gemm_point(p: dict, inv: Inventory) -> None:
    """Raise ValueError for a probe point that must not be launched; called before any launch."""
    check_choice("stores", p["stores"], STORES)
    check_choice("gemm", p["gemm"], tuple(GEMMS))
    check_gpus(p["src"], p["dst"], inv)
    if p["dst"] != HOST:
        raise ValueError(f"the probe stores into host memory (dst {HOST}), got dst={p['dst']}")
    sms = inv.gpus[p["src"]].sm_count
    k = p["producers"]
    if p["stores"] == "none" and k != 0:
        raise ValueError(f"stores=none is the GEMM alone on every SM: producers must be 0, "
                         f"got {k}")
    if p["stores"] != "none" and not (isinstance(k, (int, np.integer)) and 1 <= k < sms):
        raise ValueError(f"producers K={k} must be in 1..{sms - 1}, leaving SMs to the GEMM")


def gemm_flops(gemm: str) -> float:
    m, k, n = GEMMS[gemm]
    return 2.0 * m * k * n


def gemm_rows(gemm_ms: np.ndarray, stamps: np.ndarray, window: tuple[int, int] | None,
              flops: float, min_inside: int) -> dict:
    """One launch's GEMM rate: ``gemm_ms`` (event times) and ``stamps`` ([gemms, 2]:
    %globaltimer before and after each) of its matmuls; those inside ``window`` (the store
    warps' (start, end), ns; None: the GEMM alone, all count) give the median time and rate.
    RuntimeError where a stamp was not written or fewer than ``min_inside`` count."""
    if (stamps < 0).any() or not (stamps[:, 1] > stamps[:, 0]).all():
        raise RuntimeError("GEMM stamps: a matmul's stamp was not written or its span is empty")
    inside = (np.ones(len(stamps), bool) if window is None else
              (stamps[:, 0] >= window[0]) & (stamps[:, 1] <= window[1]))
    if inside.sum() < min_inside:
        raise RuntimeError(f"{int(inside.sum())} of {len(stamps)} matmuls ran inside the store "
                           f"window, fewer than {min_inside}")
    us = float(np.median(gemm_ms[inside])) * 1e3
    return {"gemm_us": us, "gemm_tflops": flops / us / 1e6, "gemms_inside": int(inside.sum()),
            "gemms": len(stamps)}


class GemmBesideStores:
    """Launches probe points on this machine's GPU: the store kernel through a
    ``HostLoadProbe`` (CuPy), the GEMMs through torch."""

    def __init__(self, settings: GemmSettings = GemmSettings(), inv: Inventory | None = None):
        import cupy  # the cuda backend only
        import torch

        self.cp, self.torch = cupy, torch
        self.settings = settings
        self.inv = inventory() if inv is None else inv
        s = settings
        # no load warps: a small load buffer, which the kernel never reads
        self.stores = HostLoadProbe(LoadSettings(warm_us=s.warm_us, window_us=s.window_us,
                                                 store_buffer_bytes=s.store_buffer_bytes,
                                                 load_buffer_bytes=1024 * 1024,
                                                 barrier_timeout_s=s.barrier_timeout_s), self.inv)
        self.seed = self.stores.seed
        self._operands = {}
        self._flag = None
        self._stream = None

    def validate(self, p: dict) -> None:
        validate_gemm_point(p, self.inv)

    def _gemm(self, gemm: str, src: int):
        """The point's operands (bf16, seeded), its output and the float32 reference, made once,
        with one matmul on the GEMM's stream: cuBLAS takes its handle and workspace for the
        stream, and CUDA loads its kernel (lazily, at a first launch, which may wait for the
        kernels running), there, not inside a store window."""
        torch = self.torch
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=src)
        if gemm not in self._operands:
            m, k, n = GEMMS[gemm]
            dev = torch.device("cuda", src)
            g = torch.Generator(device=dev).manual_seed(self.seed)
            a = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
            b = torch.randn(k, n, generator=g, device=dev).to(torch.bfloat16)
            ref = a.float() @ b.float()
            c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            # the operands are made on the current stream: the GEMM's waits for them
            self._stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(self._stream):
                torch.matmul(a, b, out=c)
            self._operands[gemm] = (a, b, c, ref, float(ref.abs().max()))
        return self._operands[gemm]

    def measure(self, p: dict, check_stores: bool = False) -> dict:
        """One launch of the point, checked (the GEMM's output, the stores' error flag, stamps
        and, with ``check_stores``, their destination read back); its row."""
        self.validate(p)
        cp, torch, s = self.cp, self.torch, self.settings
        src = int(p["src"])
        a, b, c, ref, scale = self._gemm(p["gemm"], src)
        module = self.stores._buffers(src)
        stamp = module.get_function("stamp_timer")
        stream = self._stream
        ext = cp.cuda.ExternalStream(stream.cuda_stream, src)
        if self._flag is None:
            self._flag = mapped_host_buffer(4096, src)
            # CUDA loads a kernel lazily, at its first launch, which may wait for the kernels
            # running: the stamp's first launch here, before any store window (into a spare word)
            stamp((1,), (1,), (np.uint64(self._flag.ptr + 8),), stream=ext)
        sms = self.inv.gpus[src].sm_count
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(s.gemms)]
        stamps = torch.full((s.gemms, 2), -1, dtype=torch.int64, device=a.device)
        c.fill_(float("nan"))
        torch.cuda.synchronize(src)
        pending = None
        if p["stores"] != "none":
            store_point = {"layout": "split", "producers": int(p["producers"]),
                           "stores": p["stores"], "load": 0, "src": src, "dst": HOST}
            flag = self._flag.words()
            flag[0] = 0
            with cp.cuda.Device(src):
                pending = self.stores.start(store_point, started=self._flag.ptr, exclusive=True,
                                            stream=cp.cuda.Stream(non_blocking=True))
            deadline = time.monotonic() + s.barrier_timeout_s
            while flag[0] == 0 and time.monotonic() < deadline:
                pass
            if flag[0] == 0:
                self.stores.check(self.stores.finish(pending), False)  # names the kernel's error
                raise RuntimeError(f"the store kernel's barrier flag did not arrive within "
                                   f"{s.barrier_timeout_s} s at {p}")
        with torch.cuda.stream(stream):
            for i, (start, end) in enumerate(events):
                stamp((1,), (1,), (np.uint64(stamps[i].data_ptr()),), stream=ext)
                start.record()
                torch.matmul(a, b, out=c)
                end.record()
                stamp((1,), (1,), (np.uint64(stamps[i].data_ptr() + 8),), stream=ext)
        stream.synchronize()
        window = None
        row = {"gemm_sms": sms, "store_rate_GBps": np.nan, "window_us": np.nan}
        if pending is not None:
            run = self.stores.finish(pending)
            self.stores.check(run, check_stores)
            st = run.stamps[run.store_warps].astype(np.int64)
            window = (int(st[:, 0].max()), int(st[:, 2].min()))  # ns: exact as integers
            row = {"gemm_sms": sms - int(p["producers"]),
                   "store_rate_GBps": load_rows(run.stamps, run.store_warps,
                                                run.load_warps)["store_rate_GBps"],
                   "window_us": (window[1] - window[0]) / 1e3}
        err = float((c.float() - ref).abs().max())  # NaN where the poison was left
        if not err <= GEMM_TOLERANCE * scale:
            raise RuntimeError(f"GEMM {p['gemm']} differs from its float32 reference by {err} "
                               f"(largest |value| {scale}) at {p}")
        ms = np.array([e0.elapsed_time(e1) for e0, e1 in events])
        return {**gemm_rows(ms, stamps.cpu().numpy(), window, gemm_flops(p["gemm"]),
                            s.min_inside), **row}

