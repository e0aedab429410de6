"""Remote-store characterization: point validation before launch, burst rows from kernel clocks,
the Fig. 3 sweeps, and the CUDA source (compiled by nvcc for sm_90, no GPU needed)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.experiments.cuda_testing import compile_sm90, needs_nvcc
from xstage_lab.experiments.remote_store.characterization import HOST, KIB, BenchSettings, characterization_sweeps, host_link_sweeps, link_settings
from xstage_lab.calibration import MIB
from xstage_lab.ops.remote_store.burst import (burst_rows, check_host_destination,
                                               isolated_recovery_us, row_layout, validate_point)
from xstage_lab.platform import GPU, Inventory
from xstage_lab.sweep import Axis, Sweep, run_sweep

CU = Path(__file__).resolve().parents[3] / "kernels" / "remote_store_burst.cu"
KERNELS = ("burst_gap", "burst_gap_fenced", "burst_gap_rows", "count_burst_mismatches",
           "sample_sm_clock", "burst_gap_ops", "count_ops_mismatches")


def make_inv(n: int, sms: int = 132, peer: bool = True) -> Inventory:
    gpus = tuple(GPU(index=i, name="NVIDIA H200", sm_count=sms, l2_bytes=60 * MIB,
                     max_smem_per_sm=233472, max_smem_per_block_optin=232448,
                     compute_capability="9.0") for i in range(n))
    return Inventory(gpus=gpus, peer=tuple(tuple(peer and i != j for j in range(n))
                                           for i in range(n)))


def fake_machine(monkeypatch, module, n: int = 2, **inv) -> Inventory:
    """``module``'s ``inventory()`` answers ``n`` H200s (``make_inv``) and the harness's
    provenance names them: an experiment run through the harness on the CPU."""
    from xstage_lab import platform

    machine = make_inv(n, **inv)
    monkeypatch.setattr(module, "inventory", lambda: machine)
    monkeypatch.setattr(platform, "provenance", lambda: {
        "gpu_name": "NVIDIA H200", "gpu_count": n, "date_utc": "2026-12-01T00:00:00+00:00",
        "git_commit": "test"})
    return machine


INV2 = make_inv(2)
GOOD = dict(mode="periodic", path="remote", producers=132, burst_bytes=32 * KIB, gap_us=0.0,
            src=0, dst=1, lines="fresh", align="each")


# --- validate_point --------------------------------------------------------------------------

def test_good_points_accepted():
    assert validate_point(GOOD, INV2) is None
    validate_point(dict(GOOD, mode="isolated", gap_us=3.5, producers=1, burst_bytes=16), INV2)
    validate_point(dict(GOOD, lines="rewrite", align="first"), INV2)
    validate_point({k: v for k, v in GOOD.items() if k not in ("lines", "align")}, INV2)
    validate_point(dict(GOOD, burst_bytes=np.int64(64 * KIB)), INV2)
    # the local control needs no peer: same GPU as source and destination, no peer access
    validate_point(dict(GOOD, path="local", dst=0), make_inv(2, peer=False))
    validate_point(dict(GOOD, path="local", src=0, dst=0), make_inv(1))
    # exactly the buffer: 128 · 2 MiB = 256 MiB
    validate_point(dict(GOOD, producers=128, burst_bytes=2 * MIB), INV2)


@pytest.mark.parametrize("change,match", [
    (dict(burst_bytes=1000), r"multiple of 16"),             # 1000 = 62·16 + 8
    (dict(burst_bytes=24), r"multiple of 16"),
    (dict(burst_bytes=0), r"positive multiple of 16"),
    (dict(burst_bytes=-16), r"positive multiple of 16"),
    (dict(burst_bytes=16384.0), r"multiple of 16"),          # not an integer
    (dict(producers=133), r"producers K=133 must be in 1\.\.132"),
    (dict(producers=0), r"producers K=0"),
    (dict(producers=-4), r"producers K=-4"),
    (dict(gap_us=-0.5), r"gap_us G=-0\.5 must not be negative"),
    (dict(dst=0), r"remote mode needs a destination other than the source"),
    (dict(src=1, dst=1), r"destination other than the source"),
    (dict(dst=2), r"must name GPUs 0\.\.1"),
    (dict(src=-1), r"must name GPUs"),
    (dict(mode="burst"), r"mode must be one of"),
    (dict(path="peer"), r"path must be one of"),
    (dict(lines="stale"), r"lines must be one of"),
    (dict(align="never"), r"align must be one of"),
    (dict(producers=132, burst_bytes=2 * MIB), r"exceeds the 268435456-byte buffer"),
])
def test_bad_points_rejected(change, match):
    with pytest.raises(ValueError, match=match):
        validate_point(dict(GOOD, **change), INV2)


def test_no_peer_access_rejected():
    with pytest.raises(ValueError, match="no peer access to GPU 1"):
        validate_point(GOOD, make_inv(2, peer=False))
    one_way = Inventory(gpus=INV2.gpus, peer=((False, True), (False, False)))
    validate_point(GOOD, one_way)
    with pytest.raises(ValueError, match="GPU 1 has no peer access to GPU 0"):
        validate_point(dict(GOOD, src=1, dst=0), one_way)


def test_settings_checked():
    with pytest.raises(ValueError, match="multiple of 32"):
        validate_point(GOOD, INV2, BenchSettings(threads=500))
    with pytest.raises(ValueError, match="multiple of 32"):
        validate_point(GOOD, INV2, BenchSettings(threads=1024))
    with pytest.raises(ValueError, match="exceeds the 1048576-byte buffer"):
        validate_point(dict(GOOD, producers=33, burst_bytes=32 * KIB), INV2,
                       BenchSettings(buffer_bytes=1 * MIB))


def test_bad_point_fails_the_sweep_before_any_launch():
    launches = []
    sw = Sweep("gap", (Axis("gap_us", [0.0, 1.0, -1.0]),),
               fixed={k: v for k, v in GOOD.items() if k != "gap_us"}, repeats=2)
    with pytest.raises(ValueError, match="must not be negative"):
        run_sweep(sw, lambda p: launches.append(p) or pd.DataFrame({"x": [0]}),
                  validate=lambda p: validate_point(p, INV2), progress=False)
    assert launches == []


def test_isolated_recovery_gap():
    # 20 µs + V / (50 GB/s): 1 MiB → 20 + 1048576 / 50e3 = 20 + 20.97152 = 40.97152 µs
    assert isolated_recovery_us(MIB, BenchSettings()) == pytest.approx(40.97152, rel=1e-12)


# --- burst_rows ------------------------------------------------------------------------------

CLK = 1980.0  # SM cycles per µs (1980 MHz)


def _trace(starts_us, issues_us, cycles_per_us):
    """trace [n, K, 3] and clocks [K, 5] for producers starting bursts at ``starts_us`` [n, K]
    with issue times ``issues_us`` [n, K]; producer k's SM runs at cycles_per_us[k]."""
    starts = np.asarray(starts_us, float)
    issues = np.asarray(issues_us, float)
    cpu = np.asarray(cycles_per_us, float)
    n, K = starts.shape
    base_clock = np.array([1_000_000 * (k + 1) for k in range(K)], float)  # arbitrary offsets
    trace = np.zeros((n, K, 3), np.uint64)
    trace[:, :, 0] = np.round(base_clock + starts * cpu)
    trace[:, :, 1] = np.round(base_clock + (starts + issues) * cpu)
    trace[:, :, 2] = np.round(5_000_000 + starts * 1e3)  # %globaltimer ns
    clocks = np.zeros((K, 5), np.uint64)
    clocks[:, 0] = 5_000_000 - 1_000                 # entry timer: 1 µs before the first burst
    clocks[:, 1] = base_clock - 1.0 * cpu
    clocks[:, 2] = 5_000_000 + 100_000               # exit timer at 100 µs
    clocks[:, 3] = base_clock + 100.0 * cpu
    clocks[:, 4] = np.arange(K)
    return trace, clocks


def test_burst_rows_hand_worked_drifting_producers():
    # producer 0: starts 0, 10, 20, 30 µs, issue 2 µs; producer 1 (slower, drifting):
    # starts 1, 12, 23, 34 µs, issue 3 µs. Warm-up 1 burst, B = 1024.
    starts = [[0, 1], [10, 12], [20, 23], [30, 34]]
    issues = [[2, 3]] * 4
    trace, clocks = _trace(starts, issues, [CLK, CLK])
    rows = burst_rows(trace, clocks, warmup_bursts=1, burst_bytes=1024)
    assert len(rows) == 4
    assert rows["burst"].tolist() == [0, 1, 2, 3]
    assert rows["warmup"].tolist() == [True, False, False, False]
    # window: lo = max(start[1]) = 12 µs, hi = min(start[3]) = 30 µs (18 µs long)
    # in window (lo <= start < hi): burst 1: p1 (12); burst 2: p0 (20), p1 (23); burst 3: none
    assert rows["producers_in_window"].tolist() == [0, 1, 2, 0]
    assert rows["window_us"].iloc[0] == pytest.approx(18.0)
    # burst 1: p1 alone → issue 3, period 23 − 12 = 11, gap 11 − 3 = 8
    # burst 2: mean(2, 3) = 2.5, period mean(30 − 20, 34 − 23) = mean(10, 11) = 10.5, gap 8
    np.testing.assert_allclose(rows["t_iss_us"], [np.nan, 3.0, 2.5, np.nan], rtol=1e-9)
    np.testing.assert_allclose(rows["period_us"], [np.nan, 11.0, 10.5, np.nan], rtol=1e-9)
    np.testing.assert_allclose(rows["gap_eff_us"], [np.nan, 8.0, 8.0, np.nan], rtol=1e-9)
    np.testing.assert_allclose(rows["t_iss_max_us"], [np.nan, 3.0, 3.0, np.nan], rtol=1e-9)
    np.testing.assert_allclose(rows["t_iss_min_us"], [np.nan, 3.0, 2.0, np.nan], rtol=1e-9)
    np.testing.assert_allclose(rows["t_iss_median_us"], [np.nan, 3.0, 2.5, np.nan], rtol=1e-9)
    # skew of the start %globaltimer: 1, 2, 3, 4 µs
    assert rows["start_skew_ns"].tolist() == [1000, 2000, 3000, 4000]
    # rate: 3 producer-bursts · 1024 B over 18 µs = 3072 B / 18000 ns = 0.170667 GB/s
    assert rows["window_rate_GBps"].iloc[0] == pytest.approx(3072 / 18000, rel=1e-12)
    assert rows["sm_clock_mhz"].iloc[0] == pytest.approx(CLK, rel=1e-9)


def test_burst_rows_converts_each_producer_at_its_own_clock():
    # same schedule, but producer 1's SM runs at 1500 MHz: its cycles must become the same µs
    starts = [[0, 1], [10, 12], [20, 23], [30, 34]]
    issues = [[2, 3]] * 4
    trace, clocks = _trace(starts, issues, [CLK, 1500.0])
    rows = burst_rows(trace, clocks, warmup_bursts=1, burst_bytes=1024)
    np.testing.assert_allclose(rows["t_iss_us"][1:3], [3.0, 2.5], rtol=1e-6)
    np.testing.assert_allclose(rows["period_us"][1:3], [11.0, 10.5], rtol=1e-6)
    # median of (1980, 1500) = 1740
    assert rows["sm_clock_mhz"].iloc[0] == pytest.approx(1740.0, rel=1e-6)


def test_burst_rows_aligned_zero_gap_rate_is_the_drain_rate():
    # K = 4 aligned producers, period 5 µs, issue 5 µs (zero gap), B = 1 MiB each:
    # every producer delivers 1 MiB per 5 µs → 4·1048576 / 5000 ns = 838.8608 GB/s
    n, K = 12, 4
    starts = np.arange(n)[:, None] * 5.0 + np.zeros(K)
    trace, clocks = _trace(starts, np.full((n, K), 5.0), [CLK] * K)
    rows = burst_rows(trace, clocks, warmup_bursts=3, burst_bytes=MIB)
    # window 15 µs .. 55 µs: bursts 3..10 (8 bursts) counted with all 4 producers
    assert rows["producers_in_window"].tolist() == [0] * 3 + [4] * 8 + [0]
    assert rows["window_rate_GBps"].iloc[0] == pytest.approx(4 * MIB / 5000, rel=1e-12)
    steady = rows[rows["producers_in_window"] > 0]
    np.testing.assert_allclose(steady["t_iss_us"], 5.0, rtol=1e-9)
    np.testing.assert_allclose(steady["period_us"], 5.0, rtol=1e-9)
    np.testing.assert_allclose(steady["gap_eff_us"], 0.0, atol=1e-9)
    assert (rows["start_skew_ns"] == 0).all()


# --- characterization sweeps -----------------------------------------------------------------

@pytest.mark.parametrize("n_gpus", [4, 8])
def test_every_characterization_point_validates(n_gpus):
    inv = make_inv(n_gpus)
    sweeps = characterization_sweeps(132, n_gpus, repeats=11)
    assert [s.name for s in sweeps] == ["drain_rate", "gap", "isolated", "fenced", "lines", "pairs"]
    for sw in sweeps:
        pts = sw.points()
        assert pts
        for p in pts:
            validate_point(p, inv)
    by = {s.name: s for s in sweeps}
    # P GPUs → P·(P − 1) ordered routes, each at two burst sizes
    routes = {(p["src"], p["dst"]) for p in by["pairs"].points()}
    assert len(routes) == n_gpus * (n_gpus - 1)
    assert all(a != b for a, b in routes)
    assert len(by["pairs"].points()) == 2 * n_gpus * (n_gpus - 1)
    assert by["pairs"].repeats == 5
    # K = 132: Ks = {132/8, 132/4, 132/2, 132} = {16, 33, 66, 132}
    assert sorted({p["producers"] for p in by["drain_rate"].points()}) == [16, 33, 66, 132]
    assert sorted({p["producers"] for p in by["isolated"].points()}) == [33, 66, 132]
    assert {p["producers"] for p in by["gap"].points()} == {132}
    assert all(p["gap_us"] == 0.0 for p in by["drain_rate"].points())


def test_pairs_heatmap_of_eight_gpus():
    """Notebook 01's R per ordered pair from the ``pairs`` sweep on 8 GPUs: the largest burst's
    V/T_period of every pair at [src, dst], the diagonal empty."""
    from xstage_lab import plots

    sweep = {s.name: s for s in characterization_sweeps(132, 8)}["pairs"]
    points = pd.DataFrame(sweep.points())
    points["burst_volume"] = points["producers"] * points["burst_bytes"]
    rate = 100.0 * points["src"] + points["dst"] + (points["burst_bytes"] < 256 * KIB) * 50.0
    points["period_us"] = points["burst_volume"] / rate / 1e3
    heat = plots.drain_rate_heatmap(points, "h200-x8").data[0]
    z = np.asarray(heat.z, dtype=float)
    assert z.shape == (8, 8) and list(heat.x) == [f"to GPU {d}" for d in range(8)]
    for a in range(8):
        for b in range(8):
            assert np.isnan(z[a, b]) if a == b else z[a, b] == pytest.approx(100.0 * a + b)


def test_characterization_sweeps_reject_on_a_smaller_or_peerless_machine():
    # the sweeps for 132 SMs do not fit a GPU of 66 SMs, nor run remote without peer access
    sweeps = characterization_sweeps(132, 2)
    with pytest.raises(ValueError, match="producers"):
        for sw in sweeps:
            for p in sw.points():
                validate_point(p, make_inv(2, sms=66))
    with pytest.raises(ValueError, match="peer access"):
        for p in sweeps[0].points():
            validate_point(p, make_inv(2, peer=False))


# --- the experiment, through the harness (a bench that answers from the model) ----------------

class ModelStoreBench:
    """Stands in for RemoteStoreBench: validates like it and answers every launch from the
    Burst–Gap model (tests/synthetic.py, KNOWN's platform)."""

    launches: list = []

    def __init__(self, settings, inv):
        self.settings, self.inv, self.seed = settings, inv, 5
        self.rows = {}  # a point's rows, made at its first launch

    def validate(self, p):
        validate_point(p, self.inv, self.settings)

    def sm_clock_mhz(self, dev=0):
        return 1980.0

    def measure(self, p, check_on_cpu=False):
        from tests.synthetic import synthetic_beyond_table

        self.launches.append(p)
        key = repr(sorted(p.items()))
        if key not in self.rows:  # the model answers a point's launches alike (2 ms each)
            # the model knows one link: a store into host memory drains as a peer's would
            route = f"{p['src']}>{p['dst'] if p['dst'] != HOST else p['src'] + 1}"
            rows = synthetic_beyond_table([Sweep("one", (), fixed=dict(p, routes=route),
                                                 repeats=1, warmup=0)])
            self.rows[key] = rows.drop(columns=["sweep", "point", "repeat", "routes", "n_dst",
                                                "gpu_start_spread_ns"])
        return self.rows[key].copy()


@pytest.fixture
def model_bench(monkeypatch):
    from xstage_lab.experiments.remote_store import characterization as ch

    monkeypatch.setattr(ModelStoreBench, "launches", [])
    monkeypatch.setattr(ch, "RemoteStoreBench", ModelStoreBench)
    return ch


def test_characterization_record_through_the_harness_calibrates(model_bench, monkeypatch,
                                                                 tmp_path):
    from tests.synthetic import KNOWN
    from xstage_lab.records import read_record

    ch = model_bench
    fake_machine(monkeypatch, ch)
    path = ch.run_characterization(repeats=2, only=("drain_rate", "gap", "isolated"),
                                   progress=False, root=tmp_path)
    assert path.parent == tmp_path / "remote_store" / "h200-x2"
    rec = read_record(path)
    sweeps = characterization_sweeps(132, 2, repeats=2)[:3]
    assert [s["name"] for s in rec.params["sweeps"]] == ["drain_rate", "gap", "isolated"]
    assert (rec.params["src"], rec.params["dst"], rec.params["seed"]) == (0, 1, 5)
    assert rec.params["settings"] == BenchSettings().__dict__
    assert rec.params["sm_clock_mhz_start"] == rec.params["sm_clock_mhz_end"] == [1980.0]
    # every point's repeats, tagged with its sweep, point and repeat; a checked launch and a
    # warm-up launch each before them, a checked launch again after them
    assert len(rec.table) == sum(len(s.points()) * 2 for s in sweeps)
    assert len(ModelStoreBench.launches) == sum(len(s.points()) * 5 for s in sweeps)
    for s in sweeps:
        rows = rec.table[rec.table["sweep"] == s.name]
        assert sorted(set(rows["point"])) == list(range(len(s.points())))
        assert set(rows["repeat"]) == {0, 1}
    cal = read_record(ch.write_calibration(path, tmp_path)).params["calibration"]
    assert cal["drain_rate_GBps"] == pytest.approx(KNOWN["drain_rate"], rel=1e-3)


def test_a_run_without_the_calibration_sweeps_is_a_partial_record(model_bench, monkeypatch,
                                                                  tmp_path):
    from xstage_lab.records import read_record

    ch = model_bench
    fake_machine(monkeypatch, ch)
    path = ch.run_characterization(repeats=1, only=("lines",), progress=False, root=tmp_path)
    assert path.parent == tmp_path / "remote_store_partial" / "h200-x2"
    table = read_record(path).table
    assert set(table["sweep"]) == {"lines"} and len(table) == 4


def test_characterization_validates_every_point_before_the_first_launch(model_bench, monkeypatch,
                                                                        tmp_path):
    ch = model_bench
    fake_machine(monkeypatch, ch, peer=False)
    with pytest.raises(ValueError, match="no peer access"):
        ch.run_characterization(repeats=1, progress=False, root=tmp_path)
    assert ModelStoreBench.launches == [] and not any(tmp_path.iterdir())


@pytest.mark.parametrize("argv,match", [(["--only", "gap,drain"], "invalid choice: 'drain'"),
                                        (["--repeats", "0"], "repeats"),
                                        (["--link", "pcie"], "--link must be one of")])
def test_characterization_arguments_checked(argv, match, capsys):
    from xstage_lab.experiments import harness
    from xstage_lab.experiments.remote_store import characterization as ch

    with pytest.raises(SystemExit) as e:
        harness.parse(ch.EXPERIMENT, ["--root", "r", *argv])
    assert e.value.code == 2 and match in capsys.readouterr().err


# --- the CUDA source -------------------------------------------------------------------------

@needs_nvcc
def test_cuda_source_compiles_for_sm90_and_exports_the_kernels(tmp_path):
    symbols, entries, text = compile_sm90(CU, tmp_path)
    assert set(KERNELS) <= symbols, symbols
    assert entries == set(KERNELS)  # extern "C": unmangled names in the PTX too
    # every operation of burst_gap_ops reaches the PTX (remote_ops.OPS)
    for instruction in ("st.global.u32", "st.global.v2.u32", "st.global.v4.u32",
                        "red.relaxed.gpu.global.add.u32", "red.relaxed.gpu.global.add.f32",
                        "cp.async.bulk.global.shared::cta.bulk_group", "cp.async.bulk.commit_group",
                        "cp.async.bulk.wait_group.read", "fence.proxy.async.shared::cta",
                        "ld.global.cv.v4.u32"):
        assert instruction in text, instruction


@needs_nvcc
def test_only_the_fenced_burst_kernel_fences(tmp_path):
    """burst_gap's and burst_gap_rows' code holds no fence, not even an untaken branch to one (that costs issue
    time: data/records/issue_time_probe); burst_gap_fenced fences at system scope per burst."""
    _, _, ptx = compile_sm90(CU, tmp_path)
    bodies = dict(re.findall(r"\.visible\s+\.entry\s+(\w+)\s*\((.*?)\n\}", ptx, re.S))
    fences = {name: re.findall(r"\b(?:membar|fence)\.[\w.]+", bodies[name])
              for name in ("burst_gap", "burst_gap_rows", "burst_gap_fenced")}
    assert fences["burst_gap"] == fences["burst_gap_rows"] == []
    assert fences["burst_gap_fenced"] and set(fences["burst_gap_fenced"]) <= {"membar.sys",
                                                                             "fence.sc.sys"}


# --- the host link ---------------------------------------------------------------------------

def _burst_pattern(seed: int, burst: int, producer: int, vec: int) -> tuple[int, ...]:
    """kernels/xstage_device.cuh's burst_pattern, in Python integers mod 2**32."""
    m = 0xFFFFFFFF
    tag = seed ^ (burst * 0x9E3779B1 & m)
    w1 = vec * 0x85EBCA77 & m
    w2 = (producer * 0xC2B2AE3D & m) ^ w1
    return tag ^ w1, w1, w2, (tag ^ w2) * 0x27D4EB2F & m


def _stored(buffer_vecs, k, vecs_per_producer, n_slots, n_bursts, seed, poison, chunk=None,
            row=None):
    """What a burst launch leaves in a poisoned buffer, store by store as the kernel issues them:
    contiguous, or ``chunk``-vector pieces one per ``row``-vector row, ``row // chunk`` producers
    side by side (burst_gap_rows)."""
    slot_vecs = row_layout(k, 16 * vecs_per_producer, 16 * (chunk or 0), 16 * (row or 0))[2]
    chunk = chunk or vecs_per_producer
    row = row or vecs_per_producer
    words = np.full(buffer_vecs * 4, poison, dtype=np.uint32)
    per_row = row // chunk
    for burst in range(n_bursts):
        for p in range(k):
            base = (p // per_row) * (vecs_per_producer // chunk) * row + (p % per_row) * chunk
            for v in range(vecs_per_producer):
                i = (burst % n_slots) * slot_vecs + base + (v // chunk) * row + v % chunk
                words[4 * i:4 * i + 4] = _burst_pattern(seed, burst, p, v)
    return words, slot_vecs


@pytest.mark.parametrize("n_slots,n_bursts", [(3, 7), (4, 2), (1, 5)])
@pytest.mark.parametrize("chunk,row", [(None, None), (2, 6)])
def test_host_destination_check_counts_what_the_producers_did_not_leave(n_slots, n_bursts, chunk,
                                                                         row):
    """Contiguous bursts, and row chunks (2-vector chunks, 3 producers a row: the 4th producer
    starts a second group, whose other two places stay poisoned)."""
    k, vpp, seed, poison = 4, 6, 0xDEADBEEF, 0xA5A5A5A5
    layout = (k, vpp, chunk or vpp, row or vpp)
    words, slot_vecs = _stored(1, k, vpp, 1, 0, seed, poison, chunk, row)
    buffer_vecs = n_slots * slot_vecs + 4  # a tail no slot covers stays poisoned
    words, _ = _stored(buffer_vecs, k, vpp, n_slots, n_bursts, seed, poison, chunk, row)
    args = (slot_vecs, n_slots, layout, n_bursts, seed, poison)
    assert check_host_destination(words, *args) == 0
    wrong = words.copy()
    wrong[4 * (slot_vecs + 2) + 3] ^= 1                     # one word of a written vector
    wrong[-1] = 0                                           # the poisoned tail
    assert check_host_destination(wrong, *args) == (2 if n_bursts > 1 else 1)
    if chunk:  # a store where no producer stores (the second group's empty places)
        hole = 4 * (slot_vecs - 1)
        assert words[hole] == poison
        wrong = words.copy()
        wrong[hole] = 0
        assert check_host_destination(wrong, *args) == 1
    # a slot that holds an earlier burst than its last, or another seed's, is wrong throughout
    assert check_host_destination(_stored(buffer_vecs, k, vpp, n_slots, n_bursts - 1, seed,
                                          poison, chunk, row)[0], *args) >= k * vpp
    assert check_host_destination(words, slot_vecs, n_slots, layout, n_bursts, seed + 1,
                                  poison) == min(n_slots, n_bursts) * k * vpp


def test_row_layout_puts_producers_side_by_side_in_rows():
    assert row_layout(132, 64 * KIB) == (4096, 4096, 132 * 4096)
    # DiT-MoE's Combine: 256-byte chunks of 2816-byte rows, 11 producers a row, 12 groups
    assert row_layout(132, 32 * KIB, 256, 2816) == (16, 176, 12 * 128 * 176)
    assert row_layout(20, 32 * KIB, 512, 8192)[2] == 2 * 64 * 512  # 16 a row: 2 groups
    for bad in [(48, 4096), (512, 1000), (0, 4096)]:
        with pytest.raises(ValueError):
            row_layout(132, 32 * KIB, *bad)


def test_every_host_link_point_validates_on_one_gpu():
    inv = make_inv(1)
    settings = link_settings("host")
    sweeps = host_link_sweeps(132, repeats=7)
    assert [s.name for s in sweeps] == ["drain_rate", "gap", "isolated", "fenced", "lines",
                                        "row_chunks", "under_load", "under_gemm"]
    for sw in sweeps[:-2]:
        for p in sw.points():
            validate_point(p, inv, settings)
            assert p["dst"] == HOST and p["src"] == 0
    iso = pd.DataFrame(sweeps[2].points())
    # the knee Q(K) at every K of the NVLink drain sweep, bursts out to half the buffer
    assert sorted(iso["producers"].unique()) == [16, 33, 66, 132]
    assert (iso["producers"] * iso["burst_bytes"]).max() <= settings.buffer_bytes // 2
    assert iso.groupby("producers")["burst_bytes"].max().min() >= 768 * KIB
    # every gap-sweep burst reaches its recovered plateau (G >= 2 V/R) even at 64 GB/s
    gap = pd.DataFrame(sweeps[1].points())
    assert (gap.groupby("burst_bytes")["gap_us"].max() * 64e3 >= 2 * 132 * gap.groupby(
        "burst_bytes")["burst_bytes"].first()).all()
    # the Combine's row patterns of every model shape beside the contiguous burst, each past
    # the contiguous knee (35 KiB a producer at K = 132) to a Linear-2 tile's 64 KiB and beyond
    rows = pd.DataFrame(sweeps[-3].points())
    assert {(c, r) for c, r in zip(rows["chunk_bytes"], rows["row_bytes"])} == {
        (0, 0), (256, 2816), (512, 8192), (512, 12288), (512, 14336)}
    assert set(rows["producers"]) == {132}
    assert rows.groupby(["chunk_bytes", "row_bytes", "mode"])["burst_bytes"].max().min() >= 64 * KIB
    # an isolated burst recovers at a rate far below PCIe's
    assert isolated_recovery_us(100 * MIB, settings) > 100 * MIB / 20e3
    with pytest.raises(ValueError, match="must name GPUs"):
        validate_point(dict(GOOD, dst=-2), inv)


class ModelHostBench(ModelStoreBench):
    """ModelStoreBench with the host link's copy engine and host buffer."""

    class host:
        numa = {"node": None, "cpus": None, "pages_bound_to_node": False}

    def copy_engine_rate(self, src):
        return {"bytes": 1, "repeats": 1, "rate_GBps": 55.5, "rate_GBps_iqr": [55.0, 56.0]}


def host_probe_characterization(monkeypatch, name: str, probe: type):
    """The characterization module on one fake H200 with ``ModelHostBench`` and, as its ``name``
    (a host-link probe's class), ``probe``, whose ``launches`` start empty."""
    from xstage_lab.experiments.remote_store import characterization as ch

    monkeypatch.setattr(probe, "launches", [])
    monkeypatch.setattr(ch, "RemoteStoreBench", ModelHostBench)
    monkeypatch.setattr(ch, name, probe)
    fake_machine(monkeypatch, ch, n=1)
    return ch


def test_host_link_record_is_a_platform_of_its_own_and_calibrates(model_bench, monkeypatch,
                                                                   tmp_path):
    from tests.synthetic import KNOWN
    from xstage_lab.records import read_record

    ch = model_bench
    monkeypatch.setattr(ch, "RemoteStoreBench", ModelHostBench)
    fake_machine(monkeypatch, ch, n=1)
    path = ch.run_characterization(repeats=1, only=("drain_rate", "gap", "isolated"),
                                   progress=False, root=tmp_path, link="host")
    assert path.parent == tmp_path / "remote_store" / "h200-x1-host"
    rec = read_record(path)
    assert (rec.params["link"], rec.params["dst"]) == ("host", HOST)
    assert rec.params["copy_engine_d2h"]["rate_GBps"] == 55.5
    assert rec.params["settings"] == link_settings("host").__dict__
    assert (rec.table["dst"] == HOST).all()
    cal = read_record(ch.write_calibration(path, tmp_path))
    assert cal.platform == "h200-x1-host"
    fit = cal.params["calibration"]
    assert fit["drain_rate_GBps"] == pytest.approx(KNOWN["drain_rate"], rel=1e-3)
    assert (fit["link"], fit["copy_engine_GBps"]) == ("host", 55.5)
    assert sorted(fit["isolated"], key=int) == ["16", "33", "66", "132"]


def test_row_chunk_sweep_fits_r_and_q_per_combine_pattern(model_bench, monkeypatch, tmp_path):
    from tests.synthetic import KNOWN, capacity
    from xstage_lab.analysis.remote_store import row_chunks as rc
    from xstage_lab.records import read_record

    ch = model_bench
    monkeypatch.setattr(ch, "RemoteStoreBench", ModelHostBench)
    fake_machine(monkeypatch, ch, n=1)
    assert rc.latest_row_chunk_record("h200-x1-host", tmp_path) is None
    path = ch.run_characterization(repeats=1, only=("row_chunks",), progress=False,
                                   root=tmp_path, link="host")
    assert path.parent == tmp_path / "remote_store_partial" / "h200-x1-host"
    rec = rc.latest_row_chunk_record("h200-x1-host", tmp_path)
    assert rec.record_id == read_record(path).record_id
    fits = rc.row_chunk_fits(rec.table)
    assert list(zip(fits["chunk_bytes"], fits["row_bytes"])) == [
        (p["chunk_bytes"], p["row_bytes"]) for p in ch.combine_row_patterns()]
    # the model drains every pattern alike: each fit finds its R and Q(132)
    assert fits["drain_rate_GBps"].to_numpy() == pytest.approx(KNOWN["drain_rate"], rel=1e-3)
    assert fits["capacity_bytes"].to_numpy() == pytest.approx(capacity(132), rel=0.05)
    m = rc.pattern_model(fits.iloc[1].to_dict())
    assert m.drain_rate == fits["drain_rate_GBps"].iloc[1]
    assert m.capacity_at(132) == fits["capacity_bytes"].iloc[1]
    no_knee = dict(fits.iloc[0].to_dict(), capacity_bytes=float("nan"))
    assert rc.pattern_model(no_knee).capacity_at(132) == fits["largest_volume_bytes"].iloc[0]
    with pytest.raises(ValueError, match="no 'row_chunks' sweep"):
        rc.row_chunk_fits(rec.table.assign(sweep="gap"))


def test_the_nvlink_link_on_one_gpu_is_refused_before_any_launch(model_bench, monkeypatch,
                                                                 tmp_path, capsys):
    ch = model_bench
    fake_machine(monkeypatch, ch, n=1)
    with pytest.raises(SystemExit) as e:
        ch.run_characterization(repeats=1, progress=False, root=tmp_path)
    assert e.value.code == 2 and "must name GPUs 0..0" in capsys.readouterr().err
    assert ModelStoreBench.launches == [] and not any(tmp_path.iterdir())


def test_a_link_this_machine_lacks_is_one_line_before_any_launch(model_bench, monkeypatch,
                                                                tmp_path, capsys):
    from xstage_lab.experiments import harness

    ch = model_bench
    fake_machine(monkeypatch, ch, n=0)
    for link in ("host", "nvlink"):
        with pytest.raises(SystemExit) as e:
            harness.main(ch.EXPERIMENT, ["--root", str(tmp_path), "--link", link])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and "needs a GPU" in err[0]
    assert ModelStoreBench.launches == [] and not any(tmp_path.iterdir())


def test_row_pattern_prose_quotes_each_pattern_against_the_contiguous_burst(model_bench,
                                                                             monkeypatch,
                                                                             tmp_path):
    from xstage_lab.analysis.remote_store import row_chunks as rc
    from xstage_lab.prose import host_link as say

    ch = model_bench
    monkeypatch.setattr(ch, "RemoteStoreBench", ModelHostBench)
    fake_machine(monkeypatch, ch, n=1)
    ch.run_characterization(repeats=1, only=("row_chunks",), progress=False, root=tmp_path,
                            link="host")
    text = str(say.row_patterns([rc.latest_row_chunk_record("h200-x1-host", tmp_path)]))
    assert "256 B of each 2816-byte row" in text and "At K = 132 producers" in text
    assert "within 0.0% of it" in text  # the model drains every pattern alike
