"""The MoE schedule probe on CPU: the balanced Linear-1 deal, the trace summary on a made-up
trace, and a whole run through the harness with the emulated launch (``test_kernel_bench``)."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from tests.experiments.moe.test_kernel_bench import SEED, TINY, TOKENS, EmulatedLaunch
from xstage_lab.experiments import harness
from xstage_lab.experiments.moe import kernel_cell as kc
from xstage_lab.experiments.probes import moe_schedule as ms
from xstage_lab.ops.moe.fused import prepare_fused_moe
from xstage_lab.ops.moe.schedules import L1, L2, MoEProblem

def test_every_probe_schedule_is_launchable_and_the_l1_first_one_is_what_it_says():
    problem = MoEProblem((3, 0, 5, 2), 4, 2)  # n_2 = 20: r_2 = 2 of 6 programs
    s = ms.probe_schedules(problem, 6, 2)
    assert list(s) == list(ms.SCHEDULES)
    assert s["wave_one"].wave_starts == (0,)
    assert s["interleaved"].programs != s["interleaved_strided"].programs
    for prog in s["interleaved_l1_first"].programs:
        kinds = [t.kind for t in prog]
        assert kinds == sorted(kinds)  # every Linear-1 tile before the first Linear-2 one
    with_leads = ms.probe_schedules(problem, 6, 2, leads=(1, 3))
    assert list(with_leads) == [*ms.SCHEDULES, "interleaved_d1", "interleaved_d3"]
    assert [with_leads[f"interleaved_d{d}"].lead_rows for d in (1, 3)] == [1, 3]


def trace(rows) -> pd.DataFrame:
    """(program, kind, t0, t1, t2, t3) per tile -> a tile frame."""
    f = pd.DataFrame(rows, columns=["program", "kind", "t0_us", "t1_us", "t2_us", "t3_us"])
    f["position"] = f.groupby("program").cumcount()
    f["wait_us"] = f["t1_us"] - f["t0_us"]
    f["mainloop_us"] = f["t2_us"] - f["t1_us"]
    f["span_us"] = f["t3_us"] - f["t2_us"]
    return f


def test_trace_summary_reads_idle_time_per_transition_and_what_ran_beside_linear2():
    f = trace([(0, L1, 0, 0, 10, 11), (0, L2, 13, 13, 33, 34), (0, L1, 34, 34, 44, 45),
               (1, L1, 0, 0, 10, 11), (1, L1, 11, 11, 21, 22), (1, L2, 22, 25, 45, 46)])
    s = ms.trace_summary(f)
    assert s["trace_makespan_us"] == 46 and s["program_end_min_us"] == 45
    assert s["idle_l1_l2_mean_us"] == pytest.approx(1.0)   # 11 -> 13 on program 0; 22 -> 22
    assert s["transitions_l1_l2"] == 2 and s["transitions_l1_l1"] == 1
    assert s["idle_l2_l2_mean_us"] != s["idle_l2_l2_mean_us"]  # none: NaN
    assert s["wait_l2_total_us"] == 3 and s["mainloop_l2_mean_us"] == 20
    # at program 0's Linear-2 midpoint (23) no Linear-1 mainloop runs; at program 1's (35)
    # program 0's (34..44) does
    assert s["l2_beside_l1_tiles"] == 1
    assert s["program_busy_max_us"] == pytest.approx(11 + 21 + 11)


@pytest.fixture
def probe_run(monkeypatch, tmp_path):
    monkeypatch.setattr(ms, "load_shapes", lambda: {"Tiny": TINY})
    real_prepare = prepare_fused_moe

    def prepare(layout, weights, schedule, peers, **kw):
        real_prepare(layout, weights, schedule, peers, **kw)
        launch = EmulatedLaunch(layout, weights, schedule, peers)
        launch.schedule = schedule  # what the fake trace reads
        return launch

    def fake_time(methods, *, trials, warmup, graph_iters, clocks):
        for fn in methods.values():
            fn()
        return {n: {"median_us": 100.0 + i, "p25_us": 99.0 + i, "p75_us": 101.0 + i,
                    "trials_us": [100.0 + i] * trials, "sm_clock_mhz": [1980.0] * trials}
                for i, n in enumerate(methods)}

    def fake_traced(cell, name):
        return trace([(g, t.kind, 0, 1, 2, 3) for g, p in
                      enumerate(cell.calls[name].schedule.programs) for t in p[:1]])

    for module in (ms, kc):
        monkeypatch.setattr(module, "prepare_fused_moe", prepare)
    monkeypatch.setattr(ms, "time_methods", fake_time)
    monkeypatch.setattr(ms, "traced_tiles", fake_traced)
    args = harness.parse(ms.EXPERIMENT, [
        "--out", str(tmp_path / "probe.json"), "--models", "Tiny", "--routing", "skewed",
        "--precisions", "bf16", "--tokens", str(TOKENS), "--kernel", "triton", "--programs", "4",
        "--trials", "2", "--seed", str(SEED), "--no-progress"])
    return args


def test_a_run_checks_every_schedule_then_times_and_traces_each(probe_run):
    assert harness.run(ms.MoESchedule(device="cpu"), probe_run) == probe_run.out
    rows = json.loads(probe_run.out.read_text())["rows"]
    assert [r["schedule"] for r in rows] == list(ms.SCHEDULES)
    for i, r in enumerate(rows):
        assert r["over_wave"] == pytest.approx(100.0 / (100.0 + i))
        assert r["spin_errors"] == 0 and r["stray_rows"] == 0 and r["trace_makespan_us"] == 3


def test_a_schedule_whose_rows_differ_aborts_before_timing(probe_run, monkeypatch):
    real = EmulatedLaunch.__init__

    def perturb(self, layout, weights, schedule, peers, fault=None):
        real(self, layout, weights, schedule, peers, None)
        self.fault = "perturb" if schedule.name == "interleaved" else None
    monkeypatch.setattr(EmulatedLaunch, "__init__", perturb)
    monkeypatch.setattr(ms, "time_methods", lambda *a, **k: pytest.fail("timed"))
    with pytest.raises(SystemExit, match="correctness failed"):
        harness.run(ms.MoESchedule(device="cpu"), probe_run)
    assert not probe_run.out.exists()
