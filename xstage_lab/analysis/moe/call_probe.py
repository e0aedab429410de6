"""The call probe's records read on the CPU (``moe_call_probe``, issue 27): per record, how much
longer the fused kernel took after each sequence of launches than after its own launch
(``over_alone``), by precision, over the record's cells; each record names the commit of the
kernel it timed, so records of two builds side by side compare them."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ...loading import platforms, read, record_paths
from ...records import Record

EXPERIMENT = "moe_call_probe"


def call_probe_records(root: Path | str | None = None) -> dict[str, tuple[Record, ...]]:
    """Every platform's ``moe_call_probe`` records, oldest first (none: an empty dict)."""
    return {p: tuple(read(path) for path in record_paths(EXPERIMENT, p, root))
            for p in platforms(EXPERIMENT, root)}


def sequence_spans(records) -> pd.DataFrame:
    """Per record (oldest first), precision and sequence other than ``alone``: the record, the
    commit of the kernel it timed, its cells and their token counts, the kernel's time after its
    own launch (``alone_us``: least and greatest over the cells) and ``over_alone``'s least,
    median and greatest over the cells."""
    rows = []
    for r in records:
        t = r.table
        alone = t[t["sequence"] == "alone"]
        for (precision, sequence), g in t[t["sequence"] != "alone"].groupby(
                ["precision", "sequence"], sort=False):
            own = alone[alone["precision"] == precision]["kernel_us"]
            rows.append({"record": r.record_id, "commit": (r.git_commit or "")[:7],
                         "precision": precision, "sequence": sequence, "cells": len(g),
                         "tokens": ", ".join(str(n) for n in sorted(g["tokens"].unique())),
                         "alone_us_min": own.min(), "alone_us_max": own.max(),
                         "over_alone_min": g["over_alone"].min(),
                         "over_alone_median": g["over_alone"].median(),
                         "over_alone_max": g["over_alone"].max()})
    return pd.DataFrame(rows)
