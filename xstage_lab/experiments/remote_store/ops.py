"""Remote operations beyond 16-byte stores (issue 6, part 2), and the concurrent launcher that the
injection patterns (``patterns``) share.

``burst_gap_ops`` in ``kernels/remote_store_burst.cu`` runs the Burst–Gap loop of §3.1 with one
operation per burst: 4-, 8- or 16-byte stores, remote reductions (``red.global.add`` u32 or f32),
bulk copies from shared memory into peer memory (``cp.async.bulk``, issue ending when the copy
engine has read the staging) or 16-byte remote loads (summed, so issue ends when the data is
back). Each source GPU's producers may split over several destinations, and several source GPUs
run at once, started together through a pinned host flag.

Every operation gets the Fig. 3 calibration on a reduced axis set (``config_sweeps``): R from
aligned zero-gap bursts (eq. 1), T_iss⁰ from the gap sweep's plateau, Q from isolated bursts
(eq. 7), then two no-refit predictions of its gap sweep (eqs. 1, 3): with its own fitted M_X
(``calibrate``), and with the 16-byte-store M_X of the same run (``no_refit_error``), which says
where the model stops describing the operation.

    python -m xstage_lab.experiments.remote_store.ops (--out FILE | --root DIR) [--repeats 5] \\
        [--src 0] [--dst 1] [--budget-s 135]

An ``Experiment`` run in process by ``experiments.harness`` (``Operations``): its ``Sweep`` is a
point per operation, each calibrated in a process of its own (``calibrate_isolated``).
"""
from __future__ import annotations

import ctypes
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from ... import model
from ...calibration import (Calibration, calibrate, fit_drain_rate, kb_key, launch_means,
                           point_table)
from ...platform import Inventory, inventory, platform_name
from ...kernel_sources import cuda_source
from ...records import RECORDS_DIR
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment
from .characterization import (BURST_RESOLUTION, KIB, BenchSettings, RemoteStoreBench, burst_rows,
                               check_burst_and_gap, check_choice, check_gpus,
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
OP_BYTES = {"store4": 4, "store8": 8, "store16": 16, "red_add_u32": 4, "red_add_f32": 4,
            "bulk": 16, "load16": 16}
BASELINE_OP = "store16"
MODES = ("periodic", "isolated")
PATHS = ("remote", "local")
ALIGNS = ("each", "first")
_POISON = 0xA5A5A5A5
_ERR_BARRIER_TIMEOUT, _ERR_START_TIMEOUT = 1, 2
_HOST_ALLOC_PORTABLE, _HOST_ALLOC_MAPPED = 0x01, 0x02   # cudaHostAlloc flags

# The reduced axes of issue 6 (one K, two gap-sweep volumes, nine gaps).
DRAIN_BURSTS = (32 * KIB, 64 * KIB, 128 * KIB)   # K·B ≥ 4 MiB at K = 132: the R fit's range
GAP_BURSTS = (16 * KIB, 64 * KIB)
# Gaps as fractions of V/R at the larger gap-sweep burst: the drain branch and the plateau
# (calibrate's plateau starts at 2·V/R).
GAP_FRACTIONS = (0.0, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1.0, 1.5, 2.5, 4.0)
ISOLATED_BURSTS = tuple(k * KIB for k in (4, 8, 16, 24, 32, 48, 64, 128))
LAUNCH_BUDGET_US = 10_000.0   # bursts of one periodic launch, at most (slow operations)
MIN_BURSTS = 40               # bursts of a periodic launch at least (warm-up included)
OPS_BUDGET_S = 135.0          # device time the operations may take, process starts included
OPS_SETTINGS = BenchSettings()


@dataclass(frozen=True)
class OpsSettings:
    """What the operations launcher adds to ``BenchSettings``."""

    bench: BenchSettings = OPS_SETTINGS
    bulk_chunk_bytes: int = 4096   # bytes per cp.async.bulk instruction


# --- routes ----------------------------------------------------------------------------------

Routes = tuple[tuple[int, tuple[int, ...]], ...]


def format_routes(routes: Routes) -> str:
    """``((0, (1, 2)), (1, (0,)))`` → ``"0>1,2;1>0"``: a route set as a record column value."""
    return ";".join(f"{s}>{','.join(str(d) for d in dsts)}" for s, dsts in routes)


def parse_routes(label: str) -> Routes:
    """Inverse of ``format_routes``; raises ValueError on a malformed label."""
    try:
        routes = tuple((int(s), tuple(int(d) for d in dsts.split(",")))
                       for s, dsts in (part.split(">") for part in label.split(";")))
    except ValueError as e:
        raise ValueError(f"malformed routes {label!r}: want 'src>dst,dst;src>dst'") from e
    return routes


def drain_share(routes: Routes) -> dict[int, float]:
    """Each source's share of its one-to-one drain rate when the routes run at once, in the
    fluid picture: a source splits its producers evenly over its destinations, a destination
    drains at most one source's one-to-one rate, and a source is slowed by its busiest
    destination. all-to-one over P GPUs gives 1/(P−1); one-to-all and all-to-all give 1."""
    load: dict[int, float] = {}
    for _, dsts in routes:
        for d in dsts:
            load[d] = load.get(d, 0.0) + 1.0 / len(dsts)
    return {s: min(1.0, min(1.0 / load[d] for d in dsts)) for s, dsts in routes}


# --- validation ------------------------------------------------------------------------------

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


# --- the launcher ----------------------------------------------------------------------------

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


# --- sweeps and fits -------------------------------------------------------------------------

def config_sweeps(config: dict, sm_count: int, fixed: dict, rate_GBps: float,
                  settings: BenchSettings = OPS_SETTINGS, repeats: int = 5) -> list[Sweep]:
    """The calibration sweeps of Fig. 3 on the reduced axes for one ``config`` (the parameters
    that make one operation or route set), K = all SMs, scaled by its drain-rate estimate
    ``rate_GBps`` so that every operation, however slow, reaches its recovered plateau:

    - ``drain_rate``: zero-gap periodic bursts, aligned each burst (R) and free-running (the
      window-rate cross-check), B in DRAIN_BURSTS;
    - ``gap``: the gap sweep, remote and the local control, B in GAP_BURSTS, G at
      GAP_FRACTIONS of V/R of the larger B (the smaller B sees the same gaps, up to 4× its V/R
      and beyond);
    - ``isolated``: isolated bursts over ISOLATED_BURSTS (Q and the knee), each after a recovery
      of V at half the estimated rate.

    Each launch runs at most LAUNCH_BUDGET_US of bursts (at least MIN_BURSTS)."""
    K = sm_count
    base = dict(fixed, **config, lines="fresh", producers=K)
    drain_us = model.drain_time(K * max(GAP_BURSTS), rate_GBps)
    gaps = tuple(round(f * drain_us, 2) for f in GAP_FRACTIONS)

    def bursts(longest_period_us: float) -> int:
        return int(np.clip(LAUNCH_BUDGET_US // longest_period_us, MIN_BURSTS,
                           settings.periodic_bursts))

    return [
        Sweep("drain_rate", (Axis("align", ALIGNS), Axis("burst_bytes", DRAIN_BURSTS)),
              fixed=dict(base, mode="periodic", path="remote", gap_us=0.0,
                         bursts=bursts(model.drain_time(K * max(DRAIN_BURSTS), rate_GBps))),
              repeats=repeats),
        Sweep("gap", (Axis("path", PATHS), Axis("burst_bytes", GAP_BURSTS), Axis("gap_us", gaps)),
              fixed=dict(base, mode="periodic", align="first",
                         bursts=bursts(drain_us + max(gaps))),
              repeats=repeats),
        Sweep("isolated", (Axis("burst_bytes", ISOLATED_BURSTS),),
              fixed=dict(base, mode="isolated", path="remote", align="each", gap_us=0.0,
                         recovery_rate_GBps=round(min(settings.isolated_recovery_rate_GBps,
                                                      rate_GBps / 2), 2)),
              repeats=repeats),
    ]


@dataclass(frozen=True)
class ConfigFit:
    """M_X of one configuration (an operation, or one source of a route set) and how well the
    model describes it: ``calibration`` (its own fit, eqs. 1, 3, 7) and, beside it, the
    no-refit prediction of its gap sweep from the baseline's M_X (``no_refit``)."""

    key: str
    src: int
    calibration: Calibration | None
    predicted: pd.DataFrame | None
    error: str | None             # why the Burst–Gap fit failed, where it did


def fit_config(table: pd.DataFrame, key: str, src: int, platform: str, record_id: str) -> ConfigFit:
    """``calibrate`` on one configuration's rows from one source GPU. A configuration the model
    cannot be fitted to (no drain-limited zero-gap point, no recovered plateau, too few isolated
    volumes) is kept with the reason: that is where the model stops describing it."""
    try:
        cal, predicted = calibrate(table, platform, record_id)
    except (ValueError, np.linalg.LinAlgError) as e:
        return ConfigFit(key, src, None, None, str(e))
    return ConfigFit(key, src, cal, predicted, None)


def no_refit_error(predicted: pd.DataFrame, base: Calibration, share: float = 1.0) -> dict:
    """Predict a configuration's remote gap sweep from the baseline M_X with no refit: R scaled
    by the configuration's drain share (``drain_share``), T_iss⁰ of the same (K, B), the
    baseline's loop gap (eqs. 1, 3). Returns the median |error| of T_iss and T_period (%)."""
    remote = predicted[predicted["path"] == "remote"]
    R = base.drain_rate_GBps * share
    t0 = np.array([base.t_iss0_us.get(kb_key(k, b), np.nan)
                   for k, b in zip(remote["producers"], remote["burst_bytes"])])
    g = remote["gap_us"] + base.loop_gap_us
    t_iss = model.issue_time(g, remote["burst_volume"], t0, R)
    per = model.period(g, remote["burst_volume"], t0, R)
    return {"drain_rate_GBps": R, "share": share,
            "t_iss_err_pct": float(np.nanmedian(np.abs(t_iss / remote["t_iss_us"] - 1)) * 100),
            "period_err_pct": float(np.nanmedian(np.abs(per / remote["period_us"] - 1)) * 100)}


def fit_entry(fit: ConfigFit, base: Calibration | None, share: float = 1.0) -> dict:
    """A configuration's fitted (T_iss⁰, R, Q) and both no-refit errors, as plain data."""
    out = {"key": fit.key, "src": fit.src}
    if fit.calibration is None:
        return {**out, "fit_error": fit.error}
    s = fit.calibration.summary()
    out.update({k: s[k] for k in ("R_GBps", "R_GBps_iqr", "R_free_running_window_GBps",
                                  "T_iss0_us", "Q_MiB", "knee_KB_per_producer", "G_star_us",
                                  "gap_prediction_median_abs_err_pct",
                                  "gap_period_prediction_median_abs_err_pct",
                                  "gap_drain_branch_median_abs_err_pct",
                                  "local_drain_rate_GBps")})
    out["loop_gap_us"] = round(fit.calibration.loop_gap_us, 3)
    if base is not None:
        out["no_refit_from_baseline"] = {k: round(v, 3) for k, v in
                                         no_refit_error(fit.predicted, base, share).items()}
    return out


def gap_points(table: pd.DataFrame) -> pd.DataFrame:
    """Point medians (over repeats) of a beyond record's table, per config and source."""
    frames = []
    for (config, src), rows in table.groupby(["config", "src"]):
        frames.append(point_table(launch_means(rows)).assign(config=config, src=src))
    return pd.concat(frames, ignore_index=True)


def probe_rate(bench: RemoteOpsBench, config: dict, fixed: dict, K: int) -> float:
    """One checked zero-gap launch of ``config`` (B = 64 KiB) before any of its timing: its
    aggregate rate V/T_period, slowest source, is the drain-rate estimate that scales the
    config's drain-rate sweep. Raises RuntimeError where the launch or its check fails."""
    p = dict(fixed, **config, mode="periodic", path="remote", producers=K,
             burst_bytes=max(GAP_BURSTS), gap_us=0.0, lines="fresh", align="first")
    rows = bench.measure(p)
    steady = rows[~rows["warmup"]]
    rate = float((steady["burst_volume"] / steady["period_us"] / 1e3)
                 .groupby(steady["src"]).median().min())
    if not rate > 0:
        raise RuntimeError(f"no steady period in the probe launch (rate {rate})")
    return rate


def sweep_seconds(sweep: Sweep, rate_GBps: float, settings: BenchSettings,
                  launch_overhead_s: float = 0.006) -> float:
    """What ``sweep`` should take at drain rate ``rate_GBps`` (the local control at no cost):
    every launch's bursts at the max law's period plus a fixed overhead per launch (buffer
    poison, check, copies), for the time budget."""
    total = 0.0
    for p in sweep.points():
        v = p["producers"] * p["burst_bytes"]
        drain = model.drain_time(v, rate_GBps) if p["path"] == "remote" else 0.0
        if p["mode"] == "isolated":
            recovery = replace(settings, isolated_recovery_rate_GBps=p["recovery_rate_GBps"])
            run_us = settings.isolated_bursts * (drain + isolated_recovery_us(v, recovery))
        else:
            run_us = p["bursts"] * max(drain, p["gap_us"])
        total += (sweep.repeats + sweep.warmup) * (run_us / 1e6 + launch_overhead_s)
    return total


def _label(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items())


def aligned_drain_rate(rows: pd.DataFrame) -> float:
    """R of a drain_rate sweep's rows (eq. 1, ``fit_drain_rate``), slowest source."""
    launches = launch_means(rows)
    aligned = launches[launches["align"] == "each"]
    return min(fit_drain_rate(g["burst_volume"], g["period_us"])[0]
               for _, g in aligned.groupby("src"))


def calibrate_configs(bench: RemoteOpsBench, configs: list[dict], fixed: dict, K: int,
                      repeats: int = 5, progress: bool = True, budget_s: float = float("inf")
                      ) -> tuple[pd.DataFrame, dict]:
    """For each config in turn: a checked probe launch, then its calibration sweeps
    (``config_sweeps``), the drain-rate sweep first, whose R scales the gap and isolated
    sweeps. Every point of a sweep is validated before its first launch. A config whose probe
    fails (its check, or a CUDA fault, which leaves the context unusable for the configs after
    it) or whose sweeps would overrun ``budget_s`` is left out with the reason. Returns the rows
    (``sweep`` and ``config`` columns added) and the run facts (clocks, the sweeps as run, the
    rates that scaled them, the configs left out)."""
    from ...sweep import run_sweep

    t0 = time.monotonic()
    srcs = sorted({s for cfg in configs
                   for s, _ in parse_routes(dict(fixed, **cfg)["routes"])})
    clock = lambda: {str(s): bench.sm_clock_mhz(s) for s in srcs}  # noqa: E731
    frames, facts = [], {"clocks": {}, "sweeps": [], "rates_GBps": {}, "excluded": {}}

    def run(sw: Sweep, label: str, cfg: dict) -> pd.DataFrame:
        rows, facts["clocks"][f"{label}/{sw.name}"] = run_sweep(
            sw, bench.measure, validate=bench.validate, sm_clock_mhz=clock, progress=progress)
        facts["sweeps"].append({"config": cfg, **sw.describe()})
        return rows.assign(sweep=sw.name, config=label)

    def over_budget(sweeps: list[Sweep], rate: float) -> str | None:
        need = sum(sweep_seconds(sw, rate, bench.settings) for sw in sweeps)
        left = budget_s - (time.monotonic() - t0)
        return f"time budget: needs ~{need:.0f} s, {left:.0f} s left" if need > left else None

    for cfg in configs:
        label = _label(cfg)
        try:
            estimate = probe_rate(bench, cfg, fixed, K)
        except RuntimeError as e:
            facts["excluded"][label] = str(e)
            continue
        drain, gap, isolated = config_sweeps(cfg, K, fixed, estimate, bench.settings, repeats)
        reason = over_budget([drain, gap, isolated], estimate)
        if reason:
            facts["excluded"][label] = reason
            continue
        drain = run(drain, label, cfg)
        try:
            rate = aligned_drain_rate(drain)
        except ValueError:  # no drain-limited point: keep the probe's estimate for the scale
            rate = estimate
        facts["rates_GBps"][label] = {"probe": estimate, "drain_sweep": rate}
        _, gap, isolated = config_sweeps(cfg, K, fixed, rate, bench.settings, repeats)
        reason = over_budget([gap, isolated], rate)
        if reason:
            facts["excluded"][label] = reason
            continue
        frames += [drain, run(gap, label, cfg), run(isolated, label, cfg)]
        print(f"{label}: done at {time.monotonic() - t0:.0f} s", flush=True)
    if not frames:
        raise NothingMeasured(facts)
    return pd.concat(frames, ignore_index=True), facts


class NothingMeasured(RuntimeError):
    """``calibrate_configs`` left every configuration out; ``facts`` says why."""

    def __init__(self, facts: dict):
        super().__init__(f"no configuration was measured: {facts['excluded']}")
        self.facts = facts


def calibrate_one(bench: RemoteOpsBench, cfg: dict, fixed: dict, K: int, repeats: int,
                  progress: bool, deadline: float) -> tuple[pd.DataFrame | None, dict]:
    """``calibrate_configs`` of ``cfg`` alone within what is left of the run's budget at
    ``deadline`` (``time.monotonic``, one clock for every process of the machine). Returns (rows,
    or None where it was left out, and the facts)."""
    try:
        return calibrate_configs(bench, [cfg], fixed, K, repeats, progress,
                                 deadline - time.monotonic())
    except NothingMeasured as e:
        return None, e.facts


def calibrate_op(cfg: dict, fixed: dict, K: int, repeats: int, progress: bool,
                 deadline: float, settings: OpsSettings) -> tuple[pd.DataFrame | None, dict]:
    """One operation's ``calibrate_one`` on a bench of its own; the facts with the bench's seed."""
    bench = RemoteOpsBench(settings)
    table, facts = calibrate_one(bench, cfg, fixed, K, repeats, progress, deadline)
    return table, {**facts, "seeds": {_label(cfg): int(bench.seed)}}


def _child_main(calibrate, kwargs: dict, out: Path) -> None:
    """A spawned child: ``calibrate(**kwargs)`` pickled to ``out``; on an exception its
    traceback goes to ``out.with_suffix('.err')`` and the child exits non-zero."""
    import pickle
    import traceback

    try:
        result = calibrate(**kwargs)
    except BaseException:
        out.with_suffix(".err").write_text(traceback.format_exc())
        raise
    out.write_bytes(pickle.dumps(result))


def calibrate_isolated(cfg: dict, fixed: dict, K: int, repeats: int, progress: bool,
                       deadline: float, settings: OpsSettings) -> tuple[pd.DataFrame | None, dict]:
    """``calibrate_op`` of ``cfg`` in a process of its own (``spawn``).

    Why: a CUDA fault (an illegal address) is sticky, it ends the CUDA context of the process
    that met it, so in one process it would lose every config after it and the record of all.
    Here a child that faults, raises or dies loses its own config only: it is left out (None)
    with its exit code and the last lines of its error."""
    import multiprocessing
    import pickle
    import tempfile

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="xstage-ops-") as tmp:
        out = Path(tmp) / "config.pkl"
        child = ctx.Process(target=_child_main, args=(calibrate_op, dict(
            cfg=cfg, fixed=fixed, K=K, repeats=repeats, progress=progress, deadline=deadline,
            settings=settings), out))
        child.start()
        child.join()
        if child.exitcode == 0 and out.exists():
            return pickle.loads(out.read_bytes())
        err = out.with_suffix(".err")
        lines = err.read_text().splitlines() if err.exists() else []
    tail = [ln.strip() for ln in lines if ln.strip(" ^~")][-3:]  # no caret rows
    return None, {"excluded": {_label(cfg): f"child process exited {child.exitcode}: "
                                            + (" | ".join(tail) or "no error text")}}


# A config's rows keep the point, repeat and order of its own calibration sweeps under these
# names while the harness tags them with the config's point (``ConfigCalibration.finish``).
_SWEEP_TAGS = {"point": "sweep_point", "repeat": "sweep_repeat", "order": "sweep_order"}


class ConfigCalibration(Experiment):
    """The calibration sweeps of every configuration (an operation, or a route set) in turn,
    within one time budget: the declared ``Sweep`` is one point per configuration, each measured
    once by ``calibrate_config`` (a checked probe launch, then ``config_sweeps`` scaled by the
    rates it finds; every launch checks its destinations). A configuration that fails or would
    overrun the budget is left out with the reason (``excluded``)."""

    launch = "in_process"
    resolution = BURST_RESOLUTION

    def add_arguments(self, p) -> None:
        p.add_argument("--budget-s", type=float, default=self.budget_s,
                       help="device time the configurations may take, s")
        p.set_defaults(settings=OpsSettings())  # the run_* functions may pass others

    def check_args(self, a) -> None:
        if a.repeats is not None and a.repeats < 1:
            raise ValueError("--repeats must be >= 1")
        if not a.budget_s > 0:
            raise ValueError("--budget-s must be positive")

    def start(self, run) -> None:
        self.deadline = time.monotonic() + run.args.budget_s
        self.facts = {"clocks": {}, "sweeps": [], "rates_GBps": {}, "excluded": {}}

    def calibrate_config(self, point: dict, run) -> tuple[pd.DataFrame | None, dict]:
        raise NotImplementedError

    def measure(self, point, run) -> pd.DataFrame:
        """The config's rows (none where it was left out); its facts kept for the header."""
        table, facts = self.calibrate_config(point, run)
        for key, value in facts.items():
            if isinstance(value, list):
                self.facts[key] += value
            else:
                self.facts.setdefault(key, {}).update(value)
        return pd.DataFrame() if table is None else table.rename(columns=_SWEEP_TAGS)

    def finish(self, table, run) -> pd.DataFrame:
        for label, why in self.facts["excluded"].items():
            print(f"{self.name}: left out {label}: {why}", flush=True)
        if table.empty:
            raise NothingMeasured(self.facts)
        self.table = table.drop(columns=list(_SWEEP_TAGS)).rename(
            columns={v: k for k, v in _SWEEP_TAGS.items()})
        return self.table  # the fits of the header (``metadata``) are made from it

    @staticmethod
    def settings_fact(settings: OpsSettings) -> dict:
        return {**settings.bench.__dict__, "bulk_chunk_bytes": settings.bulk_chunk_bytes}


class Operations(ConfigCalibration):
    """Every operation of ``OPS`` on the route src → dst, each in a process of its own
    (``calibrate_isolated``), fitted against the 16-byte stores of the same run."""

    name = "remote_ops"
    paper = "issue 6 part 2 (§3's model beyond 16-byte stores)"
    budget_s = OPS_BUDGET_S

    def add_arguments(self, p) -> None:
        p.add_argument("--repeats", type=int, default=5)
        p.add_argument("--src", type=int, default=0)
        p.add_argument("--dst", type=int, default=1)
        super().add_arguments(p)

    def sweeps(self, args) -> list[Sweep]:
        return [Sweep("ops", (Axis("config", [{"op": op} for op in OPS]),),
                      fixed=dict(routes=format_routes(((args.src, (args.dst,)),))),
                      repeats=1, warmup=0)]

    def start(self, run) -> None:
        super().start(run)
        self.facts["seeds"] = {}
        self.inv = inventory()
        check_gpus(run.args.src, run.args.dst, self.inv)
        self.K = self.inv.gpus[run.args.src].sm_count

    def calibrate_config(self, point, run):
        args = run.args
        return calibrate_isolated({"op": point["op"]}, {"routes": point["routes"]}, self.K,
                                  args.repeats, not args.no_progress, self.deadline,
                                  args.settings)

    def metadata(self, run) -> dict:
        args = run.args
        return operations_params(self.table, {**self.facts,
                                              "settings": self.settings_fact(args.settings)},
                                 args.src, args.dst, platform_name(self.inv))


EXPERIMENT = Operations()


def run_operations(repeats: int = 5, src: int = 0, dst: int = 1,
                   settings: OpsSettings = OpsSettings(), progress: bool = True,
                   budget_s: float = OPS_BUDGET_S, root: Path = RECORDS_DIR) -> Path:
    """Calibrate every operation of ``OPS`` on the route ``src → dst`` and save one
    ``remote_ops`` record: per-burst rows, and in its parameters each operation's fit and its
    no-refit error from the 16-byte stores of the same run. Each operation runs in a process of
    its own (``calibrate_isolated``); those that failed their check, faulted or would overrun
    ``budget_s`` are named with the reason, in the record and printed. Returns the record's
    path."""
    args = harness.parse(EXPERIMENT, ["--root", str(root), "--repeats", str(repeats),
                                      "--src", str(src), "--dst", str(dst),
                                      "--budget-s", str(budget_s),
                                      *([] if progress else ["--no-progress"])])
    args.settings = settings
    return harness.run(EXPERIMENT, args)


def operations_params(table: pd.DataFrame, facts: dict, src: int, dst: int,
                      platform: str) -> dict:
    """A ``remote_ops`` record's parameters: the run ``facts`` (its calibration sweeps as
    ``calibration_sweeps``) and each operation's fit with its no-refit error from the baseline
    (16-byte stores) of the same run."""
    if BASELINE_OP not in set(table["op"]):
        raise RuntimeError(f"the baseline {BASELINE_OP} was not measured: {facts['excluded']}")
    fits = operation_fits(table, platform, "this record")
    base = fits[BASELINE_OP].calibration
    return {"ops": list(fits), "baseline": BASELINE_OP, "src": src, "dst": dst,
            **run_facts(facts), "fits": {op: fit_entry(f, base) for op, f in fits.items()}}


def run_facts(facts: dict) -> dict:
    """``facts`` for a record's header, the sweeps run per config as ``calibration_sweeps`` (the
    harness's ``sweeps`` is the declared one, a point per config)."""
    return {("calibration_sweeps" if k == "sweeps" else k): v for k, v in facts.items()}


def operation_fits(table: pd.DataFrame, platform: str, record_id: str) -> dict[str, ConfigFit]:
    """Each operation's fit (``fit_config``) of a ``remote_ops`` table, in run order."""
    return {op: fit_config(rows, op, int(rows["src"].iloc[0]), platform, record_id)
            for op, rows in table.groupby("op", sort=False)}


def summary_entry(params: dict, record_id: str) -> dict:
    """The ``operations`` entry of ``summary --json`` from a ``remote_ops`` record's parameters:
    each operation's fitted (T_iss⁰, R, Q) and no-refit errors, and the operations left out."""
    return {"baseline": params["baseline"], "route": f"{params['src']}>{params['dst']}",
            "per_op": params["fits"], "excluded": params["excluded"],
            "source_record": record_id}


if __name__ == "__main__":
    harness.main(EXPERIMENT)
