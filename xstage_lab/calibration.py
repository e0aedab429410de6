"""Calibration of M_X = (T_iss^0(K, V), R, Q(K)) from a remote-store characterization (§3.3–3.6).

- R from zero-gap steady-state periods across K/B decompositions, T_period^ss = V/R (eq. 1, Fig. 3d);
- T_iss^0 from the recovered plateau of the gap sweep (§3.4);
- Q(K) and the knee from isolated bursts, T_iss^iso = max(T_iss^0(K, V), (V − Q)/R) (eq. 7, Fig. 3c);
- then the gap sweep predicted with no refit (eqs. 1, 3; Figs. 3a, 3b) and its error;
- on the host link, where the record holds the ``under_load`` probe, R under a concurrent
  memory-bound load over R alone and the load's slowdown beside a full X-Stage
  (``under_load_fits``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from . import model
from .sweep import median_spread

MIB = 1024 * 1024
KIB = 1024
# Zero-gap points at or above this aggregate volume enter the R fit: well past the issue floor of
# a full-chip burst, where the period is set by the drain (Fig. 3d's converged trend).
R_FIT_MIN_VOLUME = 4 * MIB
# Gap-sweep points whose gap is at least this multiple of V/R are on the recovered plateau.
PLATEAU_GAP_MULTIPLE = 2.0


# The mode of the under-GEMM probe's rows (ops.remote_store.under_gemm): one row per launch.
UNDER_GEMM = "under_gemm"
# The mode of the under-load probe's rows (ops.remote_store.under_load): one row per launch, no
# bursts, so the burst fits leave them out.
UNDER_LOAD = "under_load"

# A zero-gap point whose period exceeds V/R by more than this is issue-limited, not drain-limited.
ISSUE_LIMITED_EXCESS = 0.10
# An isolated sweep that the affine floor alone fits within this relative error has no
# drain-limited branch in range: no knee, no capacity.
FLOOR_ONLY_TOL = 0.02

# What names a measurement point of a remote_store record; a launch is a point's repeat.
POINT_KEYS = ["sweep", "point", "mode", "path", "producers", "burst_bytes", "gap_us", "src", "dst",
              "lines", "align", "burst_volume"]


# The launch settings of a remote_store run, as its header keeps them (``settings``): the
# launcher (``ops.remote_store.burst``) runs with them, and the simulator replays a record's
# launches with them (a record whose header has none ran with the defaults).
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


def launch_means(table: pd.DataFrame) -> pd.DataFrame:
    """Steady-state value of each launch: the mean over its producers' bursts inside the window
    where all producers overlap (each burst row weighted by the producers it counts), after the
    warm-up bursts. A time average, as the fluid model's quantities are. The under-load and
    under-GEMM probes' launches, which have no bursts, are left out."""
    if "mode" in table:
        table = table[~table["mode"].isin((UNDER_LOAD, UNDER_GEMM))]
    # a table that held probe rows too has the warm-up flag as objects: NaN where no burst was
    steady = table[~table["warmup"].astype(bool) & (table["producers_in_window"] > 0)]
    keys = POINT_KEYS + ["repeat"]
    values = ["t_iss_us", "period_us", "gap_eff_us"]
    w = steady["producers_in_window"]
    weighted = steady[keys].assign(_w=w, **{v: steady[v] * w for v in values})
    sums = weighted.groupby(keys, dropna=False).sum()
    out = sums[values].div(sums["_w"], axis=0)
    rest = steady.groupby(keys, dropna=False)[["start_skew_ns", "window_rate_GBps",
                                               "sm_clock_mhz"]].median()
    return out.join(rest).reset_index()


def point_table(launches: pd.DataFrame) -> pd.DataFrame:
    """Every measurement point's medians over repeats (issue time, period, effective gap, window
    rate), each with its interquartile spread."""
    return median_spread(launches, POINT_KEYS, "t_iss_us", "period_us", "gap_eff_us",
                         "window_rate_GBps")


def fit_drain_rate(burst_volume, period_us) -> tuple[float, np.ndarray]:
    """Least-squares R (GB/s) for T_period = V/R through the origin (eq. 1), on the
    drain-dominated points. The max law (eqs. 1–3) puts every period at or above V/R; a point
    more than ISSUE_LIMITED_EXCESS above the fitted line is issue-limited and leaves the fit,
    which is repeated until no point leaves. Returns R and the mask of the points kept."""
    v, t = np.asarray(burst_volume, float), np.asarray(period_us, float)
    keep = np.ones(v.size, bool)
    while True:
        if not keep.any():
            raise ValueError("no drain-dominated points to fit R")
        R = float((v[keep] @ v[keep]) / (v[keep] @ t[keep]) / 1e3)
        now = t <= (1 + ISSUE_LIMITED_EXCESS) * model.drain_time(v, R)
        if (now == keep).all():
            return R, keep
        keep = now


@dataclass(frozen=True)
class IsolatedFit:
    """Eq. 7 fitted for one producer count: affine issue floor, capacity Q and knee volume."""

    producers: int
    drain_rate_GBps: float
    fixed_us: float
    issue_rate_GBps: float
    capacity_bytes: float | None      # None: no drain-limited branch within the measured range
    knee_volume_bytes: float | None

    def floor(self) -> model.IssueFloor:
        return model.IssueFloor(self.producers, self.fixed_us, self.issue_rate_GBps)

    def predict(self, burst_volume):
        t0 = self.floor()(burst_volume)
        if self.capacity_bytes is None:
            return t0
        return model.isolated_issue_time(burst_volume, t0, self.capacity_bytes,
                                         self.drain_rate_GBps)


def fit_isolated(producers: int, burst_volume, t_iss_us, drain_rate: float) -> IsolatedFit:
    """Fit T_iss^iso(V) = max(a + V/I, (V − Q)/R) with R fixed (eq. 7); the knee is where the two
    branches meet, and Q = V_knee − R·T_iss^0(V_knee) (eq. 6 at the knee) holds by construction."""
    v = np.asarray(burst_volume, float)
    t = np.asarray(t_iss_us, float)
    order = np.argsort(v)
    v, t = v[order], t[order]
    if v.size < 4:
        raise ValueError("the isolated fit needs at least four burst volumes")
    # imported here: scipy.optimize is 2 s of every import of the package (plots import this
    # module), most of which never fit
    from scipy.optimize import least_squares

    small = slice(0, max(2, v.size // 3))
    slope, intercept = np.polyfit(v[small], t[small], 1)
    q0 = float(np.median((v - drain_rate * 1e3 * t)[-3:]))  # V − R·T on the largest bursts
    x0 = [max(intercept, 1e-3), max(1.0 / max(slope, 1e-12) / 1e3, drain_rate), max(q0, 0.0)]
    floor_only = least_squares(lambda x: (x[0] + v / (x[1] * 1e3) - t) / t, x0[:2],
                               bounds=([0.0, 1.0], [np.inf, np.inf]))
    if np.max(np.abs(floor_only.fun)) <= FLOOR_ONLY_TOL:
        a, rate = (float(x) for x in floor_only.x)
        return IsolatedFit(producers, drain_rate, a, rate, None, None)

    def residual(x):
        a, rate, q = x
        pred = np.maximum(a + v / (rate * 1e3), (v - q) / (drain_rate * 1e3))
        return (pred - t) / t

    fit = least_squares(residual, x0, bounds=([0.0, 1.0, 0.0], [np.inf, np.inf, np.inf]))
    a, rate, q = (float(x) for x in fit.x)
    knee = None
    if rate > drain_rate:  # issue outruns the drain, so a large enough burst must hit capacity
        knee = (a + q / (drain_rate * 1e3)) / (1 / (drain_rate * 1e3) - 1 / (rate * 1e3))
        if knee > v.max():
            knee = None
    return IsolatedFit(producers, drain_rate, a, rate, q if knee is not None else None, knee)


@dataclass(frozen=True)
class Calibration:
    """M_X and how well it holds: the numbers of Table 1 for this platform."""

    platform: str
    source_record: str
    sm_count: int
    drain_rate_GBps: float
    drain_rate_p25: float
    drain_rate_p75: float
    window_rate_GBps: float    # free-running producers' aggregate zero-gap rate (cross-check of R)
    t_iss0_us: dict            # "K=..,B=.." -> plateau T_iss^0 (µs)
    t_iss0_spread: dict        # "K=..,B=.." -> [p25, p75]
    loop_gap_us: float         # gap the burst loop adds beyond G (CTA barrier, time stamps)
    isolated: dict             # K -> IsolatedFit as a dict
    capacity_spread: dict      # K -> [p25, p75] of Q fitted on each repeat alone (bytes)
    recovery_gap_us: dict      # "K=..,B=.." -> G*
    gap_issue_err_pct: float   # no-refit median |error| of T_iss over the remote gap sweep
    gap_period_err_pct: float  # same for T_period
    gap_drain_branch_err_pct: float  # T_iss error over the drain-limited points only (G < G*)
    local_tiss_spread_pct: float  # (max - min)/median of local T_iss across its issue-bound gaps
    local_tiss_spread_all_gaps_pct: float  # the same over every gap, HBM-bound ones included
    local_drain_rate_GBps: float  # the local control's zero-gap rate (HBM-bound)
    # The completion-coupled world, measured by the fenced sweep (None where a record has none):
    completion: dict | None = None   # CompletionFit as a dict
    link: str = "nvlink"             # where the remote stores went (platform.LINKS)
    # The copy engine's rate over the same link, measured in the same run (host link): R's baseline
    copy_engine_GBps: float | None = None
    # The under-load probe (host link; None where the record has none): its fits per layout and
    # K (under_load_fits), and its two numbers (under_load_terms): R under the load over R alone
    # (the host-link MoE forecast scales R by it), and the load's throughput beside local stores
    # over beside host stores that fill the X-Stage
    under_load: list | None = None
    drain_under_load_ratio: float | None = None
    load_slowdown_full: float | None = None
    # The under-GEMM probe (host link; None where the record has none): its fits per GEMM and K
    # (under_gemm_fits) and a GEMM's slowdown beside a full X-Stage (under_gemm_terms)
    under_gemm: list | None = None
    gemm_slowdown_full: float | None = None

    def platform_model(self) -> model.PlatformModel:
        def key(s):
            k, b = s.split(",")
            return int(k[2:]), int(b[2:])
        return model.PlatformModel(
            drain_rate=self.drain_rate_GBps,
            t_iss0={key(k): v for k, v in self.t_iss0_us.items()},
            capacity={int(k): f["capacity_bytes"] for k, f in self.isolated.items()
                      if f["capacity_bytes"] is not None},
            issue_floor={int(k): model.IssueFloor(int(k), f["fixed_us"], f["issue_rate_GBps"])
                         for k, f in self.isolated.items()})

    def summary(self) -> dict:
        """The ``calibration`` entry of ``summary --json`` (schema in docs/summary_json.md)."""
        iso = {int(k): f for k, f in self.isolated.items()}
        return {
            "R_GBps": round(self.drain_rate_GBps, 1),
            "R_GBps_iqr": [round(self.drain_rate_p25, 1), round(self.drain_rate_p75, 1)],
            "R_free_running_window_GBps": round(self.window_rate_GBps, 1),
            "T_iss0_us": {k: round(v, 3) for k, v in self.t_iss0_us.items()},
            "Q_MiB": {f"K={k}": round(f["capacity_bytes"] / MIB, 3)
                      for k, f in iso.items() if f["capacity_bytes"] is not None},
            "Q_MiB_iqr": {f"K={k}": [round(q / MIB, 3) for q in spread]
                          for k, spread in self.capacity_spread.items()},
            "knee_KB_per_producer": {f"K={k}": round(f["knee_volume_bytes"] / k / KIB, 2)
                                     for k, f in iso.items() if f["knee_volume_bytes"] is not None},
            "G_star_us": {k: round(v, 3) for k, v in self.recovery_gap_us.items()},
            "gap_prediction_median_abs_err_pct": round(self.gap_issue_err_pct, 2),
            "gap_period_prediction_median_abs_err_pct": round(self.gap_period_err_pct, 2),
            "gap_drain_branch_median_abs_err_pct": round(self.gap_drain_branch_err_pct, 2),
            "local_control_tiss_spread_pct": round(self.local_tiss_spread_pct, 2),
            "local_control_tiss_spread_all_gaps_pct": round(self.local_tiss_spread_all_gaps_pct, 2),
            "local_drain_rate_GBps": round(self.local_drain_rate_GBps, 1),
            **({"completion": {k: v for k, v in self.completion.items() if k != "periods"}}
               if self.completion else {}),
            **({"link": self.link, "copy_engine_GBps": round(self.copy_engine_GBps, 1)}
               if self.copy_engine_GBps is not None else {}),
            **({"drain_under_load_ratio": round(self.drain_under_load_ratio, 4),
                "load_slowdown_full": round(self.load_slowdown_full, 4)}
               if self.under_load is not None else {}),
            **({"gemm_slowdown_full": round(self.gemm_slowdown_full, 4)}
               if self.under_gemm is not None else {}),
            "sm_count": self.sm_count,
            "source_record": self.source_record,
        }


def kb_key(k, b) -> str:
    """The key of a (K, B) pair in calibrations and summaries: ``K=132,B=32768``."""
    return f"K={int(k)},B={int(b)}"


def kb_text(b) -> str:
    """A burst size B in bytes as labels and table columns show it: ``32 KB``."""
    return f"{int(b) // 1024} KB"


def calibrate(table: pd.DataFrame, platform: str, source_record: str,
              min_volume: float = R_FIT_MIN_VOLUME, *, link: str = "nvlink",
              copy_engine_GBps: float | None = None) -> tuple[Calibration, pd.DataFrame]:
    """Fit M_X from a ``remote_store`` record's table (its stores over ``link``; the copy
    engine's rate over it is kept beside R). Returns the calibration and the gap-sweep points with
    their no-refit predictions (for Figs. 3a, 3b)."""
    launches = launch_means(table)
    points = point_table(launches)

    # R (eq. 1): zero-gap periods of aligned aggregate bursts, every K/B decomposition at or above
    # min_volume. Free-running producers cross-check it through their window rate.
    drain = launches[launches["sweep"] == "drain_rate"]
    zero_gap = drain[(drain["align"] == "each") & (drain["burst_volume"] >= min_volume)]
    free = drain[(drain["align"] == "first") & (drain["burst_volume"] >= min_volume)]
    window_rate = float(free["window_rate_GBps"].median()) if len(free) else float("nan")
    R, drain_limited = fit_drain_rate(zero_gap["burst_volume"], zero_gap["period_us"])
    zero_gap = zero_gap[drain_limited]
    per_launch_R = zero_gap["burst_volume"] / zero_gap["period_us"] / 1e3
    r_p25, r_p75 = np.percentile(per_launch_R, [25, 75])

    gap_pts = points[points["sweep"] == "gap"]
    sm_count = int(gap_pts["producers"].max())

    # The burst loop (CTA barrier, time stamps) adds to every gap; the local control, which no
    # drain backpressures, measures it: its effective gap minus the set gap.
    local = gap_pts[gap_pts["path"] == "local"]
    loop_gap_us = float(np.median(local["gap_eff_us"] - local["gap_us"]))

    # T_iss^0 (K, B): the plateau, gaps of at least PLATEAU_GAP_MULTIPLE · V/R.
    remote_launches = launches[(launches["sweep"] == "gap") & (launches["path"] == "remote")]
    t_iss0, t_iss0_spread, g_star = {}, {}, {}
    for (k, b), grp in remote_launches.groupby(["producers", "burst_bytes"]):
        v = k * b
        plateau = grp[grp["gap_us"] + loop_gap_us >= PLATEAU_GAP_MULTIPLE * model.drain_time(v, R)]
        if plateau.empty:
            raise ValueError(f"gap sweep for K={k}, B={b} reaches no recovered plateau")
        key = kb_key(k, b)
        t_iss0[key] = float(plateau["t_iss_us"].median())
        t_iss0_spread[key] = [float(x) for x in np.percentile(plateau["t_iss_us"], [25, 75])]
        g_star[key] = float(model.recovery_gap(v, t_iss0[key], R))

    # No-refit prediction of the gap sweep (eqs. 1, 3) at the gap the producers saw.
    remote = gap_pts[gap_pts["path"] == "remote"].copy()
    t0 = np.array([t_iss0[kb_key(k, b)] for k, b in zip(remote["producers"], remote["burst_bytes"])])
    g = remote["gap_us"] + loop_gap_us
    remote["t_iss0_us"] = t0
    remote["gap_model_us"] = g
    remote["t_iss_pred_us"] = model.issue_time(g, remote["burst_volume"], t0, R)
    remote["period_pred_us"] = model.period(g, remote["burst_volume"], t0, R)
    remote["period_cc_us"] = model.period_completion_coupled(g, remote["burst_volume"], R)
    issue_err = np.abs(remote["t_iss_pred_us"] / remote["t_iss_us"] - 1) * 100
    drain_branch = g < np.array([g_star[kb_key(k, b)] for k, b in
                                 zip(remote["producers"], remote["burst_bytes"])])
    period_err = np.abs(remote["period_pred_us"] / remote["period_us"] - 1) * 100

    # The local control is issue-bound except where its own drain binds: at the smallest gaps a
    # full-chip burst to local memory streams at HBM bandwidth (its zero-gap rate, V/T_period).
    local = local.assign(gap_model_us=local["gap_us"] + loop_gap_us)
    local_rate = float((local["burst_volume"] / local["period_us"])[local["gap_us"] == 0].max() / 1e3)
    issue_bound = local["gap_model_us"] >= model.drain_time(local["burst_volume"], local_rate)

    def spread(frame):
        return max((g["t_iss_us"].max() - g["t_iss_us"].min()) / g["t_iss_us"].median() * 100
                   for _, g in frame.groupby("burst_bytes"))

    predicted = pd.concat([remote, local.assign(local_issue_bound=issue_bound)], ignore_index=True)

    iso = points[(points["sweep"] == "isolated") & (points["path"] == "remote")]
    iso_launches = launches[(launches["sweep"] == "isolated") & (launches["path"] == "remote")]
    isolated, capacity_spread = {}, {}
    for k, grp in iso.groupby("producers"):
        fit = fit_isolated(int(k), grp["burst_volume"], grp["t_iss_us"], R)
        isolated[str(int(k))] = asdict(fit)
        # The spread of Q: the same fit on each repeat's launches alone.
        per_repeat = [fit_isolated(int(k), rep["burst_volume"], rep["t_iss_us"], R).capacity_bytes
                      for _, rep in iso_launches[iso_launches["producers"] == k].groupby("repeat")]
        per_repeat = [q for q in per_repeat if q is not None]
        if per_repeat:
            capacity_spread[str(int(k))] = [float(x) for x in np.percentile(per_repeat, [25, 75])]
    probe = {}
    if "mode" in table and (table["mode"] == UNDER_LOAD).any():
        fits = under_load_fits(table)
        probe = {"under_load": fits.to_dict("records"), **under_load_terms(fits)}
    if "mode" in table and (table["mode"] == UNDER_GEMM).any():
        fits = under_gemm_fits(table)
        probe |= {"under_gemm": fits.to_dict("records"), **under_gemm_terms(fits)}
    fenced = points[(points["sweep"] == "fenced") & (points["path"] == "remote")]
    completion = (asdict(fit_completion(fenced, gap_pts[gap_pts["path"] == "remote"], R, t_iss0,
                                        loop_gap_us)) if len(fenced) else None)
    cal = Calibration(platform=platform, source_record=source_record, sm_count=sm_count,
                      drain_rate_GBps=R, drain_rate_p25=float(r_p25), drain_rate_p75=float(r_p75),
                      window_rate_GBps=window_rate,
                      t_iss0_us=t_iss0, t_iss0_spread=t_iss0_spread, loop_gap_us=loop_gap_us,
                      isolated=isolated, capacity_spread=capacity_spread, recovery_gap_us=g_star,
                      gap_issue_err_pct=float(np.median(issue_err)),
                      gap_period_err_pct=float(np.median(period_err)),
                      gap_drain_branch_err_pct=float(np.median(issue_err[drain_branch])),
                      local_tiss_spread_pct=float(spread(local[issue_bound])),
                      local_tiss_spread_all_gaps_pct=float(spread(local)),
                      local_drain_rate_GBps=local_rate, completion=completion, link=link,
                      copy_engine_GBps=copy_engine_GBps, **probe)
    return cal, predicted


def under_load_fits(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (layout, K) of a record's ``under_load`` probe, medians over its launches:
    the host stores' aggregate rate alone (``drain_alone_GBps``, R as this probe measures it) and
    beside the load (``drain_under_load_GBps``) and their ratio; the load's rate alone, beside
    local stores and beside host stores, and ``load_slowdown``, beside local over beside host
    stores: how much a backpressured host link (X-Stage full) slows memory-bound work, against
    stores that take the same instructions to local memory. NaN where a case is missing."""
    rows = table[table["mode"] == UNDER_LOAD] if "mode" in table else table.iloc[:0]
    if rows.empty:
        raise ValueError(f"the record has no {UNDER_LOAD!r} probe")
    med = rows.astype({"load": int}).groupby(["layout", "producers", "stores", "load"],
                                             sort=False)[["store_rate_GBps",
                                                          "load_rate_GBps"]].median()
    out = []
    for (layout, k), grp in med.groupby(level=["layout", "producers"], sort=False):
        grp = grp.droplevel(["layout", "producers"])

        def at(stores, load, col):
            return float(grp.at[(stores, load), col]) if (stores, load) in grp.index else np.nan
        alone, loaded = at("host", 0, "store_rate_GBps"), at("host", 1, "store_rate_GBps")
        beside_local, beside_host = at("local", 1, "load_rate_GBps"), at("host", 1,
                                                                          "load_rate_GBps")
        out.append({"layout": layout, "producers": int(k), "drain_alone_GBps": alone,
                    "drain_under_load_GBps": loaded, "drain_under_load_ratio": loaded / alone,
                    "load_alone_GBps": at("none", 1, "load_rate_GBps"),
                    "load_beside_local_stores_GBps": beside_local,
                    "load_beside_host_stores_GBps": beside_host,
                    "load_slowdown": beside_local / beside_host})
    return pd.DataFrame(out)


def under_load_terms(fits: pd.DataFrame) -> dict:
    """The calibration's numbers from ``under_load_fits``: ``drain_under_load_ratio`` (the
    host-link MoE forecast scales R by it) and ``load_slowdown_full`` (a streaming load's slowdown
    at a full X-Stage), from the shared layout, where every SM stores and loads as the fused
    kernel's do, else from the split layout with the most producers."""
    shared = fits[fits["layout"] == "shared"]
    row = (shared if len(shared) else fits.sort_values("producers")).iloc[-1]
    return {"drain_under_load_ratio": float(row["drain_under_load_ratio"]),
            "load_slowdown_full": float(row["load_slowdown"])}


def under_gemm_fits(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (GEMM, K) of a record's ``under_gemm`` probe, medians over its launches: the
    GEMM's TF/s alone on every SM, beside K SMs storing locally and beside K SMs storing into
    host memory (the X-Stage full), the SMs it had beside them, and ``gemm_slowdown``, beside
    local over beside host stores: what a backpressured host link costs a GEMM on the SMs left,
    against stores that take the same SMs and instructions to local memory."""
    rows = table[table["mode"] == UNDER_GEMM] if "mode" in table else table.iloc[:0]
    if rows.empty:
        raise ValueError(f"the record has no {UNDER_GEMM!r} probe")
    med = rows.groupby(["gemm", "producers", "stores"], sort=False)[["gemm_tflops",
                                                                     "gemm_sms"]].median()
    out = []
    for gemm, grp in med.groupby(level="gemm", sort=False):
        grp = grp.droplevel("gemm")
        alone = float(grp.at[(0, "none"), "gemm_tflops"]) if (0, "none") in grp.index else np.nan
        for k in sorted(set(grp.index.get_level_values("producers")) - {0}):
            def at(stores, col):
                return float(grp.at[(k, stores), col]) if (k, stores) in grp.index else np.nan
            local, host = at("local", "gemm_tflops"), at("host", "gemm_tflops")
            out.append({"gemm": gemm, "producers": int(k), "gemm_sms": at("host", "gemm_sms"),
                        "gemm_alone_tflops": alone, "gemm_beside_local_stores_tflops": local,
                        "gemm_beside_host_stores_tflops": host, "gemm_slowdown": local / host})
    return pd.DataFrame(out)


def under_gemm_terms(fits: pd.DataFrame) -> dict:
    """The calibration's number from ``under_gemm_fits``: ``gemm_slowdown_full``, the median over
    the GEMMs of their slowdown at the largest K (the X-Stage full from the most SMs, the nearest
    to the fused kernel's, whose every SM stores); the MoE forecast does not play it
    (``moe.host_forecast`` says why)."""
    largest = fits[fits["producers"] == fits["producers"].max()]
    return {"gemm_slowdown_full": float(largest["gemm_slowdown"].median())}


@dataclass(frozen=True)
class CompletionFit:
    """The completion-coupled issuer, measured (issue 8): every producer waits, after its burst,
    until the burst is visible at the destination. T_complete(K, V) = V/R + T_lat with the
    calibrated R (no refit); T_lat is eq. 17's fixed completion-latency component. The fenced
    periods are then predicted by the sum law G + T_complete and, for contrast, by the max law
    that the X-Stage model gives the decoupled issuer."""

    producers: int
    t_complete_us: dict        # "K=..,B=.." -> median fenced issue-to-visibility time
    completion_latency_us: float           # T_lat: median of T_complete − V/R over B
    completion_rate_GBps: float            # free fit of T_complete = V/R_c + c, a check of R
    sum_law_err_pct: float     # median |error| of G + T_complete against the fenced periods
    max_law_err_pct: float     # same for max(T_iss^0 + G, V/R)
    periods: list              # rows {B, G, period_coupled_us, period_decoupled_us}


def fit_completion(fenced: pd.DataFrame, decoupled: pd.DataFrame, drain_rate: float,
                   t_iss0: dict, loop_gap_us: float) -> CompletionFit:
    """Fit T_complete(K, V) and test the sum and max laws on the fenced sweep's point medians;
    ``decoupled`` (the remote gap sweep) gives the periods of the same (B, G) without the fence."""
    k = int(fenced["producers"].iloc[0])
    per_b = fenced.groupby("burst_bytes")["t_iss_us"].median()
    volume = per_b.index.to_numpy(float) * k
    t_complete = per_b.to_numpy(float)
    latency = float(np.median(t_complete - model.drain_time(volume, drain_rate)))
    slope, _ = np.polyfit(volume, t_complete, 1)
    g = fenced["gap_us"] + loop_gap_us
    v = fenced["burst_volume"]
    sum_law = g + model.drain_time(v, drain_rate) + latency
    t0 = np.array([t_iss0.get(kb_key(k, b), np.nan) for b in fenced["burst_bytes"]])
    max_law = model.period(g, v, t0, drain_rate)
    measured = fenced["period_us"]
    return CompletionFit(
        producers=k,
        t_complete_us={kb_key(k, b): float(t) for b, t in per_b.items()},
        completion_latency_us=latency, completion_rate_GBps=float(1 / slope / 1e3),
        sum_law_err_pct=float(np.median(np.abs(sum_law / measured - 1)) * 100),
        max_law_err_pct=float(np.nanmedian(np.abs(max_law / measured - 1)) * 100),
        periods=[{"B": int(r.burst_bytes), "G": float(r.gap_us),
                  "period_coupled_us": float(r.period_us),
                  "period_decoupled_us": float(r.period_us_decoupled)}
                 for r in fenced.merge(decoupled[["burst_bytes", "gap_us", "period_us"]],
                                       on=["burst_bytes", "gap_us"],
                                       suffixes=("", "_decoupled")).itertuples()])


def calibration_from_dict(d: dict) -> Calibration:
    return Calibration(**d)


def calibration_to_dict(cal: Calibration) -> dict:
    return asdict(cal)
