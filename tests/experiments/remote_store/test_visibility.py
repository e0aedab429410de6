"""Receiver-side visibility latency (issue 8 part 2): the ping-pong offset estimator, the timer
resolution, latencies from synthetic stamps with a known offset and drift, validation before
launch, the record's size, the summary sub-entry, the figure, and the CUDA source (nvcc)."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from xstage_lab import model
from xstage_lab.experiments.remote_store import visibility as vis
from xstage_lab.analysis.remote_store.visibility import (
    add_latency, aggregate_bursts, alignment_summary, completion_comparison, first_burst_points,
    latency_points, offset_at, summary_entry, timer_resolution)
from xstage_lab.experiments.remote_store.visibility import visibility_sweep
from xstage_lab.ops.remote_store.visibility import (KIB, VisibilitySettings, clock_offset,
                                                    stamp_rows, validate_point)
from xstage_lab.records import read_record, write_record

from ..cuda_testing import compile_sm90, needs_nvcc
from .test_characterization import make_inv

CU = Path(__file__).resolve().parents[3] / "kernels" / "visibility_latency.cu"
KERNELS = ("visibility_sender", "visibility_receiver", "clock_pingpong", "globaltimer_steps")
INV2 = make_inv(2)
GOOD = dict(producers=132, burst_bytes=16 * KIB, gap_us=8.0, src=0, dst=1)
T_BASE = 1_764_000_000_000_000_000   # a %globaltimer value of 2026 (ns since 1970)


# --- validation --------------------------------------------------------------------------------

def test_good_points_accepted():
    assert validate_point(GOOD, INV2) is None
    validate_point(dict(GOOD, producers=1, burst_bytes=16, gap_us=0.0, src=1, dst=0), INV2)
    validate_point(dict(GOOD, burst_bytes=np.int64(64 * KIB)), INV2)
    for p in visibility_sweep(132).points():
        validate_point(p, INV2)


@pytest.mark.parametrize("change,match", [
    (dict(burst_bytes=1000), r"multiple of 16"),
    (dict(burst_bytes=0), r"positive multiple of 16"),
    (dict(burst_bytes=4096.0), r"multiple of 16"),
    (dict(producers=133), r"producers K=133 must be in 1\.\.132"),
    (dict(producers=0), r"producers K=0"),
    (dict(gap_us=-1.0), r"gap_us G=-1\.0 must not be negative"),
    (dict(gap_us=float("nan")), r"must not be negative"),
    (dict(dst=0), r"another GPU than the sender"),
    (dict(dst=2), r"must name GPUs 0\.\.1"),
])
def test_bad_points_rejected(change, match):
    with pytest.raises(ValueError, match=match):
        validate_point(dict(GOOD, **change), INV2)


def test_peer_access_needed_both_ways():
    one_way = make_inv(2)
    one_way = type(one_way)(gpus=one_way.gpus, peer=((False, True), (False, False)))
    with pytest.raises(ValueError, match="peer access both ways"):
        validate_point(GOOD, one_way)


@pytest.mark.parametrize("settings,match", [
    (VisibilitySettings(store_threads=100), "store threads"),
    (VisibilitySettings(checker_threads=0), "checker threads"),
    (VisibilitySettings(bursts=0), "at least one burst"),
    (VisibilitySettings(pingpong_rounds=10, pingpong_warmup=10), "ping-pong rounds"),
])
def test_bad_settings_rejected(settings, match):
    with pytest.raises(ValueError, match=match):
        validate_point(GOOD, INV2, settings)


def test_smaller_gpu_bounds_producers():
    inv = make_inv(2)
    small = type(inv)(gpus=(inv.gpus[0], type(inv.gpus[1])(**{**inv.gpus[1].__dict__,
                                                               "sm_count": 100})),
                      peer=inv.peer)
    with pytest.raises(ValueError, match=r"1\.\.100"):
        validate_point(GOOD, small)


# --- clock alignment ---------------------------------------------------------------------------

def pingpong_stamps(theta: int, n: int = 400, seed: int = 0, base: int = T_BASE):
    """Initiator (t0, t3) and responder (t1, t2) stamps for a true offset ``theta`` (responder −
    initiator): most rounds have asymmetric one-way delays (queueing on one leg), a few are
    symmetric at the floor."""
    rng = np.random.default_rng(seed)
    t0 = base + np.arange(n, dtype=np.int64) * 5000
    floor = 800
    out_leg = floor + rng.integers(0, 600, n)
    back_leg = floor + rng.integers(0, 600, n)
    symmetric = rng.random(n) < 0.15
    back_leg[symmetric] = out_leg[symmetric] = floor
    turn = rng.integers(30, 90, n)                      # responder's stamp-to-stamp time
    t1 = t0 + out_leg + theta
    t2 = t1 + turn
    t3 = t2 - theta + back_leg
    return np.stack([t0, t3], 1), np.stack([t1, t2], 1)


@pytest.mark.parametrize("theta", [0, 12_345, -987_654_321])
def test_clock_offset_recovers_known_offset(theta):
    init, resp = pingpong_stamps(theta)
    fit = clock_offset(init, resp, warmup=5, keep=0.1)
    # the kept rounds are the symmetric ones: exact
    assert fit["offset_ns"] == pytest.approx(theta, abs=0.5)
    assert fit["rtt_min_ns"] == 1600
    assert fit["uncertainty_ns"] == 800
    assert fit["rounds"] == 395 and fit["kept"] == 40
    # every round's θ is within RTT/2 of the truth; the all-round median is biased only by noise
    assert abs(fit["offset_all_rounds_ns"] - theta) < 300
    assert fit["rtt_median_ns"] > fit["rtt_min_ns"]
    assert init[5, 0] <= fit["t_ref_ns"] <= init[-1, 0]


def test_clock_offset_error_bounded_by_half_rtt_when_no_round_is_symmetric():
    init, resp = pingpong_stamps(5000, seed=3)
    init, resp = init.copy(), resp.copy()
    resp += 200                 # every outbound leg 200 ns slower: θ over-estimated by 100
    init[:, 1] += 200
    fit = clock_offset(init, resp)
    assert fit["rtt_min_ns"] == 1800
    assert abs(fit["offset_ns"] - 5000) <= fit["uncertainty_ns"]
    assert fit["offset_ns"] == pytest.approx(5100, abs=0.5)


def test_clock_offset_keeps_int64_precision():
    # at 2^60 ns float64 would round stamps to 256 ns; the estimator must not
    init, resp = pingpong_stamps(37, base=2**60 + 12_345)
    assert clock_offset(init, resp)["offset_ns"] == pytest.approx(37, abs=0.5)


@pytest.mark.parametrize("mutate,match", [
    (lambda i, r: (i, r[:-1]), "matching"),
    (lambda i, r: (i.ravel(), r.ravel()), "matching"),
    (lambda i, r: (np.where(np.arange(len(i))[:, None] == 3, 0, i), r), "did not complete"),
    (lambda i, r: (i[:, ::-1], r), "out of order"),
])
def test_clock_offset_rejects_bad_stamps(mutate, match):
    init, resp = pingpong_stamps(0)
    with pytest.raises(ValueError, match=match):
        clock_offset(*mutate(init, resp))


def test_timer_resolution():
    steps = np.array([32, 64, 32, 96, 0, 0, 32], dtype=np.uint64)
    r = timer_resolution(steps)
    assert r == {"resolution_ns": 32, "median_step_ns": 32.0, "steps": 5}
    assert timer_resolution([1000, 1024, 992])["resolution_ns"] == 992
    with pytest.raises(ValueError, match="no %globaltimer increment"):
        timer_resolution(np.zeros(8, np.uint64))


def test_offset_interpolates_drift():
    before = {"offset_ns": 1000.0, "t_ref_ns": T_BASE}
    after = {"offset_ns": 1300.0, "t_ref_ns": T_BASE + 3_000_000_000}
    got = offset_at([T_BASE, T_BASE + 1_000_000_000, T_BASE + 3_000_000_000], before, after)
    np.testing.assert_allclose(got, [1000.0, 1100.0, 1300.0])
    with pytest.raises(ValueError, match="must come after"):
        offset_at([T_BASE], after, before)


def test_alignment_summary_bounds_and_swap_check():
    fwd_b = clock_offset(*pingpong_stamps(2000, seed=1))
    fwd_a = clock_offset(*pingpong_stamps(2600, seed=2, base=T_BASE + 2_000_000_000))
    # receiver-initiated: its θ is t_src − t_dst
    rev_b = clock_offset(*pingpong_stamps(-2000, seed=4))
    rev_a = clock_offset(*pingpong_stamps(-2600, seed=5, base=T_BASE + 2_000_000_000))
    res = {"resolution_ns": 32, "median_step_ns": 32.0, "steps": 512}
    a = alignment_summary(fwd_b, fwd_a, rev_b, rev_a, res, dict(res, resolution_ns=64))
    assert a["drift_ns"] == pytest.approx(600, abs=1)
    assert a["drift_ns_per_s"] == pytest.approx(300, rel=0.01)
    assert a["swap_check_ns"] == pytest.approx([0, 0], abs=1)
    assert a["uncertainty_ns"] == pytest.approx(800 + 64)


# --- latency from stamps -------------------------------------------------------------------------

def synthetic_launch(K, B, G, theta_fn, n=6, rate_GBps=400.0, t_lat_us=2.0, start=T_BASE,
                     seed=0):
    """Sender [n, K, 3] and receiver [n, K] stamps of one launch: burst b of producer p issues
    for a known time, its flag becomes visible ``latency`` ns after issue end (sender clock),
    the receiver stamps on its own clock (sender clock + θ(t))."""
    rng = np.random.default_rng(seed)
    issue = int(100 + B / 64)                                   # ns
    latency = int(model.drain_time(K * B, rate_GBps) * 1e3 + t_lat_us * 1e3)
    tx = np.zeros((n, K, 3), np.int64)
    rx = np.zeros((n, K), np.int64)
    t = start
    for b in range(n):
        skew = rng.integers(0, 40, K)
        tx[b, :, 0] = t + skew
        tx[b, :, 1] = tx[b, :, 0] + issue
        tx[b, :, 2] = tx[b, :, 1] + latency - 300
        visible_src = tx[b, :, 1] + latency
        rx[b] = visible_src + np.rint(theta_fn(tx[b, :, 1])).astype(np.int64)
        t = int(tx[b, :, 1].max()) + int(G * 1e3)
    return tx, rx, latency


def synthetic_table(theta_fn, sweep=None, repeats=2, **kw):
    sweep = sweep or visibility_sweep(132, repeats=repeats)
    frames, t = [], T_BASE
    for rep in range(sweep.repeats):
        for idx, p in enumerate(sweep.points()):
            tx, rx, _ = synthetic_launch(p["producers"], p["burst_bytes"], p["gap_us"], theta_fn,
                                         start=t, n=VisibilitySettings().bursts, **kw)
            t = int(rx.max()) + 1_000_000
            frames.append(stamp_rows(tx, rx).assign(gap_set_us=p["gap_us"], point=idx,
                                                    repeat=rep, order=0, **p))
    return pd.concat(frames, ignore_index=True)


def test_stamp_rows_layout():
    tx = np.arange(2 * 3 * 3).reshape(2, 3, 3) + 1
    rx = np.arange(6).reshape(2, 3) + 100
    rows = stamp_rows(tx, rx)
    assert list(rows["burst"]) == [0, 0, 0, 1, 1, 1] and list(rows["producer"]) == [0, 1, 2] * 2
    r = rows.iloc[4]     # burst 1, producer 1
    assert (r.t_iss_start_ns, r.t_iss_end_ns, r.t_release_ns, r.t_visible_ns) == (13, 14, 15, 104)
    with pytest.raises(ValueError, match="do not match"):
        stamp_rows(tx[:, :2], rx)


def test_latency_recovered_with_offset_and_drift():
    before = {"offset_ns": -5_000_000.0, "t_ref_ns": T_BASE - 1_000_000}
    after = {"offset_ns": -4_999_000.0, "t_ref_ns": T_BASE + 50_000_000}
    theta = lambda t: offset_at(t, before, after)                        # noqa: E731
    tx, rx, latency = synthetic_launch(33, 16 * KIB, 8.0, theta)
    rows = add_latency(stamp_rows(tx, rx), {"before": before, "after": after})
    np.testing.assert_allclose(rows["latency_us"], latency / 1e3, atol=2e-3)
    issue = (tx[:, :, 1] - tx[:, :, 0]).ravel() / 1e3
    np.testing.assert_allclose(rows["latency_from_start_us"], latency / 1e3 + issue, atol=2e-3)
    np.testing.assert_allclose(rows["release_to_visible_us"], 0.3, atol=2e-3)
    np.testing.assert_allclose(rows["release_us"], latency / 1e3 - 0.3)
    # ignoring the drift would be wrong by up to the drift (1 µs) at the far end
    no_drift = {"before": before, "after": dict(before, t_ref_ns=after["t_ref_ns"])}
    fixed = add_latency(stamp_rows(tx, rx), no_drift)
    assert (fixed["latency_us"] - rows["latency_us"]).abs().max() > 1e-3


def test_completion_comparison_matches_model_when_latency_is_the_model():
    theta = lambda t: np.full(np.shape(t), 777.0)                        # noqa: E731
    table = add_latency(synthetic_table(theta, repeats=1, t_lat_us=2.1),
                        {"before": {"offset_ns": 777.0, "t_ref_ns": T_BASE},
                         "after": {"offset_ns": 777.0, "t_ref_ns": T_BASE + 10**12}})
    cmp = completion_comparison(table, 400.0, 2.1)
    # only the gaps whose next burst starts after this one's last flag: G >= V/R + T_lat here
    want_gap = np.where(cmp["producers"] * cmp["burst_bytes"] == 132 * 64 * KIB, 24.0, 8.0)
    assert len(cmp) == 9 and list(cmp["gap_min_us"]) == list(want_gap)
    assert list(cmp["launches"]) == [2 if g == 24.0 else 3 for g in want_gap]
    # visible from start = issue + (V/R + T_lat): the difference is the issue time alone
    issue_us = (100 + cmp["burst_bytes"] / 64) / 1e3
    np.testing.assert_allclose(cmp["diff_us"], issue_us, atol=3e-3)
    # the aggregate adds the start skew (< 40 ns) between producers
    assert ((cmp["aggregate_diff_us"] - cmp["diff_us"]) > -1e-3).all()
    assert ((cmp["aggregate_diff_us"] - cmp["diff_us"]) < 0.05).all()
    pts = latency_points(table)
    assert len(pts) == 45
    want = model.drain_time(pts["producers"] * pts["burst_bytes"], 400.0) + 2.1
    np.testing.assert_allclose(pts["latency_us"], want, atol=2e-3)
    agg = aggregate_bursts(table)
    assert len(agg) == 45 * VisibilitySettings().bursts


def test_overlapped_first_bursts_are_kept_out_of_the_comparison():
    """A first burst whose flag queues behind the next burst (G shorter than its completion)
    shows both bursts' drain: it is reported per gap but not compared with T_complete."""
    theta = lambda t: np.full(np.shape(t), 0.0)                          # noqa: E731
    align = {"before": {"offset_ns": 0.0, "t_ref_ns": T_BASE},
             "after": {"offset_ns": 0.0, "t_ref_ns": T_BASE + 10**12}}
    raw = synthetic_table(theta, repeats=1, t_lat_us=2.1)
    t_complete_ns = (model.drain_time(raw["producers"] * raw["burst_bytes"], 400.0) + 2.1) * 1e3
    queued = (raw["burst"] == 0) & (raw["gap_us"] * 1e3 < t_complete_ns)
    clean = add_latency(raw, align)
    delayed = add_latency(raw.assign(t_visible_ns=raw["t_visible_ns"] + 10_000 * queued), align)
    pts = first_burst_points(delayed, 400.0, 2.1)
    assert len(pts) == 45
    by_gap = pts.set_index(["producers", "burst_bytes", "gap_us"])
    assert by_gap.loc[(132, 64 * KIB, 8.0), "overlapped"] == 1.0
    assert not by_gap.loc[(132, 64 * KIB, 8.0), "isolated"]
    assert by_gap.loc[(132, 64 * KIB, 24.0), "isolated"]
    assert by_gap.loc[(1, 4 * KIB, 0.0), "diff_us"] > 10.0
    assert (pts.loc[pts["isolated"], "diff_us"] < 1.2).all()          # the issue time
    assert (pts.loc[~pts["isolated"], "diff_us"] > 10.0).all()
    pd.testing.assert_frame_equal(completion_comparison(delayed, 400.0, 2.1),
                                  completion_comparison(clean, 400.0, 2.1))


# --- the record, summary and figure -----------------------------------------------------------

PROVENANCE = {"gpu_name": "NVIDIA H200", "gpu_count": 2, "git_commit": "test"}


def write_synthetic_records(root: Path, repeats: int = 2) -> Path:
    before = clock_offset(*pingpong_stamps(1500, seed=1, base=T_BASE - 10**9))
    after = clock_offset(*pingpong_stamps(1700, seed=2, base=T_BASE + 10**11))
    rev_b = clock_offset(*pingpong_stamps(-1500, seed=3, base=T_BASE - 10**9))
    rev_a = clock_offset(*pingpong_stamps(-1700, seed=4, base=T_BASE + 10**11))
    res = {"resolution_ns": 32, "median_step_ns": 32.0, "steps": 512}
    a = alignment_summary(before, after, rev_b, rev_a, res, res)
    theta = lambda t: offset_at(t, before, after)                        # noqa: E731
    sweep = visibility_sweep(132, repeats=repeats)
    table = add_latency(synthetic_table(theta, sweep), a)
    completion = {"producers": 132, "t_complete_us": {"K=132,B=65536": 24.0},
                  "completion_latency_us": 2.0,
                  "completion_rate_GBps": 400.0, "sum_law_err_pct": 3.0, "max_law_err_pct": 37.0,
                  "periods": []}
    write_record("calibration", "h200-x2", pd.DataFrame({"quantity": ["R_GBps"], "value": ["400"]}),
                 {"calibration": {"drain_rate_GBps": 400.0, "completion": completion}},
                 PROVENANCE, root)
    return write_record("visibility", "h200-x2", table,
                        {"sweep": sweep.describe(), "settings": asdict(VisibilitySettings()),
                         "src": 0, "dst": 1, "seed": 1, "clocks": {}, "clock_alignment": a},
                        PROVENANCE, root)


def test_default_sweep_record_fits_16_mib(tmp_path):
    sweep = visibility_sweep(132)
    rows = sum(p["producers"] for p in sweep.points()) * sweep.repeats * VisibilitySettings().bursts
    assert rows == 166 * 3 * 5 * 5 * 6
    path = write_synthetic_records(tmp_path, repeats=sweep.repeats)
    rec = read_record(path)
    assert len(rec.table) == rows
    assert path.stat().st_size < 16 * 2**20


def test_summary_entry_from_synthetic_record(tmp_path):
    write_synthetic_records(tmp_path)
    entry = summary_entry("h200-x2", tmp_path)
    assert entry["clock_offset_ns"] == pytest.approx(1500, abs=0.5)
    assert entry["drift_ns"] == pytest.approx(200, abs=1)
    assert entry["swap_check_ns"] == pytest.approx([0, 0], abs=1)
    assert entry["timer_resolution_ns"] == {"src": 32, "dst": 32}
    assert entry["clock_offset_uncertainty_ns"] == pytest.approx(800 + 32)
    assert len(entry["latency"]) == 45
    row = next(r for r in entry["latency"] if (r["K"], r["B"], r["G"]) == (132, 64 * KIB, 0.0))
    assert row["latency_us"] == pytest.approx(132 * 64 * KIB / 400e3 + 2.0, abs=2e-3)
    assert entry["T_lat_us"] == 2.0 and len(entry["vs_T_complete"]) == 9
    assert all(0 < r["diff_us"] < 1.2 for r in entry["vs_T_complete"])
    assert summary_entry("h100-x8", tmp_path) == {}


def test_summary_counterfactual_gains_visibility(tmp_path):
    from xstage_lab.summary import summary

    write_synthetic_records(tmp_path)
    cf = summary(tmp_path)["platforms"]["h200-x2"]["counterfactual"]
    assert cf["visibility"]["clock_offset_ns"] == pytest.approx(1500, abs=0.5)
    assert cf["T_lat_us"] == 2.0


def test_figures_and_tables_from_synthetic_record(tmp_path):
    from xstage_lab import load, plots

    write_synthetic_records(tmp_path)
    [v] = load("visibility", backend="replay", root=tmp_path)
    fig = plots.fig_visibility_latency(v)
    boxes = [t for t in fig.data if t.type == "box"]
    assert len(boxes) == 3 * 5                     # one box trace per (K, G)
    assert sum(len(b.y) for b in boxes) == len(v.record.table)
    table = plots.visibility_alignment_table([v])
    assert table.loc[0, "θ before (ns)"] == pytest.approx(1500, abs=0.5)
    cmp = plots.visibility_completion_table(v)
    assert list(cmp["K"]) == sorted(cmp["K"]) and len(cmp) == 9
    assert (cmp["gaps ≥ (µs)"] > 0).all()
    fenced = cmp.set_index(["K", "B"])["fenced sweep measured (µs)"]
    assert fenced.loc[(132, 64 * KIB)] == 24.0 and fenced.drop((132, 64 * KIB)).isna().all()
    full = cmp.set_index(["K", "B"]).loc[(132, 64 * KIB)]
    assert full["difference to fenced (µs)"] == pytest.approx(
        full["visible from start (µs)"] - 24.0, abs=1e-3)
    lat = plots.visibility_latency_table(v)
    assert lat.shape == (9, 7) and list(lat.columns)[:3] == ["K", "B", "G = 0 µs"]
    assert lat.set_index(["K", "B"]).loc[(132, 64 * KIB), "G = 72 µs"] == pytest.approx(132 * 64 * KIB / 400e3 + 2.0,
                                                                  abs=2e-3)
    first = plots.visibility_first_burst_table(v)
    assert len(first) == 45 and not first.loc[first["G (µs)"] == 0.0, "isolated"].any()
    assert len(load("visibility", backend="replay", root=tmp_path / "empty")) == 0


# --- the CUDA source -----------------------------------------------------------------------------

@needs_nvcc
def test_cuda_source_compiles_for_sm90_and_exports_the_kernels(tmp_path):
    symbols, entries, text = compile_sm90(CU, tmp_path)
    assert set(KERNELS) <= symbols and entries == set(KERNELS)
    # the flag protocol: a release store by the sender, an acquire on the receiver side
    assert "st.release.sys" in text and "fence.acq_rel.sys" in text


# --- the experiment, through the harness -------------------------------------------------------

class ModelVisibilityBench:
    """Stands in for VisibilityBench: validates like it, logs its calls, aligns with θ 1500 ns
    before and 1700 ns after, and answers every launch with ``synthetic_launch``'s stamps."""

    def __init__(self, src, dst, settings, inv):
        self.settings, self.inv, self.seed, self.calls = settings, inv, 3, []
        self.before = (clock_offset(*pingpong_stamps(1500, seed=1, base=T_BASE - 10**9)),
                       clock_offset(*pingpong_stamps(-1500, seed=3, base=T_BASE - 10**9)))
        self.after = (clock_offset(*pingpong_stamps(1700, seed=2, base=T_BASE + 10**11)),
                      clock_offset(*pingpong_stamps(-1700, seed=4, base=T_BASE + 10**11)))
        self.t = T_BASE

    def validate(self, p):
        self.calls.append("validate")
        validate_point(p, self.inv, self.settings)

    def prepare(self):
        self.calls.append("prepare")

    def timer_steps(self, dev):
        return np.full(8, 32)

    def pingpong(self, initiator, responder):
        self.calls.append("pingpong")

    def align(self):
        self.calls.append("align")
        return self.after if "measure" in self.calls else self.before

    def sm_clock_mhz(self):
        return 1980.0

    def measure(self, p):
        self.calls.append("measure")
        theta = lambda t: offset_at(t, self.before[0], self.after[0])      # noqa: E731
        tx, rx, _ = synthetic_launch(p["producers"], p["burst_bytes"], p["gap_us"], theta,
                                     start=self.t, n=self.settings.bursts)
        self.t = int(rx.max()) + 1_000_000
        return stamp_rows(tx, rx).assign(gap_set_us=float(p["gap_us"]))


def test_visibility_through_the_harness(monkeypatch, tmp_path):
    """Every point validated, then the timers and θ, the sweep, θ again; the record's latencies
    are the model's (drain time + 2 µs) and its header holds the alignment."""
    from .test_characterization import fake_machine

    fake_machine(monkeypatch, vis)
    benches = []
    monkeypatch.setattr(vis, "VisibilityBench",
                        lambda *a: benches.append(ModelVisibilityBench(*a)) or benches[-1])
    path = vis.run_visibility(repeats=1, progress=False, root=tmp_path)
    calls = benches[0].calls
    n = len(visibility_sweep(132).points())
    assert calls[:n + 4] == ["validate"] * n + ["prepare", "pingpong", "align", "measure"]
    assert calls.count("measure") == 2 * n and calls[-1] == "align"  # a warm-up launch each
    rec = read_record(path)
    assert rec.params["clock_alignment"]["before"]["offset_ns"] == pytest.approx(1500, abs=0.5)
    assert rec.params["clocks"] == {"sm_clock_mhz_before": 1980.0, "sm_clock_mhz_after": 1980.0}
    assert (rec.params["src"], rec.params["dst"], rec.params["seed"]) == (0, 1, 3)
    assert rec.params["sweeps"] == [visibility_sweep(132, repeats=1).describe()]
    entry = summary_entry("h200-x2", tmp_path)
    row = next(r for r in entry["latency"] if (r["K"], r["B"], r["G"]) == (132, 64 * KIB, 0.0))
    assert row["latency_us"] == pytest.approx(132 * 64 * KIB / 400e3 + 2.0, abs=2e-3)


def test_visibility_needs_two_peer_gpus(monkeypatch, tmp_path):
    from .test_characterization import fake_machine

    fake_machine(monkeypatch, vis, peer=False)
    with pytest.raises(RuntimeError, match="two peer-capable GPUs"):
        vis.run_visibility(repeats=1, progress=False, root=tmp_path)
