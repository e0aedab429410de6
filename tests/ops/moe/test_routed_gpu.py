"""The fused MoE call that routes itself (``routed``: ``routing="kernel"``) on a Hopper GPU
(skipped elsewhere): call after call, with calls over the routing launches between them, its
outputs and Combine rows equal those of a layer that routes by launches, bit for bit, and the
reference (an FP8 layer's tokens quantized in the kernel, bit for bit as by the routing); its
table, counts, row maps and quantized rows equal the host reference, and its row counters are
left zero; split Linear-2 tiles too; an eager call never synchronizes; one graph replays five
routings; an id out of range inside a graph raises the error flag; an EP rank routes its
received rows itself, e4m3 ones included. Not yet run on a GPU."""
from __future__ import annotations

import pytest
import torch

from tests.ops.moe.test_op_gpu import (SEED, SHAPES, _check, _check_unsynchronized, _inputs,
                                       _replay_routings, _user_graph)
from xstage_lab.ops.moe.routed import ROUTED_ARRIVALS, routed_mismatches
from xstage_lab.ops.moe.op import FusedMoE
from xstage_lab.ops.moe.table_reference import host_tables, table_mismatches
from xstage_lab.ops.moe.weights import local_expert_weights, quantize_rows_fp8

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper (sm_90) GPU")


def _layers(model: str, max_tokens: int, schedule: str,
            precision: str = "bf16") -> tuple[FusedMoE, FusedMoE]:
    """A layer that routes its calls itself and one that routes by launches, one weights."""
    shape = SHAPES[model]
    weights = local_expert_weights(shape, 0, 1, precision, seed=SEED, device="cuda")
    return tuple(FusedMoE(weights, max_tokens=max_tokens, top_k=shape.top_k, schedule=schedule,
                          routing=r) for r in ("kernel", "launch"))


def _routed_tables_match(layer: FusedMoE, x, ids) -> list[str]:
    """The tables a routed call writes (its schedule's, the row maps) against the host's."""
    ws = layer.workspace
    rows = x.repeat_interleave(layer.top_k, dim=0)
    xq, xs = quantize_rows_fp8(rows) if ws.weights.precision == "fp8" else (rows, None)
    host = host_tables(ws.bounds, ids.reshape(-1), xq, xs, top_k=layer.top_k)
    return routed_mismatches(table_mismatches(ws.tables, host), layer.schedule)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("schedule", ["wave", "interleaved"])
@pytest.mark.parametrize("model", ["DiT-MoE", "Qwen3.5", "DeepSeek-V4-Flash"])
def test_routed_calls_equal_the_launch_paths_call_after_call(model, schedule, precision):
    """Calls routed by the kernel (an FP8 layer's tokens quantized there, bitwise as the
    routing's) between calls routed by launches: the same bits as the layer that always
    launches, the reference, the host's tables, the counters left zero."""
    shape = SHAPES[model]
    most = ROUTED_ARRIVALS // shape.top_k  # the most tokens a call routes itself
    routed, launched = _layers(model, most + 1, schedule, precision)
    for i, tokens in enumerate((1, most, 1, most + 1, 2, 1)):
        x, ids, w = _inputs(tokens, 100 + i, ("balanced", "skewed")[i % 2], model)
        ys = []
        for layer in (routed, launched):
            layer.combine.fill_(float("nan"))
            ys.append(layer(x, ids, w))
        torch.cuda.synchronize()
        assert routed.workspace.routes_in_kernel(tokens * shape.top_k) == (tokens <= most)
        assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16)), (i, tokens)
        _check(routed, ys[0], x, ids, w, model)
        if tokens <= most:
            assert _routed_tables_match(routed, x, ids) == []
        assert int(routed.workspace.tables.routed_ready.count_nonzero()) == 0
    assert int(routed.error) == 0


def test_split_linear2_tiles_route_in_kernel():
    """DiT-MoE at one token: Linear-2 tiles split along K, routed by the kernel, the same bits."""
    routed, launched = _layers("DiT-MoE", 1, "wave")
    assert routed.workspace.bounds.l2_splits > 1
    for seed in range(3):
        x, ids, w = _inputs(1, seed, model="DiT-MoE")
        ys = [layer(x, ids, w) for layer in (routed, launched)]
        torch.cuda.synchronize()
        assert torch.equal(ys[0].view(torch.int16), ys[1].view(torch.int16))
        _check(routed, ys[0], x, ids, w, "DiT-MoE")
    assert int(routed.error) == 0


def test_a_routed_call_never_synchronizes_and_one_graph_replays_five_routings():
    routed, _ = _layers("DeepSeek-V4-Flash", 8, "wave")
    _check_unsynchronized(routed, 8)
    _replay_routings(routed, 8, range(20, 25))
    assert int(routed.error) == 0


def test_an_id_out_of_range_raises_the_flag_inside_a_routed_graph():
    """A graph of a routed call replayed with one id out of range: the flag counts it and the
    call goes on; replayed with valid ids again, the reference."""
    routed, _ = _layers("DeepSeek-V4-Flash", 4, "wave")
    x, ids, w = _inputs(4, 3)
    graph, y = _user_graph(routed, x, ids, w)
    good = ids.clone()
    ids[2, 1] = SHAPES["DeepSeek-V4-Flash"].routed_experts
    graph.replay()
    torch.cuda.synchronize()
    assert int(routed.error) == 1
    ids.copy_(good)
    y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(routed, y, x, good, w)
    assert int(routed.error) == 1


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_an_ep_rank_routes_its_received_rows_itself(precision):
    """One token's received rows on rank 0 of EP = 8 (e4m3 with their scales in FP8: nothing
    to quantize): the Combine rows of the routed call equal those of the launches, bit for
    bit, call after call."""
    from xstage_lab.experiments.moe.layer_cells import EP, Ep8RankCell
    from xstage_lab.ops.moe.unfused import GroupedWeights

    shape = SHAPES["DeepSeek-V4-Flash"]
    weights = local_expert_weights(shape, 0, EP, precision, seed=SEED, device="cuda")
    grouped = GroupedWeights("bf16", weights.w1, weights.w2) if precision == "bf16" else None
    cells = [Ep8RankCell(shape, precision, 1, weights, grouped, SEED, "cuda", routing=r)
             for r in ("kernel", "launch")]
    assert cells[0].routes_in_kernel() and not cells[1].routes_in_kernel()
    for _ in range(3):
        for cell in cells:
            for buffer in cell.buffers:
                buffer.fill_(float("nan"))
            cell.call()
        torch.cuda.synchronize()
        got, want = (torch.stack(c.buffers)[c.src, c.slot] for c in cells)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert int(cells[0].ws.error) == 0
    assert int(cells[0].ws.tables.routed_ready.count_nonzero()) == 0
