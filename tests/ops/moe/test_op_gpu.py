"""``FusedMoE`` and the device tables on a Hopper GPU (skipped elsewhere: CI has no GPU): the
tables equal the host reference, an eager call runs under ``set_sync_debug_mode("error")``, one
CUDA graph replayed with five routings matches the reference each time, and
``torch.compile(fullgraph=True)`` of a block (router, FusedMoE, residual) matches eager."""
from __future__ import annotations

import pytest
import torch

from xstage_lab.experiments.moe.bench import TOLERANCE
from xstage_lab.ops.moe.device_tables import host_tables, table_mismatches
from xstage_lab.ops.moe.op import FusedMoE
from xstage_lab.ops.moe.reference import reference_moe
from xstage_lab.ops.moe.routing import router_logits, router_topk
from xstage_lab.ops.moe.shapes import PRECISIONS, load_shapes
from xstage_lab.ops.moe.weights import local_expert_weights, quantize_rows_fp8

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper (sm_90) GPU")

SHAPES = load_shapes()
MODEL = "DeepSeek-V4-Flash"
SEED = 5


@pytest.fixture(scope="module", params=PRECISIONS)
def layer(request):
    weights = local_expert_weights(SHAPES[MODEL], 0, 1, request.param, seed=SEED, device="cuda")
    return FusedMoE(weights, max_tokens=256, top_k=SHAPES[MODEL].top_k, schedule="wave")


def _inputs(tokens: int, seed: int, routing: str = "balanced"):
    shape = SHAPES[MODEL]
    g = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(tokens, shape.hidden, generator=g, device="cuda").to(torch.bfloat16)
    ids, w = router_topk(router_logits(tokens, shape.routed_experts, routing, seed=seed,
                                       device="cuda"), shape.top_k)
    return x, ids, w


def _check(layer: FusedMoE, y, x, ids, w):
    precision = layer.workspace.weights.precision
    for kind, ref in reference_moe(x, ids, w, SHAPES[MODEL], seed=SEED,
                                   precision=precision).items():
        err = float((y.float() - ref).norm() / ref.norm())
        assert err <= TOLERANCE[precision][kind], (kind, err)


@pytest.mark.parametrize("tokens,routing", [(1, "balanced"), (37, "skewed"), (256, "balanced")])
def test_device_tables_equal_the_host_reference(layer, tokens, routing):
    x, ids, w = _inputs(tokens, tokens, routing)
    layer.combine.fill_(float("nan"))
    y = layer(x, ids, w)
    ws, k = layer.workspace, SHAPES[MODEL].top_k
    rows = x.repeat_interleave(k, dim=0)
    xq, xs = quantize_rows_fp8(rows) if ws.weights.precision == "fp8" else (rows, None)
    assert table_mismatches(ws.tables, host_tables(ws.bounds, ids.reshape(-1), xq, xs)) == []
    _check(layer, y, x, ids, w)
    assert int(layer.error) == 0


def test_an_eager_call_never_synchronizes(layer):
    x, ids, w = _inputs(64, 1)
    layer(x, ids, w)  # compiled and warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = layer(x, ids, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _check(layer, y, x, ids, w)


def test_one_graph_replays_five_routings(layer):
    x, ids, w = _inputs(64, 2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x, ids, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x, ids, w)
    for i in range(5):
        nx, nids, nw = _inputs(64, 10 + i, ("balanced", "skewed")[i % 2])
        x.copy_(nx)
        ids.copy_(nids)
        w.copy_(nw)
        y.fill_(float("nan"))
        layer.combine.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(layer, y, nx, nids, nw)
    assert int(layer.error) == 0


def test_compiled_block_matches_eager(layer):
    shape = SHAPES[MODEL]

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(shape.hidden, shape.routed_experts,
                                          dtype=torch.bfloat16, device="cuda")
            self.moe = layer

        def forward(self, x):
            ids, w = router_topk(self.router(x), shape.top_k)
            return x + self.moe(x, ids, w)

    block = Block()
    x = _inputs(48, 3)[0]
    with torch.no_grad():  # an inference forward (DiT): the op has no backward
        eager = block(x)
        compiled = torch.compile(block, fullgraph=True)(x)
    torch.testing.assert_close(compiled.float(), eager.float(), rtol=2e-2, atol=2e-2)
