"""Injection patterns: the route sets of every pattern on 2, 4 and 8 GPUs (and which are
degenerate), their validation, and the per-source fits with the drain-share no-refit prediction
on records made from known model parameters."""
from __future__ import annotations

import pytest

from tests.experiments.remote_store.test_characterization import make_inv
from tests.synthetic import KNOWN, synthetic_beyond_table
from xstage_lab.analysis.remote_store import operations as operation_analysis, patterns as pattern_analysis
from xstage_lab.analysis.remote_store.patterns import pattern_fits
from xstage_lab.experiments.remote_store.patterns import PATTERNS, pattern_instances, route_sets
from xstage_lab.analysis.remote_store.patterns import baseline_route
from xstage_lab.experiments.remote_store.ops import config_sweeps, parse_routes
from xstage_lab.analysis.remote_store.routes import drain_share
from xstage_lab.ops.remote_store.operations import validate_ops_point
from xstage_lab.experiments.remote_store.characterization import BenchSettings
from xstage_lab.analysis.remote_store import tables


@pytest.mark.parametrize("n", [2, 4, 8])
def test_pattern_instances(n):
    inst = pattern_instances(n)
    by = {p: [i for i in inst if i["pattern"] == p] for p in PATTERNS}
    assert [len(by[p]) for p in PATTERNS] == [n * (n - 1), n, n, 1]
    assert {parse_routes(i["routes"])[0] for i in by["one_to_one"]} == {
        (a, (b,)) for a in range(n) for b in range(n) if a != b}
    # one-to-all from s: s to every other GPU, in order
    assert parse_routes(by["one_to_all"][1]["routes"]) == ((1, tuple(d for d in range(n)
                                                                     if d != 1)),)
    # all-to-one to d: every other GPU to d
    assert parse_routes(by["all_to_one"][0]["routes"]) == tuple((s, (0,)) for s in range(1, n))
    a2a = parse_routes(by["all_to_all"][0]["routes"])
    assert [s for s, _ in a2a] == list(range(n))
    assert all(set(d) == set(range(n)) - {s} for s, d in a2a)
    # every route set validates at K = 132 on n GPUs
    for routes in route_sets(inst):
        validate_ops_point(dict(op="store16", routes=routes, mode="periodic", path="remote",
                                producers=132, burst_bytes=65536, gap_us=0.0), make_inv(n))
    degenerate = {i["pattern"] for i in inst if i["degenerate_of"]}
    if n == 2:
        # one-to-all and all-to-one are one-to-one routes; all-to-all is bidirectional
        assert degenerate == {"one_to_all", "all_to_one"}
        assert route_sets(inst) == ["0>1", "1>0", "0>1;1>0"]
        assert by["one_to_all"][0]["degenerate_of"] == "0>1"
        assert by["all_to_one"][0]["degenerate_of"] == "1>0"
    else:
        assert degenerate == set()
        assert len(route_sets(inst)) == n * (n - 1) + 2 * n + 1
    # the drain shares the no-refit prediction uses
    assert set(drain_share(parse_routes(by["all_to_one"][0]["routes"])).values()) == {1 / (n - 1)}
    assert set(drain_share(parse_routes(by["all_to_all"][0]["routes"])).values()) == {1.0}


def test_one_gpu_has_no_patterns():
    with pytest.raises(ValueError, match="at least two GPUs"):
        pattern_instances(1)


def test_baseline_route():
    assert baseline_route(2, (0, 1, 3)) == "2>0"


def test_pattern_fits_per_source_with_the_shared_drain():
    # all-to-one onto GPU 0 of three GPUs, beside its one-to-one baselines: each source drains
    # at half the one-to-one rate, which the drain share predicts with no refit
    routes = ["1>0", "2>0", "1>0;2>0"]
    sweeps = [sw for r in routes for sw in config_sweeps({"routes": r}, 132, dict(op="store16"),
                                                         KNOWN["drain_rate"], BenchSettings(), 3)]
    fits = pattern_fits(synthetic_beyond_table(sweeps), "test")
    assert set(fits) == set(routes)
    shared = {e["src"]: e for e in fits["1>0;2>0"]}
    assert set(shared) == {1, 2}
    for e in shared.values():
        assert e["R_GBps"] == pytest.approx(KNOWN["drain_rate"] / 2, abs=0.1)
        nr = e["no_refit_from_baseline"]
        assert nr["share"] == 0.5
        assert nr["drain_rate_GBps"] == pytest.approx(KNOWN["drain_rate"] / 2, abs=0.01)
        assert nr["t_iss_err_pct"] == pytest.approx(0.0, abs=1e-3)
    for r in ("1>0", "2>0"):
        (e,) = fits[r]
        assert e["R_GBps"] == pytest.approx(KNOWN["drain_rate"], abs=0.1)
        assert e["no_refit_from_baseline"]["t_iss_err_pct"] == pytest.approx(0.0, abs=1e-3)


def test_records_and_summary_entries(tmp_path):
    from tests.synthetic import write_synthetic_beyond_records
    from xstage_lab.records import read_record
    from xstage_lab.summary import summary

    ops_path, patterns_path = write_synthetic_beyond_records(tmp_path, n_gpus=3, noise=0.0)
    rec = read_record(patterns_path)
    assert rec.params["degenerate"] == []
    assert set(rec.params["fits"]) == set(route_sets(pattern_instances(3)))
    entry = summary(root=tmp_path)["platforms"]["h200-x3"]
    pat, ops = entry["patterns"], entry["operations"]
    assert pat["gpus"] == 3 and len(pat["per_instance"]) == 6 + 3 + 3 + 1
    by = {(i["pattern"], i["instance"]): i for i in pat["per_instance"]}
    a2o = by[("all_to_one", "dst=0")]
    assert a2o["routes"] == "1>0;2>0" and a2o["degenerate_of"] is None
    for src in a2o["sources"]:
        assert src["R_GBps"] == pytest.approx(KNOWN["drain_rate"] / 2, abs=0.1)
        assert src["no_refit_from_baseline"]["t_iss_err_pct"] == pytest.approx(0.0, abs=1e-3)
    assert [s["src"] for s in by[("all_to_all", "all")]["sources"]] == [0, 1, 2]
    # multi-source route sets only: 3 all-to-one and the all-to-all (synthetic spread 800 ns)
    assert pat["gpu_start_spread_ns_median"] == {r: 800.0 for r in
                                                 ("1>0;2>0", "0>1;2>1", "0>2;1>2",
                                                  "0>1,2;1>0,2;2>0,1")}
    assert ops["baseline"] == "store16" and ops["route"] == "0>1"
    assert ops["per_op"]["red_add_u32"]["R_GBps"] == pytest.approx(120.0, abs=0.1)
    assert ops["per_op"]["store16"]["no_refit_from_baseline"]["t_iss_err_pct"] == 0.0
    # the reductions drain far slower than the 16-byte stores: the baseline mispredicts them
    assert ops["per_op"]["red_add_u32"]["no_refit_from_baseline"]["t_iss_err_pct"] > 20.0
    assert ops["source_record"] == ops_path.stem


def test_two_gpu_record_names_the_degenerate_patterns(tmp_path):
    from tests.synthetic import write_synthetic_beyond_records
    from xstage_lab.summary import summary

    write_synthetic_beyond_records(tmp_path, n_gpus=2)
    pat = summary(root=tmp_path)["platforms"]["h200-x2"]["patterns"]
    assert pat["degenerate"] == ["all_to_one", "one_to_all"]
    by = {(i["pattern"], i["instance"]): i for i in pat["per_instance"]}
    # a degenerate instance carries the fit of the one-to-one route set it equals
    assert by[("one_to_all", "src=0")]["sources"] == by[("one_to_one", "0>1")]["sources"]


def test_tables_and_figures_from_records(tmp_path):
    from tests.synthetic import write_synthetic_beyond_records
    from xstage_lab import plots
    from xstage_lab.experiments.remote_store import ops as remote_ops
    from xstage_lab.records import read_record

    ops_path, patterns_path = write_synthetic_beyond_records(tmp_path, n_gpus=3, noise=0.0)
    pat = read_record(patterns_path)
    entry = pattern_analysis.summary_entry(pat.params, pat.record_id)
    table = tables.patterns_table(entry)
    # 6 one-to-one + 3 one-to-all + 3 all-to-one (two sources each) + all-to-all (three)
    assert len(table) == 6 + 3 + 3 * 2 + 3
    assert (table["fit"] == "ok").all()
    a2o = table[table["pattern"] == "all_to_one"]
    assert a2o["drain share"].tolist() == [0.5] * 6
    heat = plots.patterns_drain_heatmap(entry, "h200-x3").data[0].z
    assert heat.shape == (3, 3)
    assert abs(heat[0][1] - KNOWN["drain_rate"]) < 0.1 and heat[0][0] != heat[0][0]  # NaN diagonal
    assert len(plots.patterns_rates(table, "h200-x3").data) == 2
    ops = read_record(ops_path)
    op_table = tables.operations_table(operation_analysis.summary_entry(ops.params, ops.record_id))
    assert op_table["operation"].tolist() == list(remote_ops.OPS)
    fits = operation_analysis.operation_fits(ops.table, ops.platform, ops.record_id)
    fig = plots.operations_gap_sweeps(fits, remote_ops.BASELINE_OP, ops.platform)
    # per op: measured, own fit, baseline
    assert len(fig.data) == 3 * len(remote_ops.OPS)


def test_operations_table_names_what_was_left_out():
    entry = {"per_op": {"store16": {"key": "store16", "src": 0, "fit_error": "no plateau"}},
             "excluded": {"op=bulk": "illegal address"}}
    t = tables.operations_table(entry)
    assert t["operation"].tolist() == ["store16", "bulk"]
    assert t["fit"].tolist() == ["model fit failed: no plateau", "not measured: illegal address"]


def test_no_refit_verdict_applies_the_threshold_to_each_sweep():
    def fit(R, own, no_refit):
        return {"key": "", "src": 0, "R_GBps": R, "R_GBps_iqr": [R, R],
                "T_iss0_us": {"K=132,B=16384": 0.5}, "Q_MiB": {"K=132": 2.0},
                "knee_KB_per_producer": {"K=132": 18.0}, "G_star_us": {"K=132,B=16384": 5.0},
                "gap_prediction_median_abs_err_pct": own,
                "no_refit_from_baseline": {"drain_rate_GBps": 400.0, "share": 1.0,
                                           "t_iss_err_pct": no_refit, "period_err_pct": 0.1}}

    entry = {"per_op": {"store16": fit(400.0, 0.2, 0.2), "store4": fit(400.0, 0.3, 17.0),
                        "bulk": fit(360.0, 9.0, 12.0),
                        "red_add_f32": {"key": "red_add_f32", "src": 0, "fit_error": "no plateau"}},
             "excluded": {"op=load16": "load check failed"}}
    table = tables.operations_table(entry)
    assert table["knee (KB/producer)"].tolist()[:3] == [18.0] * 3
    assert "G* B=16 KB (µs)" in table and "T_iss0 B=16 KB (µs)" in table
    v = tables.no_refit_verdict(table, ["operation"], 5.0).set_index("operation")
    assert v["own fit holds (≤ 5%)"].tolist() == ["yes", "yes", "no", "model fit failed", "not measured"]
    assert v["holds without refit (≤ 5%)"].tolist() == ["yes", "no", "no", "model fit failed",
                                                        "not measured"]
    assert v.loc["bulk", "R / R predicted"] == 0.9
    assert v["R as predicted (≤ 5%)"].tolist() == ["yes", "yes", "no", "model fit failed",
                                                   "not measured"]
    assert tables.operations_table(entry, left_out=False)["operation"].tolist() == [
        "store16", "store4", "bulk", "red_add_f32"]
    assert tables.operations_left_out(entry).to_dict("records") == [
        {"operation": "load16", "reason": "load check failed"}]


def _source_launches_and_kernel_s(configs: list[tuple[dict, float]], repeats: int):
    """Over ``(config, rate)`` pairs run as ``calibrate_configs`` runs them (a probe, then the
    three sweeps, each point warmed up once): the launches times their source GPUs, and the
    kernels' own seconds (``sweep_seconds`` with no host overhead)."""
    from xstage_lab.experiments.remote_store.ops import config_sweeps, sweep_seconds

    settings = BenchSettings()
    source_launches, kernel_s = 0, 0.0
    for cfg, rate in configs:
        sweeps = config_sweeps(cfg, 132, dict(op="store16"), rate, settings, repeats)
        launches = 1 + sum(len(sw.points()) * (sw.repeats + sw.warmup) for sw in sweeps)
        source_launches += launches * len(parse_routes(cfg["routes"]))
        kernel_s += sum(sweep_seconds(sw, rate, settings, launch_overhead_s=0.0) for sw in sweeps)
    return source_launches, kernel_s


@pytest.mark.parametrize("n", [2, 4, 8])
def test_every_route_set_fits_the_budget(n):
    """Issue 7: one call measures every route set of 8 GPUs. The estimate takes the host time per
    launch and source GPU that the committed 2-GPU record took beyond its kernels (~11 ms: poison,
    checks, copies, per-burst rows), and the 2-GPU one-to-one R scaled by each route set's drain
    share (all-to-one on 8 GPUs: 1/7, seven times longer bursts)."""
    from xstage_lab.experiments.remote_store.patterns import PATTERNS_BUDGET_S, default_repeats
    from xstage_lab.records import latest_record

    rec = latest_record("remote_patterns", "h200-x2").params
    rates = {label.removeprefix("routes="): r["drain_sweep"] for label, r in rec["rates_GBps"].items()}
    measured = [({"routes": r}, rate) for r, rate in rates.items()]
    launches, kernel_s = _source_launches_and_kernel_s(measured, rec["sweeps"][0]["repeats"])
    host_s = (rec["elapsed_s"] - kernel_s) / launches
    assert 0.002 < host_s < 0.05

    one_to_one = rates["0>1"]
    configs = [({"routes": r}, one_to_one * min(drain_share(parse_routes(r)).values()))
               for r in route_sets(pattern_instances(n))]
    launches, kernel_s = _source_launches_and_kernel_s(configs, default_repeats(n))
    estimate = kernel_s + host_s * launches
    assert estimate <= PATTERNS_BUDGET_S, f"{n} GPUs: ~{estimate:.0f} s"
    # the fits and the write follow the sweeps inside the same 10-minute call
    assert PATTERNS_BUDGET_S <= 600 - 120


def test_default_repeats():
    from xstage_lab.experiments.remote_store.patterns import default_repeats

    assert [default_repeats(n) for n in (2, 3, 4, 5, 8)] == [5, 5, 5, 3, 3]


def test_drain_heatmap_of_eight_gpus():
    """The topology heat map of 8 GPUs: all 56 one-to-one fits, each at [src, dst], the diagonal
    empty; a pattern instance of several sources does not enter it."""
    import numpy as np

    from xstage_lab import plots

    def fit(src, dst):
        R = 100.0 * src + dst
        return {"key": "", "src": src, "R_GBps": R, "R_GBps_iqr": [R, R],
                "T_iss0_us": {"K=132,B=16384": 0.5}, "Q_MiB": {"K=132": 2.0},
                "knee_KB_per_producer": {"K=132": 18.0}, "G_star_us": {"K=132,B=16384": 5.0},
                "gap_prediction_median_abs_err_pct": 1.0}

    inst = pattern_instances(8)
    entry = {"per_instance": [
        {**i, "sources": [fit(s, d[0]) for s, d in parse_routes(i["routes"])]} for i in inst]}
    heat = plots.patterns_drain_heatmap(entry, "h200-x8").data[0]
    z = np.asarray(heat.z, dtype=float)
    assert z.shape == (8, 8)
    assert list(heat.x) == [f"to GPU {d}" for d in range(8)]
    assert list(heat.y) == [f"GPU {s}" for s in range(8)]
    for s in range(8):
        for d in range(8):
            assert np.isnan(z[s, d]) if s == d else z[s, d] == 100.0 * s + d
    table = tables.patterns_table(entry)
    # 56 one-to-one + 8 one-to-all + 8 all-to-one of 7 sources + all-to-all of 8
    assert len(table) == 56 + 8 + 8 * 7 + 8


def test_patterns_through_the_harness_fit_every_source(monkeypatch, tmp_path):
    """Every route set of three GPUs measured on one bench that answers from the model (each
    source at its drain share), the record's fits and rows as the summary reads them."""
    from xstage_lab.experiments.remote_store import patterns as injection_patterns
    from xstage_lab.records import read_record

    from .test_characterization import fake_machine
    from .test_ops import ModelBench

    fake_machine(monkeypatch, injection_patterns, 3)

    class PatternsBench(ModelBench):
        def __init__(self, settings, inv):
            super().__init__({"store16": KNOWN["drain_rate"]})
            self.inv, self.seed = inv, 11

        def validate(self, p):
            validate_ops_point(p, self.inv)

    monkeypatch.setattr(injection_patterns, "RemoteOpsBench", PatternsBench)
    path = injection_patterns.run_patterns(repeats=1, progress=False, root=tmp_path)
    rec = read_record(path)
    assert path.parent == tmp_path / "remote_patterns" / "h200-x3"
    sets = route_sets(pattern_instances(3))
    assert list(dict.fromkeys(rec.table["routes"])) == sets
    assert rec.params["sweeps"][0]["axes"] == {"config": [{"routes": r} for r in sets]}
    assert rec.params["gpus"] == 3 and rec.params["seed"] == 11 and rec.params["excluded"] == {}
    assert set(rec.params["fits"]) == set(sets)
    # the calibration sweeps' own point and repeat, per route set (one repeat each)
    drain = rec.table[(rec.table["routes"] == "1>0;2>0") & (rec.table["sweep"] == "drain_rate")]
    assert sorted(set(drain["point"])) == list(range(6)) and set(drain["repeat"]) == {0}
    for src in rec.params["fits"]["1>0;2>0"]:
        assert src["R_GBps"] == pytest.approx(KNOWN["drain_rate"] / 2, rel=1e-3)
    entry = pattern_analysis.summary_entry(rec.params, rec.record_id)
    assert len(entry["per_instance"]) == 6 + 3 + 3 + 1
