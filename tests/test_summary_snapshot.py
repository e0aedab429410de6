"""Issue 21: ``summary --json`` and every figure's table stay as they were before the records were
made lean, to four significant digits. ``snapshots/`` holds them as taken at ``commit``, with the
records they were made from (``experiment/platform/record_id``, the files that ``summary --json``
and ``reproduce --backend replay`` opened); each test recomputes them from those records only, so
records added later change nothing here."""
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.one_kernel import replay
from xstage_lab.records import RECORDS_ENV, select_records
from xstage_lab.summary import summary

SNAPSHOTS = Path(__file__).parent / "snapshots"
# Four significant digits: half a unit in the fourth, relative to the snapshot's value.
REL_TOL = 5e-4


def assert_close(got, want, where: str) -> None:
    """``got`` equals ``want`` (nested dicts and lists), numbers to ``REL_TOL``."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            assert_close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{where}[{i}]")
    elif isinstance(want, (int, float)) and not isinstance(want, bool):
        assert isinstance(got, (int, float)) and not isinstance(got, bool), where
        assert (math.isnan(got) and math.isnan(want)) or math.isclose(got, want, rel_tol=REL_TOL), \
            f"{where}: {got} != {want}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


# A number in a text cell (a dict or list a table shows as text): compared as a number.
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def assert_same_text(got: str, want: str, where: str) -> None:
    """``got`` is ``want`` but for the numbers in it, which agree to ``REL_TOL``."""
    assert NUMBER.split(got) == NUMBER.split(want), f"{where}: {got!r} != {want!r}"
    for g, w in zip(NUMBER.findall(got), NUMBER.findall(want)):
        assert math.isclose(float(g), float(w), rel_tol=REL_TOL), f"{where}: {g} != {w}"


def test_summary_is_unchanged(tmp_path):
    snap = json.loads((SNAPSHOTS / "summary.json").read_text())
    root = select_records(snap["records"], tmp_path)
    assert_close(summary(root=root), snap["summary"], "summary")


@pytest.mark.early  # every notebook, on the snapshot's records
def test_figure_tables_are_unchanged(tmp_path, monkeypatch):
    tables = SNAPSHOTS / "tables"
    root = select_records(json.loads((tables / "records.json").read_text())["records"],
                          tmp_path / "records")
    monkeypatch.setenv(RECORDS_ENV, str(root))  # read at import, by the notebooks' kernel
    out = tmp_path / "out"
    assert replay(out) == 0
    want = sorted(p.relative_to(tables) for p in tables.glob("*/*.csv"))
    assert sorted(p.relative_to(out) for p in out.glob("*/*.csv")) == want
    for name in want:
        got, snap = pd.read_csv(out / name), pd.read_csv(tables / name)
        assert list(got.columns) == list(snap.columns) and len(got) == len(snap), name
        for column in snap:
            g, w = got[column], snap[column]
            if pd.api.types.is_numeric_dtype(w) and pd.api.types.is_numeric_dtype(g):
                assert np.allclose(g, w, rtol=REL_TOL, atol=0, equal_nan=True), f"{name}: {column}"
            else:
                for i, (gc, wc) in enumerate(zip(map(str, g.tolist()), map(str, w.tolist()))):
                    assert_same_text(gc, wc, f"{name}: {column}[{i}]")
