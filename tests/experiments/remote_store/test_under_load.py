"""The X-Stage under load (issue 26): the probe's CUDA source (compiled by nvcc for sm_90, no GPU
needed), its points, the CPU references its launches are checked against, its rows, its fits in
the calibration and the terms the host-link MoE forecast takes, through the harness with a probe
that answers from a model."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.experiments.cuda_testing import compile_sm90, needs_nvcc
from tests.experiments.remote_store.test_characterization import (
    host_probe_characterization, make_inv)
from xstage_lab.calibration import calibrate, launch_means, under_load_fits, under_load_terms
from xstage_lab.experiments.remote_store.characterization import HOST, under_load_sweep
from xstage_lab.ops.remote_store.under_load import (LOAD_ITER_BYTES, STORE_ITER_BYTES,
                                                    check_store_regions, expected_load_sums,
                                                    load_rows, region_vecs, roles,
                                                    validate_load_point)

CU = Path(__file__).resolve().parents[3] / "kernels" / "host_store_load.cu"
INV1 = make_inv(1)
M32 = 0xFFFFFFFF


@needs_nvcc
def test_cuda_source_compiles_for_sm90_and_exports_the_probe(tmp_path):
    symbols, entries, ptx = compile_sm90(CU, tmp_path)
    assert entries == symbols == {"store_under_load", "stamp_timer"}
    # 16-byte stores, 16-byte loads, the clock that bounds the loop, no fence in it; the barrier
    # flag for under_gemm a plain volatile store
    assert "st.global.v4.u32" in ptx and "ld.global.nc.v4.u32" in ptx
    assert "st.volatile.global.u32" in ptx
    assert "%globaltimer" in ptx and "membar" not in ptx and "fence" not in ptx


def pattern(seed: int, burst: int, producer: int, vec: int) -> tuple[int, ...]:
    """kernels/xstage_device.cuh's burst_pattern, written out again in Python integers."""
    tag = seed ^ (burst * 0x9E3779B1 & M32)
    w1 = vec * 0x85EBCA77 & M32
    w2 = (producer * 0xC2B2AE3D & M32) ^ w1
    return tag ^ w1, w1, w2, (tag ^ w2) * 0x27D4EB2F & M32


def stored_by_the_kernel(n_iters, region: int, seed: int, total_vecs: int) -> np.ndarray:
    """The store loop of host_store_load.cu played in Python over a poisoned destination."""
    out = np.full((total_vecs, 4), 0xA5A5A5A5, dtype=np.uint32)
    passes = region // 128
    for w, n in enumerate(n_iters):
        for it in range(n):
            for u in range(4):
                for lane in range(32):
                    p = (it % passes) * 128 + u * 32 + lane
                    out[w * region + p] = pattern(seed, it // passes, w, p)
    return out.reshape(-1)


def test_the_store_check_counts_what_the_warps_did_not_leave():
    region, seed = 384, 12345  # three iterations a pass
    n_iters = np.array([0, 2, 3, 7])
    words = stored_by_the_kernel(n_iters, region, seed, 4 * region + 50)
    assert check_store_regions(words, n_iters, region, seed) == 0
    vecs = words.reshape(-1, 4)
    for at, value in [(region + 200, 0xA5A5A5A5),       # warp 1's first pass, poison: unwritten
                      (region + 300, 1),                 # a position warp 1 never wrote
                      (3 * region + 10, 7),              # warp 3: not its last pass
                      (4 * region + 3, 0)]:              # past every region
        bad = vecs.copy()
        bad[at, 0] = value
        assert check_store_regions(bad.reshape(-1), n_iters, region, seed) == 1, at
    # a warp that wrote one iteration fewer than it counted
    assert check_store_regions(words, np.array([0, 2, 3, 8]), region, seed) > 0


@pytest.mark.parametrize("n", [0, 1, 3, 4, 9])
def test_expected_load_sums_match_the_kernels_loop(n):
    region = 1024  # four iterations a pass
    first = np.array([0, 1 << 26, 3 * region + 5])  # large indices: the sum wraps
    got = expected_load_sums(np.full(3, n), first, region)
    want = np.zeros((3, 32), dtype=np.uint64)
    for w in range(3):
        for it in range(n):
            for u in range(8):
                for lane in range(32):
                    i = int(first[w]) + (it % 4) * 256 + u * 32 + lane
                    want[w, lane] = (int(want[w, lane]) + 4 * i) & M32
    assert got.dtype == np.uint32 and np.array_equal(got, want.astype(np.uint32))


def test_region_and_roles():
    # 1 GiB over 116 SMs of 16 load warps: whole iterations of 256 vectors each
    r = region_vecs(1 << 30, 116 * 16, 8)
    assert r % 256 == 0 and r * 116 * 16 * 16 <= 1 << 30 and (r + 256) * 116 * 16 * 16 > 1 << 30
    assert roles("split", 33, 132) == {"store_ctas": 33, "store_warps": 16, "load_from_cta": 33,
                                       "load_warps": 16}
    assert roles("shared", 132, 132) == {"store_ctas": 132, "store_warps": 8,
                                         "load_from_cta": 0, "load_warps": 8}


def test_load_rows_sum_each_roles_warps_over_their_windows():
    # [t at the window's start, iterations before, t at the end, iterations in all] per warp
    stamps = np.array([[1000, 10, 3001000, 110],       # store: 100 iterations in 3 ms
                       [1000, 5, 2001000, 55],         # store: 50 in 2 ms
                       [1200, 30, 3001200, 1030],      # load: 1000 in 3 ms
                       [2 ** 64 - 1] * 4], dtype=np.uint64)  # idle
    store = np.array([True, True, False, False])
    load = np.array([False, False, True, False])
    rows = load_rows(stamps, store, load)
    assert rows["store_rate_GBps"] == pytest.approx((100 / 3e6 + 50 / 2e6) * STORE_ITER_BYTES)
    assert rows["load_rate_GBps"] == pytest.approx(1000 / 3e6 * LOAD_ITER_BYTES)
    assert rows["window_us"] == 3000.0 and (rows["store_warps"], rows["load_warps"]) == (2, 1)
    assert np.isnan(load_rows(stamps, store, np.zeros(4, bool))["load_rate_GBps"])


def test_the_sweep_holds_every_control_and_validates_on_one_gpu():
    sweep = under_load_sweep(132, 0, 7)
    points = pd.DataFrame(sweep.points())
    assert sweep.repeats == 7 and len(points) == 16
    for p in sweep.points():
        validate_load_point(p, INV1)
    assert (points["dst"] == HOST).all() and (points["mode"] == "under_load").all()
    shapes = set(zip(points["layout"], points["producers"]))
    assert shapes == {("split", 16), ("split", 33), ("split", 66), ("shared", 132)}
    for _, grp in points.groupby(["layout", "producers"]):
        assert set(zip(grp["stores"], grp["load"])) == {("host", 1), ("host", 0), ("local", 1),
                                                        ("none", 1)}


GOOD = dict(mode="under_load", layout="split", producers=33, stores="host", load=1, src=0,
            dst=HOST, gap_us=0.0)


@pytest.mark.parametrize("change,match", [
    (dict(stores="peer"), "stores"), (dict(layout="mixed"), "layout"), (dict(load=2), "load"),
    (dict(dst=0), "host memory"), (dict(src=1), "must name GPUs"),
    (dict(producers=132), "leaving SMs"), (dict(producers=0), "leaving SMs"),
    (dict(layout="shared", producers=66), "every SM"),
    (dict(stores="none", load=0), "measures nothing")])
def test_bad_probe_points_rejected(change, match):
    with pytest.raises(ValueError, match=match):
        validate_load_point(dict(GOOD, **change), INV1)


# --- fits and forecast terms ---------------------------------------------------------------------

def probe_rates(layout: str, producers: int, stores: str, load: int) -> dict:
    """What a model platform answers: host stores drain 50 GB/s alone and 45 beside the load;
    the load streams 3000 GB/s alone, 2900 beside local stores and 2000 (split) or 1000
    (shared) beside host stores that fill the X-Stage."""
    drain = {"host": 45.0 if load else 50.0, "local": 900.0, "none": np.nan}[stores]
    beside_host = 2000.0 if layout == "split" else 1000.0
    rate = {"host": beside_host, "local": 2900.0, "none": 3000.0}[stores] if load else np.nan
    return {"store_rate_GBps": drain, "load_rate_GBps": rate, "window_us": 3000.0,
            "store_warps": 1, "load_warps": 1}


def probe_table(repeats: int = 3) -> pd.DataFrame:
    rows = [dict(p, repeat=r, sweep="under_load", **probe_rates(p["layout"], p["producers"],
                                                              p["stores"], p["load"]))
            for p in under_load_sweep(132, 0, repeats).points() for r in range(repeats)]
    return pd.DataFrame(rows)


def test_fits_per_layout_and_the_forecasts_terms_from_the_shared_layout():
    fits = under_load_fits(probe_table())
    assert list(zip(fits["layout"], fits["producers"])) == [("split", 16), ("split", 33),
                                                            ("split", 66), ("shared", 132)]
    assert fits["drain_under_load_ratio"].to_numpy() == pytest.approx(0.9)
    assert fits["load_alone_GBps"].to_numpy() == pytest.approx(3000.0)
    assert fits["load_slowdown"].to_numpy() == pytest.approx([1.45, 1.45, 1.45, 2.9])
    assert under_load_terms(fits) == {"drain_under_load_ratio": pytest.approx(0.9),
                                      "load_slowdown_full": pytest.approx(2.9)}
    # without the shared layout, the split layout with the most producers
    split = fits[fits["layout"] == "split"]
    assert under_load_terms(split)["load_slowdown_full"] == pytest.approx(1.45)
    with pytest.raises(ValueError, match="no 'under_load' probe"):
        under_load_fits(probe_table().assign(mode="periodic"))


class ModelLoadProbe:
    """Stands in for HostLoadProbe: validates like it and answers from ``probe_rates``."""

    launches: list = []

    def __init__(self, settings, inv):
        self.settings, self.inv, self.seed = settings, inv, 7

    def measure(self, p, check_stores=False):
        validate_load_point(p, self.inv)
        self.launches.append((p, check_stores))
        return probe_rates(p["layout"], p["producers"], p["stores"], p["load"])


@pytest.fixture
def model_probe(monkeypatch):
    return host_probe_characterization(monkeypatch, "HostLoadProbe", ModelLoadProbe)


def test_the_probe_alone_is_a_partial_record_the_forecast_reads(model_probe, tmp_path):
    from xstage_lab.analysis.remote_store.under_load import forecast_terms
    from xstage_lab.records import read_record

    ch = model_probe
    assert forecast_terms("h200-x1-host", tmp_path) == ({}, None)
    path = ch.run_characterization(repeats=1, only=("under_load",), progress=False,
                                   root=tmp_path, link="host")
    assert path.parent == tmp_path / "remote_store_partial" / "h200-x1-host"
    rec = read_record(path)
    assert rec.params["under_load_settings"]["window_us"] == 3000.0
    # each point checked (stores read back) before its warm-up and again after its repeat
    checked = [c for _, c in ModelLoadProbe.launches]
    assert len(checked) == 16 * 4 and checked.count(True) == 32
    terms, name = forecast_terms("h200-x1-host", tmp_path)
    assert name == f"remote_store_partial/h200-x1-host/{rec.record_id}"
    assert terms == {"drain_under_load_ratio": pytest.approx(0.9),
                     "load_slowdown_full": pytest.approx(2.9)}


def test_a_complete_record_calibrates_as_before_with_the_probes_numbers_beside(model_probe,
                                                                              tmp_path):
    from tests.synthetic import KNOWN
    from xstage_lab.records import read_record
    from xstage_lab.summary import host_link_entry

    ch = model_probe
    path = ch.run_characterization(repeats=1, only=("drain_rate", "gap", "isolated",
                                                    "under_load"),
                                   progress=False, root=tmp_path, link="host")
    rec = read_record(path)
    probe = rec.table["mode"] == "under_load"
    # the burst fits leave the probe's launches out: the same launches and M_X as without them
    assert launch_means(rec.table).equals(launch_means(rec.table[~probe]))
    with_probe, _ = calibrate(rec.table, "p", "r")
    without, _ = calibrate(rec.table[~probe], "p", "r")
    assert with_probe.drain_rate_GBps == without.drain_rate_GBps
    assert with_probe.drain_rate_GBps == pytest.approx(KNOWN["drain_rate"], rel=1e-3)
    assert without.under_load is None and "load_slowdown_full" not in without.summary()
    assert with_probe.load_slowdown_full == pytest.approx(2.9)
    cal = read_record(ch.write_calibration(path, tmp_path)).params["calibration"]
    assert cal["drain_under_load_ratio"] == pytest.approx(0.9)
    assert len(cal["under_load"]) == 4
    entry = host_link_entry("h200-x1-host", tmp_path)
    assert entry["drain_under_load_ratio"] == pytest.approx(0.9)
    assert entry["load_slowdown_full"] == pytest.approx(2.9)


def test_the_notebooks_passage_says_each_layouts_slowdown_from_the_record():
    """``prose.host_link.under_load`` on the model platform's probe: the drain beside the load
    against alone, each split K's slowdown and the shared layout's, from the record's rows."""
    from types import SimpleNamespace

    from xstage_lab.prose.host_link import under_load

    record = SimpleNamespace(record_id="rid", platform="x-host", table=probe_table())
    text = str(under_load([record]))
    assert "drain at 45.0 GB/s, 0.900× their rate alone" in text
    assert "K = 16: 1.4×; K = 33: 1.4×; K = 66: 1.4×" in text
    assert "every SM stores and loads, 2.9× (1000 GB/s against 2900)" in text
