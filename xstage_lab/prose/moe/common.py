"""What the ``moe`` passages share: the names of a regression's causes and of a traced kernel's
components, a cell's name, the models that regress in every cell, a record's EP."""
from __future__ import annotations

import pandas as pd

CAUSE_NAMES = {"wait_l2": "Linear-2 dependency wait (starvation)",
               "mainloop_l1": "Linear-1 mainloop growth", "mainloop_l2": "Linear-2 mainloop growth",
               "epilogue_l1": "Linear-1 epilogue growth", "span_l2": "remote-store span growth",
               "not traced": "not traced"}
COMPONENT_NAMES = {"wait_l2": "Linear-2 dependency wait", "mainloop_l1": "Linear-1 mainloops",
                   "mainloop_l2": "Linear-2 mainloops", "epilogue_l1": "Linear-1 epilogues",
                   "span_l2": "remote-store spans"}


def cell_name(row) -> str:
    return f"{row['model']} {row['precision']} {row['routing']} {int(row['tokens'])}"


def all_regress(table: pd.DataFrame) -> list[str]:
    """Models of a matrix whose every cell has speedup < 1."""
    return [m for m, g in table.groupby("model", sort=False) if (g["speedup"] < 1).all()]


def record_ep(record) -> int:
    return int(record.params.get("world_size", record.table["world_size"].iloc[0]))
