"""Live runs on this machine's GPUs, each writing a record through ``experiments.harness``: in
process, or one process per GPU under torchrun, whose JSON output becomes a record.

``plan`` gives each experiment, per link it measures over, its backend on this machine
(``platform.choose_backend``: on one GPU ``auto`` measures the host link's experiments and
replays the rest). ``measure-all`` runs every experiment the registry lists for it over every
link this machine has; ``measure`` runs one, with the same options, over the links whose backend
is ``cuda`` (a notebook calls it, then ``load``s); ``reproduce`` prints the plan its notebooks
follow."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .experiments import experiment, measure_all_names, module_name
from .platform import LOCAL, SAFE_ENV, BackendChoice, Inventory
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


def _run_live(name: str, root: Path, args: Sequence[str],
              derived: bool = True) -> tuple[Path, list[Path]]:
    """``run_live``'s record, and everything it wrote in the order written."""
    from .experiments import harness
    from .platform import inventory

    exp = experiment(name)
    first = []
    if exp.launch == "in_process":
        parsed = harness.parse(exp, ["--root", str(root), *args])
        first = exp.before(parsed, root)
        path = harness.run(exp, parsed)
    else:
        path = torchrun_record(name, inventory().peer_capable_gpus, list(args), root)
    return path, [*first, path, *(exp.derived(path, root) if derived else [])]


def run_live(name: str, root: Path = RECORDS_DIR, args: Sequence[str] = (),
             derived: bool = True) -> list[Path]:
    """Experiment ``name`` on this machine's GPUs, with its command-line ``args``: the records
    it reads that must come first (``Experiment.before``: the forecast it tests), its record,
    then (``derived``) the records derived from it (``Experiment.derived``), in that order."""
    return _run_live(name, root, args, derived)[1]


@dataclass(frozen=True)
class Step:
    """One experiment over one of its links, and the backend it gets here."""

    name: str
    link: str
    choice: BackendChoice

    @property
    def live(self) -> bool:
        return self.choice.name == "cuda"


def plan_lines(steps: Sequence[Step], other: str = "replayed") -> list[str]:
    """``steps`` as lines, those with the same backend and reason on one: what is measured live
    and what is not (``other``), and why."""
    groups: dict[tuple[bool, str], list[str]] = {}
    for step in steps:
        where = "on one GPU" if step.link == LOCAL else f"over {step.link}"
        groups.setdefault((step.live, step.choice.reason), []).append(f"{step.name} {where}")
    return [f"{'measured live' if live else other}: {', '.join(names)} ({reason})"
            for (live, reason), names in groups.items()]


def plan(backend: str = "auto", names: Sequence[str] | None = None,
         inv: Inventory | None = None) -> list[Step]:
    """Each experiment of ``names`` (default: ``measure-all``'s, in its order) over each of its
    links, with the backend ``platform.choose_backend`` gives it on this machine (``inv``): what
    ``measure``, ``measure-all`` and ``reproduce`` measure live and what they replay."""
    from .platform import choose_backend

    names = measure_all_names() if names is None else names
    return [Step(name, link, choose_backend(backend, inv, link))
            for name in names for link in experiment(name).links]


def _options(name: str, link: str, written: dict[str, Path], root: Path) -> list[str]:
    """What a live run of ``name`` over ``link`` is given: its ``measure_all_args`` and
    ``link_args``."""
    exp = experiment(name)
    return [*exp.measure_all_args(written, root), *exp.link_args(link)]


def measure(name: str, backend: str = "auto", root: Path | str | None = None) -> list[Path]:
    """Experiment ``name`` measured live on this machine over each of its links whose backend is
    ``cuda`` here (``plan``), with the options ``measure-all`` passes it: the records written
    (``run_live``); nothing (``[]``) where every link replays. Under ``cuda`` a link this
    machine lacks is said in one line and replayed. A notebook calls it before
    ``load(name, backend=backend)``, which then reads the new records."""
    root = RECORDS_DIR if root is None else Path(root)
    steps = plan(backend, [name])
    for line in plan_lines([s for s in steps if not s.live]) if backend == "cuda" else ():
        print(line)
    return [path for step in steps if step.live
            for path in run_live(name, root, _options(name, step.link, {}, root))]


def measure_all_plan(only: list[str] | None = None) -> list[Step]:
    """``plan("cuda")`` of what ``measure-all`` runs (every experiment that declares
    ``in_measure_all``, or those named in ``only``), refused with a ``ValueError`` before any
    launch: a name it does not run, a machine with no GPU, or one that has none of the links of
    an experiment ``only`` names."""
    from .platform import inventory

    inv = inventory()
    no_gpu = f"measure-all needs a GPU; this machine has none ({inv.error})"
    if only is None and not inv.gpus:  # said before every experiment is imported to be named
        raise ValueError(no_gpu)
    known = measure_all_names()
    names = known if only is None else list(only)
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"unknown measurements {unknown}; known: {known}")
    if not inv.gpus:
        raise ValueError(no_gpu)
    steps = plan("cuda", names, inv)
    for name in only or ():
        lacking = [s.choice.reason for s in steps if s.name == name and not s.live]
        if len(lacking) == len(experiment(name).links):
            raise ValueError(f"{name} cannot run here: {'; '.join(lacking)}")
    return steps


def measure_all(root: Path = RECORDS_DIR, only: list[str] | None = None) -> list[Path]:
    """Every experiment ``measure-all`` runs (or those named in ``only``) live on this machine's
    GPUs, in one go, in the registry's order, each over every link this machine has
    (``measure_all_plan``), with its ``measure_all_args``; first a line for the links it lacks.
    Returns the records written."""
    steps = measure_all_plan(only)
    for line in plan_lines([s for s in steps if not s.live], other="not measured here"):
        print(line)
    paths, written = [], {}
    for step in (s for s in steps if s.live):
        record, new = _run_live(step.name, root, _options(step.name, step.link, written, root))
        written[step.name] = record
        paths.extend(new)
    return paths
