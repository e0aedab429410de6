"""Remote operations beyond 16-byte stores: routes, drain shares, point validation before launch,
the rate-scaled calibration sweeps, and the fits with their no-refit errors on records made from
known model parameters (tests/synthetic.py)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.experiments.remote_store.test_characterization import make_inv
from tests.synthetic import KNOWN, capacity, issue_floor, synthetic_beyond_table
from xstage_lab import model
from xstage_lab.calibration import kb_key
from xstage_lab.ops.remote_store.burst import _POISON
from xstage_lab.experiments.remote_store.ops import GAP_FRACTIONS, MIN_BURSTS, OPS, OpsSettings, config_sweeps, fit_entry, format_routes, parse_routes
from xstage_lab.ops.remote_store.operations import OP_CODES, expected_load_sums, kernel_op_codes, stamps_bytes, validate_ops_point
from xstage_lab.analysis.remote_store.routes import drain_share
from xstage_lab.analysis.remote_store.operations import fit_config, no_refit_error
from xstage_lab.experiments.remote_store.characterization import KIB, BenchSettings
from xstage_lab.calibration import MIB

INV2 = make_inv(2)
GOOD = dict(op="store16", routes="0>1", mode="periodic", path="remote", producers=132,
            burst_bytes=64 * KIB, gap_us=0.0, lines="fresh", align="first")


# --- routes and shares -----------------------------------------------------------------------

def test_routes_round_trip():
    routes = ((0, (1, 2, 3)), (1, (0,)), (3, (2,)))
    assert format_routes(routes) == "0>1,2,3;1>0;3>2"
    assert parse_routes("0>1,2,3;1>0;3>2") == routes


@pytest.mark.parametrize("label", ["0-1", "0>", "a>1", "0>1;;1>0", ""])
def test_malformed_routes_rejected(label):
    with pytest.raises(ValueError, match="malformed routes"):
        parse_routes(label)


def test_drain_share():
    assert drain_share(parse_routes("0>1")) == {0: 1.0}
    assert drain_share(parse_routes("0>1;1>0")) == {0: 1.0, 1: 1.0}
    # all-to-one over 4 GPUs: three sources share GPU 0's drain
    assert drain_share(parse_routes("1>0;2>0;3>0")) == pytest.approx({1: 1 / 3, 2: 1 / 3, 3: 1 / 3})
    # one-to-all and all-to-all: each destination receives one source's worth
    assert drain_share(parse_routes("0>1,2,3")) == {0: 1.0}
    a2a = ";".join(f"{s}>{','.join(str(d) for d in range(8) if d != s)}" for s in range(8))
    assert drain_share(parse_routes(a2a)) == pytest.approx({s: 1.0 for s in range(8)})
    # a source is held back by its busiest destination: 0 → {1, 2} while 3 and 4 also hit 1
    # (load on 1 = 1/2 + 1 + 1 = 2.5: shares 0.4 for every source into 1)
    assert drain_share(parse_routes("0>1,2;3>1;4>1")) == pytest.approx({0: 0.4, 3: 0.4, 4: 0.4})


# --- what the kernel runs and what the checks expect ------------------------------------------

def test_op_codes_are_the_kernels():
    # kernels/remote_store_burst.cu: #define OP_STORE4 0u ... OP_LOAD16 6u. Codes taken from the
    # run order of OPS sent store16 to OP_STORE4, load16 to OP_RED_ADD_U32 (every load sum
    # wrong), red_add_u32 to OP_BULK (staging past its shared memory: an illegal address) and
    # red_add_f32 to OP_LOAD16 (the poisoned buffer left untouched) on the device.
    assert OP_CODES == {"store4": 0, "store8": 1, "store16": 2, "red_add_u32": 3,
                        "red_add_f32": 4, "bulk": 5, "load16": 6}
    assert len(set(OP_CODES.values())) == len(OPS)
    with pytest.raises(ValueError, match=r"no OP_\* code for \['load16'\]"):
        kernel_op_codes("#define OP_STORE4 0u\n#define OP_STORE8 1u\n#define OP_STORE16 2u\n"
                        "#define OP_RED_ADD_U32 3u\n#define OP_RED_ADD_F32 4u\n"
                        "#define OP_BULK 5u\n")


def _kernel_load_sums(words, K, B, n_slots, n_bursts, threads=3):
    """burst_gap_ops' OP_LOAD16 loop, thread by thread, in Python integers."""
    sums = [0] * K
    for burst in range(n_bursts):
        for p in range(K):
            word0 = (burst % n_slots) * K * B // 4 + p * B // 4
            for t in range(threads):
                for v in range(t, B // 16, threads):
                    sums[p] += sum(int(x) for x in words[word0 + 4 * v: word0 + 4 * v + 4])
    return np.array(sums, np.uint64)


@pytest.mark.parametrize("n_slots,n_bursts", [(4, 10), (4, 3), (5, 5), (1, 7)])
def test_expected_load_sums_match_the_kernels_loop(n_slots, n_bursts):
    K, B = 3, 64
    rng = np.random.default_rng(n_slots * 100 + n_bursts)
    # the device fill: non-negative int32 viewed as uint32, plus a few top-bit words
    words = rng.integers(0, 2**31 - 1, n_slots * K * B // 4 + 40, dtype=np.int32).view(np.uint32)
    words[::7] |= np.uint32(0x80000000)
    want = _kernel_load_sums(words, K, B, n_slots, n_bursts)
    got = expected_load_sums(words, K, B, n_slots, n_bursts)
    assert got.dtype == np.uint64
    np.testing.assert_array_equal(got, want)
    assert (got > 0).all()


def test_f32_reduction_expectation_is_exact_and_tells_hits_apart():
    # count_ops_mismatches: x = poison as f32, then hits additions of a small integer, as the
    # red.global.add.f32 of every hitting burst leaves it. Poison 0xA5A5A5A5 is a normal f32
    # (≈ −2.9e-16), absorbed by the first addition; every sum is then an exact integer.
    poison = np.array([_POISON], np.uint32).view(np.float32)[0]
    assert np.isfinite(poison) and abs(poison) > np.finfo(np.float32).tiny
    for addend in range(1, 9):
        for hits in range(1, 8):
            x = poison
            for _ in range(hits):
                x = np.float32(x + np.float32(addend))
            assert x == np.float32(hits * addend)
            assert x.view(np.uint32) != np.uint32(_POISON)


# --- validation ------------------------------------------------------------------------------

def test_stamps_bytes():
    assert stamps_bytes(96) == 96 * 3 * 8          # 288 words: already a multiple of 16
    assert stamps_bytes(97) == 304 * 8             # 291 → 304


def test_good_points_accepted():
    for op in OPS:
        validate_ops_point(dict(GOOD, op=op), INV2)
    validate_ops_point(dict(GOOD, mode="isolated", recovery_rate_GBps=5.0), INV2)
    validate_ops_point(dict(GOOD, routes="0>1;1>0", bursts=40), INV2)
    validate_ops_point(dict(GOOD, routes="0>1,2,3;1>0", producers=3), make_inv(4))
    # local control: the routes' sources store to themselves, peers not needed
    validate_ops_point(dict(GOOD, path="local"), make_inv(2, peer=False))
    validate_ops_point(dict(GOOD, op="bulk", burst_bytes=128 * KIB), INV2)


@pytest.mark.parametrize("change,match", [
    (dict(op="store2"), r"op must be one of"),
    (dict(mode="fenced"), r"mode must be one of"),
    (dict(path="peer"), r"path must be one of"),
    (dict(align="never"), r"align must be one of"),
    (dict(lines="rewrite"), r"fresh lines only"),
    (dict(burst_bytes=24), r"multiple of 16"),
    (dict(burst_bytes=16384.0), r"multiple of 16"),
    (dict(gap_us=float("nan")), r"must not be negative"),
    (dict(routes="0>0"), r"stores to its own GPU"),
    (dict(routes="0>1;0>1"), r"name a source twice"),
    (dict(routes="0>1,1"), r"distinct destinations"),
    (dict(routes="0>2"), r"must name GPUs 0\.\.1"),
    (dict(producers=133), r"producers K=133 must be in 1\.\.132"),
    (dict(op="bulk", burst_bytes=256 * KIB), r"bulk staging"),
    (dict(producers=132, burst_bytes=4 * MIB), r"exceeds the 268435456-byte buffer"),
    (dict(bursts=17), r"bursts=17 must be in 18\.\.96"),
    (dict(bursts=97), r"bursts=97"),
    (dict(recovery_rate_GBps=0.0), r"recovery_rate_GBps must be positive"),
])
def test_bad_points_rejected(change, match):
    with pytest.raises(ValueError, match=match):
        validate_ops_point(dict(GOOD, **change), INV2)


def test_more_destinations_than_producers_rejected():
    with pytest.raises(ValueError, match=r"producers K=2 must be in 3\.\.132"):
        validate_ops_point(dict(GOOD, routes="0>1,2,3", producers=2), make_inv(4))


def test_no_peer_access_rejected():
    with pytest.raises(ValueError, match="GPU 0 has no peer access to GPU 1"):
        validate_ops_point(GOOD, make_inv(2, peer=False))


def test_bulk_chunk_checked():
    with pytest.raises(ValueError, match="bulk_chunk_bytes"):
        validate_ops_point(GOOD, INV2, OpsSettings(bulk_chunk_bytes=1000))


# --- sweeps ----------------------------------------------------------------------------------

def test_config_sweeps_scale_with_the_rate():
    fixed = dict(routes="0>1")
    drain, gap, iso = config_sweeps({"op": "store4"}, 132, fixed, rate_GBps=368.0)
    # V/R at B = 64 KiB: 132 · 65536 B / 368e3 B/µs = 23.508 µs
    v_r = 132 * 65536 / 368e3
    gaps = sorted({p["gap_us"] for p in gap.points()})
    np.testing.assert_allclose(gaps, [round(f * v_r, 2) for f in GAP_FRACTIONS])
    assert max(gaps) >= 2 * v_r  # reaches calibrate's plateau (gap ≥ 2·V/R)
    # zero-gap launches at full length; the gap sweep's longest period, V/R + 4·V/R = 117.54 µs,
    # fits 10 ms 85 times; isolated recovery capped at the bench default
    assert {p["bursts"] for p in drain.points()} == {96}
    assert {p["bursts"] for p in gap.points()} == {85}
    assert {p["recovery_rate_GBps"] for p in iso.points()} == {50.0}
    assert {p["op"] for p in drain.points() + gap.points() + iso.points()} == {"store4"}
    assert len(drain.points()) == 6 and len(gap.points()) == 40 and len(iso.points()) == 8
    for sw in (drain, gap, iso):
        for p in sw.points():
            validate_ops_point(p, INV2)
    # slow (a reduction at 10 GB/s): gaps up to 4·V/R, launches shortened, recovery at R/2
    drain, gap, iso = config_sweeps({"op": "red_add_u32"}, 132, fixed, rate_GBps=10.0)
    assert max(p["gap_us"] for p in gap.points()) == pytest.approx(4 * 132 * 65536 / 10e3,
                                                                   abs=0.01)
    assert {p["bursts"] for p in gap.points()} == {MIN_BURSTS}
    assert {p["recovery_rate_GBps"] for p in iso.points()} == {5.0}
    for sw in (drain, gap, iso):
        for p in sw.points():
            validate_ops_point(p, INV2)


# --- fits ------------------------------------------------------------------------------------

def _sweeps(configs, rate=KNOWN["drain_rate"]):
    return [sw for cfg in configs for sw in config_sweeps(cfg, 132, dict(routes="0>1"), rate,
                                                          BenchSettings(), repeats=3)]


def test_fit_recovers_the_known_platform_and_predicts_without_refit():
    table = synthetic_beyond_table(_sweeps([{"op": "store16"}]), noise=0.0)
    fit = fit_config(table, "store16", 0, "test", "r")
    assert fit.error is None
    cal = fit.calibration
    assert cal.drain_rate_GBps == pytest.approx(KNOWN["drain_rate"], rel=1e-6)
    assert cal.loop_gap_us == pytest.approx(KNOWN["loop_gap_us"], rel=1e-6)
    for b in (16 * KIB, 64 * KIB):
        # the plateau: the issue floor, or, past the capacity, the isolated burst's (V − Q)/R
        v = 132 * b
        plateau = model.isolated_issue_time(v, issue_floor(132, v), capacity(132), KNOWN["drain_rate"])
        assert cal.t_iss0_us[kb_key(132, b)] == pytest.approx(float(plateau), rel=1e-6)
    assert cal.isolated["132"]["capacity_bytes"] == pytest.approx(capacity(132), rel=1e-3)
    assert cal.gap_issue_err_pct == pytest.approx(0.0, abs=1e-6)
    # the same M_X predicts its own sweep exactly; half the drain rate does not
    assert no_refit_error(fit.predicted, cal)["t_iss_err_pct"] == pytest.approx(0.0, abs=1e-6)
    worse = no_refit_error(fit.predicted, cal, share=0.5)
    assert worse["drain_rate_GBps"] == pytest.approx(KNOWN["drain_rate"] / 2)
    assert worse["t_iss_err_pct"] > 5.0
    entry = fit_entry(fit, cal)
    assert entry["R_GBps"] == pytest.approx(KNOWN["drain_rate"], abs=0.1)
    assert entry["Q_MiB"]["K=132"] == pytest.approx(capacity(132) / MIB, abs=1e-3)
    assert entry["no_refit_from_baseline"]["t_iss_err_pct"] == pytest.approx(0.0, abs=1e-3)


def test_slower_operation_fitted_at_its_own_rate_and_missed_by_the_baseline():
    # a reduction draining at 100 GB/s: its sweeps are scaled to it, its fit finds it, and the
    # 16-byte-store M_X (700 GB/s) mispredicts its drain branch
    sweeps = _sweeps([{"op": "store16"}]) + _sweeps([{"op": "red_add_u32"}], rate=100.0)
    table = synthetic_beyond_table(
        sweeps, drain_rate=lambda p: 100.0 if p["op"] == "red_add_u32" else KNOWN["drain_rate"])
    base = fit_config(table[table["op"] == "store16"], "store16", 0, "t", "r").calibration
    red = fit_config(table[table["op"] == "red_add_u32"], "red_add_u32", 0, "t", "r")
    assert red.calibration.drain_rate_GBps == pytest.approx(100.0, rel=1e-6)
    assert red.calibration.gap_issue_err_pct == pytest.approx(0.0, abs=1e-6)
    assert fit_entry(red, base)["no_refit_from_baseline"]["t_iss_err_pct"] > 20.0


def test_a_sweep_without_plateau_is_kept_with_the_reason():
    # sweeps scaled for 700 GB/s, but the operation drains at 50: no gap reaches 2·V/R
    table = synthetic_beyond_table(_sweeps([{"op": "red_add_f32"}]), drain_rate=lambda p: 50.0)
    fit = fit_config(table, "red_add_f32", 0, "t", "r")
    assert fit.calibration is None and "no recovered plateau" in fit.error
    assert fit_entry(fit, None) == {"key": "red_add_f32", "src": 0, "fit_error": fit.error}


def test_model_drain_time_is_what_scales_the_gaps():
    # the sweep scale and the model agree on V/R
    assert model.drain_time(132 * 65536, 368.0) == pytest.approx(132 * 65536 / 368e3)


# --- orchestration (a bench that answers from the model) -------------------------------------

class ModelBench:
    """Stands in for RemoteOpsBench: validates like it, answers every point from the Burst–Gap
    model (rates per op), and faults on the ops in ``faulty``."""

    def __init__(self, rates: dict, faulty=()):
        self.settings, self.rates, self.faulty, self.launches = BenchSettings(), rates, faulty, []
        self.rows = {}  # a point's rows, made at its first launch

    def validate(self, p):
        validate_ops_point(p, INV2)

    def sm_clock_mhz(self, dev):
        return 1980.0

    def measure(self, p):
        from xstage_lab.sweep import Sweep

        self.validate(p)
        if p["op"] in self.faulty:
            raise RuntimeError(f"{p['op']}: illegal address")
        self.launches.append(p)
        key = repr(sorted(p.items()))
        if key not in self.rows:  # the model answers a point's launches alike (2 ms each)
            rows = synthetic_beyond_table([Sweep("one", (), fixed=p, repeats=1, warmup=0)],
                                          drain_rate=lambda q: self.rates[q["op"]])
            self.rows[key] = rows.drop(columns=["sweep", "point", "repeat"])
        return self.rows[key].copy()


def test_calibrate_configs_scales_excludes_and_fits():
    from xstage_lab.experiments.remote_store.ops import calibrate_configs, sweep_seconds

    bench = ModelBench({"store16": 700.0, "load16": 350.0, "red_add_u32": 0.5}, faulty=("bulk",))
    configs = [{"op": op} for op in ("store16", "load16", "bulk", "red_add_u32")]
    table, facts = calibrate_configs(bench, configs, dict(routes="0>1"), 132, repeats=2,
                                     progress=False, budget_s=60.0)
    assert list(dict.fromkeys(table["op"])) == ["store16", "load16"]
    assert "illegal address" in facts["excluded"]["op=bulk"]
    assert facts["excluded"]["op=red_add_u32"].startswith("time budget")
    # the drain sweep's R (aligned, eq. 1) scaled the gap sweep of each op
    assert facts["rates_GBps"]["op=load16"]["drain_sweep"] == pytest.approx(350.0, rel=1e-6)
    gaps = sorted(set(table[(table["op"] == "load16") & (table["sweep"] == "gap")]["gap_us"]))
    np.testing.assert_allclose(gaps, [round(f * 132 * 65536 / 350e3, 2) for f in GAP_FRACTIONS])
    assert set(table["sweep"]) == {"drain_rate", "gap", "isolated"}
    fit = fit_config(table[table["op"] == "load16"], "load16", 0, "t", "r")
    assert fit.calibration.drain_rate_GBps == pytest.approx(350.0, rel=1e-6)
    # every launch was a validated point; nothing ran for the excluded configs but the probe
    assert {p["op"] for p in bench.launches} == {"store16", "load16", "red_add_u32"}
    assert sum(p["op"] == "red_add_u32" for p in bench.launches) == 1
    # the budget estimate: 8.65 MB at 0.5 GB/s is 17.3 ms a burst, past 60 s in all
    sweeps = config_sweeps({"op": "red_add_u32"}, 132, dict(routes="0>1"), 0.5, repeats=2)
    assert sum(sweep_seconds(sw, 0.5, BenchSettings()) for sw in sweeps) > 60.0


def test_sweep_seconds_hand_worked():
    from xstage_lab.experiments.remote_store.ops import sweep_seconds
    from xstage_lab.sweep import Axis, Sweep

    # 2 points × (1 warm-up + 2 repeats) launches of 40 bursts; remote, V/R = 132·65536/100e3
    # = 86.50752 µs > gap 10 µs; local costs its gap only: 40 · 10 µs
    sw = Sweep("gap", (Axis("path", ("remote", "local")),),
               fixed=dict(producers=132, burst_bytes=65536, gap_us=10.0, mode="periodic",
                          bursts=40), repeats=2, warmup=1)
    want = 3 * (40 * 86.50752e-6 + 0.006) + 3 * (40 * 10e-6 + 0.006)
    assert sweep_seconds(sw, 100.0, BenchSettings()) == pytest.approx(want, rel=1e-12)


def test_cli_runs_each_part_and_reports_a_failing_one(monkeypatch, tmp_path, capsys):
    from xstage_lab import __main__ as cli
    from xstage_lab.experiments.remote_store import patterns as injection_patterns, ops as remote_ops

    calls = []

    def fail(**kw):
        raise RuntimeError("no peer access")

    monkeypatch.setattr(cli, "_need_gpus", lambda *pairs, **kw: None)  # two peer GPUs
    monkeypatch.setattr(injection_patterns, "run_patterns", fail)
    monkeypatch.setattr(remote_ops, "run_operations",
                        lambda **kw: calls.append(kw) or tmp_path / "ops.parquet")
    assert cli.main(["characterize-beyond", "--root", str(tmp_path), "--repeats", "3"]) == 1
    assert calls == [dict(repeats=3, src=0, dst=1, root=tmp_path)]
    out = capsys.readouterr()
    assert "wrote " in out.out and "failed: ['patterns']" in out.out
    assert "no peer access" in out.err


# --- isolation: each operation in a spawned process, through the harness ----------------------

def fake_calibrate_op(cfg, fixed, K, repeats, progress, deadline, settings):
    """Stands in for ``calibrate_op`` in the spawned children: bulk dies as a sticky CUDA fault
    would (an exception), load16 exits without a word, red_add_u32 is left out by its own
    bench (facts only); the others return their calibration sweeps' rows from the model (as
    ``calibrate_configs`` tags them), with the budget they were given."""
    import os
    import time

    op = cfg["op"]
    if op == "bulk":
        raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
    if op == "load16":
        os._exit(3)
    facts = {"clocks": {f"op={op}/drain_rate": {"sm_clock_mhz_before": 1980.0}},
             "sweeps": [{"config": cfg, "name": "drain_rate"}],
             "rates_GBps": {f"op={op}": {"probe": 1.0, "drain_sweep": 1.0}},
             "excluded": {}, "seeds": {f"op={op}": 7}}
    if op == "red_add_u32":
        return None, {**facts, "excluded": {f"op={op}": "time budget: needs ~99 s, 1 s left"},
                      "rates_GBps": {}, "sweeps": []}
    rate = {"store16": 700.0, "store4": 400.0}[op]
    rows = synthetic_beyond_table(config_sweeps(cfg, K, fixed, rate, repeats=repeats),
                                  drain_rate=lambda p: rate)
    return rows.assign(order=np.arange(len(rows)), config=f"op={op}", K=K,
                       budget_left_s=deadline - time.monotonic()), facts


def run_ops(monkeypatch, tmp_path, ops):
    from xstage_lab.experiments.remote_store import ops as remote_ops

    from .test_characterization import fake_machine

    monkeypatch.setattr(remote_ops, "calibrate_op", fake_calibrate_op)
    monkeypatch.setattr(remote_ops, "OPS", ops)
    fake_machine(monkeypatch, remote_ops)
    return remote_ops.run_operations(repeats=2, progress=False, budget_s=100.0, root=tmp_path)


def test_operations_leave_out_failed_children_and_fit_the_rest(monkeypatch, tmp_path):
    from xstage_lab.records import read_record

    ops = ("store16", "bulk", "load16", "red_add_u32", "store4")
    rec = read_record(run_ops(monkeypatch, tmp_path, ops))
    assert rec.meta["experiment"] == "remote_ops"
    table, params = rec.table, rec.params
    # the children after a failed one still ran and their rows were merged in order
    assert list(dict.fromkeys(table["op"])) == ["store16", "store4"]
    assert (table["K"] == 132).all()
    assert (table["budget_left_s"] <= 100.0).all() and (table["budget_left_s"] > 50.0).all()
    # each row keeps its calibration sweep's point and repeat (the harness's per-config tags
    # are not the record's)
    for (op, name), rows in table.groupby(["op", "sweep"]):
        sweep = {s.name: s for s in config_sweeps({"op": op}, 132, dict(routes="0>1"), 1.0)}[name]
        assert sorted(set(rows["point"])) == list(range(len(sweep.points())))
        assert set(rows["repeat"]) == {0, 1}
    assert not {"sweep_point", "sweep_repeat", "sweep_order"} & set(table)
    ex = params["excluded"]
    assert set(ex) == {"op=bulk", "op=load16", "op=red_add_u32"}
    assert ex["op=bulk"].startswith("child process exited 1: ")
    assert ex["op=bulk"].endswith("RuntimeError: cudaErrorIllegalAddress: an illegal memory "
                                  "access was encountered")
    assert ex["op=load16"] == "child process exited 3: no error text"
    assert ex["op=red_add_u32"] == "time budget: needs ~99 s, 1 s left"
    assert params["seeds"] == {"op=store16": 7, "op=red_add_u32": 7, "op=store4": 7}
    assert set(params["rates_GBps"]) == {"op=store16", "op=store4"}
    assert [s["config"]["op"] for s in params["calibration_sweeps"]] == ["store16", "store4"]
    assert set(params["clocks"]) == {f"op={op}/drain_rate" for op in ("store16", "red_add_u32",
                                                                       "store4")}
    # the declared sweep: a point per operation
    assert params["sweeps"][0]["axes"] == {"config": [{"op": op} for op in ops]}
    assert params["ops"] == ["store16", "store4"] and params["baseline"] == "store16"
    assert params["fits"]["store4"]["R_GBps"] == pytest.approx(400.0, rel=1e-3)
    from xstage_lab.analysis.remote_store.operations import summary_entry

    entry = summary_entry(params, rec.record_id)
    assert entry["route"] == "0>1" and set(entry["per_op"]) == {"store16", "store4"}


def test_operations_raise_when_nothing_was_measured(monkeypatch, tmp_path):
    from xstage_lab.experiments.remote_store import ops as remote_ops

    with pytest.raises(remote_ops.NothingMeasured, match="op=bulk"):
        run_ops(monkeypatch, tmp_path, ("bulk",))
    assert not any(tmp_path.iterdir())
