"""Remote-store characterization (paper §3, Fig. 3): the Burst–Gap microbenchmark on live GPUs.

    python -m xstage_lab.experiments.remote_store.characterization (--out FILE | --root DIR) \\
        [--link nvlink|host] [--repeats 11] [--src 0] [--dst 1] [--only drain_rate,gap,...]

``kernels/remote_store_burst.cu`` runs K producers (one CTA per SM) that repeatedly store B bytes
each with 16-byte stores into a destination buffer, then spin for a gap G. This module validates
a measurement point, launches it through CuPy, checks the destination buffer holds exactly what
was written, and turns the in-kernel clocks into one row per burst.

Links (``--link``): ``nvlink`` stores into a peer GPU's buffer; ``host`` into pinned host memory
mapped for the device (``platform.mapped_host_buffer``, on the GPU's NUMA node), across PCIe, a
path every GPU has: its records are the platform ``<gpu>-host``, its sweeps scaled to the slower
link, and the copy engine's device-to-host rate is measured in the same run as R's baseline. What
the producers stored into host memory is checked on the device after every launch and read back
and checked on the CPU before each point is timed (``check_host_destination``).

Modes: ``periodic`` (burst, gap, burst, ...), ``isolated`` (each burst after a recovery gap long
enough to drain it) and ``fenced`` (periodic, but each producer waits for its burst to be visible
at the destination before the gap: the completion-coupled counterfactual). Paths: ``remote`` (destination on a peer GPU) and ``local`` (the control: the
same code with the destination on the issuing GPU).

An ``Experiment`` run in process by ``experiments.harness``: its ``Sweep``s are
``characterization_sweeps`` (rows tagged with ``sweep``); the record is ``remote_store``, or
``remote_store_partial`` where ``--only`` leaves out a sweep the calibration needs.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ...calibration import (Calibration, calibrate, calibration_to_dict, launch_means,
                           point_table)
from ...kernel_sources import cuda_module
from ...platform import LINKS, Inventory, LinkError, git_commit, inventory, mapped_host_buffer
from ...records import RECORDS_DIR, Record, read_record, write_record
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment

KIB = 1024
MIB = 1024 * KIB
MODES = ("periodic", "isolated", "fenced")
PATHS = ("remote", "local")
LINES = ("fresh", "rewrite")
# "each": a grid barrier aligns the K producers before every burst (one aggregate burst of K·B
# bytes); "first": before the first burst only, after which the producers run free.
ALIGNS = ("each", "first")
# The sweeps M_X is fitted from (calibration.calibrate).
CALIBRATION_SWEEPS = ("drain_rate", "gap", "isolated")
_POISON = 0xA5A5A5A5
_ERR_BARRIER_TIMEOUT = 1
# ``dst`` of a point whose remote stores go to pinned host memory (the host link).
HOST = -1
# burst_pattern's odd multipliers (kernels/xstage_device.cuh), for the CPU's check of host memory.
_PATTERN_BURST, _PATTERN_VEC, _PATTERN_PRODUCER, _PATTERN_LAST = (
    0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)


@dataclass(frozen=True)
class BenchSettings:
    """Launch settings shared by every point of a characterization run."""

    threads: int = 512                 # store threads per producer CTA (plus one timekeeper warp)
    periodic_bursts: int = 96          # bursts per periodic launch
    periodic_warmup_bursts: int = 16   # first bursts of a launch, before steady state
    isolated_bursts: int = 8
    isolated_warmup_bursts: int = 1
    # Rotation buffer for fresh destination lines: several times the 60 MiB L2 of an H200.
    buffer_bytes: int = 256 * MIB
    # An isolated burst waits this long after the previous one: a floor plus V at a rate far
    # below any NVLink drain rate, so X-Stage is empty when it starts.
    isolated_recovery_floor_us: float = 20.0
    isolated_recovery_rate_GBps: float = 50.0
    barrier_timeout_s: float = 2.0


def link_settings(link: str) -> BenchSettings:
    """The launch settings of a link. On the host link, whose capacity Q holds tens of small
    bursts, a periodic launch runs longer and leaves more warm-up bursts out, so that the backlog
    has filled Q before the steady window starts (a burst adds V − R·(T_iss^0 + G) to it); an
    isolated burst's recovery assumes a rate well below PCIe's, so the X-Stage is empty when the
    next starts."""
    if link == "host":
        return BenchSettings(periodic_bursts=256, periodic_warmup_bursts=128,
                             isolated_recovery_rate_GBps=10.0)
    return BenchSettings()


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
    if K * B > settings.buffer_bytes:
        raise ValueError(f"burst volume K*B={K * B} exceeds the {settings.buffer_bytes}-byte buffer")
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
        isolated = p["mode"] == "isolated"
        n_bursts = s.isolated_bursts if isolated else s.periodic_bursts
        warmup = s.isolated_warmup_bursts if isolated else s.periodic_warmup_bursts
        gap_us = isolated_recovery_us(volume, s) if isolated else float(p["gap_us"])
        n_slots = 1 if p.get("lines", "fresh") == "rewrite" else s.buffer_bytes // volume
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
            kernel = self._module(src).get_function(
                "burst_gap_fenced" if p["mode"] == "fenced" else "burst_gap")
            kernel.max_dynamic_shared_size_bytes = smem
            arrivals = cp.zeros(1, cp.uint32)
            error = cp.zeros(1, cp.uint32)
            trace = cp.zeros((n_bursts, K, 3), cp.uint64)
            clocks = cp.zeros((K, 5), cp.uint64)
            kernel((K,), (s.threads + 32,),
                   (np.uint64(buf_ptr), np.uint64(volume // 16), np.uint32(n_slots),
                    np.uint32(B // 16), np.uint32(n_bursts), np.uint64(round(gap_us * mhz)),
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
        self._check_destination(check_dev, buf_ptr, volume, n_slots, B, n_bursts)
        if check_on_cpu and dst == HOST:
            bad = check_host_destination(self.host.words(), volume // 16, n_slots, B // 16,
                                         n_bursts, int(self.seed), _POISON)
            if bad:
                raise RuntimeError(f"host memory read back on the CPU: {bad} 16-byte vectors "
                                   f"differ from what the producers wrote at {p}")
        rows = burst_rows(trace_h, clocks_h, warmup, B)
        self._clock_mhz[src] = float(rows["sm_clock_mhz"].iloc[0])
        return rows.assign(gap_set_us=gap_us, dst_used=dst, burst_volume=volume)

    def _check_destination(self, dev, buf_ptr, volume, n_slots, B, n_bursts) -> None:
        cp = self.cp
        with cp.cuda.Device(dev):
            mismatches = cp.zeros(1, cp.uint64)
            self._module(dev).get_function("count_burst_mismatches")(
                (1024,), (256,),
                (np.uint64(buf_ptr), np.uint64(self.settings.buffer_bytes // 16),
                 np.uint64(volume // 16), np.uint32(n_slots),
                 np.uint32(B // 16), np.uint32(n_bursts), np.uint32(self.seed),
                 np.uint32(_POISON), mismatches))
            bad = int(mismatches.get()[0])
        if bad:
            raise RuntimeError(f"destination check failed: {bad} 16-byte vectors differ from what "
                               f"the producers wrote (or poison was overwritten)")


def check_host_destination(words: np.ndarray, slot_vecs: int, n_slots: int,
                           vecs_per_producer: int, n_bursts: int, seed: int, poison: int) -> int:
    """The 16-byte vectors of host memory (``words``, uint32) that differ from what a burst
    launch must have left there, counted on the CPU: each used rotation slot holds the
    ``burst_pattern`` of the last burst that wrote it, every other vector still holds poison.
    The CPU's twin of the kernel ``count_burst_mismatches``."""
    vecs = words.reshape(-1, 4)
    used = min(n_bursts, n_slots)
    written = used * slot_vecs
    bad = int(np.count_nonzero((vecs[written:] != np.uint32(poison)).any(axis=1)))
    got = vecs[:written].reshape(used, -1, vecs_per_producer, 4)  # [slot, producer, vec, word]
    # burst_pattern(seed, burst, producer, vec), in uint32 arithmetic that wraps as the device's
    w1 = np.arange(vecs_per_producer, dtype=np.uint32) * np.uint32(_PATTERN_VEC)
    w2 = (np.arange(got.shape[1], dtype=np.uint32) * np.uint32(_PATTERN_PRODUCER))[:, None] ^ w1
    slot = np.arange(used, dtype=np.uint32)
    last_burst = slot + (np.uint32(n_bursts - 1) - slot) // np.uint32(n_slots) * np.uint32(n_slots)
    tag = (np.uint32(seed) ^ (last_burst * np.uint32(_PATTERN_BURST)))[:, None, None]
    ok = ((got[..., 0] == (tag ^ w1)) & (got[..., 1] == w1) & (got[..., 2] == w2)
          & (got[..., 3] == (tag ^ w2) * np.uint32(_PATTERN_LAST)))
    return bad + int(np.count_nonzero(~ok))


def KIBS(*kib: int) -> list[int]:
    return [k * KIB for k in kib]


def host_link_sweeps(sm_count: int, src: int = 0, repeats: int = 11,
                     settings: BenchSettings = link_settings("host")) -> list[Sweep]:
    """The Fig. 3 sweeps on the host link (stores into pinned host memory, ``dst = HOST``),
    scaled to a drain some ten times slower than NVLink's: smaller bursts in the gap and fenced
    sweeps with gaps out to several V/R, so that each burst size reaches its recovered plateau;
    isolated bursts at every K of the NVLink sweep (K = all SMs, 1/2, 1/4, 1/8) and B out to a
    burst volume of half the buffer, far enough to find a knee set by a capacity of tens of MiB.
    No ``pairs`` sweep: a GPU has one host link."""
    K = sm_count
    Ks = sorted({max(1, K // 8), max(1, K // 4), max(1, K // 2), K})
    fixed = dict(src=src, dst=HOST, lines="fresh")
    gaps = [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 24.0, 32.0, 40.0, 48.0,
            64.0, 96.0, 128.0]
    largest = settings.buffer_bytes // 2
    isolated_b = KIBS(1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048,
                      3072, 4096, 6144)
    return [
        Sweep("drain_rate", (Axis("align", ALIGNS), Axis("producers", Ks),
                             Axis("burst_bytes", KIBS(8, 16, 32, 64, 128, 256))),
              fixed=dict(fixed, mode="periodic", path="remote", gap_us=0.0), repeats=repeats),
        Sweep("gap", (Axis("path", PATHS), Axis("burst_bytes", KIBS(2, 4, 8, 16)),
                      Axis("gap_us", gaps)),
              fixed=dict(fixed, mode="periodic", producers=K, align="first"), repeats=repeats),
        Sweep("isolated", (Axis("path", PATHS),
                           Axis("shape", [{"producers": k, "burst_bytes": b} for k in Ks
                                          for b in isolated_b if k * b <= largest])),
              fixed=dict(fixed, mode="isolated", gap_us=0.0, align="each"), repeats=repeats),
        Sweep("fenced", (Axis("path", PATHS), Axis("burst_bytes", KIBS(2, 4, 8, 16)),
                         Axis("gap_us", [0.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0])),
              fixed=dict(fixed, mode="fenced", producers=K, align="each"), repeats=repeats),
        Sweep("lines", (Axis("lines", LINES), Axis("burst_bytes", KIBS(32, 128))),
              fixed=dict(src=src, dst=HOST, mode="periodic", path="remote", gap_us=0.0,
                         producers=K, align="first"), repeats=repeats),
    ]


def characterization_sweeps(sm_count: int, n_gpus: int, src: int = 0, dst: int = 1,
                            repeats: int = 11) -> list[Sweep]:
    """The sweeps behind Fig. 3, declared as axes, for a GPU with ``sm_count`` SMs.

    - ``drain_rate`` (Fig. 3d): zero-gap periodic bursts over K/B decompositions.
    - ``gap`` (Figs. 3a, 3b): the gap sweep at K = all SMs, remote and the local control.
    - ``isolated`` (Fig. 3c): isolated bursts over B for several K, remote and local.
    - ``fenced``: the gap sweep with a system-scope fence after each burst (issue 8), aligned:
      a fenced burst leaves nothing outstanding, so the barrier before the next absorbs no wait
      and every burst is the aggregate V = K·B that the completion-coupled sum law describes.
    - ``lines``: fresh destination lines against rewriting the same lines (a known bias).
    - ``pairs``: zero-gap periodic bursts on every ordered GPU pair, for R per pair.
    """
    K = sm_count
    Ks = sorted({max(1, K // 8), max(1, K // 4), max(1, K // 2), K})
    common = dict(src=src, dst=dst, lines="fresh", align="each")
    return [
        Sweep("drain_rate", (Axis("align", ALIGNS), Axis("producers", Ks),
                             Axis("burst_bytes", [8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB,
                                                  128 * KIB, 256 * KIB])),
              fixed=dict(src=src, dst=dst, lines="fresh", mode="periodic", path="remote",
                         gap_us=0.0), repeats=repeats),
        Sweep("gap", (Axis("path", PATHS),
                      Axis("burst_bytes", [8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB]),
                      Axis("gap_us", [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0,
                                      12.0, 16.0, 24.0, 32.0, 48.0, 64.0])),
              fixed=dict(src=src, dst=dst, lines="fresh", mode="periodic", producers=K,
                         align="first"), repeats=repeats),
        Sweep("isolated", (Axis("path", PATHS), Axis("producers", Ks[-3:]),
                           Axis("burst_bytes", [k * KIB for k in (1, 2, 4, 8, 12, 16, 20, 24, 28,
                                                                  32, 36, 40, 48, 56, 64, 96, 128,
                                                                  192, 256)])),
              fixed=dict(common, mode="isolated", gap_us=0.0), repeats=repeats),
        Sweep("fenced", (Axis("path", PATHS),
                         Axis("burst_bytes", [8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB]),
                         Axis("gap_us", [0.0, 1.0, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0])),
              fixed=dict(src=src, dst=dst, lines="fresh", mode="fenced", producers=K,
                         align="each"), repeats=repeats),
        Sweep("lines", (Axis("lines", LINES), Axis("burst_bytes", [32 * KIB, 128 * KIB])),
              fixed=dict(src=src, dst=dst, mode="periodic", path="remote", gap_us=0.0,
                         producers=K, align="first"), repeats=repeats),
        Sweep("pairs", (Axis("route", [{"src": a, "dst": b} for a in range(n_gpus)
                                       for b in range(n_gpus) if a != b]),
                        Axis("burst_bytes", [64 * KIB, 256 * KIB])),
              fixed=dict(mode="periodic", path="remote", gap_us=0.0, producers=K, lines="fresh",
                         align="first"),
              repeats=max(3, repeats // 2)),
    ]


SWEEP_NAMES = tuple(s.name for s in characterization_sweeps(1, 2))


class BurstGapCharacterization(Experiment):
    """The Fig. 3 sweeps (``characterization_sweeps``) on this machine's GPUs, one record.

    Each launch checks its destination buffer (poisoned first) and its barriers itself
    (``RemoteStoreBench.measure``): a point's first launch, its warm-up, fails the run before any
    of its repeats is kept."""

    name = "remote_store"
    paper = "§3, Fig. 3"
    launch = "in_process"
    resolution = BURST_RESOLUTION

    def add_arguments(self, p) -> None:
        p.add_argument("--link", default="nvlink",
                       help=f"where the remote stores go, one of {list(LINKS)}: a peer GPU, or "
                            "pinned host memory mapped for the GPU (one GPU suffices)")
        p.add_argument("--repeats", type=int, default=11)
        p.add_argument("--src", type=int, default=0)
        p.add_argument("--dst", type=int, default=1)
        p.add_argument("--only", default=None,
                       help=f"comma list of the sweeps to run, of {list(SWEEP_NAMES)}")
        p.set_defaults(settings=None)  # run_characterization may pass others

    def check_args(self, a) -> None:
        if a.link not in LINKS:
            raise ValueError(f"--link must be one of {list(LINKS)}, got {a.link!r}")
        if a.settings is None:
            a.settings = link_settings(a.link)
        if a.only is not None:
            a.only = tuple(x for x in a.only.split(",") if x)
            bad = [x for x in a.only if x not in SWEEP_NAMES]
            if bad or not a.only:
                raise ValueError(f"--only: unknown sweeps {bad}; choose from {list(SWEEP_NAMES)}")
        if a.repeats < 1:
            raise ValueError("--repeats must be >= 1")

    def sweeps(self, args) -> list[Sweep]:
        self.inv = inventory()
        host = args.link == "host"
        if not self.inv.gpus:
            raise LinkError(f"the {args.link} link needs a GPU; none is visible ({self.inv.error})")
        check_gpus(args.src, HOST if host else args.dst, self.inv)
        sms = self.inv.gpus[args.src].sm_count
        sweeps = (host_link_sweeps(sms, args.src, args.repeats, args.settings) if host else
                  characterization_sweeps(sms, len(self.inv.gpus), args.src, args.dst,
                                          args.repeats))
        if host and args.only is not None and "pairs" in args.only:
            raise ValueError("--only pairs: the host link has one route, no pairs sweep")
        return [s for s in sweeps if args.only is None or s.name in args.only]

    def start(self, run) -> None:
        self.bench = RemoteStoreBench(run.args.settings, self.inv)
        self.copy_engine = (self.bench.copy_engine_rate(run.args.src)
                            if run.args.link == "host" else None)

    def validate(self, point, run) -> None:
        self.bench.validate(point)

    def sm_clock_mhz(self, run):
        return self.bench.sm_clock_mhz(run.args.src)

    def check(self, point, run) -> list[str]:
        """One launch of the point, its destination poisoned first and checked after (on the
        device, and for host memory read back on the CPU too), before any launch is timed."""
        try:
            self.bench.measure(point, check_on_cpu=True)
        except RuntimeError as e:
            return [str(e)]
        return []

    def measure(self, point, run) -> pd.DataFrame:
        return self.bench.measure(point)

    def finish(self, table, run) -> pd.DataFrame:
        # the calibration picks its sweeps by this column, also where ``--only`` names one
        return table if "sweep" in table else table.assign(sweep=run.args.only[0])

    def metadata(self, run) -> dict:
        args = run.args
        host = args.link == "host"
        facts = {"link": args.link, "settings": args.settings.__dict__, "src": args.src,
                 "dst": HOST if host else args.dst, "seed": int(self.bench.seed)}
        if host:
            facts |= {"host_memory": self.bench.host.numa, "copy_engine_d2h": self.copy_engine}
        return facts

    def record_name(self, args) -> str:
        """``remote_store`` where the run holds every sweep of ``CALIBRATION_SWEEPS``, else
        ``remote_store_partial``, which replay and calibration do not pick up."""
        complete = args.only is None or set(CALIBRATION_SWEEPS) <= set(args.only)
        return self.name if complete else "remote_store_partial"

    def derived(self, path, root) -> list[Path]:
        """The calibration fitted from a complete run's record."""
        return [write_calibration(path, root)] if path.parent.parent.name == self.name else []

    @classmethod
    def analyse(cls, record, root):
        return Characterization.from_record(record)


EXPERIMENT = BurstGapCharacterization()


def run_characterization(repeats: int = 11, src: int = 0, dst: int = 1,
                         only: tuple[str, ...] | None = None,
                         settings: BenchSettings | None = None, progress: bool = True,
                         root: Path = RECORDS_DIR, link: str = "nvlink") -> Path:
    """Run the Fig. 3 sweeps on this machine and save them as one ``remote_store`` record, or,
    where ``only`` leaves out a sweep the calibration needs, a ``remote_store_partial`` one (which
    replay and calibration do not pick up). Every point of every sweep is validated before the
    first launch. Returns the record's path."""
    args = harness.parse(EXPERIMENT, ["--root", str(root), "--link", link,
                                      "--repeats", str(repeats),
                                      "--src", str(src), "--dst", str(dst),
                                      *(["--only", ",".join(only)] if only is not None else []),
                                      *([] if progress else ["--no-progress"])])
    args.settings = settings or link_settings(link)
    return harness.run(EXPERIMENT, args)


def calibrate_record(rec: Record) -> tuple[Calibration, pd.DataFrame]:
    """``calibrate`` on a ``remote_store`` record, with the link and copy-engine rate of its
    header."""
    copy_engine = rec.params.get("copy_engine_d2h")
    return calibrate(rec.table, rec.platform, rec.record_id, link=rec.params.get("link", "nvlink"),
                     copy_engine_GBps=copy_engine["rate_GBps"] if copy_engine else None)


def write_calibration(record_path: Path | str, root: Path = RECORDS_DIR) -> Path:
    """Fit M_X from a ``remote_store`` record and save it as a ``calibration`` record (one row per
    fitted quantity; the full fit in its parameters), for the later experiments to load."""
    rec = read_record(record_path)
    cal, _ = calibrate_record(rec)
    table = pd.DataFrame([{"quantity": k, "value": json.dumps(v)} for k, v in cal.summary().items()])
    params = {"source_record": rec.record_id, "calibrated_with_commit": git_commit(),
              "calibration": calibration_to_dict(cal)}
    return write_record("calibration", rec.platform, table, params, rec.provenance, root)


@dataclass(frozen=True)
class Characterization:
    """One platform's characterization: its record, the fitted M_X, the gap sweep with the
    no-refit predictions, and every point's medians over repeats."""

    record: Record
    calibration: Calibration
    predicted: pd.DataFrame
    points: pd.DataFrame

    def sweep(self, name: str) -> pd.DataFrame:
        return self.points[self.points["sweep"] == name]

    @classmethod
    def from_record(cls, rec: Record) -> "Characterization":
        cal, predicted = calibrate_record(rec)
        return cls(rec, cal, predicted, point_table(launch_means(rec.table)))


def latest_calibration(platform: str, root: Path = RECORDS_DIR) -> Calibration:
    """M_X of ``platform`` from its latest calibration record, for the experiments that use it."""
    from ...calibration import calibration_from_dict
    from ...records import latest_record

    return calibration_from_dict(latest_record("calibration", platform, root).params["calibration"])


if __name__ == "__main__":
    harness.main(EXPERIMENT)
