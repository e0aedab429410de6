"""The multi-GPU forecast of the fused MoE (``moe_forecast``), on hand-worked numbers."""
import pandas as pd
import pytest

from xstage_lab import model
from xstage_lab.analysis.moe import forecast as moe_forecast

# R = 1000 GB/s moves 1e6 bytes per µs; T_iss^0 of 132 producers of 16 KiB is 0.5 µs (measured),
# elsewhere the affine floor; Q = 3 MB.
PLATFORM = model.PlatformModel(drain_rate=1000.0, t_iss0={(132, 16384): 0.5},
                               capacity={132: 3e6},
                               issue_floor={132: model.IssueFloor(132, 0.4, 20000.0)})
KERNEL = dict(model="m", precision="bf16", hidden=4096, intermediate=2048, block_m=128,
              block_n1=128, block_n2=128, programs=132, waves=1, l1_tiles_per_program=32,
              l2_tiles_per_program=64, mainloop_l1_us=4.0, mainloop_l2_us=1.0,
              kernel_wave_us=1000.0, kernel_interleaved_us=900.0)


def test_tile_orders_keep_the_tiles_and_spread_linear1():
    orders = moe_forecast.tile_orders(5, 3, 2)
    assert orders["wave"] == ["L1", "L1", "L2", "L1", "L1", "L1", "L2", "L2"]
    assert orders["interleaved"] == ["L1", "L2", "L1", "L1", "L2", "L1", "L1", "L2"]
    half = moe_forecast.tile_orders(2, 4, 1)["interleaved"]  # n1/n2 = 1/2
    assert half == ["L2", "L1", "L2", "L2", "L1", "L2"]
    with pytest.raises(ValueError):
        moe_forecast.tile_orders(2, 0, 1)


def test_a_batch_with_fewer_linear2_tiles_than_programs_plays_a_program_that_holds_one():
    """A small batch (DiT-MoE at 256 tokens: 1.33 Linear-1 and 0.33 Linear-2 tiles per program,
    as the one-GPU entry-point run met it) is forecast, its program holding one Linear-2 tile."""
    assert moe_forecast.tile_orders(4 / 3, 1 / 3, 1) == {"wave": ["L1", "L2"],
                                                         "interleaved": ["L1", "L2"]}
    small = {**KERNEL, "l1_tiles_per_program": 4 / 3, "l2_tiles_per_program": 1 / 3}
    row = moe_forecast.host_forecast_row({**small, "routing": "balanced", "tokens": 256},
                                         PLATFORM, 1)
    assert row["predicted_wave_us"] >= KERNEL["kernel_wave_us"]


def test_remote_share():
    assert [moe_forecast.remote_share(p) for p in (2, 4, 8)] == [0.5, 0.75, 0.875]
    with pytest.raises(ValueError):
        moe_forecast.remote_share(1)


def test_expert_wave_stalls_where_interleaving_covers_the_drain():
    """P = 2: V = 132 · 128·128·2 B · 1/2 = 2162688 B, V/R = 2.163 µs. Expert-Wave's gap is
    T_L2 = 1 µs, so eq. 4 gives 2.163 − 1 − 0.5 = 0.663 µs per burst once the queue has filled;
    Interleaved adds (16/32)·4 µs of Linear-1 (G = 3 µs > V/R): no stall."""
    row = moe_forecast.forecast_row(KERNEL, PLATFORM, 2)
    assert row["burst_volume"] == 2162688
    assert row["v_over_r_us"] == pytest.approx(2.162688)
    assert (row["g_wave_us"], row["g_int_us"]) == (1.0, 3.0)
    assert row["steady_stall_wave_us"] == pytest.approx(0.662688)
    assert row["action"] == "reshape" and row["condition1_holds"]
    # the queue starts empty and grows by V − R·(T_iss^0 + G) = 0.66 MB a burst until it holds
    # Q = 3 MB (bursts 1-5 issue freely): the mean over 64 bursts is just under the steady stall
    assert 0.55 < row["predicted_stall_us"] <= 0.662688 + 1e-9
    assert row["predicted_stall_int_us"] == 0.0
    assert row["predicted_span_us"] == pytest.approx(0.5 + row["predicted_stall_us"])
    # each schedule's kernel time is its own measured one plus its program's stall
    assert row["predicted_wave_us"] == pytest.approx(1000.0 + 64 * row["predicted_stall_us"])
    assert row["predicted_interleaved_us"] == 900.0
    assert row["predicted_speedup"] == pytest.approx(
        (1000.0 + 64 * row["predicted_stall_us"]) / 900.0)


def test_forecast_covers_every_shape_and_p():
    table = moe_forecast.forecast(pd.DataFrame([KERNEL, dict(KERNEL, model="n")]), PLATFORM)
    assert list(zip(table["model"], table["ep"])) == [(m, p) for m in "mn" for p in (2, 4, 8)]
    # more peers, more remote bytes per burst: the stall can only grow
    stalls = table[table["model"] == "m"]["predicted_stall_us"].tolist()
    assert stalls == sorted(stalls)
    with pytest.raises(KeyError, match="mainloop_l2_us"):
        moe_forecast.forecast_row({k: v for k, v in KERNEL.items() if k != "mainloop_l2_us"},
                                  PLATFORM, 2)


def test_kernel_inputs_from_a_moe_kernel_table():
    """The basis cells (balanced, 8192 tokens) of a record's table, tile sizes read from the
    record's JSON tile_config; the other cells (skewed, 4096 tokens) left out; a table without a
    basis cell is refused."""
    cell = {k: v for k, v in KERNEL.items() if not k.startswith("block_") and k != "programs"}
    tiles = '{"block_m": 128, "block_n1": 128, "block_n2": 256, "kernel": "gluon_ws"}'
    common = dict(tile_config=tiles, num_programs=132)
    table = pd.DataFrame([
        dict(cell, routing="balanced", tokens=4096, **dict(common, num_programs=66),
             mainloop_l1_us=2.0),
        dict(cell, routing="balanced", tokens=8192, **common),
        dict(cell, routing="skewed", tokens=8192, **common, model="other")])
    inputs = moe_forecast.kernel_inputs(table)
    assert list(inputs.columns) == list(moe_forecast.INPUT_COLUMNS)
    assert inputs["model"].tolist() == ["m"] and inputs.loc[0, "block_n2"] == 256
    assert inputs.loc[0, "programs"] == 132 and inputs.loc[0, "mainloop_l1_us"] == 4.0
    for other in (table["routing"] == "skewed", table["tokens"] == 4096):
        with pytest.raises(ValueError, match="no"):
            moe_forecast.kernel_inputs(table[other])


def test_the_command_prints_and_writes_only_with_root(tmp_path, capsys):
    """Without ``--root`` the forecast of the committed records is printed and nothing is
    written; with it, the record is written there and named."""
    import shutil

    from xstage_lab.records import RECORDS_DIR, list_records

    before = sorted(RECORDS_DIR.rglob("*"))
    moe_forecast.main([])
    out = capsys.readouterr().out
    assert "not saved" in out and "predicted_speedup" in out
    assert sorted(RECORDS_DIR.rglob("*")) == before
    for part in ("moe_kernel/h200-x1", "calibration/h200-x2"):
        shutil.copytree(RECORDS_DIR / part, tmp_path / part)
    moe_forecast.main(["--root", str(tmp_path)])
    written, = list_records("moe_forecast", "h200-x1", tmp_path)
    assert capsys.readouterr().out == f"wrote {written}\n"
    with pytest.raises(SystemExit) as e:
        moe_forecast.main(["--kernel-platform", "nowhere"])
    assert e.value.code == 2 and "no 'moe_kernel' record" in capsys.readouterr().err


def test_a_cell_drains_by_its_combine_row_patterns_model_where_measured():
    from xstage_lab import model
    from xstage_lab.analysis.moe.forecast import combine_platform

    base = model.PlatformModel(50.0, {}, {132: 4e6}, {})
    rows = model.PlatformModel(25.0, {}, {132: 1e6}, {})
    patterns = {(512, 8192): rows}  # block_n2 = 256 bf16 columns of a 4096-column row
    assert combine_platform(base, patterns, 256, 4096) == (rows, "rows 512/8192")
    assert combine_platform(base, patterns, 128, 1408) == (base, "contiguous")
