"""The MoE kernel with Combine into host memory (issue 26 item 2) on CPU: the host-share peer
table, the derived Interleaved lead, and a whole run through the harness with a stand-in for the
fused launch (``test_kernel_bench.EmulatedLaunch``, which stores each row through the peer table
as the kernel does) and for the CUDA timing: the forecast it needs first and names, the checks
that read the host buffers back, the row it measures."""
from __future__ import annotations

import json
from datetime import datetime, timezone

import numpy as np
import pandas as pd
import pytest
import torch

from tests.experiments.moe.test_kernel_bench import SEED, TINY, TOKENS, EmulatedLaunch
from xstage_lab.experiments import harness
from xstage_lab.experiments.moe import host_bench as hb, kernel_cell as kc, kernel_rows as kr
from xstage_lab.analysis.moe.forecast import host_share_fraction
from xstage_lab.ops.moe.combine import host_combine_peers
from xstage_lab.ops.moe.fused import prepare_fused_moe
from xstage_lab.ops.moe.schedules import d_knee, derived_lead
from xstage_lab.ops.moe.shapes import PRECISIONS, MoEContractError
from xstage_lab.ops.moe.tiles import default_tile_config
from xstage_lab.records import write_record


def test_host_peers_put_the_first_sources_in_host_memory():
    local = torch.zeros(8, 4, 16, dtype=torch.bfloat16)
    host = [torch.zeros(4, 16, dtype=torch.bfloat16) for _ in range(3)]
    peers = host_combine_peers(local, host)
    assert peers.ptrs == (*(b.data_ptr() for b in host),
                          *(local[r].data_ptr() for r in range(3, 8)))
    assert peers.table.tolist() == list(peers.ptrs) and (peers.slots, peers.hidden) == (4, 16)
    with pytest.raises(MoEContractError, match="9 host buffers"):
        host_combine_peers(local, host * 3)
    with pytest.raises(MoEContractError, match="contiguous bf16"):
        host_combine_peers(local, [torch.zeros(4, 8, dtype=torch.bfloat16)])


def test_the_derived_lead_adds_the_linear2_streams_span_only_where_it_is_the_sparser():
    # DiT-MoE on 132 SMs: P_1 = 5632 / 128 = 44, P_2 = 1408 / 128 = 11
    knee = d_knee(2 * 128, 132, 5632)
    assert knee == 3 and derived_lead(knee, 132, 44, 11) == 3 + 12
    # GLM-5.x: P_1 = 2048 / 128 = 16, P_2 = 6144 / 256 = 24, the programs in step: eq. 16's
    assert derived_lead(9, 132, 16, 24) == derived_lead(9, 132, 16, 16) == 9
    with pytest.raises(ValueError):
        derived_lead(0, 132, 44, 11)


def tiny_lead(r: dict) -> int:
    """The derived lead of a Tiny row of the CPU runs below (4 programs, the Triton kernel's
    tiles)."""
    cfg = default_tile_config(r["precision"], "triton", hidden=TINY.hidden)
    return derived_lead(r["d_knee"], 4, TINY.intermediate // cfg.block_n1,
                        TINY.hidden // cfg.block_n2)


def test_host_share_fraction_is_h_of_eight():
    assert host_share_fraction(1) == 1 / 8 and host_share_fraction(8) == 1.0
    for bad in (0, 9):
        with pytest.raises(ValueError, match="1..8"):
            host_share_fraction(bad)


def fake_time_methods(methods, *, trials, warmup, graph_iters, clocks):
    """Each method called once (it must run); made-up times: Expert-Wave slowed by the host."""
    out = {}
    for i, (name, fn) in enumerate(methods.items()):
        fn()
        us = 200.0 if name == "wave" else 100.0 + i
        out[name] = {"median_us": us, "p25_us": us - 1, "p75_us": us + 1,
                     "trials_us": [us] * trials, "sm_clock_mhz": [1980.0] * trials}
    return out


def forecast_table(shares) -> pd.DataFrame:
    rows = [{"model": "Tiny", "precision": p, "routing": "skewed", "tokens": TOKENS,
             "host_share": h, "burst_volume": 1.0, "g_wave_us": 1.0, "v_over_r_us": 2.0,
             "g_star_us": 2.0, "action": "reshape", "predicted_stall_us": 3.0,
             "predicted_span_us": 3.3, "predicted_wave_us": 10.0,
             "predicted_interleaved_us": 8.0, "predicted_speedup": 1.25}
            for p in PRECISIONS for h in shares]
    return pd.DataFrame(rows)


@pytest.fixture
def host_run(monkeypatch, tmp_path):
    """``MoEHost(device="cpu")`` through the harness: Tiny only, EmulatedLaunch behind the real
    contract check, fake timing, the forecast in a scratch root. Returns (args, set_fault)."""
    monkeypatch.setattr(hb, "load_shapes", lambda: {"Tiny": TINY})
    real_prepare = prepare_fused_moe
    fault = {"kind": None}

    def prepare(layout, weights, schedule, peers, **kw):
        real_prepare(layout, weights, schedule, peers, **kw)
        return EmulatedLaunch(layout, weights, schedule, peers, fault["kind"])

    for module in (hb, kc, kr):
        monkeypatch.setattr(module, "prepare_fused_moe", prepare)
    monkeypatch.setattr(hb, "time_methods", fake_time_methods)
    monkeypatch.setattr(hb, "RECORDS_DIR", tmp_path / "records")
    args = harness.parse(hb.EXPERIMENT, [
        "--out", str(tmp_path / "host.json"), "--models", "Tiny", "--routing", "skewed",
        "--tokens", str(TOKENS), "--host-shares", "1", "8", "--kernel", "triton", "--programs",
        "4", "--trials", "2", "--seed", str(SEED), "--no-trace", "--no-progress"])
    return args, tmp_path / "records", lambda kind: fault.update(kind=kind)


def test_a_run_needs_its_forecast_first(host_run):
    args, _, _ = host_run
    with pytest.raises(SystemExit, match="write the forecast first"):
        harness.run(hb.MoEHost(device="cpu"), args)
    assert not args.out.exists()


def test_run_checks_reads_back_and_names_its_forecast(host_run):
    args, root, _ = host_run
    fc = write_record("moe_host_forecast", "cpu-host", forecast_table([1, 8]), {}, {}, root)
    assert harness.run(hb.MoEHost(device="cpu"), args) == args.out
    doc = json.loads(args.out.read_text())
    meta, rows = doc["metadata"], doc["rows"]
    assert meta["link"] == "host" and meta["forecast_record"] == f"moe_host_forecast/cpu-host/" \
        f"{fc.stem}"
    assert [(r["precision"], r["host_share"]) for r in rows] == \
        [("bf16", 1), ("bf16", 8), ("fp8", 1), ("fp8", 8)]
    for r in rows:
        assert set(r["host_spin_errors"]) == {"wave", "wave_local", "wave_fenced",
                                             "interleaved_local",
                                             *(f"interleaved_d{d}" for d in r["leads"])}
        assert r["stray_rows"] == 0 and r["forecast_predicted_speedup"] == 1.25
        assert r["interleaved_us"] == r[f"interleaved_d{r['lead_rows']}_us"]
        assert r["measured_speedup"] == pytest.approx(200.0 / r["interleaved_us"])
        assert r["measured_stall_us"] > 0 and r["lead_rows"] == tiny_lead(r)


def test_a_local_sweep_times_every_lead_with_every_store_local(host_run):
    args, root, _ = host_run
    write_record("moe_host_forecast", "cpu-host", forecast_table([1, 8]), {}, {}, root)
    args.host_shares, args.lead_multiples = [0], [1, 8]
    assert harness.run(hb.MoEHost(device="cpu"), args) == args.out
    rows = json.loads(args.out.read_text())["rows"]
    for r in rows:
        lead = tiny_lead(r)
        assert r["host_share"] == 0 and r["leads"] == sorted({r["d_knee"], lead, 8 * lead})
        assert r["auto_us"] is None and "forecast_predicted_speedup" not in r
        assert r["local_interleaved_over_wave"] == pytest.approx(
            r["wave_local_us"] / r["interleaved_local_us"])


@pytest.mark.parametrize("fault, message", [("skip", "error inf"), ("perturb", "differ")])
def test_a_wrong_launch_into_host_memory_aborts_before_timing(host_run, fault, message,
                                                              monkeypatch, capsys):
    args, root, set_fault = host_run
    write_record("moe_host_forecast", "cpu-host", forecast_table([1, 8]), {}, {}, root)
    set_fault(fault)
    timed = []
    monkeypatch.setattr(hb, "time_methods", lambda *a, **k: timed.append(1))
    with pytest.raises(SystemExit, match="correctness failed"):
        harness.run(hb.MoEHost(device="cpu"), args)
    assert message in capsys.readouterr().err
    assert not timed and not args.out.exists()


@pytest.mark.parametrize("argv, match", [(["--host-shares", "9"], "0..8"),
                                         (["--host-shares", "-1"], "0..8"),
                                         (["--models", "Nope"], "unknown model")])
def test_bad_options_are_one_line_before_any_launch(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        harness.parse(hb.EXPERIMENT, ["--out", "x.json", *argv])
    assert e.value.code == 2 and match in capsys.readouterr().err


# --- the read side: a run's chunks, forecast beside measurement, the misses ---------------------

def _host_rows(shares, wave, local, interleaved, predicted_speedup, stall_pred):
    rows = []
    for h in shares:
        rows.append({"model": "Tiny", "precision": "bf16", "routing": "skewed", "tokens": TOKENS,
                     "host_share": h, "wave_local_us": local, "wave_us": wave(h),
                     "interleaved_us": interleaved, "interleaved_best": "interleaved_d4",
                     "interleaved_best_us": interleaved, "wave_fenced_us": wave(h) * 1.01,
                     "lead_rows": 4, "measured_stall_us": (wave(h) - local) / 10,
                     "measured_speedup": wave(h) / interleaved, "l2_tiles_per_program": 10.0,
                     "forecast_predicted_wave_us": local + 10 * stall_pred,
                     "forecast_predicted_stall_us": stall_pred,
                     "forecast_predicted_interleaved_us": interleaved,
                     "forecast_predicted_speedup": predicted_speedup, "forecast_g_wave_us": 3.0,
                     "g_wave_us": 3.5, "wave_wait_l2_us": 0.5, "int_wait_l2_us": 0.6})
    return pd.DataFrame(rows)


def test_host_view_joins_a_runs_chunks_and_finds_the_misses(tmp_path):
    from xstage_lab.analysis.moe import host_view as hv
    from xstage_lab.prose import host_link as say
    from xstage_lab.summary import summary

    params = {"forecast_record": "moe_host_forecast/x-host/f", "link": "host"}
    prov = {"git_commit": "abc"}
    # an older run; a first try of chunk 0 of the latest; then its two chunks (the same
    # forecast, from two sessions: the commits differ)
    at = [datetime(2026, 12, 2, 0, m, tzinfo=timezone.utc) for m in range(5)]
    write_record("moe_host", "x-host", _host_rows([1], lambda h: 999.0, 100.0, 100.0, 1.0, 0.0),
                 {**params, "forecast_record": "moe_host_forecast/x-host/old", "chunk": "0/1"},
                 prov, tmp_path, created=at[0])
    write_record("moe_host", "x-host", _host_rows([1, 2], lambda h: 777.0, 100.0, 110.0,
                                                   1.0, 2.0), {**params, "chunk": "0/2"}, prov,
                 tmp_path, created=at[1])
    write_record("moe_host", "x-host", _host_rows([1, 2], lambda h: 100.0 + 30 * h, 100.0, 110.0,
                                                   1.0, 2.0), {**params, "chunk": "0/2"}, prov,
                 tmp_path, created=at[2])
    write_record("moe_host", "x-host", _host_rows([8], lambda h: 300.0, 100.0, 250.0, 1.2, 20.0),
                 {**params, "chunk": "1/2"}, {"git_commit": "def"}, tmp_path, created=at[3])
    # a local sweep after the run (--host-shares 0, another forecast): not part of its matrix
    write_record("moe_host", "x-host", _host_rows([0], lambda h: 101.0, 101.0, 102.0, 1.0, 0.0),
                 {**params, "forecast_record": "moe_host_forecast/x-host/g"}, prov, tmp_path,
                 created=at[4])
    assert list(hv.local_sweep_view("x-host", tmp_path).table["wave_us"]) == [101.0]
    view = hv.latest_host_view("x-host", tmp_path)
    assert len(view.records) == 2 and list(view.table["host_share"]) == [1, 2, 8]
    assert 777.0 not in set(view.table["wave_us"])  # the newer record of chunk 0 wins
    c = hv.comparison(view)
    assert list(c["speedup_error_pp"].round(6)) == pytest.approx(
        [(1.0 - 130 / 110) * 100, (1.0 - 160 / 110) * 100, 0.0])
    assert list(c["wave_error_pct"].round(6)) == pytest.approx(
        [(120 / 130 - 1) * 100, (120 / 160 - 1) * 100, (300 / 300 - 1) * 100])
    m = hv.misses(view)
    assert list(m["host_share"]) == [1, 2]  # 18.2 and 45.5 pp off; h = 8 is met
    assert list(m["stall_error_us"]) == pytest.approx([-1.0, -4.0])
    entry = summary(tmp_path)["platforms"]["x-host"]["moe_host_link"]
    assert entry["forecast_record"] == params["forecast_record"]
    assert [set(r) for r in entry["rows"]] == [set(hv.SUMMARY_KEYS)] * 3
    text = say.forecast_misses([view])
    assert "2 cells miss" in text and "in 1 the measured Expert-Wave stall exceeds" in text
    assert "3 cells" in say.matrix([view])
    fig = plots_host(c)
    assert fig.layout.xaxis.title.text and fig.layout.yaxis.title.text and len(fig.data) == 5


def plots_host(c):
    from xstage_lab import plots
    return plots.moe_host_speedups(c, "x-host", 5.0)


def test_auto_is_tuned_among_the_schedules_the_forecast_cannot_tell_apart(host_run, monkeypatch):
    args, root, _ = host_run
    h8 = np.array([False, True, False, True])  # forecast_table's rows: bf16 h = 1, 8, fp8 h = 1, 8
    # h = 1: Expert-Wave predicted 2x ahead, the one candidate; h = 8: every lead within 1%
    table = forecast_table([1, 8]).assign(
        auto_schedule=np.where(h8, "interleaved_d3", "wave"), tile_wave_us=np.where(h8, 30.0, 10.0),
        tile_wave_local_us=5.0, tile_interleaved_local_us=5.0,  # all local: not candidates
        **{f"tile_interleaved_d{d}_us": np.where(h8, 10.0 + d / 100, 20.0) for d in range(1, 65)})
    write_record("moe_host_forecast", "cpu-host", table, {}, {}, root)
    passes = []

    def timing(methods, *, trials, warmup, graph_iters, clocks=False):
        passes.append(list(methods))
        out = fake_time_methods(methods, trials=trials, warmup=warmup, graph_iters=graph_iters,
                                clocks=clocks)
        if not clocks:  # the tuning pass: a clock step after trial 3, after trial 2 for the
            # last candidate, the fastest in every trial but by its median the slowest
            assert trials == 5
            out = {n: {**t, "trials_us": [200.0 - i] * 3 + [1.3 * (200.0 - i)] * 2}
                   for i, (n, t) in enumerate(out.items())}
            out[list(out)[-1]]["trials_us"] = [190.0] * 2 + [1.3 * 190.0] * 3
            out = {n: {**t, "median_us": float(np.median(t["trials_us"]))}
                   for n, t in out.items()}
        return out

    monkeypatch.setattr(hb, "time_methods", timing)
    harness.run(hb.MoEHost(device="cpu"), args)
    rows = json.loads(args.out.read_text())["rows"]
    assert [r["auto_forecast_lead"] for r in rows] == [0, 3, 0, 3]
    for r in rows:
        # the sweep's leads, then the forecast's pick where the sweep has not got it
        leads = [f"interleaved_d{d}" for d in dict.fromkeys([*r["leads"], 3])]
        candidates = ["wave"] if r["host_share"] == 1 else leads
        assert r["auto_candidates"] == candidates
        assert {f"auto[{n}]" for n in candidates} <= set(r["host_spin_errors"])
        assert r["auto_us"] > 0
        if r["host_share"] == 1:  # one candidate: picked untimed
            assert r["auto_lead"] == 0 and r["auto_tune_us"] is None
        else:
            assert r["auto_lead"] == int(leads[-1].removeprefix("interleaved_d"))
            assert list(r["auto_tune_us"]) == leads and r["auto_tune_ms"] > 0
    tuned = [p for p in passes if "wave_local" not in p]
    assert tuned == [leads, leads] and all("auto" in p for p in passes if p not in tuned)


def test_host_rows_per_block_count_real_rows_of_the_first_sources():
    from xstage_lab.experiments.moe.host_forecast import host_rows_per_block
    from xstage_lab.ops.moe.schedules import lead_sweep

    src = np.array([0, 1, 2, 0, 3, 0, 0, 1])
    slot = np.array([5, 6, 7, -1, 1, 2, 3, -1])  # two padding rows
    assert host_rows_per_block(src, slot, 4, 1).tolist() == [1, 2]
    assert host_rows_per_block(src, slot, 4, 2).tolist() == [2, 2]
    assert host_rows_per_block(src, slot, 4, 8).tolist() == [3, 3]
    assert lead_sweep(3, 15) == [3, 15, 30, 60] and lead_sweep(9, 9) == [9, 18, 36]


def test_a_forecasts_pick_is_looked_up_in_the_runs_own_timings(tmp_path):
    from xstage_lab.analysis.moe import host_view as hv

    rows = _host_rows([1, 8], lambda h: 100.0 + h, 100.0, 90.0, 1.0, 0.0).assign(
        interleaved_d4_us=[90.0, 120.0], interleaved_d8_us=[95.0, 105.0])
    write_record("moe_host", "x-host", rows, {"forecast_record": "f"}, {}, tmp_path)
    forecast = rows[hv.CELL].assign(auto_schedule=["interleaved_d8", "wave"])
    a = hv.auto_against_measured(hv.latest_host_view("x-host", tmp_path), forecast)
    assert list(a["auto_measured_us"]) == [95.0, 108.0]
    assert list(a["fastest"]) == ["interleaved_d4", "interleaved_d8"]
    assert list(a["auto_over_fastest"]) == pytest.approx([95 / 90, 108 / 105])


def test_local_sweep_table_and_prose_find_the_cells_no_lead_brings_to_the_bound(tmp_path):
    from xstage_lab.analysis.moe import host_view as hv
    from xstage_lab.prose import host_link as say

    def cell(model, knee_us, lead_us, far_us):
        return {"model": model, "precision": "bf16", "routing": "skewed", "tokens": TOKENS,
                "host_share": 0, "d_knee": 2, "lead_rows": 4, "wave_us": 100.0,
                "wave_local_us": 100.0, "interleaved_d2_us": knee_us,
                "interleaved_d4_us": lead_us, "interleaved_d16_us": far_us,
                "int_mainloop_l2_us": 12.0, "wave_mainloop_l2_us": 10.0,
                "int_wait_l2_us": 0.1, "wave_wait_l2_us": 0.1}
    write_record("moe_host", "x-host", pd.DataFrame([cell("Fast", 150.0, 99.0, 101.0),
                                                     cell("Slow", 160.0, 104.0, 103.0)]),
                 {"forecast_record": "f", "link": "host"}, {}, tmp_path)
    assert hv.local_sweep_view("y-host", tmp_path) is None
    s = hv.local_sweep_table(hv.local_sweep_view("x-host", tmp_path))
    assert list(s["at_knee"]) == pytest.approx([100 / 150, 100 / 160])
    assert list(s["at_lead"]) == pytest.approx([100 / 99, 100 / 104])
    assert list(s["best_lead"]) == [4, 16] and list(s["mainloop_l2_ratio"]) == [1.2, 1.2]
    text = str(say.local_sweep([hv.local_sweep_view("x-host", tmp_path)]))
    assert "at least 0.98 in 1 cells" in text and "Below 0.98 at every lead: Slow bf16" in text


def test_misses_set_the_traced_mainloops_beside_the_all_local_ones_the_forecast_plays(tmp_path):
    """The kernel record the forecast names is the base: a host-link cell whose traced
    Expert-Wave Linear-2 mainloop is 3× the all-local one there is put down to backpressure
    reaching the Tensor Cores; without that record the ratios are NaN and nothing is said."""
    from xstage_lab.analysis.moe import host_view as hv
    from xstage_lab.prose import host_link as say

    local = {"wave_mainloop_l1_us": 10.0, "wave_mainloop_l2_us": 4.0,
             "int_mainloop_l1_us": 10.0, "int_mainloop_l2_us": 4.0}
    kernel = write_record("moe_kernel", "x", pd.DataFrame([{
        "model": "Tiny", "precision": "bf16", "routing": "skewed", "tokens": TOKENS, **local}]),
        {}, {}, tmp_path)
    key = kernel.relative_to(tmp_path).with_suffix("").as_posix()
    forecast = write_record("moe_host_forecast", "x-host", pd.DataFrame([{"host_share": 2}]),
                            {"kernel_records": [key]}, {}, tmp_path)
    rows = _host_rows([2], lambda h: 200.0, 100.0, 110.0, 1.0, 2.0).assign(
        wave_mainloop_l1_us=10.0, wave_mainloop_l2_us=12.0, int_mainloop_l1_us=15.0,
        int_mainloop_l2_us=4.0)
    params = {"forecast_record": forecast.relative_to(tmp_path).with_suffix("").as_posix()}
    write_record("moe_host", "x-host", rows, params, {}, tmp_path)
    view = hv.latest_host_view("x-host", tmp_path)
    m = hv.misses(view)
    assert list(m["wave_mainloop_l2_over_local"]) == [3.0]
    assert list(m["int_mainloop_l1_over_local"]) == [1.5]
    assert list(m["wave_mainloop_l1_over_local"]) == [1.0]
    text = str(say.forecast_misses([view]))
    assert "Expert-Wave's Linear-2 3.00×, Interleaved's Linear-1 1.50×" in text
    forecast.unlink()
    gone = hv.misses(hv.latest_host_view("x-host", tmp_path))
    assert gone["wave_mainloop_l2_over_local"].isna().all()
    assert "Tensor Cores" not in str(say.forecast_misses([hv.latest_host_view("x-host",
                                                                              tmp_path)]))


def test_an_auto_rule_is_scored_by_the_measured_times_of_what_it_picks(tmp_path):
    from xstage_lab.analysis.moe import host_view as hv
    from xstage_lab.experiments.moe.host_forecast import pick_auto

    cell = {"model": "Tiny", "precision": "bf16", "routing": "skewed", "tokens": TOKENS}
    forecast = write_record("moe_host_forecast", "x-host", pd.DataFrame([
        {**cell, "host_share": 1, "lead_rows": 4, "tile_wave_us": 100.0,
         "tile_interleaved_d4_us": 100.2, "tile_interleaved_d8_us": 100.3},
        {**cell, "host_share": 8, "lead_rows": 4, "tile_wave_us": 150.0,
         "tile_interleaved_d4_us": 100.0, "tile_interleaved_d8_us": 130.0}]), {},
        {"git_commit": "abc"}, tmp_path)
    measured = write_record("moe_host", "x-host", pd.DataFrame([
        {**cell, "host_share": 1, "wave_us": 110.0, "interleaved_d4_us": 105.0,
         "interleaved_d4_p25_us": 1.0, "interleaved_d8_us": 100.0},
        {**cell, "host_share": 8, "wave_us": 200.0, "interleaved_d4_us": 120.0,
         "interleaved_d4_p25_us": 1.0, "interleaved_d8_us": 140.0}]),
        {"forecast_record": f"moe_host_forecast/x-host/{forecast.stem}"}, {"git_commit": "abc"},
        tmp_path)
    view = hv.HostView("x-host", (hv.read(measured),))
    # h = 1: Expert-Wave predicted fastest, measured 1.1 x the fastest (d8); h = 8: twice the
    # lead (d8), measured 140 against d4's 120
    assert hv.pick_over_fastest(view, pick_auto).tolist() == [pytest.approx(1.1),
                                                             pytest.approx(140 / 120)]
    fastest_predicted = hv.pick_over_fastest(view, lambda p, lead: min(p, key=p.get))
    assert fastest_predicted.tolist() == [pytest.approx(1.1), 1.0]


def test_auto_stands_against_the_fastest_timing_and_its_own_second_timing(tmp_path):
    from xstage_lab.analysis.moe import host_view as hv

    cell = {"model": "Tiny", "precision": "bf16", "routing": "skewed", "tokens": TOKENS}
    measured = write_record("moe_host", "x-host", pd.DataFrame([
        # auto picked d8 (timed 102 in the sweep); d4 was fastest
        {**cell, "host_share": 1, "wave_us": 110.0, "interleaved_d4_us": 100.0,
         "interleaved_d8_us": 102.0, "auto_lead": 8, "auto_us": 104.0},
        # auto picked Expert-Wave and beat every timing of the sweep
        {**cell, "host_share": 8, "wave_us": 150.0, "interleaved_d4_us": 160.0,
         "interleaved_d8_us": 170.0, "auto_lead": 0, "auto_us": 147.0}]),
        {"forecast_record": "f"}, {"git_commit": "abc"}, tmp_path)
    a = hv.auto_standing(hv.HostView("x-host", (hv.read(measured),)))
    assert a["auto_over_fastest"].tolist() == pytest.approx([1.04, 1.0])
    assert a["auto_over_same"].tolist() == pytest.approx([104 / 102, 147 / 150])
    assert "forecast_over_fastest" not in a


def test_a_tuned_auto_stands_beside_the_forecasts_own_pick(tmp_path):
    from xstage_lab.analysis.moe import host_view as hv
    from xstage_lab.prose import Prose, host_link as say

    cell = {"model": "Tiny", "precision": "bf16", "routing": "skewed", "tokens": TOKENS}
    measured = write_record("moe_host", "x-host", pd.DataFrame([
        # the forecast picked d8 (102), tuning d4 (timed 101 as auto): d4 the fastest
        {**cell, "host_share": 1, "wave_us": 110.0, "interleaved_d4_us": 100.0,
         "interleaved_d8_us": 104.0, "auto_lead": 4, "auto_us": 101.0, "auto_forecast_lead": 8,
         "auto_tune_ms": 900.0},
        # one candidate, Expert-Wave, untimed by the tuning
        {**cell, "host_share": 8, "wave_us": 150.0, "interleaved_d4_us": 160.0,
         "interleaved_d8_us": 170.0, "auto_lead": 0, "auto_us": 147.0, "auto_forecast_lead": 0,
         "auto_tune_ms": None}]),
        {"forecast_record": "f"}, {"git_commit": "abc"}, tmp_path)
    view = hv.HostView("x-host", (hv.read(measured),))
    a = hv.auto_standing(view)
    assert a["auto_over_fastest"].tolist() == pytest.approx([1.01, 1.0])
    assert a["forecast_over_fastest"].tolist() == pytest.approx([1.04, 150 / 147])
    text = Prose(say._auto(view))
    assert "`auto`, tuned among" in text and "in 2 of 2 cells" in text
    assert "own pick, untuned, is within 3% of the fastest in 1 of 2 cells" in text
    assert "took 0.90 s (median of the 1 cells" in text


def test_auto_is_bounded_by_its_per_trial_ratio_to_the_fastest_where_trials_are_kept(tmp_path):
    from xstage_lab.analysis.moe import host_view as hv
    from xstage_lab.prose import Prose, host_link as say

    cell = {"model": "Tiny", "precision": "bf16", "routing": "skewed", "tokens": TOKENS}
    # a clock step from trial 2 on, reached by auto one trial before d4 (the fastest, by median
    # 100): auto's median 110 is 1.10 x d4's, trial by trial it is 1.01 x
    d4 = [100.0, 100.0, 100.0, 130.0, 130.0]
    trials = {"wave": [120.0] * 5, "interleaved_d4": d4,
              "auto": [101.0, 101.0, 110.0, 131.3, 131.3], "interleaved_d8": [104.0] * 5}
    measured = write_record("moe_host", "x-host", pd.DataFrame([
        {**cell, "host_share": 1, "wave_us": 120.0, "interleaved_d4_us": 100.0,
         "interleaved_d8_us": 104.0, "auto_lead": 4, "auto_us": 110.0, "auto_forecast_lead": 8,
         "auto_tune_ms": 500.0, "trials_us": json.dumps(trials)}]),
        {"forecast_record": "f"}, {"git_commit": "abc"}, tmp_path)
    view = hv.HostView("x-host", (hv.read(measured),))
    a = hv.auto_standing(view)
    assert a["auto_over_fastest"].tolist() == pytest.approx([1.10])
    assert a["auto_over_fastest_paired"].tolist() == pytest.approx([1.01])
    assert a["forecast_over_fastest_paired"].tolist() == pytest.approx([1.04])
    text = Prose(say._auto(view))
    assert "by the median of its per-trial ratios" in text and "in 1 of 1 cells" in text
    assert "By the ratio of the two medians it is within 3% in 0 cells (1.100× at worst)" in text
