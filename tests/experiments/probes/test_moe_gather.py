"""The gather probe on CPU: its options refused before any CUDA work, and the committed kernel's
arguments mapped onto the contract before the gather (``tma_arguments``)."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from xstage_lab.experiments.probes import moe_gather as mg
from xstage_lab.kernel_sources import kernel_path


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    mg.EXPERIMENT.add_arguments(p)
    return p.parse_args(list(argv))


def test_options_are_checked_before_any_launch(tmp_path):
    a = _args("--variant", f"copy={kernel_path('moe_fused_ws.py')}")
    mg.EXPERIMENT.check_args(a)
    assert list(a.variants) == ["copy"] and a.kernel == "gluon_ws" and a.schedule == "wave"
    assert _args("--schedule", "interleaved").schedule == "interleaved"
    with pytest.raises(SystemExit):
        _args("--schedule", "fenced")
    for argv, message in [(("--variant", f"tma={kernel_path('moe_fused_ws.py')}"), "taken"),
                          (("--variant", f"in_place={kernel_path('moe_fused_ws.py')}"), "taken"),
                          (("--tma-kernel", str(tmp_path / "none.py")), "no file"),
                          (("--models", "GPT-2"), "unknown model"),
                          (("--tokens", "0"), ">= 1")]:
        with pytest.raises(ValueError, match=message):
            mg.EXPERIMENT.check_args(_args(*argv))


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
