"""The ring probe on CPU: its options refused before any CUDA work, Little's law in its units,
each depth's launch checked against the default's rows (a wrong depth named), and its rows from
the timings and traces it is given."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from xstage_lab.experiments import harness
from xstage_lab.experiments.moe.layer_bench import LayerCellRun
from xstage_lab.experiments.probes import moe_ring as mr
from xstage_lab.ops.moe.tiles import default_tile_config


def _args(*argv: str) -> argparse.Namespace:
    """The experiment's command line parsed as ``harness`` parses it, unchecked."""
    return harness.parser(mr.EXPERIMENT).parse_args(["--root", "records", *argv])


def test_options_are_checked_before_any_launch():
    a = _args()
    mr.EXPERIMENT.check_args(a)
    assert a.tokens == [1] and a.stages == list(mr.STAGES) and a.trials == 9
    for argv, message in [(("--models", "GPT-2"), "unknown model"),
                          (("--settings", "ep2"), "unknown setting"),
                          (("--tokens", "0"), ">= 1"), (("--trials", "0"), ">= 1"),
                          (("--stages", "1", "3"), "depths >= 2"),
                          (("--stages", "3", "3"), "distinct")]:
        with pytest.raises(ValueError, match=message):
            mr.EXPERIMENT.check_args(_args(*argv))


def test_littles_law_in_microseconds():
    # 4 blocks of 32 KiB in flight at 65.536 GB/s: 2 µs each
    assert mr.ring_latency_us(4, 32768, 65.536) == pytest.approx(2.0)
    assert mr.ring_latency_us(2, 32768, 65.536) == pytest.approx(1.0)


@pytest.mark.parametrize("precision, hidden, want", [("bf16", 4096, (32768, 32768)),
                                                     ("bf16", 1408, (32768, 16384)),
                                                     ("fp8", 4096, (32768, 32768)),
                                                     ("fp8", 1408, (32768, 16384))])
def test_a_stage_holds_one_k_block_of_each_tiles_weights(precision, hidden, want):
    config = default_tile_config(precision, "gluon_ws", hidden=hidden)
    weights = SimpleNamespace(w1=torch.empty(0, dtype=torch.bfloat16 if precision == "bf16"
                                             else torch.float8_e4m3fn))
    assert mr.block_bytes(config, weights) == want


class _Trace:
    """A launch's trace buffer, read back as its depth (what the fake ``tile_frame`` returns)."""

    def __init__(self, stages):
        self.stages = stages

    def cpu(self):
        return self

    def numpy(self):
        return self.stages


class _Launch:
    """A prepared launch of ``stages`` that stores ``value`` into the cell's Combine rows."""

    def __init__(self, cell, value, stages=None, errors=0):
        self.cell, self.value, self.errors = cell, value, errors
        self.trace, self.schedule = _Trace(stages), None

    def __call__(self):
        self.cell.rows.fill_(self.value)

    def error_count(self):
        return self.errors


class _Cell:
    def __init__(self, wrong=None, erring=None):
        self.rows = torch.zeros(4, dtype=torch.bfloat16)
        self.ws = SimpleNamespace(config=default_tile_config("fp8", "gluon_ws", hidden=4096),
                                  weights=SimpleNamespace(
                                      w1=torch.empty(0, dtype=torch.float8_e4m3fn),
                                      hidden=4096, intermediate=1024),
                                  bounds=SimpleNamespace(l2_splits=1))
        self.shape = SimpleNamespace(model="Qwen3.5")
        self.precision, self.setting, self.tokens = "fp8", "ep1", 1
        self.host_call = _Launch(self, 1.0)
        self.wrong, self.erring = wrong, erring

    def poison(self):
        self.rows.fill_(float("nan"))

    def combined(self):
        return self.rows

    def host_launch(self, instrument=False, config=None):
        s = config.num_stages
        return _Launch(self, 2.0 if (s, instrument) == self.wrong else 1.0, s,
                       errors=int((s, instrument) == self.erring))


def _check(cell, monkeypatch, *argv):
    monkeypatch.setattr(LayerCellRun, "check", lambda self, cell, run: [])
    return mr.EXPERIMENT.check(cell, SimpleNamespace(args=_args(*argv)))


def test_every_depth_and_its_traced_build_store_the_default_rows(monkeypatch):
    cell = _Cell()
    assert _check(cell, monkeypatch) == []
    assert sorted(cell.depths) == sorted(cell.traced) == list(mr.STAGES)
    assert [cell.depths[s].errors for s in mr.STAGES] == [0, 0, 0]
    failures = _check(_Cell(wrong=(3, True)), monkeypatch)
    assert failures == ["3 stages (instrumented): other Combine rows than the default launch"]
    assert _check(_Cell(erring=(2, False)), monkeypatch) == ["2 stages: spin errors 1"]


def test_rows_read_each_depths_trials_against_the_default_and_its_trace(monkeypatch):
    cell = _Cell()
    _check(cell, monkeypatch, "--stages", "2", "3")
    # the default depth (4) is left out of --stages: timed too, as the ratios' base
    trials = {"stages_2": [20.0, 22.0, 24.0], "stages_3": [15.0, 15.0, 18.0],
              "stages_4": [10.0, 11.0, 12.0]}

    def time_methods(methods, **kwargs):
        assert sorted(methods) == sorted(trials) and methods["stages_4"] is cell.host_call
        return {n: {"median_us": sorted(t)[1], "p25_us": min(t), "p75_us": max(t),
                    "trials_us": t, "sm_clock_mhz": [1980] * 3} for n, t in trials.items()}

    rates = {2: 32.768, 3: 49.152}  # GB/s per SM: the ring's bytes over 2 µs at both depths

    def phases(stages, l1, l2):  # the tiles of a depth's traced launch
        assert (l1, l2) == (2 * 128 * 4096, 256 * 1024)
        return {"trace_l1_tile_gbps": rates[stages], "trace_l2_tile_gbps": rates[stages] / 2,
                "trace_l1_sms": 80}

    monkeypatch.setattr(mr, "time_methods", time_methods)
    monkeypatch.setattr(mr, "tile_table", lambda schedule: ())
    monkeypatch.setattr(mr, "tile_frame", lambda trace: trace)
    monkeypatch.setattr(mr, "kernel_phases", phases)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    mr.EXPERIMENT.hbm_gbps = 4096.0
    rows = mr.EXPERIMENT.measure(cell, SimpleNamespace(args=_args("--stages", "2", "3")))
    assert rows["stages"].tolist() == [2, 3] and (rows["default_stages"] == 4).all()
    assert rows["over_default"].tolist() == [2.0, 1.5]  # medians of per-trial ratios
    assert rows["kernel_us"].tolist() == [22.0, 15.0]
    assert rows["l1_ring_latency_us"].tolist() == pytest.approx([2.0, 2.0])
    assert rows["l2_ring_latency_us"].tolist() == pytest.approx([4.0, 4.0])
    assert rows["l1_hbm_share"].tolist() == pytest.approx([80 * 32.768 / 4096,
                                                           80 * 49.152 / 4096])
