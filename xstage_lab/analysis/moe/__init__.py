"""What is read of the MoE records (§4.2): the traces (``trace``: Table 2, Figs. 9–10), the one-GPU
kernel records (``kernel_view``) and layer records (``layer_view``), and the EP forecast
(``forecast``).

The record vocabulary the kernels write, without importing them: a tile table entry's ``kind``
(``L1``: Linear-1, ``L2``: Linear-2) and the precisions (``ops.moe`` holds the same values; a test
keeps them equal)."""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pandas as pd

L1, L2 = 0, 1
PRECISIONS = ("bf16", "fp8")
# A record's params may name the options that made its version of the code beside its commit (a
# build an option picks: moe_layer's weighted sum), so that runs of one commit compare as versions
VARIANT = "variant"


def geometric_mean(values) -> float:
    """exp(mean(log x)), to the bit ``scipy.stats.gmean``'s of a 1-D array, without importing
    scipy.stats (half a second of each process that reads a MoE record: the summary, a kernel)."""
    return float(np.exp(np.mean(np.log(np.asarray(values, dtype=float)))))


def newest_per_cell(records, cell: list[str]):
    """The rows of ``records`` (oldest first) with every ``cell`` once, a later record's row
    winning, in cell order: a matrix measured in several records (chunks, runs)."""
    rows = pd.concat([r.table for r in records], ignore_index=True)
    return rows.drop_duplicates(cell, keep="last").sort_values(cell, kind="stable") \
        .reset_index(drop=True)


@dataclass(frozen=True)
class CellView:
    """One platform's records of a matrix measured in cells (the subclass's ``CELL`` columns),
    oldest first."""

    platform: str
    records: tuple
    CELL: ClassVar[list[str]]

    @property
    def table(self) -> pd.DataFrame:
        """Every cell once (a later record's row wins), in cell order."""
        return newest_per_cell(self.records, self.CELL)
