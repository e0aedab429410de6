"""What is read of a remote-store characterization (paper §3, Fig. 3) on the CPU: the fitted M_X
of a ``remote_store`` record (``calibrate_record``, saved as a ``calibration`` record by
``write_calibration``), the view notebooks and the summary load (``Characterization``), and the
latest calibration of a platform (``latest_calibration``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ...calibration import (Calibration, calibrate, calibration_from_dict, calibration_to_dict,
                            launch_means, point_table)
from ...platform import git_commit
from ...records import RECORDS_DIR, Record, write_record
from ...loading import latest as latest_record, read as read_record


def calibrate_record(rec: Record) -> tuple[Calibration, pd.DataFrame]:
    """``calibrate`` on a ``remote_store`` record, with the link and copy-engine rate of its
    header."""
    copy_engine = rec.params.get("copy_engine_d2h")
    return calibrate(rec.table, rec.platform, rec.record_id, link=rec.params.get("link", "nvlink"),
                     copy_engine_GBps=copy_engine["rate_GBps"] if copy_engine else None)


def write_calibration(record_path: Path | str, root: Path = RECORDS_DIR) -> Path:
    """Fit M_X from a ``remote_store`` record and save it as a ``calibration`` record (one row per
    fitted quantity; the full fit in its parameters), for the later experiments to load."""
    rec = read_record(record_path)
    cal, _ = calibrate_record(rec)
    table = pd.DataFrame([{"quantity": k, "value": json.dumps(v)} for k, v in cal.summary().items()])
    params = {"source_record": rec.record_id, "calibrated_with_commit": git_commit(),
              "calibration": calibration_to_dict(cal)}
    return write_record("calibration", rec.platform, table, params, rec.provenance, root)


@dataclass(frozen=True)
class Characterization:
    """One platform's characterization: its record, the fitted M_X, the gap sweep with the
    no-refit predictions, and every point's medians over repeats."""

    record: Record
    calibration: Calibration
    predicted: pd.DataFrame
    points: pd.DataFrame

    def sweep(self, name: str) -> pd.DataFrame:
        return self.points[self.points["sweep"] == name]

    @classmethod
    def from_record(cls, rec: Record) -> "Characterization":
        cal, predicted = calibrate_record(rec)
        return cls(rec, cal, predicted, point_table(launch_means(rec.table)))


def latest_calibration(platform: str, root: Path = RECORDS_DIR) -> Calibration:
    """M_X of ``platform`` from its latest calibration record, for the experiments that use it."""
    return calibration_from_dict(latest_record("calibration", platform, root).params["calibration"])
