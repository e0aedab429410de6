"""The patterns and operations summary entries (``patterns.summary_entry``,
``ops.summary_entry``) as tables, and the verdict on each row: does the Burst–Gap model
calibrated once on the baseline still describe it (issue 6)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...calibration import kb_text


def fit_row(fit: dict | None) -> dict:
    """One fit of a patterns/operations summary entry (FIT in docs/summary_json.md) as table
    columns."""
    if not fit:
        return {"fit": "not measured"}
    if "fit_error" in fit:
        return {"fit": f"model fit failed: {fit['fit_error']}"}
    nr = fit.get("no_refit_from_baseline") or {}

    def by_burst(values: dict, name: str) -> dict:  # keys "K=..,B=.." (one K per fit)
        return {f"{name} B={kb_text(k.split('B=')[1])} (µs)": v for k, v in values.items()}

    return {"R (GB/s)": fit["R_GBps"], "R IQR": fit["R_GBps_iqr"],
            **by_burst(fit["T_iss0_us"], "T_iss0"),
            "Q (MiB)": next(iter(fit["Q_MiB"].values()), None),
            "knee (KB/producer)": next(iter(fit["knee_KB_per_producer"].values()), None),
            **by_burst(fit["G_star_us"], "G*"),
            "gap err, own fit (%)": fit["gap_prediction_median_abs_err_pct"],
            "drain share": nr.get("share"), "R predicted (GB/s)": nr.get("drain_rate_GBps"),
            "gap err, no refit (%)": nr.get("t_iss_err_pct"),
            "period err, no refit (%)": nr.get("period_err_pct"), "fit": "ok"}


def patterns_table(entry: dict) -> pd.DataFrame:
    """Injection patterns (issue 6): per pattern instance and source GPU, the fitted
    (T_iss⁰, R, Q), the gap sweep's error from its own fit and with no refit from its
    one-to-one route's M_X times its drain share (``summary``'s ``patterns`` entry)."""
    rows = []
    for inst in entry["per_instance"]:
        head = {"pattern": inst["pattern"], "instance": inst["instance"],
                "routes": inst["routes"], "same as": inst["degenerate_of"] or ""}
        for fit in inst["sources"] or [None]:
            rows.append({**head, "src": fit["src"] if fit else None, **fit_row(fit)})
    return pd.DataFrame(rows)


def operations_table(entry: dict, left_out: bool = True) -> pd.DataFrame:
    """Remote operations (issue 6): per operation the fitted (T_iss⁰, R, Q), knee and G*, and
    the gap sweep's error from its own fit and with no refit from the 16-byte stores' M_X;
    with ``left_out``, also the operations left out, with the reason (``summary``'s
    ``operations`` entry; ``operations_left_out`` lists them alone)."""
    rows = [{"operation": op, **fit_row(fit)} for op, fit in entry["per_op"].items()]
    if left_out:
        rows += [{"operation": r["operation"], "fit": f"not measured: {r['reason']}"}
                 for r in operations_left_out(entry).to_dict("records")]
    return pd.DataFrame(rows)


def operations_left_out(entry: dict) -> pd.DataFrame:
    """The operations a ``remote_ops`` record left out (failed check, fault, time budget),
    each with the record's reason."""
    return pd.DataFrame([{"operation": label.split("=", 1)[1], "reason": why}
                         for label, why in entry["excluded"].items()],
                        columns=["operation", "reason"])


def no_refit_verdict(table: pd.DataFrame, keys: list[str], max_err_pct: float) -> pd.DataFrame:
    """Whether the Burst–Gap model, calibrated once on the baseline (16-byte stores, or a
    pattern's one-to-one route), still describes each row of ``patterns_table`` or
    ``operations_table``: the gap sweep's median |T_iss error| from the row's own fit and with
    no refit, and the fitted R's departure from the predicted one, each against ``max_err_pct``."""
    needed = ["R (GB/s)", "R predicted (GB/s)", "gap err, own fit (%)", "gap err, no refit (%)"]
    table = table.reindex(columns=list(dict.fromkeys([*table.columns, *needed])))  # no row fitted
    ok = table["fit"] == "ok"
    out = table[keys].copy()
    ratio = table["R (GB/s)"] / table["R predicted (GB/s)"]
    out["R / R predicted"] = ratio.round(3)
    # the gap sweep's median can sit on its plateau; R alone decides the drain-bound regime
    out[f"R as predicted (≤ {max_err_pct:g}%)"] = np.where(
        ok, np.where((ratio - 1).abs() * 100 <= max_err_pct, "yes", "no"),
        table["fit"].str.split(":").str[0])
    for col, verdict in (("gap err, own fit (%)", "own fit holds"),
                         ("gap err, no refit (%)", "holds without refit")):
        out[col] = table[col]
        out[f"{verdict} (≤ {max_err_pct:g}%)"] = np.where(
            ok, np.where(table[col] <= max_err_pct, "yes", "no"), table["fit"].str.split(":").str[0])
    return out
