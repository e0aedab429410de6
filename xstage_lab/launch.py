"""Live runs on this machine's GPUs, each writing a record through ``experiments.harness``: in
process, or one process per GPU under torchrun, whose JSON output becomes a record.
``measure-all`` runs them all; ``load``'s ``cuda`` backend runs one (``live_record``)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from .experiments import MEASURE_ALL, experiment, module_name
from .platform import SAFE_ENV
from .records import RECORDS_DIR, import_bench_json

MOE_MATRIX = Path(__file__).resolve().parent.parent / "data" / "moe_matrix.json"


def torchrun_record(name: str, nproc: int, args: list[str] = (),
                    root: Path = RECORDS_DIR) -> Path:
    """Run experiment ``name``'s module under ``python -m torch.distributed.run
    --nproc_per_node=nproc`` with ``--out FILE args`` and save its output as a record; raises
    with the output on failure."""
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, **SAFE_ENV,
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "-m", module_name(name), "--out", str(out),
               "--no-progress", *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}"
                               f"\n{proc.stderr[-4000:]}")
        return import_bench_json(out, name, root, experiment(name).resolution)


def run_live(name: str, root: Path = RECORDS_DIR, args: list[str] = ()) -> list[Path]:
    """Experiment ``name`` on this machine's GPUs, with its command-line ``args``: its record,
    then the records derived from it (``Experiment.derived``)."""
    from .experiments import harness
    from .platform import inventory

    exp = experiment(name)
    if exp.launch == "in_process":
        path = harness.run(exp, harness.parse(exp, ["--root", str(root), *args]))
    else:
        path = torchrun_record(name, inventory().peer_capable_gpus, args, root)
    return [path, *exp.derived(path, root)]


def live_record(name: str) -> Callable[[Path], Path] | None:
    """How ``loading.load`` measures experiment ``name`` live: a function(root) that runs it on
    this machine's GPUs and returns its new record (the records derived from it written beside);
    None where its records come from other records."""
    if name not in MEASURE_ALL:
        return None
    return lambda root: run_live(name, root)[0]


def measurement_names() -> list[str]:
    """Every measurement ``measure_all`` runs, in its order."""
    return list(MEASURE_ALL)


def _benchmark_args(name: str, written: dict[str, Path], root: Path) -> list[str]:
    """What ``measure_all`` passes an experiment: the declared MoE matrix, the attention trace's
    repeated launches, and to the MoE trace benchmark the MoE record whose regressing cells it
    explains (the one this run wrote, else the latest of this platform under ``root``)."""
    from .platform import platform_name
    from .records import list_records

    if name == "moe":
        return ["--matrix", str(MOE_MATRIX)]
    if name == "fa_trace":
        return ["--repeat-build"]  # the state the Table 3 replays run in (notebook 04)
    if name == "moe_trace":
        moe = written.get("moe") or next(reversed(list_records("moe", platform_name(), root)), None)
        return ["--regressions", str(moe)] if moe else []
    return []


def measure_all(root: Path = RECORDS_DIR, only: list[str] | None = None) -> list[Path]:
    """Every experiment (or those named in ``only``) live on this machine's GPUs, in one go, in
    ``MEASURE_ALL``'s order: the in-process measurements, then each multi-process one on all
    peer-capable GPUs. Returns the records written."""
    from .platform import choose_backend

    names = measurement_names() if only is None else list(only)
    unknown = sorted(set(names) - set(measurement_names()))
    if unknown:
        raise ValueError(f"unknown measurements {unknown}; known: {measurement_names()}")
    choose_backend("cuda")  # raises without two peer-capable GPUs
    paths, written = [], {}
    for name in names:
        new = run_live(name, root, _benchmark_args(name, written, root))
        written[name] = new[0]
        paths.extend(new)
    return paths
