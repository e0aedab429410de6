"""Two versions of the code measured in one job, cell by cell: versions are compared only by
ratios measured in one run. The change's record is held against the base's records of the same
job, taken before and after it (order base, change, base): a drift of the machine over the job
(its clocks, its heat, the order of the processes) then shows as the base runs disagreeing, not
as an effect of the change. ``python -m xstage_lab compare`` prints it."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from ...records import Record
from . import VARIANT, geometric_mean
from .host_view import CELL as HOST_CELL
from .layer_view import CELL as LAYER_CELL, profile_total_us

# What a change did to a cell's time, against the base runs of its job.
FASTER, SLOWER, WITHIN, UNBRACKETED = "faster", "slower", "within", "unbracketed"
VERDICTS = (FASTER, SLOWER, WITHIN, UNBRACKETED)
# The cell columns of the experiments measured in cells (each view's ``CELL``).
CELLS = {"moe_layer": LAYER_CELL, "moe_host": HOST_CELL}


def record_version(record: Record) -> str:
    """The version of the code that produced ``record``: its commit, and its params' ``VARIANT``
    options where it has any (``abc123 weighted_sum=kernel``)."""
    options = record.params.get(VARIANT) or {}
    return " ".join([record.git_commit, *(f"{k}={options[k]}" for k in sorted(options))])


def version_ratios(base: Sequence[pd.DataFrame], change: pd.DataFrame, cell: Sequence[str],
                   columns: Sequence[str]) -> pd.DataFrame:
    """Per cell that the change and every base run measured (``cell`` columns), per column ``c``
    of ``columns`` (a time: lower is better): the change's value over each base run's
    (``c_over_base0``, ``c_over_base1``, ...: in the job's order of the base runs), over their
    geometric mean (``c_ratio``), and ``c_verdict``: ``FASTER`` where the change is below every
    base run, ``SLOWER`` where above every one, ``WITHIN`` where the base runs bracket it;
    ``UNBRACKETED`` with a single base run (a ratio without the job's own spread); missing where
    a run left the time unmeasured (NaN). A per-kernel profile (a JSON column:
    ``route_kernels_us``) is compared by its kernels' total (``profile_total_us``). A cell
    measured by only some of the runs is left out. Raises ValueError on a table that lacks a
    column, holds neither times nor profiles in one, or measures a cell twice."""
    if not base:
        raise ValueError("no base run: a change is held against the base measured in its job")
    cell, columns = list(cell), list(columns)
    for name, t in (("change", change), *((f"base run {i}", b) for i, b in enumerate(base))):
        missing = [c for c in (*cell, *columns) if c not in t]
        if missing:
            raise ValueError(f"the {name} has no column {missing}")
        if t.duplicated(cell).any():
            raise ValueError(f"the {name} measures a cell of {cell} twice")
    out = _times(change, cell, columns, "change")
    for i, b in enumerate(base):
        out = out.merge(_times(b, cell, columns, f"base run {i}")
                        .rename(columns={c: f"{c}_base{i}" for c in columns}), on=cell)
    for c in columns:
        runs = out[[f"{c}_base{i}" for i in range(len(base))]].to_numpy(float)
        new = out[c].to_numpy(float)
        for i in range(len(base)):
            out[f"{c}_over_base{i}"] = new / runs[:, i]
        out[f"{c}_ratio"] = new / np.exp(np.log(runs).mean(axis=1))
        verdict = (np.where(new < runs.min(axis=1), FASTER,
                            np.where(new > runs.max(axis=1), SLOWER, WITHIN))
                   if len(base) > 1 else np.full(len(new), UNBRACKETED))
        # a time some run did not measure (NaN) gets no verdict
        out[f"{c}_verdict"] = np.where(np.isnan(out[f"{c}_ratio"]), None, verdict)
    return out.drop(columns=[f"{c}_base{i}" for c in columns for i in range(len(base))]) \
        .sort_values(cell, kind="stable").reset_index(drop=True)


def _times(table: pd.DataFrame, cell: list[str], columns: list[str], name: str) -> pd.DataFrame:
    """The ``cell`` and ``columns`` of ``table`` (the ``name``d run's), each column as times:
    a profile's as its kernels' total."""
    out = table[cell + columns].copy()
    for c in columns:
        if not pd.api.types.is_numeric_dtype(out[c]):
            try:
                out[c] = profile_total_us(out[c])
            except (ValueError, AttributeError, TypeError):  # not JSON, or not {kernel: us}
                raise ValueError(f"the {name}'s column {c} holds neither times nor per-kernel "
                                 f"profiles") from None
    return out


def version_summary(ratios: pd.DataFrame, by: Sequence[str],
                    columns: Sequence[str]) -> pd.DataFrame:
    """``version_ratios``' cells per group of ``by`` (every cell in one group where ``by`` is
    empty): the cells, and per column ``c`` the geometric mean of ``c_ratio`` over the cells
    that measured it and the cells of each verdict it holds (``c_faster``, ``c_slower``, ...)."""
    groups = ratios.groupby(list(by), sort=True) if by else [((), ratios)]
    rows = []
    for key, g in groups:
        row = dict(zip(by, key if isinstance(key, tuple) else (key,)), cells=len(g))
        for c in columns:
            measured = g[f"{c}_ratio"].dropna()
            row[f"{c}_ratio"] = geometric_mean(measured) if len(measured) else np.nan
            row.update({f"{c}_{v}": int((g[f"{c}_verdict"] == v).sum()) for v in VERDICTS})
        rows.append(row)
    out = pd.DataFrame(rows)
    # a verdict no cell got says nothing (unbracketed, where the base ran twice)
    return out.drop(columns=[f"{c}_{v}" for c in columns for v in VERDICTS
                             if not out[f"{c}_{v}"].any()])
