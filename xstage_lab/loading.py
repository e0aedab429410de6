"""``load``: what every notebook, the summary and the analysis read of an experiment's records.
This module is the one door to the records for everything above ``records``; it never measures.

``load(experiment, platform, backend, record)`` returns a ``Loaded``: a sequence with one view per
platform, in platform order. A view is the experiment's analysis (``Experiment.analyse`` of a
record, or ``Experiment.analyse_platform`` of all of a platform's records) where the experiment
declares one (the characterization with its calibration, the visibility latencies, each
precision's latest MoE kernel record), and the record itself elsewhere (records that no experiment
writes, a calibration or a forecast, included); ``Loaded.records`` are the records the views
read, for their headers and provenance.

The backend is chosen here: ``replay`` reads the committed records (every platform, or those
named), ``cuda`` the latest record of this machine's platform, ``auto`` picks ``cuda`` where two
peer-capable GPUs exist (``platform.choose_backend``). A live run is the launcher's
(``launch.measure``: a notebook calls it, then loads), never ``load``'s.

Beside ``load``, what the analysis reads of the records by name: ``history`` (every record of a
platform, oldest first), ``record_paths``, ``latest``, ``read`` (a record file) and
``platforms``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import records as _records
from .platform import BackendChoice, choose_backend
from .records import RECORDS_DIR, Record


def _root(root: Path | str | None) -> Path:
    return RECORDS_DIR if root is None else Path(root)


def read(path: Path | str) -> Record:
    """The record at ``path`` (a Parquet file of a records root)."""
    return _records.read_record(path)


def record_paths(experiment: str, platform: str | None = None,
                 root: Path | str | None = None) -> list[Path]:
    """The paths of ``experiment``'s records (of ``platform`` where given), oldest first, less
    those the errata mark invalid."""
    return _records.list_records(experiment, platform, _root(root))


def history(experiment: str, platform: str, root: Path | str | None = None) -> list[Record]:
    """Every record of ``experiment`` on ``platform``, oldest first."""
    return [read(p) for p in record_paths(experiment, platform, root)]


def latest(experiment: str, platform: str, root: Path | str | None = None) -> Record:
    """The latest record of ``experiment`` on ``platform`` (FileNotFoundError where none)."""
    return _records.latest_record(experiment, platform, _root(root))


def platforms(experiment: str, root: Path | str | None = None) -> list[str]:
    """The platforms with ``experiment`` records, sorted."""
    return _records.platforms(experiment, _root(root))


def _declaration(experiment: str):
    """The ``Experiment`` that writes ``experiment`` records (None for records that none
    writes)."""
    from .experiments import EXPERIMENTS
    from .experiments import experiment as registered

    return registered(experiment) if experiment in EXPERIMENTS else None


@dataclass(frozen=True)
class Loaded(Sequence):
    """One view per platform, in platform order, and the backend that produced them."""

    experiment: str
    choice: BackendChoice
    views: tuple

    def __getitem__(self, i):
        return self.views[i]

    def __len__(self) -> int:
        return len(self.views)

    @property
    def records(self) -> list[Record]:
        """The records the views read, platform by platform."""
        declared = _declaration(self.experiment)
        if declared is None:
            return list(self.views)
        return [rec for view in self.views for rec in declared.view_records(view)]

    def banner(self) -> str:
        return self.choice.banner()


def load(experiment: str, platform: str | list[str] | None = None, backend: str = "auto",
         record: str | None = None, root: Path | str | None = None) -> Loaded:
    """``experiment``'s records read: under ``replay`` the latest record, or ``record``, of
    ``platform`` (a name, a list of names, or None for every platform with records); under
    ``cuda`` the latest of this machine's platform (what ``launch.measure`` just wrote). ``root``:
    the records root (None: the committed records, or what ``XSTAGE_LAB_RECORDS`` names)."""
    root = _root(root)
    declared = _declaration(experiment)
    choice = choose_backend(backend if declared is not None else "replay")
    if choice.name == "cuda":
        from .platform import platform_name
        names = [platform_name()]
    else:
        names = ([platform] if isinstance(platform, str) else platform) or platforms(experiment,
                                                                                     root)
    if not names and not (declared is not None and declared.optional):
        raise FileNotFoundError(f"no {experiment!r} records under {root}")
    if declared is None:
        return Loaded(experiment, choice,
                      tuple(_records.resolve_record(experiment, p, record, root) for p in names))
    by_platform = [declared.analyse_platform(p, root) for p in names] if names else []
    if by_platform and all(v is not None for v in by_platform):
        if record is not None:
            raise ValueError(f"{experiment!r} is read from every record of a platform; "
                             f"no single record can be named")
        return Loaded(experiment, choice, tuple(by_platform))
    return Loaded(experiment, choice,
                  tuple(declared.analyse(_records.resolve_record(experiment, p, record, root), root)
                        for p in names))
