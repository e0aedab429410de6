"""``summary --json``: the headline numbers of the committed records, keyed by platform.

Each experiment contributes one key per platform (schema in README.md); this module gathers
them from the latest record of each platform.
"""
from __future__ import annotations

import json
from pathlib import Path

from .records import RECORDS_DIR, latest_record, platforms


def calibration_entry(platform: str, root: Path) -> dict:
    """The ``calibration`` entry: the latest calibration record's quantities."""
    rec = latest_record("calibration", platform, root)
    return {row.quantity: json.loads(row.value) for row in rec.table.itertuples()}


ENTRIES = {"calibration": calibration_entry}


def summary(root: Path = RECORDS_DIR) -> dict:
    out: dict[str, dict] = {}
    for key, entry in ENTRIES.items():
        for platform in platforms(key, root):
            out.setdefault(platform, {})[key] = entry(platform, root)
    return {"platforms": out}
