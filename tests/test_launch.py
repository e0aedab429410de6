"""What measure-all hands each benchmark, and the names it accepts."""
from pathlib import Path

import pytest

from xstage_lab import launch


def test_moe_runs_the_declared_matrix():
    (flag, matrix), = [launch._benchmark_args("moe", {}, Path("unused"))]
    assert flag == "--matrix" and Path(matrix).name == "moe_matrix.json" and Path(matrix).is_file()


def test_trace_explains_the_moe_record_of_this_run_else_the_latest(tmp_path, monkeypatch):
    monkeypatch.setattr("xstage_lab.platform.platform_name", lambda inv=None: "h200-x2")
    written = {"moe": tmp_path / "new.parquet"}
    assert launch._benchmark_args("moe_trace", written, tmp_path) == ["--regressions",
                                                                     str(tmp_path / "new.parquet")]
    assert launch._benchmark_args("moe_trace", {}, tmp_path) == []  # none on this platform
    older = tmp_path / "moe" / "h200-x2"
    older.mkdir(parents=True)
    for name in ("20260101T000000Z-a.parquet", "20260102T000000Z-b.parquet"):
        (older / name).touch()
    assert launch._benchmark_args("moe_trace", {}, tmp_path) == [
        "--regressions", str(older / "20260102T000000Z-b.parquet")]
    assert launch._benchmark_args("fa_a2a", written, tmp_path) == []


def test_unknown_measurements_are_refused_before_any_launch():
    with pytest.raises(ValueError, match="unknown measurements"):
        launch.measure_all(only=["remote_store", "nonsense"])
