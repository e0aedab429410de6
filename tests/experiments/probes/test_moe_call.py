"""The call probe on CPU: its options refused before any CUDA work, its sequences and their
rotation; its own launches (kernels/moe_call_predecessors.py): ``straight_line``'s words in the
interpreter against the host's steps, poisoned first, and its sm_90 build straight-line code of
the size the probe rests on."""
from __future__ import annotations

import argparse
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.experiments.triton_testing import (assert_case_ok, child_main, child_results,
                                              interpreter_case_tests)
from xstage_lab.experiments import harness
from xstage_lab.experiments.probes import moe_call as mc

MODULE = "tests.experiments.probes.test_moe_call"


def case_straight_line(programs: int, steps: int) -> dict:
    from xstage_lab.kernel_sources import load_kernel_module

    k = load_kernel_module("moe_call_predecessors")
    words = torch.full((programs * mc.CODE_WIDTH,), -1, dtype=torch.int32)
    k.straight_line[(programs,)](words, mc.CODE_MULTIPLIER, STEPS=steps, WIDTH=mc.CODE_WIDTH)
    want = mc.code_words(programs, steps)
    assert (want != np.uint32(0xFFFFFFFF)).all()  # the poison is not an answer
    assert (words.numpy().view(np.uint32) == want).all()
    stores = torch.full((programs,), -1, dtype=torch.int32)
    k.one_store[(programs,)](stores)
    assert stores.tolist() == list(range(programs))
    return {}


def interpreter_cases() -> dict:
    return {"straight_line_3x5": (case_straight_line, 3, 5),
            "straight_line_1x1": (case_straight_line, 1, 1)}


def _compile_sm90() -> dict:
    import triton
    from triton.compiler import ASTSource

    from tests.experiments.triton_testing import hopper_target, sass_bytes
    from xstage_lab.kernel_sources import load_kernel_module

    kernel = load_kernel_module("moe_call_predecessors").straight_line
    signature = {"out": "*i32", "mul": "i32", "STEPS": "constexpr", "WIDTH": "constexpr"}
    compiled = triton.compile(ASTSource(kernel, signature, {(2,): mc.CODE_STEPS,
                                                            (3,): mc.CODE_WIDTH}),
                              target=hopper_target())
    return {"sass_bytes": sass_bytes(compiled.asm["cubin"], "straight_line"),
            "ptx": compiled.asm["ptx"]}


COMPILE_CASES = {"compile_sm90_straight_line": (_compile_sm90,)}

interpreter_results, test_interpreter_case = interpreter_case_tests(MODULE, interpreter_cases())


def test_straight_line_compiles_to_straight_code_of_the_size_it_claims():
    results = child_results(MODULE, "--compile-sm90", interpret=False, timeout=600)
    assert_case_ok(results, "compile_sm90_straight_line")
    detail = results["compile_sm90_straight_line"]["detail"]
    ptx = detail["ptx"]
    # the steps unrolled, none folded: one multiply by the launch argument each, no loop
    assert ptx.count("mul.lo.s32") >= mc.CODE_STEPS and not re.search(r"\bbra\b", ptx)
    assert detail["sass_bytes"] >= 64 * 1024


def _args(*argv: str) -> argparse.Namespace:
    """The experiment's command line parsed as ``harness`` parses it, unchecked."""
    return harness.parser(mc.EXPERIMENT).parse_args(["--root", "records", *argv])


def test_options_are_checked_before_any_launch():
    a = _args()
    mc.EXPERIMENT.check_args(a)
    assert a.tokens == [64] and a.repeats == 5 and a.sequences == list(mc.SEQUENCES)
    a = _args("--sequences", "code_all", "call")
    mc.EXPERIMENT.check_args(a)
    assert a.sequences == ["alone", "code_all", "call"]  # the ratios' base always timed
    for argv, message in [(("--models", "GPT-2"), "unknown model"),
                          (("--precisions", "fp4"), "unknown precision"),
                          (("--settings", "ep2"), "unknown setting"),
                          (("--tokens", "0"), ">= 1"), (("--repeats", "0"), ">= 1"),
                          (("--calls", "0"), ">= 1"),
                          (("--sequences", "alone", "warm"), "unknown sequence")]:
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
    before = SimpleNamespace(sms=3, idle=lambda n: cell.log.append(f"one_store x{n}"),
                             code=lambda: cell.log.append("straight_line"))
    seqs = mc.sequences(cell, before)
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
            "call": ["call"], "idle_one": ["one_store x1", "memset, kernel"],
            "idle_all": [f"one_store x{3 * mc.IDLE_PROGRAMS_PER_SM}", "memset, kernel"],
            "code_all": ["straight_line", "memset, kernel"]}
    for name, fn in seqs.items():
        cell.log.clear()
        fn()
        assert cell.log == want[name], name


def test_rounds_rotate_the_order():
    names = list(mc.SEQUENCES)
    orders = [mc.rotated(names, r) for r in range(len(names) + 1)]
    assert orders[0] == names and orders[-1] == names
    assert [o[0] for o in orders[:-1]] == names  # each sequence first once


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:], interpreter_cases(), COMPILE_CASES))


def _probe_rows(precision, over, model="M"):
    """One cell's rows of a probe record: ``alone`` and each sequence of ``over``."""
    base = dict(model=model, precision=precision, setting="ep1", tokens=8, p25_us=1.0,
                p75_us=1.0, sm_clock_mhz=1980.0)
    rows = [{**base, "sequence": "alone", "kernel_us": 100.0, "over_alone": 1.0}]
    return rows + [{**base, "sequence": s, "kernel_us": 100.0 * x, "over_alone": x}
                   for s, x in over.items()]


def test_the_records_spans_and_prose_name_each_builds_commit(tmp_path):
    from datetime import datetime, timezone

    import pandas as pd

    from xstage_lab.analysis.moe.call_probe import call_probe_records, sequence_spans
    from xstage_lab.prose.moe import call_probes
    from xstage_lab.records import write_record

    assert call_probe_records(tmp_path) == {}
    for minute, commit, code in ((0, "aaaaaaa1", 1.25), (1, "bbbbbbb2", 1.05)):
        rows = (_probe_rows("fp8", {"code_all": code, "call": 1.1, "routed": 1.2})
                + _probe_rows("fp8", {"code_all": 1.02, "call": 1.0, "routed": 1.0}, "N")
                + _probe_rows("fp8", {"code_all": 1.0304321, "call": 1.0, "routed": 1.0}, "O")
                + _probe_rows("bf16", {"code_all": 1.01}))
        write_record("moe_call_probe", "x", pd.DataFrame(rows), {}, {"git_commit": commit},
                     tmp_path, created=datetime(2026, 12, 4, 21, minute, tzinfo=timezone.utc))
    records = call_probe_records(tmp_path)["x"]
    spans = sequence_spans(records)
    assert list(spans["commit"].unique()) == ["aaaaaaa", "bbbbbbb"]
    fp8 = spans[(spans["precision"] == "fp8") & (spans["sequence"] == "code_all")]
    assert fp8["over_alone_max"].tolist() == [1.25, 1.05] and (spans["sequence"] != "alone").all()
    assert fp8["over_alone_min"].tolist() == [1.02, 1.02] and fp8["cells"].tolist() == [3, 3]
    assert fp8["over_alone_median"].tolist() == [1.0304321, 1.0304321]
    text = str(call_probes({"x": records}))
    assert ("(the kernel at `aaaaaaa`, 4 cells at 8 tokens), the fused kernel's time "
            "over its time right after itself: in the whole call, fp8 1.000–1.100×; after "
            "straight-line code on every SM, fp8 1.020–1.250×, bf16 1.010–1.010×.") in text
    assert "fp8 1.020–1.050×" in text and "routed" not in text
    from xstage_lab.plots import moe_call_probe_table

    shown = moe_call_probe_table(records)  # the notebook's table: the spans, rounded
    assert list(shown.columns) == list(spans.columns) and len(shown) == len(spans)
    assert shown["over_alone_median"].tolist() == spans["over_alone_median"].round(3).tolist()
    code = shown[(shown["sequence"] == "code_all") & (shown["precision"] == "fp8")]
    assert code["over_alone_median"].tolist() == [1.03, 1.03]
