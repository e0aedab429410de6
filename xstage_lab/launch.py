"""Live runs on this machine's GPUs, each writing a record through ``experiments.harness``: in
process, or one process per GPU under torchrun, whose JSON output becomes a record.
``measure-all`` runs every experiment the registry lists for it; ``measure`` runs one, with the
same options, where the backend is ``cuda`` (a notebook calls it, then ``load``s)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .experiments import experiment, measure_all_names, module_name
from .platform import SAFE_ENV
from .records import RECORDS_DIR, import_bench_json


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


def run_live(name: str, root: Path = RECORDS_DIR, args: list[str] = (),
             derived: bool = True) -> list[Path]:
    """Experiment ``name`` on this machine's GPUs, with its command-line ``args``: its record,
    then (``derived``) the records derived from it (``Experiment.derived``)."""
    from .experiments import harness
    from .platform import inventory

    exp = experiment(name)
    if exp.launch == "in_process":
        path = harness.run(exp, harness.parse(exp, ["--root", str(root), *args]))
    else:
        path = torchrun_record(name, inventory().peer_capable_gpus, args, root)
    return [path, *(exp.derived(path, root) if derived else [])]


def measure(name: str, backend: str = "auto", root: Path | str | None = None) -> list[Path]:
    """Where ``backend`` resolves to ``cuda`` (``platform.choose_backend``), experiment ``name``
    measured live on this machine with the options ``measure-all`` passes it
    (``Experiment.measure_all_args``): its new record and those derived from it; elsewhere
    nothing (``[]``). A notebook calls it before ``load(name, backend=backend)``, which then
    reads the new record."""
    from .platform import choose_backend

    if choose_backend(backend).name != "cuda":
        return []
    root = RECORDS_DIR if root is None else Path(root)
    return run_live(name, root, experiment(name).measure_all_args({}, root))


def measure_all(root: Path = RECORDS_DIR, only: list[str] | None = None) -> list[Path]:
    """Every experiment ``measure-all`` runs (or those named in ``only``) live on this machine's
    GPUs, in one go, in the registry's order, each with its ``measure_all_args``. Returns the
    records written."""
    from .platform import choose_backend

    known = measure_all_names()
    names = known if only is None else list(only)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"unknown measurements {unknown}; known: {known}")
    choose_backend("cuda")  # raises without two peer-capable GPUs
    paths, written = [], {}
    for name in names:
        new = run_live(name, root, experiment(name).measure_all_args(written, root))
        written[name] = new[0]
        paths.extend(new)
    return paths
