"""A change held against the base runs of its job, cell by cell (``analysis.moe.versions``), and
the command that prints it (``python -m xstage_lab compare``)."""
import itertools
import json
from datetime import datetime, timedelta, timezone

import pandas as pd
import pytest

from xstage_lab.__main__ import main
from xstage_lab.analysis.moe import VARIANT
from xstage_lab.analysis.moe.versions import (FASTER, SLOWER, UNBRACKETED, WITHIN, version_ratios,
                                              version_summary)
from xstage_lab.dist_timing import timing_method
from xstage_lab.records import write_record

CELL = ["model", "tokens"]
_SECONDS = itertools.count()  # a record a second: records of the same table never share a name


def _runs(times: dict[str, list[float]], tokens=(1, 8, 64)) -> pd.DataFrame:
    """A record's table: per model its time at each token count (``t_us``)."""
    return pd.DataFrame([{"model": m, "tokens": t, "t_us": v, "other_us": 2 * v}
                         for m, vs in times.items() for t, v in zip(tokens, vs)])


def test_a_verdict_needs_the_change_outside_both_base_runs():
    before = _runs({"A": [10.0, 20.0, 30.0]})
    after = _runs({"A": [12.0, 18.0, 30.0]})
    change = _runs({"A": [9.0, 19.0, 31.0]})
    out = version_ratios([before, after], change, CELL, ["t_us"])
    assert list(out["t_us_verdict"]) == [FASTER, WITHIN, SLOWER]
    assert out["t_us_over_base0"].tolist() == pytest.approx([0.9, 0.95, 31 / 30])
    assert out["t_us_over_base1"].tolist() == pytest.approx([0.75, 19 / 18, 31 / 30])
    assert out["t_us_ratio"][0] == pytest.approx(9.0 / (10.0 * 12.0) ** 0.5)


def test_one_base_run_gives_ratios_without_a_verdict():
    out = version_ratios([_runs({"A": [10.0, 20.0, 30.0]})], _runs({"A": [5.0, 40.0, 30.0]}),
                         CELL, ["t_us", "other_us"])
    assert set(out["t_us_verdict"]) == {UNBRACKETED}
    assert out["other_us_ratio"].tolist() == pytest.approx([0.5, 2.0, 1.0])


def test_a_time_some_run_left_unmeasured_gets_no_verdict():
    base = _runs({"A": [10.0, float("nan"), 30.0]})
    out = version_ratios([base, base], _runs({"A": [5.0, 20.0, 60.0]}), CELL, ["t_us"])
    assert out["t_us_verdict"].fillna("none").tolist() == [FASTER, "none", SLOWER]
    summary = version_summary(out, [], ["t_us"])
    assert summary["t_us_ratio"][0] == pytest.approx(1.0)  # (0.5 · 2) ** 0.5
    assert summary[["t_us_faster", "t_us_slower"]].values.tolist() == [[1, 1]]


def test_only_cells_every_run_measured_are_compared():
    base = _runs({"A": [10.0, 20.0, 30.0], "B": [1.0, 2.0, 3.0]})
    change = _runs({"A": [10.0, 20.0]}, tokens=(8, 512))
    out = version_ratios([base, base], change, CELL, ["t_us"])
    assert out[CELL].values.tolist() == [["A", 8]]


def test_a_per_kernel_profile_is_compared_by_its_total():
    """``route_kernels_us`` is JSON ({kernel: us}, as a record reads it back): its total is the
    time compared; a cell without a profile gets no verdict."""
    def profiled(totals):
        t = _runs({"A": [1.0, 1.0, 1.0]})
        t["route_us"] = [None if x is None else json.dumps({"route_tiny": x - 1, "route_rows": 1})
                         for x in totals]
        return t
    out = version_ratios([profiled([4.0, 2.0, 3.0]), profiled([4.0, 2.0, None])],
                         profiled([2.0, 3.0, 3.0]), CELL, ["route_us"])
    assert out["route_us_ratio"][:2].tolist() == pytest.approx([0.5, 1.5])
    assert out["route_us_verdict"].fillna("none").tolist() == [FASTER, SLOWER, "none"]
    text = _runs({"A": [1.0, 1.0, 1.0]}).assign(route_us=["fast", "fast", "slow"])
    with pytest.raises(ValueError, match="change's column route_us holds neither times nor"):
        version_ratios([profiled([4.0, 2.0, 3.0])], text, CELL, ["route_us"])


@pytest.mark.parametrize("bad", ["column", "twice", "no_base"])
def test_tables_that_cannot_be_paired_are_refused(bad):
    base = _runs({"A": [10.0, 20.0, 30.0]})
    change = {"column": base.drop(columns="t_us"), "twice": pd.concat([base, base])}.get(bad, base)
    with pytest.raises(ValueError, match={"column": "no column", "twice": "twice",
                                          "no_base": "no base run"}[bad]):
        version_ratios([] if bad == "no_base" else [base], change, CELL, ["t_us"])


def test_the_summary_counts_each_groups_verdicts():
    base = [_runs({"A": [10.0, 20.0, 30.0], "B": [10.0, 20.0, 30.0]})] * 2
    change = _runs({"A": [5.0, 20.0, 60.0], "B": [5.0, 20.0, 60.0]})
    by_tokens = version_summary(version_ratios(base, change, CELL, ["t_us"]), ["tokens"], ["t_us"])
    assert by_tokens["tokens"].tolist() == [1, 8, 64]
    assert by_tokens["t_us_ratio"].tolist() == pytest.approx([0.5, 1.0, 2.0])
    assert by_tokens[["t_us_faster", "t_us_within", "t_us_slower"]].values.tolist() == \
        [[2, 0, 0], [0, 2, 0], [0, 0, 2]]
    assert "t_us_unbracketed" not in by_tokens
    whole = version_summary(version_ratios(base, change, CELL, ["t_us"]), [], ["t_us"])
    assert whole["cells"].tolist() == [6] and whole["t_us_ratio"][0] == pytest.approx(1.0)


def _record(root, table, commit, experiment="moe_layer", platform="h200-x1", variant=None,
            timing=None):
    created = datetime(2026, 12, 5, tzinfo=timezone.utc) + timedelta(seconds=next(_SECONDS))
    params = {} if variant is None else {VARIANT: variant}
    if timing is not None:
        params["timing"] = timing
    return write_record(experiment, platform, table.assign(setting="ep1", precision="bf16"),
                        params, {"git_commit": commit}, root=root, created=created)


def test_compare_prints_the_cells_and_the_groups(tmp_path, capsys):
    old = [_record(tmp_path, _runs({"A": [10.0, 20.0, 30.0]}), "old") for _ in range(2)]
    new = _record(tmp_path, _runs({"A": [5.0, 20.0, 60.0]}), "new")
    assert main(["compare", str(new), *map(str, old), "--columns", "t_us", "--by", "tokens"]) == 0
    out = capsys.readouterr().out
    assert "new against old, 2 base run(s)" in out
    assert out.count(FASTER) == 2 and out.count(SLOWER) == 2  # a cell's line and its group's


def test_compare_takes_runs_of_one_commit_as_versions_by_their_variant(tmp_path, capsys):
    """moe_layer's --weighted-sum picks a build: one commit, two versions."""
    old = [_record(tmp_path, _runs({"A": [10.0, 20.0, 30.0]}), "abc",
                   variant={"weighted_sum": "launch"}) for _ in range(2)]
    new = _record(tmp_path, _runs({"A": [5.0, 20.0, 60.0]}), "abc",
                  variant={"weighted_sum": "kernel"})
    assert main(["compare", str(new), *map(str, old), "--columns", "t_us"]) == 0
    assert "abc weighted_sum=kernel against abc weighted_sum=launch" in capsys.readouterr().out
    same = _record(tmp_path, _runs({"A": [5.0, 20.0, 60.0]}), "abc",
                   variant={"weighted_sum": "launch"})
    assert main(["compare", str(same), *map(str, old), "--columns", "t_us"]) == 2
    assert "share one version" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["same_commit", "other_experiment", "no_cell", "no_column"])
def test_compare_refuses_records_it_cannot_hold_together(tmp_path, capsys, bad):
    table = _runs({"A": [10.0, 20.0, 30.0]})
    experiment = "route_small_probe" if bad == "no_cell" else "moe_layer"
    base = _record(tmp_path, table, "old",
                   experiment="moe_host" if bad == "other_experiment" else experiment)
    change = _record(tmp_path, table, "old" if bad == "same_commit" else "new",
                     experiment=experiment)
    args = ["compare", str(change), str(base), "--columns",
            "nonsense_us" if bad == "no_column" else "t_us"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert {"same_commit": "share one version", "other_experiment": "different experiments",
            "no_cell": "--cell", "no_column": "no column"}[bad] in err


def test_compare_holds_two_timings_apart_only_as_one_commits_variants(tmp_path, capsys):
    """Runs timed two ways are two versions where one commit's variant picks the timing
    (moe_layer --graph-start); across commits each ratio would mix the code's change with the
    timing's, and compare refuses."""
    idle, held = timing_method(5), timing_method(5, 100_000)
    old = [_record(tmp_path, _runs({"A": [10.0, 20.0, 30.0]}), "abc", timing=idle,
                   variant={"graph_start": "idle"}) for _ in range(2)]
    same_commit = _record(tmp_path, _runs({"A": [5.0, 20.0, 60.0]}), "abc", timing=held,
                          variant={"graph_start": "held"})
    assert main(["compare", str(same_commit), *map(str, old), "--columns", "t_us"]) == 0
    assert "abc graph_start=held against abc graph_start=idle" in capsys.readouterr().out
    other_commit = _record(tmp_path, _runs({"A": [5.0, 20.0, 60.0]}), "def", timing=held,
                           variant={"graph_start": "held"})
    assert main(["compare", str(other_commit), *map(str, old), "--columns", "t_us"]) == 2
    assert "timed in different ways" in capsys.readouterr().err
    alike = _record(tmp_path, _runs({"A": [5.0, 20.0, 60.0]}), "def", timing=idle)
    assert main(["compare", str(alike), *map(str, old), "--columns", "t_us"]) == 0
