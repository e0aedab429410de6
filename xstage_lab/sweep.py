"""The sweep harness shared by every experiment: declared axes, their product, warm-up, repeats
in rotated order, each point checked before its first repeat and after its last, the SM clock
before and after, a progress bar, and medians with spread."""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from tqdm.auto import tqdm


@dataclass(frozen=True)
class Axis:
    """A named axis. A value may be a dict of parameters that vary together (a source and a
    destination GPU, say): the point takes them, and the axis column a label of them."""

    name: str
    values: tuple

    def __init__(self, name: str, values: Sequence):
        if not values:
            raise ValueError(f"axis {name!r} has no values")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "values", tuple(values))


@dataclass(frozen=True)
class Sweep:
    """The cartesian product of ``axes``, each point completed by ``fixed`` parameters.

    Each point is measured ``warmup`` times unrecorded before its first recorded repeat; the
    ``repeats`` passes visit all points, each pass in an order rotated by ``len(points)/repeats``
    so that no point always runs first or right after the same neighbour.
    """

    name: str
    axes: tuple[Axis, ...]
    fixed: dict = field(default_factory=dict)
    repeats: int = 5
    warmup: int = 1

    def __post_init__(self):
        names = [a.name for a in self.axes]
        if len(set(names)) != len(names) or set(names) & set(self.fixed):
            raise ValueError(f"sweep {self.name!r}: axis names must be unique and not fixed")
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("repeats must be >= 1 and warmup >= 0")

    def points(self) -> list[dict]:
        out = []
        for combo in itertools.product(*(a.values for a in self.axes)):
            point = dict(self.fixed)
            for axis, value in zip(self.axes, combo):
                if isinstance(value, dict):
                    point.update(value)
                    value = ",".join(f"{k}={v}" for k, v in value.items())
                point[axis.name] = value
            out.append(point)
        return out

    def describe(self) -> dict:
        """The declaration as plain data, for a record's parameters."""
        return {"name": self.name, "axes": {a.name: list(a.values) for a in self.axes},
                "fixed": self.fixed, "repeats": self.repeats, "warmup": self.warmup}

    def order(self) -> list[tuple[int, int]]:
        """(repeat, point index) in execution order."""
        n = len(self.points())
        step = max(1, n // self.repeats)
        return [(r, (i + r * step) % n) for r in range(self.repeats) for i in range(n)]


Measure = Callable[[object], "pd.DataFrame | dict | list[dict]"]


def as_frame(rows) -> pd.DataFrame:
    """A measurement's rows as a table: a DataFrame as it is, a dict as one row, a list of dicts."""
    if isinstance(rows, pd.DataFrame):
        return rows
    return pd.DataFrame([rows] if isinstance(rows, dict) else list(rows))


def run_sweep(sweep: Sweep, measure: Measure, validate: Callable[[dict], None] | None = None,
              sm_clock_mhz: Callable[[], float] | None = None,
              progress: bool = True, *, prepare: Callable[[dict], object] | None = None,
              check: Callable[[object], None] | None = None,
              recheck: Callable[[object], None] | None = None,
              indices: Sequence[int] | None = None) -> tuple[pd.DataFrame, dict]:
    """Run ``measure`` at every point of ``sweep`` (or the points numbered ``indices``); return
    its rows tagged with the point's parameters, ``point``, ``repeat`` and ``order``, and a dict of
    run facts (clocks).

    ``validate`` sees every point before the first launch, so bad input fails before any work.
    ``prepare`` turns a point into what ``check`` and ``measure`` take (inputs, buffers, prepared
    launches; default: the point itself), once per point, kept until the point's last repeat;
    ``check`` sees it before the point's first warm-up, so a wrong result stops the sweep before
    that point is timed; ``recheck`` sees it after the point's last repeat, so a result that the
    timed runs left wrong stops the sweep too. ``measure`` returns a DataFrame, a dict (one row)
    or a list of dicts."""
    points = sweep.points()
    chosen = set(range(len(points)) if indices is None else indices)
    if validate is not None:
        for i in sorted(chosen):
            validate(points[i])
    order = [(rep, idx) for rep, idx in sweep.order() if idx in chosen]
    visits_left = Counter(idx for _, idx in order)
    facts = {"sm_clock_mhz_before": sm_clock_mhz() if sm_clock_mhz else None}
    states: dict[int, object] = {}
    frames = []
    for seq, (rep, idx) in enumerate(tqdm(order, desc=sweep.name, disable=not progress)):
        if idx not in states:
            states[idx] = points[idx] if prepare is None else prepare(points[idx])
            if check is not None:
                check(states[idx])
            for _ in range(sweep.warmup):
                measure(states[idx])
        rows = as_frame(measure(states[idx]))
        frames.append(rows.assign(point=idx, repeat=rep, order=seq, **points[idx]))
        visits_left[idx] -= 1
        if not visits_left[idx]:
            if recheck is not None:
                recheck(states[idx])
            states[idx] = None  # its buffers go before the next point's are made
    facts["sm_clock_mhz_after"] = sm_clock_mhz() if sm_clock_mhz else None
    return pd.concat(frames, ignore_index=True), facts


def median_spread(df: pd.DataFrame, by: Sequence[str], *values: str) -> pd.DataFrame:
    """Per group of ``by``, the median of each of ``values`` with its interquartile spread and
    count (columns ``v``, ``v_p25``, ``v_p75``, ``v_n`` per value ``v``), the groups made once
    for all of them. The median and count skip NaN; the spread is ``np.percentile``'s of the
    whole group, so NaN where the group holds one."""
    g = df.groupby(list(by), sort=True)
    medians, counts = g[list(values)].median(), g[list(values)].count()
    codes = g.ngroup().fillna(-1).to_numpy(dtype=np.intp)  # -1: a row whose keys hold NaN
    out = medians[[]]
    for v in values:
        out[v] = medians[v]
        for q in (25, 75):
            out[f"{v}_p{q}"] = _group_percentile(codes, df[v].to_numpy(), len(out), q)
        out[f"{v}_n"] = counts[v]
    return out.reset_index()


def _group_percentile(codes: np.ndarray, values: np.ndarray, groups: int, q: float) -> np.ndarray:
    """``np.percentile(values[codes == i], q)`` for every group i < ``groups`` at once, with the
    same arithmetic (a lambda per group through pandas cost most of a calibration): linear
    interpolation between the sorted neighbours of rank (n - 1)·q/100, NaN for a group that
    holds NaN."""
    keep = codes >= 0
    codes, values = codes[keep], values[keep]
    order = np.lexsort((values, codes))
    codes, values = codes[order], values[order]
    sizes = np.bincount(codes, minlength=groups)
    first = np.cumsum(sizes) - sizes
    rank = (sizes - 1) * (q / 100)
    below = np.floor(rank).astype(np.intp)
    a = values[first + below]
    b = values[first + np.minimum(below + 1, sizes - 1)]
    # np.percentile's weight: a Python float, which takes a float array's own precision
    t = (rank - below).astype(values.dtype if values.dtype.kind == "f" else np.float64)
    diff = b - a
    out = np.where(t >= 0.5, b - diff * (1 - t), a + diff * t)
    holds_nan = np.bincount(codes, weights=np.isnan(values), minlength=groups) > 0
    return np.where(holds_nan, np.nan, out)
