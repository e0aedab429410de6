"""Instrumentation, fenced epilogue and local-store control of the fused MoE kernel
(``kernels/moe_fused.py`` INSTRUMENT / FENCE, ``analysis/moe/trace.py``, ``moe_trace_bench``).

Kernel cases run in a child under ``TRITON_INTERPRET=1`` with the interpreter fixes of
``triton_testing`` plus one more: the interpreter has no inline assembly, so ``%clock64`` and
``%globaltimer`` read a host nanosecond clock and ``%smid`` reads the program id (the GPU reads the
registers). The analysis is tested on hand-made traces with known answers.
"""
from __future__ import annotations

import json
import re
import sys

import numpy as np
import pandas as pd
import pytest
import torch

from tests.experiments.moe.test_kernel import (
    SIM_PROGRAMS, TINY, TINY_TILES, in_program_order, poisoned_buffers, problem_of, rank_schedules,
    simulate_layer)
from tests.experiments.triton_testing import (assert_case_ok, child_main, child_results,
                                              interpreter_case_tests)
from xstage_lab.analysis.moe import trace as moe_trace
from xstage_lab.ops.moe.combine import local_combine_peers, local_store_control
from xstage_lab.ops.moe.fused import prepare_fused_moe
from xstage_lab.ops.moe.schedules import L1, L2, tile_table
from xstage_lab.ops.moe.shapes import MoEContractError, PRECISIONS, load_shapes


# ------------------------------------------------------------------------ hand-made traces

def _trace(programs: list[list[tuple]], clock_mhz: float = 1000.0):
    """Trace, table and counts from per-program lists of (kind, entry_us, ready_us, ml_end_us,
    end_us, spins); globaltimer in ns, clock64 = ns * clock_mhz / 1000 + an SM-specific offset."""
    g_n, t_n = len(programs), max(len(p) for p in programs)
    trace = np.full((g_n, t_n, 10), -1, dtype=np.int64)
    table = np.zeros((g_n, t_n, 4), dtype=np.int32)
    counts = np.array([len(p) for p in programs], dtype=np.int32)
    for g, tiles in enumerate(programs):
        offset = 10_000 * (g + 1)  # clock64 origins differ per SM
        for i, (kind, *points_us, spins) in enumerate(tiles):
            ns = np.array(points_us) * 1e3
            trace[g, i, 0:4] = np.round(ns * clock_mhz / 1e3) + offset
            trace[g, i, 4:8] = np.round(ns) + 1_000_000
            trace[g, i, 8] = g
            trace[g, i, 9] = spins if kind == L2 else -1
            table[g, i] = (kind, 0, i, 0)
    return trace, table, counts


def test_tile_frame_durations_and_successors():
    trace, table, counts = _trace([
        [(L1, 0, 0, 4, 5, 0), (L2, 5, 7, 10, 13, 3), (L1, 13, 13, 17, 18, 0)],
        [(L2, 1, 2, 6, 8, 0), (L2, 8, 8, 12, 14, 0)]], clock_mhz=1500.0)
    assert moe_trace.trace_clock_mhz(trace, counts) == pytest.approx(1500.0, rel=1e-6)
    f = moe_trace.tile_frame(trace, table, counts)
    assert f["wait_us"].tolist() == pytest.approx([0, 2, 0, 1, 0], abs=1e-6)
    assert f["mainloop_us"].tolist() == pytest.approx([4, 3, 4, 4, 4], abs=1e-6)
    assert f["span_us"].tolist() == pytest.approx([1, 3, 1, 2, 2], abs=1e-6)
    assert f["t0_us"].tolist() == pytest.approx([0, 5, 13, 1, 8])
    assert f["next_kind"].tolist() == [L2, L1, -1, L2, -1]
    assert f["next_mainloop_us"].iloc[1] == pytest.approx(4)
    assert np.isnan(f["next_mainloop_us"].iloc[2])
    assert f["spins"].tolist() == [0, 3, 0, 0, 0]


def test_unstamped_tile_rejected():
    trace, table, counts = _trace([[(L1, 0, 0, 1, 2, 0), (L2, 2, 3, 4, 5, 0)]])
    trace[0, 1, 3] = -1  # epilogue never stamped: the tile was skipped
    with pytest.raises(moe_trace.TraceError, match="program 0 tile 1"):
        moe_trace.tile_frame(trace, table, counts)


def test_eq15_prediction_and_measured_stall():
    """Local control: L1 mainloop 10, L2 mainloop 4, L2 span 1 µs. Remote: an L2 tile with span 6
    followed by an L2 whose mainloop took 7 (cover 4: pred 2, meas 3), and an L2 with span 3
    followed by an L1 of mainloop 10 (cover 10: pred 0, meas 0)."""
    local = moe_trace.tile_frame(*_trace([[(L1, 0, 0, 10, 11, 0), (L2, 11, 11, 15, 16, 0),
                                           (L2, 16, 16, 20, 21, 0), (L1, 21, 21, 31, 32, 0)]]))
    remote = moe_trace.tile_frame(*_trace([[(L1, 0, 0, 10, 11, 0), (L2, 11, 11, 15, 21, 0),
                                            (L2, 21, 21, 28, 31, 0), (L1, 31, 31, 41, 42, 0)]]))
    assert moe_trace.mainloop_floor(local) == {L1: pytest.approx(10), L2: pytest.approx(4)}
    s = moe_trace.linear2_stalls(remote, local)
    assert s["cover_us"].tolist() == pytest.approx([4, 10])
    assert s["stall_pred_us"].tolist() == pytest.approx([2, 0], abs=1e-6)
    assert s["stall_meas_us"].tolist() == pytest.approx([3, 0], abs=1e-6)
    assert s["span_excess_us"].tolist() == pytest.approx([5, 2], abs=1e-6)
    stats = moe_trace.run_stats(remote, local)
    assert stats["stall_pred_us"] == pytest.approx(1.0) and stats["stall_meas_us"] == pytest.approx(1.5)
    assert stats["span_l2_us"] == pytest.approx(4.5) and stats["cover_l1_us"] == pytest.approx(10)
    row = moe_trace.table2_row("m", stats, {**stats, "span_l2_us": 1.0, "stall_pred_us": 0.0})
    assert row["span_wave_us"] == pytest.approx(4.5) and row["span_int_us"] == 1.0
    assert row["mma_l2_us"] == pytest.approx(4) and row["stall_pred_int_us"] == 0.0


def test_wait_share_measures_starvation():
    f = moe_trace.tile_frame(*_trace([[(L1, 0, 0, 4, 5, 0), (L2, 5, 9, 10, 11, 7)],
                                      [(L2, 0, 6, 8, 10, 9), (L1, 10, 10, 14, 15, 0)]]))
    stats = moe_trace.run_stats(f)
    assert stats["wait_l2_total_us"] == pytest.approx(10)
    assert stats["wait_l2_share"] == pytest.approx(10 / 26)
    assert stats["spins_l2_max"] == 9


def test_table2_and_counterfactual_from_a_record(tmp_path):
    """A moe_trace bench JSON (rows of the three kinds) imported as a record gives Table 2 from its
    trace rows and the coupled/decoupled times from its fenced rows."""
    from xstage_lab.records import import_bench_json

    local = moe_trace.tile_frame(*_trace([[(L1, 0, 0, 10, 11, 0), (L2, 11, 11, 15, 16, 0)]]))
    wave = moe_trace.tile_frame(*_trace([[(L2, 0, 0, 4, 10, 0), (L2, 10, 10, 17, 18, 0)]]))
    inter = moe_trace.tile_frame(*_trace([[(L2, 0, 0, 4, 5, 0), (L1, 5, 5, 15, 16, 0)]]))
    base = {"model": "M", "precision": "fp8", "routing": "skewed", "tokens": 64}
    shape = {"hidden": 512, "intermediate": 256, "num_programs": 4,
             "tile_config": {"block_m": 64, "block_n1": 128, "block_n2": 128}}
    rows = [{**base, **shape, "kind": "trace", "schedule": s, "path": "local",
             **moe_trace.run_stats(local)} for s in ("wave", "interleaved")]
    rows += [{**base, "kind": "trace", "schedule": "wave", "path": "remote",
              **moe_trace.run_stats(wave, local), "sample": {"span_us": [6.0]}},
             {**base, "kind": "trace", "schedule": "interleaved", "path": "remote",
              **moe_trace.run_stats(inter, local)},
             {**base, "kind": "fenced", "wave_us": 10.0, "interleaved_us": 9.0,
              "wave_fenced_us": 14.0, "interleaved_fenced_us": 12.5},
             {**base, "kind": "d_sweep", "lead_rows": 2, "interleaved_us": 9.5, "wave_us": 10.0}]
    doc = tmp_path / "bench.json"
    doc.write_text(json.dumps({"metadata": {"provenance": {"gpu_name": "NVIDIA H200",
                                                           "gpu_count": 2}}, "rows": rows}))
    import_bench_json(doc, "moe_trace", root=tmp_path)
    table = moe_trace.latest_trace_table("h200-x2", tmp_path)
    (row,) = moe_trace.table2(table)
    # wave: span 6 then 1; first L2 is followed by an L2 (cover 4): pred 2, meas 7 - 4 = 3
    assert row == {"model": "M", "span_wave_us": 3.5, "span_int_us": 1.0, "mma_l2_us": 4.0,
                   "mma_l1_us": 10.0, "stall_pred_wave_us": 2.0, "stall_meas_wave_us": 3.0,
                   "stall_pred_int_us": 0.0, "stall_meas_int_us": 0.0}
    assert moe_trace.counterfactual_rows(table) == [{**base, "wave_us": 10.0, "interleaved_us": 9.0,
                                                     "wave_fenced_us": 14.0,
                                                     "interleaved_fenced_us": 12.5}]
    assert moe_trace.summary_table2("h200-x2", tmp_path / "none") == []

    # the notebook's tables and figures from the same record
    from types import SimpleNamespace

    from xstage_lab import plots
    from xstage_lab.paper import published
    rec = SimpleNamespace(platform="h200-x2", table=table)
    t2 = plots.moe_table2(published("table2"), {rec.platform: moe_trace.table2(table)})
    ours = t2[t2["source"] == "h200-x2"].iloc[0]
    assert ours["err_wave_us"] == pytest.approx(-1.0) and len(t2) == 8
    assert t2[t2["source"] == "paper"]["model"].tolist()[0] == "DiT-MoE"
    cf = moe_trace.counterfactual_table(table)
    assert cf["coupled_over_decoupled_wave"].iloc[0] == pytest.approx(1.4)
    # +4 µs over 2 Linear-2 tiles of the one program (wave); +3.5 µs over 1 (interleaved)
    assert cf["fence_us_per_l2_tile_wave"].iloc[0] == pytest.approx(2.0)
    assert cf["fence_us_per_l2_tile_int"].iloc[0] == pytest.approx(3.5)
    from types import SimpleNamespace as NS
    (c1,) = moe_trace.condition1_rows(table, NS(drain_rate=65.536, t_iss0_at=lambda k, b: 0.25))
    assert c1["T_l2_mma_us"] == pytest.approx(4.0) and c1["span_wave_us"] == pytest.approx(3.5)
    assert c1["n1"] == 2 and c1["n2"] == 4 and c1["K_act"] == 4
    matrix = pd.DataFrame([{**base, "speedup": 0.8}, {**base, "tokens": 8, "speedup": 1.2}])
    reg = moe_trace.regressions_table(matrix, table)
    # the regressing cell is the traced one: Interleaved adds a 10 µs L1 mainloop, saves 7 µs of
    # L2 mainloop and 6 µs of L2 span (one program)
    assert reg["cause"].tolist() == ["mainloop_l1"] and reg["matrix_speedup"].tolist() == [0.8]
    assert reg["Δmainloop_l2 (µs/SM)"].iloc[0] == pytest.approx(-7.0)
    assert reg["makespan_ratio"].iloc[0] == pytest.approx(18 / 16)
    fig10 = plots.moe_span_distributions(rec, published("table2"))
    assert list(fig10.data[0].y) == [6.0]
    runs = plots.moe_trace_runs(rec)
    # wave remote spans 6 and 1 (median 3.5); the excess over the local control's Linear-2 span
    # of 1 is taken over tiles with a successor: the first, 6 - 1
    wave_remote = runs[(runs["schedule"] == "wave") & (runs["path"] == "remote")].iloc[0]
    assert len(runs) == 4 and wave_remote["span_l2_us"] == 3.5 and wave_remote["span_excess_us"] == 5.0
    sweep = plots.moe_d_sweep_rows(rec)
    assert sweep[["lead_rows", "wave_us", "interleaved_us"]].values.tolist() == [[2, 10.0, 9.5]]


def test_regression_cause_is_the_component_that_grows():
    """Two programs each. Interleaved waits 3 + 5 µs more on dependencies and its L1 mainloops
    are 1 µs shorter in total: starvation (wait_l2, +4 µs per SM) is the measured cause."""
    wave = moe_trace.run_stats(moe_trace.tile_frame(*_trace(
        [[(L1, 0, 0, 4, 5, 0), (L2, 5, 5, 8, 9, 0)], [(L1, 0, 0, 4, 5, 0), (L2, 5, 5, 8, 9, 0)]])))
    inter = moe_trace.run_stats(moe_trace.tile_frame(*_trace(
        [[(L1, 0, 0, 3, 4, 0), (L2, 4, 7, 10, 11, 1)], [(L1, 0, 0, 4, 5, 0), (L2, 5, 10, 13, 14, 1)]])))
    cause = moe_trace.regression_cause(wave, inter)
    assert cause["cause"] == "wait_l2"
    assert cause["delta_per_sm_us"]["wait_l2"] == pytest.approx(4.0)
    assert cause["delta_per_sm_us"]["mainloop_l1"] == pytest.approx(-0.5)
    assert cause["makespan_ratio"] == pytest.approx(9 / 14)
    assert moe_trace.regression_cause(wave, wave)["cause"] == "none"  # nothing grows


def test_regression_rows_cause_where_traced_proxies_elsewhere():
    """Matrix cells below 1, worst first: the traced cell gets its measured cause, makespan ratio
    and own wait shares, a ``regression`` row wins over a trace pair, an untraced cell is "not
    traced" with the causes of its model's traced regressing cells and the same model's traced
    wait shares beside it; the D sweep at the cell's lead D and the quartile range for every cell.
    Groups count the traced launches that show the loss."""
    wave = moe_trace.run_stats(moe_trace.tile_frame(*_trace(
        [[(L1, 0, 0, 4, 5, 0), (L2, 5, 5, 8, 9, 0)], [(L1, 0, 0, 4, 5, 0), (L2, 5, 5, 8, 9, 0)]])))
    inter = moe_trace.run_stats(moe_trace.tile_frame(*_trace(
        [[(L1, 0, 0, 3, 4, 0), (L2, 4, 7, 10, 11, 1)], [(L1, 0, 0, 4, 5, 0), (L2, 5, 10, 13, 14, 1)]])))
    base = {"model": "A", "precision": "fp8", "routing": "skewed", "tokens": 64}
    trace = pd.DataFrame(
        [{**base, "kind": "trace", "path": "remote", "schedule": "wave", **wave},
         {**base, "kind": "trace", "path": "remote", "schedule": "interleaved", **inter},
         {**base, "kind": "d_sweep", "lead_rows": 2, "d_factor": 1.0, "speedup": 0.7},
         {**base, "kind": "d_sweep", "lead_rows": 4, "d_factor": 2.0, "speedup": 1.01},
         {**base, "tokens": 32, "kind": "regression", "cause": "span_l2", "makespan_ratio": 1.02,
          "delta_per_sm_us": json.dumps({"span_l2": 3.0}),
          "wave": json.dumps({"wait_l2_share": 0.1}), "interleaved": json.dumps({"wait_l2_share": 0.3})}])
    spread = json.dumps({"wave": {"p25_us": 9.0, "p75_us": 11.0},
                         "interleaved": {"p25_us": 10.0, "p75_us": 12.0}})
    matrix = pd.DataFrame([{**base, "speedup": 0.64, "lead_rows": 2, "spreads": spread},
                           {**base, "tokens": 128, "speedup": 0.9, "lead_rows": 2, "spreads": spread},
                           {**base, "tokens": 32, "speedup": 0.95, "lead_rows": 2, "spreads": None},
                           {**base, "model": "B", "speedup": 0.99, "lead_rows": 2, "spreads": spread},
                           {**base, "tokens": 8, "speedup": 1.1, "lead_rows": 2, "spreads": spread}])
    rows = moe_trace.regression_rows(matrix, trace)
    assert [r["matrix_speedup"] for r in rows] == [0.64, 0.9, 0.95, 0.99]
    assert [r["cause"] for r in rows] == ["wait_l2", "not traced", "span_l2", "not traced"]
    assert rows[0]["speedup_lo"] == pytest.approx(0.75) and rows[0]["speedup_hi"] == pytest.approx(1.1)
    assert rows[0]["Δwait_l2 (µs/SM)"] == pytest.approx(4.0) and rows[2]["Δspan_l2 (µs/SM)"] == 3.0
    assert rows[1]["traced_wait_share_int"] == pytest.approx(inter["wait_l2_share"])
    assert rows[1]["traced_shape"] == "fp8/skewed/64" and "speedup_lo" not in rows[2]
    # a traced cell has its own wait shares: no proxy from the model's traced shape
    assert "traced_shape" not in rows[0] and "traced_wait_share_int" not in rows[2]
    assert rows[0]["makespan_ratio"] == round(9 / 14, 4) and rows[2]["makespan_ratio"] == 1.02
    assert rows[1]["dsweep_speedup_at_lead"] == 0.7 and rows[1]["dsweep_best_d_factor"] == 2.0
    assert "traced_shape" not in rows[3] and "dsweep_best_speedup" not in rows[3]
    # traced cells carry their own wait shares; untraced ones the causes of the model's traced
    # regressing cells (both of model A's, worst first), or "none"
    assert rows[0]["wait_share_int"] == pytest.approx(inter["wait_l2_share"])
    assert rows[2]["wait_share_wave"] == 0.1 and rows[2]["wait_share_int"] == 0.3
    assert "model_traced_regressions" not in rows[0] and "wait_share_wave" not in rows[1]
    assert rows[1]["model_traced_regressions"] == "fp8/skewed/64: wait_l2; fp8/skewed/32: span_l2"
    assert rows[3]["model_traced_regressions"] == "none"
    groups = moe_trace.regression_groups(rows)
    assert [(g["cause"], g["cells"]) for g in groups] == [("wait_l2", 1), ("not traced", 2),
                                                          ("span_l2", 1)]
    assert groups[1]["models"] == "A, B" and groups[1]["speedup_min"] == 0.9
    assert groups[0]["Δwait_l2 min..max (µs/SM)"] == "+4..+4" and "makespan_ratio_min" not in groups[1]
    # the wait_l2 trace shows the loss (9/14), the span_l2 one ran faster under Interleaved
    assert groups[0]["traces_with_loss"] == 1 and groups[2]["traces_with_loss"] == 0
    assert "traces_with_loss" not in groups[1]
    (c,) = moe_trace.traced_causes(trace)
    assert c["cause"] == "wait_l2" and c["wait_share_int"] > c["wait_share_wave"] == 0.0
    # mainloops 4 + 3 µs per program over 2 programs x 9 µs (wave); (3 + 3 + 4 + 3) / (2 x 14)
    assert c["mma_busy_wave"] == pytest.approx(14 / 18) and c["mma_busy_int"] == pytest.approx(13 / 28)


def parse_args(argv):
    from xstage_lab.experiments import harness
    from xstage_lab.experiments.moe import trace_bench
    return harness.parse(trace_bench.EXPERIMENT, argv)


def test_regression_cells_from_matrix_outputs(tmp_path):
    rows = [{"model": "DiT-MoE", "precision": "bf16", "routing": "skewed", "tokens": 2048, "speedup": 0.6},
            {"model": "Hy3", "precision": "fp8", "routing": "skewed", "tokens": 4096, "speedup": 1.2},
            {"model": "Qwen3.5", "precision": "fp8", "routing": "balanced", "tokens": 8192, "speedup": 0.9},
            {"model": "DiT-MoE", "precision": "fp8", "routing": "balanced", "tokens": 8192, "speedup": 0.5}]
    (tmp_path / "m.json").write_text(json.dumps({"metadata": {}, "rows": rows}))
    a = parse_args(["--out", "x", "--regressions", str(tmp_path / "m.json"), "--max-regressions", "2"])
    assert [c["speedup"] for c in a.regression_cells] == [0.5, 0.6]
    assert parse_args(["--out", "x"]).regression_cells == []


def test_geometric_mean_is_scipys_to_the_bit():
    """``analysis.moe.geometric_mean`` stands in for ``scipy.stats.gmean`` in the summaries
    (headline numbers, kernel geomeans): the same float on arrays of any length."""
    from scipy.stats import gmean

    from xstage_lab.analysis.moe import geometric_mean
    rng = np.random.default_rng(1)
    for n in (1, 2, 3, 7, 28, 112, 1000):
        values = rng.uniform(0.3, 3.0, n)
        assert geometric_mean(values) == float(gmean(values))
        assert geometric_mean(pd.Series(values)) == float(gmean(values))


def test_condition1_by_hand():
    """K_act = 4 SMs x 16 KiB = 64 KiB at R = 65.536 GB/s: V/R = 1 µs; T_iss^0 = T_L2 = 0.25 µs,
    so Expert-Wave's overhead (eq. 4) is 0.5 µs; n1/n2 = 2/4 of T_L1 = 0.6 µs offsets 0.3 (eq. 13);
    eq. 14: 4·1 > 4·0.5 + 2·0.6, interleaving alone is not sufficient."""
    from types import SimpleNamespace
    platform = SimpleNamespace(drain_rate=65.536, t_iss0_at=lambda k, b: 0.25)
    c = moe_trace.condition1(0.25, 0.6, hidden=512, intermediate=256, block_m=64, block_n1=128,
                             block_n2=128, programs=4, platform=platform)
    assert c["V_over_R_us"] == pytest.approx(1.0) and c["G_wave_us"] == pytest.approx(0.25)
    assert c["G_int_us"] == pytest.approx(0.55) and c["G_star_us"] == pytest.approx(0.75)
    assert c["dT_iss_wave_us"] == pytest.approx(0.5) and c["dT_iss_int_us"] == pytest.approx(0.2)
    assert c["condition1_holds"] is False
    assert moe_trace.condition1(0.25, 2.0, hidden=512, intermediate=256, block_m=64, block_n1=128,
                                block_n2=128, programs=4, platform=platform)["condition1_holds"]


def test_tensor_core_activity_fractions():
    """Two programs over 0..10 µs: program 0 in an L1 mainloop over 0..5, program 1 in an L2
    mainloop over 5..10. Two bins: L1 active 1/2 then 0; L2 0 then 1/2."""
    f = moe_trace.tile_frame(*_trace([[(L1, 0, 0, 5, 10, 0)], [(L2, 0, 5, 10, 10, 0)]]))
    act = moe_trace.tensor_core_activity(f, bins=2)
    assert act["t_us"] == pytest.approx([2.5, 7.5])
    assert act["l1"] == pytest.approx([0.5, 0.0]) and act["l2"] == pytest.approx([0.0, 0.5])


def test_sample_is_seeded_and_ordered():
    frame = pd.DataFrame({"a": np.arange(100)})
    s1, s2 = moe_trace.sample_tiles(frame, 10, 3), moe_trace.sample_tiles(frame, 10, 3)
    assert s1["a"].tolist() == s2["a"].tolist() == sorted(s1["a"].tolist()) and len(s1) == 10
    assert len(moe_trace.sample_tiles(frame, 500)) == 100


def test_d_sweep_leads():
    from xstage_lab.experiments.moe.trace_bench import DEFAULT_D_FACTORS
    from xstage_lab.experiments.moe.trace_steps import sweep_leads
    assert sweep_leads(3, DEFAULT_D_FACTORS) == [1, 2, 3, 6, 12, 24]
    assert sweep_leads(1, (0.25, 0.5, 1)) == [1]


def test_trace_bench_arguments():
    a = parse_args(["--out", "x.json"])
    assert a.models == list(load_shapes()) and a.local_models == a.models
    assert a.precision == "fp8" and a.routing == "skewed" and a.d_factors[2] == 1
    assert a.lead is None and a.k_fractions == sorted(a.k_fractions, reverse=True)


@pytest.mark.parametrize("bad", [["--d-sweep-models", "GPT-5"], ["--d-factors", "0,1"],
                                 ["--d-factors", "x"], ["--k-fractions", "1.5"],
                                 ["--knee-models", "DiT-MoE", "--kernel", "triton"],
                                 ["--models", ""], ["--models", "GPT-5"], ["--tokens", "0"],
                                 ["--samples", "0"], ["--max-regressions", "-1"], ["--lead", "0"],
                                 ["--trials", "0"]])
def test_trace_bench_refuses_bad_options(bad, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--out", "x.json", *bad])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_trace_bench_steps(tmp_path):
    """One sweep of steps: per model trace, fenced, the D sweep and one knee step per fraction
    where asked; then the regressing cells grouped by their weights, each with its own cell."""
    from xstage_lab.experiments import harness
    from xstage_lab.experiments.moe import trace_bench
    rows = [{"model": "DiT-MoE", "precision": "bf16", "routing": "skewed", "tokens": 2048, "speedup": 0.6},
            {"model": "Qwen3.5", "precision": "fp8", "routing": "balanced", "tokens": 8192, "speedup": 0.9},
            {"model": "DiT-MoE", "precision": "bf16", "routing": "balanced", "tokens": 8192, "speedup": 0.5}]
    (tmp_path / "m.json").write_text(json.dumps({"metadata": {}, "rows": rows}))
    a = parse_args(["--out", "x", "--models", "DiT-MoE,Hy3", "--d-sweep-models", "Hy3",
                    "--knee-models", "DiT-MoE", "--k-fractions", "0.5,1,0.5", "--tokens", "512",
                    "--regressions", str(tmp_path / "m.json")])
    sweep, = trace_bench.EXPERIMENT.sweeps(a)
    assert [ax.name for ax in sweep.axes] == ["step"] and sweep.repeats == 1
    points = sweep.points()
    assert [(p["kind"], p["model"], p.get("k_fraction")) for p in points] == [
        ("trace", "DiT-MoE", None), ("fenced", "DiT-MoE", None),
        ("knee_sweep", "DiT-MoE", 1.0), ("knee_sweep", "DiT-MoE", 0.5),
        ("trace", "Hy3", None), ("fenced", "Hy3", None), ("d_sweep", "Hy3", None),
        ("regression", "DiT-MoE", None), ("regression", "DiT-MoE", None),
        ("regression", "Qwen3.5", None)]
    assert all((p["precision"], p["routing"], p["tokens"]) == ("fp8", "skewed", 512)
               for p in points if p["kind"] != "regression")
    assert [(p["precision"], p["routing"], p["tokens"], p["matrix_speedup"])
            for p in points if p["kind"] == "regression"] == [
        ("bf16", "balanced", 8192, 0.5), ("bf16", "skewed", 2048, 0.6),
        ("fp8", "balanced", 8192, 0.9)]
    assert harness.chunk_indices([sweep], (1, 2)) == [[5, 6, 7, 8, 9]]


@pytest.fixture
def fake_steps(monkeypatch):
    """The trace experiment in this process with every GPU part replaced by a stand-in that logs
    what ran (``log``); ``failing``: models whose traced cell's check fails."""
    from types import SimpleNamespace
    from xstage_lab.experiments.moe import trace_bench as tb
    log, failing = [], set()
    monkeypatch.setattr(tb, "SymmetricCombine", lambda capacity: log.append(("combine", capacity)))
    monkeypatch.setattr(tb, "local_expert_weights",
                        lambda shape, rank, world, precision, **kw:
                        log.append(("weights", shape.model, precision)) or "w")
    monkeypatch.setattr(tb, "prepare_fused_moe", lambda *a, **k: "launch")

    def traced_cell(shape, weights, combine, args, world, seed):
        log.append(("cell", shape.model))
        return tb.TracedCell(SimpleNamespace(), weights, {}, None, None, {})

    def check_traced_cell(cell, combine, run):
        model = next(e[1] for e in reversed(log) if e[0] == "cell")
        log.append(("check cell", model))
        cell.base = {"model": model}
        return ["bad"] if model in failing else []

    def step_check(step, combine):
        log.append(("check", step.point["kind"], step.point["model"]))
        return []

    def rows(step_or_cell, combine, run, *rest):
        point = getattr(step_or_cell, "point", None)
        kind = point["kind"] if point else ("trace" if rest else "fenced")
        log.append(("measure", kind))
        return [{"kind": kind}] if kind in ("trace", "d_sweep") else {"kind": kind}

    monkeypatch.setattr(tb, "traced_cell", traced_cell)
    monkeypatch.setattr(tb, "check_traced_cell", check_traced_cell)
    monkeypatch.setattr(tb, "setup_config", lambda *a: SimpleNamespace(
        schedules={"wave": 0, "interleaved": 1}, cfg=None, layout=None, peers=None))
    monkeypatch.setattr(tb, "prepare_d_sweep", lambda step, args: None)
    monkeypatch.setattr(tb, "prepare_knee", lambda step: None)
    for name in ("check_d_sweep", "check_knee", "check_regression"):
        monkeypatch.setattr(tb, name, step_check)
    for name in ("trace_rows", "fenced_row", "d_sweep_rows", "knee_row", "regression_row"):
        monkeypatch.setattr(tb, name, rows)
    monkeypatch.setattr(tb, "progress", lambda row: row["kind"])
    experiment = tb.MoETrace()
    experiment.launch = "in_process"
    return experiment, log, failing


def test_trace_steps_check_before_timing_and_make_weights_once(fake_steps, tmp_path):
    from xstage_lab.experiments import harness
    experiment, log, _ = fake_steps
    (tmp_path / "m.json").write_text(json.dumps({"metadata": {}, "rows": [
        {"model": "Hy3", "precision": "fp8", "routing": "skewed", "tokens": 64, "speedup": 0.5}]}))
    args = harness.parse(experiment, [
        "--out", str(tmp_path / "t.json"), "--models", "DiT-MoE,Hy3", "--tokens", "32",
        "--d-sweep-models", "Hy3", "--knee-models", "DiT-MoE", "--k-fractions", "1,0.5",
        "--regressions", str(tmp_path / "m.json"), "--no-progress"])
    harness.run(experiment, args)
    shapes = load_shapes()
    assert log[0] == ("combine", max(t * shapes[m].top_k * shapes[m].hidden
                                     for m, t in (("DiT-MoE", 32), ("Hy3", 32), ("Hy3", 64))))
    # after each step's timed runs, its checks again (Experiment.recheck): the traced cell's
    # (its launches' spin-error flags count every run) and the step's own
    assert log[1:] == [
        ("weights", "DiT-MoE", "fp8"), ("cell", "DiT-MoE"), ("check cell", "DiT-MoE"),
        ("measure", "trace"), ("check cell", "DiT-MoE"),
        ("measure", "fenced"), ("check cell", "DiT-MoE"),
        ("check", "knee_sweep", "DiT-MoE"), ("measure", "knee_sweep"),
        ("check cell", "DiT-MoE"), ("check", "knee_sweep", "DiT-MoE"),
        ("check", "knee_sweep", "DiT-MoE"), ("measure", "knee_sweep"),
        ("check cell", "DiT-MoE"), ("check", "knee_sweep", "DiT-MoE"),
        ("weights", "Hy3", "fp8"), ("cell", "Hy3"), ("check cell", "Hy3"),
        ("measure", "trace"), ("check cell", "Hy3"),
        ("measure", "fenced"), ("check cell", "Hy3"),
        ("check", "d_sweep", "Hy3"), ("measure", "d_sweep"),
        ("check cell", "Hy3"), ("check", "d_sweep", "Hy3"),
        # the regressing cell shares Hy3's fp8 weights: not made again
        ("check", "regression", "Hy3"), ("measure", "regression"),
        ("check", "regression", "Hy3")]
    doc = json.loads((tmp_path / "t.json").read_text())
    assert [r["kind"] for r in doc["rows"]] == ["trace", "fenced", "knee_sweep", "knee_sweep",
                                                "trace", "fenced", "d_sweep", "regression"]
    meta = doc["metadata"]
    assert meta["experiment"] == "moe_trace" and meta["k_fractions"] == [1.0, 0.5]
    assert meta["lead_rows"] == "d_knee (eq. 16)" and meta["tokens_per_rank"] == 32


def test_a_chunk_checks_its_first_models_cell_before_timing(fake_steps, tmp_path):
    """A chunk starting at a model's fenced step still checks the traced cell first; a failing
    check stops the run before that model is timed, with no output."""
    from xstage_lab.experiments import harness
    experiment, log, failing = fake_steps
    out = tmp_path / "t.json"
    argv = ["--out", str(out), "--models", "DiT-MoE,Hy3", "--d-sweep-models", "",
            "--no-progress"]
    harness.run(experiment, harness.parse(experiment, [*argv, "--chunk", "1/4"]))
    assert log[1:] == [("weights", "DiT-MoE", "fp8"), ("cell", "DiT-MoE"),
                       ("check cell", "DiT-MoE"), ("measure", "fenced"),
                       ("check cell", "DiT-MoE")]  # the re-check after the step's runs
    out.unlink()
    log.clear()
    failing.add("Hy3")
    with pytest.raises(SystemExit, match="correctness failed"):
        harness.run(experiment, harness.parse(experiment, argv))
    assert log[-2:] == [("cell", "Hy3"), ("check cell", "Hy3")] and not out.exists()


def test_registered_for_measure_all_and_import():
    from xstage_lab.experiments import experiment, measure_all_names, module_name
    assert "moe_trace" in measure_all_names()
    assert module_name("moe_trace") == "xstage_lab.experiments.moe.trace_bench"
    assert experiment("moe_trace").name == "moe_trace"


@pytest.mark.parametrize("world", [2, 8])
def test_local_store_control_contract(world):
    layer = simulate_layer("bf16", world)
    peers = local_combine_peers(poisoned_buffers(layer))
    local = torch.zeros(world, peers.slots, peers.hidden, dtype=torch.bfloat16)
    ctrl = local_store_control(peers, local)
    assert ctrl.ptrs == tuple(r.data_ptr() for r in local) and ctrl.slots == peers.slots
    with pytest.raises(MoEContractError, match="local control buffer"):
        local_store_control(peers, local[:world - 1].contiguous())


# ------------------------------------------------------------- kernel cases in the interpreter

def _patch_inline_asm() -> None:
    """The interpreter has no inline asm: %clock64 and %globaltimer read a host nanosecond clock
    (monotone), %smid the program id."""
    import time

    import triton.language as tl
    import triton.runtime.interpreter as interp

    class _Result:
        def __init__(self, handle):
            self.handle = handle

        def get_result(self, i):
            return self.handle

    def create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
        if "%smid" in asm:
            return _Result(interp.TensorHandle(np.array([self.grid_idx[0]], np.int32), tl.int32))
        return _Result(interp.TensorHandle(np.array([time.perf_counter_ns()], np.int64), tl.int64))

    interp.InterpreterBuilder.create_inline_asm = create_inline_asm


def _linear(layer, name):
    out = []
    for rank in range(layer.world):
        sched = rank_schedules(layer, rank)[name]
        out.append(in_program_order(problem_of(layer, rank), sched, SIM_PROGRAMS))
    return out


def _launch(layer, schedules, **kw):
    buffers = poisoned_buffers(layer)
    peers = local_combine_peers(buffers)
    calls = []
    for rank, sched in enumerate(schedules):
        call = prepare_fused_moe(layer.layouts[rank], layer.weights[rank], sched, peers,
                                     config=TINY_TILES, max_spin_iters=1000, **kw)
        call()
        calls.append(call)
    return buffers, calls


def case_variants_bitwise(precision: str) -> dict:
    """Instrumented and fenced launches leave the Combine buffers bitwise equal to the timing
    kernel's, under both schedules; the trace stamps are monotone within every tile and from each
    tile to the next of its program, and the frame analyses."""
    layer = simulate_layer(precision, 2, seed=7)
    detail = {}
    for name in ("wave", "interleaved"):
        scheds = _linear(layer, name)
        plain, calls = _launch(layer, scheds)
        assert [c.error_count() for c in calls] == [0, 0]
        assert all(not torch.isnan(b.float()).any() for b in plain)
        for kw in ({"instrument": True}, {"fence": True}):
            got, calls = _launch(layer, scheds, **kw)
            assert [c.error_count() for c in calls] == [0, 0], kw
            assert all(torch.equal(a, b) for a, b in zip(plain, got)), (name, kw)
        _, calls = _launch(layer, scheds, instrument=True)
        for rank, call in enumerate(calls):
            table, counts = tile_table(scheds[rank])
            trace = call.trace.numpy()
            for g, c in enumerate(counts):
                rec = trace[g, :c]
                assert (rec[:, :8] >= 0).all()
                assert (np.diff(rec[:, 0:4], axis=1) >= 0).all() and (np.diff(rec[:, 4:8], axis=1) >= 0).all()
                assert (rec[1:, 0] >= rec[:-1, 3]).all()  # next tile starts after this one ends
                assert (rec[:, 8] == g).all()
                l2 = table[g, :c, 0] == L2
                assert (rec[l2, 9] == 0).all()  # program order: every dependency already met
            frame = moe_trace.tile_frame(trace, table, counts, clock_mhz=1000.0)
            assert len(frame) == int(counts.sum())
        detail[name] = int(counts.sum())
    return detail


def case_local_store_control(world: int) -> dict:
    """The local-store control writes each row to local[source][slot], the values the remote
    run stores into that source's buffer; the peers' buffers stay poisoned."""
    layer = simulate_layer("bf16", world, seed=8)
    scheds = _linear(layer, "interleaved")
    plain, _ = _launch(layer, scheds)
    peers_bufs = poisoned_buffers(layer)
    peers = local_combine_peers(peers_bufs)
    written = 0
    for rank, sched in enumerate(scheds):
        local = torch.full((world, peers.slots, peers.hidden), float("nan"), dtype=torch.bfloat16)
        call = prepare_fused_moe(layer.layouts[rank], layer.weights[rank], sched,
                                     local_store_control(peers, local), config=TINY_TILES,
                                     instrument=True)
        call()
        assert call.error_count() == 0
        for src in range(world):
            rows = ~torch.isnan(local[src].float()).any(dim=-1)
            assert torch.equal(local[src][rows], plain[src][rows])
            written += int(rows.sum())
    assert all(torch.isnan(b.float()).all() for b in peers_bufs)
    assert written == world * TINY["tokens"] * TINY["top_k"]  # every slot of every source, once
    return {"rows": written}


def interpreter_cases() -> dict:
    cases = {f"variants_bitwise_{p}": (case_variants_bitwise, p) for p in PRECISIONS}
    cases.update({f"local_store_control_P{w}": (case_local_store_control, w) for w in (2, 8)})
    return cases


def _compile_variant(precision: str, variant: str) -> dict:
    """Compile the ``variant`` ("instrument" or "fence") launch for sm_90 with its PTX, to read
    the order of barriers, clock reads and Combine stores."""
    from tests.experiments.moe.test_kernel import _compile_sm90
    return _compile_sm90(precision, with_ptx=True, **{variant: True})


interpreter_results, test_interpreter_case = interpreter_case_tests(
    "tests.experiments.moe.test_trace", interpreter_cases())


def test_stamps_and_fence_in_ptx():
    """In the sm_90 PTX: every %clock64 read directly follows a bar.sync (nothing of the tile
    between the barrier and the stamp); the Linear-2 Combine stores (16-byte vectors) lie between
    the epilogue-start and epilogue-end stamps; the fenced kernel has a system-scope release atom
    after each Linear-2 tile besides the one at the kernel's end; neither variant spills."""
    results = child_results("tests.experiments.moe.test_trace", "--compile-sm90", interpret=False,
                            timeout=900)
    for name, result in results.items():
        assert_case_ok(results, name)
        assert result["detail"]["spill_store_bytes"] == 0, name
    lines = [ln.strip() for ln in results["instrument_fp8"]["detail"]["ptx"].splitlines()
             if ln.strip() and not ln.strip().startswith((".loc", "//", "$L"))]
    clocks = [i for i, ln in enumerate(lines) if "%clock64" in ln]
    assert len(clocks) == 7, len(clocks)  # entry, then 3 stamps in each of the two tile kinds
    for i in clocks:
        assert lines[i - 1].startswith("bar.sync"), lines[i - 2:i + 1]
    vector_stores = [i for i, ln in enumerate(lines) if "st.global.v4" in ln]
    assert any(clocks[-2] < i < clocks[-1] for i in vector_stores)
    assert not any(clocks[-3] < i < clocks[-2] for i in vector_stores)  # mainloop: no Combine store
    fenced = results["fence_bf16"]["detail"]["ptx"]
    assert len(re.findall(r"atom\.global\.sys\.release", fenced)) == 2


if __name__ == "__main__":
    raise SystemExit(child_main(
        sys.argv[1:], interpreter_cases(),
        {"instrument_fp8": (_compile_variant, "fp8", "instrument"),
         "fence_bf16": (_compile_variant, "bf16", "fence")},
        patch=_patch_inline_asm))


def test_regression_cells_from_a_moe_record(tmp_path):
    """measure-all hands the trace benchmark the moe record it just wrote, not the JSON."""
    from xstage_lab.records import import_bench_json
    rows = [{"model": "DiT-MoE", "precision": "bf16", "routing": "skewed", "tokens": 2048, "speedup": 0.6},
            {"model": "Hy3", "precision": "fp8", "routing": "skewed", "tokens": 4096, "speedup": 1.2}]
    prov = {"gpu_name": "NVIDIA H200", "gpu_count": 2, "git_commit": "test"}
    (tmp_path / "m.json").write_text(json.dumps({"metadata": {"provenance": prov}, "rows": rows}))
    record = import_bench_json(tmp_path / "m.json", "moe", root=tmp_path / "records")
    a = parse_args(["--out", "x", "--regressions", str(record)])
    assert [(c["model"], c["speedup"]) for c in a.regression_cells] == [("DiT-MoE", 0.6)]


def test_design_verdicts_on_the_kernels_numbers():
    """K_act = 4 SMs x 16 KiB = 64 KiB at R = 65.536 GB/s: V/R = 1 µs, T_iss^0 = 0.25 µs, so
    G* = 0.75 µs. Expert-Wave's gap is T_L2 = 0.25 µs: reshape, eq. 4 overhead 0.5 µs.
    Interleaved's is 0.25 + (2/4)·2.0 = 1.25 µs (eq. 12): piggyback. Tolerance: the local
    control's T_RS IQR, 0.2 µs."""
    from types import SimpleNamespace

    platform = SimpleNamespace(drain_rate=65.536, t_iss0_at=lambda k, b: 0.25,
                               capacity_at=lambda k: 1e6)
    shape = {"kind": "trace", "precision": "fp8", "routing": "skewed", "tokens": 64,
             "hidden": 512, "intermediate": 256, "num_programs": 4,
             "tile_config": json.dumps({"block_m": 64, "block_n1": 128, "block_n2": 128})}
    local = {"path": "local", "mainloop_l2_us": 0.25, "mainloop_l1_us": 2.0, "span_l2_us": 0.4,
             "span_l2_p25_us": 0.3, "span_l2_p75_us": 0.5}
    rows = []
    for m, wave_span in (("M", 1.0), ("N", 0.5)):
        for s, span in (("wave", wave_span), ("interleaved", 0.45)):
            rows += [{**shape, "model": m, "schedule": s, **local},
                     {**shape, "model": m, "schedule": s, "path": "remote", "span_l2_us": span,
                      "stall_meas_us": 0.1}]
    rows.append({**shape, "model": "O", "schedule": "wave", **local})  # no remote run: skipped
    v = moe_trace.design_verdicts(pd.DataFrame(rows), platform)
    assert [(r["model"], r["schedule"]) for r in v] == [
        ("M", "wave"), ("M", "interleaved"), ("N", "wave"), ("N", "interleaved")]
    wave, inter = v[0], v[1]
    assert wave["burst_volume"] == 65536 and wave["K_act"] == 4
    assert wave["gap_us"] == pytest.approx(0.25) and inter["gap_us"] == pytest.approx(1.25)
    assert wave["g_star_us"] == pytest.approx(0.75)
    assert wave["action"] == "reshape" and not wave["rate_bound"] and wave["capacity_bound"]
    assert wave["dT_iss_pred_us"] == pytest.approx(0.5)
    assert inter["action"] == "piggyback" and inter["dT_iss_pred_us"] == 0.0
    assert wave["excess_us"] == pytest.approx(0.6) and wave["tolerance_us"] == pytest.approx(0.2)
    assert [r["agrees"] for r in v] == ["yes", "yes", "no", "yes"]  # N: reshape, excess 0.1


def test_knee_sweep_rows_by_hand():
    """P = 2, 132 programs, 128 x 128 bf16 Linear-2 tiles: half of each tile's 32 KiB is remote,
    V = 132 · 16384 B = 2162688 B; R = 1000 GB/s gives V/R = 2.163 µs; T_iss^0 = 0.5 µs. With
    G_wave = 1 µs the steady-state span is max(0.5, 2.163 − 1) = 1.163 µs, G* = 1.663 µs;
    at G_wave = 3 µs it is T_iss^0. Q = 1 MB: the isolated burst takes (V − Q)/R = 1.163 µs."""
    import json

    import pandas as pd

    from xstage_lab import model
    from xstage_lab.analysis.moe import trace as moe_trace

    platform = model.PlatformModel(drain_rate=1000.0, t_iss0={(132, 16384): 0.5},
                                   capacity={132: 1e6}, issue_floor={})
    base = dict(kind="knee_sweep", model="m", precision="bf16", routing="skewed", tokens=4096,
                world_size=2, num_programs=132, speedup=1.1, span_l2_local_us=0.5,
                tile_config=json.dumps({"block_m": 128, "block_n2": 128}))
    table = pd.DataFrame([dict(base, k_fraction=0.25, mainloop_l2_us=1.0, span_l2_remote_us=1.3),
                          dict(base, k_fraction=1.0, mainloop_l2_us=3.0, span_l2_remote_us=0.6),
                          dict(base, kind="trace", k_fraction=None)])
    fast, slow = moe_trace.knee_sweep_rows(table, platform)
    assert fast["v_over_r_us"] == pytest.approx(2.1627, abs=1e-4)
    assert fast["g_star_us"] == pytest.approx(1.6627, abs=1e-4)
    assert fast["span_pred_us"] == pytest.approx(1.1627, abs=1e-4)
    assert slow["span_pred_us"] == 0.5
    assert fast["span_pred_isolated_us"] == pytest.approx(1.1627, abs=1e-4)
    assert fast["excess_us"] == pytest.approx(0.8) and slow["excess_us"] == pytest.approx(0.1)


def test_regression_groups_of_a_matrix_without_regressions():
    from xstage_lab.analysis.moe import trace as moe_trace

    assert moe_trace.regression_groups([]) == []
