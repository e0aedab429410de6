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
    assert isinstance(loaded, Loaded) and {c.name for _, c in loaded.choices} == {"replay"}
    assert {d["backend"] for d in loaded.drawn()} == {"replay"}
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


def test_cuda_reads_this_machine_s_latest_record_and_never_measures(monkeypatch, tmp_path):
    """Live: the backend is chosen once per link; ``load`` reads the latest record of this
    machine's platform for each link (what ``launch.measure`` wrote) and measures nothing;
    computed experiments are read whatever the backend."""
    chosen = []

    def choose(requested, inv=None, link="nvlink"):
        chosen.append((requested, link))
        return BackendChoice("cuda" if requested != "replay" else "replay", requested, "test")

    def no_measurement(*a, **k):
        raise AssertionError("load measured")

    monkeypatch.setattr(loading, "choose_backend", choose)
    monkeypatch.setattr("xstage_lab.platform.platform_name",
                        lambda inv=None, link="nvlink": "h200-x1-host" if link == "host" else "h200-x2")
    monkeypatch.setattr("xstage_lab.launch.run_live", no_measurement)
    host, nvlink = load("remote_store", backend="auto")
    assert isinstance(nvlink, Characterization)
    assert nvlink.record.path == list_records("remote_store", "h200-x2")[-1]
    assert host.record.path == list_records("remote_store", "h200-x1-host")[-1]
    assert {c.name for _, c in load("moe_forecast", backend="cuda").choices} == {"replay"}
    assert chosen == [("auto", "nvlink"), ("auto", "host"), ("replay", "nvlink"),
                      ("replay", "host")]


def test_one_gpu_reads_the_host_link_live_and_replays_nvlink(monkeypatch, tmp_path):
    """On one GPU, ``auto``: the host link's view is this machine's platform (measured live),
    NVLink's the committed platforms; each view says its link and backend (``drawn``), the
    banner both; ``link`` reads one link, none where it has no records."""
    from tests.test_platform import inv

    monkeypatch.setattr("xstage_lab.platform.inventory", lambda: inv(1))
    loaded = load("remote_store", backend="auto")
    assert loaded.platforms == ("h200-x1-host", "h200-x2")
    assert loaded.drawn() == [
        {"platform": "h200-x1-host", "link": "host", "backend": "cuda"},
        {"platform": "h200-x2", "link": "nvlink", "backend": "replay"}]
    assert loaded.drawn(loaded[1]) == loaded.drawn("h200-x2") == loaded.drawn()[1:]
    assert loaded.banner().startswith("nvlink: backend: replay (requested auto; the nvlink link "
                                      "needs two peer-capable GPUs")
    assert "host: backend: cuda (requested auto; measuring live over host" in loaded.banner()
    [host] = load("remote_store", backend="auto", link="host")
    assert host.record.platform == "h200-x1-host"
    assert [d["link"] for d in load("moe_kernel", backend="auto").drawn()] == ["local"]
    assert len(load("remote_store", backend="replay", root=tmp_path, link="host")) == 0
    with pytest.raises(ValueError, match="is measured over \\['host'\\], not 'nvlink'"):
        load("moe_host", link="nvlink")


def test_measure_runs_live_only_under_cuda(monkeypatch, tmp_path):
    """``launch.measure``: nothing under replay; under cuda the experiment with the options
    measure-all passes it."""
    from xstage_lab import launch

    from tests.test_platform import inv

    runs = []
    monkeypatch.setattr(launch, "run_live", lambda name, root, args: runs.append((name, args))
                        or [root / "new.parquet"])
    monkeypatch.setattr("xstage_lab.platform.inventory", lambda: inv(2, "all"))
    assert launch.measure("moe", "replay", tmp_path) == [] and runs == []
    assert launch.measure("moe", "cuda", tmp_path) == [tmp_path / "new.parquet"]
    assert runs[0][0] == "moe" and runs[0][1][0] == "--matrix"
