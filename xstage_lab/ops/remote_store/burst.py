"""The host side of the Burst–Gap kernel (``kernels/remote_store_burst.cu``, paper §3.1): a
point's contract (``validate_point``), its launch through CuPy (``RemoteStoreBench``), the checks of
what the producers stored (on the device, and for host memory on the CPU:
``check_host_destination``), and the in-kernel clocks turned into one row per burst
(``burst_rows``).

A point: K ``producers`` (one CTA per SM) store ``burst_bytes`` each with 16-byte stores into a
destination buffer, then spin ``gap_us``. ``mode``: ``periodic``, ``isolated`` (each burst after a
recovery gap long enough to drain it) or ``fenced`` (each producer waits for its burst to be visible
before the gap); ``path``: ``remote`` (a peer GPU, or pinned host memory where ``dst`` is ``HOST``)
or ``local`` (the issuing GPU); ``lines``: ``fresh`` or ``rewrite``; ``align``: ``each`` or
``first``. The launch settings shared by a run are ``calibration.BenchSettings``.

CuPy is imported only when a ``RemoteStoreBench`` is made (the cuda backend)."""
from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

from ...calibration import BenchSettings
from ...kernel_sources import cuda_module
from ...platform import Inventory, LinkError, inventory, mapped_host_buffer

KIB = 1024
MODES = ("periodic", "isolated", "fenced")
PATHS = ("remote", "local")
LINES = ("fresh", "rewrite")
# "each": a grid barrier aligns the K producers before every burst (one aggregate burst of K·B
# bytes); "first": before the first burst only, after which the producers run free.
ALIGNS = ("each", "first")
_POISON = 0xA5A5A5A5
_ERR_BARRIER_TIMEOUT = 1
# ``dst`` of a point whose remote stores go to pinned host memory (the host link).
HOST = -1
# burst_pattern's odd multipliers (kernels/xstage_device.cuh), for the CPU's check of host memory.
_PATTERN_BURST, _PATTERN_VEC, _PATTERN_PRODUCER, _PATTERN_LAST = (
    0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)


def isolated_recovery_us(burst_volume: int, settings: BenchSettings) -> float:
    return settings.isolated_recovery_floor_us + burst_volume / (
        settings.isolated_recovery_rate_GBps * 1e3)


def check_choice(name: str, value, allowed: tuple) -> None:
    """ValueError unless ``value`` (a point's ``name`` field) is one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_burst_and_gap(B, G) -> None:
    """ValueError unless the burst is a positive whole number of 16-byte stores and the gap is
    not negative (nor NaN)."""
    if not isinstance(B, (int, np.integer)) or B <= 0 or B % 16:
        raise ValueError(f"burst_bytes B={B} must be a positive multiple of 16 (16-byte stores)")
    if not G >= 0:  # also refuses NaN
        raise ValueError(f"gap_us G={G} must not be negative")


def check_gpus(src: int, dst: int, inv: Inventory) -> None:
    """ValueError unless ``src`` names a GPU of ``inv`` and ``dst`` one too, or the host."""
    n = len(inv.gpus)
    if not (0 <= src < n and (dst == HOST or 0 <= dst < n)):
        raise ValueError(f"src={src} and dst={dst} must name GPUs 0..{n - 1} (dst {HOST}: host)")


def row_layout(producers: int, burst_bytes: int, chunk_bytes: int = 0,
               row_bytes: int = 0) -> tuple[int, int, int]:
    """Where a burst's 16-byte vectors land in a rotation slot: ``(chunk_vecs, row_vecs,
    slot_vecs)``. Row chunks (``chunk_bytes`` C and ``row_bytes`` S both set, the Combine
    epilogue's pattern: one C-byte chunk per S-byte row): the S / C producers of a group fill the
    same B / C rows side by side, ``ceil(K / (S / C))`` groups a slot. Contiguous (both 0): each
    producer's B bytes in one piece, ``K · B / 16`` vectors a slot."""
    vecs = burst_bytes // 16
    if not chunk_bytes and not row_bytes:
        return vecs, vecs, producers * vecs
    chunk, row = chunk_bytes // 16, row_bytes // 16
    if chunk_bytes % 16 or chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk_bytes={chunk_bytes} must be 16 bytes times a power of two")
    if row_bytes % chunk_bytes or row_bytes < chunk_bytes or burst_bytes % chunk_bytes:
        raise ValueError(f"row_bytes={row_bytes} and burst_bytes={burst_bytes} must be whole "
                         f"multiples of chunk_bytes={chunk_bytes}")
    per_row = row // chunk
    groups = -(-producers // per_row)
    return chunk, row, groups * (vecs // chunk) * row


def validate_point(p: dict, inv: Inventory, settings: BenchSettings = BenchSettings()) -> None:
    """Raise ValueError for a point that must not be launched; called before any launch."""
    K, B, G = p["producers"], p["burst_bytes"], p["gap_us"]
    check_choice("mode", p["mode"], MODES)
    check_choice("path", p["path"], PATHS)
    check_choice("lines", p.get("lines", "fresh"), LINES)
    check_choice("align", p.get("align", "each"), ALIGNS)
    check_burst_and_gap(B, G)
    src, dst = p["src"], p["dst"]
    check_gpus(src, dst, inv)
    sms = inv.gpus[src].sm_count
    if not isinstance(K, (int, np.integer)) or not 1 <= K <= sms:
        raise ValueError(f"producers K={K} must be in 1..{sms} (one CTA per SM of GPU {src})")
    if p["path"] == "remote" and dst != HOST:
        if src == dst:
            raise ValueError(f"remote mode needs a destination other than the source (GPU {src})")
        if not inv.can_access_peer(src, dst):
            raise ValueError(f"GPU {src} has no peer access to GPU {dst}")
    chunk, row = p.get("chunk_bytes", 0), p.get("row_bytes", 0)
    slot_bytes = 16 * row_layout(K, B, chunk, row)[2]
    if (chunk or row) and p["mode"] == "fenced":
        raise ValueError("row chunks are stored by burst_gap_rows, which has no fenced variant")
    if slot_bytes > settings.buffer_bytes:
        raise ValueError(f"burst volume K*B={K * B} (a slot of {slot_bytes} bytes) exceeds the "
                         f"{settings.buffer_bytes}-byte buffer")
    if settings.threads % 32 or not 32 <= settings.threads <= 992:
        raise ValueError("store threads per producer must be a multiple of 32 in 32..992")


# The finest step of burst_rows' measured columns (write_record's ``resolution``): one SM cycle at
# up to 2 GHz (0.5 ns) for the issue times and periods, a %globaltimer nanosecond for the window
# and the start skew. (gap_eff_us is left out of the record: records.DERIVED.)
BURST_RESOLUTION = {**dict.fromkeys(("t_iss_us", "t_iss_median_us", "t_iss_max_us", "t_iss_min_us",
                                     "period_us"), 5e-4),
                    "window_us": 1e-3, "start_skew_ns": 1.0}


def burst_rows(trace: np.ndarray, clocks: np.ndarray, warmup_bursts: int,
               burst_bytes: int) -> pd.DataFrame:
    """One row per burst from the kernel's clocks.

    ``trace`` is [n_bursts, K, 3] (issue-start clock, issue-end clock, issue-start %globaltimer);
    ``clocks`` is [K, 5] (entry timer, entry clock, exit timer, exit clock, SM id). Each
    producer's cycles become µs at the SM clock it measured over the launch.

    Producers that run free drift apart (unequal arbitration lets some race ahead), so the K
    producers overlap only inside a window: from the latest start of a first steady burst to the
    earliest start of a last burst. A producer's burst counts where it starts inside that window.
    The burst's issue time and period are means over those producers, as the fluid model's are
    time averages: under backpressure the arbitration serves producers unevenly, a few bursts
    wait long and most little, and a median would miss the waits (median, slowest and fastest
    issue times are kept beside). ``window_rate_GBps`` is the bytes the producers issued in the
    window over its length: with no gap it is the aggregate drain rate, however they drift.
    """
    trace = trace.astype(np.float64)
    clocks = clocks.astype(np.float64)
    n, K = trace.shape[:2]
    cycles_per_us = (clocks[:, 3] - clocks[:, 1]) / (clocks[:, 2] - clocks[:, 0]) * 1e3  # [K]
    issue = (trace[:, :, 1] - trace[:, :, 0]) / cycles_per_us                         # [n, K]
    period = np.full((n, K), np.nan)
    period[:-1] = np.diff(trace[:, :, 0], axis=0) / cycles_per_us
    start_ns = trace[:, :, 2]
    lo, hi = start_ns[warmup_bursts].max(), start_ns[-1].min()
    in_window = (start_ns >= lo) & (start_ns < hi)
    issue_w = np.where(in_window, issue, np.nan)
    period_w = np.where(in_window, period, np.nan)
    counted = in_window.any(axis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a burst no producer counts gives NaN
        t_iss, t_median = np.nanmean(issue_w, axis=1), np.nanmedian(issue_w, axis=1)
        per = np.nanmean(period_w, axis=1)
        t_max, t_min = np.nanmax(issue_w, axis=1), np.nanmin(issue_w, axis=1)
    window_us = (hi - lo) / 1e3
    rate = in_window.sum() * burst_bytes / (window_us * 1e3) if window_us > 0 else np.nan
    return pd.DataFrame({
        "burst": np.arange(n),
        "warmup": np.arange(n) < warmup_bursts,
        "producers_in_window": in_window.sum(axis=1),
        "t_iss_us": np.where(counted, t_iss, np.nan),
        "t_iss_median_us": np.where(counted, t_median, np.nan),
        "t_iss_max_us": np.where(counted, t_max, np.nan),
        "t_iss_min_us": np.where(counted, t_min, np.nan),
        "period_us": np.where(counted, per, np.nan),
        "gap_eff_us": np.where(counted, per - t_iss, np.nan),
        "start_skew_ns": start_ns.max(axis=1) - start_ns.min(axis=1),
        "window_us": window_us,
        "window_rate_GBps": rate,
        "sm_clock_mhz": np.median(cycles_per_us),
    })


class RemoteStoreBench:
    """Launches Burst–Gap points on this machine's GPUs (CuPy RawModule, NVRTC for the device)."""

    def __init__(self, settings: BenchSettings = BenchSettings(), inv: Inventory | None = None):
        import cupy  # the cuda backend only

        self.cp = cupy
        self.settings = settings
        self.inv = inventory() if inv is None else inv
        self._modules: dict[int, object] = {}
        self._buffers: dict[int, object] = {}
        self.host = None  # the host link's MappedHostBuffer, made by host_buffer
        self._peers_enabled: set[tuple[int, int]] = set()
        self._clock_mhz: dict[int, float] = {}
        # a fresh pattern per bench: a buffer left by an earlier run cannot pass the check
        self.seed = np.random.default_rng().integers(1, 2**31)

    def validate(self, p: dict) -> None:
        validate_point(p, self.inv, self.settings)

    def _module(self, dev: int):
        if dev not in self._modules:
            with self.cp.cuda.Device(dev):
                self._modules[dev] = cuda_module("remote_store_burst.cu")
        return self._modules[dev]

    def _buffer(self, dev: int):
        if dev not in self._buffers:
            with self.cp.cuda.Device(dev):
                self._buffers[dev] = self.cp.empty(self.settings.buffer_bytes // 4, self.cp.uint32)
        return self._buffers[dev]

    def host_buffer(self, src: int):
        """The host link's destination: ``buffer_bytes`` of mapped pinned host memory for GPU
        ``src`` (one per bench)."""
        if self.host is None:
            self.host = mapped_host_buffer(self.settings.buffer_bytes, src)
        elif self.host.device != src:
            raise LinkError(f"the host buffer is mapped for GPU {self.host.device}, not {src}")
        return self.host

    def copy_engine_rate(self, src: int, repeats: int = 21, warmup: int = 3) -> dict:
        """The copy engine's device-to-host rate from GPU ``src`` into the host buffer
        (cudaMemcpyAsync of the whole buffer, timed by events): the baseline the host link's
        drain rate R is read against. Median and interquartile range over ``repeats``."""
        cp, host = self.cp, self.host_buffer(src)
        rt = cp.cuda.runtime
        src_buf = self._buffer(src)
        with cp.cuda.Device(src):
            stream = cp.cuda.Stream(non_blocking=True)
            times = []
            for i in range(warmup + repeats):
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(stream)
                rt.memcpyAsync(host.ptr, src_buf.data.ptr, host.nbytes,
                               rt.memcpyDeviceToHost, stream.ptr)
                end.record(stream)
                end.synchronize()
                if i >= warmup:
                    times.append(cp.cuda.get_elapsed_time(start, end))
        rates = host.nbytes / (np.asarray(times) * 1e6)  # bytes / (ms · 1e6) = GB/s
        return {"bytes": host.nbytes, "repeats": repeats,
                "rate_GBps": float(np.median(rates)),
                "rate_GBps_iqr": [float(x) for x in np.percentile(rates, [25, 75])]}

    def _enable_peer(self, src: int, dst: int) -> None:
        if src == dst or dst == HOST or (src, dst) in self._peers_enabled:
            return
        with self.cp.cuda.Device(src):
            try:
                self.cp.cuda.runtime.deviceEnablePeerAccess(dst)
            except self.cp.cuda.runtime.CUDARuntimeError as e:
                if "AlreadyEnabled" not in str(e):
                    raise
        self._peers_enabled.add((src, dst))

    def sm_clock_mhz(self, dev: int = 0, window_us: float = 5000.0) -> float:
        """SM clock of GPU ``dev``: clock64 cycles over a %globaltimer window on one SM."""
        cp = self.cp
        with cp.cuda.Device(dev):
            out = cp.zeros(4, cp.uint64)
            self._module(dev).get_function("sample_sm_clock")(
                (1,), (32,), (np.uint64(window_us * 1e3), out))
            t0, c0, t1, c1 = (int(x) for x in out.get())
        mhz = (c1 - c0) / (t1 - t0) * 1e3
        self._clock_mhz[dev] = mhz
        return mhz

    def measure(self, p: dict, check_on_cpu: bool = False) -> pd.DataFrame:
        """Run one point (one launch) and return its per-burst rows; raises if the destination
        buffer does not hold exactly what the producers wrote or a barrier timed out. With
        ``check_on_cpu`` the host link's destination is also read back and checked on the CPU."""
        self.validate(p)
        cp, s = self.cp, self.settings
        K, B = int(p["producers"]), int(p["burst_bytes"])
        src = int(p["src"])
        dst = src if p["path"] == "local" else int(p["dst"])
        volume = K * B
        chunk_bytes, row_bytes = p.get("chunk_bytes", 0), p.get("row_bytes", 0)
        chunk_vecs, row_vecs, slot_vecs = row_layout(K, B, chunk_bytes, row_bytes)
        layout = (K, B // 16, chunk_vecs, row_vecs)
        isolated = p["mode"] == "isolated"
        n_bursts = s.isolated_bursts if isolated else s.periodic_bursts
        warmup = s.isolated_warmup_bursts if isolated else s.periodic_warmup_bursts
        gap_us = isolated_recovery_us(volume, s) if isolated else float(p["gap_us"])
        n_slots = (1 if p.get("lines", "fresh") == "rewrite"
                   else s.buffer_bytes // (16 * slot_vecs))
        self._enable_peer(src, dst)
        mhz = self._clock_mhz.get(src) or self.sm_clock_mhz(src)

        if dst == HOST:
            host = self.host_buffer(src)
            host.words().fill(_POISON)
            buf_ptr, check_dev = host.ptr, src  # the GPU reads host memory back through UVA
        else:
            buf = self._buffer(dst)
            with cp.cuda.Device(dst):
                buf.fill(_POISON)
                cp.cuda.Device(dst).synchronize()
            buf_ptr, check_dev = buf.data.ptr, dst
        gpu = self.inv.gpus[src]
        # More than half of an SM's shared memory per CTA: no two producers share an SM.
        smem = min(gpu.max_smem_per_sm // 2 + 1024, gpu.max_smem_per_block_optin)
        with cp.cuda.Device(src):
            rows = bool(chunk_bytes or row_bytes)
            kernel = self._module(src).get_function(
                "burst_gap_rows" if rows else
                "burst_gap_fenced" if p["mode"] == "fenced" else "burst_gap")
            kernel.max_dynamic_shared_size_bytes = smem
            arrivals = cp.zeros(1, cp.uint32)
            error = cp.zeros(1, cp.uint32)
            trace = cp.zeros((n_bursts, K, 3), cp.uint64)
            clocks = cp.zeros((K, 5), cp.uint64)
            pattern = ((np.uint32(chunk_vecs.bit_length() - 1), np.uint32(row_vecs)) if rows
                       else ())
            kernel((K,), (s.threads + 32,),
                   (np.uint64(buf_ptr), np.uint64(slot_vecs), np.uint32(n_slots),
                    np.uint32(B // 16), *pattern, np.uint32(n_bursts),
                    np.uint64(round(gap_us * mhz)),
                    np.uint32(isolated or p.get("align", "each") == "each"),
                    np.uint32(self.seed), arrivals, error,
                    np.uint64(s.barrier_timeout_s * 1e9), trace, clocks),
                   shared_mem=smem)
            cp.cuda.Device(src).synchronize()
            err = int(error.get()[0])
            trace_h, clocks_h = trace.get(), clocks.get()
        if err:
            raise RuntimeError(f"burst kernel error flag {err:#x} (barrier timeout) at {p}")
        if len(set(clocks_h[:, 4].tolist())) != K:
            raise RuntimeError(f"producers shared SMs at {p}: the one-CTA-per-SM premise failed")
        self._check_destination(check_dev, buf_ptr, slot_vecs, n_slots, layout, n_bursts)
        if check_on_cpu and dst == HOST:
            bad = check_host_destination(self.host.words(), slot_vecs, n_slots, layout,
                                         n_bursts, int(self.seed), _POISON)
            if bad:
                raise RuntimeError(f"host memory read back on the CPU: {bad} 16-byte vectors "
                                   f"differ from what the producers wrote at {p}")
        rows = burst_rows(trace_h, clocks_h, warmup, B)
        self._clock_mhz[src] = float(rows["sm_clock_mhz"].iloc[0])
        return rows.assign(gap_set_us=gap_us, dst_used=dst, burst_volume=volume)

    def _check_destination(self, dev, buf_ptr, slot_vecs, n_slots, layout, n_bursts) -> None:
        cp = self.cp
        producers, vecs_per_producer, chunk_vecs, row_vecs = layout
        with cp.cuda.Device(dev):
            mismatches = cp.zeros(1, cp.uint64)
            self._module(dev).get_function("count_burst_mismatches")(
                (1024,), (256,),
                (np.uint64(buf_ptr), np.uint64(self.settings.buffer_bytes // 16),
                 np.uint64(slot_vecs), np.uint32(n_slots), np.uint32(producers),
                 np.uint32(vecs_per_producer), np.uint32(chunk_vecs), np.uint32(row_vecs),
                 np.uint32(n_bursts), np.uint32(self.seed), np.uint32(_POISON), mismatches))
            bad = int(mismatches.get()[0])
        if bad:
            raise RuntimeError(f"destination check failed: {bad} 16-byte vectors differ from what "
                               f"the producers wrote (or poison was overwritten)")


def check_host_destination(words: np.ndarray, slot_vecs: int, n_slots: int, layout: tuple,
                           n_bursts: int, seed: int, poison: int) -> int:
    """The 16-byte vectors of host memory (``words``, uint32) that differ from what a burst
    launch must have left there, counted on the CPU: each used rotation slot holds the
    ``burst_pattern`` of the last burst that wrote it where ``layout`` = ``(producers,
    vecs_per_producer, chunk_vecs, row_vecs)`` puts a store (``row_layout``), every other vector
    still holds poison. The CPU's twin of the kernel ``count_burst_mismatches``."""
    producers, vpp, chunk, row = layout
    vecs = words.reshape(-1, 4)
    used = min(n_bursts, n_slots)
    written = used * slot_vecs
    bad = int(np.count_nonzero((vecs[written:] != np.uint32(poison)).any(axis=1)))
    got = vecs[:written].reshape(used, slot_vecs, 4)
    if chunk == row == vpp:  # contiguous: a slot is [producer, vec] in order, each one stored
        stored = got.reshape(used, producers, vpp, 4)  # a view: no gather, no unstored place
    else:
        # where producer p's vector v lands in a slot (burst_gap_body's addressing)
        p = np.arange(producers)[:, None]
        v = np.arange(vpp)[None, :]
        at = ((p // (row // chunk)) * (vpp // chunk) * row + (p % (row // chunk)) * chunk
              + (v // chunk) * row + v % chunk)
        stored = got[:, at]
        untouched = np.ones(slot_vecs, dtype=bool)
        untouched[at.ravel()] = False
        bad += int(np.count_nonzero((got[:, untouched] != np.uint32(poison)).any(axis=-1)))
    # burst_pattern(seed, burst, producer, vec), in uint32 arithmetic that wraps as the device's
    w1 = np.arange(vpp, dtype=np.uint32) * np.uint32(_PATTERN_VEC)
    w2 = (np.arange(producers, dtype=np.uint32) * np.uint32(_PATTERN_PRODUCER))[:, None] ^ w1
    slot = np.arange(used, dtype=np.uint32)
    last_burst = slot + (np.uint32(n_bursts - 1) - slot) // np.uint32(n_slots) * np.uint32(n_slots)
    tag = (np.uint32(seed) ^ (last_burst * np.uint32(_PATTERN_BURST)))[:, None, None]
    # stored: [slot, producer, vec, word]
    ok = ((stored[..., 0] == (tag ^ w1)) & (stored[..., 1] == w1) & (stored[..., 2] == w2)
          & (stored[..., 3] == (tag ^ w2) * np.uint32(_PATTERN_LAST)))
    return bad + int(np.count_nonzero(~ok))
