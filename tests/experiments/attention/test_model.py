"""Fig. 11's no-refit predictions (eqs. 17–20) from a calibration and FA-only times."""
import pandas as pd
import pytest

from xstage_lab import model
from xstage_lab.analysis.attention.model import residual_predictions
from xstage_lab.analysis.remote_store.characterization import latest_calibration
from xstage_lab.records import platforms


@pytest.fixture(scope="module")
def cal():
    return latest_calibration(platforms("calibration")[0])


def test_predictions_hand_worked(cal):
    # M = 8192, H = 24, P = 2: 64 row tiles × 12 heads = 768 tiles on 132 programs → 6 waves;
    # T_FA = 870 µs → G_Qloop = 145 µs, σ = 145 / 64 KV tiles
    table = pd.DataFrame([dict(M=8192, heads=24, head_dim=128, P=2, fa_us=870.0, e_res_us=5.0)])
    p = residual_predictions(table, cal, 128, 128, 132).iloc[0]
    assert p["waves"] == 6 and p["producers"] == 132
    assert p["burst_volume"] == 132 * 32768
    assert p["g_qloop_us"] == pytest.approx(145.0)
    assert p["kv_tile_us"] == pytest.approx(145.0 / 64)
    v_over_r = model.drain_time(132 * 32768, cal.drain_rate_GBps)
    # the Q-loop covers the drain: no X-Stage residual; the coupled issuer pays V/R − σ/2 per wave
    assert p["e_drain_us"] == 0.0
    t_lat = cal.completion["completion_latency_us"]  # measured by the fenced sweep
    assert p["t_lat_us"] == t_lat
    assert p["e_cc_us"] == pytest.approx(6 * (v_over_r + t_lat - 145.0 / 64 / 2))
    assert p["m_star_ub"] == model.convergence_bound(p["g_star_us"], 145.0 / 64, 128)


def test_predictions_at_p8(cal):
    # M = 8192, H = 24, P = 8: 64 row tiles × 3 local heads = 192 tiles on 132 programs → 2 waves,
    # every program busy in the first; at M = 4096 (96 tiles) fewer producers than programs
    table = pd.DataFrame([dict(M=8192, heads=24, head_dim=128, P=8, fa_us=290.0, e_res_us=1.0),
                          dict(M=4096, heads=24, head_dim=128, P=8, fa_us=40.0, e_res_us=1.0)])
    p8, p4 = (r for _, r in residual_predictions(table, cal, 128, 128, 132).iterrows())
    assert (p8["waves"], p8["producers"], p8["g_qloop_us"]) == (2, 132, 145.0)
    assert p8["kv_tile_us"] == pytest.approx(145.0 / 64)
    assert (p4["waves"], p4["producers"], p4["burst_volume"]) == (1, 96, 96 * 32768)
    assert p4["t_iss0_us"] == cal.platform_model().t_iss0_at(96, 32768)


def test_short_qloop_exposes_the_drain(cal):
    # a Q-loop far shorter than V/R: eq. 18 gives a stall, eq. 19 subtracts the QK cover
    table = pd.DataFrame([dict(M=1024, heads=2, head_dim=128, P=2, fa_us=8.0, e_res_us=0.0)])
    p = residual_predictions(table, cal, 128, 128, 132).iloc[0]
    assert p["waves"] == 1 and p["producers"] == 8  # 8 row tiles × 1 head: fewer than 132 programs
    stall = model.issue_overhead(8.0, 8 * 32768, p["t_iss0_us"], cal.drain_rate_GBps)
    assert p["e_drain_us"] == pytest.approx(max(0.0, float(stall) - 8.0 / 8 / 2))


def test_paired_residuals_take_the_median_of_matched_differences():
    from types import SimpleNamespace

    from xstage_lab.analysis.attention.model import paired_residuals

    # the clock halves in trial 3: unpaired medians would shift, matched differences do not
    fa = [100.0, 101.0, 200.0, 99.0]
    fused = [103.0, 104.0, 206.0, 102.0]       # differences 3, 3, 6, 3 → median 3
    rec = SimpleNamespace(params={"raw": [{"M": 1024, "max_us": {"fa": fa, "fused": fused}}]})
    row = paired_residuals(rec).iloc[0]
    assert row["e_res_paired_fa_us"] == 3.0
    assert row["e_res_paired_fa_p25_us"] == 3.0 and row["e_res_paired_fa_p75_us"] == 3.75
    assert row["e_res_paired_fa_rel_pct"] == pytest.approx(3.0 / 100.5 * 100)
    assert "e_res_paired_fa_same_code_us" not in row


def test_prediction_check_names_the_nearer_prediction():
    from xstage_lab.analysis.attention.model import prediction_check

    pred = pd.DataFrame(dict(M=[8192, 65536], fa_us=[100.0, 1000.0], e_drain_us=[0.0, 0.0],
                             e_cc_us=[8.0, 20.0], e_res_paired_fa_same_code_us=[1.0, 18.0],
                             e_res_paired_fa_same_code_rel_pct=[1.0, 1.8],
                             e_res_paired_fa_same_code_p25_us=[-1.0, 15.0],
                             e_res_paired_fa_same_code_p75_us=[2.0, 21.0]))
    check = prediction_check(pred)
    # 1% measured: 0% (X-Stage) is nearer than 8%, and inside the IQR [-1%, 2%]
    assert check["nearer"].tolist() == ["X-Stage", "completion-coupled"]
    assert check["x_stage_in_iqr"].tolist() == [True, False]
    assert check["measured_p75_pct"].tolist() == pytest.approx([2.0, 2.1])


def test_paired_difference_matches_clock_states():
    from xstage_lab.analysis.attention.model import paired_difference

    r = paired_difference([10.0, 20.0, 12.0, 11.0], [8.0, 10.0, 9.0, 9.0],
                          [1980, 1500, 1965, None], [1980, 1980, 1980, 1980])
    assert r["median_us"] == 2.5                              # 2, 10, 3, 2
    assert r["matched_trials"] == 2 and r["matched_median_us"] == 2.5  # trials 1 and 3
    assert paired_difference([1.0], [0.0])["matched_median_us"] is None


def test_prediction_check_scores_both_epilogues():
    from xstage_lab.analysis.attention.model import prediction_check

    pred = pd.DataFrame(dict(M=[8192], fa_us=[100.0], e_drain_us=[0.0], e_cc_us=[8.0],
                             e_res_paired_fa_same_code_us=[1.0],
                             e_res_paired_fa_same_code_rel_pct=[1.0],
                             e_res_paired_fa_same_code_p25_us=[-1.0],
                             e_res_paired_fa_same_code_p75_us=[2.0],
                             e_res_fenced_paired_fa_same_code_us=[5.0],
                             e_res_fenced_paired_fa_same_code_rel_pct=[5.0],
                             e_res_fenced_paired_fa_same_code_p25_us=[4.0],
                             e_res_fenced_paired_fa_same_code_p75_us=[6.0]))
    c = prediction_check(pred).iloc[0]
    assert c["x_stage_err_pct"] == pytest.approx(-1.0) and c["x_stage_in_iqr"]
    # the coupled prediction, 8%, misses the fenced residual's IQR [4%, 6%]: it fails here
    assert c["completion_coupled_err_pct"] == pytest.approx(3.0)
    assert not c["completion_coupled_in_iqr"]
    assert c["fenced_measured_pct"] == pytest.approx(5.0)
    assert c["fenced_control"] == "fa_same_code"
    # a record with the fenced build's own local control scores the fenced residual against it
    pred = pred.assign(e_res_fenced_paired_fa_same_code_fenced_us=[7.0],
                       e_res_fenced_paired_fa_same_code_fenced_rel_pct=[7.0],
                       e_res_fenced_paired_fa_same_code_fenced_p25_us=[7.5],
                       e_res_fenced_paired_fa_same_code_fenced_p75_us=[9.0])
    c = prediction_check(pred).iloc[0]
    assert c["fenced_control"] == "fa_same_code_fenced"
    assert c["fenced_measured_pct"] == pytest.approx(7.0) and c["completion_coupled_in_iqr"]


def test_counterfactual_attention_entry(tmp_path):
    from xstage_lab.analysis.attention.model import summary_counterfactual
    from xstage_lab.records import write_record

    assert summary_counterfactual("h200-x2", tmp_path) == {}
    table = pd.DataFrame([dict(M=8192, fa_us=100.0, fused_us=101.0, fused_fenced_us=120.0,
                               serial_us=130.0, e_res_us=1.0, e_res_fenced_us=20.0,
                               hiding_ratio=1 - 1 / 30, hiding_ratio_fenced=1 - 20 / 30)])
    write_record("fa_a2a", "h200-x2", table, {}, {}, root=tmp_path)
    entry = summary_counterfactual("h200-x2", tmp_path)
    assert entry["per_M"] == [dict(M=8192, coupled_us=120.0, decoupled_us=101.0, fa_us=100.0,
                                   serial_us=130.0, e_res_coupled_us=20.0, e_res_decoupled_us=1.0,
                                   hiding_ratio_coupled=pytest.approx(1 - 20 / 30),
                                   hiding_ratio_decoupled=pytest.approx(1 - 1 / 30))]
    # a record with the same-code control reports the paired residuals against it too
    write_record("fa_a2a", "h200-x2", table.assign(fa_same_code_us=95.0,
                                                  e_res_fenced_paired_fa_same_code_us=24.0,
                                                  e_res_paired_fa_same_code_us=6.0),
                 {}, {}, root=tmp_path / "same_code")
    row = summary_counterfactual("h200-x2", tmp_path / "same_code")["per_M"][0]
    assert row["fa_same_code_us"] == 95.0
    assert row["e_res_coupled_paired_same_code_us"] == 24.0
    assert row["e_res_decoupled_paired_same_code_us"] == 6.0


def test_prediction_failures_name_each_miss():
    from xstage_lab.analysis.attention.model import prediction_failures

    check = pd.DataFrame(dict(M=[8192, 16384], x_stage_pct=[0.0, 0.0], x_stage_err_pct=[-1.0, -3.0],
                              x_stage_in_iqr=[True, False]))
    (line,) = prediction_failures(check)
    assert line.startswith("M=16384: the X-Stage") and "-3.00 points" in line


def test_headline_marks_the_bar_from_16k_on():
    from types import SimpleNamespace

    from xstage_lab.analysis.attention.model import bar_failures, headline

    t = pd.DataFrame(dict(M=[8192, 16384, 32768], speedup=[1.1, 1.2, 1.0],
                          hiding_ratio=[0.9, 2.0, 0.5], speedup_fenced=[1.0, 1.1, 1.0],
                          hiding_ratio_fenced=[0.5, 1.0, 0.4], a2a_remote_us=[50.0, 100.0, 200.0],
                          a2a_nccl_us=[100.0, 100.0, 400.0], fa_tflops=[300.0, 390.0, 410.0],
                          cudnn_tflops=[500.0, 500.0, 500.0]))
    h = headline(SimpleNamespace(table=t))
    assert h["a2a_remote_over_nccl"].tolist() == [0.5, 1.0, 0.5]
    assert h["fa_over_cudnn"].tolist() == pytest.approx([0.6, 0.78, 0.82])
    assert h["meets_bar"].tolist() == [None, False, True]  # 8192 is below the bar's range
    (line,) = bar_failures(h)
    assert line.startswith("M=16384, FA-only: 0.780") and "0.8 bar" in line


def test_fenced_vs_decoupled_pairs_trials_and_counts_wins():
    from types import SimpleNamespace

    from xstage_lab.analysis.attention.model import fenced_vs_decoupled

    fused = [100.0, 110.0, 120.0, 130.0]
    fenced = [98.0, 111.0, 115.0, 126.0]            # differences -2, +1, -5, -4
    clocks = {"fused": [1800, 1800, 1500, 1800], "fused_fenced": [1800, 1800, 1800, 1810],
              "fa": [1500, 1500, 1500, 1500]}
    rec = SimpleNamespace(params={"raw": [{"M": 1024, "sm_clock_mhz": clocks,
                                           "max_us": {"fused": fused, "fused_fenced": fenced}}]})
    r = fenced_vs_decoupled(rec).iloc[0]
    assert r["fenced_minus_fused_us"] == -3.0
    assert r["fenced_faster_trials"] == "3/4"
    assert r["matched_trials"] == 3 and r["matched_us"] == -2.0  # trial 3's clocks differ
    assert r["fa_clock_mhz"] == 1500 and r["fused_clock_mhz"] == 1800
    assert r["rel_pct"] == pytest.approx(-3.0 / 115.0 * 100)
    assert "fa_minus_same_code_us" not in r  # no same-code control in this record
    rec.params["raw"][0]["max_us"] |= {"fa": [10.0, 12.0, 14.0, 16.0],
                                       "fa_same_code": [9.0, 9.0, 9.0, 9.0]}
    r = fenced_vs_decoupled(rec).iloc[0]
    assert r["fa_minus_same_code_us"] == 4.0                 # differences 1, 3, 5, 7
    assert (r["fa_minus_same_code_p25_us"], r["fa_minus_same_code_p75_us"]) == (2.5, 5.5)
    assert "fenced_minus_fenced_same_code_us" not in r
    rec.params["raw"][0]["max_us"]["fa_same_code_fenced"] = [96.0, 108.0, 113.0, 126.0]
    r = fenced_vs_decoupled(rec).iloc[0]
    assert r["fenced_minus_fenced_same_code_us"] == 2.0      # differences 2, 3, 2, 0
    assert r["fenced_build_minus_same_code_us"] == 101.5    # 87, 99, 104, 117


def test_epilogue_builds_pair_each_build_with_local():
    from types import SimpleNamespace

    from xstage_lab.analysis.attention.model import epilogue_builds

    trials = {"c": [100.0, 102.0, 104.0], "c+remote": [99.0, 103.0, 101.0],
              "c+remote_fenced": [95.0, 97.0, 99.0], "cudnn": [80.0, 80.0, 80.0]}
    runs = [SimpleNamespace(record_id="a", params={"params": {"epilogues": True},
                                                   "raw": [{"M": 4096, "trials_us": trials}]}),
            SimpleNamespace(record_id="b", params={"params": {}, "raw": []})]
    t = epilogue_builds(runs)
    assert list(t["config"]) == ["c"]                       # cuDNN and non-epilogue runs left out
    r = t.iloc[0]
    assert r["remote_minus_local_us"] == -1.0               # differences -1, +1, -3
    assert r["remote_fenced_minus_local_us"] == -5.0
    assert r["remote_fenced_minus_local_pct"] == pytest.approx(-5.0 / 102.0 * 100)


def test_tuning_table_orders_runs_by_creation_and_keeps_the_best(tmp_path):
    from xstage_lab.analysis.attention.model import (bar_failures, tuning_best, tuning_records,
                                                        tuning_table)
    from xstage_lab.records import write_record

    def run(created, d, ratios):
        t = pd.DataFrame(dict(M=[16384] * 3, method=["a", "b", "cudnn"], median_us=[1.0] * 3,
                              p25_us=[1.0] * 3, p75_us=[1.0] * 3, tflops=[1.0] * 3,
                              over_cudnn=ratios + [1.0], over_cudnn_paired=ratios + [1.0],
                              sm_clock_mhz=[[1980.0]] * 3))
        return write_record("fa_tuning", "h200-x1", t, {"created_utc": created,
                            "params": {"heads": 12, "head_dim": d, "trials": 3}}, {}, root=tmp_path)

    run("2026-11-29T23:00:00", 64, [0.7, 0.9])      # written first, created last
    run("2026-11-29T22:00:00", 128, [0.6, 0.75])
    recs = tuning_records("h200-x1", tmp_path)
    assert [r.params["params"]["head_dim"] for r in recs] == [128, 64]
    table = tuning_table(recs)
    assert table[table["method"] == "cudnn"]["meets_bar"].isna().all()
    best = tuning_best(table)
    assert best["method"].tolist() == ["b", "b"]
    assert best["over_cudnn_paired"].tolist() == [0.75, 0.9]
    assert best["meets_bar"].tolist() == [False, True]
    (line,) = bar_failures(best, "over_cudnn_paired")
    assert line.startswith("M=16384, d=128, b: 0.750")



def test_tuning_table_reads_rows_tagged_by_the_harness_as_before(tmp_path):
    """A record written through ``experiments.harness`` carries the point (heads, head_dim) and
    its sweep tags in its rows: the table is the one its parameters alone gave."""
    from xstage_lab.analysis.attention.model import tuning_records, tuning_table
    from xstage_lab.records import write_record

    rows = pd.DataFrame(dict(M=[16384] * 2, method=["a", "cudnn"], median_us=[1.0] * 2,
                             p25_us=[1.0] * 2, p75_us=[1.0] * 2, tflops=[1.0] * 2,
                             over_cudnn=[0.9, 1.0], over_cudnn_paired=[0.9, 1.0],
                             sm_clock_mhz=[[1980.0]] * 2))
    params = {"params": {"heads": 12, "head_dim": 128, "trials": 3}}
    write_record("fa_tuning", "h200-x1", rows, {"created_utc": "2026-11-29T22:00:00", **params},
                 {}, root=tmp_path)
    tagged = rows.assign(heads=12, head_dim=128, point=0, repeat=0, order=0)
    write_record("fa_tuning", "h200-x1", tagged, {"created_utc": "2026-11-29T23:00:00", **params},
                 {}, root=tmp_path)
    before, after = (tuning_table([r]) for r in tuning_records("h200-x1", tmp_path))
    assert list(before.columns)[:4] == ["record", "heads", "head_dim", "trials"]
    pd.testing.assert_frame_equal(before.drop(columns="record"), after.drop(columns="record"))

def test_verdict_agreement_needs_a_p25_above_zero_for_reshape():
    from xstage_lab.analysis.attention.model import verdict_agreement

    tag = "e_res_paired_fa_same_code"
    p = pd.DataFrame({"M": [1, 2, 3, 4], "action": ["reshape", "reshape", "reshape", "piggyback"],
                      f"{tag}_us": [20.0, 200.0, -100.0, 5.0],
                      f"{tag}_p25_us": [8.0, -15.0, -130.0, -2.0]})
    v = verdict_agreement(p)
    # tolerance = median − p25: 12, 215, 30, 7; excess beyond it only at M = 1
    assert v["tolerance_us"].tolist() == pytest.approx([12.0, 215.0, 30.0, 7.0])
    assert v["agrees"].tolist() == ["yes", "no", "no", "yes"]
    assert "excess_us" not in p  # the predictions are not modified


def test_the_model_on_another_link_keeps_the_fa_times_and_takes_that_link_s_m_x():
    """Issue 26: ``link_comparison`` sets the host link's M_X beside NVLink's for the same FA-only
    times: each link's columns are ``residual_predictions`` on its calibration (R and Q beside),
    and nothing measured is carried over to the host link."""
    from xstage_lab import load
    from xstage_lab.analysis.attention.model import (host_link_comparisons, link_comparison,
                                                     link_predictions)
    from xstage_lab.prose.attention import host_link

    [record] = load("fa_a2a", "h200-x2", "replay")
    nvlink = latest_calibration("h200-x2")
    host = latest_calibration("h200-x1-host")
    table = link_comparison(record, {"nvlink": nvlink, "host": host})
    assert table["fa_us"].tolist() == record.table["fa_us"].tolist()
    assert (table["host_drain_rate_GBps"] == host.drain_rate_GBps).all()
    assert (table["nvlink_drain_rate_GBps"] == nvlink.drain_rate_GBps).all()
    assert (table["host_capacity_bytes"]
            == host.platform_model().capacity_at(int(table["producers"].iloc[0]))).all()
    alone = link_predictions(record, host)
    assert "e_res_us" not in alone and table["host_e_cc_us"].tolist() == alone["e_cc_us"].tolist()
    assert list(host_link_comparisons([record], [host])) == [("h200-x2", "h200-x1-host")]
    assert str(host_link([record], [], {})).startswith("No host-link calibration is among")
