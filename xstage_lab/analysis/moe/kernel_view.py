"""What the notebooks and ``summary`` read of ``moe_kernel`` records (``kernel_bench``'s), on the
CPU: a platform's newest record of each precision as one ``KernelView``, and the summary entry."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pandas as pd

from . import PRECISIONS, geometric_mean
from ...loading import record_paths as list_records, read as read_record

SUMMARY_KEYS = ("model", "precision", "routing", "tokens", "kernel_wave_us",
                "kernel_interleaved_us", "call_wave_us", "tflops", "cublas_dense_tflops",
                "grouped_mm_tflops", "unfused_us")


def _plain(value):
    return value.item() if hasattr(value, "item") else value


def kernel_summary(table: pd.DataFrame, call_overhead: dict) -> dict:
    """The ``moe_kernel`` entry of ``summary --json`` from a record's table (or the JSON's rows)
    and its ``call_overhead`` header: the per-cell rows; the geometric mean over cells, per
    precision, of the kernel's TF/s over cuBLAS's (None where a precision has no cell); and per
    precision the one-token kernel and call times, the worst over models."""
    rows = [{k: _plain(r[k]) for k in SUMMARY_KEYS} for r in table.to_dict("records")]
    ratio = table["tflops"].astype(float) / table["cublas_dense_tflops"].astype(float)
    geomean = {p: (round(geometric_mean(ratio[table["precision"] == p]), 4)
                   if (table["precision"] == p).any() else None) for p in PRECISIONS}
    one_token = pd.DataFrame(call_overhead["rows"])
    worst = {p: {"kernel_us": float(g["kernel_wave_us"].max()),
                 "call_us": float(g["call_wave_us"].max())}
             for p, g in one_token.groupby("precision")} if len(one_token) else {}
    return {"rows": rows, "geomean_ratio_to_cublas": geomean, "call_overhead_us": worst}


@dataclass(frozen=True)
class KernelView:
    """A platform's latest ``moe_kernel`` record of each precision, read as one (each precision's
    rows and one-token calls come from its own record: every ratio in them was measured within
    that record's run). ``record_id`` names the records; ``params`` holds the kernel and the
    one-token calls as a record's would."""

    platform: str
    records: tuple  # newest first

    @cached_property
    def source(self) -> dict:
        """Precision -> the newest record that has it."""
        chosen = {}
        for rec in self.records:
            for p in rec.table["precision"].unique():
                chosen.setdefault(p, rec)
        return chosen

    @property
    def record_id(self) -> str:
        return " + ".join(r.record_id for r in self.records)

    @property
    def git_commit(self) -> str:
        return " + ".join(r.git_commit for r in self.records)

    @property
    def table(self) -> pd.DataFrame:
        return pd.concat([rec.table[rec.table["precision"] == p]
                          for p, rec in self.source.items()], ignore_index=True)

    @property
    def params(self) -> dict:
        rows = [o for p, rec in self.source.items()
                for o in rec.params["call_overhead"]["rows"] if o["precision"] == p]
        return {"kernel": self.records[0].params.get("kernel"),
                "call_overhead": {**self.records[0].params["call_overhead"], "rows": rows}}


def latest_view(platform: str, root: Path) -> KernelView:
    """The ``KernelView`` of ``platform``'s ``moe_kernel`` records: the newest record of each
    precision (those no precision is taken from are left out)."""
    newest = KernelView(platform, tuple(read_record(p) for p in
                                        reversed(list_records("moe_kernel", platform, root))))
    used = {r.record_id for r in newest.source.values()}
    return KernelView(platform, tuple(r for r in newest.records if r.record_id in used))


def summary_entry(platform: str, root: Path) -> dict:
    """``kernel_summary`` of the platform's ``latest_view``."""
    view = latest_view(platform, root)
    return kernel_summary(view.table, view.params["call_overhead"])
