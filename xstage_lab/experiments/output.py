"""The one output shape of every benchmark (under torchrun or on one GPU): a JSON file
``{"metadata": {..., "provenance": {...}}, "rows": [...]}`` written by rank 0, which
``records.import_bench_json`` saves as a record (the table from ``rows``, the parameters from
``metadata`` less its ``provenance``; ``records.read_output`` reads it back, checked)."""
from __future__ import annotations

import json
from pathlib import Path


def write_output(path: Path, metadata: dict, rows: list[dict], **dumps) -> None:
    """Write a benchmark's output to ``path`` (its folder made); ``dumps``: ``json.dumps``'s
    options (``indent``, ``default``)."""
    if "provenance" not in metadata:
        raise ValueError("a benchmark's metadata must hold its provenance")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"metadata": metadata, "rows": rows}, **dumps))
