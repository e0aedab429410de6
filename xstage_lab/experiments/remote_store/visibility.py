"""Remote-visible completion seen from the receiver (issue 8 part 2, paper §3).

The sender (``visibility_sender`` in ``kernels/visibility_latency.cu``, K producers, one CTA per
SM) stores a burst of B bytes per producer into the receiver's buffer, then a flag warp releases
a per-(burst, producer) flag with ``st.release.sys`` while the store warps spin the gap G and go
on to the next burst. The receiver (``visibility_receiver`` on the destination GPU, launched
concurrently) polls its local flags, stamps when each becomes visible and then checks the burst's
data against the pattern: a visible flag with stale data fails the run before any time is kept.

Each GPU stamps with its own ``%globaltimer``. Their offset θ = t_dst − t_src is measured by a
ping-pong before and after the sweep (Cristian/NTP): the initiator stamps t0 and pings, the
responder stamps t1 on arrival and t2 after its pong, the initiator stamps t3 on the pong;
θ = ((t1 − t0) + (t2 − t3)) / 2 and RTT = (t3 − t0) − (t2 − t1). The samples of smallest RTT
give θ, whose error is at most RTT_min/2 (any asymmetry of the two one-way delays) plus the
timer's resolution, measured too. θ is interpolated linearly between the two measurements
(the drift). The issue-to-visibility latency of a burst is
t_visible − θ − t_iss_end (and from t_iss_start), compared with the fenced sweep's
T_complete(K, V) = V/R + T_lat (``calibration.CompletionFit``).

    python -m xstage_lab.experiments.remote_store.visibility (--out FILE | --root DIR) \\
        [--src 0] [--dst 1] [--repeats 5]

An ``Experiment`` run in process by ``experiments.harness``: its ``Sweep`` is
``visibility_sweep``; θ before and after it, and the latency columns, are its own.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ... import model
from ...calibration import kb_key
from ...kernel_sources import cuda_module
from ...platform import Inventory, choose_backend, inventory
from ...records import RECORDS_DIR, Record, latest_record, list_records
from ...sweep import Axis, Sweep, median_spread
from .. import harness
from ..harness import Experiment
from .characterization import check_burst_and_gap, check_gpus

KIB = 1024
KERNEL_FILE = "visibility_latency.cu"
_POISON = 0xA5A5A5A5
_UNWRITTEN = 0xFFFFFFFF
# Error bits of kernels/visibility_latency.cu.
_ERRORS = {1: "sender grid barrier timeout", 2: "sender flag release waited for a burst in vain",
           4: "start rendezvous timeout (receiver not polling)",
           8: "receiver: a flag never became visible", 16: "receiver checkers timed out",
           32: "ping-pong timeout"}
STAMP_COLUMNS = ("t_iss_start_ns", "t_iss_end_ns", "t_release_ns", "t_visible_ns")


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


# --- clock alignment ---------------------------------------------------------------------------

def timer_resolution(steps) -> dict:
    """%globaltimer's update step from the increments one thread saw reading it back to back:
    the smallest is the resolution (a slow loop only adds multiples of it)."""
    steps = np.asarray(steps, dtype=np.int64)
    steps = steps[steps > 0]
    if steps.size == 0:
        raise ValueError("no %globaltimer increment observed")
    return {"resolution_ns": int(steps.min()), "median_step_ns": float(np.median(steps)),
            "steps": int(steps.size)}


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


def offset_at(t_ns, before: dict, after: dict) -> np.ndarray:
    """θ at sender time ``t_ns``: linear between the ping-pongs before and after the sweep."""
    t = np.asarray(t_ns, dtype=np.int64)
    span = after["t_ref_ns"] - before["t_ref_ns"]
    if span <= 0:
        raise ValueError("the second clock alignment must come after the first")
    frac = (t - before["t_ref_ns"]).astype(np.float64) / span
    return before["offset_ns"] + frac * (after["offset_ns"] - before["offset_ns"])


def alignment_summary(before: dict, after: dict, before_swapped: dict, after_swapped: dict,
                      resolution_src: dict, resolution_dst: dict) -> dict:
    """The record's clock-alignment header: both ping-pongs (sender-initiated give θ; the
    receiver-initiated ones, negated, are a check), the drift between them, the timers'
    resolution and the resulting bound on any cross-GPU time difference."""
    drift = after["offset_ns"] - before["offset_ns"]
    span_s = (after["t_ref_ns"] - before["t_ref_ns"]) / 1e9
    worst = max(before["uncertainty_ns"], after["uncertainty_ns"])
    return {"before": before, "after": after,
            "before_swapped": before_swapped, "after_swapped": after_swapped,
            # θ from the receiver-initiated ping-pong is t_src − t_dst: θ + θ_swapped ≈ 0
            "swap_check_ns": [before["offset_ns"] + before_swapped["offset_ns"],
                              after["offset_ns"] + after_swapped["offset_ns"]],
            "drift_ns": drift, "drift_ns_per_s": drift / span_s if span_s > 0 else float("nan"),
            "span_s": span_s,
            "resolution_src": resolution_src, "resolution_dst": resolution_dst,
            "uncertainty_ns": worst + max(resolution_src["resolution_ns"],
                                          resolution_dst["resolution_ns"])}


# --- latency -------------------------------------------------------------------------------------

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


def add_latency(table: pd.DataFrame, alignment: dict) -> pd.DataFrame:
    """The latency columns (µs) from the raw stamps and the clock alignment:
    t_visible_src_ns = t_visible − θ(t_iss_end) (the receiver's stamp on the sender's clock);
    latency_us = from issue end, latency_from_start_us = from issue start,
    release_to_visible_us = from the sender's release returning, issue_us, release_us (issue
    end to the release's return: the sender's own view of completion)."""
    theta = offset_at(table["t_iss_end_ns"], alignment["before"], alignment["after"])
    visible = table["t_visible_ns"].to_numpy(np.int64) - np.rint(theta).astype(np.int64)
    start, end = table["t_iss_start_ns"].to_numpy(np.int64), table["t_iss_end_ns"].to_numpy(np.int64)
    release = table["t_release_ns"].to_numpy(np.int64)
    return table.assign(t_visible_src_ns=visible,
                        latency_us=(visible - end) / 1e3,
                        latency_from_start_us=(visible - start) / 1e3,
                        release_to_visible_us=(visible - release) / 1e3,
                        issue_us=(end - start) / 1e3,
                        release_us=(release - end) / 1e3)


LAUNCH_KEYS = ["producers", "burst_bytes", "gap_us", "repeat"]


def aggregate_bursts(table: pd.DataFrame) -> pd.DataFrame:
    """Per launch and burst: the aggregate burst of V = K·B bytes, from the first producer's issue
    start (``first_start_ns``) to the last producer's flag becoming visible (``last_visible_ns``,
    sender clock; ``aggregate_visible_us`` between them), and the mean
    per-producer latency from issue start (``visible_from_start_us``, what the fenced sweep's
    T_complete averages)."""
    g = table.groupby(LAUNCH_KEYS + ["burst"], sort=True)
    out = g.agg(first_start_ns=("t_iss_start_ns", "min"),
                last_visible_ns=("t_visible_src_ns", "max"),
                visible_from_start_us=("latency_from_start_us", "mean"),
                latency_us=("latency_us", "mean")).reset_index()
    out["aggregate_visible_us"] = (out["last_visible_ns"] - out["first_start_ns"]) / 1e3
    out["burst_volume"] = out["producers"] * out["burst_bytes"]
    return out


def latency_points(table: pd.DataFrame) -> pd.DataFrame:
    """Median per-producer latency (issue end → visible) over every burst and repeat of each
    (K, B, G), with its interquartile spread; and the same from issue start."""
    keys = ["producers", "burst_bytes", "gap_us"]
    a = median_spread(table, keys, "latency_us")
    b = median_spread(table, keys, "latency_from_start_us")[keys + ["latency_from_start_us"]]
    c = median_spread(table, keys, "release_us")[keys + ["release_us"]]
    return a.merge(b, on=keys).merge(c, on=keys)


def _against_t_complete(out: pd.DataFrame, drain_rate_GBps: float,
                        completion_latency_us: float) -> None:
    """Add T_complete(K, V) = V/R + T_lat (eq. 17) to each row of medians, and the measured
    per-producer (``diff_us``) and aggregate (``aggregate_diff_us``) differences to it."""
    volume = (out["producers"] * out["burst_bytes"]).to_numpy(float)
    out["T_complete_model_us"] = model.drain_time(volume, drain_rate_GBps) + completion_latency_us
    out["diff_us"] = out["visible_from_start_us"] - out["T_complete_model_us"]
    out["aggregate_diff_us"] = out["aggregate_visible_us"] - out["T_complete_model_us"]


def first_burst_points(table: pd.DataFrame, drain_rate_GBps: float,
                       completion_latency_us: float) -> pd.DataFrame:
    """The aligned first burst of every launch (X-Stage is empty when it starts) per (K, B, G),
    beside the fenced sweep's T_complete(K, V) = V/R + T_lat (eq. 17 with the calibrated R and
    T_lat). ``overlapped``: the fraction of launches whose next burst began issuing before this
    burst's last flag was visible; its stores then queue ahead of this burst's flag release and
    the flag shows two bursts' drain, not one. ``isolated``: no launch of that G overlapped (a
    per-gap verdict, so no single slow launch is dropped from an isolated gap)."""
    agg = aggregate_bursts(table)
    keys = ["producers", "burst_bytes", "gap_us"]
    first = agg[agg["burst"] == 0].set_index(LAUNCH_KEYS)
    nxt = agg[agg["burst"] == 1].set_index(LAUNCH_KEYS)["first_start_ns"].reindex(first.index)
    first = first.assign(overlapped=nxt < first["last_visible_ns"]).reset_index()
    out = first.groupby(keys, sort=True).agg(
        visible_from_start_us=("visible_from_start_us", "median"),
        aggregate_visible_us=("aggregate_visible_us", "median"),
        overlapped=("overlapped", "mean"),
        launches=("aggregate_visible_us", "size")).reset_index()
    _against_t_complete(out, drain_rate_GBps, completion_latency_us)
    out["isolated"] = out["overlapped"] == 0
    return out


def completion_comparison(table: pd.DataFrame, drain_rate_GBps: float,
                          completion_latency_us: float, fenced_us: dict | None = None
                          ) -> pd.DataFrame:
    """Receiver-seen completion of the first burst against T_complete(K, V) per (K, B), over the
    launches of the isolated gaps only (``first_burst_points``). ``diff_us`` = measured median
    per-producer issue-start-to-visible − T_complete; the aggregate (last flag) beside it.
    A (K, B) without an isolated gap has no row. ``fenced_us`` (the calibration's
    ``t_complete_us``, keyed by ``kb_key``) adds the fenced sweep's own measurement where it has
    the point, and the difference to it."""
    pts = first_burst_points(table, drain_rate_GBps, completion_latency_us)
    first = aggregate_bursts(table)
    first = first[first["burst"] == 0].merge(
        pts.loc[pts["isolated"], ["producers", "burst_bytes", "gap_us"]])
    g = first.groupby(["producers", "burst_bytes"], sort=True)
    out = g.agg(visible_from_start_us=("visible_from_start_us", "median"),
                aggregate_visible_us=("aggregate_visible_us", "median"),
                launches=("aggregate_visible_us", "size"),
                gap_min_us=("gap_us", "min")).reset_index()
    _against_t_complete(out, drain_rate_GBps, completion_latency_us)
    fenced = [(fenced_us or {}).get(kb_key(k, b), np.nan)
              for k, b in zip(out["producers"], out["burst_bytes"])]
    out["T_complete_fenced_us"] = np.asarray(fenced, dtype=float)
    out["fenced_diff_us"] = out["visible_from_start_us"] - out["T_complete_fenced_us"]
    return out


# --- the device run ------------------------------------------------------------------------------

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


def visibility_sweep(sm_count: int, src: int = 0, dst: int = 1, repeats: int = 5) -> Sweep:
    """Producers K (one, a quarter and all SMs), burst volume per producer B and gap G (0 up to
    about 3·V/R of the largest burst at the H200's measured R)."""
    Ks = sorted({1, max(1, sm_count // 4), sm_count})
    return Sweep("visibility", (Axis("producers", Ks),
                              Axis("burst_bytes", [4 * KIB, 16 * KIB, 64 * KIB]),
                              Axis("gap_us", [0.0, 2.0, 8.0, 24.0, 72.0])),
                 fixed=dict(src=src, dst=dst), repeats=repeats)


class VisibilityLatency(Experiment):
    """The visibility sweep (``visibility_sweep``) between two GPUs, with the timers' resolution
    and θ measured before the first point and θ again after the last.

    Each launch checks itself (``VisibilityBench.measure``: every burst's data once its flag is
    visible, every wait, one CTA per SM): a point's first launch, its warm-up, fails the run
    before any of its repeats is kept."""

    name = "visibility"
    paper = "§3 (issue 8 part 2)"
    launch = "in_process"

    def add_arguments(self, p) -> None:
        p.add_argument("--src", type=int, default=0)
        p.add_argument("--dst", type=int, default=1)
        p.add_argument("--repeats", type=int, default=5)
        p.set_defaults(settings=VisibilitySettings())  # run_visibility may pass others

    def check_args(self, a) -> None:
        if a.repeats < 1:
            raise ValueError("--repeats must be >= 1")

    def sweeps(self, args) -> list[Sweep]:
        self.inv = inventory()
        choose_backend("cuda", self.inv)  # raises without two peer-capable GPUs
        check_gpus(args.src, args.dst, self.inv)
        gpus = self.inv.gpus
        return [visibility_sweep(min(gpus[args.src].sm_count, gpus[args.dst].sm_count),
                                 args.src, args.dst, args.repeats)]

    def start(self, run) -> None:
        args = run.args
        self.began = time.monotonic()
        self.bench = VisibilityBench(args.src, args.dst, args.settings, self.inv)
        self.before = None

    def say(self, run, msg: str) -> None:
        if not run.args.no_progress:
            print(f"[visibility {time.monotonic() - self.began:6.1f} s] {msg}", flush=True)

    def validate(self, point, run) -> None:
        self.bench.validate(point)

    def prepare(self, point, run):
        if self.before is None:  # every point validated: the run's first launches
            self.align_before(run)
        return point

    def align_before(self, run) -> None:
        """Peer access and modules, the timers' resolution, a warm-up ping-pong, θ before."""
        bench, src, dst = self.bench, run.args.src, run.args.dst
        bench.prepare()
        self.say(run, "compiled; measuring the timers and the clock offset")
        self.resolution = {dev: timer_resolution(bench.timer_steps(dev)) for dev in (src, dst)}
        bench.pingpong(src, dst)  # warm-up: first-touch of the peer mappings
        self.before = bench.align()
        self.clocks = {"sm_clock_mhz_before": bench.sm_clock_mhz()}
        b = self.before[0]
        self.say(run, f"θ before = {b['offset_ns']:.0f} ns (RTT min {b['rtt_min_ns']} ns, "
                      f"median {b['rtt_median_ns']:.0f} ns)")

    def measure(self, point, run) -> pd.DataFrame:
        return self.bench.measure(point)

    def finish(self, table, run) -> pd.DataFrame:
        """θ after the sweep; the latency columns from the alignment."""
        self.clocks["sm_clock_mhz_after"] = self.bench.sm_clock_mhz()
        after, after_rev = self.bench.align()
        self.say(run, f"θ after = {after['offset_ns']:.0f} ns; {len(table)} rows")
        (before, before_rev), src, dst = self.before, run.args.src, run.args.dst
        self.alignment = alignment_summary(before, after, before_rev, after_rev,
                                           self.resolution[src], self.resolution[dst])
        return add_latency(table, self.alignment)

    def metadata(self, run) -> dict:
        args = run.args
        return {"settings": asdict(args.settings), "src": args.src, "dst": args.dst,
                "seed": int(self.bench.seed), "clocks": self.clocks,
                "clock_alignment": self.alignment}

    @classmethod
    def analyse(cls, record, root):
        return Visibility.from_record(record, root)


EXPERIMENT = VisibilityLatency()


def run_visibility(src: int = 0, dst: int = 1, repeats: int = 5,
                   settings: VisibilitySettings = VisibilitySettings(), progress: bool = True,
                   root: Path = RECORDS_DIR) -> Path:
    """Measure the timers' resolution and θ, run the latency sweep, measure θ again, and save a
    ``visibility`` record (raw stamps plus latency columns; the alignment in the header)."""
    args = harness.parse(EXPERIMENT, ["--root", str(root), "--src", str(src), "--dst", str(dst),
                                      "--repeats", str(repeats),
                                      *([] if progress else ["--no-progress"])])
    args.settings = settings
    return harness.run(EXPERIMENT, args)


# --- replay, figures' data, summary ----------------------------------------------------------

def _calibration_completion(platform: str, root: Path) -> tuple[float, dict] | None:
    try:
        cal = latest_record("calibration", platform, root).params["calibration"]
    except FileNotFoundError:
        return None
    if not cal.get("completion"):
        return None
    return cal["drain_rate_GBps"], cal["completion"]


@dataclass(frozen=True)
class Visibility:
    """One platform's visibility record with its analysis: per-point latencies and, where the
    platform has a calibration with a fenced sweep, the first burst per gap and the comparison
    with T_complete over the isolated gaps."""

    record: Record
    points: pd.DataFrame
    first_burst: pd.DataFrame | None
    comparison: pd.DataFrame | None
    completion_latency_us: float | None

    @property
    def alignment(self) -> dict:
        return self.record.params["clock_alignment"]

    @classmethod
    def from_record(cls, rec: Record, root: Path = RECORDS_DIR) -> "Visibility":
        cal = _calibration_completion(rec.platform, root)
        first, comparison, t_lat = None, None, None
        if cal is not None:
            rate, completion = cal
            t_lat = completion["completion_latency_us"]
            first = first_burst_points(rec.table, rate, t_lat)
            comparison = completion_comparison(rec.table, rate, t_lat,
                                               completion.get("t_complete_us"))
        return cls(rec, latency_points(rec.table), first, comparison, t_lat)


def summary_entry(platform: str, root: Path = RECORDS_DIR) -> dict:
    """``counterfactual.visibility`` of ``summary --json``: the clock alignment, the median
    issue-to-visibility latency per (K, B, G), and the comparison with T_complete; {} where the
    platform has no visibility record."""
    if not list_records(EXPERIMENT.name, platform, root):
        return {}
    vis = Visibility.from_record(latest_record(EXPERIMENT.name, platform, root), root)
    a = vis.alignment
    entry = {
        "source_record": vis.record.record_id,
        "clock_offset_ns": round(a["before"]["offset_ns"], 1),
        "clock_offset_uncertainty_ns": round(a["uncertainty_ns"], 1),
        "rtt_min_ns": a["before"]["rtt_min_ns"],
        "rtt_median_ns": round(a["before"]["rtt_median_ns"], 1),
        "drift_ns": round(a["drift_ns"], 1),
        "swap_check_ns": [round(x, 1) for x in a["swap_check_ns"]],
        "timer_resolution_ns": {"src": a["resolution_src"]["resolution_ns"],
                                "dst": a["resolution_dst"]["resolution_ns"]},
        "latency": [{"K": int(r.producers), "B": int(r.burst_bytes), "G": float(r.gap_us),
                     "latency_us": round(r.latency_us, 3),
                     "latency_iqr_us": [round(r.latency_us_p25, 3), round(r.latency_us_p75, 3)],
                     "latency_from_start_us": round(r.latency_from_start_us, 3),
                     "release_us": round(r.release_us, 3)}
                    for r in vis.points.itertuples()],
    }
    if vis.comparison is not None:
        entry["T_lat_us"] = round(vis.completion_latency_us, 3)
        entry["vs_T_complete"] = [
            {"K": int(r.producers), "B": int(r.burst_bytes),
             "visible_from_start_us": round(r.visible_from_start_us, 3),
             "aggregate_visible_us": round(r.aggregate_visible_us, 3),
             "T_complete_model_us": round(r.T_complete_model_us, 3),
             "diff_us": round(r.diff_us, 3), "gap_min_us": float(r.gap_min_us),
             "launches": int(r.launches)}
            for r in vis.comparison.itertuples()]
    return entry


if __name__ == "__main__":
    harness.main(EXPERIMENT)
