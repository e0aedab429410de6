"""pyproject.toml installs every package of xstage_lab, and environment.yml serves conda users with
the same dependencies."""
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
# conda-forge names that differ from PyPI's
CONDA_TO_PYPI = {"python-kaleido": "kaleido"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_lists_the_pyproject_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *sum(project["optional-dependencies"].values(), [])]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"]
    conda = [d for d in env if isinstance(d, str) and not d.startswith(("python=", "pip"))]
    pip = next(d["pip"] for d in env if isinstance(d, dict))
    listed = [*conda, *(p for p in pip if not p.startswith("-e"))]
    norm = lambda r: CONDA_TO_PYPI.get(_name(r), _name(r)) + r[len(_name(r)):].replace(" ", "")
    assert sorted(map(norm, listed)) == sorted(norm(r.lower()) for r in wanted)


def test_pyproject_installs_every_package():
    """A subpackage left out of the install works in the editable checkout and is missing from a
    wheel: what setuptools finds from pyproject's patterns is every folder with an __init__.py."""
    from setuptools import find_packages

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    installed = set(find_packages(str(ROOT), include=found["find"]["include"]))
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "xstage_lab").rglob("__init__.py")}
    assert installed == on_disk
