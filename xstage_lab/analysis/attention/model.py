"""The Burst–Gap model applied to FlashAttention–A2A (§4.3, eqs. 17–20): the predictions that
Fig. 11 draws beside the measured residual, from a calibration and the measured FA-only times,
with no refit.

Per output tile a producer issues B_t = b_m·d·s_out bytes; in the worst case all K persistent
programs align, V = K·B_t. The gap between a program's bursts is its next tile's Q-loop,
G_Qloop = T_FA / N_t with N_t = ⌈tiles / programs⌉ tile waves; σ = G_Qloop / ⌈M/b_n⌉ is the time
per KV tile, and the double-buffer cover G_QK (eq. 19) and the completion-coupled cover T_cover
(eq. 17) are one QK^T mainloop, half of a KV tile's two matrix products (σ/2).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ... import model
from ...calibration import Calibration


def residual_predictions(table: pd.DataFrame, cal: Calibration, block_m: int, block_n: int,
                         programs: int) -> pd.DataFrame:
    """Per measured M: N_t, G_Qloop, σ, the X-Stage drain residual E_drain = N_t·Δt′ (eqs. 18–19),
    the completion-coupled residual E_cc = N_t·Δt_cc (eq. 17, with T_lat measured by the fenced
    sweep of the calibration, or 0, a lower bound, where it has none), M*_ub (eq. 20), and the
    design test (eq. 10) for the aligned worst case."""
    completion_latency_us = cal.completion["completion_latency_us"] if cal.completion else 0.0
    rows = []
    for _, r in table.iterrows():
        M, d, h_local = int(r["M"]), int(r["head_dim"]), int(r["heads"]) // int(r["P"])
        tiles = M // block_m * h_local
        producers = min(programs, tiles)
        waves = int(np.ceil(tiles / programs))
        volume = producers * model.tile_burst_bytes(block_m, d)
        platform = cal.platform_model()
        t_iss0 = platform.t_iss0_at(producers, model.tile_burst_bytes(block_m, d))
        g_qloop = r["fa_us"] / waves
        sigma = g_qloop / np.ceil(M / block_n)
        cover = sigma / 2
        stall = model.issue_overhead(g_qloop, volume, t_iss0, cal.drain_rate_GBps)  # eq. 18
        g_star = float(model.recovery_gap(volume, t_iss0, cal.drain_rate_GBps))
        verdict = model.design_test(volume, g_qloop, t_iss0, cal.drain_rate_GBps,
                                    platform.capacity_at(producers))
        rows.append(dict(
            M=M, waves=waves, producers=producers, burst_volume=volume, t_iss0_us=t_iss0,
            g_qloop_us=g_qloop, kv_tile_us=sigma, g_star_us=g_star,
            e_drain_us=waves * float(model.critical_path_stall(stall, cover)),
            e_cc_us=waves * float(model.completion_coupled_stall(volume, cal.drain_rate_GBps, cover,
                                                                 completion_latency_us)),
            m_star_ub=model.convergence_bound(g_star, sigma, block_n),
            t_lat_us=completion_latency_us,
            # the design test (eq. 10) for the aligned worst case; where one burst exceeds Q,
            # eq. 7 bounds the stall of each aligned wave
            rate_bound=verdict.rate_bound, capacity_bound=verdict.capacity_bound,
            action=verdict.action,
            e_capacity_bound_us=waves * max(0.0, verdict.isolated_issue_us - t_iss0),
            fa_us=r["fa_us"], e_res_us=r["e_res_us"]))
    return pd.DataFrame(rows)



def _record_predictions(record, cal: Calibration) -> pd.DataFrame:
    """``residual_predictions`` of an ``fa_a2a`` record's FA-only times with its kernel
    configuration and SM count, on ``cal``."""
    cfg, sm_count = record.params["config"], record.provenance["gpus"][0]["sm_count"]
    return residual_predictions(record.table, cal, cfg["BLOCK_M"], cfg["BLOCK_N"],
                                sm_count * cfg["ctas_per_sm"])


def link_predictions(record, cal: Calibration) -> pd.DataFrame:
    """The model alone for an ``fa_a2a`` record's measured FA-only times on the M_X of ``cal``,
    any link's (the host link's, where no attention run stored its output): the predictions of
    ``residual_predictions`` with the M_X they used, R and Q(K) beside T_iss⁰, and no measured
    residual."""
    out = _record_predictions(record, cal).drop(columns="e_res_us")
    platform = cal.platform_model()
    out.insert(5, "drain_rate_GBps", cal.drain_rate_GBps)
    out.insert(6, "capacity_bytes", [platform.capacity_at(k) for k in out["producers"]])
    return out


# What ``link_comparison`` keeps of each link's ``link_predictions``.
LINK_COLUMNS = ("t_iss0_us", "drain_rate_GBps", "capacity_bytes", "g_star_us", "rate_bound",
                "capacity_bound", "action", "e_drain_us", "e_cc_us", "t_lat_us")


def link_comparison(record, cals: dict) -> pd.DataFrame:
    """Per M of an ``fa_a2a`` record: its FA-only time, Q-loop gap and aligned burst, and per
    link (``cals``: link -> calibration) the M_X, G*, design test and predicted residuals of
    ``link_predictions``, each column prefixed with its link."""
    tables = {link: link_predictions(record, cal) for link, cal in cals.items()}
    out = next(iter(tables.values()))[["M", "fa_us", "g_qloop_us", "producers", "burst_volume"]]
    for link, table in tables.items():
        out = out.join(table[list(LINK_COLUMNS)].add_prefix(f"{link}_"))
    return out


def host_link_comparisons(records, host_cals) -> dict[tuple[str, str], pd.DataFrame]:
    """``link_comparison`` of each ``fa_a2a`` record on its own platform's M_X (``nvlink``) and
    on each host-link calibration of ``host_cals`` (``host``), by (record's platform, host-link
    platform)."""
    from ..remote_store.characterization import latest_calibration

    return {(r.platform, h.platform): link_comparison(r, {"nvlink": latest_calibration(r.platform),
                                                          "host": h})
            for r in records for h in host_cals}


def record_predictions(record) -> pd.DataFrame:
    """``residual_predictions`` for an ``fa_a2a`` record: its kernel configuration and SM count,
    its platform's latest calibration, and the measured same-code residual beside."""
    from ..remote_store.characterization import latest_calibration

    out = _record_predictions(record, latest_calibration(record.platform))
    if "e_res_same_code_us" in record.table:
        out["e_res_same_code_us"] = record.table["e_res_same_code_us"].to_numpy()
    return out.merge(paired_residuals(record), on="M")


# Two clock readings within one H200 DVFS step (15 MHz) count as the same clock state.
CLOCK_MATCH_MHZ = 15.0


def paired_difference(minuend_us, subtrahend_us, minuend_mhz=None, subtrahend_mhz=None) -> dict:
    """Per-trial differences of two methods timed in the same rotations (§5.3's E_res from
    matched trials): their median, p25 and p75; where both SM clocks are known per trial, the
    median over the clock-matched trials alone (readings within ``CLOCK_MATCH_MHZ``) and their
    count (None and 0 without clocks). Drift between trials shifts both methods of a trial alike
    and cancels in the difference; matching also drops the trials whose clock moved between
    the two methods."""
    diff = np.asarray(minuend_us, float) - np.asarray(subtrahend_us, float)
    lo, med, hi = np.percentile(diff, [25, 50, 75])
    matched = np.zeros(len(diff), bool)
    if minuend_mhz is not None and subtrahend_mhz is not None:
        a = np.array([np.nan if c is None else c for c in minuend_mhz], float)
        b = np.array([np.nan if c is None else c for c in subtrahend_mhz], float)
        matched = np.abs(a - b) <= CLOCK_MATCH_MHZ  # False where a clock is unknown (NaN)
    return dict(median_us=float(med), p25_us=float(lo), p75_us=float(hi),
                matched_median_us=float(np.median(diff[matched])) if matched.any() else None,
                matched_trials=int(matched.sum()))


# (method, residual name, same-code controls): the decoupled epilogue (X-Stage, eqs. 18-19) and
# the fenced one (completion-coupled, eq. 17, issue 8), the latter also against its own build
# storing locally (records from 2026-11-30 on), since the builds' Q-loops are scheduled apart
RESIDUALS = (("fused", "e_res", ("fa", "fa_same_code")),
             ("fused_fenced", "e_res_fenced", ("fa", "fa_same_code", "fa_same_code_fenced")))


def paired_residuals(record) -> pd.DataFrame:
    """E_res from matched trials (§5.3): per trial, Fused (and Fused-fenced, where the record has
    it) minus FA-only and minus the same-code FA-only (for Fused-fenced also minus the fenced
    build storing locally, where the record has it), measured in the same rotation; the
    median, IQR and share of T_FA of the differences, and the clock-matched median where the
    record has per-trial clocks (``paired_difference``)."""
    rows = []
    for raw in record.params["raw"]:
        trials = raw["max_us"]
        clocks = raw.get("sm_clock_mhz", {})
        row = {"M": raw["M"]}
        for method, name, bases in RESIDUALS:
            for base in bases:
                if method not in trials or base not in trials:
                    continue
                r = paired_difference(trials[method], trials[base], clocks.get(method),
                                      clocks.get(base))
                tag = f"{name}_paired_{base}"
                row |= {f"{tag}_us": r["median_us"], f"{tag}_p25_us": r["p25_us"],
                        f"{tag}_p75_us": r["p75_us"], f"{tag}_matched_us": r["matched_median_us"],
                        f"{tag}_matched_trials": r["matched_trials"],
                        f"{tag}_rel_pct": r["median_us"] / np.median(trials[base]) * 100}
        rows.append(row)
    return pd.DataFrame(rows)


def prediction_check(predictions: pd.DataFrame) -> pd.DataFrame:
    """Per M, each prediction against the residual it predicts, from the paired trials against
    the same-code FA-only, all as shares of T_FA (%): the X-Stage prediction (eqs. 18-19)
    against the decoupled Fused residual and, where the record has the fenced epilogue, the
    completion-coupled prediction (eq. 17) against the fenced one, whose control is the fenced
    build storing locally where the record has it (``fenced_control``). ``*_err_pct`` is prediction
    minus measurement (points of T_FA); ``*_in_iqr`` whether the prediction lies inside the
    measured IQR (where it does not, the prediction fails at that M); ``nearer`` which
    prediction the decoupled residual is closer to."""
    out = pd.DataFrame({"M": predictions["M"]})
    x_stage = predictions["e_drain_us"] / predictions["fa_us"] * 100
    coupled = predictions["e_cc_us"] / predictions["fa_us"] * 100
    out["x_stage_pct"] = x_stage
    out["completion_coupled_pct"] = coupled
    for name, prediction, label in (("e_res", x_stage, "x_stage"),
                                    ("e_res_fenced", coupled, "completion_coupled")):
        tag = f"{name}_paired_fa_same_code"
        if name == "e_res_fenced" and f"{tag}_fenced_us" in predictions:
            tag = f"{tag}_fenced"
        if f"{tag}_us" not in predictions:
            continue
        if name == "e_res_fenced":
            out["fenced_control"] = tag.removeprefix("e_res_fenced_paired_")
        base = predictions[f"{tag}_us"] / predictions[f"{tag}_rel_pct"]
        measured = predictions[f"{tag}_rel_pct"]
        lo, hi = predictions[f"{tag}_p25_us"] / base, predictions[f"{tag}_p75_us"] / base
        prefix = "measured" if name == "e_res" else "fenced_measured"
        out[f"{prefix}_pct"], out[f"{prefix}_p25_pct"], out[f"{prefix}_p75_pct"] = measured, lo, hi
        out[f"{label}_err_pct"] = prediction - measured
        out[f"{label}_in_iqr"] = (lo <= prediction) & (prediction <= hi)
    if "measured_pct" in out:
        out["nearer"] = np.where((out["measured_pct"] - x_stage).abs()
                                 <= (out["measured_pct"] - coupled).abs(),
                                 "X-Stage", "completion-coupled")
    return out


def verdict_agreement(predictions: pd.DataFrame) -> pd.DataFrame:
    """``record_predictions`` with the design-test verdict (eq. 10, aligned worst case) held
    against the measured residual: ``excess_us`` is the paired residual against the same-code
    FA-only (median of per-trial differences), ``tolerance_us`` its median minus its p25, so a
    measured excess (``model.verdict_agrees``) is a p25 above zero: at least three quarters of
    the paired trials show Fused slower than FA-only; ``agrees`` "yes"/"no"."""
    tag = "e_res_paired_fa_same_code"
    out = predictions.copy()
    out["excess_us"] = out[f"{tag}_us"]
    out["tolerance_us"] = out[f"{tag}_us"] - out[f"{tag}_p25_us"]
    out["agrees"] = ["yes" if model.verdict_agrees(a, e, t) else "no"
                     for a, e, t in zip(out["action"], out["excess_us"], out["tolerance_us"])]
    return out


def prediction_failures(check: pd.DataFrame) -> list[str]:
    """One sentence per prediction and M where ``prediction_check`` finds the prediction outside
    the measured IQR, with its error against the measured median in points of T_FA."""
    out = []
    for label, name, measured in (("x_stage", "X-Stage (eqs. 18-19)", "decoupled Fused"),
                                  ("completion_coupled", "completion-coupled (eq. 17)",
                                   "fenced Fused")):
        if f"{label}_in_iqr" not in check:
            continue
        for _, r in check[~check[f"{label}_in_iqr"].astype(bool)].iterrows():
            out.append(f"M={int(r['M'])}: the {name} prediction {r[f'{label}_pct']:.2f}% lies "
                       f"outside the {measured} residual's IQR; prediction minus median "
                       f"{r[f'{label}_err_pct']:+.2f} points of T_FA")
    return out


def summary_counterfactual(platform: str, root) -> dict:
    """``summary --json``'s ``counterfactual.attention``: per M of the latest ``fa_a2a`` record
    that measured the fenced epilogue, the completion-coupled (fenced) and decoupled (X-Stage)
    Fused times beside FA-only and Serial, their residuals and hiding ratios (eq. 21) against
    FA-only and, where the record has them, their residuals against the same-code FA-only
    (medians of per-trial differences, ``paired_residuals``: FA-only is another build); {} where
    there is no such record."""
    from ...loading import latest as latest_record, platforms

    if platform not in platforms("fa_a2a", root):
        return {}
    rec = latest_record("fa_a2a", platform, root)
    t = rec.table
    if "fused_fenced_us" not in t:
        return {}
    return {"record": rec.record_id,
            "per_M": [{"M": int(r["M"]), "coupled_us": float(r["fused_fenced_us"]),
                       "decoupled_us": float(r["fused_us"]), "fa_us": float(r["fa_us"]),
                       "serial_us": float(r["serial_us"]),
                       "e_res_coupled_us": float(r["e_res_fenced_us"]),
                       "e_res_decoupled_us": float(r["e_res_us"]),
                       "hiding_ratio_coupled": float(r["hiding_ratio_fenced"]),
                       "hiding_ratio_decoupled": float(r["hiding_ratio"]),
                       **{key: float(r[col]) for key, col in SAME_CODE_KEYS.items() if col in r}}
                      for _, r in t.iterrows()]}


# counterfactual.attention's same-code keys -> the fa_a2a record's columns
SAME_CODE_KEYS = {"fa_same_code_us": "fa_same_code_us",
                  "fa_same_code_fenced_us": "fa_same_code_fenced_us",
                  "e_res_coupled_paired_same_code_us": "e_res_fenced_paired_fa_same_code_us",
                  "e_res_coupled_paired_fenced_same_code_us":
                      "e_res_fenced_paired_fa_same_code_fenced_us",
                  "e_res_decoupled_paired_same_code_us": "e_res_paired_fa_same_code_us"}


# Issue 3's target for the Triton FA-only kernel: at least 0.8 of cuDNN's TF/s from M = 16384 on.
FA_OVER_CUDNN_BAR = 0.8
FA_OVER_CUDNN_FROM_M = 16384


def _meets_bar(M, ratio):
    """True/False against ``FA_OVER_CUDNN_BAR`` where M is in the target's range, else None."""
    return [bool(r >= FA_OVER_CUDNN_BAR) if m >= FA_OVER_CUDNN_FROM_M else None
            for m, r in zip(M, ratio)]


def headline(record) -> pd.DataFrame:
    """Per M of an ``fa_a2a`` record: the speedup over Serial and the hiding ratio (eq. 21,
    1 − E_res/(T_Serial − T_FA), against FA-only) of the decoupled and the fenced Fused, the
    remote-store All-to-All over NCCL's, and FA-only's TF/s over cuDNN's with the issue-3 bar
    (``meets_bar`` None below ``FA_OVER_CUDNN_FROM_M``). A hiding ratio above 1 means Fused beat
    FA-only itself, not that more than the A2A was hidden."""
    t = record.table
    out = pd.DataFrame({"M": t["M"].astype(int), "speedup": t["speedup"],
                        "hiding_ratio": t["hiding_ratio"]})
    if "fused_fenced_us" in t:
        out["speedup_fenced"] = t["speedup_fenced"]
        out["hiding_ratio_fenced"] = t["hiding_ratio_fenced"]
    out["a2a_remote_over_nccl"] = t["a2a_remote_us"] / t["a2a_nccl_us"]
    out["fa_tflops"], out["cudnn_tflops"] = t["fa_tflops"], t["cudnn_tflops"]
    out["fa_over_cudnn"] = t["fa_tflops"] / t["cudnn_tflops"]
    out["meets_bar"] = _meets_bar(out["M"], out["fa_over_cudnn"])
    return out


def fenced_vs_decoupled(record) -> pd.DataFrame:
    """Per M, the fenced Fused minus the decoupled Fused from the paired trials of one rotation
    (``paired_difference``: median, IQR, clock-matched median and count), how many trials the
    fenced one was faster in, the same pairing of FA-only (the LOCAL build) minus the same-code
    control (the REMOTE build with local destinations), which differ only by their build, and
    the median SM clock read at each method's launch (one NVML reading per trial, the lowest
    over ranks) for the four FA-based methods."""
    rows = []
    for raw in record.params["raw"]:
        trials, clocks = raw["max_us"], raw.get("sm_clock_mhz", {})
        if "fused_fenced" not in trials:
            continue
        r = paired_difference(trials["fused_fenced"], trials["fused"],
                              clocks.get("fused_fenced"), clocks.get("fused"))
        faster = np.asarray(trials["fused_fenced"]) < np.asarray(trials["fused"])
        rows.append({"M": raw["M"], "fenced_minus_fused_us": r["median_us"],
                     "p25_us": r["p25_us"], "p75_us": r["p75_us"],
                     "rel_pct": r["median_us"] / np.median(trials["fused"]) * 100,
                     "matched_us": r["matched_median_us"], "matched_trials": r["matched_trials"],
                     "fenced_faster_trials": f"{int(faster.sum())}/{len(faster)}",
                     **_paired_columns(trials, "fa", "fa_same_code", "fa_minus_same_code"),
                     **_paired_columns(trials, "fa_same_code_fenced", "fa_same_code",
                                       "fenced_build_minus_same_code"),
                     **_paired_columns(trials, "fused_fenced", "fa_same_code_fenced",
                                       "fenced_minus_fenced_same_code"),
                     **{f"{m}_clock_mhz": float(np.nanmedian(np.array(clocks[m], float)))
                        for m in ("fa", "fa_same_code", "fa_same_code_fenced", "fused",
                                  "fused_fenced") if m in clocks}})
    return pd.DataFrame(rows)


def _paired_columns(trials: dict, method: str, base: str, name: str) -> dict:
    """``method`` minus ``base`` from paired trials as ``{name}_us`` and its IQR; nothing when the
    record lacks either (the fenced same-code control exists from 2026-11-30 on)."""
    if method not in trials or base not in trials:
        return {}
    r = paired_difference(trials[method], trials[base])
    return {f"{name}_us": r["median_us"], f"{name}_p25_us": r["p25_us"],
            f"{name}_p75_us": r["p75_us"]}


def epilogue_builds(records) -> pd.DataFrame:
    """The ``--fa-only --epilogues`` runs of ``records`` (``tuning_records``): per record, M and
    configuration, the LOCAL build (FA-only) and the Fused kernel's REMOTE builds, unfenced and
    fenced, all storing on one GPU with no peer traffic, as the median time and each REMOTE build
    minus LOCAL from paired trials (µs and % of LOCAL): the build's share of any difference."""
    rows = []
    for rec in records:
        if not rec.params["params"].get("epilogues"):
            continue
        for raw in rec.params["raw"]:
            trials = raw["trials_us"]
            for local in (m for m in trials if m != "cudnn" and "+" not in m):
                row = {"record": rec.record_id, "M": raw["M"], "config": local,
                       "local_us": float(np.median(trials[local]))}
                for build in ("remote", "remote_fenced"):
                    row[f"{build}_us"] = float(np.median(trials[f"{local}+{build}"]))
                    row |= _paired_columns(trials, f"{local}+{build}", local,
                                           f"{build}_minus_local")
                    row[f"{build}_minus_local_pct"] = (row[f"{build}_minus_local_us"]
                                                       / row["local_us"] * 100)
                rows.append(row)
    return pd.DataFrame(rows)


def tuning_records(platform: str = "h200-x1", root=None) -> list:
    """Every ``fa_tuning`` record of ``platform`` (single-GPU FA-only candidates against cuDNN,
    ``attention.bench --fa-only``), oldest run first (by their creation time: one import can
    stamp several records with the same file time)."""
    from ...records import RECORDS_DIR
    from ...loading import record_paths as list_records, read as read_record

    recs = [read_record(p) for p in list_records("fa_tuning", platform, root or RECORDS_DIR)]
    return sorted(recs, key=lambda r: r.params["created_utc"])


def tuning_table(records) -> pd.DataFrame:
    """The tuning runs side by side: per record, head dim, M and configuration, the median time
    and IQR, TF/s, TF/s over cuDNN from paired trials, and the issue-3 bar (``meets_bar``)."""
    frames = []
    for rec in records:
        p = rec.params["params"]
        first = {"record": rec.record_id, **{k: p[k] for k in ("heads", "head_dim", "trials")}}
        # records since the harness (issue 21) carry the point's heads and head dim, and its
        # sweep tags, in their rows
        t = rec.table.drop(columns=["sm_clock_mhz", *first, "point", "repeat", "order"],
                           errors="ignore")
        for i, (key, value) in enumerate(first.items()):
            t.insert(i, key, value)
        t["meets_bar"] = [None if m == "cudnn" else b for m, b in
                          zip(t["method"], _meets_bar(t["M"], t["over_cudnn_paired"]))]
        frames.append(t)
    return pd.concat(frames, ignore_index=True)


def tuning_best(table: pd.DataFrame) -> pd.DataFrame:
    """Per record, head dim and M of ``tuning_table``: the fastest configuration (either kernel),
    its TF/s over cuDNN (paired) and whether it meets the bar, in the runs' order."""
    # FA-only is the LOCAL epilogue; ``+remote`` rows time the Fused kernel's code (codegen)
    ours = table[(table["method"] != "cudnn") & ~table["method"].str.contains("+", regex=False)]
    best = ours.loc[ours.groupby(["record", "M"], sort=False)["over_cudnn_paired"].idxmax()]
    return best[["record", "head_dim", "M", "method", "tflops", "over_cudnn_paired", "meets_bar"]]


def bar_failures(table: pd.DataFrame, ratio: str = "fa_over_cudnn") -> list[str]:
    """One sentence per row of ``headline`` or ``tuning_table`` whose FA-only TF/s over cuDNN's
    (column ``ratio``) misses the issue-3 bar where the bar applies."""
    label = table["method"] if "method" in table else pd.Series("FA-only", index=table.index)
    return [f"M={int(r['M'])}{f', d={int(r.head_dim)}' if 'head_dim' in table else ''}, "
            f"{label[i]}: {r[ratio]:.3f} of cuDNN's TF/s, below the {FA_OVER_CUDNN_BAR} bar"
            for i, r in table.iterrows() if r["meets_bar"] is False]
