"""The host side of ``burst_gap_ops`` (``kernels/remote_store_burst.cu``, issue 6): one operation
per burst (4-, 8- or 16-byte stores, ``red.global.add`` u32 or f32, ``cp.async.bulk`` copies from
shared memory, 16-byte remote loads), each source GPU's producers split over its destinations
(``analysis.remote_store.routes``), several sources started together through a pinned host flag.
A point's contract (``validate_ops_point``), the concurrent launch and its checks of every
destination, reduction and loaded sum (``RemoteOpsBench``). CuPy is imported only when a bench
is made."""
from __future__ import annotations

import ctypes
import re
import time
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from ...analysis.remote_store.routes import parse_routes
from ...calibration import BenchSettings
from ...kernel_sources import cuda_source
from ...platform import Inventory
from .burst import (RemoteStoreBench, burst_rows, check_burst_and_gap, check_choice,
                    isolated_recovery_us)


# In run order: the baseline first; bulk copies (the one path through the copy engine) and the
# reductions (slowest: the first the time budget leaves out) last.
OPS = ("store16", "store8", "store4", "load16", "bulk", "red_add_u32", "red_add_f32")


def kernel_op_codes(source: str) -> dict[str, int]:
    """Each operation's code as the kernel defines it (``#define OP_STORE16 2u`` → ``store16:
    2``). Read from the source, never from the run order of OPS: a code that differs from the
    kernel's runs another operation under this one's name. Raises ValueError where an
    operation of OPS has no define."""
    codes = {m[1].lower(): int(m[2])
             for m in re.finditer(r"^#define OP_(\w+) (\d+)u\b", source, re.MULTILINE)}
    missing = [op for op in OPS if op not in codes]
    if missing:
        raise ValueError(f"kernel defines no OP_* code for {missing}")
    return {op: codes[op] for op in OPS}


OP_CODES = kernel_op_codes(cuda_source("remote_store_burst.cu"))  # OP_* in the kernel


MODES = ("periodic", "isolated")


PATHS = ("remote", "local")


ALIGNS = ("each", "first")


_POISON = 0xA5A5A5A5


_ERR_BARRIER_TIMEOUT, _ERR_START_TIMEOUT = 1, 2


_HOST_ALLOC_PORTABLE, _HOST_ALLOC_MAPPED = 0x01, 0x02   # cudaHostAlloc flags


OPS_SETTINGS = BenchSettings()


@dataclass(frozen=True)
class OpsSettings:
    """What the operations launcher adds to ``BenchSettings``."""

    bench: BenchSettings = OPS_SETTINGS
    bulk_chunk_bytes: int = 4096   # bytes per cp.async.bulk instruction


def stamps_bytes(n_bursts: int) -> int:
    """Shared memory the kernel keeps its stamps in, rounded up to 128 bytes (the staging's
    alignment)."""
    return (n_bursts * 3 + 15) // 16 * 16 * 8


def validate_ops_point(p: dict, inv: Inventory, settings: OpsSettings = OpsSettings()) -> None:
    """Raise ValueError for a point that must not be launched; called before any launch."""
    s = settings.bench
    K, B, G, op = p["producers"], p["burst_bytes"], p["gap_us"], p["op"]
    check_choice("op", op, OPS)
    check_choice("mode", p["mode"], MODES)
    check_choice("path", p["path"], PATHS)
    check_choice("align", p.get("align", "each"), ALIGNS)
    if p.get("lines", "fresh") != "fresh":
        raise ValueError("the operations bench writes fresh lines only")
    check_burst_and_gap(B, G)
    routes = parse_routes(p["routes"])
    n = len(inv.gpus)
    srcs = [src for src, _ in routes]
    if len(set(srcs)) != len(srcs):
        raise ValueError(f"routes {p['routes']!r} name a source twice")
    for src, dsts in routes:
        if not dsts or len(set(dsts)) != len(dsts):
            raise ValueError(f"routes {p['routes']!r}: source {src} needs distinct destinations")
        for gpu in (src, *dsts):
            if not 0 <= gpu < n:
                raise ValueError(f"routes {p['routes']!r} must name GPUs 0..{n - 1}")
        sms = inv.gpus[src].sm_count
        if not isinstance(K, (int, np.integer)) or not len(dsts) <= K <= sms:
            raise ValueError(f"producers K={K} must be in {len(dsts)}..{sms} (one CTA per SM of "
                             f"GPU {src}, at least one per destination)")
        if p["path"] == "remote":
            for d in dsts:
                if d == src:
                    raise ValueError(f"remote route {src}>{d} stores to its own GPU")
                if not inv.can_access_peer(src, d):
                    raise ValueError(f"GPU {src} has no peer access to GPU {d}")
        staging = stamps_bytes(s.periodic_bursts) + B
        if op == "bulk" and staging > inv.gpus[src].max_smem_per_block_optin:
            raise ValueError(f"bulk staging B={B} does not fit GPU {src}'s shared memory")
    if K * B > s.buffer_bytes:
        raise ValueError(f"burst volume K*B={K * B} exceeds the {s.buffer_bytes}-byte buffer")
    n_bursts = p.get("bursts", s.periodic_bursts)
    if not s.periodic_warmup_bursts + 2 <= n_bursts <= s.periodic_bursts:
        raise ValueError(f"bursts={n_bursts} must be in {s.periodic_warmup_bursts + 2}.."
                         f"{s.periodic_bursts} (warm-up plus a steady window)")
    if not p.get("recovery_rate_GBps", 1.0) > 0:
        raise ValueError("recovery_rate_GBps must be positive")
    if s.threads % 32 or not 32 <= s.threads <= 992:
        raise ValueError("store threads per producer must be a multiple of 32 in 32..992")
    if settings.bulk_chunk_bytes <= 0 or settings.bulk_chunk_bytes % 16:
        raise ValueError("bulk_chunk_bytes must be a positive multiple of 16")


def expected_load_sums(words, K: int, B: int, n_slots: int, n_bursts: int, xp=np):
    """What each of K producers' OP_LOAD16 sums must be over ``words`` (the destination
    buffer, uint32): burst b reads producer p's B bytes of slot b mod n_slots, so each used slot
    counts once per burst that hit it (``slot_hits`` in the kernel). uint64, shape (K,);
    ``xp``: numpy, or cupy for a device buffer."""
    used = min(n_bursts, n_slots)
    hits = (n_bursts - 1 - np.arange(used)) // n_slots + 1
    per = words[:used * K * B // 4].reshape(used, K, B // 4).sum(axis=2, dtype=xp.uint64)
    return (per * xp.asarray(hits, xp.uint64)[:, None]).sum(axis=0, dtype=xp.uint64)


class RemoteOpsBench(RemoteStoreBench):
    """Launches ``burst_gap_ops`` on every source GPU of a point at once; checks every
    destination (or, for loads, what was loaded) before returning rows."""

    def __init__(self, settings: OpsSettings = OpsSettings(), inv: Inventory | None = None):
        super().__init__(settings.bench, inv)
        self.ops_settings = settings
        self._pair_buffers: dict[tuple[int, int], object] = {}
        self._buffer_holds: dict[tuple[int, int], str] = {}   # "poison" or "random"
        n = len(self.inv.gpus)
        # One ready word per GPU, then the go word: pinned, mapped, seen by every GPU (UVA).
        rt = self.cp.cuda.runtime
        self._flags_ptr = rt.hostAlloc(4 * (n + 1), _HOST_ALLOC_PORTABLE | _HOST_ALLOC_MAPPED)
        self._flags = np.ctypeslib.as_array(
            (ctypes.c_uint32 * (n + 1)).from_address(self._flags_ptr))

    def validate(self, p: dict) -> None:
        validate_ops_point(p, self.inv, self.ops_settings)

    def _pair_buffer(self, src: int, dst: int):
        """The buffer on ``dst`` that ``src`` writes (each source its own, so that concurrent
        sources into one destination can be checked apart)."""
        key = (src, dst)
        if key not in self._pair_buffers:
            with self.cp.cuda.Device(dst):
                self._pair_buffers[key] = self.cp.empty(self.settings.buffer_bytes // 4,
                                                        self.cp.uint32)
        return self._pair_buffers[key]

    def _prepare(self, key, op: str) -> None:
        """Poison before stores and reductions; fresh random words (once) before loads."""
        cp, buf = self.cp, self._pair_buffer(*key)
        want = "random" if op == "load16" else "poison"
        with cp.cuda.Device(key[1]):
            if want == "poison":
                buf.fill(_POISON)
            elif self._buffer_holds.get(key) != "random":
                rs = cp.random.RandomState(int(self.seed) + 7919 * key[0] + key[1])
                buf[...] = rs.randint(0, 2**31 - 1, buf.size, dtype=cp.int32).view(cp.uint32)
            cp.cuda.Device(key[1]).synchronize()
        self._buffer_holds[key] = want

    def measure(self, p: dict) -> pd.DataFrame:
        """Run one point: one launch per source GPU, started together; returns per-burst rows
        of every source (``src``; ``dst`` is -1 where a source has several destinations)."""
        self.validate(p)
        cp, s = self.cp, self.settings
        K, B, op = int(p["producers"]), int(p["burst_bytes"]), p["op"]
        routes = parse_routes(p["routes"])
        if p["path"] == "local":
            routes = tuple((src, (src,)) for src, _ in routes)
        volume = K * B
        isolated = p["mode"] == "isolated"
        n_bursts = s.isolated_bursts if isolated else int(p.get("bursts", s.periodic_bursts))
        warmup = s.isolated_warmup_bursts if isolated else s.periodic_warmup_bursts
        recovery = replace(s, isolated_recovery_rate_GBps=p.get("recovery_rate_GBps",
                                                                 s.isolated_recovery_rate_GBps))
        gap_us = isolated_recovery_us(volume, recovery) if isolated else float(p["gap_us"])
        n_slots = s.buffer_bytes // volume
        mhz = {}
        for src, dsts in routes:
            mhz[src] = self._clock_mhz.get(src) or self.sm_clock_mhz(src)
            for d in dsts:
                self._enable_peer(src, d)
                self._prepare((src, d), op)
        self._flags[:] = 0
        launched = []
        for src, dsts in routes:
            gpu = self.inv.gpus[src]
            smem = max(min(gpu.max_smem_per_sm // 2 + 1024, gpu.max_smem_per_block_optin),
                       stamps_bytes(n_bursts) + (B if op == "bulk" else 0))
            with cp.cuda.Device(src):
                kernel = self._module(src).get_function("burst_gap_ops")
                kernel.max_dynamic_shared_size_bytes = smem
                a = dict(arrivals=cp.zeros(1, cp.uint32), error=cp.zeros(1, cp.uint32),
                         sums=cp.zeros(K, cp.uint64), trace=cp.zeros((n_bursts, K, 3), cp.uint64),
                         clocks=cp.zeros((K, 5), cp.uint64),
                         table=cp.asarray([self._pair_buffer(src, d).data.ptr for d in dsts],
                                          cp.uint64))
                kernel((K,), (s.threads + 32,),
                       (a["table"], np.uint32(len(dsts)), np.uint32(OP_CODES[op]),
                        np.uint64(volume // 4), np.uint32(n_slots), np.uint32(B // 4),
                        np.uint32(self.ops_settings.bulk_chunk_bytes), np.uint32(n_bursts),
                        np.uint64(round(gap_us * mhz[src])),
                        np.uint32(isolated or p.get("align", "each") == "each"),
                        np.uint32(self.seed), a["arrivals"], a["error"],
                        np.uint64(self._flags_ptr + 4 * src),
                        np.uint64(self._flags_ptr + 4 * len(self.inv.gpus)),
                        np.uint64(s.barrier_timeout_s * 1e9), a["sums"], a["trace"], a["clocks"]),
                       shared_mem=smem)
            launched.append((src, dsts, a))
        # Go once every source's producers are resident; the kernels bound their own wait.
        srcs = [src for src, _ in routes]
        deadline = time.monotonic() + s.barrier_timeout_s
        while not self._flags[srcs].all() and time.monotonic() < deadline:
            pass
        self._flags[-1] = 1
        frames, first_start = [], {}
        for src, dsts, a in launched:
            with cp.cuda.Device(src):
                try:
                    cp.cuda.Device(src).synchronize()
                except cp.cuda.runtime.CUDARuntimeError as e:  # sticky: name the point it hit
                    raise RuntimeError(f"{e} on GPU {src} at {p}") from e
                err = int(a["error"].get()[0])
                trace_h, clocks_h, sums_h = a["trace"].get(), a["clocks"].get(), a["sums"].get()
            if err:
                what = "start timeout" if err & _ERR_START_TIMEOUT else "barrier timeout"
                raise RuntimeError(f"ops kernel error flag {err:#x} ({what}) on GPU {src} at {p}")
            if len(set(clocks_h[:, 4].tolist())) != K:
                raise RuntimeError(f"producers shared SMs on GPU {src} at {p}")
            if op == "load16":
                self._check_loads(src, dsts, sums_h, K, B, n_slots, n_bursts)
            else:
                for i, d in enumerate(dsts):
                    self._check_ops_destination(src, d, i, len(dsts), op, volume, n_slots, B,
                                                n_bursts)
            rows = burst_rows(trace_h, clocks_h, warmup, B)
            self._clock_mhz[src] = float(rows["sm_clock_mhz"].iloc[0])
            first_start[src] = float(trace_h[0, :, 2].min())
            frames.append(rows.assign(src=src, dst=dsts[0] if len(dsts) == 1 else -1,
                                      n_dst=len(dsts), gap_set_us=gap_us, burst_volume=volume))
        starts = list(first_start.values())
        # %globaltimer of different GPUs: the spread of their first bursts' starts, an upper
        # bound of the start skew where the GPUs' timers agree (recorded, not assumed).
        return pd.concat(frames, ignore_index=True).assign(
            gpu_start_spread_ns=max(starts) - min(starts))

    def _check_ops_destination(self, src, dst, dst_index, n_dst, op, volume, n_slots, B,
                               n_bursts) -> None:
        cp, buf = self.cp, self._pair_buffer(src, dst)
        with cp.cuda.Device(dst):
            mismatches = cp.zeros(1, cp.uint64)
            self._module(dst).get_function("count_ops_mismatches")(
                (1024,), (256,),
                (buf, np.uint64(buf.size), np.uint64(volume // 4), np.uint32(n_slots),
                 np.uint32(B // 4), np.uint32(n_bursts), np.uint32(n_dst), np.uint32(dst_index),
                 np.uint32(OP_CODES[op]), np.uint32(self.seed), np.uint32(_POISON), mismatches))
            bad = int(mismatches.get()[0])
        if bad:
            raise RuntimeError(f"destination check failed ({op}, GPU {src} → {dst}): {bad} words "
                               f"differ from what the producers wrote (or poison was overwritten)")

    def _check_loads(self, src, dsts, sums, K, B, n_slots, n_bursts) -> None:
        """Each producer's loaded sum against the same sum taken over the buffer it read."""
        cp = self.cp
        want = np.zeros(K, np.uint64)
        for i, d in enumerate(dsts):
            with cp.cuda.Device(d):
                per = expected_load_sums(self._pair_buffer(src, d), K, B, n_slots, n_bursts,
                                         cp).get()
            mine = np.arange(K) % len(dsts) == i
            want[mine] = per[mine]
        bad = int((want != sums).sum())
        if bad:
            raise RuntimeError(f"load check failed (GPU {src} ← {dsts}): {bad} of {K} producers "
                               f"loaded sums that differ from their buffers'")
