"""The buffers a model's MoE layers share (``buffers.MoEBuffers``): what one set takes for every
model shape, as the README states it, sized without allocating (on the meta device); and what a
workspace asks the tile rule with."""
from __future__ import annotations

import pytest
import torch

from xstage_lab.ops.moe.buffers import MoEBuffers
from xstage_lab.ops.moe.op import MoEWorkspace
from xstage_lab.ops.moe.shapes import PRECISIONS, load_shapes
from xstage_lab.ops.moe.tiles import default_tile_config
from xstage_lab.ops.moe.weights import ExpertWeights

TOKENS = 8192
H200_SMS = 132
README_GIB = (0.15, 1.2)  # the README's span for one set at 8192 tokens


def _meta_weights(shape, precision: str) -> ExpertWeights:
    e, h, i = shape.routed_experts, shape.hidden, shape.intermediate
    dtype = torch.bfloat16 if precision == "bf16" else torch.float8_e4m3fn
    scales = ((torch.empty(e, 2 * i // 128, h // 128, device="meta"),
               torch.empty(e, h // 128, i // 128, device="meta")) if precision == "fp8" else ())
    return ExpertWeights(precision, torch.empty(e, 2 * i, h, dtype=dtype, device="meta"),
                         torch.empty(e, h, i, dtype=dtype, device="meta"), *scales)


def _buffers(shape, precision: str) -> MoEBuffers:
    """A FusedMoE's buffers for ``TOKENS`` tokens on an H200 (its gluon_ws tiles, one program
    per SM)."""
    return MoEWorkspace(_meta_weights(shape, precision), TOKENS * shape.top_k,
                        config=default_tile_config(precision, "gluon_ws", hidden=shape.hidden),
                        num_programs=H200_SMS, source_rows=TOKENS, combine_rows=True).buffers


def test_one_set_takes_what_the_readme_says():
    gib = {(m, p): _buffers(s, p).nbytes / 2**30 for m, s in load_shapes().items()
           for p in PRECISIONS}
    lo, hi = README_GIB
    assert lo <= round(min(gib.values()), 2) and round(max(gib.values()), 1) <= hi, gib


@pytest.mark.parametrize("precision", PRECISIONS)
def test_nbytes_counts_every_buffer(precision):
    """The Combine rows and ``h`` (and its scales) are most of it; the rest is the tables."""
    shape = load_shapes()["DiT-MoE"]
    b = _buffers(shape, precision)
    rows, fp8 = b.sizes.bounds.rows, precision == "fp8"
    big = (TOKENS * shape.top_k * shape.hidden * 2 + rows * shape.intermediate * (1 if fp8 else 2)
           + (rows * shape.intermediate // 128 * 4 if fp8 else 0))
    assert big < b.nbytes < big * 1.2


def test_workspace_picks_its_tiles_by_its_weights_hidden_size(monkeypatch):
    """A workspace asks the tile rule (``tiles.ws_tile_rows``) with its rows an expert and its
    weights' hidden size, which decides DiT-MoE's height (128-wide Linear-2 tiles at 1408)."""
    import xstage_lab.ops.moe.op as op

    asked = []
    monkeypatch.setattr(op, "ws_tile_rows", lambda *a: asked.append(a) or 128)
    for model in ("DiT-MoE", "Qwen3.5"):
        shape = load_shapes()[model]
        MoEWorkspace(_meta_weights(shape, "bf16"), TOKENS * shape.top_k, num_programs=H200_SMS)
    dit, qwen = load_shapes()["DiT-MoE"], load_shapes()["Qwen3.5"]
    assert asked == [("bf16", TOKENS * s.top_k / s.routed_experts, s.hidden) for s in (dit, qwen)]
