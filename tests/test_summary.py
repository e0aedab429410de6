"""``summary --json`` reports the committed records' headline numbers per platform."""
import json
import subprocess
import sys
from datetime import datetime, timezone

import pytest

from xstage_lab.records import platforms
from xstage_lab.summary import summary


@pytest.fixture(scope="module")
def committed() -> dict:
    """``summary()`` of the committed records, made once for the tests that read it (about 2 s a
    call); read only."""
    return summary()


def test_summary_has_calibration_per_platform(committed):
    """Every platform with calibration records (one GPU has none: it has no peer to store to)."""
    s = committed
    assert s["platforms"], "no platform with committed records"
    calibrated = {p: e for p, e in s["platforms"].items() if "calibration" in e}
    assert set(calibrated) == set(platforms("calibration"))
    for platform, entries in calibrated.items():
        cal = entries["calibration"]
        assert cal["R_GBps"] > 0
        assert all(k.startswith("K=") and ",B=" in k for k in cal["T_iss0_us"])
        assert all(k.startswith("K=") for k in cal["Q_MiB"])
        for key in ("knee_KB_per_producer", "G_star_us", "gap_prediction_median_abs_err_pct",
                    "local_control_tiss_spread_pct"):
            assert key in cal


def test_cli_prints_json():
    out = subprocess.run([sys.executable, "-m", "xstage_lab", "summary", "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["platforms"]


def test_fa_a2a_rows_carry_the_documented_keys(committed):
    from xstage_lab.summary import FA_A2A_KEYS

    for platform, entries in committed["platforms"].items():
        for row in entries.get("fa_a2a", []):
            assert set(row) == set(FA_A2A_KEYS)
            assert row["e_res_us"] == row["fused_us"] - row["fa_us"]
            assert abs(row["speedup"] - row["serial_us"] / row["fused_us"]) < 1e-9


def test_fa_a2a_keeps_the_latest_record_of_each_attention_shape(tmp_path):
    import pandas as pd

    from xstage_lab.records import write_record
    from xstage_lab.summary import FA_A2A_KEYS, fa_a2a_entry

    def run(head_dim, seqs, fa_us, when):
        rows = [dict(dict.fromkeys(FA_A2A_KEYS, 1.0), M=m, heads=24, head_dim=head_dim, P=2,
                     fa_us=fa_us) for m in seqs]
        write_record("fa_a2a", "test-x2", pd.DataFrame(rows), {}, {"git_commit": "x"}, tmp_path,
                     created=datetime(2026, 12, 1, when, tzinfo=timezone.utc))

    run(128, [8192, 16384], 10.0, 1)
    run(64, [8192], 20.0, 2)       # another head dim: its rows join
    run(128, [8192], 30.0, 3)      # the same shape again: replaces that shape's rows
    rows = fa_a2a_entry("test-x2", tmp_path)
    assert [(r["head_dim"], r["M"], r["fa_us"]) for r in rows] == [(64, 8192, 20.0),
                                                                   (128, 8192, 30.0)]


def test_moe_entry_aggregates_its_per_config_speedups(committed):
    import numpy as np

    for platform, entries in committed["platforms"].items():
        if "moe" not in entries:
            continue
        moe = entries["moe"]
        speedups = np.array([c["speedup"] for c in moe["per_config"]])
        assert moe["configs"] == len(speedups)
        assert moe["max_speedup"] == round(float(speedups.max()), 4)
        assert moe["geomean_speedup"] == round(float(np.exp(np.log(speedups).mean())), 4)
        for c in moe["per_config"]:
            assert abs(c["speedup"] - c["wave_us"] / c["interleaved_us"]) < 1e-6


def test_counterfactual_carries_both_worlds(committed):
    for platform, entries in committed["platforms"].items():
        if "counterfactual" not in entries:
            continue
        cf = entries["counterfactual"]
        assert cf["T_lat_us"] > 0 and cf["T_complete_us"]
        assert cf["sum_law_err_pct"] < cf["max_law_err_pct"]
        for row in cf["microbenchmark"]:
            assert row["period_coupled_us"] > 0 and row["period_decoupled_us"] > 0


def test_an_eight_gpu_platform_beside_the_committed_one(eight_gpu_root, committed):
    """Issue 7: an h200-x8 platform gets every entry the committed h200-x2 has, its own (P = 8,
    8-GPU injection patterns), and leaves the h200-x2 entries as they were."""
    platforms = summary(root=eight_gpu_root)["platforms"]
    assert set(platforms) == {"h200-x2", "h200-x8"}
    x2 = committed["platforms"]["h200-x2"]
    assert json.dumps(platforms["h200-x2"], sort_keys=True) == json.dumps(x2, sort_keys=True)
    x8 = platforms["h200-x8"]
    assert set(x8) == set(x2)
    assert {row["P"] for row in x8["fa_a2a"]} == {8}
    assert x8["moe"]["configs"] == x2["moe"]["configs"]
    pat = x8["patterns"]
    assert pat["gpus"] == 8 and pat["degenerate"] == [] and not pat["excluded"]
    assert len(pat["per_instance"]) == 56 + 8 + 8 + 1
    by = {(i["pattern"], i["instance"]): i for i in pat["per_instance"]}
    assert [s["src"] for s in by[("all_to_one", "dst=3")]["sources"]] == [0, 1, 2, 4, 5, 6, 7]
    assert all(s["no_refit_from_baseline"]["share"] == pytest.approx(1 / 7, abs=1e-3)
               for s in by[("all_to_one", "dst=3")]["sources"])


def test_moe_kernel_and_forecast_entries_follow_the_schema(committed):
    """``moe_kernel`` and ``moe_forecast`` of every platform with those records, as
    docs/summary_json.md states them."""
    s = committed
    kernels = [e for e in s["platforms"].values() if "moe_kernel" in e]
    assert kernels, "no moe_kernel record"
    for entries in kernels:
        k = entries["moe_kernel"]
        assert set(k) == {"rows", "geomean_ratio_to_cublas", "call_overhead_us"}
        assert set(k["rows"][0]) == {"model", "precision", "routing", "tokens", "kernel_wave_us",
                                     "kernel_interleaved_us", "call_wave_us", "tflops",
                                     "cublas_dense_tflops", "grouped_mm_tflops", "unfused_us"}
        assert set(k["geomean_ratio_to_cublas"]) == {"bf16", "fp8"}
        f = entries["moe_forecast"]["rows"]
        assert {r["ep"] for r in f} == {2, 4, 8}
        assert set(f[0]) == {"model", "precision", "ep", "remote_share", "g_wave_us",
                             "v_over_r_us", "predicted_stall_us", "predicted_speedup"}
