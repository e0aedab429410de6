"""Every registered experiment's entry point on one GPU (issue 28; skipped where torch sees no CUDA
GPU: CI has none). Each experiment that one GPU can run (over the host link, or on the GPU alone)
runs as ``python -m xstage_lab run NAME`` with its smallest options into a scratch records root,
and every record it writes is read by ``loading.load``, with rows; each that needs two
peer-capable GPUs is refused in one line, exit code 2, with nothing written. Every command sees
one GPU, the first visible. 97 s on one H200 (2026-12-02), most of it the kernels' first compiles.

    PYTHONPATH=$PWD python3 -m pytest -q tests/test_entry_points_gpu.py
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from xstage_lab.experiments import EXPERIMENTS, experiment
from xstage_lab.kernel_sources import kernel_path
from xstage_lab.loading import load, record_paths
from xstage_lab.platform import SAFE_ENV

REPO = Path(__file__).resolve().parent.parent
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Every command: the first visible GPU alone, NVLink multicast off, this checkout's package.
ENV = {**os.environ, **SAFE_ENV,
       "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
       "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


@dataclass(frozen=True)
class Live:
    """A small live run over ``link``: ``run NAME`` with ``options``. ``record``: the record it
    writes (None: the experiment's name); ``after``: the experiments whose records it reads, run
    first."""

    link: str
    options: tuple[str, ...]
    record: str | None = None
    after: tuple[str, ...] = ()


# One MoE cell: the smallest model, one precision, one routing.
MOE_CELL = ("--models", "DiT-MoE", "--precisions", "bf16", "--routing", "balanced",
            "--tokens", "256")
TIMING = ("--trials", "2", "--graph-iters", "1")

LIVE = {
    # 4 points; a run without the calibration's sweeps is saved as remote_store_partial
    "remote_store": Live("host", ("--link", "host", "--repeats", "1", "--only", "lines"),
                         record="remote_store_partial"),
    # traced (the default): moe_host's forecast reads its per-tile times
    "moe_kernel": Live("local", (*MOE_CELL, "--warmup", "1", *TIMING)),
    "fa_tuning": Live("local", ("--seq", "1024", "--configs", "gluon_ws_128x128_s2",
                                "--trials", "2", "--iters", "1")),
    # first its forecast (Experiment.before), from moe_kernel's record of the same cell
    "moe_host": Live("host", (*MOE_CELL, "--host-shares", "1", "--lead-multiples", "1",
                              "--warmup", "1", "--no-trace", *TIMING), after=("moe_kernel",)),
    # 64 tokens: the count at which the layer's graph replays are checked too; the layer as it
    # ships (layer_view's matrix takes only PLATFORM_VARIANT's records: the in-kernel sum's is an
    # A/B's side, which load finds no matrix in)
    "moe_layer": Live("local", ("--models", "DiT-MoE", "--precisions", "bf16", "--settings", "ep1",
                                "--tokens", "64", *TIMING)),
    "issue_time_probe": Live("local", ("--repeats", "1", "--burst-kib", "16")),
    # the probe's schedules on one MoE cell
    "moe_schedule_probe": Live("local", ("--models", "DiT-MoE", "--precisions", "bf16",
                                         "--routing", "balanced", "--tokens", "256", *TIMING)),
    # both routing paths at one token, both settings, one shape
    "route_small_probe": Live("local", ("--models", "DiT-MoE", "--tokens", "1", *TIMING)),
    # the committed kernel as the variant compared with it
    "moe_gather_probe": Live("local", ("--models", "DiT-MoE", "--precisions", "bf16",
                                       "--tokens", "256", "--variant",
                                       f"copy={kernel_path('moe_fused_ws.py')}", *TIMING)),
    # every sequence on one cell
    "moe_call_probe": Live("local", ("--models", "DiT-MoE", "--precisions", "bf16", "--settings",
                                     "ep1", "--repeats", "1", "--calls", "2")),
    # two depths of one cell, the default among them
    "moe_ring_probe": Live("local", ("--models", "DiT-MoE", "--precisions", "bf16", "--settings",
                                     "ep1", "--stages", "2", "4", "--trials", "2")),
    "fa_kernel_probe": Live("local", ("--variant",
                                      f"committed={kernel_path('flash_attention_ws.py')}",
                                      "--shapes", "128:12:1024", *TIMING)),
}

# The NVLink-only experiments: ``run`` refuses each on one GPU, per_gpu or in process.
REFUSED = ("visibility", "remote_patterns", "remote_ops", "fa_a2a", "moe", "moe_trace", "fa_trace",
           "link_probe")


def test_every_registered_experiment_is_run_or_refused():
    assert not LIVE.keys() & set(REFUSED)
    assert LIVE.keys() | set(REFUSED) == EXPERIMENTS.keys()


def _xstage(*argv: str) -> list[str]:
    return [sys.executable, "-m", "xstage_lab", *argv]


def _refusal(name: str, root: Path) -> list[str]:
    return _xstage("run", "--root", str(root), name)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict:
    """Every refused experiment's command, all started at once (none reaches the GPU): name ->
    (its records root, exit code, stdout, stderr)."""
    started = {}
    for name in REFUSED:
        root = tmp_path_factory.mktemp(name)
        started[name] = root, subprocess.Popen(_refusal(name, root), env=ENV, text=True,
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    done = {}
    for name, (root, proc) in started.items():
        out, err = proc.communicate(timeout=120)
        done[name] = root, proc.returncode, out, err
    return done


@one_gpu
@pytest.mark.parametrize("name", REFUSED)
def test_needs_two_peer_gpus_and_says_so_before_any_launch(name, refusals):
    assert experiment(name).links == ("nvlink",)
    root, rc, out, err = refusals[name]
    assert rc == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("python -m xstage_lab run: error: ") and name in err, err
    assert "needs two peer-capable GPUs" in err, err
    assert out == "" and not any(root.iterdir())


@pytest.fixture(scope="module")
def platforms() -> dict[str, str]:
    """This GPU's platform per link, as its runs name their records (``platform_name``)."""
    code = ("from xstage_lab.platform import LOCAL, platform_name; "
            "print(platform_name(link='host'), platform_name(link=LOCAL))")
    host, local = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True,
                                 text=True, check=True).stdout.split()
    return {"host": host, "local": local}


@pytest.fixture(scope="module")
def root(tmp_path_factory, platforms) -> Path:
    """A scratch records root holding the committed host-link calibration of one H200 as this
    GPU's: moe_host's forecast reads one, and the characterization that writes it takes 4 min."""
    root = tmp_path_factory.mktemp("records")
    dest = root / "calibration" / platforms["host"]
    dest.mkdir(parents=True)
    shutil.copy(record_paths("calibration", "h200-x1-host")[-1], dest)
    return root


@pytest.fixture(scope="module")
def live(root):
    """``live(name)``: ``LIVE[name]`` run once, after the runs it reads; its process and the
    records it wrote."""
    done = {}

    def run(name: str):
        if name not in done:
            for first in LIVE[name].after:
                run(first)
            before = set(root.rglob("*.parquet"))
            proc = subprocess.run(_xstage("run", "--root", str(root), name, *LIVE[name].options,
                                          "--no-progress"),
                                  env=ENV, capture_output=True, text=True, timeout=300)
            done[name] = proc, sorted(set(root.rglob("*.parquet")) - before)
        return done[name]
    return run


@one_gpu
@pytest.mark.parametrize("name", LIVE)
def test_runs_small_into_records_that_load(name, live, root, platforms):
    entry = LIVE[name]
    assert entry.link in experiment(name).links
    proc, written = live(name)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (entry.record or name) in {p.parent.parent.name for p in written}, proc.stdout
    for path in written:
        assert path.parent.name == platforms[entry.link]
        loaded = load(path.parent.parent.name, platform=path.parent.name, backend="replay",
                      root=root)
        assert path.stem in {r.record_id for r in loaded.records}
        assert all(len(view.table) for view in loaded)
