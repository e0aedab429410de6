"""Command line: ``python -m xstage_lab {run,measure-all,calibrate,import-bench,reproduce,summary,
compare,ab,transcode}``; ``characterize``, ``visibility`` and ``characterize-beyond`` are the older
names of ``run remote_store``, ``run visibility`` and ``run remote_patterns`` / ``run remote_ops``.

``run NAME [options]`` runs any registered experiment (``experiments.EXPERIMENTS``) live on this
machine, its options parsed by the experiment's own parser (``experiments.harness.parser``: ``run
NAME --help``), and writes its record and the records derived from it under ``--root``.

A user's mistake ends in one line on stderr and exit code 2, never a traceback; the arguments are
checked before CuPy or a GPU is touched."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .cli import list_option
from .experiments import EXPERIMENTS
from .platform import LINKS
from .records import RECORDS_DIR


class UsageError(Exception):
    """A user's mistake: ``main`` prints it as one line on stderr and returns 2."""


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line on stderr (no usage block), exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _count(text: str) -> int:
    """argparse type: a whole number of at least 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return n


def _gpu(text: str) -> int:
    """argparse type: a GPU index (0 or more)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a GPU index (0, 1, ...), got {text!r}")
    return n


def _distinct(src: int, dst: int) -> None:
    if src == dst:
        raise UsageError(f"--src and --dst must be two GPUs, got {src} for both")


def _need_gpu(index: int, what: str) -> None:
    """Stop unless this machine has GPU ``index``. Imports CuPy: call it after the arguments are
    checked."""
    from .platform import inventory

    inv = inventory()
    if index >= len(inv.gpus):
        raise UsageError(f"{what} needs GPU {index}; this machine has {len(inv.gpus)} GPU(s)"
                         + (f" ({inv.error})" if inv.error else ""))


def _need_gpus(*pairs: tuple[int, int], what: str = "this command") -> None:
    """Stop unless this machine has two peer-capable GPUs and each (src, dst) of ``pairs`` is a
    peer pair among them. Imports CuPy: call it after the arguments are checked."""
    from .platform import inventory

    inv = inventory()
    if inv.peer_capable_gpus < 2:
        raise UsageError(f"{what} needs two peer-capable GPUs; this machine has {len(inv.gpus)} "
                         f"GPU(s), {inv.peer_capable_gpus} peer-capable"
                         + (f" ({inv.error})" if inv.error else ""))
    for src, dst in pairs:
        if max(src, dst) >= len(inv.gpus):
            raise UsageError(f"--src {src} --dst {dst}: this machine has GPUs "
                             f"0..{len(inv.gpus) - 1}")
        if not inv.can_access_peer(src, dst):
            raise UsageError(f"GPU {src} has no peer access to GPU {dst}")


def _existing_file(path: Path) -> Path:
    if not path.is_file():
        raise UsageError(f"no such file: {path}")
    return path


def _characterize(args) -> int:
    from .experiments.remote_store.characterization import CALIBRATION_SWEEPS, SWEEP_NAMES

    bad = sorted(set(args.only or ()) - set(SWEEP_NAMES))
    if bad:
        raise UsageError(f"--only: invalid choice: {bad} (choose from {' '.join(SWEEP_NAMES)})")
    if args.calibrate and args.only and not set(CALIBRATION_SWEEPS) <= set(args.only):
        raise UsageError(f"--calibrate needs the sweeps {CALIBRATION_SWEEPS} among --only")
    if args.link == "host":
        if args.only and "pairs" in args.only:
            raise UsageError("--only pairs: the host link has one route, no pairs sweep")
        _need_gpu(args.src, "the host link")
    else:
        _distinct(args.src, args.dst)
        _need_gpus((args.src, args.dst))
    from .experiments.remote_store.characterization import run_characterization

    path = run_characterization(repeats=args.repeats, src=args.src, dst=args.dst,
                                only=tuple(args.only) if args.only else None, root=args.root,
                                link=args.link)
    print(f"wrote {path}")
    if args.calibrate:
        from .analysis.remote_store.characterization import write_calibration
        print(f"wrote {write_calibration(path, root=args.root)}")
    return 0


def _characterize_beyond(args) -> int:
    import time
    import traceback

    if "ops" in args.only:
        _distinct(args.src, args.dst)
    _need_gpus(*([(args.src, args.dst)] if "ops" in args.only else []))
    from .experiments.remote_store.patterns import run_patterns
    from .experiments.remote_store.ops import run_operations

    repeats = {} if args.repeats is None else {"repeats": args.repeats}
    parts = {"patterns": lambda: run_patterns(root=args.root, **repeats),
             "ops": lambda: run_operations(src=args.src, dst=args.dst, root=args.root, **repeats)}
    t0, failed = time.monotonic(), []
    for name in args.only:
        try:  # each part its own record: one failing leaves the other's
            print(f"wrote {parts[name]()}", flush=True)
        except Exception:
            traceback.print_exc()
            failed.append(name)
    print(f"characterize-beyond: {time.monotonic() - t0:.0f} s"
          + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


def _calibrate(args) -> int:
    from .loading import read as read_record

    try:
        rec = read_record(_existing_file(args.record))
    except ValueError as e:  # not Parquet, no header, or marked invalid by the errata
        raise UsageError(str(e)) from None
    if rec.meta["experiment"] != "remote_store":
        raise UsageError(f"{args.record} is a {rec.meta['experiment']!r} record, "
                         "not a 'remote_store' one")
    if args.root is not None:
        from .analysis.remote_store.characterization import write_calibration

        print(f"wrote {write_calibration(args.record, root=args.root)}")
        return 0
    from .calibration import calibrate

    cal, _ = calibrate(rec.table, rec.platform, rec.record_id)
    print(f"M_X of {rec.platform} from {rec.record_id} (not saved; --root DIR writes the "
          f"calibration record):")
    print(json.dumps(cal.summary(), indent=2))
    return 0


def _import_bench(args) -> int:
    from .experiments import experiment
    from .records import import_bench_json

    resolution = experiment(args.experiment).resolution
    try:
        path = import_bench_json(_existing_file(args.file), args.experiment, args.root, resolution)
    except ValueError as e:  # not JSON, or not an experiment's output
        raise UsageError(str(e)) from None
    print(f"wrote {path}")
    return 0


def _visibility(args) -> int:
    _distinct(args.src, args.dst)
    _need_gpus((args.src, args.dst))
    from .experiments.remote_store.visibility import run_visibility

    print(f"wrote {run_visibility(src=args.src, dst=args.dst, repeats=args.repeats, root=args.root)}")
    return 0


def _measure_all(args) -> int:
    if args.only:
        from .experiments import measure_all_names

        known = measure_all_names()
        bad = [n for n in args.only if n not in known]
        if bad:
            raise UsageError(f"--only: invalid choice: {bad} (choose from {' '.join(known)})")
    from .launch import measure_all, measure_all_plan

    try:
        measure_all_plan(args.only)
    except ValueError as e:
        raise UsageError(str(e)) from None
    for path in measure_all(root=args.root, only=args.only):
        print(f"wrote {path}")
    return 0


def _reproduce(args) -> int:
    from .runner import notebooks, reproduce

    try:
        notebooks(args.only)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.backend == "cuda":
        from .platform import inventory

        inv = inventory()
        if not inv.gpus:
            raise UsageError("--backend cuda needs a GPU; this machine has none"
                             + (f" ({inv.error})" if inv.error else ""))
    return reproduce(only=args.only, backend=args.backend, out=args.out)


def _summary(args) -> int:
    if not args.root.is_dir():
        raise UsageError(f"no records folder {args.root}")
    from .summary import format_summary, summary

    s = summary(root=args.root)
    if not s["platforms"]:
        raise UsageError(f"no records under {args.root}")
    print(json.dumps(s, indent=2) if args.json else format_summary(s))
    return 0


def _compare(args) -> int:
    """``compare CHANGE BASE [BASE]``: the change's record against the base's from one job
    (``analysis.moe.versions``), a table of cells then one of groups."""
    return _compare_paths(args.change, args.base, args.columns, args.cell, args.by)


def _compare_paths(change_path: Path, base_paths: list[Path], columns: list[str],
                   cell: list[str] | None, by: list[str]) -> int:
    import pandas as pd

    from .analysis.moe.versions import CELLS, record_version, version_ratios, version_summary
    from .loading import read

    try:
        change, *base = [read(p) for p in (change_path, *base_paths)]
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    kinds = {(r.meta["experiment"], r.platform) for r in (change, *base)}
    if len(kinds) > 1:
        raise UsageError(f"the records come from different experiments or platforms: "
                         f"{sorted(kinds)}")
    experiment = change.meta["experiment"]
    cell = cell or CELLS.get(experiment)
    if not cell:
        raise UsageError(f"name the cell columns of {experiment} records (--cell)")
    versions = {record_version(r) for r in base}
    if len(versions) > 1 or record_version(change) in versions:
        raise UsageError(f"the base runs must share one version (commit and variant options) "
                         f"and the change another: base {sorted(versions)}, change "
                         f"{record_version(change)}")
    timings = {r.params.get("timing") for r in (change, *base)}
    if len(timings) > 1 and len({r.git_commit for r in (change, *base)}) > 1:
        # a variant of one commit may be the timing itself (moe_layer --graph-start)
        raise UsageError(f"the records were timed in different ways and come from different "
                         f"commits, so each ratio would mix the two: {sorted(map(str, timings))}")
    try:
        ratios = version_ratios([r.table for r in base], change.table, cell, columns)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if ratios.empty:
        raise UsageError("no cell was measured by the change and every base run")
    shown = [*cell, *(f"{c}_{s}" for c in columns for s in ("ratio", "verdict"))]
    with pd.option_context("display.width", 200, "display.max_rows", None,
                           "display.max_columns", None):
        print(f"{experiment}/{change.platform}: {record_version(change)} against "
              f"{record_version(base[0])}, {len(base)} base run(s)")
        print(ratios[shown].to_string(index=False, float_format="{:.3f}".format))
        print()
        print(version_summary(ratios, by, columns)
              .to_string(index=False, float_format="{:.3f}".format))
    return 0


def _ab(args) -> int:
    """``ab EXPERIMENT [--options ...] [sides] --columns ...``: the experiment run as base,
    change, base in one job (``experiments.ab``), then ``compare``."""
    import shlex

    from .experiments.ab import Side, run_sides

    if (args.base_tree is None) != (args.base_commit is None):
        raise UsageError("--base-tree and --base-commit go together: a tree extracted from a "
                         "commit has no git history to name it")
    here = Path(__file__).resolve().parent.parent
    base = Side(args.base_tree or here, args.base_commit, tuple(shlex.split(args.base_options)))
    change = Side(here, None, tuple(shlex.split(args.change_options)))
    try:  # run_sides checks the sides before anything runs
        change_record, base_records = run_sides(args.name, shlex.split(args.options), base,
                                                change, args.root)
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None
    print(f"wrote {base_records[0]}, {change_record}, {base_records[1]}")
    return _compare_paths(change_record, base_records, args.columns, args.cell, args.by)


def _run(args) -> int:
    """``run NAME [options]``: the experiment's options checked by its own parser before any GPU
    is touched, then its record (in process, or under torchrun on every peer-capable GPU) and
    the records derived from it."""
    from .experiments import experiment, harness

    exp = experiment(args.name)
    options = list(args.options)
    if any(o in ("--out", "--root") or o.startswith(("--out=", "--root=")) for o in options):
        raise UsageError("run writes records under --root, given before the experiment's name")
    try:
        harness.parse(exp, ["--root", str(args.root), *options])
    except SystemExit as e:  # the experiment's parser said why, in one line
        return e.code if isinstance(e.code, int) else 2
    if exp.launch == "per_gpu" or exp.links == ("nvlink",):  # one GPU has no NVLink to measure
        _need_gpus(what=f"run {args.name}")
    from .launch import run_live

    for path in run_live(args.name, args.root, options):
        print(f"wrote {path}")
    return 0


def _transcode(args) -> int:
    from .experiments import resolution
    from .records import transcode

    bad = [r for r in args.records if len(Path(r).parts) != 3 or Path(r).suffix]
    if bad:
        raise UsageError(f"records are named experiment/platform/record_id, got {bad}")
    for record in args.records:
        try:
            path = transcode(record, args.commit, root=args.root,
                             resolution=resolution(Path(record).parts[0]))
        except (ValueError, FileNotFoundError) as e:
            raise UsageError(f"{record}: {e}") from None
        print(f"transcoded {path}")
    return 0


def _comparison_options(p: argparse.ArgumentParser) -> None:
    """What ``compare`` (and ``ab``, which ends with it) takes of the comparison."""
    p.add_argument("--columns", **list_option(), required=True,
                   help="the times to compare (lower is better)")
    p.add_argument("--cell", **list_option(), default=None,
                   help="the columns that name a cell (default: the experiment's, where known)")
    p.add_argument("--by", **list_option(nargs="*"), default=[],
                   help="the columns to summarize by (default: every cell together)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m xstage_lab",
                     description="The X-Stage workbench: measure on this node's GPUs, keep the "
                                 "results as records, replay them.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    root_help = "records root (default: the committed data/records)"

    p = sub.add_parser("run", help="run one registered experiment live on this machine: its "
                                   "record and those derived from it")
    p.add_argument("--root", type=Path, default=RECORDS_DIR, help=root_help)
    p.add_argument("name", choices=list(EXPERIMENTS), metavar="NAME",
                   help=f"the experiment, one of {' '.join(EXPERIMENTS)}")
    p.add_argument("options", nargs=argparse.REMAINDER,
                   help="the experiment's own options (run NAME --help lists them)")
    p.set_defaults(func=_run)

    p = sub.add_parser("characterize", help="run the remote-store sweeps (Fig. 3) on this machine "
                                            "(the older name of run remote_store)")
    p.add_argument("--link", choices=LINKS, default="nvlink",
                   help="stores into a peer GPU (nvlink, default) or into pinned host memory "
                        "(host: one GPU suffices; --dst is not used)")
    p.add_argument("--repeats", type=_count, default=11, help="launches per point (default: 11)")
    p.add_argument("--src", type=_gpu, default=0, help="GPU that stores (default: 0)")
    p.add_argument("--dst", type=_gpu, default=1, help="GPU stored to (default: 1)")
    # its names checked by _characterize: importing them here would slow every command
    p.add_argument("--only", **list_option(nargs="*", metavar="SWEEP",
                                           help="these sweeps only, of drain_rate gap isolated "
                                                "fenced lines pairs (default: all)"))
    p.add_argument("--root", type=Path, default=RECORDS_DIR, help=root_help)
    p.add_argument("--calibrate", action="store_true", help="also write the calibration record")
    p.set_defaults(func=_characterize)

    p = sub.add_parser("characterize-beyond",
                       help="injection patterns on every GPU and remote operations beyond "
                            "16-byte stores")
    p.add_argument("--only", **list_option(choices=("patterns", "ops"), default=["patterns", "ops"],
                                           help="these parts only (default: both)"))
    p.add_argument("--repeats", type=_count, default=None,
                   help="per point (default: 5; the patterns on more than four GPUs: 3)")
    p.add_argument("--src", type=_gpu, default=0, help="source GPU of the operations (default: 0)")
    p.add_argument("--dst", type=_gpu, default=1,
                   help="destination GPU of the operations (default: 1)")
    p.add_argument("--root", type=Path, default=RECORDS_DIR, help=root_help)
    p.set_defaults(func=_characterize_beyond)

    p = sub.add_parser("calibrate", help="fit M_X from a remote_store record: printed, or a "
                                         "calibration record with --root")
    p.add_argument("record", type=Path, help="path of a remote_store record")
    p.add_argument("--root", type=Path, default=None,
                   help="write the calibration record under this records root (default: print "
                        "the fit, write nothing)")
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("import-bench", help="save an experiment's JSON output (its --out) as a "
                                            "record")
    p.add_argument("file", type=Path, help="the experiment's JSON output")
    p.add_argument("--experiment", required=True, choices=sorted(EXPERIMENTS),
                   help="the experiment the record belongs to")
    p.add_argument("--root", type=Path, default=RECORDS_DIR, help=root_help)
    p.set_defaults(func=_import_bench)

    p = sub.add_parser("visibility", help="receiver-side remote-visible completion latency, with "
                                          "the two GPUs' clocks aligned by ping-pong")
    p.add_argument("--src", type=_gpu, default=0, help="GPU that stores (default: 0)")
    p.add_argument("--dst", type=_gpu, default=1, help="GPU that observes (default: 1)")
    p.add_argument("--repeats", type=_count, default=5, help="launches per point (default: 5)")
    p.add_argument("--root", type=Path, default=RECORDS_DIR, help=root_help)
    p.set_defaults(func=_visibility)

    p = sub.add_parser("measure-all", help="every experiment live on this machine, over every "
                                           "link it has (one GPU: the host link's), as records")
    p.add_argument("--root", type=Path, default=RECORDS_DIR, help=root_help)
    p.add_argument("--only", **list_option(
        metavar="NAME", help="these measurements only, in this order (default: every experiment "
                             "that declares in_measure_all, in the registry's order)"))
    p.set_defaults(func=_measure_all)

    p = sub.add_parser("reproduce", help="run every notebook headlessly (papermill)")
    p.add_argument("--only", **list_option(
        help="notebook names, each with or without its number (default: all)"))
    p.add_argument("--backend", choices=("auto", "cuda", "replay"), default="auto",
                   help="per experiment and link: cuda measures live what this machine can "
                        "run; replay: the committed records; auto (default): cuda on two "
                        "peer-capable GPUs, the host link's experiments on one GPU")
    p.add_argument("--out", type=Path, default=Path("out"),
                   help="folder for the executed notebooks and figures (default: out)")
    p.set_defaults(func=_reproduce)

    p = sub.add_parser("summary", help="headline numbers of the records, a table per platform")
    p.add_argument("--json", action="store_true", help="every number, as JSON")
    p.add_argument("--root", type=Path, default=RECORDS_DIR, help=root_help)
    p.set_defaults(func=_summary)

    p = sub.add_parser("compare", help="a change's record against the base's records of the "
                                       "same job, cell by cell: ratios and verdicts")
    p.add_argument("change", type=Path, help="the change's record (a path)")
    p.add_argument("base", type=Path, nargs="+",
                   help="the base's records of the same job, before and after the change's")
    _comparison_options(p)
    p.set_defaults(func=_compare)

    p = sub.add_parser("ab", help="one experiment run as the base, the change, the base again "
                                  "in one job, then compare")
    p.add_argument("name", choices=list(EXPERIMENTS), metavar="EXPERIMENT",
                   help="a registered experiment")
    p.add_argument("--options", default="",
                   help="the experiment's options both sides run with (one string)")
    p.add_argument("--root", type=Path, default=RECORDS_DIR, help=root_help)
    p.add_argument("--base-tree", type=Path, default=None,
                   help="the base's source tree (git archive of its commit; default: this one)")
    p.add_argument("--base-commit", default=None, help="the commit the base tree holds")
    p.add_argument("--base-options", default="",
                   help="the base runs' options beyond the shared ones (one string)")
    p.add_argument("--change-options", default="",
                   help="the change run's options beyond the shared ones (one string)")
    _comparison_options(p)
    p.set_defaults(func=_ab)

    p = sub.add_parser("transcode", help="rewrite records of the format before the lean one in the "
                                         "lean format, once, listed in retired.json")
    p.add_argument("records", nargs="+", metavar="RECORD",
                   help="experiment/platform/record_id of a record")
    p.add_argument("--commit", required=True,
                   help="a commit that holds the records' present bytes (their original)")
    p.add_argument("--root", type=Path, default=RECORDS_DIR, help=root_help)
    p.set_defaults(func=_transcode)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"{parser.prog} {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
