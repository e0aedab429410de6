"""``load``: what every notebook and the summary read of an experiment, live or from the records.

The backend is chosen here and nowhere else: ``cuda`` measures on this machine (a new record,
read back), ``replay`` reads the committed records, ``auto`` picks ``cuda`` where two
peer-capable GPUs exist (``platform.choose_backend``). Experiments whose records are computed
from other records on the CPU (``moe_forecast``) or written by another experiment's run
(``calibration``) have no live measurement: they are always read.

Whichever the backend, ``load`` returns a ``Loaded``: a sequence with one view per platform, in
platform order. A view is the experiment's analysis of its record (``Experiment.analyse``)
where it has one (``VIEWS``: the characterization with its calibration, the visibility latencies,
each precision's latest MoE kernel record) and the record itself elsewhere; ``Loaded.records``
are the records the views read, for their headers and provenance.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .platform import BackendChoice, choose_backend
from .records import RECORDS_DIR, Record, platforms, read_record, resolve_record


@dataclass(frozen=True)
class View:
    """How ``load`` reads an experiment: ``of_record(record, root)`` -> the view of one record;
    ``of_platform(platform, root)``, where set, the view of a platform from all its records
    (no single ``record`` can then be named); ``records(view)`` -> the records a view read."""

    of_record: Callable[[Record, Path], object]
    records: Callable[[object], tuple[Record, ...]]
    of_platform: Callable[[str, Path], object] | None = None


def _analysis(experiment: str) -> Callable[[Record, Path], object]:
    """The experiment's analysis of one record (``harness.Experiment.analyse``)."""
    def of_record(rec: Record, root: Path):
        from .experiments import experiment as registered
        return registered(experiment).analyse(rec, root)
    return of_record


def _latest_kernel_view(platform: str, root: Path):
    from .analysis.moe.kernel_view import latest_view

    return latest_view(platform, root)


VIEWS = {"remote_store": View(_analysis("remote_store"), lambda c: (c.record,)),
         "visibility": View(_analysis("visibility"), lambda v: (v.record,)),
         "moe_kernel": View(_analysis("moe_kernel"), lambda k: tuple(k.records),
                            _latest_kernel_view)}
RECORD = View(lambda rec, root: rec, lambda rec: (rec,))
# Experiments a notebook shows where they exist: no record is an empty ``Loaded``, not an error.
OPTIONAL = frozenset({"visibility", "remote_patterns", "remote_ops"})


@dataclass(frozen=True)
class Loaded(Sequence):
    """One view per platform (``VIEWS``), in platform order, and the backend that produced them."""

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
        reader = VIEWS.get(self.experiment, RECORD).records
        return [rec for view in self.views for rec in reader(view)]

    def banner(self) -> str:
        return self.choice.banner()


def load(experiment: str, platform: str | list[str] | None = None, backend: str = "auto",
         record: str | None = None, root: Path | str | None = None) -> Loaded:
    """``experiment`` measured live (``cuda``: one new record on this machine) or read
    (``replay``: the latest record, or ``record``, of ``platform``: a name, a list of names, or
    None for every platform with records). ``root``: the records root (None: the committed
    records, or what ``XSTAGE_LAB_RECORDS`` names)."""
    from .launch import live_record

    root = RECORDS_DIR if root is None else Path(root)
    view = VIEWS.get(experiment, RECORD)
    measure = live_record(experiment)
    choice = choose_backend(backend if measure is not None else "replay")
    if choice.name == "cuda":
        return Loaded(experiment, choice, (view.of_record(read_record(measure(root)), root),))
    names = ([platform] if isinstance(platform, str) else platform) or platforms(experiment, root)
    if not names and experiment not in OPTIONAL:
        raise FileNotFoundError(f"no {experiment!r} records under {root}")
    if view.of_platform is not None:
        if record is not None:
            raise ValueError(f"{experiment!r} is read from every record of a platform; "
                             f"no single record can be named")
        return Loaded(experiment, choice, tuple(view.of_platform(p, root) for p in names))
    return Loaded(experiment, choice,
                  tuple(view.of_record(resolve_record(experiment, p, record, root), root)
                        for p in names))
