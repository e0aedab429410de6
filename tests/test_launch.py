"""What measure-all hands each benchmark (``Experiment.measure_all_args``), and the names it accepts."""
from pathlib import Path

import pytest

from xstage_lab import launch
from xstage_lab.experiments import experiment


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
    monkeypatch.setattr("xstage_lab.platform.choose_backend", lambda requested: None)
    paths = launch.measure_all(root=tmp_path, only=["remote_store"])
    assert runs == [("remote_store", tmp_path, None)]
    assert paths == [tmp_path / "remote_store" / "new.parquet",
                     tmp_path / "calibration" / "from-new.parquet"]
