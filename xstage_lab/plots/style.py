"""What every figure module shares: units and the palette."""
from __future__ import annotations

from ..calibration import kb_text  # noqa: F401  (the figures' B labels)

KIB = 1024
MIB = 1024 * 1024
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"]
