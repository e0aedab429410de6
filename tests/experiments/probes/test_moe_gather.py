"""The gather probe on CPU: its options refused before any CUDA work, and the committed kernel's
arguments mapped onto the contract before the gather (``tma_arguments``)."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from xstage_lab.experiments import harness
from xstage_lab.experiments.probes import moe_gather as mg
from xstage_lab.kernel_sources import kernel_path


def _args(*argv: str) -> argparse.Namespace:
    """The experiment's command line parsed as ``harness`` parses it, unchecked."""
    return harness.parser(mg.EXPERIMENT).parse_args(["--root", "records", *argv])


def test_options_are_checked_before_any_launch(tmp_path):
    a = _args("--variant", f"copy={kernel_path('moe_fused_ws.py')}")
    mg.EXPERIMENT.check_args(a)
    assert list(a.variants) == ["copy"] and a.kernel == "gluon_ws" and a.schedule == "wave"
    assert _args("--schedule", "interleaved").schedule == "interleaved"
    with pytest.raises(SystemExit):
        _args("--schedule", "fenced")
    for argv, message in [(("--variant", f"tma={kernel_path('moe_fused_ws.py')}"), "taken"),
                          (("--variant", f"in_place={kernel_path('moe_fused_ws.py')}"), "taken"),
                          (("--variant", f"scales_in_place={kernel_path('moe_fused_ws.py')}"),
                           "taken"),
                          (("--tma-kernel", str(tmp_path / "none.py")), "no file"),
                          (("--models", "GPT-2"), "unknown model"),
                          (("--tokens", "0"), ">= 1"),
                          (("--setting", "ep1", "--schedule", "wave"), "own schedule"),
                          (("--setting", "ep1", "--routing", "skewed"), "balanced"),
                          (("--setting", "ep1", "--tma-kernel", str(kernel_path("moe_fused_ws.py"))),
                           "no --tma-kernel")]:
        with pytest.raises(ValueError, match=message):
            mg.EXPERIMENT.check_args(_args(*argv))
    ep1 = _args("--setting", "ep1")
    mg.EXPERIMENT.check_args(ep1)
    assert ep1.schedule is None  # the layer's own, as layer_bench's EP = 1 cell


def test_argument_positions_name_the_kernels_parameters():
    from xstage_lab.kernel_sources import load_kernel_module
    names = load_kernel_module("moe_fused_ws").moe_fused_ws_kernel.arg_names
    assert [names[i] for i in (mg.TILES, mg.A_ROWS, mg.ROW_ORIGIN, mg.ROW_SLOT)] == \
        ["tiles", "a_rows", "row_origin", "row_slot"]


def test_tma_arguments_put_the_layout_rows_where_the_old_contract_reads_them(monkeypatch):
    monkeypatch.setattr(mg, "_ws_descriptor", lambda t, block: ("desc", t, tuple(block)))
    h_desc = SimpleNamespace(block_shape=[64, 128])
    args = ("tiles", "num", 9, "a_rows", "origin", "w1_desc", h_desc, "w2_desc", "w1_scale",
            "w2_scale", "h", "h_scale", "ready", "src", "slot", "peers", "error", "spin")
    x, x_scale = torch.zeros(2, 8), torch.ones(2, 1)
    layout = SimpleNamespace(x=x, x_scale=x_scale)
    out = mg.tma_arguments(args, layout)
    assert out[:3] == args[:3] and out[3] == ("desc", x, (64, 128))
    assert out[4:7] == ("w1_desc", h_desc, "w2_desc") and out[7] is x_scale
    assert out[8:] == args[8:]
    # bf16: the error flag stands in for the scales, as kernel_launch passes it
    assert mg.tma_arguments(args, SimpleNamespace(x=x, x_scale=None))[7] == "error"
