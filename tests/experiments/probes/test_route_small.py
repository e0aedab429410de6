"""The routing probe on CPU: an EP rank's arrivals padded as ``route_to_tables`` takes them and
unpadded as the host reference does, bad options refused before any GPU is touched, and in the
interpreter its check of an FP8 cell's paths (the quantization in the first launch and apart)
against the host reference, outputs poisoned first."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from tests.experiments.triton_testing import child_main, interpreter_case_tests
from xstage_lab.experiments import harness
from xstage_lab.experiments.probes import route_small as rs
from xstage_lab.ops.moe.shapes import load_shapes

SHAPE = load_shapes()["Qwen3.5"]
MODULE = "tests.experiments.probes.test_route_small"


def case_fp8_paths_check(setting: str, tokens: int) -> dict:
    """The probe's own check (``RouteSmall.check``) of Hy3's FP8 cell on the CPU: every path's
    tables and quantized rows equal the host reference; the first launch's quantizing programs
    in one path, ``route_quantize``'s launch in the other."""
    probe = rs.RouteSmall()
    probe.device, probe.programs, probe.shapes = torch.device("cpu"), 8, load_shapes()
    paths = ["scan_in_histogram", "quantize_apart"]
    run = SimpleNamespace(args=SimpleNamespace(seed=3, paths=paths))
    step = probe.prepare({"model": "Hy3", "setting": setting, "precision": "fp8",
                          "tokens": tokens}, run)
    assert probe.check(step, run) == []
    routing = {path: step.tables[path].routing(setting != "ep1", True, step.arrivals
                                               .expert_ids.dtype) for path in paths}
    capacity = step.bounds.capacity if setting != "ep1" else step.arrivals.expert_ids.numel()
    assert [routing[p].quantized_first(capacity, step.arrivals.top_k) for p in paths] == \
        [True, False]
    return {"arrivals": int(step.arrivals.received["n_arrivals"]) if step.arrivals.received
            else step.arrivals.expert_ids.numel()}


def interpreter_cases() -> dict:
    # 96 picks at EP = 1; the rank's 4 tokens' received rows under a bound of 256
    return {"fp8_paths_ep1": (case_fp8_paths_check, "ep1", 12),
            "fp8_paths_ep_rank": (case_fp8_paths_check, "ep8_rank", 4)}


interpreter_results, test_interpreter_case = interpreter_case_tests(MODULE, interpreter_cases())


def test_ep1_arrivals_are_the_router_picks_and_their_token_rows():
    a = rs.cell_arrivals(SHAPE, "ep1", 3, 0, "cpu")
    assert a.expert_ids.shape == (3 * SHAPE.top_k,) and not a.received
    assert torch.equal(a.host_x[SHAPE.top_k], a.x[1])


def test_an_ep_ranks_arrivals_are_its_experts_picks_padded_to_the_capacity():
    a = rs.cell_arrivals(SHAPE, "ep8_rank", 4, 0, "cpu")
    n, e_loc = int(a.received["n_arrivals"]), SHAPE.routed_experts // rs.EP
    assert a.expert_ids.shape == (rs.EP * 4 * SHAPE.top_k,) and 0 < n < a.expert_ids.numel()
    assert bool((a.host_ids < e_loc).all()) and torch.equal(a.expert_ids[:n].long(), a.host_ids)
    src = a.host_received["arrival_src"]
    assert bool((src[1:] >= src[:-1]).all())  # source by source
    assert torch.equal(a.received["arrival_slot"][:n].long(), a.host_received["arrival_slot"])
    assert torch.equal(a.x[:n], a.host_x) and not a.x[n:].any()


@pytest.mark.parametrize("argv", [["--models", "Nope"], ["--settings", "ep4"],
                                  ["--tokens", "0"], ["--trials", "0"],
                                  ["--paths", "launches", "two_programs"],
                                  ["--precisions", "fp16"]])
def test_bad_options_are_refused_before_any_launch(argv, tmp_path):
    with pytest.raises((ValueError, SystemExit)):
        args = harness.parse(rs.EXPERIMENT, ["--out", str(tmp_path / "x.json"), *argv])
        rs.EXPERIMENT.check_args(args)


def test_quantizing_apart_is_a_path_of_fp8_cells_only():
    """In bf16 nothing quantizes, so ``quantize_apart`` would time ``scan_in_histogram`` again."""
    paths = list(rs.PATHS)
    assert rs.cell_paths(paths, "fp8") == paths
    assert rs.cell_paths(paths, "bf16") == [p for p in paths if p != "quantize_apart"]
    assert rs.PATHS["quantize_apart"]["quant_rows"] == 0
    assert {k: v for k, v in rs.PATHS["quantize_apart"].items() if k != "quant_rows"} == \
        {k: v for k, v in rs.PATHS["scan_in_histogram"].items() if k != "quant_rows"}


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:], interpreter_cases(), {}))
