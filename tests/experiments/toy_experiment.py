"""A toy experiment for the registry's test (``test_registry.py``): everything it declares, in one
class, on the CPU."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from xstage_lab.experiments import harness
from xstage_lab.sweep import Axis, Sweep


class ToyView:
    """What ``load`` gives of a toy record."""

    def __init__(self, record):
        self.record = record
        self.total = float(record.table["value"].sum())


class Toy(harness.Experiment):
    name = "toy"
    paper = "none: the registry's test"
    launch = "in_process"
    in_measure_all = True
    optional = True
    links = ("local",)  # one GPU, no link: measure-all runs it on the one GPU of the test

    def add_arguments(self, p) -> None:
        p.add_argument("--points", type=int, default=3, help="points to measure")

    def check_args(self, a) -> None:
        if a.points < 1:
            raise ValueError("--points must be >= 1")

    def measure_all_args(self, written, root: Path) -> list[str]:
        return ["--points", "2"]

    def sweeps(self, args) -> list[Sweep]:
        return [Sweep("toy", (Axis("x", list(range(args.points))),), repeats=1, warmup=0)]

    def measure(self, point, run) -> pd.DataFrame:
        return pd.DataFrame({"value": [float(point["x"])]})

    @classmethod
    def analyse(cls, record, root):
        return ToyView(record)

    @classmethod
    def summary_entry(cls, view) -> dict:
        return {"total": view.total, "source_record": view.record.record_id}


EXPERIMENT = Toy()

if __name__ == "__main__":
    harness.main(EXPERIMENT)
