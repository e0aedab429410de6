"""The sweep harness: axes, product, rotated repeat order, validate-first, warm-up, tagging."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd
import pytest

from xstage_lab.sweep import Axis, Sweep, median_spread, run_sweep


def test_axis_rejects_empty_and_keeps_values():
    with pytest.raises(ValueError, match="no values"):
        Axis("gap_us", [])
    a = Axis("gap_us", [0.0, 1.0])
    assert a.values == (0.0, 1.0)
    assert a.name == "gap_us"


def test_sweep_declaration_checks():
    with pytest.raises(ValueError):
        Sweep("s", (Axis("a", [1]), Axis("a", [2])))
    with pytest.raises(ValueError):
        Sweep("s", (Axis("a", [1]),), fixed={"a": 3})
    with pytest.raises(ValueError):
        Sweep("s", (Axis("a", [1]),), repeats=0)
    with pytest.raises(ValueError):
        Sweep("s", (Axis("a", [1]),), warmup=-1)


def test_points_are_the_product_with_fixed_merged():
    sw = Sweep("s", (Axis("path", ["remote", "local"]), Axis("burst_bytes", [16, 32, 64])),
               fixed={"src": 0, "dst": 1})
    pts = sw.points()
    assert len(pts) == 2 * 3
    # first axis varies slowest
    assert [(p["path"], p["burst_bytes"]) for p in pts] == [
        ("remote", 16), ("remote", 32), ("remote", 64), ("local", 16), ("local", 32), ("local", 64)]
    assert all(p["src"] == 0 and p["dst"] == 1 for p in pts)
    # each point is its own dict
    pts[0]["src"] = 99
    assert sw.points()[0]["src"] == 0
    d = sw.describe()
    assert d["axes"] == {"path": ["remote", "local"], "burst_bytes": [16, 32, 64]}
    assert d["fixed"] == {"src": 0, "dst": 1} and d["repeats"] == 5 and d["warmup"] == 1


def test_dict_valued_axis_merges_and_labels():
    routes = [{"src": 0, "dst": 1}, {"src": 1, "dst": 0}]
    sw = Sweep("pairs", (Axis("route", routes), Axis("burst_bytes", [64, 256])),
               fixed={"mode": "periodic"})
    pts = sw.points()
    assert len(pts) == 4
    assert pts[0] == {"mode": "periodic", "src": 0, "dst": 1, "route": "src=0,dst=1",
                      "burst_bytes": 64}
    assert pts[3] == {"mode": "periodic", "src": 1, "dst": 0, "route": "src=1,dst=0",
                      "burst_bytes": 256}


def _sweep(n_a=3, n_b=2, repeats=3, warmup=1):
    return Sweep("s", (Axis("a", list(range(n_a))), Axis("b", list(range(10, 10 + n_b)))),
                 fixed={"f": "x"}, repeats=repeats, warmup=warmup)


@pytest.mark.parametrize("n_a,n_b,repeats", [(3, 2, 3), (5, 1, 2), (2, 1, 5), (4, 3, 4),
                                             (1, 1, 3), (7, 1, 3)])
def test_order_visits_each_repeat_point_once(n_a, n_b, repeats):
    sw = _sweep(n_a, n_b, repeats)
    n = n_a * n_b
    order = sw.order()
    assert len(order) == n * repeats
    assert Counter(order) == Counter((r, i) for r in range(repeats) for i in range(n))
    # passes are contiguous and in order of repeat
    assert [r for r, _ in order] == [r for r in range(repeats) for _ in range(n)]
    firsts = [order[r * n][1] for r in range(repeats)]
    if n >= repeats:
        # every pass starts at a different point
        assert len(set(firsts)) == repeats
        assert all(f != firsts[0] for f in firsts[1:])


def test_order_rotation_hand_worked():
    # n = 6, repeats = 3 → step = 6 // 3 = 2: passes start at 0, 2, 4
    order = _sweep(3, 2, 3).order()
    assert [i for _, i in order] == [0, 1, 2, 3, 4, 5,
                                     2, 3, 4, 5, 0, 1,
                                     4, 5, 0, 1, 2, 3]


class Spy:
    """A measure that logs every call and returns rows carrying the call number."""

    def __init__(self, rows_per_call=2, log=None):
        self.calls = []
        self.rows_per_call = rows_per_call
        self.log = log if log is not None else []

    def __call__(self, p):
        self.calls.append(dict(p))
        self.log.append(("measure", p["a"], p["b"]))
        call = len(self.calls) - 1
        return pd.DataFrame({"burst": np.arange(self.rows_per_call),
                             "call": call, "value": float(p["a"] * 100 + p["b"])})


def test_validate_sees_every_point_before_any_measure():
    sw = _sweep()
    pts = sw.points()
    seen = []
    spy = Spy()

    def validate(p):
        seen.append(dict(p))
        if p == pts[-1]:
            raise ValueError("bad last point")

    with pytest.raises(ValueError, match="bad last point"):
        run_sweep(sw, spy, validate=validate, progress=False)
    assert spy.calls == []
    assert seen == pts


def test_run_sweep_warmup_tagging_and_clock():
    sw = _sweep(3, 2, repeats=3, warmup=2)
    n = 6
    log = []
    spy = Spy(rows_per_call=2, log=log)
    clock_values = iter([1410.0, 1980.0])

    def clock():
        log.append(("clock",))
        return next(clock_values)

    rows, facts = run_sweep(sw, spy, validate=lambda p: log.append(("validate",)),
                            sm_clock_mhz=clock, progress=False)
    # validate ×6, clock, measures, clock
    assert log[:n] == [("validate",)] * n
    assert log[n] == ("clock",) and log[-1] == ("clock",)
    assert sum(1 for e in log if e == ("clock",)) == 2
    assert facts == {"sm_clock_mhz_before": 1410.0, "sm_clock_mhz_after": 1980.0}

    # each point measured warmup + repeats times; only the repeats are recorded
    assert len(spy.calls) == n * (2 + 3)
    assert len(rows) == n * 3 * 2
    assert Counter((c["a"], c["b"]) for c in spy.calls) == {
        (p["a"], p["b"]): 5 for p in sw.points()}
    recorded = set(rows["call"])
    assert len(recorded) == n * 3
    # the two calls before the first recorded call of a point are its warm-ups, on the same point
    pts = sw.points()
    for idx in range(n):
        first = rows.loc[rows["point"] == idx, "call"].min()
        assert first >= 2
        for w in (first - 1, first - 2):
            assert w not in recorded
            assert (spy.calls[w]["a"], spy.calls[w]["b"]) == (pts[idx]["a"], pts[idx]["b"])

    # tags: point, repeat, order and the point's parameters
    order = sw.order()
    for seq, (rep, idx) in enumerate(order):
        sel = rows[rows["order"] == seq]
        assert len(sel) == 2
        assert (sel["repeat"] == rep).all() and (sel["point"] == idx).all()
        assert (sel["a"] == pts[idx]["a"]).all() and (sel["b"] == pts[idx]["b"]).all()
        assert (sel["f"] == "x").all()
        assert (sel["value"] == pts[idx]["a"] * 100 + pts[idx]["b"]).all()
    assert sorted(rows["order"].unique()) == list(range(len(order)))
    # recorded calls run in execution order
    assert rows.groupby("order")["call"].first().is_monotonic_increasing


def test_run_sweep_without_clock_or_warmup():
    sw = _sweep(2, 1, repeats=2, warmup=0)
    spy = Spy(rows_per_call=1)
    rows, facts = run_sweep(sw, spy, progress=False)
    assert facts == {"sm_clock_mhz_before": None, "sm_clock_mhz_after": None}
    assert len(spy.calls) == 4 and len(rows) == 4
    assert sorted(rows["call"]) == [0, 1, 2, 3]


def test_median_spread_values():
    df = pd.DataFrame({"k": ["a"] * 4 + ["b"], "j": [1, 1, 1, 1, 2],
                       "v": [4.0, 1.0, 3.0, 2.0, 10.0]})
    out = median_spread(df, ["k", "j"], "v")
    assert list(out.columns) == ["k", "j", "v", "v_p25", "v_p75", "v_n"]
    a = out[out["k"] == "a"].iloc[0]
    # [1, 2, 3, 4]: median 2.5; p25 at rank 0.75 → 1 + 0.75 = 1.75; p75 at rank 2.25 → 3.25
    assert (a["v"], a["v_p25"], a["v_p75"], a["v_n"]) == (2.5, 1.75, 3.25, 4)
    b = out[out["k"] == "b"].iloc[0]
    assert (b["v"], b["v_p25"], b["v_p75"], b["v_n"]) == (10.0, 10.0, 10.0, 1)


def test_median_spread_of_several_values_and_nan_as_np_percentile():
    """Each value as if alone; the median and count skip NaN, the spread is np.percentile's of the
    whole group (NaN where it holds one); rows whose keys hold NaN belong to no group."""
    df = pd.DataFrame({"k": ["a"] * 5 + ["b"] * 3 + [None],
                       "v": [5.0, 1.0, 4.0, 2.0, 3.0, 1.0, np.nan, 3.0, 9.0],
                       "w": [0.5, 0.25, 8.0, 1.0, 2.0, 7.0, 6.0, 5.0, 9.0]})
    out = median_spread(df, ["k"], "v", "w")
    assert list(out.columns) == ["k", "v", "v_p25", "v_p75", "v_n", "w", "w_p25", "w_p75", "w_n"]
    for value in ("v", "w"):
        alone = median_spread(df, ["k"], value)
        pd.testing.assert_frame_equal(out[alone.columns], alone)
        for _, row in out.iterrows():
            group = df.loc[df["k"] == row["k"], value].to_numpy()
            for q in (25, 75):
                want = np.percentile(group, q)
                assert row[f"{value}_p{q}"] == want or (np.isnan(want) and
                                                        np.isnan(row[f"{value}_p{q}"]))
    b = out[out["k"] == "b"].iloc[0]
    assert (b["v"], b["v_n"]) == (2.0, 2) and np.isnan(b["v_p25"]) and np.isnan(b["v_p75"])
