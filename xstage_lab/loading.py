"""``load``: what every notebook, the summary and the analysis read of an experiment's records.
This module is the one door to the records for everything above ``records``; it never measures.

``load(experiment, platform, backend, record)`` returns a ``Loaded``: a sequence with one view per
platform, in platform order. A view is the experiment's analysis (``Experiment.analyse`` of a
record, or ``Experiment.analyse_platform`` of all of a platform's records) where the experiment
declares one (the characterization with its calibration, the visibility latencies, each
precision's latest MoE kernel record), and the record itself elsewhere (records that no experiment
writes, a calibration or a forecast, included); ``Loaded.records`` are the records the views
read, for their headers and provenance.

The backend is chosen here, per link the experiment measures over (``platform.choose_backend``,
from the experiment's ``links``): a link that replays reads the committed records (every
platform of that link, or those named), a link measured live (``cuda``) the latest record of this
machine's platform for it (``h200-x1-host`` for the host link); on one GPU ``auto`` measures the
host link and replays NVLink. A live run is the launcher's (``launch.measure``: a notebook calls
it, then loads), never ``load``'s. ``Loaded.drawn`` says which platform, link and backend each
view came from, for the figures drawn from it (``plots.publish``).

Beside ``load``, what the analysis reads of the records by name: ``history`` (every record of a
platform, oldest first), ``record_paths``, ``latest``, ``read`` (a record file) and
``platforms``.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import records as _records
from .platform import LINKS, LOCAL, BackendChoice, choose_backend, platform_link
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


def _link_of(platform: str, links) -> str:
    """The link of ``platform``'s records of an experiment measured over ``links``: ``local``
    for a one-GPU experiment, else the platform's (``platform.platform_link``)."""
    return LOCAL if LOCAL in links else platform_link(platform)


@dataclass(frozen=True)
class Loaded(Sequence):
    """One view per platform, in platform order, and the backend of each link it was read over."""

    experiment: str
    views: tuple
    platforms: tuple[str, ...]                      # each view's platform
    choices: tuple[tuple[str, BackendChoice], ...]  # (link, its backend)

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

    def link(self, platform: str) -> str:
        """The link ``platform``'s views were read over."""
        return _link_of(platform, dict(self.choices))

    def choice(self, platform: str) -> BackendChoice:
        """The backend ``platform``'s view was read with."""
        return dict(self.choices)[self.link(platform)]

    def drawn(self, of=None) -> list[dict]:
        """What a figure drawn from every view, or from one (``of``: a view or its platform),
        came from, for ``plots.publish``: per view its platform, link and backend (``cuda``:
        measured live in this run; ``replay``: committed records)."""
        if of is None:
            names = self.platforms
        elif isinstance(of, str):
            names = (of,)
        else:
            names = tuple(p for v, p in zip(self.views, self.platforms) if v is of)
        return [{"platform": p, "link": self.link(p), "backend": self.choice(p).name}
                for p in names]

    def banner(self) -> str:
        banners = {link: choice.banner() for link, choice in self.choices}
        if len(set(banners.values())) == 1:
            return next(iter(banners.values()))
        return "; ".join(f"{link}: {banner}" for link, banner in banners.items())


def load(experiment: str, platform: str | list[str] | None = None, backend: str = "auto",
         record: str | None = None, root: Path | str | None = None,
         link: str | None = None) -> Loaded:
    """``experiment``'s records read, over each link it measures over (``link``: that one only),
    by the backend ``platform.choose_backend`` gives the link: where it replays, the latest
    record, or ``record``, of ``platform`` (a name, a list of names, or None for every platform
    of that link with records); where it is ``cuda``, the latest of this machine's platform for
    the link (what ``launch.measure`` just wrote). Records that no experiment writes (a
    calibration, a forecast) replay. An experiment without records raises, unless it is
    ``optional`` or ``link`` names one link (then: no views). ``root``: the records root (None:
    the committed records, or what ``XSTAGE_LAB_RECORDS`` names)."""
    from .experiments import links as declared_links

    root = _root(root)
    declared = _declaration(experiment)
    links = declared_links(experiment) or LINKS
    if link is not None and link not in links:
        raise ValueError(f"{experiment!r} is measured over {list(links)}, not {link!r}")
    links = links if link is None else (link,)
    choices = {ln: choose_backend(backend if declared is not None else "replay", link=ln)
               for ln in links}
    replayed = {ln for ln, c in choices.items() if c.name == "replay"}
    asked = ([platform] if isinstance(platform, str) else platform) or platforms(experiment, root)
    names = [p for p in asked if _link_of(p, links) in replayed]
    if len(replayed) < len(links):
        from .platform import platform_name
        names += [platform_name(link=ln) for ln in links if ln not in replayed]
        names = names if platform else sorted(names)
    if not names and link is None and not (declared is not None and declared.optional):
        raise FileNotFoundError(f"no {experiment!r} records under {root}")
    loaded = functools.partial(Loaded, experiment, platforms=tuple(names),
                               choices=tuple(choices.items()))
    if declared is None:
        return loaded(tuple(_records.resolve_record(experiment, p, record, root) for p in names))
    by_platform = [declared.analyse_platform(p, root) for p in names] if names else []
    if by_platform and all(v is not None for v in by_platform):
        if record is not None:
            raise ValueError(f"{experiment!r} is read from every record of a platform; "
                             f"no single record can be named")
        return loaded(tuple(by_platform))
    return loaded(tuple(declared.analyse(_records.resolve_record(experiment, p, record, root), root)
                        for p in names))
