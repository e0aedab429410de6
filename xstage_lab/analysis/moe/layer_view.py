"""What ``summary`` reads of ``moe_layer`` records (``layer_bench``'s), on the CPU: the per-cell
rows of the fused MoE layer from the router's output to the layer's output (issue 27)."""
from __future__ import annotations

import pandas as pd

SUMMARY_KEYS = ("model", "precision", "setting", "tokens", "fused_eager_us", "fused_graph_us",
                "schedule_us", "host_overhead_us", "kernel_us", "weighted_sum_floor_us",
                "unfused_eager_us", "unfused_graph_us", "host_scheduled_us", "weight_floor_us")


def summary_entry(table: pd.DataFrame) -> dict:
    """The ``moe_layer`` entry of ``summary --json``: one row per cell, ``SUMMARY_KEYS``."""
    return {"rows": [{k: (r[k].item() if hasattr(r[k], "item") else r[k]) for k in SUMMARY_KEYS}
                     for r in table.to_dict("records")]}
