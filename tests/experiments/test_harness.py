"""The experiment contract and its harness (``experiments/harness.py``), with a toy in-process
experiment: options checked before a launch, every point validated first, a point checked before
it is timed, a failure anywhere stopping the run with no output, one header shape whichever the
sink."""
import json
import math
from dataclasses import dataclass

import pandas as pd
import pytest

from xstage_lab.experiments import harness
from xstage_lab.experiments.harness import Experiment, Run
from xstage_lab.records import import_bench_json, read_record
from xstage_lab.sweep import Axis, Sweep

PROV = {"gpu_name": "NVIDIA H200", "gpu_count": 1, "date_utc": "2026-12-01T09:00:00+00:00"}


@pytest.fixture(autouse=True)
def fixed_provenance(monkeypatch):
    monkeypatch.setattr("xstage_lab.platform.provenance", lambda inv=None: dict(PROV))


@dataclass
class State:
    point: dict
    out: list
    spin_errors: int = 0  # as a kernel's spin-timeout flag: counts every launch's, never reset
    timed: int = 0
    broken: bool = False


class Toy(Experiment):
    """Squares ``n`` into a poisoned buffer; ``--wrong-at N`` makes the result at N wrong,
    ``--spin-error-at N`` one timed run at N report a spin error, ``--broken-at N`` the last timed
    run at N leave the point computing wrong results."""

    name = "toy"
    paper = "a test"
    launch = "in_process"

    def __init__(self):
        self.log = []

    def add_arguments(self, p):
        p.add_argument("--wrong-at", type=int, default=None)
        p.add_argument("--invalid-at", type=int, default=None)
        p.add_argument("--ns", default="1,2,3")
        p.add_argument("--spin-error-at", type=int, default=None)
        p.add_argument("--broken-at", type=int, default=None)

    def check_args(self, a):
        a.ns = [int(n) for n in a.ns.split(",")]
        if min(a.ns) < 1:
            raise ValueError("--ns must be >= 1")

    def sweeps(self, a):
        return [Sweep("squares", (Axis("n", a.ns),), fixed={"kind": "square"}, repeats=2,
                      warmup=1),
                Sweep("cubes", (Axis("n", [2]),), repeats=1, warmup=0)]

    def validate(self, point, run):
        self.log.append(("validate", point["n"]))
        if point["n"] == run.args.invalid_at:
            raise ValueError(f"n = {point['n']} is not possible here")

    def prepare(self, point, run):
        self.log.append(("prepare", point["n"]))
        return State(point, [math.nan])

    def _compute(self, state, run):
        n = state.point["n"]
        state.out[0] = n * n + (1 if n == run.args.wrong_at or state.broken else 0)

    def check(self, state, run):
        self.log.append(("check", state.point["n"]))
        state.out[0] = math.nan
        self._compute(state, run)
        failures = [] if state.out[0] == state.point["n"] ** 2 else [f"got {state.out[0]}"]
        return failures + ([f"spin errors {state.spin_errors}"] if state.spin_errors else [])

    def measure(self, state, run):
        self.log.append(("measure", state.point["n"]))
        n, a = state.point["n"], run.args
        self._compute(state, run)
        state.timed += 1
        state.spin_errors += n == a.spin_error_at and state.timed == 2
        state.broken |= n == a.broken_at and state.timed == 1 + 2  # warm-up + repeats
        return {"value": state.out[0], "trials_us": [1.0, 2.0]}

    def metadata(self, run):
        return {"ns": run.args.ns}


def run_toy(argv, toy=None):
    toy = toy or Toy()
    return toy, harness.run(toy, harness.parse(toy, [*argv, "--no-progress"]))


def test_json_output_has_the_one_header_and_tagged_rows(tmp_path):
    out = tmp_path / "toy.json"
    toy, written = run_toy(["--out", str(out)])
    assert written == out
    doc = json.loads(out.read_text())
    meta, rows = doc["metadata"], doc["rows"]
    assert list(meta) == ["experiment", "paper", "sweeps", "chunk", "world_size", "ns",
                          "sm_clock_mhz_start", "sm_clock_mhz_end", "sm_clock_unread", "wall_s",
                          "provenance"]
    assert meta["experiment"] == "toy" and meta["world_size"] == 1 and meta["chunk"] is None
    assert [s["name"] for s in meta["sweeps"]] == ["squares", "cubes"]
    assert meta["provenance"] == PROV
    # 3 points x 2 repeats, then 1 point x 1
    assert len(rows) == 7
    assert [(r["sweep"], r["n"], r["value"]) for r in rows if r["repeat"] == 0][:3] == [
        ("squares", 1, 1), ("squares", 2, 4), ("squares", 3, 9)]
    assert rows[-1]["sweep"] == "cubes" and rows[-1]["value"] == 4
    assert all(r["trials_us"] == [1.0, 2.0] for r in rows)
    assert {r["kind"] for r in rows if r["sweep"] == "squares"} == {"square"}


def test_order_of_calls_validate_all_then_prepare_check_warm_measure():
    toy, _ = run_toy(["--out", "/dev/null"])
    kinds = [k for k, _ in toy.log]
    assert kinds[:4] == ["validate"] * 4  # every point of both sweeps before any launch
    # each point is prepared and checked before its warm-up and its repeats, checked again after
    for n in (1, 3):
        mine = [k for k, m in toy.log[4:] if m == n and k != "validate"]
        assert mine == ["prepare", "check", "measure", "measure", "measure", "check"]
    assert sum(1 for e in toy.log if e == ("prepare", 2)) == 2  # once per sweep holding n = 2
    assert sum(1 for e in toy.log if e == ("measure", 1)) == 1 + 2  # warm-up + repeats


def test_a_failing_check_stops_before_timing_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "toy.json"
    toy = Toy()
    with pytest.raises(SystemExit, match="correctness failed"):
        run_toy(["--out", str(out), "--wrong-at", "2"], toy)
    assert not out.exists()
    assert ("check", 2) in toy.log and ("measure", 2) not in toy.log
    assert "got 5" in capsys.readouterr().err


@pytest.mark.parametrize("fault, says", [("--spin-error-at", "spin errors 1"),
                                         ("--broken-at", "got 5")])
def test_a_point_the_timed_runs_leave_wrong_stops_the_run_with_nothing_written(
        tmp_path, capsys, fault, says):
    """A spin error in a timed run, or a result the last timed run leaves wrong, is found by the
    check after the point's last repeat (the run's fourth of six): the run stops there, nothing
    written."""
    out = tmp_path / "toy.json"
    toy = Toy()
    with pytest.raises(SystemExit, match="correctness failed for .*n=2.* after timing"):
        run_toy(["--out", str(out), fault, "2"], toy)
    assert not list(tmp_path.iterdir())
    assert toy.log[-1] == ("check", 2) and toy.log.count(("measure", 1)) == 1 + 1
    assert says in capsys.readouterr().err


def test_a_clock_that_cannot_be_read_is_in_the_header_with_its_reason(tmp_path, monkeypatch,
                                                                       capsys):
    import torch

    def unreadable(device=None):
        raise ModuleNotFoundError("no pynvml here")

    monkeypatch.setattr(torch.cuda, "clock_rate", unreadable)
    out = tmp_path / "toy.json"
    run_toy(["--out", str(out)])
    meta = json.loads(out.read_text())["metadata"]
    assert meta["sm_clock_mhz_start"] == meta["sm_clock_mhz_end"] == [None]
    assert meta["sm_clock_unread"] == ["ModuleNotFoundError: no pynvml here"]
    assert capsys.readouterr().err.count("SM clock not read") == 1  # once per run
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device=None: 1980)
    run_toy(["--out", str(out)])
    meta = json.loads(out.read_text())["metadata"]
    assert meta["sm_clock_mhz_start"] == [1980] and meta["sm_clock_unread"] == [None]
    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device=None: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # a bug is not an unreadable clock
        run_toy(["--out", str(out)])


def test_an_invalid_point_stops_before_any_launch(tmp_path):
    toy = Toy()
    with pytest.raises(ValueError, match="n = 3 is not possible"):
        run_toy(["--out", str(tmp_path / "t.json"), "--invalid-at", "3"], toy)
    assert all(k == "validate" for k, _ in toy.log)


@pytest.mark.parametrize("argv", [["--ns", "0,1"], ["--chunk", "2/2"], ["--chunk", "x"], []])
def test_bad_options_exit_2_before_anything_runs(argv, capsys):
    toy = Toy()
    with pytest.raises(SystemExit) as e:
        harness.parse(toy, ["--out", "t.json", *argv] if argv else [])
    assert e.value.code == 2 and toy.log == []
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_commit_named_wrong_exits_2_before_anything_runs(tmp_path, monkeypatch, capsys):
    """A record names the commit it was measured at: a value of XSTAGE_GIT_COMMIT that is no
    commit's hash stops the run before any point is validated or launched, nothing written."""
    monkeypatch.setenv("XSTAGE_GIT_COMMIT", "7444daf-UNKNOWN")
    toy = Toy()
    with pytest.raises(SystemExit) as e:
        run_toy(["--out", str(tmp_path / "t.json")], toy)
    assert e.value.code == 2 and toy.log == [] and not (tmp_path / "t.json").exists()
    assert "XSTAGE_GIT_COMMIT='7444daf-UNKNOWN'" in capsys.readouterr().err


def test_record_sink_keeps_the_same_header_as_import_bench(tmp_path):
    _, path = run_toy(["--root", str(tmp_path / "direct")])
    direct = read_record(path)
    out = tmp_path / "toy.json"
    run_toy(["--out", str(out)])
    imported = read_record(import_bench_json(out, "toy", root=tmp_path / "imported"))
    assert direct.platform == imported.platform == "h200-x1"
    assert direct.provenance == imported.provenance == PROV
    drop = {"wall_s"}
    assert ({k: v for k, v in direct.params.items() if k not in drop}
            == {k: v for k, v in imported.params.items() if k not in drop})
    pd.testing.assert_frame_equal(direct.table, imported.table, check_dtype=False)
    assert json.loads(direct.table["trials_us"][0]) == [1.0, 2.0]


def test_record_name_is_the_experiments_choice(tmp_path):
    class Partial(Toy):
        def record_name(self, args):
            return "toy_partial"

    _, path = run_toy(["--root", str(tmp_path)], Partial())
    assert read_record(path).meta["experiment"] == "toy_partial"
    assert path.parent.parent.name == "toy_partial"


def test_chunks_split_the_points_of_all_sweeps_in_order():
    sweeps = Toy().sweeps(harness.parse(Toy(), ["--out", "x"]))  # 3 + 1 points
    assert harness.chunk_indices(sweeps, None) == [[0, 1, 2], [0]]
    parts = [harness.chunk_indices(sweeps, (i, 2)) for i in range(2)]
    assert parts == [[[0, 1], []], [[2], [0]]]


def test_a_chunk_runs_only_its_points(tmp_path):
    out = tmp_path / "c.json"
    run_toy(["--out", str(out), "--chunk", "1/2"])
    doc = json.loads(out.read_text())
    assert doc["metadata"]["chunk"] == "1/2"
    assert sorted({(r["sweep"], r["n"]) for r in doc["rows"]}) == [("cubes", 2), ("squares", 3)]


def test_per_gpu_experiment_outside_torchrun_is_refused(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)

    class Spmd(Toy):
        launch = "per_gpu"

    toy = Spmd()
    with pytest.raises(SystemExit, match="torchrun"):
        harness.run(toy, harness.parse(toy, ["--out", "x.json"]))
    assert toy.log == []


def test_run_require_and_resource():
    run = Run(args=None)
    run.require([], "fine")
    with pytest.raises(SystemExit, match="for w"):
        run.require(["broken"], "w")
    made = []
    a = run.resource(("m", "bf16"), lambda: made.append(1) or "A")
    assert run.resource(("m", "bf16"), lambda: made.append(2) or "B") == a == "A"
    assert run.resource(("m", "fp8"), lambda: made.append(3) or "C") == "C"
    assert made == [1, 3]


def test_every_experiment_module_is_a_command_named_by_its_module():
    """``python -m <module> --help`` of a registered experiment: usage under the module's name
    (not ``__main__``), described by its docstring, with the harness's sinks."""
    import subprocess
    import sys

    from xstage_lab.experiments import module_name

    module = module_name("moe")
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith(f"usage: python -m {module} ")
    assert "(--out OUT | --root ROOT)" in out and "--chunk I/N" in out
    assert "SPMD benchmark of the fused MoE kernel" in out


def test_the_registry_names_each_experiment_by_its_record():
    from xstage_lab.experiments import EXPERIMENTS, experiment, measure_all_names

    assert set(measure_all_names()) <= set(EXPERIMENTS)
    for name in EXPERIMENTS:
        exp = experiment(name)
        assert isinstance(exp, Experiment) and exp.name == name
        assert exp.launch in ("in_process", "per_gpu")
    with pytest.raises(ValueError, match="unknown experiment"):
        experiment("nonsense")
