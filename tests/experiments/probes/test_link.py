"""The link probe on the CPU: its arguments refused before any CUDA work, the declared settings
and their order, rank 0's control of every window (fake clocks and collectives), what a poisoned
trickle target must hold, the NVML summary, the output as a record, and the trickle kernel
compiled for sm_90 (no GPU needed)."""
import json
import math
import re
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
from triton.compiler import ASTSource

from tests.experiments.triton_testing import compile_sm90, ptxas_report
from xstage_lab import dist_timing
from xstage_lab.__main__ import build_parser
from xstage_lab.experiments import harness
from xstage_lab.experiments.harness import Run
from xstage_lab.experiments.probes import link as lp, link_checks as lc, link_windows as lw
from xstage_lab.records import import_bench_json, read_record
from xstage_lab.sweep import run_sweep


# ------------------------------------------------------------------------------- arguments

@pytest.fixture
def no_cuda(monkeypatch):
    """Fail where the probe starts a rank (the GPU, NCCL) before its arguments are checked."""
    def touched():
        raise AssertionError("a rank was started before the arguments were checked")
    monkeypatch.setattr(dist_timing, "start_rank", touched)
    monkeypatch.setenv("LOCAL_RANK", "0")  # as under torchrun: only the checks stop the run


@pytest.mark.parametrize("extra,says", [
    (["--periods-us", "0"], "each period must be in"),
    (["--periods-us", "-20"], "each period must be in"),
    (["--periods-us", "0.5"], "each period must be in"),
    (["--periods-us", "nan"], "each period must be in"),
    (["--periods-us", "inf"], "each period must be in"),
    (["--periods-us", "20", "20"], "lists a period twice"),
    (["--periods-us", "300000"], "at least 10 stores per window"),
    (["--window-s", "0"], "--window-s must be in"),
    (["--window-s", "-1"], "--window-s must be in"),
    (["--window-s", "61"], "--window-s must be in"),
    (["--settle-s", "-0.5"], "--settle-s must be in"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--M", "1000"], "multiple of the 128-row tiles"),
    (["--heads", "0"], "--heads must be >= 1"),
])
def test_bad_arguments_exit_before_any_cuda_work(capsys, no_cuda, extra, says):
    with pytest.raises(SystemExit) as e:
        harness.main(lp.EXPERIMENT, ["--out", "x.json", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err, err
    assert "Traceback" not in err


def test_the_shape_is_checked_for_the_world_size():
    args = harness.parse(lp.EXPERIMENT, ["--out", "x.json"])
    (sweep,) = lp.EXPERIMENT.sweeps(args)
    with pytest.raises(ValueError, match="not divisible by P=5"):
        lp.EXPERIMENT.validate(sweep.points()[0], Run(args, world=5))
    args = harness.parse(lp.EXPERIMENT, ["--out", "x.json", "--M", "8192", "--periods-us", "20",
                                         "2000"])
    assert args.periods_us == [20.0, 2000.0] and args.M == 8192
    for point in lp.EXPERIMENT.sweeps(args)[0].points():
        lp.EXPERIMENT.validate(point, Run(args, world=2))


# -------------------------------------------------------------------------------- settings

def test_declared_settings_are_the_control_beside_the_trickle_and_the_three_methods():
    settings = lw.declared_settings([2, 2000])
    assert [s.name for s in settings] == [
        "fa_same_code", "fa_same_code+peer@2us", "fa_same_code+local@2us",
        "fa_same_code+peer@2000us", "fa_same_code+local@2000us", "fused", "serial", "a2a_nccl"]
    assert {s.workload for s in settings} == set(lw.WORKLOADS)
    assert {s.trickle for s in settings} == set(lw.TRICKLES)
    assert all((s.trickle == "none") == (s.period_us is None) for s in settings)
    assert len(lw.declared_settings(lw.DEFAULT_PERIODS_US)) == 4 + 2 * len(lw.DEFAULT_PERIODS_US)


def test_the_sweep_is_every_round_of_settings_in_its_seeded_order():
    args = harness.parse(lp.EXPERIMENT, ["--out", "x.json", "--M", "8192", "--heads", "8",
                                         "--periods-us", "20", "2000", "--rounds", "2",
                                         "--seed", "3"])
    (sweep,) = lp.EXPERIMENT.sweeps(args)
    assert sweep.repeats == 1 and sweep.warmup == 0
    assert sweep.fixed == dict(M=8192, heads=8, head_dim=128)
    points = sweep.points()
    settings = lw.declared_settings([20.0, 2000.0])
    assert [(p["round"], p["setting"]) for p in points] == [
        (r, s.name) for r in range(2) for s in lw.round_order(settings, r, seed=3)]
    assert [i for _, i in sweep.order()] == list(range(len(points)))  # run as declared
    assert len(points) == 2 * len(settings)
    assert lp.EXPERIMENT.sweeps(args)[0].points() == points  # the same on every rank
    # tagged as the harness tags them: rows per (round, setting, rank) in the run's order
    rows, _ = run_sweep(sweep, lambda p: [dict(round=p["round"], setting=p["setting"], rank=r)
                                          for r in range(2)], progress=False)
    assert rows[["round", "setting"]].values.tolist()[::2] == [
        [p["round"], p["setting"]] for p in points]
    assert rows["order"].tolist() == [i for i in range(len(points)) for _ in range(2)]
    assert set(rows["M"]) == {8192} and set(rows["heads"]) == {8}


def test_round_order_is_a_seeded_shuffle_the_same_on_every_rank():
    settings = lw.declared_settings(lw.DEFAULT_PERIODS_US)
    orders = [lw.round_order(settings, r, seed=0) for r in range(3)]
    assert all(sorted(o, key=settings.index) == settings for o in orders)
    assert orders == [lw.round_order(settings, r, seed=0) for r in range(3)]
    assert len({tuple(o) for o in orders}) == 3
    assert lw.round_order(settings, 0, seed=1) != orders[0]


# ---------------------------------------------------------------------- window control

class FakeClock:
    """A host clock that the test's ``launch`` advances."""

    def __init__(self, start=0.0):
        self.t = start

    def __call__(self):
        return self.t


def test_the_leader_runs_steps_until_its_window_is_over():
    clock, launched, proposals = FakeClock(), [], []

    def decide(value):
        proposals.append(value)
        return value

    def launch(n):
        launched.append(n)
        clock.t += 0.03

    calls = lw.run_window(0.1, 5, leader=True, clock=clock, decide=decide, launch=launch)
    assert launched == [5, 5, 5, 5] and calls == 20  # steps start at 0, .03, .06, .09
    assert proposals == [5, 5, 5, 5, 0]


def test_the_first_step_runs_even_where_the_clock_is_already_past_the_window():
    clock_jump = iter([0.0, 10.0, 10.0])  # the start, then past the window at once
    calls = lw.run_window(0.1, 3, leader=True, clock=lambda: next(clock_jump),
                          decide=lambda v: v, launch=lambda n: None)
    assert calls == 3


class FakeBroadcast:
    """Rank 0's value to every rank, as ``dist.broadcast`` over a group of ``world`` threads."""

    def __init__(self, world):
        self.barrier = threading.Barrier(world, timeout=10)
        self.value = None
        self.calls = [0] * world

    def for_rank(self, rank):
        def decide(value):
            self.calls[rank] += 1
            if rank == 0:
                self.value = value
            self.barrier.wait()  # the leader's value is in
            out = self.value
            self.barrier.wait()  # everyone read it before the next broadcast
            return out
        return decide


def test_every_rank_runs_the_leaders_steps_whatever_its_own_clock_says():
    """Rank 1's clock says its window ended at once (before, it would have stopped and left
    rank 0 waiting in a collective): both ranks still run the same steps and make the same
    broadcasts, as many as rank 0's clock asks for."""
    world, bcast = 2, FakeBroadcast(2)
    clocks = [FakeClock(), FakeClock()]
    launched = [[], []]
    results = [None, None]

    def rank_main(rank):
        def launch(n):
            launched[rank].append(n)
            clocks[rank].t += 0.03 if rank == 0 else 100.0
        results[rank] = lw.run_window(0.1, 4, leader=rank == 0, clock=clocks[rank],
                                      decide=bcast.for_rank(rank), launch=launch)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert results == [16, 16]
    assert launched[0] == launched[1] == [4, 4, 4, 4]
    assert bcast.calls == [5, 5]


def test_steps_and_the_trickles_run_cover_the_window():
    assert lw.step_calls_for(0.010) == 2 and lw.step_calls_for(0.0004) == 50
    assert lw.step_calls_for(1.5) == 1 and lw.step_calls_for(0.0) == 1
    run = lw.trickle_run_s(1.0, 2.5, 0.02)
    assert run == pytest.approx(1.0 + 2.5 + lw.TRICKLE_TAIL_S + 0.08)
    # the window's trickle stays inside int32 stores even at the shortest period and longest run
    longest = lw.trickle_run_s(lw.MAX_WINDOW_S, lw.MAX_WINDOW_S, 1.0)
    assert longest * 1e9 // (lw.MIN_PERIOD_US * 1e3) + 1 < lc.MAX_STORES


# -------------------------------------------------------------------- the trickle's target

def test_expected_slots_before_the_stores_wrap():
    got = lc.expected_slots(3, 8, source=1)
    assert got.dtype == torch.int32 and got.shape == (8, lc.SLOT_WORDS)
    assert got[:3].tolist() == [[i, 1, i, lc.MAGIC] for i in range(3)]
    assert (got[3:] == lc.POISON).all()


def test_expected_slots_keep_each_slots_last_store_once_they_wrap():
    got = lc.expected_slots(11, 4, source=0)  # stores 0..10 into 4 slots
    assert got.tolist() == [[8, 0, 0, lc.MAGIC], [9, 0, 1, lc.MAGIC], [10, 0, 2, lc.MAGIC],
                            [7, 0, 3, lc.MAGIC]]
    assert (lc.expected_slots(0, 4, source=0) == lc.POISON).all()


def test_the_poison_is_no_word_a_store_writes():
    assert lc.POISON not in (lc.MAGIC, 0, 1) and lc.POISON > lc.MAX_STORES // 2
    assert math.isnan(torch.tensor([lc.POISON], dtype=torch.int32).view(torch.float32).item())


@pytest.mark.parametrize("kwargs,says", [
    (dict(slots=0), "slots >= 1"),
    (dict(period_ns=0), "period_ns >= 1"),
    (dict(run_ns=-1), "run_ns >= 0"),
    (dict(max_stores=2 ** 31), "max_stores"),
    (dict(target=1), "must index an int64 table"),
])
def test_the_trickle_refuses_bad_bounds_before_launching(kwargs, says):
    args = dict(table=torch.zeros(1, dtype=torch.int64), target=0,
                result=torch.zeros(lc.RESULT_FIELDS, dtype=torch.int64), slots=4, period_ns=1000,
                run_ns=10 ** 6, max_stores=10, source=0) | kwargs
    with pytest.raises(ValueError, match=says):
        lc.launch_trickle(**args)
    with pytest.raises(ValueError, match="CUDA device"):  # good bounds: a CPU table is refused
        lc.launch_trickle(**(args | dict(slots=4, period_ns=1000, run_ns=0, max_stores=10,
                                         target=0)))


# ------------------------------------------------------------------------------ NVML summary

def _sample(t, clock, power, energy, reasons):
    return dict(t=t, sm_clock_mhz=clock, power_w=power, energy_j=energy, temp_c=60,
                power_limit_w=700.0, reasons=reasons)


def test_power_summary_of_a_window():
    samples = [_sample(0.0, 1500, 690.0, 1000.0, 0x4), _sample(0.5, 1530, 700.0, None, 0x4),
               _sample(1.0, None, 680.0, 1690.0, 0x0), _sample(1.5, 1560, None, 2035.0, 0x4 | 0x8)]
    out = lw.power_summary(samples, us_per_call=2000.0)
    assert out["samples"] == 4 and out["sm_clock_mhz_median"] == 1530
    assert out["power_w_mean"] == pytest.approx(690.0) and out["power_w_max"] == 700.0
    assert out["energy_w"] == pytest.approx((2035.0 - 1000.0) / 1.5)
    assert out["energy_j_per_call"] == pytest.approx(out["energy_w"] * 2e-3)
    assert out["sw_power_cap_frac"] == 0.75 and out["hw_slowdown_frac"] == 0.25
    assert out["sw_thermal_frac"] == 0.0 and out["power_limit_w"] == 700.0


def test_power_summary_without_nvml_is_none_not_zero():
    out = lw.power_summary([], us_per_call=2000.0)
    assert out["samples"] == 0
    assert all(v is None for k, v in out.items() if k != "samples")
    with lw.PowerSampler(None) as sampler:
        pass
    assert sampler.samples == []


class FakeNvmlError(Exception):
    pass


def fake_pynvml(**overrides):
    """pynvml's calls as the sampler makes them, one of them refusing like a GPU without it."""
    def refuse(handle):
        raise FakeNvmlError("not supported")
    calls = dict(NVMLError=FakeNvmlError, NVML_CLOCK_SM=1, NVML_TEMPERATURE_GPU=0,
                 nvmlDeviceGetClockInfo=lambda h, kind: {1: 1545}[kind],
                 nvmlDeviceGetPowerUsage=lambda h: 691500,
                 nvmlDeviceGetTotalEnergyConsumption=refuse,
                 nvmlDeviceGetTemperature=lambda h, kind: 63,
                 nvmlDeviceGetEnforcedPowerLimit=lambda h: 700000,
                 nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0x4)
    return SimpleNamespace(**(calls | overrides))


def test_a_sample_reads_nvml_in_its_units_and_none_where_it_refuses():
    sample = lw.Nvml(fake_pynvml(), handle=object()).sample()
    assert sample["sm_clock_mhz"] == 1545 and sample["temp_c"] == 63
    assert sample["power_w"] == pytest.approx(691.5) and sample["power_limit_w"] == 700.0
    assert sample["energy_j"] is None and sample["reasons"] == 0x4
    # newer NVML names the reasons clock events
    newer = fake_pynvml(nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x8)
    assert lw.Nvml(newer, handle=object()).sample()["reasons"] == 0x8


def test_without_pynvml_the_readings_are_unknown(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # importing it raises ImportError
    nvml, why = lw.Nvml.open(0)
    assert nvml is None and why.startswith("NVML unavailable: ModuleNotFoundError")


# ------------------------------------------------------------------------ output as a record

def _document(tmp_path, world):
    """The output as the harness writes it: its header around the probe's metadata, and rows
    tagged with their window."""
    args = harness.parse(lp.EXPERIMENT, ["--out", str(tmp_path / "x.json"), "--M", "8192",
                                         "--periods-us", "20", "2000", "--rounds", "1"])
    probe = lp.LinkProbe()
    probe.cfg, probe.checks, probe.steps = dict(kernel="gluon_ws"), [{}], {"fused": 2}
    probe.nvml_by_rank = ["pynvml"]
    (sweep,) = probe.sweeps(args)
    row = dict(round=0, setting="fa_same_code+peer@20us", workload="fa_same_code",
               trickle="peer", period_us=20.0, rank=0, calls=100, us_per_call=1000.0,
               window_s=0.1, trickle_stores=5000, trickle_span_s=0.1, trickle_period_us=20.2,
               trickle_covered=True) | lw.power_summary([], 1000.0)
    points = {p["setting"]: (i, p) for i, p in enumerate(sweep.points())}
    rows = [dict(r, point=points[r["setting"]][0], repeat=0, order=n, **points[r["setting"]][1])
            for n, r in enumerate([row, dict(row, setting="fused", workload="fused",
                                             trickle="none", period_us=None)])]
    prov = dict(date_utc="2026-12-02T10:00:00+00:00", gpu_name="NVIDIA H200", gpu_count=world,
                git_commit="abc")
    header = {"experiment": probe.name, "paper": probe.paper, "sweeps": [sweep.describe()],
              "chunk": None, "world_size": world, **probe.metadata(Run(args, world=world)),
              "sm_clock_mhz_start": [None] * world, "sm_clock_mhz_end": [None] * world,
              "wall_s": 1.0, "provenance": prov}
    return dict(metadata=header, rows=rows)


def test_the_output_imports_as_a_link_probe_record(tmp_path):
    doc = _document(tmp_path, world=2)
    meta = doc["metadata"]
    assert meta["dry_run"] is False and meta["dry_run_note"] is None
    assert [s["name"] for s in meta["settings"]][:3] == [
        "fa_same_code", "fa_same_code+peer@20us", "fa_same_code+local@20us"]
    assert meta["step_calls"] == {"fused": 2} and meta["nvml_by_rank"] == ["pynvml"]
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(doc))
    build_parser().parse_args(["import-bench", str(path), "--experiment", "link_probe"])
    record = read_record(import_bench_json(path, "link_probe", root=tmp_path / "records"))
    assert record.platform == "h200-x2" and record.params["params"]["P"] == 2
    assert record.table["setting"].tolist() == ["fa_same_code+peer@20us", "fused"]
    assert record.table["sm_clock_mhz_median"].isna().all()


def test_a_one_rank_run_says_it_is_a_dry_run(tmp_path):
    meta = _document(tmp_path, world=1)["metadata"]
    assert meta["dry_run"] is True and "own symmetric buffer" in meta["dry_run_note"]


# ------------------------------------------------------------------ the kernel, for sm_90

@pytest.fixture(scope="module")
def trickle_build():
    signature = {"table_ptr": "*i64", "target": "i32", "result_ptr": "*i64", "slots": "i32",
                 "period_ns": "i32", "run_ns": "i64", "max_stores": "i32", "source": "i32"}
    aligned = {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
    return compile_sm90(ASTSource(lc._kernels.link_trickle_kernel, signature, {}, aligned),
                        num_warps=1)


def test_the_trickle_is_one_warp_of_few_registers(trickle_build):
    assert trickle_build.metadata.num_warps == 1 and trickle_build.metadata.shared == 0
    ptxas = ptxas_report(trickle_build.asm["ptx"])
    assert ptxas["registers"] <= 64 and ptxas["spill_store_bytes"] == 0


def test_the_trickle_stores_16_byte_vectors_and_its_result(trickle_build):
    stores = re.findall(r"st\.global\S*", trickle_build.asm["ptx"])
    vectors = [s for s in stores if ".v4." in s]
    assert vectors and set(vectors) == {"st.global.v4.b32"}, stores
    assert sorted(set(stores) - set(vectors)) == ["st.global.b64"]
    assert len(stores) - len(vectors) == lc.RESULT_FIELDS


def test_the_trickle_reads_globaltimer_in_a_loop_bounded_by_count_and_deadline(trickle_build):
    ptx = trickle_build.asm["ptx"]
    assert len(re.findall(r"mov\.u64\s+%rd\d+,\s*%globaltimer", ptx)) >= 2  # entry, the spin
    ttir = trickle_build.asm["ttir"]
    conditions = re.findall(r"scf\.while.*?\{(.*?)\}\s*do", ttir, flags=re.S)
    assert len(conditions) == 2, conditions  # the store loop and its wait
    store_loop, wait = conditions
    deadline = re.search(r"(%deadline\w*) = arith\.addi %\w+, %run_ns", ttir).group(1)
    assert re.search(r"arith\.cmpi slt, %issued\w*, %max_stores", store_loop)
    assert re.search(rf"arith\.cmpi slt, %now\w*, {deadline}\b", store_loop)
    assert re.search(rf"arith\.cmpi slt, %now\w*, {deadline}\b", wait)
    assert "arith.andi" in store_loop and "arith.andi" in wait
