"""The call probe on CPU: its options refused before any CUDA work, its sequences and their
rotation."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from xstage_lab.experiments.probes import moe_call as mc


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    mc.EXPERIMENT.add_arguments(p)
    return p.parse_args(list(argv))


def test_options_are_checked_before_any_launch():
    a = _args()
    mc.EXPERIMENT.check_args(a)
    assert a.tokens == [64] and a.repeats == 5
    for argv, message in [(("--models", "GPT-2"), "unknown model"),
                          (("--precisions", "fp4"), "unknown precision"),
                          (("--settings", "ep2"), "unknown setting"),
                          (("--tokens", "0"), ">= 1"), (("--repeats", "0"), ">= 1"),
                          (("--calls", "0"), ">= 1")]:
        with pytest.raises(ValueError, match=message):
            mc.EXPERIMENT.check_args(_args(*argv))


class _Buffer:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def view(self, dtype):
        assert dtype is torch.uint8
        return self

    def max(self):
        self.log.append(f"read {self.name}")


class _Cell:
    """Records the launches each sequence makes, in order."""

    def __init__(self):
        self.log = []
        b = {n: _Buffer(n, self.log) for n in ("wave", "inter", "n_wave", "n_inter", "origin",
                                                "slot", "src", "args", "xq", "xs")}
        tables = SimpleNamespace(tiles={"wave": b["wave"], "interleaved": b["inter"]},
                                 num_tiles={"wave": b["n_wave"], "interleaved": b["n_inter"]},
                                 row_origin=b["origin"], row_slot=b["slot"], row_src=b["src"],
                                 args=b["args"], x_quant=b["xq"], x_quant_scale=b["xs"])
        self.ws = SimpleNamespace(tables=tables)

    def route(self):
        self.log.append("route")

    def kernel(self, routed: bool = False):
        self.log.append("kernel after route" if routed else "memset, kernel")

    def call(self):
        self.log.append("call")


def test_each_sequence_launches_what_it_names(monkeypatch):
    cell = _Cell()
    monkeypatch.setattr(mc.torch.cuda, "synchronize", lambda: cell.log.append("sync"))
    seqs = mc.sequences(cell)
    assert tuple(seqs) == mc.SEQUENCES
    want = {"alone": ["memset, kernel"], "routed": ["route", "kernel after route"],
            "routed_memset": ["route", "memset, kernel"],
            "routed_idle": ["route", "sync", "kernel after route"],
            "read_all": ["route", *(f"read {n}" for n in ("wave", "inter", "n_wave", "n_inter",
                                                         "origin", "slot", "src", "args", "xq",
                                                         "xs")), "kernel after route"],
            "read_tiles": ["route", "read wave", "read inter", "read n_wave", "read n_inter",
                           "kernel after route"],
            "read_rows": ["route", "read origin", "read slot", "read src", "kernel after route"],
            "call": ["call"]}
    for name, fn in seqs.items():
        cell.log.clear()
        fn()
        assert cell.log == want[name], name


def test_rounds_rotate_the_order():
    names = list(mc.SEQUENCES)
    orders = [mc.rotated(names, r) for r in range(len(names) + 1)]
    assert orders[0] == names and orders[-1] == names
    assert [o[0] for o in orders[:-1]] == names  # each sequence first once
