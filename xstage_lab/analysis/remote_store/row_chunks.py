"""The host link's M_X per Combine row pattern (issue 26): the ``row_chunks`` sweep of a
``remote_store`` record (or of a ``remote_store_partial`` one, run with ``--only row_chunks``)
fitted pattern by pattern, and the platform model the host-link MoE forecast plays a model
shape's Combine with.

A pattern is the fused MoE's Linear-2 epilogue as it stores: one ``chunk_bytes`` piece of each
``row_bytes`` Combine row (``block_n2`` bf16 columns of a ``hidden``-column row), the producers
of one row group side by side; ``chunk_bytes = row_bytes = 0`` is the contiguous burst the
calibration's R and Q come from, measured in the same run as the reference. Per pattern, at K =
all SMs: R from the zero-gap periodic points (eq. 1, ``calibration.fit_drain_rate``), then the
isolated issue floor and Q from the isolated points with that R (eq. 7,
``calibration.fit_isolated``)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ... import model
from ...calibration import fit_drain_rate, fit_isolated, launch_means
from ...loading import read, record_paths
from ...records import RECORDS_DIR, Record

SWEEP = "row_chunks"
PATTERN = ["chunk_bytes", "row_bytes"]
RECORDS = ("remote_store", "remote_store_partial")


def row_chunk_fits(table: pd.DataFrame) -> pd.DataFrame:
    """One row per pattern of a record's ``row_chunks`` sweep: ``producers``,
    ``drain_rate_GBps`` (R), ``window_rate_GBps`` (the zero-gap points' median aggregate rate, a
    cross-check of R), the isolated floor (``fixed_us``, ``issue_rate_GBps``), ``capacity_bytes``
    (Q; NaN where no isolated burst reached the drain-limited branch), ``knee_volume_bytes`` and
    ``largest_volume_bytes`` (the largest isolated burst: a bound on Q where none was fitted)."""
    rows = table[table["sweep"] == SWEEP]
    if rows.empty:
        raise ValueError(f"the record has no {SWEEP!r} sweep")
    pattern_of = rows.groupby("point")[PATTERN].first()
    launches = launch_means(rows).join(pattern_of, on="point")
    points = launches.groupby(["point", *PATTERN, "mode", "producers", "burst_volume"],
                              as_index=False)[["t_iss_us", "period_us",
                                               "window_rate_GBps"]].median()
    out = []
    for (chunk, row), grp in points.groupby(PATTERN, sort=False):
        periodic, isolated = grp[grp["mode"] == "periodic"], grp[grp["mode"] == "isolated"]
        k = int(grp["producers"].iloc[0])
        rate, _ = fit_drain_rate(periodic["burst_volume"], periodic["period_us"])
        fit = fit_isolated(k, isolated["burst_volume"], isolated["t_iss_us"], rate)
        out.append({"chunk_bytes": int(chunk), "row_bytes": int(row), "producers": k,
                    "drain_rate_GBps": rate,
                    "window_rate_GBps": float(periodic["window_rate_GBps"].median()),
                    "fixed_us": fit.fixed_us, "issue_rate_GBps": fit.issue_rate_GBps,
                    "capacity_bytes": fit.capacity_bytes, "knee_volume_bytes":
                    fit.knee_volume_bytes,
                    "largest_volume_bytes": float(isolated["burst_volume"].max())})
    return pd.DataFrame(out).astype({"capacity_bytes": float, "knee_volume_bytes": float})


def latest_with_sweep(platform: str, sweep: str, root: Path = RECORDS_DIR) -> Record | None:
    """``platform``'s newest ``remote_store`` or ``remote_store_partial`` record that holds the
    sweep ``sweep``; None where none does."""
    paths = sorted((p for name in RECORDS for p in record_paths(name, platform, root)),
                   key=lambda p: p.stem)
    for path in reversed(paths):
        rec = read(path)
        if "sweep" in rec.table and (rec.table["sweep"] == sweep).any():
            return rec
    return None


def latest_row_chunk_record(platform: str, root: Path = RECORDS_DIR) -> Record | None:
    """``platform``'s newest record that holds a ``row_chunks`` sweep (``latest_with_sweep``)."""
    return latest_with_sweep(platform, SWEEP, root)


def pattern_model(fit: dict) -> model.PlatformModel:
    """The platform model of one pattern's fit (a row of ``row_chunk_fits``): its R, and at its K
    its Q (where no knee was in range, the largest isolated burst, which the X-Stage held) and
    issue floor (T_iss^0 from the floor at every burst volume)."""
    k = int(fit["producers"])
    capacity = fit["capacity_bytes"]
    return model.PlatformModel(
        drain_rate=float(fit["drain_rate_GBps"]), t_iss0={},
        capacity={k: float(fit["largest_volume_bytes"] if pd.isna(capacity) else capacity)},
        issue_floor={k: model.IssueFloor(k, float(fit["fixed_us"]),
                                         float(fit["issue_rate_GBps"]))})


def combine_models(platform: str, root: Path = RECORDS_DIR) -> tuple[dict, str | None]:
    """``{(chunk_bytes, row_bytes): PlatformModel}`` of every Combine row pattern of
    ``platform``'s latest ``row_chunks`` sweep (``pattern_model``), and that record's name
    (``experiment/platform/id``); ``({}, None)`` where the platform has none."""
    rec = latest_row_chunk_record(platform, root)
    if rec is None:
        return {}, None
    fits = row_chunk_fits(rec.table)
    models = {(int(f["chunk_bytes"]), int(f["row_bytes"])): pattern_model(f)
              for f in fits.to_dict("records") if f["chunk_bytes"]}
    return models, f"{rec.meta['experiment']}/{platform}/{rec.record_id}"


def combine_pattern(block_n2: int, hidden: int) -> tuple[int, int]:
    """A model shape's Combine row pattern: ``block_n2`` bf16 columns of a ``hidden``-column
    row."""
    return 2 * int(block_n2), 2 * int(hidden)
