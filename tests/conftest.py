"""Fixtures shared by several test modules, and how the tests run in parallel.

``make test`` runs pytest-xdist workers (``-n auto --dist loadgroup``). A fixture wider than one
test (session, module or class scope) is computed once per worker that uses it, so
``pytest_collection_modifyitems`` below puts every test that uses such a fixture of this
repository in one ``xdist_group`` with every other test using it (transitively): a notebook run,
an interpreter child or a compiled kernel is made once per run, on one worker, and tests without
one are spread freely. The modules that run kernel cases in children of
``triton_testing.child_main`` are one group too: one child process per flag runs all their
cases. Tests marked ``early`` (long on their own) and the large groups start first, so that the
workers finish together.
"""
from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import pytest

from tests.experiments import triton_testing

TESTS = Path(__file__).resolve().parent

# One thread per xdist worker for torch's OpenMP and NumPy's BLAS, and for the children the tests
# start (notebook kernels, interpreter runs), which inherit it: the workers already take a core
# each, and threads more than cores only wait, spinning (a torch test beside another worker took
# seven times its CPU time). Set before any test module imports torch.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# jsonschema (under nbformat and papermill) imports rfc3987_syntax where it is installed (the IRI
# formats of jupyter-events' extra), which compiles 39 lark grammars at import: 1.5 to 4 s of
# every worker's collection (more beside torch's heap). nbformat validates notebooks without
# format checks, so nothing here reads an IRI format; jsonschema goes without that checker.
sys.modules.setdefault("rfc3987_syntax", None)


@pytest.fixture(scope="session")
def eight_gpu_root(tmp_path_factory):
    """Records of an h200-x8 platform beside the committed h200-x2 ones
    (``synthetic.write_eight_gpu_beside_committed``); read only."""
    from tests.synthetic import write_eight_gpu_beside_committed

    root = tmp_path_factory.mktemp("records")
    write_eight_gpu_beside_committed(root)
    return root


@pytest.fixture(scope="session")
def reproduced(tmp_path_factory):
    """``reproduce --backend replay`` of every notebook on the committed records, once per run
    and in one kernel (``one_kernel.replay``; tests/test_notebooks.py and tests/test_prose.py
    read it): the output folder; read only."""
    from tests.one_kernel import replay

    out = tmp_path_factory.mktemp("reproduced")
    assert replay(out) == 0
    return out


# ------------------------------------------------------------------ grouping for pytest-xdist

def _ours(fixturedef) -> bool:
    """A fixture defined in this repository's tests (not pytest's or a plugin's)."""
    try:
        return TESTS in Path(inspect.getfile(fixturedef.func)).resolve().parents
    except (TypeError, OSError):
        return False


def _shared_keys(item) -> list[str]:
    """The fixtures wider than one test that ``item`` uses, each named by where one value of it
    lives: the session, or the module or class that holds the test."""
    keys = [m.args[0] if m.args else m.kwargs.get("name", "default")
            for m in item.iter_markers("xdist_group")]
    if triton_testing.is_batched(getattr(item, "module", None)):
        keys.append("triton_children")  # one child per flag runs all their cases
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return keys
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name)
        if not defs or not _ours(defs[-1]) or defs[-1].scope == "function":
            continue
        scope = defs[-1].scope
        if scope in ("session", "package"):
            keys.append(name)
        elif scope == "module" or item.cls is None:
            keys.append(f"{item.module.__name__}:{name}")
        else:
            keys.append(f"{item.module.__name__}.{item.cls.__name__}:{name}")
    return keys


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    parent: dict[str, str] = {}

    def find(k: str) -> str:
        while parent.setdefault(k, k) != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    def union(a: str, b: str) -> None:
        a, b = find(a), find(b)
        if a != b:
            if ":" in a and ":" not in b:  # a session fixture's name names the group
                a, b = b, a
            parent[b] = a

    keys = {item.nodeid: _shared_keys(item) for item in items}
    for ks in keys.values():
        for k in ks:
            union(ks[0], k)
    for item in items:
        if keys[item.nodeid]:
            item.add_marker(pytest.mark.xdist_group(find(keys[item.nodeid][0])), append=False)
    # Modules with a long test first (whole modules, so that no module fixture is made twice):
    # xdist hands out the larger groups first, then single tests in this order.
    early = {getattr(item, "module", None) for item in items if item.get_closest_marker("early")}
    items.sort(key=lambda item: getattr(item, "module", None) not in early)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """The modules that run kernel cases in children (``triton_testing.is_batched``) share one
    child per flag (``triton_testing.batched``). Under ``--dist loadgroup`` xdist marks each grouped
    test's id with ``@group``; where it does not (pytest 9.2 with pytest-xdist 3.8), the groups
    would be silently ignored and every worker would make the shared fixtures again."""
    triton_testing.batched[:] = triton_testing.batch_order(
        item.module.__name__ for item in session.items
        if triton_testing.is_batched(getattr(item, "module", None)))
    if getattr(session.config.option, "loadgroup", False):
        for item in session.items:
            if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
                raise pytest.UsageError(
                    f"--dist loadgroup did not group {item.nodeid}: this pytest-xdist does not "
                    "support this pytest (see the pin in pyproject.toml)")
