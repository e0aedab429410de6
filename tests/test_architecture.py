"""The layering of the package, read from the sources (parsed, never imported): no import cycle
among the modules of xstage_lab, and the device code in kernels/ imports nothing of xstage_lab."""
import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "xstage_lab"
KERNELS = REPO / "kernels"


def module_name(path: Path) -> str:
    """The dotted name of a source under the repository (a package by its ``__init__.py``)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def parse(path: Path) -> ast.Module:
    """The syntax tree of the source at ``path``, parsed once per version of the file (the tests
    here read every source several times); read only."""
    stat = path.stat()
    return _parsed(path, stat.st_mtime_ns, stat.st_size)


@functools.cache
def _parsed(path: Path, mtime_ns: int, size: int) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def imports(path: Path, name: str, modules: set[str] = frozenset()) -> set[str]:
    """Every dotted name that the source at ``path`` (the module ``name``) imports, at any depth
    (imports inside functions count): the modules, and for ``from m import x`` also ``m.x``.
    ``from m import x`` depends on m's own namespace (its ``__init__``) unless every x is one of
    ``modules``: then it depends on those submodules, as ``import m.x`` does."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[:len(parts) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            named = {f"{source}.{a.name}" for a in node.names}
            out |= named | (set() if named <= modules else {source})
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the package it imports."""
    sources = {module_name(p): p for p in (REPO / PACKAGE).rglob("*.py")}
    names = set(sources)
    return {name: imports(path, name, names) & names - {name} for name, path in sources.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path that ends where it starts, or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once fully explored
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle_and_only_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_resolve_relative_and_function_level_imports(tmp_path):
    source = tmp_path / "pkg" / "sub" / "mod.py"
    source.parent.mkdir(parents=True)
    source.write_text("from .. import a\nfrom .b import c\n\ndef f():\n    import pkg.d\n")
    assert imports(source, "pkg.sub.mod") == {"pkg", "pkg.a", "pkg.sub.b", "pkg.sub.b.c", "pkg.d"}
    # ``a`` a submodule: the import names it, not pkg's namespace
    assert imports(source, "pkg.sub.mod", {"pkg.a"}) == {"pkg.a", "pkg.sub.b", "pkg.sub.b.c",
                                                          "pkg.d"}


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 30 and graph["xstage_lab.runner"]  # the sources were found and read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_plots_draw_what_the_experiments_computed():
    """Figures and tables take records and the fits and rows computed from them: no module of
    plots imports an experiment (its fits would run while drawing) or summary (a level above)."""
    for name, deps in import_graph().items():
        if name.startswith(f"{PACKAGE}.plots"):
            above = {d for d in deps
                     if d.startswith((f"{PACKAGE}.experiments", f"{PACKAGE}.summary"))}
            assert not above, (name, above)


def test_ops_import_no_experiment():
    """The host side of the kernels (``ops``) stands below the experiments that measure them."""
    for name, deps in import_graph().items():
        if name.startswith(f"{PACKAGE}.ops"):
            above = {d for d in deps if d.startswith(f"{PACKAGE}.experiments")}
            assert not above, (name, above)


def test_kernels_import_nothing_of_the_package():
    """Device code imports triton, gluon and its sibling sources (relatively: they are imported as
    one package, ``kernel_sources.KERNELS_PACKAGE``), never the host package."""
    sources = sorted(KERNELS.glob("*.py"))
    assert sources
    siblings = {p.stem for p in sources}
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                # one level up from kernels/ would be xstage_lab itself
                targets = [node.module] if node.module else [a.name for a in node.names]
                assert node.level == 1 and set(targets) <= siblings, (path.name, node.lineno)
                continue
            elif isinstance(node, ast.ImportFrom):
                names = [node.module]
            else:
                continue
            assert not any(n.split(".")[0] == PACKAGE for n in names), (path.name, node.lineno)


# --- the three rooms (ops: the kernels' host side; experiments: what measures; analysis: what
# reads) ----------------------------------------------------------------------------------------

GPU_LIBRARIES = ("torch", "cupy", "triton")
# Where the read side stands: the analysis of records and the CPU model, fits and simulator.
READ_SIDE = (f"{PACKAGE}.analysis", f"{PACKAGE}.model", f"{PACKAGE}.calibration",
             f"{PACKAGE}.simulator")
# What reads records: the records module's readers, reached only through ``loading``.
RECORD_READERS = ("read_record", "list_records", "latest_record", "resolve_record", "platforms",
                  "select_records")
MAX_LINES = 600


def _sources() -> dict[str, Path]:
    return {module_name(p): p for p in (REPO / PACKAGE).rglob("*.py")}


def _in(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _all_imports(name: str, path: Path) -> set[str]:
    """Every dotted name the module imports, of the package or not."""
    return imports(path, name, set(_sources()))


def test_the_read_side_imports_no_benchmark_no_ops_and_no_gpu_library():
    """``analysis``, ``model``, ``calibration`` and ``simulator`` run on the CPU from records: no
    experiment (the benchmarks, the registry included), no kernel host code, no torch, CuPy or
    Triton."""
    checked = 0
    for name, path in _sources().items():
        if not _in(name, READ_SIDE):
            continue
        checked += 1
        deps = _all_imports(name, path)
        bad = {d for d in deps if _in(d, (f"{PACKAGE}.experiments", f"{PACKAGE}.ops"))
               or d.split(".")[0] in GPU_LIBRARIES}
        assert not bad, (name, bad)
    assert checked >= 15


def test_prose_and_the_simulator_read_no_benchmark_and_no_ops():
    """The notebooks' sentences, the figures, the summary and the simulator read what the
    analysis computed (the summary asks the registry, ``experiments``, which experiments
    declare an entry; no benchmark module)."""
    for name, path in _sources().items():
        if _in(name, (f"{PACKAGE}.prose", f"{PACKAGE}.simulator", f"{PACKAGE}.summary",
                      f"{PACKAGE}.plots")):
            bad = {d for d in _all_imports(name, path)
                   if (_in(d, (f"{PACKAGE}.experiments", f"{PACKAGE}.ops"))
                       and d not in (f"{PACKAGE}.experiments", f"{PACKAGE}.experiments.EXPERIMENTS",
                                     f"{PACKAGE}.experiments.experiment"))
                   or d.split(".")[0] in GPU_LIBRARIES}
            assert not bad, (name, bad)


def test_nothing_above_the_records_module_reads_records_but_through_load():
    """The records module's readers are called by ``loading`` alone (``load`` and the door's
    ``history``, ``latest``, ``read``, ``record_paths``, ``platforms``): imported from it, or
    reached as ``records.<reader>``."""
    door = {f"{PACKAGE}.records", f"{PACKAGE}.loading"}
    for name, path in _sources().items():
        if name in door:
            continue
        readers = {d for d in _all_imports(name, path)
                   if d in {f"{PACKAGE}.records.{r}" for r in RECORD_READERS}}
        tree = parse(path)
        readers |= {f"records.{n.attr}" for n in ast.walk(tree)
                    if isinstance(n, ast.Attribute) and n.attr in RECORD_READERS
                    and isinstance(n.value, ast.Name) and n.value.id in ("records", "_records")}
        assert not readers, (name, readers)


def test_no_module_of_the_package_is_longer_than_600_lines():
    lengths = {name: len(path.read_text().splitlines()) for name, path in _sources().items()}
    over = {name: n for name, n in lengths.items() if n > MAX_LINES}
    assert not over, over
