"""The host side of the X-Stage-under-load probe (``kernels/host_store_load.cu``, issue 26): a
point's contract (``validate_load_point``), its launch through CuPy (``HostLoadProbe``), the
checks of what it stored and loaded against references computed on the CPU
(``check_store_regions``, ``expected_load_sums``), and one row per launch (``load_rows``).

A point: store warps inject sustained 16-byte stores (no gap) into pinned host memory
(``stores="host"``), into the GPU's own memory (``"local"``, the control) or not at all
(``"none"``), while load warps stream 16-byte reads of a local buffer four times the H200's
60 MiB L2 and more (``load=1``) or do not (``load=0``), all in one launch. ``layout``:
``split``, ``producers`` K CTAs store with every warp and the other SMs load (does a backpressured
host link slow other SMs' memory traffic?); ``shared``, every SM stores with half its warps and
loads with the other half, as a fused kernel's SMs both store and compute
(``producers`` = all SMs). What a point measures: the aggregate rate of the store warps (with
the X-Stage full, the host link's drain rate) and of the load warps, each over a window that
starts after the X-Stage has filled.

CuPy is imported only when a ``HostLoadProbe`` is made (the cuda backend)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...kernel_sources import cuda_module
from ...platform import Inventory, inventory, mapped_host_buffer
from .burst import (_PATTERN_BURST, _PATTERN_LAST, _PATTERN_PRODUCER, _PATTERN_VEC, _POISON,
                    HOST, check_choice, check_gpus)

MODE = "under_load"
STORES = ("host", "local", "none")
LAYOUTS = ("split", "shared")
WARPS = 16                # per CTA (512 threads), one CTA per SM
STORE_UNROLL, LOAD_UNROLL = 4, 8   # the kernel's vectors per lane per iteration
STORE_ITER_BYTES = 32 * STORE_UNROLL * 16
LOAD_ITER_BYTES = 32 * LOAD_UNROLL * 16
_ERR_BARRIER_TIMEOUT, _ERR_ITERATION_BOUND = 1, 4
_STAMP_POISON = np.uint64(0xFFFFFFFFFFFFFFFF)
# No warp issues faster than this (16-byte stores or loads of one warp, GB/s): the iteration
# bound of the kernel's loop, far above any measured rate, whose reach is an error.
_WARP_RATE_BOUND_GBPS = 200.0


@dataclass(frozen=True)
class LoadSettings:
    """Launch settings of the probe, shared by a run's points."""

    warm_us: float = 500.0          # the X-Stage fills (Q / R ~ 0.1 ms on the H200's host link)
    window_us: float = 3000.0       # the steady window each rate is measured over
    store_buffer_bytes: int = 256 * 1024 * 1024  # the store warps' regions (host or local)
    load_buffer_bytes: int = 1024 * 1024 * 1024  # the load warps' regions: 17x the 60 MiB L2
    barrier_timeout_s: float = 2.0


def roles(layout: str, producers: int, sms: int) -> dict:
    """The kernel's role arguments of a layout: CTAs [0, store_ctas) store with warps
    [0, store_warps); CTAs [load_from_cta, sms) load with ``load_warps`` warps after those."""
    if layout == "split":
        return {"store_ctas": producers, "store_warps": WARPS, "load_from_cta": producers,
                "load_warps": WARPS}
    return {"store_ctas": sms, "store_warps": WARPS // 2, "load_from_cta": 0,
            "load_warps": WARPS // 2}


def validate_load_point(p: dict, inv: Inventory) -> None:
    """Raise ValueError for a probe point that must not be launched; called before any launch."""
    check_choice("stores", p["stores"], STORES)
    check_choice("layout", p["layout"], LAYOUTS)
    check_choice("load", p["load"], (0, 1))
    check_gpus(p["src"], p["dst"], inv)
    if p["dst"] != HOST:
        raise ValueError(f"the probe stores into host memory (dst {HOST}), got dst={p['dst']}")
    sms = inv.gpus[p["src"]].sm_count
    k = p["producers"]
    if p["layout"] == "split" and not (isinstance(k, (int, np.integer)) and 1 <= k < sms):
        raise ValueError(f"split layout: producers K={k} must be in 1..{sms - 1}, leaving SMs "
                         f"to load")
    if p["layout"] == "shared" and k != sms:
        raise ValueError(f"shared layout: producers K={k} must be every SM ({sms})")
    if p["stores"] == "none" and not p["load"]:
        raise ValueError("a point with neither stores nor load measures nothing")


def region_vecs(buffer_bytes: int, warps: int, unroll: int) -> int:
    """16-byte vectors of each of ``warps`` regions of a buffer: a whole number of the kernel's
    iterations (32 lanes x ``unroll`` vectors)."""
    step = 32 * unroll
    return buffer_bytes // 16 // max(warps, 1) // step * step


def expected_load_sums(n_iters: np.ndarray, first_vec: np.ndarray, region: int) -> np.ndarray:
    """Each load lane's sum (uint32, as the kernel's wrapping sum) where the load buffer holds
    vector index i in every word of vector i: ``n_iters[w]`` iterations of warp w over its
    region starting at vector ``first_vec[w]``, lane l of iteration i reading vectors
    first + (i mod P)·256 + u·32 + l, u < 8 (P = region / 256). Returns [warps, 32]."""
    per = 32 * LOAD_UNROLL
    passes = region // per
    n = n_iters.astype(np.uint64)[:, None]
    full, rest = n // np.uint64(passes), n % np.uint64(passes)
    # sum over iterations of (i mod P): full passes of P(P-1)/2, then rest(rest-1)/2 (0 where
    # rest is 0: the wrapped rest - 1 is multiplied by 0)
    mod_sum = (full * np.uint64(passes * (passes - 1) // 2)
               + rest * (rest - np.uint64(1)) // np.uint64(2))
    lane = np.arange(32, dtype=np.uint64)[None, :]
    start = first_vec.astype(np.uint64)[:, None]
    unrolled = np.uint64(32 * sum(range(LOAD_UNROLL)))  # sum over u of u·32
    total = (np.uint64(LOAD_UNROLL) * n * (start + lane) + unrolled * n
             + np.uint64(LOAD_UNROLL * per) * mod_sum)
    return ((np.uint64(4) * total) & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def check_store_regions(words: np.ndarray, n_iters: np.ndarray, region: int, seed: int,
                        poison: int = _POISON) -> int:
    """The 16-byte vectors of the store destination (``words``, uint32) that differ from what
    the store warps must have left: warp w's region (``region`` vectors from w·region) holds at
    position p = j·128 + r the ``burst_pattern(seed, pass, w, p)`` of the last of its
    ``n_iters[w]`` iterations i with i mod P = j (pass = i / P, P = region / 128), poison where
    no iteration wrote it; past the regions, poison. The CPU's reference of the kernel's
    addressing."""
    vecs = words.reshape(-1, 4)
    warps = len(n_iters)
    used = warps * region
    bad = int(np.count_nonzero((vecs[used:] != np.uint32(poison)).any(axis=1)))
    per = 32 * STORE_UNROLL
    passes = region // per
    p = np.arange(region, dtype=np.int64)
    j = p // per
    for w, n in enumerate(np.asarray(n_iters, dtype=np.int64)):
        got = vecs[w * region:(w + 1) * region]
        written = j < n
        last = j + passes * ((n - 1 - j) // passes)
        pass_ = np.where(written, last // passes, 0).astype(np.uint32)
        w1 = p.astype(np.uint32) * np.uint32(_PATTERN_VEC)
        w2 = np.uint32(w * _PATTERN_PRODUCER & 0xFFFFFFFF) ^ w1
        tag = np.uint32(seed) ^ (pass_ * np.uint32(_PATTERN_BURST))
        want = np.stack([tag ^ w1, w1, w2, (tag ^ w2) * np.uint32(_PATTERN_LAST)], axis=1)
        want[~written] = np.uint32(poison)
        bad += int(np.count_nonzero((got != want).any(axis=1)))
    return bad


def load_rows(stamps: np.ndarray, store_warps: np.ndarray, load_warps: np.ndarray) -> dict:
    """One launch's rates from the kernel's stamps ([warps, 4]: timer at the window's first
    iteration, iterations before it, timer at the end, iterations in all): per role the sum
    over its warps of the bytes issued inside the window over the window's length (GB/s), the
    median window (µs) and the warps counted."""
    s = stamps.astype(np.float64)
    window_ns = s[:, 2] - s[:, 0]
    iters = s[:, 3] - s[:, 1]

    def rate(warps, nbytes):
        if not warps.any():
            return np.nan
        return float(np.sum(iters[warps] * nbytes / window_ns[warps]))  # bytes/ns = GB/s
    working = store_warps | load_warps
    return {"store_rate_GBps": rate(store_warps, STORE_ITER_BYTES),
            "load_rate_GBps": rate(load_warps, LOAD_ITER_BYTES),
            "window_us": float(np.median(window_ns[working])) / 1e3,
            "store_warps": int(store_warps.sum()), "load_warps": int(load_warps.sum())}


@dataclass(frozen=True)
class ProbeLaunch:
    """What one launch left: its point, the kernel's error flag, the stamps and load sums
    ([warps, 4], [warps, 32]), which warps stored and loaded, and their regions (vectors)."""

    point: dict
    error: int
    stamps: np.ndarray
    sums: np.ndarray
    store_warps: np.ndarray
    load_warps: np.ndarray
    store_region: int
    load_region: int


@dataclass(frozen=True)
class _Pending:
    """A launch ``HostLoadProbe.start`` enqueued: what ``finish`` reads back."""

    point: dict
    src: int
    roles: dict
    store_region: int
    load_region: int
    error: object   # the device buffers (CuPy)
    stamps: object
    sums: object
    stream: object


class HostLoadProbe:
    """Launches probe points on this machine's GPU (CuPy RawModule, NVRTC for the device)."""

    def __init__(self, settings: LoadSettings = LoadSettings(), inv: Inventory | None = None):
        import cupy  # the cuda backend only

        self.cp = cupy
        self.settings = settings
        self.inv = inventory() if inv is None else inv
        self._module = None
        self._host = None
        self._local = None
        self._load = None
        # a fresh pattern per probe: a buffer left by an earlier run cannot pass the check
        self.seed = int(np.random.default_rng().integers(1, 2**31))

    def validate(self, p: dict) -> None:
        validate_load_point(p, self.inv)

    def _buffers(self, src: int):
        cp, s = self.cp, self.settings
        if self._module is None:
            with cp.cuda.Device(src):
                self._module = cuda_module("host_store_load.cu")
                self._host = mapped_host_buffer(s.store_buffer_bytes, src)
                self._local = cp.empty(s.store_buffer_bytes // 4, cp.uint32)
                # vector i holds i in each word: the load sums are known in closed form
                n = s.load_buffer_bytes // 16
                self._load = cp.repeat(cp.arange(n, dtype=cp.uint32), 4)
                cp.cuda.Device(src).synchronize()
        return self._module

    def measure(self, p: dict, check_stores: bool = False) -> dict:
        """One launch of the point (``launch``), checked (``check``); its rates (``load_rows``)."""
        run = self.launch(p)
        self.check(run, check_stores)
        return load_rows(run.stamps, run.store_warps, run.load_warps)

    def launch(self, p: dict) -> "ProbeLaunch":
        """One launch of the point, the store destination poisoned first; what it left."""
        return self.finish(self.start(p))

    def start(self, p: dict, started: int = 0, exclusive: bool = False,
              stream=None) -> "_Pending":
        """Enqueue one launch of the point (its store destination poisoned first) on ``stream``
        (CuPy's current one where None); ``started``: a mapped host word the kernel sets once
        its grid barrier passed (0: none); ``exclusive``: each CTA takes all of its SM's shared
        memory, so no CTA of another kernel can share the SM. ``finish`` waits for it."""
        self.validate(p)
        cp, s = self.cp, self.settings
        src = int(p["src"])
        module = self._buffers(src)
        gpu = self.inv.gpus[src]
        sms = gpu.sm_count
        r = roles(p["layout"], int(p["producers"]), sms)
        if p["stores"] == "none":
            r["store_warps"] = 0
        if not p["load"]:
            r["load_warps"] = 0
        n_store = r["store_ctas"] * r["store_warps"]
        n_load = (sms - r["load_from_cta"]) * r["load_warps"]
        store_region = region_vecs(s.store_buffer_bytes, n_store, STORE_UNROLL)
        load_region = region_vecs(s.load_buffer_bytes, n_load, LOAD_UNROLL)
        if p["stores"] == "host":
            self._host.words().fill(_POISON)
            ptr = self._host.ptr
        else:
            with cp.cuda.Device(src):
                self._local.fill(_POISON)
            ptr = self._local.data.ptr
        total_ns = (s.warm_us + s.window_us) * 1e3
        max_iters = int(total_ns * _WARP_RATE_BOUND_GBPS / min(STORE_ITER_BYTES, LOAD_ITER_BYTES))
        with cp.cuda.Device(src):
            stream = stream if stream is not None else cp.cuda.get_current_stream()
            kernel = module.get_function("store_under_load")
            # one CTA per SM: more than half an SM's shared memory; exclusive: the most a CTA
            # may take, which with the 1 KiB reserved per CTA is all of the SM's (232448 + 1024
            # on the H200), so no CTA of another kernel fits beside it
            smem = (gpu.max_smem_per_block_optin - kernel.shared_size_bytes if exclusive else
                    min(gpu.max_smem_per_sm // 2 + 1024, gpu.max_smem_per_block_optin))
            kernel.max_dynamic_shared_size_bytes = smem
            arrivals, error = cp.zeros(1, cp.uint32), cp.zeros(1, cp.uint32)
            stamps = cp.full((sms * WARPS, 4), _STAMP_POISON, cp.uint64)
            sums = cp.full((sms * WARPS, 32), _POISON, cp.uint32)
            cp.cuda.Device(src).synchronize()  # the poison and zeros before the launch
            kernel((sms,), (WARPS * 32,),
                   (np.uint64(ptr), np.uint64(store_region), np.uint64(self._load.data.ptr),
                    np.uint64(load_region), np.uint32(r["store_ctas"]),
                    np.uint32(r["store_warps"]), np.uint32(r["load_from_cta"]),
                    np.uint32(r["load_warps"]), np.uint64(s.warm_us * 1e3),
                    np.uint64(s.window_us * 1e3), np.uint64(max_iters), np.uint32(self.seed),
                    arrivals, error, np.uint64(s.barrier_timeout_s * 1e9), stamps, sums,
                    np.uint64(started)),
                   shared_mem=smem, stream=stream)
        return _Pending(p, src, r, store_region, load_region, error, stamps, sums, stream)

    def finish(self, pending: "_Pending") -> "ProbeLaunch":
        """Wait for a launch of ``start``; what it left."""
        cp, r = self.cp, pending.roles
        with cp.cuda.Device(pending.src):
            pending.stream.synchronize()
            err = int(pending.error.get()[0])
            stamps_h, sums_h = pending.stamps.get(), pending.sums.get()
        sms = self.inv.gpus[pending.src].sm_count
        cta, warp = np.divmod(np.arange(sms * WARPS), WARPS)
        store_w = (cta < r["store_ctas"]) & (warp < r["store_warps"])
        first = np.where(cta < r["store_ctas"], r["store_warps"], 0)
        load_w = (cta >= r["load_from_cta"]) & (warp >= first) & (warp < first + r["load_warps"])
        return ProbeLaunch(pending.point, err, stamps_h, sums_h, store_w, load_w,
                           pending.store_region, pending.load_region)

    def check(self, run: "ProbeLaunch", check_stores: bool) -> None:
        """Raise where the kernel's error flag is set, a working warp left no stamps or an idle
        one did, a load sum differs from the reference (``expected_load_sums``), or
        (``check_stores``) the store destination does not hold exactly what the store warps
        wrote (``check_store_regions``: host memory read back on the CPU, the local control
        copied to it)."""
        p = run.point
        if run.error:
            raise RuntimeError(f"probe error flag {run.error:#x} (1: start barrier timeout, 4: "
                               f"iteration bound reached) at {p}")
        self._check_stamps(run.stamps, run.store_warps | run.load_warps, p)
        want = expected_load_sums(run.stamps[run.load_warps, 3],
                                  np.arange(run.load_warps.sum()) * run.load_region,
                                  run.load_region)
        if not (np.array_equal(run.sums[run.load_warps], want)
                and (run.sums[run.store_warps] == 0).all()):
            raise RuntimeError(f"load sums differ from the reference at {p}")
        if check_stores and run.store_warps.any():
            got = self._host.words() if p["stores"] == "host" else self._local.get()
            bad = check_store_regions(got, run.stamps[run.store_warps, 3], run.store_region,
                                      self.seed)
            if bad:
                raise RuntimeError(f"store destination ({p['stores']}) read back on the CPU: "
                                   f"{bad} 16-byte vectors differ from what the warps wrote at {p}")

    @staticmethod
    def _check_stamps(stamps: np.ndarray, working: np.ndarray, p: dict) -> None:
        idle_untouched = (stamps[~working] == _STAMP_POISON).all()
        done = stamps[working]
        complete = ((done != _STAMP_POISON).all() and (done[:, 2] > done[:, 0]).all()
                    and (done[:, 3] > done[:, 1]).all())
        if not (idle_untouched and complete):
            raise RuntimeError(f"probe stamps: a working warp left none, an idle one wrote some, "
                               f"or a window is empty at {p}")
