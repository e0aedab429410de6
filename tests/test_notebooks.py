"""Every notebook runs headlessly through papermill in replay mode from the committed records,
and the runner writes each figure and table and an index that lists them. The notebooks run once
per session for all of these tests and tests/test_prose.py (``reproduced`` in conftest.py)."""
import json

import pytest

from xstage_lab import runner
from xstage_lab.analysis.remote_store import tables


@pytest.mark.parametrize("notebook", [p.stem for p in runner.notebooks()])
def test_notebook_publishes_its_figures_and_tables(reproduced, notebook):
    assert (reproduced / f"{notebook}.ipynb").exists()
    entries = [json.loads(line) for line in (reproduced / notebook / "manifest.jsonl").read_text().splitlines()]
    assert any(e["kind"] == "figure" for e in entries)
    for e in entries:
        for f in e["files"]:
            assert (reproduced / notebook / f).stat().st_size > 0


def test_outputs_open_offline_and_the_index_shows_every_figure(reproduced):
    """Issue 20: no figure page or the index loads anything from the network, and each figure
    appears in the index as its picture (PNG) or, without an image engine, its offline page."""
    from xstage_lab.offline import network_loads

    assert network_loads(reproduced) == []
    index = (reproduced / "index.html").read_text()
    for manifest in reproduced.glob("*/manifest.jsonl"):
        for e in map(json.loads, manifest.read_text().splitlines()):
            if e["kind"] == "figure":
                shown = e.get("image") or e["files"][0]
                assert f'src="{manifest.parent.name}/{shown}"' in index, e["name"]


def test_fa_labels_come_from_the_record():
    """Issue 20: the kernel named in Table 3 is the record's, and records from before the kernel
    was recorded ran the Triton kernel."""
    from types import SimpleNamespace

    import pandas as pd

    from xstage_lab import plots

    table = pd.DataFrame({"P": [4], "heads": [16], "head_dim": [64]})
    gluon = SimpleNamespace(platform="x", table=table, params={"config": {"kernel": "gluon_ws"}})
    old = SimpleNamespace(platform="x", table=table, params={"config": {"BLOCK_M": 128}})
    assert plots.fa_label(gluon) == "x Gluon FA (warp-specialized), P=4, H=16, d=64"
    assert plots.fa_label(old) == "x Triton FA, P=4, H=16, d=64"


def test_characterization_publishes_fig3_and_table1(reproduced):
    names = {json.loads(line)["name"] for line in
             (reproduced / "01_remote_store_characterization" / "manifest.jsonl").read_text().splitlines()}
    assert {"table1", "calibration_summary"} <= names
    for fig in ("fig3a", "fig3b", "fig3c", "fig3d"):
        assert any(n.startswith(fig) for n in names), fig
    assert {"visibility_clocks", "visibility_h200-x2", "visibility_latency_h200-x2",
            "visibility_first_burst_h200-x2", "visibility_vs_T_complete_h200-x2"} <= names
    index = (reproduced / "index.html").read_text()
    assert "Table 1" in index
    assert "<li>replayed: remote_store over nvlink, remote_store over host" in index


def test_ulysses_attention_publishes_table3_fig11_tuning_and_the_fenced_pairing(reproduced):
    names = {json.loads(line)["name"] for line in
             (reproduced / "02_ulysses_attention" / "manifest.jsonl").read_text().splitlines()}
    assert {"table3", "fig11", "fa_tuning", "fa_tuning_best", "attention_links",
            "attention_links_h200-x2_h200-x1-host"} <= names
    for prefix in ("fa_a2a_headline_", "fig11_predictions_", "fig11_check_",
                   "fa_fenced_vs_decoupled_"):
        assert any(n.startswith(prefix) for n in names), prefix


def test_fused_moe_publishes_fig8_table2_and_the_mechanism(reproduced):
    names = {json.loads(line)["name"] for line in
             (reproduced / "03_fused_moe" / "manifest.jsonl").read_text().splitlines()}
    assert {"moe_headline", "fig8", "table2"} <= names
    for prefix in ("fig9_", "fig10_", "condition1_", "moe_d_sweep_", "moe_regressions_",
                   "moe_counterfactual_", "moe_traced_causes_", "moe_regression_groups_",
                   "moe_trace_runs_", "moe_d_sweep_rows_", "moe_layer_call_excess_"):
        assert any(n.startswith(prefix) for n in names), prefix


def test_notebook_04_publishes_verdicts_beside_measurements(reproduced):
    entries = [json.loads(line) for line in
               (reproduced / "04_simulator_and_design_test" / "manifest.jsonl").read_text().splitlines()]
    names = {e["name"] for e in entries}
    assert {"simulator_errors", "simulated_schedules"} <= names
    assert any(n.startswith("attention_epilogue_spans_") for n in names)
    assert any(n.startswith("attention_trace_simulated_") for n in names)
    # the attention (end to end and per tile) and MoE verdicts each carry a yes/no "agrees" column
    for prefix in ("attention_verdicts_", "attention_trace_verdicts_", "moe_verdicts_"):
        verdict = next(e for e in entries if e["name"].startswith(prefix))
        csv = reproduced / "04_simulator_and_design_test" / verdict["files"][0]
        header, *rows = csv.read_text().splitlines()
        assert header.split(",")[-1] == "agrees" and rows, prefix
        assert {r.split(",")[-1] for r in rows} <= {"yes", "no"}, prefix


def test_beyond_the_paper_publishes_patterns_operations_and_verdicts(reproduced):
    entries = [json.loads(line) for line in
               (reproduced / "05_beyond_the_paper" / "manifest.jsonl").read_text().splitlines()]
    names = {e["name"] for e in entries}
    for prefix in ("patterns_", "patterns_heatmap_", "patterns_rates_", "patterns_verdict_",
                   "operations_", "operations_verdict_", "operations_gap_sweeps_",
                   "operations_left_out_"):
        assert any(n.startswith(prefix) for n in names), prefix
    # the verdicts carry the notebook's threshold parameter and a yes/no for every measured row
    verdict = next(e for e in entries if e["name"].startswith("operations_verdict_"))
    csv = (reproduced / "05_beyond_the_paper" / verdict["files"][0]).read_text()
    assert "holds without refit (≤ 5%)" in csv and ",yes" in csv


def test_failing_notebook_gives_nonzero_exit_and_names_the_cell(tmp_path, monkeypatch, capsys):
    import nbformat

    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"},
                                            "language_info": {"name": "python"}})
    params = nbformat.v4.new_code_cell("backend = 'auto'\nout_dir = None")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell("raise RuntimeError('planted failure')")]
    (tmp_path / "nb").mkdir()
    nbformat.write(nb, tmp_path / "nb" / "99_broken.ipynb")
    monkeypatch.setattr(runner, "NOTEBOOKS_DIR", tmp_path / "nb")
    assert runner.reproduce(backend="replay", out=tmp_path / "out") == 1
    assert "planted failure" in capsys.readouterr().err


def test_only_rejects_unknown_names():
    with pytest.raises(ValueError, match="no notebook"):
        runner.notebooks(["no_such_notebook"])


def test_replay_shows_an_eight_gpu_platform_beside_the_committed_one(eight_gpu_root, monkeypatch):
    """Issue 7: the notebooks' calls in replay, with an h200-x8 platform's records beside the
    committed h200-x2 ones: every side-by-side table and figure has both, in platform order, and
    the per-platform ones work on the 8-GPU records (P = 8, 73 injection-pattern route sets)."""
    import functools

    from xstage_lab import load, plots
    from xstage_lab.analysis.attention import model as attention_model
    from xstage_lab.analysis.moe import trace as moe_trace
    from xstage_lab.analysis.remote_store import characterization as remote_store
    from xstage_lab.analysis.remote_store import patterns as injection_patterns
    from xstage_lab.paper import published

    root, both = eight_gpu_root, ["h200-x2", "h200-x8"]
    # notebook 02 reads each record's calibration from the records root it replays
    monkeypatch.setattr(remote_store, "latest_calibration",
                        functools.partial(remote_store.latest_calibration, root=root))

    # 01: Table 1, the calibration summary, the pairs heat maps, the visibility clocks
    chars = load("remote_store", backend="replay", root=root)
    assert [c.record.platform for c in chars] == both
    cals = [c.calibration for c in chars]
    assert list(plots.table1_comparison(published("table1"), cals).columns) == [
        "quantity", "paper", *both]
    assert list(plots.calibration_summary_table(cals).columns) == ["quantity", *both]
    assert len(load("visibility", backend="replay", root=root)) == 2
    # 02: Table 3, the times per platform, Fig. 11 with each platform's predictions
    fa = load("fa_a2a", backend="replay", root=root)
    assert [r.platform for r in fa] == both
    # labels from the records: the kernel from the record's config (gluon_ws in the latest), P,
    # heads and head dim from its rows
    sources = set(plots.table3_comparison(published("table3"), fa)["source"])
    assert {"h200-x2 Gluon FA (warp-specialized), P=2, H=24, d=128",
            "h200-x8 Gluon FA (warp-specialized), P=8, H=24, d=128"} <= sources
    assert [a.text for a in plots.fa_a2a_times(fa).layout.annotations] == [
        plots.fa_label(r) for r in fa]
    predictions = {r.platform: attention_model.record_predictions(r) for r in fa}
    groups = {t.legendgrouptitle.text for t in
              plots.fig11_residual(published("table3"), fa, predictions).data}
    assert {"h200-x2 Gluon FA (warp-specialized), P=2, H=24, d=128",
            "h200-x8 Gluon FA (warp-specialized), P=8, H=24, d=128"} <= groups
    # 03: the MoE headline, Fig. 8, Table 2, Condition 1 per platform
    moe = load("moe", backend="replay", root=root)
    traces = load("moe_trace", backend="replay", root=root)
    headlines = {r.platform: moe_trace.headline_numbers(r.table) for r in moe}
    assert plots.moe_headline(published("moe_headline"), headlines)["source"].tolist() == ["paper", *both]
    assert [a.text for a in plots.moe_speedups(moe).layout.annotations] == both
    table2 = {r.platform: moe_trace.table2(r.table) for r in traces}
    assert set(plots.moe_table2(published("table2"), table2)["source"]) == {"paper", *both}
    for r in traces:
        assert len(moe_trace.condition1_table(r.table, remote_store.latest_calibration(r.platform)
                                              .platform_model()))
    # 05: injection patterns and operations per platform
    patterns = load("remote_patterns", backend="replay", root=root)
    assert [r.platform for r in patterns] == both
    rec = patterns[1]
    entry = injection_patterns.summary_entry(rec.params, rec.record_id)
    assert len(tables.patterns_table(entry)) == 56 + 8 + 8 * 7 + 8
    assert plots.patterns_drain_heatmap(entry, "h200-x8").data[0].z.shape == (8, 8)


def test_every_figure_names_the_link_and_backend_that_drew_it(reproduced):
    """Issue 26: each figure's manifest entry names the platforms it was drawn from, each with its
    link and backend, and the index says them under the figure; the host link's figures (notebook
    01's Fig. 3 of ``h200-x1-host``, notebook 02's attention model, notebook 03's matrix) name
    it."""
    from xstage_lab.runner import drawn_line

    index = (reproduced / "index.html").read_text()
    links = {}
    for manifest in reproduced.glob("*/manifest.jsonl"):
        for e in map(json.loads, manifest.read_text().splitlines()):
            if e["kind"] != "figure":
                continue
            assert e["drawn"], e["name"]
            assert {d["backend"] for d in e["drawn"]} == {"replay"}, e["name"]
            links[e["name"]] = {d["link"] for d in e["drawn"]}
            assert f'<p class="drawn">drawn by {drawn_line(e["drawn"])}</p>' in index, e["name"]
    assert links["fig3d_h200-x1-host"] == {"host"} and links["fig3d_h200-x2"] == {"nvlink"}
    assert links["attention_links"] == {"nvlink", "host"} and links["fig11"] == {"nvlink"}
    assert links["moe_host_speedups_h200-x1-host"] == {"host"}
    assert links["moe_kernel_ratio"] == {"local"}


def test_every_figure_has_a_caption_and_axis_titles_and_the_index_no_long_table(reproduced):
    """Issue 29: each figure of ``out/`` with a caption and a title on the axes of each direction
    its traces use; a table longer than ``runner.INDEX_TABLE_ROWS`` rows linked from the index,
    not shown in it; Table 1's paper column as the paper prints it."""
    for manifest in reproduced.glob("*/manifest.jsonl"):
        for e in map(json.loads, manifest.read_text().splitlines()):
            if e["kind"] == "figure":
                assert e["caption"].strip() and e["untitled_axes"] == [], e
    index = (reproduced / "index.html").read_text()
    for table in index.split("<table")[1:]:
        assert table.split("</table>")[0].count("<tr") - 1 <= runner.INDEX_TABLE_ROWS  # + header
    table1 = (reproduced / "01_remote_store_characterization" / "table1.md").read_text()
    sm_count = next(line for line in table1.splitlines() if line.startswith("| SMs per GPU"))
    assert sm_count.split("|")[2].strip() == "148" and "nan" not in table1.lower()


def test_the_readme_cpu_commands_run_as_written(reproduced, tmp_path):
    """The README's "On the CPU" block as written, line by line after its activation line, in a
    scratch folder holding what its set-up made (``.venv``: this interpreter's environment;
    ``out``: this module's reproduce run): every command succeeds and no file of the repository
    changes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = runner.NOTEBOOKS_DIR.parent
    section = (repo / "README.md").read_text().split("\n## On the CPU\n", 1)[1].split("\n## ")[0]
    block = section.split("```\n")[1]
    activate, *commands = [line.split("  #")[0].strip() for line in block.splitlines()]
    assert activate == ". .venv/bin/activate" and commands
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    (tmp_path / "out").symlink_to(reproduced)

    def status() -> str:
        return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=repo,
                              capture_output=True, text=True, check=True).stdout

    before = status()
    env = {**os.environ, "PYTHONPATH": str(repo)}  # this checkout's package, whatever .venv holds
    for command in commands:
        done = subprocess.run(["bash", "-ec", f"{activate}\n{command}"], cwd=tmp_path, env=env,
                              capture_output=True, text=True)
        assert done.returncode == 0 and done.stdout, (command, done.stderr[-2000:])
    assert status() == before
