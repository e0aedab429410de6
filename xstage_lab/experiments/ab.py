"""Two versions of the code measured in one job (``python -m xstage_lab ab``): one experiment run as
the base, the change, then the base again, each a ``run`` of its own in its version's source tree
(another tree, extracted from the base's commit, or this one with other options), its records
under one root; ``compare`` then holds the change against the two base runs
(``analysis.moe.versions``). Versions are compared only by ratios measured in one run: the base
before and after the change shows the machine's drift over the job."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..loading import record_paths

# the runs of a job, in order
ORDER = ("base", "change", "base")


@dataclass(frozen=True)
class Side:
    """One version: the source tree its runs import (its ``xstage_lab`` and ``kernels``), the
    commit its records name (None: as ``run`` finds it there, ``XSTAGE_GIT_COMMIT`` or the
    checkout's) and its options beyond those the sides share."""

    tree: Path
    commit: str | None = None
    options: tuple[str, ...] = ()


def check_sides(base: Side, change: Side) -> None:
    """Raise ValueError unless the two sides are two versions: another tree, or other options,
    and every tree holds the package and its kernels."""
    if base == change:
        raise ValueError("the base and the change are one version: give the base another tree "
                         "or either side other options")
    for side in (base, change):
        missing = [d for d in ("xstage_lab", "kernels") if not (side.tree / d).is_dir()]
        if missing:
            raise ValueError(f"{side.tree} holds no {' or '.join(missing)}: not a source tree")


def run_sides(experiment: str, options: list[str], base: Side, change: Side, root: Path,
              runner=None) -> tuple[Path, list[Path]]:
    """``experiment`` run in ``ORDER``, each ``python -m xstage_lab run --root ROOT EXPERIMENT
    OPTIONS SIDE.OPTIONS`` in its side's tree (imported first; its commit as
    ``XSTAGE_GIT_COMMIT`` where given); the change's record and the base runs'. Raises
    RuntimeError where a run fails or writes other than one record of ``experiment``.
    ``runner``: what runs a command (``subprocess.run`` where None)."""
    check_sides(base, change)
    runner = runner or subprocess.run
    root = root.resolve()
    for side in (base, change):
        _check_imports_its_tree(side, runner)
    records = []
    for name in ORDER:
        side = base if name == "base" else change
        before = set(record_paths(experiment, root=root))
        done = runner([sys.executable, "-m", "xstage_lab", "run", "--root", str(root),
                       experiment, *options, *side.options], cwd=side.tree, env=_env(side))
        if done.returncode:
            raise RuntimeError(f"the {name} run of {experiment} failed (exit {done.returncode})")
        new = sorted(set(record_paths(experiment, root=root)) - before)
        if len(new) != 1:
            raise RuntimeError(f"the {name} run wrote {len(new)} {experiment} records, not one")
        records.append(new[0])
    return records[1], [records[0], records[2]]


def _env(side: Side) -> dict:
    """The environment of a side's runs: its tree first on the import path, its commit."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(side.tree.resolve()),
                                                    env.get("PYTHONPATH")) if p)
    if side.commit:
        env["XSTAGE_GIT_COMMIT"] = side.commit
    return env


def _check_imports_its_tree(side: Side, runner) -> None:
    """Raise RuntimeError unless a run in ``side``'s environment imports the package of its own
    tree (an installed copy found first would measure another version under its name)."""
    done = runner([sys.executable, "-c", "import xstage_lab; print(xstage_lab.__file__)"],
                  cwd=side.tree, env=_env(side), capture_output=True, text=True)
    found = Path(done.stdout.strip()).resolve().parent.parent if done.returncode == 0 else None
    if found != side.tree.resolve():
        raise RuntimeError(f"a run in {side.tree} imports xstage_lab from "
                           f"{found or 'nowhere'}, not from its own tree")
