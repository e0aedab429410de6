"""What measure-all hands each benchmark (``Experiment.measure_all_args``), and the names it accepts."""
from pathlib import Path

import pytest

from tests.test_platform import inv
from xstage_lab import launch
from xstage_lab.experiments import experiment, measure_all_names


def _benchmark_args(name, written, root):
    return experiment(name).measure_all_args(written, root)


def test_moe_runs_the_declared_matrix():
    (flag, matrix), = [_benchmark_args("moe", {}, Path("unused"))]
    assert flag == "--matrix" and Path(matrix).name == "moe_matrix.json" and Path(matrix).is_file()


def test_trace_explains_the_moe_record_of_this_run_else_the_latest(tmp_path, monkeypatch):
    monkeypatch.setattr("xstage_lab.platform.platform_name", lambda inv=None: "h200-x2")
    written = {"moe": tmp_path / "new.parquet"}
    assert _benchmark_args("moe_trace", written, tmp_path) == ["--regressions",
                                                                     str(tmp_path / "new.parquet")]
    assert _benchmark_args("moe_trace", {}, tmp_path) == []  # none on this platform
    older = tmp_path / "moe" / "h200-x2"
    older.mkdir(parents=True)
    for name in ("20260101T000000Z-a.parquet", "20260102T000000Z-b.parquet"):
        (older / name).touch()
    assert _benchmark_args("moe_trace", {}, tmp_path) == [
        "--regressions", str(older / "20260102T000000Z-b.parquet")]
    assert _benchmark_args("fa_a2a", written, tmp_path) == []
    assert _benchmark_args("fa_trace", written, tmp_path) == ["--repeat-build"]


def test_unknown_measurements_are_refused_before_any_launch():
    with pytest.raises(ValueError, match="unknown measurements"):
        launch.measure_all(only=["remote_store", "nonsense"])


def test_measure_all_launches_every_rank_of_eight_gpus(tmp_path, monkeypatch):
    """On an 8-GPU machine every multi-process experiment runs under torchrun with 8 processes,
    multicast off, the MoE matrix declared, the trace benchmark given the MoE record of this run;
    each record is imported under the records root with its experiment's resolution."""
    import subprocess

    from tests.experiments.remote_store.test_characterization import make_inv
    from xstage_lab.experiments import harness, module_name
    from xstage_lab.platform import SAFE_ENV

    monkeypatch.setattr("xstage_lab.platform.inventory", lambda: make_inv(8))
    ran = []

    def fake_run(cmd, env, capture_output, text):
        ran.append((cmd, env))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def fake_import(out, experiment, root, resolution):
        assert resolution == {}
        return root / experiment / "h200-x8" / f"{Path(out).name}-{len(ran)}.parquet"

    monkeypatch.setattr(launch.subprocess, "run", fake_run)
    monkeypatch.setattr(launch, "import_bench_json", fake_import)
    monkeypatch.setattr(harness, "run", lambda *a: pytest.fail("ran in process"))
    paths = launch.measure_all(root=tmp_path, only=["fa_a2a", "moe", "moe_trace"])
    assert [p.parent.parent.name for p in paths] == ["fa_a2a", "moe", "moe_trace"]
    for (cmd, env), name in zip(ran, ["fa_a2a", "moe", "moe_trace"]):
        out = cmd.index("--out")
        assert cmd[1:out - 2] == ["-m", "torch.distributed.run", "--standalone",
                                  "--nproc_per_node=8"]
        assert cmd[out - 2:out] == ["-m", module_name(name)]
        assert all(env[k] == v for k, v in SAFE_ENV.items())
        tail = cmd[out + 2:]
        assert tail[0] == "--no-progress"
        if name == "moe":
            from xstage_lab.experiments.moe.bench import MOE_MATRIX
            assert tail[1:] == ["--matrix", str(MOE_MATRIX)]
        elif name == "moe_trace":
            assert tail[1:] == ["--regressions", str(paths[1])]
        else:
            assert tail[1:] == []


def test_in_process_experiments_write_their_record_and_what_derives_from_it(tmp_path,
                                                                            monkeypatch):
    """An in-process experiment runs in this process through the harness, writing its record
    under the root; the records derived from it (the calibration) follow it."""
    from xstage_lab.experiments import experiment, harness

    runs = []

    def fake_run(exp, args):
        runs.append((exp.name, args.root, args.out))
        return tmp_path / exp.name / "new.parquet"

    monkeypatch.setattr(harness, "run", fake_run)
    exp = experiment("remote_store")
    monkeypatch.setattr(type(exp), "derived",
                        lambda self, path, root: [root / "calibration" / f"from-{path.name}"])
    monkeypatch.setattr("xstage_lab.platform.inventory", lambda: inv(2, "all", maps_host=False))
    paths = launch.measure_all(root=tmp_path, only=["remote_store"])
    assert runs == [("remote_store", tmp_path, None)]
    assert paths == [tmp_path / "remote_store" / "new.parquet",
                     tmp_path / "calibration" / "from-new.parquet"]


# ------------------------------------------------- the backend per experiment and link (issue 26)

def _live(steps) -> list[tuple[str, str]]:
    return [(s.name, s.link) for s in steps if s.live]


def test_the_plan_per_inventory():
    """No GPU: everything replays. One GPU: ``auto`` measures the host link's experiments live
    (characterization, then the MoE matrix) and replays the rest; ``cuda`` the one-GPU ones too.
    Two peer-capable GPUs: every experiment over every link, live."""
    names = measure_all_names()
    every = [(n, link) for n in names for link in experiment(n).links]
    assert {link for _, link in every} == {"nvlink", "host", "local"}
    assert _live(launch.plan("auto", inv=inv(0))) == []
    with pytest.raises(RuntimeError, match="needs a GPU"):
        launch.plan("cuda", inv=inv(0))
    host = [("remote_store", "host"), ("moe_host", "host")]
    assert _live(launch.plan("auto", inv=inv(1))) == host
    assert _live(launch.plan("cuda", inv=inv(1))) == [("remote_store", "host"),
                                                      ("moe_kernel", "local"), ("moe_host", "host"),
                                                      ("moe_layer", "local")]
    assert _live(launch.plan("auto", inv=inv(1, maps_host=False))) == []
    for backend in ("auto", "cuda"):
        assert _live(launch.plan(backend, inv=inv(2, "all"))) == every
    assert _live(launch.plan("replay", inv=inv(2, "all"))) == []
    lines = launch.plan_lines(launch.plan("auto", inv=inv(1)))
    assert lines[0].startswith("replayed: remote_store over nvlink, visibility over nvlink, ")
    assert lines[1].startswith("measured live: remote_store over host, moe_host over host ")


def test_one_gpu_measures_the_host_link_with_its_forecast_first(tmp_path, monkeypatch, capsys):
    """``measure`` on one GPU under ``auto``: remote_store over the host link only (its
    calibration derived after it), moe_host after its forecast (``Experiment.before``); NVLink
    nothing. ``measure-all`` runs what one GPU can, in the registry's order, and says what not;
    an ``--only`` that this machine cannot run is refused before any launch."""
    from xstage_lab.experiments import harness

    monkeypatch.setattr("xstage_lab.platform.inventory", lambda: inv(1))
    monkeypatch.setattr("xstage_lab.platform.platform_name",
                        lambda inv=None, link="nvlink": "h200-x1" + ("-host" if link == "host" else ""))
    written = []

    def fake_run(exp, args):
        written.append((exp.name, getattr(args, "link", None), getattr(args, "repeats", None)))
        return tmp_path / exp.name / "new.parquet"

    def forecast(kernel_platform, host_platform, tokens, root):
        written.append(("moe_host_forecast", kernel_platform, host_platform, tokens))
        return root / "moe_host_forecast" / "new.parquet"

    monkeypatch.setattr(harness, "run", fake_run)
    monkeypatch.setattr("xstage_lab.experiments.moe.host_forecast.write", forecast)
    monkeypatch.setattr(type(experiment("remote_store")), "derived",
                        lambda self, path, root: [root / "calibration" / "new.parquet"])
    monkeypatch.setattr(type(experiment("moe_kernel")), "derived", lambda self, path, root: [])
    with pytest.raises(ValueError, match="no moe_kernel record of h200-x1: measure it first"):
        launch.measure("moe_host", "auto", tmp_path)
    (tmp_path / "moe_kernel" / "h200-x1").mkdir(parents=True)
    (tmp_path / "moe_kernel" / "h200-x1" / "20260101T000000Z-a.parquet").touch()
    assert launch.measure("fa_a2a", "auto", tmp_path) == []
    assert launch.measure("remote_store", "auto", tmp_path) == [
        tmp_path / "remote_store" / "new.parquet", tmp_path / "calibration" / "new.parquet"]
    assert launch.measure("moe_host", "auto", tmp_path) == [
        tmp_path / "moe_host_forecast" / "new.parquet", tmp_path / "moe_host" / "new.parquet"]
    assert launch.measure("moe_kernel", "auto", tmp_path) == []
    assert written == [("remote_store", "host", 7),
                       ("moe_host_forecast", "h200-x1", "h200-x1-host", 4096),
                       ("moe_host", None, None)]
    assert capsys.readouterr().out == ""
    launch.measure("fa_a2a", "cuda", tmp_path)  # says why it replays
    assert capsys.readouterr().out.startswith("replayed: fa_a2a over nvlink (the nvlink link needs "
                                              "two peer-capable GPUs; this machine has 1 GPU(s)")

    written.clear()
    launch.measure_all(root=tmp_path)
    assert [w[0] for w in written] == ["remote_store", "moe_kernel", "moe_host_forecast",
                                       "moe_host", "moe_layer"]
    assert capsys.readouterr().out.startswith("not measured here: remote_store over nvlink, "
                                              "visibility over nvlink, ")
    with pytest.raises(ValueError, match="fa_a2a cannot run here: the nvlink link needs two "
                                         "peer-capable GPUs"):
        launch.measure_all(root=tmp_path, only=["moe_kernel", "fa_a2a"])


def test_every_experiment_measure_all_runs_is_measured_by_the_notebook_that_draws_it():
    """``reproduce`` measures what ``measure-all`` does: each of its experiments is measured by a
    notebook, ``measure("name", backend...)`` or a loop ``for name in (...): measure(name,
    backend...)``, and none other."""
    import re

    import nbformat

    from xstage_lab.runner import notebooks

    measured = set()
    for nb in notebooks():
        for cell in nbformat.read(nb, as_version=4).cells:
            if cell.cell_type != "code":
                continue
            measured |= set(re.findall(r'measure\("(\w+)", backend', cell.source))
            for names in re.findall(r'for name in \(([^)]*)\):[^\n]*\n\s+measure\(name, backend',
                                    cell.source):
                measured |= set(re.findall(r'"(\w+)"', names))
    assert measured == set(measure_all_names())
