"""What every figure module shares: units, the palette, record cells stored as JSON text."""
from __future__ import annotations

import json

KIB = 1024
MIB = 1024 * 1024
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"]


def kb_text(b) -> str:
    return f"{int(b) // KIB} KB"


def json_cell(v):
    """A record cell that held a dict or list (stored as JSON text)."""
    return json.loads(v) if isinstance(v, str) else v
