"""The experiment contract and the one harness that runs every experiment.

An experiment (a subclass of ``Experiment``) declares:

- its options (``add_arguments``, checked by ``check_args`` before any GPU is touched);
- its ``Sweep``s (``sweeps``): the points it measures, and their repeats;
- ``validate``: a point's parameters are possible here (before the first launch of the run);
- ``prepare``: a point's fresh seeded inputs and prepared launches;
- ``check``: the point's correctness (outputs poisoned first, against a reference), returning its
  failures; any failure on any rank stops the run before that point is timed;
- ``recheck``: the same after the point's last timed repeat (default: ``check`` again, which
  poisons the outputs itself: a ``check`` that is not repeatable needs its own ``recheck``); a
  failure, a spin error during the timed runs included, stops the run with nothing written;
- ``measure``: the point timed, as rows;
- ``metadata``: its own facts for the record's header; ``finish``: the rows as the record keeps
  them; ``record_name``: the experiment the record is saved under (a partial run's apart);
- ``derived``: the records computed from its new record (``measure-all`` writes them);
- ``analyse``: what the notebooks and the summary read of one of its records (``loading.load``;
  ``analyse_platform`` where a view reads every record of a platform);
- ``in_measure_all``, ``measure_all_args``, ``optional``: whether ``measure-all`` runs it and
  with which options, and whether a notebook shows it only where it exists; ``links``: what it
  needs of the machine (the links its remote stores take: ``nvlink``, two peer-capable GPUs;
  ``host``, one GPU; ``local``, none: one GPU), from which ``platform.choose_backend`` picks its
  backend per link, and ``link_args``, the options of a live run over one; ``before``: records a
  live run writes first (the forecast it tests). The registry (``experiments.__init__``) derives
  every list of experiments from these.

``start`` makes run-wide state once the rank has started; ``sm_clock_mhz`` reads the clock the
header keeps before the first point and after the last (``sm_clock_unread``: per rank, why a
clock of the run could not be read, once, or None); ``progress_line`` is what rank 0 prints
after a point.

``main`` runs an experiment from a command line, in this process (``launch = "in_process"``:
one GPU, or CuPy driving several) or as one rank of a torchrun job (``launch = "per_gpu"``: one
process per GPU). Whatever the launch, the output has one shape: the rows of every point (tagged
with the point's parameters) and one header, ``{experiment, paper, sweeps, chunk, world_size,
sm_clock_mhz_start, sm_clock_mhz_end, sm_clock_unread, wall_s, ...the experiment's metadata,
provenance}``,
written by rank 0 either as JSON (``--out``, ``output.write_output``; ``import-bench`` makes it a
record) or straight into a records root (``--root``, ``records.save_output``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pandas as pd

from ..sweep import Sweep, as_frame, run_sweep
from .output import write_output


class Experiment:
    """One experiment: see the module docstring for what each method declares."""

    name: ClassVar[str]  # the record's experiment
    paper: ClassVar[str]  # what of the paper (or which issue) it measures
    launch: ClassVar[str] = "per_gpu"
    # Per column, the resolution the record may round values to (``records.write_record``).
    resolution: ClassVar[dict[str, float]] = {}

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The experiment's own options."""

    def check_args(self, args: argparse.Namespace) -> None:
        """Raise ``ValueError`` (one line, said to the user) where the options cannot run."""

    def sweeps(self, args: argparse.Namespace) -> list[Sweep]:
        raise NotImplementedError

    def start(self, run: "Run") -> None:
        """Run-wide state (symmetric buffers, a CuPy bench) once the rank has started."""

    def validate(self, point: dict, run: "Run") -> None:
        """Raise ``ValueError`` where ``point`` cannot run here; every point is seen before the
        first launch."""

    def prepare(self, point: dict, run: "Run"):
        """What ``check`` and ``measure`` take for ``point`` (default: the point)."""
        return point

    def check(self, state, run: "Run") -> list[str]:
        """The point's correctness failures (none: an empty list)."""
        return []

    def recheck(self, state, run: "Run") -> list[str]:
        """The point's correctness failures after its last timed repeat (default: ``check``)."""
        return self.check(state, run)

    def measure(self, state, run: "Run") -> pd.DataFrame | dict | list[dict]:
        raise NotImplementedError

    def progress_line(self, rows: pd.DataFrame) -> str | None:
        """A line rank 0 prints after a point's rows (None: nothing)."""
        return None

    def metadata(self, run: "Run") -> dict:
        """The experiment's facts for the header (beyond what the harness writes)."""
        return {}

    def sm_clock_mhz(self, run: "Run") -> float | None:
        """This rank's SM clock now, for the header's clocks before the first point and after
        the last (default: through torch and NVML; None where unknown)."""
        return run.sm_clock_mhz()

    def record_name(self, args: argparse.Namespace) -> str:
        """The experiment the record is saved under (default: ``name``; a run that leaves out
        part of the experiment may be saved under another, so that readers skip it)."""
        return self.name

    def finish(self, table: pd.DataFrame, run: "Run") -> pd.DataFrame:
        """The rows as the record keeps them (default: as measured)."""
        return table

    def derived(self, path: Path, root: Path) -> list[Path]:
        """Records computed on the CPU from this experiment's new record at ``path`` (a
        calibration, a forecast), written under ``root`` by ``measure-all``."""
        return []

    def before(self, args: argparse.Namespace, root: Path) -> list[Path]:
        """Records computed on the CPU that a live run with ``args`` reads and that must exist
        before it (the forecast it tests), written under ``root`` by ``launch`` first (for an
        experiment run in process)."""
        return []

    # --- what the registry derives from (``experiments.__init__``) ------------------------------
    # ``measure-all`` runs the experiment (in registry order) where this is set.
    in_measure_all: ClassVar[bool] = False
    # A notebook shows it where it exists: with no record ``load`` gives an empty ``Loaded``.
    optional: ClassVar[bool] = False
    # The links it measures over (``platform.LINKS``, or ``("local",)``: one GPU, no link); one
    # with several takes ``--link``, and ``launch`` runs it once per link the backend measures.
    links: ClassVar[tuple[str, ...]] = ("nvlink",)

    def measure_all_args(self, written: dict[str, Path], root: Path) -> list[str]:
        """The options ``measure-all`` (and a notebook's live run, ``launch.measure``) pass it:
        ``written`` holds the records this run wrote so far, by experiment; ``root`` the records
        root (default: none)."""
        return []

    def link_args(self, link: str) -> list[str]:
        """The options beside ``measure_all_args`` of a live run over ``link`` (default:
        ``--link`` where it has several links)."""
        return ["--link", link] if len(self.links) > 1 else []

    @classmethod
    def analyse(cls, record, root: Path):
        """What ``loading.load`` gives of one record (default: the record itself)."""
        return record

    @classmethod
    def analyse_platform(cls, platform: str, root: Path):
        """Where set, what ``loading.load`` gives of a platform from all its records (no single
        record can then be named); None: ``analyse`` of the one record."""
        return None

    @classmethod
    def summary_entry(cls, view) -> dict | None:
        """Its entry in ``summary --json`` (under its ``name``) from a platform's view
        (``load``'s), for an experiment that ``summary`` has no entry of its own for; None:
        none."""
        return None

    @classmethod
    def view_records(cls, view) -> tuple:
        """The records a view (``analyse``'s or ``analyse_platform``'s result) read: its
        ``records``, its ``record``, or the view itself where it is a record."""
        if hasattr(view, "records"):
            return tuple(view.records)
        return (getattr(view, "record", view),)


@dataclass
class Run:
    """One running experiment on this process: its options, its rank among ``world`` processes
    (``distributed``: a torch.distributed process group), and per-run resources."""

    args: argparse.Namespace
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    distributed: bool = False
    _resource: tuple = field(default=(None, None), repr=False)

    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        if not self.distributed:
            return [obj]
        from ..dist_timing import all_gather_objects
        return all_gather_objects(obj)

    def require(self, failures: Sequence[str], what: str) -> None:
        """Gather every rank's failures; any failure anywhere stops the run (rank 0 says which)
        with no output written."""
        everyone = self.gather(list(failures))
        if any(everyone):
            if self.rank == 0:
                for r, f in enumerate(everyone):
                    if f:
                        print(f"[{what}] rank {r}: {'; '.join(f)}", file=sys.stderr)
            raise SystemExit(f"correctness failed for {what}; nothing written")

    def resource(self, key, make: Callable[[], object]):
        """``make()``'s result, kept while consecutive points ask for the same ``key`` (a model's
        expert weights, say): the previous one is dropped (and the CUDA cache emptied) first."""
        if self._resource[0] != key:
            self._resource = (None, None)
            if "torch" in sys.modules:
                import torch
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            self._resource = (key, make())
        return self._resource[1]

    def sm_clock_mhz(self):
        """This rank's SM clock (None where unknown), for the header."""
        if "torch" not in sys.modules:
            return None
        from ..dist_timing import read_sm_clock_mhz
        return read_sm_clock_mhz()

    def take_clock_unread(self) -> str | None:
        """Why this rank's SM clock could not be read since the last call (None: it always
        was)."""
        if "torch" not in sys.modules:
            return "torch is not loaded"
        from ..dist_timing import take_clock_unread
        return take_clock_unread()


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line on stderr, exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _chunk(text: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be I/N, got {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"{text}: need 0 <= I < N")
    return i, n


def _module(experiment: Experiment) -> str:
    """The name of the module that defines ``experiment`` (under ``python -m`` that module is
    ``__main__``; its spec keeps the name it was run by)."""
    module = sys.modules[type(experiment).__module__]
    spec = getattr(module, "__spec__", None)
    return spec.name if spec is not None else module.__name__


def _summary_line(experiment: Experiment) -> str | None:
    """The first paragraph of the docstring of the module that defines ``experiment``."""
    doc = sys.modules[type(experiment).__module__].__doc__
    return doc.split("\n\n")[0] if doc else None


def parser(experiment: Experiment) -> argparse.ArgumentParser:
    """The command line of ``experiment``: the harness's options and the experiment's own,
    described by the first paragraph of its module's docstring."""
    p = _Parser(prog=f"python -m {_module(experiment)}", description=_summary_line(experiment))
    sink = p.add_mutually_exclusive_group(required=True)
    sink.add_argument("--out", type=Path, help="JSON output written by rank 0 (for import-bench)")
    sink.add_argument("--root", type=Path, help="records root to write the record into")
    p.add_argument("--chunk", type=_chunk, default=None, metavar="I/N",
                   help="run only the I-th of N contiguous, near-equal pieces of the points "
                        "(0-based), so a long sweep can run as resumable pieces, each its own "
                        "output")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    experiment.add_arguments(p)
    return p


def parse(experiment: Experiment, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check ``experiment``'s command line; a mistake exits with code 2 and one line."""
    p = parser(experiment)
    args = p.parse_args(argv)
    try:
        experiment.check_args(args)
    except ValueError as e:
        p.error(str(e))
    return args


def chunk_indices(sweeps: Sequence[Sweep], chunk: tuple[int, int] | None) -> list[list[int]]:
    """Per sweep, the point numbers of the ``chunk`` = (I, N): the I-th of N contiguous pieces of
    all the sweeps' points in declaration order."""
    sizes = [len(s.points()) for s in sweeps]
    total = sum(sizes)
    lo, hi = (0, total) if chunk is None else (chunk[0] * total // chunk[1],
                                              (chunk[0] + 1) * total // chunk[1])
    out, first = [], 0
    for n in sizes:
        out.append([i for i in range(n) if lo <= first + i < hi])
        first += n
    return out


def _start(experiment: Experiment, args: argparse.Namespace) -> Run:
    """This process's rank: one rank of the torchrun job for ``per_gpu`` experiments (the
    process group started, NVLink multicast off), else the only process."""
    if experiment.launch == "in_process":
        return Run(args)
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit(f"{experiment.name} runs one process per GPU: start it with "
                         f"torchrun --standalone --nproc_per_node=N -m {_module(experiment)}")
    from ..dist_timing import start_rank
    local_rank, rank, world = start_rank()
    return Run(args, rank, world, local_rank, distributed=True)


def _stop(run: Run) -> None:
    if run.distributed:
        import torch
        import torch.distributed as dist
        dist.barrier(device_ids=[torch.cuda.current_device()])
        dist.destroy_process_group()


def run(experiment: Experiment, args: argparse.Namespace) -> Path | None:
    """Run ``experiment`` with parsed ``args``; returns what rank 0 wrote (the JSON output or the
    record), None on the other ranks."""
    from ..platform import git_commit
    try:
        sweeps = experiment.sweeps(args)
        git_commit()  # the record's commit, checked now, not when the run's end writes it
    except ValueError as e:  # options this machine cannot run, or a commit named wrong:
        parser(experiment).error(str(e))  # nothing launched
    chosen = chunk_indices(sweeps, args.chunk)
    run_ = _start(experiment, args)
    try:
        experiment.start(run_)
        for sweep, indices in zip(sweeps, chosen):  # every point, before the first launch
            points = sweep.points()
            for i in indices:
                experiment.validate(points[i], run_)
        run_.take_clock_unread()  # a reason from before this run is not this run's
        clocks_start = run_.gather(experiment.sm_clock_mhz(run_))
        started = time.time()
        progress = run_.rank == 0 and not args.no_progress
        frames = []

        def check(state):
            run_.require(experiment.check(state, run_), _label(state))

        def recheck(state):
            run_.require(experiment.recheck(state, run_), f"{_label(state)} after timing")

        def measure(state):
            rows = as_frame(experiment.measure(state, run_))
            if run_.rank == 0:
                line = experiment.progress_line(rows)
                if line:
                    print(line, flush=True)
            return rows

        for sweep, indices in zip(sweeps, chosen):
            if not indices:
                continue
            rows, _ = run_sweep(sweep, measure, prepare=lambda p: experiment.prepare(p, run_),
                                check=check, recheck=recheck, indices=indices,
                                progress=progress)
            frames.append(rows.assign(sweep=sweep.name) if len(sweeps) > 1 else rows)
        table = experiment.finish(pd.concat(frames, ignore_index=True) if frames
                                  else pd.DataFrame(), run_)
        clocks_end = run_.gather(experiment.sm_clock_mhz(run_))
        clock_unread = run_.gather(run_.take_clock_unread())
        written = None
        if run_.rank == 0:
            from ..platform import provenance
            header = {"experiment": experiment.record_name(args), "paper": experiment.paper,
                      "sweeps": [s.describe() for s in sweeps],
                      "chunk": None if args.chunk is None else "/".join(map(str, args.chunk)),
                      "world_size": run_.world, **experiment.metadata(run_),
                      "sm_clock_mhz_start": clocks_start, "sm_clock_mhz_end": clocks_end,
                      "sm_clock_unread": clock_unread, "wall_s": time.time() - started,
                      "provenance": provenance()}
            written = _write(experiment, args, header, table)
            print(f"wrote {written} ({len(table)} rows, {time.time() - started:.0f} s)", flush=True)
        return written
    finally:
        _stop(run_)


def _label(state) -> str:
    point = state if isinstance(state, dict) else getattr(state, "point", {})
    return " ".join(f"{k}={v}" for k, v in point.items()) or "a point"


def _write(experiment: Experiment, args, header: dict, table: pd.DataFrame) -> Path:
    if args.out is not None:
        write_output(args.out, header, _records(table), default=_plain)
        return args.out
    from ..records import save_output
    return save_output(header, table, header["experiment"], args.root, experiment.resolution)


def _records(table: pd.DataFrame) -> list[dict]:
    """The table's rows as JSON-ready dicts (NaN as null)."""
    return [{k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}
            for row in table.to_dict("records")]


def _plain(value):
    """JSON for numpy scalars and arrays (anything else as its text)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def main(experiment: Experiment, argv: Sequence[str] | None = None) -> Path | None:
    """The command line of ``experiment`` (``python -m <its module>``)."""
    return run(experiment, parse(experiment, argv))
