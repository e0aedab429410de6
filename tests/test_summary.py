"""``summary --json`` reports the committed records' headline numbers per platform."""
import json
import subprocess
import sys

from xstage_lab.summary import summary


def test_summary_has_calibration_per_platform():
    s = summary()
    assert s["platforms"], "no platform with committed records"
    for platform, entries in s["platforms"].items():
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
