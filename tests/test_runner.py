"""``reproduce``'s plan and index (issue 26): per experiment and link, what the notebooks measure
live on this machine and what they replay, and per figure the link and backend that drew it; the
notebooks stand in, as papermill's stub."""
import json

import pytest

from tests.test_platform import inv
from xstage_lab import runner

HOST_LIVE = {"platform": "h200-x1-host", "link": "host", "backend": "cuda"}
NVLINK_REPLAYED = {"platform": "h200-x2", "link": "nvlink", "backend": "replay"}


@pytest.fixture
def stub_notebooks(monkeypatch):
    """papermill runs no notebook: each call is recorded and publishes one figure drawn from the
    host link's live record and NVLink's committed one."""
    import papermill

    calls = []

    def execute(src, dst, parameters, **kw):
        calls.append((src, parameters))
        entry = {"kind": "figure", "name": "fig", "title": "a figure", "caption": "c",
                 "files": ["fig.html"], "drawn": [HOST_LIVE, NVLINK_REPLAYED]}
        with open(f"{parameters['out_dir']}/manifest.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")
        open(dst, "w").write("{}")

    monkeypatch.setattr(papermill, "execute_notebook", execute)
    return calls


def test_one_gpu_plan_measures_the_host_link_live_and_the_index_says_so(
        stub_notebooks, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("xstage_lab.platform.inventory", lambda: inv(1))
    assert runner.reproduce(backend="auto", out=tmp_path) == 0
    out = capsys.readouterr().out
    assert "\nmeasured live: remote_store over host, moe_host over host (measuring live over " \
           "host: 1 GPU(s), 1 peer-capable)\n" in out
    assert "replayed: remote_store over nvlink, visibility over nvlink, remote_patterns over " \
           "nvlink, remote_ops over nvlink, fa_a2a over nvlink, moe over nvlink, moe_trace over " \
           "nvlink, fa_trace over nvlink (the nvlink link needs two peer-capable GPUs" in out
    assert "replayed: moe_kernel on one GPU, moe_layer on one GPU (no two peer-capable GPUs" in out
    # every notebook resolves auto itself, per experiment and link
    assert [p["backend"] for _, p in stub_notebooks] == ["auto"] * len(runner.notebooks())
    index = (tmp_path / "index.html").read_text()
    assert "<p>Backend auto: per experiment and link" in index
    assert "<li>measured live: remote_store over host, moe_host over host" in index
    assert ('<p class="drawn">drawn by host link, measured live (cuda): h200-x1-host; NVLink, '
            'replayed: h200-x2</p>') in index


def test_where_nothing_is_live_the_notebooks_replay(stub_notebooks, monkeypatch, tmp_path):
    monkeypatch.setattr("xstage_lab.platform.inventory", lambda: inv(0))
    assert runner.reproduce(backend="auto", out=tmp_path, only=["remote_store_characterization"]) == 0
    assert [p["backend"] for _, p in stub_notebooks] == ["replay"]
    assert "<li>replayed: remote_store over nvlink, remote_store over host, " in \
        (tmp_path / "index.html").read_text()


def test_cuda_on_one_gpu_measures_what_one_gpu_can(stub_notebooks, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("xstage_lab.platform.inventory", lambda: inv(1))
    assert runner.reproduce(backend="cuda", out=tmp_path, only=["remote_store_characterization"]) == 0
    out = capsys.readouterr().out
    assert "measured live: moe_kernel on one GPU, moe_layer on one GPU (measuring live on one GPU, no link" in out
    assert "replayed: remote_store over nvlink, " in out
    assert [p["backend"] for _, p in stub_notebooks] == ["cuda"]


def test_drawn_line_groups_platforms_by_link_and_backend():
    local = {"platform": "h200-x1", "link": "local", "backend": "replay"}
    assert runner.drawn_line([NVLINK_REPLAYED, HOST_LIVE, local, NVLINK_REPLAYED]) == (
        "NVLink, replayed: h200-x2; host link, measured live (cuda): h200-x1-host; "
        "one GPU, no link, replayed: h200-x1")
    assert runner.drawn_line([]) == ""
