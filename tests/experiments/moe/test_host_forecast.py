"""The host-link tile forecast (``moe.host_forecast``) with the under-load probe's terms, on one
committed one-GPU kernel cell and the committed host-link calibration."""
import pytest

from xstage_lab.analysis.moe.kernel_view import latest_view
from xstage_lab.analysis.remote_store.characterization import latest_calibration
from xstage_lab.experiments.moe.host_forecast import (AUTO_LEAD_MULTIPLE, AUTO_TUNE_MARGIN,
                                                      cell_forecast, pick_auto,
                                                      tune_candidates)
from xstage_lab.records import RECORDS_DIR


@pytest.fixture(scope="module")
def cell():
    kernels = latest_view("h200-x1", RECORDS_DIR).table
    row = kernels[(kernels["model"] == "DiT-MoE") & (kernels["precision"] == "bf16")
                  & (kernels["routing"] == "balanced") & (kernels["tokens"] == 4096)]
    return row.iloc[0].to_dict(), latest_calibration("h200-x1-host").platform_model()


def test_no_probe_and_probes_whose_drain_held_forecast_alike(cell):
    """Neither probe's slowdown is played (``host_forecast``'s docstring)."""
    kernel, platform = cell
    plain, = cell_forecast(kernel, platform, [8])
    unit, = cell_forecast(kernel, platform, [8], under_load={"drain_under_load_ratio": 1.0,
                                                            "load_slowdown_full": 36.0,
                                                            "gemm_slowdown_full": 37.0})
    assert plain == unit


def test_a_slower_drain_under_load_lengthens_the_host_cells_only(cell):
    kernel, platform = cell
    plain, = cell_forecast(kernel, platform, [8])
    loaded, = cell_forecast(kernel, platform, [8], under_load={"drain_under_load_ratio": 0.5})
    local = [k for k in plain if k.endswith("_local_us")]
    assert local and all(loaded[k] == plain[k] for k in local)
    assert loaded["simulated_scale"] == plain["simulated_scale"]
    # with the Combine of all eight sources in host memory, Expert-Wave drains the X-Stage
    # full: a slower drain lengthens it
    assert loaded["tile_wave_us"] > 1.05 * plain["tile_wave_us"]


def test_auto_is_wave_where_predicted_fastest_else_interleaved_at_twice_the_derived_lead():
    assert AUTO_LEAD_MULTIPLE == 2
    leads = {"interleaved_d9": 100.0, "interleaved_d18": 100.4, "interleaved_d36": 99.0}
    assert pick_auto({"wave": 98.0, **leads}, 9) == "wave"
    assert pick_auto({"wave": 120.0, **leads}, 9) == "interleaved_d18"
    with pytest.raises(ValueError, match="interleaved_d18"):
        pick_auto({"wave": 120.0, "interleaved_d9": 100.0}, 9)


def test_auto_is_tuned_among_the_schedules_predicted_within_the_margin():
    assert AUTO_TUNE_MARGIN == 0.08
    assert tune_candidates({"wave": 120.0, "interleaved_d9": 100.0, "interleaved_d18": 108.0,
                            "interleaved_d36": 108.1}) == ["interleaved_d9", "interleaved_d18"]
    assert tune_candidates({"wave": 50.0, "interleaved_d9": 100.0}) == ["wave"]
    with pytest.raises(ValueError, match="no predicted schedule"):
        tune_candidates({})


def test_the_forecast_picks_by_its_own_predictions(cell):
    kernel, platform = cell
    for row in cell_forecast(kernel, platform, [1, 8]):
        times = {k.removeprefix("tile_").removesuffix("_us"): v for k, v in row.items()
                 if k.startswith("tile_") and k.endswith("_us") and not k.endswith("_local_us")}
        assert row["auto_schedule"] == pick_auto(times, row["lead_rows"])
        assert times[row["auto_schedule"]] == row["auto_predicted_us"]
