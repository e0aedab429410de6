"""The routing probe on CPU: an EP rank's arrivals padded as ``route_to_tables`` takes them and
unpadded as the host reference does, and bad options refused before any GPU is touched."""
from __future__ import annotations

import pytest
import torch

from xstage_lab.experiments import harness
from xstage_lab.experiments.probes import route_small as rs
from xstage_lab.ops.moe.shapes import load_shapes

SHAPE = load_shapes()["Qwen3.5"]


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
                                  ["--paths", "launches", "two_programs"]])
def test_bad_options_are_refused_before_any_launch(argv, tmp_path):
    with pytest.raises((ValueError, SystemExit)):
        args = harness.parse(rs.EXPERIMENT, ["--out", str(tmp_path / "x.json"), *argv])
        rs.EXPERIMENT.check_args(args)
