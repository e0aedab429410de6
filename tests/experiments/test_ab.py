"""``experiments.ab`` and ``python -m xstage_lab ab``: one experiment run as base, change, base,
each in its side's tree with its commit and options, then held together by ``compare``. The
runs are stood in for by a runner that writes the record a run would (no GPU here)."""
from __future__ import annotations

import itertools
import shlex
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pandas as pd
import pytest
import torch

from xstage_lab.__main__ import main
from xstage_lab.analysis.moe import VARIANT
from xstage_lab.experiments import ab
from xstage_lab.experiments.ab import Side, check_sides, run_sides
from xstage_lab.records import write_record

_SECONDS = itertools.count()  # a record per second: its name holds the time


def _tree(path: Path) -> Path:
    for d in ("xstage_lab", "kernels"):
        (path / d).mkdir(parents=True)
    return path


class FakeRun:
    """Writes the ``moe_layer`` record a run would: its commit from ``XSTAGE_GIT_COMMIT``
    (``here`` without it), its variant from ``--weighted-sum``, a time per cell that the
    ``times`` of its run sets; records every call."""

    def __init__(self, times, writes=1, exit_code=0, package_in=None):
        self.times, self.writes, self.exit_code, self.calls = list(times), writes, exit_code, []
        self.package_in = package_in  # where the import check finds the package (its tree)

    def __call__(self, argv, cwd, env, **kw):
        if argv[1] == "-c":  # the import check
            tree = self.package_in or Path(env["PYTHONPATH"].split(":")[0])
            return subprocess.CompletedProcess(argv, 0, f"{tree}/xstage_lab/__init__.py\n")
        self.calls.append((argv, Path(cwd), env))
        root = Path(argv[argv.index("--root") + 1])
        options = argv[argv.index("moe_layer") + 1:]
        variant = ({"weighted_sum": options[options.index("--weighted-sum") + 1]}
                   if "--weighted-sum" in options else None)
        time = self.times.pop(0)
        table = pd.DataFrame({"model": "M", "precision": "bf16", "setting": "ep1",
                              "tokens": [1, 8], "t_us": [time, 2 * time]})
        for _ in range(self.writes):
            created = datetime(2026, 12, 5, tzinfo=timezone.utc) + \
                timedelta(seconds=next(_SECONDS))
            write_record("moe_layer", "h200-x1", table,
                         {} if variant is None else {VARIANT: variant},
                         {"git_commit": env.get("XSTAGE_GIT_COMMIT", "here")}, root=root,
                         created=created)
        return subprocess.CompletedProcess(argv, self.exit_code)


def test_the_sides_run_base_change_base_each_in_its_tree(tmp_path, monkeypatch):
    monkeypatch.delenv("XSTAGE_GIT_COMMIT", raising=False)
    old, here = _tree(tmp_path / "old"), _tree(tmp_path / "here")
    runner = FakeRun([10.0, 8.0, 11.0])
    change, base = run_sides("moe_layer", ["--tokens", "1", "8"], Side(old, "abc"),
                             Side(here), tmp_path / "records", runner=runner)
    trees = [cwd for _, cwd, _ in runner.calls]
    assert trees == [old, here, old]
    commits = [env.get("XSTAGE_GIT_COMMIT") for _, _, env in runner.calls]
    assert commits == ["abc", None, "abc"]
    for argv, cwd, env in runner.calls:
        assert argv[1:5] == ["-m", "xstage_lab", "run", "--root"]
        assert argv[-3:] == ["moe_layer", "--tokens", "1", "8"][-3:]
        assert env["PYTHONPATH"].split(":")[0] == str(cwd.resolve())  # the side's tree first
    assert [p.parent for p in (change, *base)] == [tmp_path / "records/moe_layer/h200-x1"] * 3
    assert base[0] != base[1] and change not in base


def test_a_run_that_fails_or_writes_other_than_one_record_is_refused(tmp_path):
    here = _tree(tmp_path / "here")
    sides = (Side(here, options=("--weighted-sum", "launch")),
             Side(here, options=("--weighted-sum", "kernel")))
    with pytest.raises(RuntimeError, match="base run of moe_layer failed"):
        run_sides("moe_layer", [], *sides, tmp_path / "r", runner=FakeRun([1.0], exit_code=3))
    with pytest.raises(RuntimeError, match="wrote 2 moe_layer records"):
        run_sides("moe_layer", [], *sides, tmp_path / "s", runner=FakeRun([1.0], writes=2))


def test_a_side_whose_runs_import_another_tree_is_refused(tmp_path):
    """An installed copy of the package found first would measure another version."""
    old, here = _tree(tmp_path / "old"), _tree(tmp_path / "here")
    runner = FakeRun([1.0], package_in=here)
    with pytest.raises(RuntimeError, match=f"a run in {old} imports xstage_lab from {here}"):
        run_sides("moe_layer", [], Side(old, "abc"), Side(here), tmp_path / "r", runner=runner)
    assert runner.calls == []  # nothing ran


def test_two_sides_must_be_two_versions_of_source_trees(tmp_path):
    here = _tree(tmp_path / "here")
    with pytest.raises(ValueError, match="one version"):
        check_sides(Side(here), Side(here))
    with pytest.raises(ValueError, match="holds no xstage_lab or kernels"):
        check_sides(Side(tmp_path), Side(here))


def test_ab_runs_the_job_and_compares_it(tmp_path, monkeypatch, capsys):
    """Two versions of one commit by their options (moe_layer's variant): the change faster
    than both base runs."""
    runner = FakeRun([10.0, 8.0, 11.0])
    monkeypatch.setattr(ab.subprocess, "run", runner)
    monkeypatch.setenv("XSTAGE_GIT_COMMIT", "abc")
    argv = ["ab", "moe_layer", "--options", "--tokens 1 8", "--root", str(tmp_path),
            "--base-options", "--weighted-sum launch", "--change-options",
            "--weighted-sum kernel", "--columns", "t_us", "--by", "tokens"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "abc weighted_sum=kernel against abc weighted_sum=launch, 2 base run(s)" in out
    cells = [line.split() for line in out.splitlines() if line.startswith("    M ")]
    assert [c[-1] for c in cells] == ["faster", "faster"]  # both cells below both base runs
    assert [shlex.join(a[-4:]) for a, _, _ in runner.calls] == [
        "1 8 --weighted-sum launch", "1 8 --weighted-sum kernel", "1 8 --weighted-sum launch"]


def test_the_import_check_finds_this_trees_package():
    """Run for real (a subprocess): this checkout's runs import its own package."""
    ab._check_imports_its_tree(Side(Path(ab.__file__).resolve().parents[2]), subprocess.run)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the run must stop at its GPU check")
def test_ab_runs_run_for_real_up_to_the_experiments_gpu_check(tmp_path, capfd):
    """The real subprocesses: the import checks pass in this checkout, and the base's ``run``
    takes the shared and the side's options, then stops where ``moe_layer`` needs a GPU."""
    argv = ["ab", "moe_layer", "--options", "--models DiT-MoE --tokens 1", "--root",
            str(tmp_path), "--base-options", "--weighted-sum launch", "--change-options",
            "--weighted-sum kernel", "--columns", "fused_graph_us"]
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert "moe_layer needs a CUDA GPU" in err
    assert "ab: error: the base run of moe_layer failed (exit 1)" in err
