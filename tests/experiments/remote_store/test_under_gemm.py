"""A GEMM beside a full host X-Stage (issue 26): the ``under_gemm`` probe's points, the rows of a
launch from its event times and stamps, its fits and term in the calibration and the summary,
through the harness with a probe that answers from a model."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tests.experiments.remote_store.test_characterization import (
    host_probe_characterization, make_inv)
from xstage_lab.calibration import calibrate, under_gemm_fits, under_gemm_terms
from xstage_lab.experiments.remote_store.characterization import HOST, under_gemm_sweep
from xstage_lab.ops.remote_store.under_gemm import (GEMMS, gemm_flops, gemm_rows,
                                                    validate_gemm_point)

INV1 = make_inv(1)


def test_the_sweep_holds_the_gemm_alone_and_both_stores_at_each_k():
    sweep = under_gemm_sweep(132, 0, 5)
    points = pd.DataFrame(sweep.points())
    assert sweep.repeats == 5 and len(points) == 2 * 7
    for p in sweep.points():
        validate_gemm_point(p, INV1)
    assert (points["dst"] == HOST).all() and (points["mode"] == "under_gemm").all()
    assert set(points["gemm"]) == set(GEMMS) == {"linear1", "linear2"}
    for _, grp in points.groupby("gemm"):
        assert set(zip(grp["stores"], grp["producers"])) == {
            ("none", 0), *((s, k) for k in (16, 33, 66) for s in ("local", "host"))}
    assert gemm_flops("linear1") == gemm_flops("linear2") == 2.0 * 4096 * 7168 * 2048


GOOD = dict(mode="under_gemm", gemm="linear1", producers=33, stores="host", src=0, dst=HOST,
            gap_us=0.0)


@pytest.mark.parametrize("change,match", [
    (dict(stores="peer"), "stores"), (dict(gemm="attention"), "gemm"),
    (dict(dst=0), "host memory"), (dict(src=1), "must name GPUs"),
    (dict(producers=132), "leaving SMs"), (dict(producers=0), "leaving SMs"),
    (dict(stores="none"), "alone on every SM")])
def test_bad_probe_points_rejected(change, match):
    validate_gemm_point(GOOD, INV1)
    with pytest.raises(ValueError, match=match):
        validate_gemm_point(dict(GOOD, **change), INV1)


def test_rows_count_only_the_matmuls_inside_the_store_window():
    # five matmuls of 1 ms (events) each, stamped [start, end] in ns; the window holds the
    # middle three whole, the first starts before it and the last ends after it
    stamps = np.array([[0, 1000], [1100, 2100], [2200, 3200], [3300, 4300], [4400, 5400]])
    ms = np.array([9.0, 1.0, 2.0, 3.0, 9.0])
    rows = gemm_rows(ms, stamps, (1000, 4400), 2e12, 3)
    assert rows == {"gemm_us": 2000.0, "gemm_tflops": pytest.approx(1000.0),
                    "gemms_inside": 3, "gemms": 5}
    # the GEMM alone: every matmul counts
    assert gemm_rows(ms, stamps, None, 2e12, 3)["gemms_inside"] == 5
    with pytest.raises(RuntimeError, match="3 of 5 matmuls ran inside the store window"):
        gemm_rows(ms, stamps, (1000, 4400), 2e12, 4)
    unwritten = stamps.copy()
    unwritten[2, 1] = -1  # the poison left
    with pytest.raises(RuntimeError, match="not written"):
        gemm_rows(ms, unwritten, (1000, 4400), 2e12, 3)


# --- fits and the calibration's term -------------------------------------------------------------

def gemm_rates(gemm: str, producers: int, stores: str) -> dict:
    """What a model platform answers: 700 TF/s alone; on the SMs left, in proportion to them
    beside local stores and, beside host stores, slowed 1.2x (linear1) or 1.6x (linear2) at
    K = 66, by half that excess at smaller K."""
    sms = 132 - producers
    tflops = 700.0 * sms / 132
    if stores == "host":
        full = {"linear1": 1.2, "linear2": 1.6}[gemm]
        tflops /= full if producers == 66 else 1 + (full - 1) / 2
    return {"gemm_us": gemm_flops(gemm) / tflops / 1e6, "gemm_tflops": tflops,
            "gemms_inside": 20, "gemms": 30, "gemm_sms": sms,
            "store_rate_GBps": {"host": 52.0, "local": 900.0, "none": np.nan}[stores],
            "window_us": np.nan if stores == "none" else 150000.0}


def gemm_table(repeats: int = 3) -> pd.DataFrame:
    return pd.DataFrame([dict(p, repeat=r, sweep="under_gemm",
                              **gemm_rates(p["gemm"], p["producers"], p["stores"]))
                         for p in under_gemm_sweep(132, 0, repeats).points()
                         for r in range(repeats)])


def test_fits_per_gemm_and_k_and_the_forecasts_term_from_the_largest_k():
    fits = under_gemm_fits(gemm_table())
    assert list(zip(fits["gemm"], fits["producers"])) == [
        (g, k) for g in ("linear1", "linear2") for k in (16, 33, 66)]
    assert fits["gemm_alone_tflops"].to_numpy() == pytest.approx(700.0)
    assert fits["gemm_sms"].tolist() == [116, 99, 66] * 2
    assert fits["gemm_beside_local_stores_tflops"].to_numpy() == pytest.approx(
        [700.0 * s / 132 for s in (116, 99, 66)] * 2)
    assert fits["gemm_slowdown"].to_numpy() == pytest.approx([1.1, 1.1, 1.2, 1.3, 1.3, 1.6])
    # the median over the GEMMs at K = 66
    assert under_gemm_terms(fits) == {"gemm_slowdown_full": pytest.approx(1.4)}
    with pytest.raises(ValueError, match="no 'under_gemm' probe"):
        under_gemm_fits(gemm_table().assign(mode="under_load"))


class ModelGemmProbe:
    """Stands in for GemmBesideStores: validates like it and answers from ``gemm_rates``."""

    launches: list = []

    def __init__(self, settings, inv):
        self.settings, self.inv, self.seed = settings, inv, 9

    def measure(self, p, check_stores=False):
        validate_gemm_point(p, self.inv)
        self.launches.append((p, check_stores))
        return gemm_rates(p["gemm"], p["producers"], p["stores"])


@pytest.fixture
def model_probe(monkeypatch):
    return host_probe_characterization(monkeypatch, "GemmBesideStores", ModelGemmProbe)


def test_the_probe_alone_is_a_partial_record_the_calibration_reads(model_probe, tmp_path):
    from xstage_lab.analysis.remote_store.row_chunks import latest_with_sweep
    from xstage_lab.analysis.remote_store.under_load import forecast_terms
    from xstage_lab.records import read_record

    ch = model_probe
    assert latest_with_sweep("h200-x1-host", "under_gemm", tmp_path) is None
    path = ch.run_characterization(repeats=1, only=("under_gemm",), progress=False,
                                   root=tmp_path, link="host")
    assert path.parent == tmp_path / "remote_store_partial" / "h200-x1-host"
    rec = read_record(path)
    assert rec.params["under_gemm_settings"]["window_us"] == 150000.0
    # each point checked (stores read back) before its warm-up and again after its repeat
    checked = [c for _, c in ModelGemmProbe.launches]
    assert len(checked) == 14 * 4 and checked.count(True) == 28
    assert latest_with_sweep("h200-x1-host", "under_gemm", tmp_path).record_id == rec.record_id
    assert under_gemm_terms(under_gemm_fits(rec.table)) == {"gemm_slowdown_full":
                                                            pytest.approx(1.4)}
    # the under-load probe's terms stay apart: this record has none
    assert forecast_terms("h200-x1-host", tmp_path) == ({}, None)


def test_a_complete_record_calibrates_as_before_with_the_gemm_term_beside(model_probe, tmp_path):
    from xstage_lab.records import read_record
    from xstage_lab.summary import host_link_entry

    ch = model_probe
    path = ch.run_characterization(repeats=1, only=("drain_rate", "gap", "isolated",
                                                    "under_gemm"),
                                   progress=False, root=tmp_path, link="host")
    rec = read_record(path)
    probe = rec.table["mode"] == "under_gemm"
    with_probe, _ = calibrate(rec.table, "p", "r")
    without, _ = calibrate(rec.table[~probe], "p", "r")
    assert with_probe.drain_rate_GBps == without.drain_rate_GBps
    assert without.under_gemm is None and "gemm_slowdown_full" not in without.summary()
    assert with_probe.gemm_slowdown_full == pytest.approx(1.4)
    assert with_probe.summary()["gemm_slowdown_full"] == pytest.approx(1.4)
    cal = read_record(ch.write_calibration(path, tmp_path)).params["calibration"]
    assert len(cal["under_gemm"]) == 6
    assert host_link_entry("h200-x1-host", tmp_path)["gemm_slowdown_full"] == pytest.approx(1.4)


def test_the_notebooks_passage_says_each_ks_slowdown_from_the_record():
    """``prose.host_link.under_gemm`` on the model probe's rows: each K's slowdown and rates."""
    from types import SimpleNamespace

    from xstage_lab.prose.host_link import under_gemm

    text = str(under_gemm([SimpleNamespace(record_id="rid", platform="x-host",
                                           table=gemm_table())]))
    assert "`rid` (x-host): the matmul (linear1, linear2;" in text
    assert "K = 16: 1.1–1.3× (473–559 TF/s against 615)" in text
    assert "K = 66: 1.2–1.6× (219–292 TF/s against 350)" in text
