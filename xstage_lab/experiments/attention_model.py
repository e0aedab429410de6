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

from .. import model
from ..calibration import Calibration


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



def record_predictions(record) -> pd.DataFrame:
    """``residual_predictions`` for an ``fa_a2a`` record: its kernel configuration and SM count,
    its platform's latest calibration, and the measured same-code residual beside."""
    from .remote_store import latest_calibration

    cfg, sm_count = record.params["config"], record.provenance["gpus"][0]["sm_count"]
    out = residual_predictions(record.table, latest_calibration(record.platform), cfg["BLOCK_M"],
                               cfg["BLOCK_N"], sm_count * cfg["ctas_per_sm"])
    if "e_res_same_code_us" in record.table:
        out["e_res_same_code_us"] = record.table["e_res_same_code_us"].to_numpy()
    return out.merge(paired_residuals(record), on="M")


def paired_residuals(record) -> pd.DataFrame:
    """E_res from matched trials (§5.3): per trial, Fused minus FA-only (and minus the same-code
    FA-only) measured in the same rotation, then the median and IQR over trials. Clock drift
    between trials, which shifts every method of a trial alike, cancels in the difference."""
    rows = []
    for raw in record.params["raw"]:
        trials = {m: np.asarray(v) for m, v in raw["max_us"].items()}
        row = {"M": raw["M"]}
        for base in ("fa", "fa_same_code"):
            if base in trials:
                diff = trials["fused"] - trials[base]
                lo, med, hi = np.percentile(diff, [25, 50, 75])
                row |= {f"e_res_paired_{base}_us": med, f"e_res_paired_{base}_p25_us": lo,
                        f"e_res_paired_{base}_p75_us": hi,
                        f"e_res_paired_{base}_rel_pct": med / np.median(trials[base]) * 100}
        rows.append(row)
    return pd.DataFrame(rows)


def prediction_check(predictions: pd.DataFrame) -> pd.DataFrame:
    """Per M, which prediction the paired same-code residual supports: its median and IQR as a
    share of T_FA beside the X-Stage (eqs. 18–19) and completion-coupled (eq. 17) predictions;
    ``x_stage_in_iqr`` says whether the X-Stage prediction lies inside the measured IQR."""
    base = predictions["e_res_paired_fa_same_code_us"] / predictions["e_res_paired_fa_same_code_rel_pct"]
    lo = predictions["e_res_paired_fa_same_code_p25_us"] / base
    hi = predictions["e_res_paired_fa_same_code_p75_us"] / base
    measured = predictions["e_res_paired_fa_same_code_rel_pct"]
    x_stage = predictions["e_drain_us"] / predictions["fa_us"] * 100
    coupled = predictions["e_cc_us"] / predictions["fa_us"] * 100
    return pd.DataFrame({
        "M": predictions["M"], "measured_pct": measured, "measured_p25_pct": lo,
        "measured_p75_pct": hi, "x_stage_pct": x_stage, "completion_coupled_pct": coupled,
        "x_stage_in_iqr": (lo <= x_stage) & (x_stage <= hi),
        "nearer": np.where((measured - x_stage).abs() <= (measured - coupled).abs(),
                           "X-Stage", "completion-coupled")})
