"""The host side of the visibility kernels (``kernels/visibility_latency.cu``, issue 8 part 2):
a point's contract (``validate_point``), the sender and receiver launched together on two GPUs
(``VisibilityBench``: the data checked by the receiver, a stale burst failing the run), the
``%globaltimer`` ping-pong (``clock_offset``: θ = t_dst − t_src from the rounds of smallest round
trip) and the stamps turned into rows (``stamp_rows``). CuPy is imported only when a
``VisibilityBench`` is made."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from ...kernel_sources import cuda_module
from ...platform import Inventory, inventory
from .burst import check_burst_and_gap, check_gpus

KIB = 1024
KERNEL_FILE = "visibility_latency.cu"
_POISON = 0xA5A5A5A5
_UNWRITTEN = 0xFFFFFFFF
# Error bits of kernels/visibility_latency.cu.
_ERRORS = {1: "sender grid barrier timeout", 2: "sender flag release waited for a burst in vain",
           4: "start rendezvous timeout (receiver not polling)",
           8: "receiver: a flag never became visible", 16: "receiver checkers timed out",
           32: "ping-pong timeout"}


@dataclass(frozen=True)
class VisibilitySettings:
    """Launch settings shared by every point of a visibility run."""

    store_threads: int = 512       # per sender CTA, plus a flag warp and a timekeeper warp
    checker_threads: int = 256     # per receiver CTA, plus the poller warp
    bursts: int = 6                # bursts per launch (burst 0 starts aligned, then free-running)
    pingpong_rounds: int = 2000
    pingpong_warmup: int = 50      # first rounds, dropped (the two kernels start apart)
    pingpong_keep: float = 0.1     # fraction of the rounds of smallest RTT that give θ
    timer_steps: int = 512         # %globaltimer increments observed for its resolution
    timeout_s: float = 1.0         # every in-kernel wait


def validate_point(p: dict, inv: Inventory, settings: VisibilitySettings = VisibilitySettings()
                   ) -> None:
    """Raise ValueError for a point that must not be launched; called before any launch."""
    K, B, G = p["producers"], p["burst_bytes"], p["gap_us"]
    check_burst_and_gap(B, G)
    src, dst = p["src"], p["dst"]
    check_gpus(src, dst, inv)
    if src == dst:
        raise ValueError(f"the receiver must be another GPU than the sender (GPU {src})")
    if not (inv.can_access_peer(src, dst) and inv.can_access_peer(dst, src)):
        raise ValueError(f"GPUs {src} and {dst} need peer access both ways")
    sms = min(inv.gpus[src].sm_count, inv.gpus[dst].sm_count)
    if not isinstance(K, (int, np.integer)) or not 1 <= K <= sms:
        raise ValueError(f"producers K={K} must be in 1..{sms} (one CTA per SM on both GPUs)")
    if settings.store_threads % 32 or not 32 <= settings.store_threads <= 960:
        raise ValueError("store threads per producer must be a multiple of 32 in 32..960")
    if settings.checker_threads % 32 or not 32 <= settings.checker_threads <= 992:
        raise ValueError("checker threads per receiver CTA must be a multiple of 32 in 32..992")
    if settings.bursts < 1 or settings.pingpong_rounds <= settings.pingpong_warmup:
        raise ValueError("need at least one burst and more ping-pong rounds than warm-up rounds")


def clock_offset(initiator, responder, warmup: int = 0, keep: float = 0.1) -> dict:
    """θ = t_responder − t_initiator from ping-pong stamps (Cristian/NTP).

    ``initiator`` is [n, 2] = (t0, t3), ``responder`` [n, 2] = (t1, t2), all integer ns.
    Per round θ_i = ((t1 − t0) + (t2 − t3)) / 2 and RTT_i = (t3 − t0) − (t2 − t1); θ is the
    median over the ``keep`` fraction of rounds (after ``warmup``) of smallest RTT, whose
    one-way delays are closest to symmetric; |error| ≤ RTT_min / 2. Differences are taken in
    int64: %globaltimer values near 2^60 lose 8 bits in float64."""
    init = np.asarray(initiator, dtype=np.int64)[warmup:]
    resp = np.asarray(responder, dtype=np.int64)[warmup:]
    if init.shape != resp.shape or init.ndim != 2 or init.shape[1] != 2 or len(init) == 0:
        raise ValueError(f"need matching [n, 2] stamp arrays, got {init.shape} and {resp.shape}")
    if (init == 0).any() or (resp == 0).any():
        raise ValueError("ping-pong stamps hold zeros: a round did not complete")
    t0, t3 = init[:, 0], init[:, 1]
    t1, t2 = resp[:, 0], resp[:, 1]
    rtt = (t3 - t0) - (t2 - t1)
    if (rtt < 0).any() or (t3 < t0).any() or (t2 < t1).any():
        raise ValueError("ping-pong stamps out of order (negative round trip)")
    theta = ((t1 - t0) + (t2 - t3)) / 2.0
    n_keep = max(1, math.ceil(keep * len(rtt)))
    kept = np.argsort(rtt, kind="stable")[:n_keep]
    return {"offset_ns": float(np.median(theta[kept])),
            "offset_p25_ns": float(np.percentile(theta[kept], 25)),
            "offset_p75_ns": float(np.percentile(theta[kept], 75)),
            "offset_all_rounds_ns": float(np.median(theta)),
            "rtt_min_ns": int(rtt.min()), "rtt_median_ns": float(np.median(rtt)),
            "rtt_p25_ns": float(np.percentile(rtt, 25)), "rtt_p75_ns": float(np.percentile(rtt, 75)),
            "rtt_max_ns": int(rtt.max()),
            "uncertainty_ns": float(rtt.min()) / 2.0,
            "rounds": int(len(rtt)), "kept": int(n_keep),
            # when, on the initiator's clock, this θ holds (for the drift interpolation)
            "t_ref_ns": int(np.median(t0[kept]))}


def stamp_rows(tx, rx) -> pd.DataFrame:
    """One row per (burst, producer) from the sender's [n, K, 3] stamps (issue start, issue end,
    flag release return) and the receiver's [n, K] flag-visible stamps; raw integer ns."""
    tx = np.asarray(tx, dtype=np.int64)
    rx = np.asarray(rx, dtype=np.int64)
    n, K = rx.shape
    if tx.shape != (n, K, 3):
        raise ValueError(f"sender stamps {tx.shape} do not match receiver stamps {rx.shape}")
    burst, producer = np.meshgrid(np.arange(n), np.arange(K), indexing="ij")
    return pd.DataFrame({"burst": burst.ravel(), "producer": producer.ravel(),
                         "t_iss_start_ns": tx[:, :, 0].ravel(), "t_iss_end_ns": tx[:, :, 1].ravel(),
                         "t_release_ns": tx[:, :, 2].ravel(), "t_visible_ns": rx.ravel()})


def _error_text(err: int) -> str:
    return ", ".join(text for bit, text in _ERRORS.items() if err & bit) or f"{err:#x}"


class VisibilityBench:
    """Sender and receiver kernels on two GPUs of this machine (CuPy RawModule, NVRTC)."""

    def __init__(self, src: int, dst: int, settings: VisibilitySettings = VisibilitySettings(),
                 inv: Inventory | None = None):
        import cupy  # the cuda backend only

        from .characterization import RemoteStoreBench

        self.cp = cupy
        self.settings = settings
        self.inv = inventory() if inv is None else inv
        self.src, self.dst = src, dst
        self._modules: dict[int, object] = {}
        # peer enabling and the SM clock (for the gap in cycles) come from the burst bench
        self._burst_bench = RemoteStoreBench(inv=self.inv)
        self.seed = np.random.default_rng().integers(1, 2**31)
        self.clock_mhz: float | None = None

    def validate(self, p: dict) -> None:
        validate_point(p, self.inv, self.settings)

    def prepare(self) -> None:
        """Peer access both ways and both modules compiled, before any timing."""
        self._burst_bench._enable_peer(self.src, self.dst)
        self._burst_bench._enable_peer(self.dst, self.src)
        for dev in (self.src, self.dst):
            self._module(dev)

    def _module(self, dev: int):
        if dev not in self._modules:
            with self.cp.cuda.Device(dev):
                self._modules[dev] = cuda_module(KERNEL_FILE)
        return self._modules[dev]

    def sm_clock_mhz(self) -> float:
        self.clock_mhz = self._burst_bench.sm_clock_mhz(self.src)
        return self.clock_mhz

    def _one_cta_per_sm_smem(self, dev: int) -> int:
        gpu = self.inv.gpus[dev]
        return min(gpu.max_smem_per_sm // 2 + 1024, gpu.max_smem_per_block_optin)

    def _sync(self) -> None:
        for dev in (self.src, self.dst):
            self.cp.cuda.Device(dev).synchronize()

    def timer_steps(self, dev: int) -> np.ndarray:
        cp, s = self.cp, self.settings
        with cp.cuda.Device(dev):
            steps = cp.zeros(s.timer_steps, cp.uint64)
            self._module(dev).get_function("globaltimer_steps")(
                (1,), (32,), (np.uint32(s.timer_steps), np.uint64(1 << 26), steps))
            return steps.get()

    def pingpong(self, initiator: int, responder: int) -> tuple[np.ndarray, np.ndarray]:
        """One ping-pong run: (initiator [n, 2] = t0, t3; responder [n, 2] = t1, t2)."""
        cp, s = self.cp, self.settings
        n = s.pingpong_rounds
        arrays = {}
        for dev in (initiator, responder):
            with cp.cuda.Device(dev):
                arrays[dev] = (cp.zeros(1, cp.uint32), cp.zeros(1, cp.uint32),
                               cp.zeros((n, 2), cp.uint64))
        self._sync()
        for role, dev, peer in ((1, responder, initiator), (0, initiator, responder)):
            flag, error, stamps = arrays[dev]
            with cp.cuda.Device(dev):
                self._module(dev).get_function("clock_pingpong")(
                    (1,), (32,), (np.uint32(role), flag, np.uint64(arrays[peer][0].data.ptr),
                                  np.uint32(n), np.uint64(s.timeout_s * 1e9), error, stamps),
                    shared_mem=n * 16)
        self._sync()
        for dev in (initiator, responder):
            err = int(arrays[dev][1].get()[0])
            if err:
                raise RuntimeError(f"ping-pong on GPU {dev}: {_error_text(err)}")
        return arrays[initiator][2].get(), arrays[responder][2].get()

    def align(self) -> tuple[dict, dict]:
        """θ = t_dst − t_src from a sender-initiated ping-pong, and the receiver-initiated one."""
        s = self.settings
        fwd = clock_offset(*self.pingpong(self.src, self.dst), s.pingpong_warmup, s.pingpong_keep)
        rev = clock_offset(*self.pingpong(self.dst, self.src), s.pingpong_warmup, s.pingpong_keep)
        return fwd, rev

    def measure(self, p: dict) -> pd.DataFrame:
        """One launch of sender and receiver; raw per-(burst, producer) stamps. Raises if any wait
        timed out, a flag was never seen, a producer shared an SM, or any burst's data was not
        what the producer wrote once its flag was visible."""
        self.validate(p)
        cp, s = self.cp, self.settings
        K, B = int(p["producers"]), int(p["burst_bytes"])
        n, vpp = s.bursts, B // 16
        src, dst = self.src, self.dst
        if (int(p["src"]), int(p["dst"])) != (src, dst):
            raise ValueError(f"this bench runs GPU {src} -> GPU {dst}, not {p['src']} -> {p['dst']}")
        mhz = self.clock_mhz or self.sm_clock_mhz()
        timeout = np.uint64(s.timeout_s * 1e9)
        with cp.cuda.Device(dst):
            buf = cp.empty(n * K * B // 4, cp.uint32)
            buf.fill(_POISON)
            flags = cp.zeros((n, K), cp.uint32)
            rx_arrivals, rx_error = cp.zeros(1, cp.uint32), cp.zeros(1, cp.uint32)
            rx = cp.zeros((n, K), cp.uint64)
            mismatches = cp.full((n, K), _UNWRITTEN, cp.uint32)
        with cp.cuda.Device(src):
            ready, arrivals, error = (cp.zeros(1, cp.uint32) for _ in range(3))
            tx = cp.zeros((n, K, 3), cp.uint64)
            smids = cp.full(K, _UNWRITTEN, cp.uint32)
        # The receiver sets `ready` on the source GPU: it must not race the zeroing above.
        self._sync()
        with cp.cuda.Device(dst):
            smem = self._one_cta_per_sm_smem(dst)
            kernel = self._module(dst).get_function("visibility_receiver")
            kernel.max_dynamic_shared_size_bytes = smem
            kernel((K,), (32 + s.checker_threads,),
                   (buf, np.uint32(vpp), np.uint32(n), np.uint32(self.seed), flags,
                    np.uint64(ready.data.ptr), rx_arrivals, rx_error, timeout, rx, mismatches),
                   shared_mem=smem)
        with cp.cuda.Device(src):
            smem = self._one_cta_per_sm_smem(src)
            kernel = self._module(src).get_function("visibility_sender")
            kernel.max_dynamic_shared_size_bytes = smem
            kernel((K,), (s.store_threads + 64,),
                   (np.uint64(buf.data.ptr), np.uint32(vpp), np.uint32(n),
                    np.uint64(round(float(p["gap_us"]) * mhz)), np.uint32(self.seed),
                    np.uint64(flags.data.ptr), ready, arrivals, error, timeout, tx, smids),
                   shared_mem=smem)
        self._sync()
        err_tx, err_rx = int(error.get()[0]), int(rx_error.get()[0])
        if err_tx or err_rx:
            raise RuntimeError(f"visibility kernels at {p}: sender "
                               f"{_error_text(err_tx) if err_tx else 'ok'}; receiver "
                               f"{_error_text(err_rx) if err_rx else 'ok'}")
        bad = mismatches.get()
        if bad.any():
            stale = int(bad[bad != _UNWRITTEN].sum())
            raise RuntimeError(f"data check failed at {p}: {int((bad != 0).sum())} (burst, "
                               f"producer) flags were visible before their data ({stale} stale "
                               f"16-byte vectors; {int((bad == _UNWRITTEN).sum())} unchecked)")
        if len(set(smids.get().tolist())) != K:
            raise RuntimeError(f"producers shared SMs at {p}: the one-CTA-per-SM premise failed")
        tx_h, rx_h = tx.get(), rx.get()
        if (tx_h == 0).any() or (rx_h == 0).any():
            raise RuntimeError(f"missing stamps at {p}")
        return stamp_rows(tx_h, rx_h).assign(gap_set_us=float(p["gap_us"]))
