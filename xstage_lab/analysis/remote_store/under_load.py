"""The X-Stage under load (issue 26): the ``under_load`` probe of a host-link ``remote_store``
record (or of a ``remote_store_partial`` one, run with ``--only under_load``), fitted by
``calibration.under_load_fits``, and its two numbers (``calibration.under_load_terms``): R under
a concurrent memory-bound load over R alone, which the host-link MoE forecast plays, and that
load's slowdown beside a full X-Stage, which it does not, nor the ``under_gemm`` probe's matmul
slowdown (``moe.host_forecast`` says why). A platform without the probe plays R as
calibrated."""
from __future__ import annotations

from pathlib import Path

from ...calibration import UNDER_LOAD, under_load_fits, under_load_terms
from ...records import RECORDS_DIR, Record
from .row_chunks import latest_with_sweep


def latest_under_load_record(platform: str, root: Path = RECORDS_DIR) -> Record | None:
    """``platform``'s newest record that holds the ``under_load`` probe; None where none does."""
    return latest_with_sweep(platform, UNDER_LOAD, root)


def forecast_terms(platform: str, root: Path = RECORDS_DIR) -> tuple[dict, str | None]:
    """``under_load_terms`` of ``platform``'s latest probe and that record's name
    (``experiment/platform/id``); ``({}, None)`` where the platform has none."""
    rec = latest_under_load_record(platform, root)
    if rec is None:
        return {}, None
    return (under_load_terms(under_load_fits(rec.table)),
            f"{rec.meta['experiment']}/{platform}/{rec.record_id}")
