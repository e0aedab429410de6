"""environment.yml serves conda users with the same dependencies as pyproject.toml."""
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
