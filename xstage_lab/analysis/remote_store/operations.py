"""What is read of the beyond-16-byte-store records on the CPU (issue 6): a configuration's fitted
M_X with its no-refit error from the baseline's (``fit_config``, ``fit_entry``), every operation's
fit of a ``remote_ops`` table (``operation_fits``) and the summary's ``operations`` entry."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ... import model
from ...calibration import Calibration, calibrate, fit_drain_rate, kb_key, launch_means


BASELINE_OP = "store16"


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


def aligned_drain_rate(rows: pd.DataFrame) -> float:
    """R of a drain_rate sweep's rows (eq. 1, ``fit_drain_rate``), slowest source."""
    launches = launch_means(rows)
    aligned = launches[launches["align"] == "each"]
    return min(fit_drain_rate(g["burst_volume"], g["period_us"])[0]
               for _, g in aligned.groupby("src"))


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
