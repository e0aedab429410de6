"""README "Adding an experiment": an experiment registered in one place (``EXPERIMENTS``) is
run by ``python -m xstage_lab run``, listed and run by ``measure-all`` with the options it
declares, read by ``load`` through its own view and shown by ``summary``."""
import pytest

from tests.experiments.remote_store.test_characterization import fake_machine
from xstage_lab import launch, load
from xstage_lab.__main__ import main
from xstage_lab.experiments import EXPERIMENTS, is_optional, measure_all_names


@pytest.fixture
def toy(monkeypatch):
    """The toy experiment registered (the one line an experiment adds), on a one-GPU machine."""
    from xstage_lab.experiments.remote_store import characterization

    monkeypatch.setitem(EXPERIMENTS, "toy", "tests.experiments.toy_experiment:EXPERIMENT")
    fake_machine(monkeypatch, characterization, 1)


def test_a_registered_experiment_runs_is_measured_by_measure_all_loads_and_summarises(
        toy, tmp_path, monkeypatch, capsys):
    from tests.experiments.toy_experiment import ToyView
    from xstage_lab.summary import summary

    assert main(["run", "--root", str(tmp_path), "toy", "--points", "4"]) == 0
    [loaded] = load("toy", backend="replay", root=tmp_path)
    assert isinstance(loaded, ToyView) and loaded.total == 0 + 1 + 2 + 3

    assert measure_all_names()[-1] == "toy" and is_optional("toy")
    assert len(load("toy", backend="replay", root=tmp_path / "none")) == 0  # optional
    from tests.test_platform import inv

    monkeypatch.setattr("xstage_lab.platform.inventory", lambda: inv(1))  # one GPU: its own
    root = tmp_path / "measure-all"
    [path] = launch.measure_all(root=root, only=["toy"])
    [loaded] = load("toy", backend="replay", root=root)
    assert loaded.record.path == path and loaded.total == 0 + 1  # --points 2, as declared

    entry = summary(root)["platforms"][loaded.record.platform]["toy"]
    assert entry == {"total": 1.0, "source_record": loaded.record.record_id}


def test_run_checks_the_experiment_s_options_with_its_own_parser(toy, capsys):
    assert main(["run", "toy", "--points", "0"]) == 2
    assert "--points must be >= 1" in capsys.readouterr().err
