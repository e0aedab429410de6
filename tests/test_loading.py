"""``xstage_lab.load``: one loader, one return shape, the backend chosen in one place."""
import pytest

from xstage_lab import Loaded, load, loading
from xstage_lab.analysis.moe.kernel_view import KernelView
from xstage_lab.experiments.remote_store.characterization import Characterization
from xstage_lab.platform import BackendChoice
from xstage_lab.records import list_records, platforms, read_record


@pytest.mark.parametrize("experiment", ["remote_store", "visibility", "remote_patterns",
                                        "remote_ops", "fa_a2a", "moe", "moe_trace", "moe_kernel",
                                        "moe_forecast", "calibration"])
def test_replay_gives_one_view_per_platform_in_platform_order(experiment):
    loaded = load(experiment, backend="replay")
    assert isinstance(loaded, Loaded) and loaded.choice.name == "replay"
    assert len(loaded) == len(platforms(experiment)) >= 1
    records = loaded.records
    assert {r.meta["experiment"] for r in records} == {experiment}
    assert sorted({r.platform for r in records}) == platforms(experiment)


def test_views_are_the_experiments_analyses():
    assert isinstance(load("remote_store", "h200-x2", "replay")[0], Characterization)
    [kernels] = load("moe_kernel", backend="replay")
    assert isinstance(kernels, KernelView) and kernels.platform == "h200-x1"
    fa = load("fa_a2a", ["h200-x2"], "replay")
    assert fa.records == list(fa)  # a record is its own view


def test_a_named_record_is_read_instead_of_the_latest():
    oldest = read_record(list_records("fa_a2a", "h200-x2")[0])
    [rec] = load("fa_a2a", "h200-x2", "replay", record=oldest.record_id)
    assert rec.record_id == oldest.record_id
    with pytest.raises(ValueError, match="no single record"):
        load("moe_kernel", "h200-x1", "replay", record="x")


def test_missing_records(tmp_path):
    with pytest.raises(FileNotFoundError):
        load("fa_a2a", backend="replay", root=tmp_path)
    assert len(load("visibility", backend="replay", root=tmp_path)) == 0


def test_cuda_measures_once_and_reads_the_new_record(monkeypatch, tmp_path):
    """Live: the backend is chosen once, the measurement writes one record, its view comes back;
    computed experiments are read whatever the backend."""
    path = list_records("remote_store", "h200-x2")[-1]
    chosen = []

    def choose(requested):
        chosen.append(requested)
        return BackendChoice("cuda" if requested != "replay" else "replay", requested, "test")

    monkeypatch.setattr(loading, "choose_backend", choose)
    monkeypatch.setattr("xstage_lab.launch.live_record",
                        lambda e: None if e == "moe_forecast" else (lambda root: path))
    [c] = load("remote_store", backend="auto", root=tmp_path)
    assert isinstance(c, Characterization) and c.record.path == path
    assert load("moe_forecast", backend="cuda").choice.name == "replay"
    assert chosen == ["auto", "replay"]
