"""Expert weights from a model's own projections (``ExpertWeights.from_projections``), bitwise the
kernels' layout that the seeded weights have; their contract, checked at construction and by
``FusedMoE`` before anything is allocated or launched."""
from __future__ import annotations

import pytest
import torch

from xstage_lab.ops.moe.op import FusedMoE
from xstage_lab.ops.moe.shapes import MoEContractError, MoEShape
from xstage_lab.ops.moe.weights import ExpertWeights, local_expert_weights

SHAPE = MoEShape("Tiny", "test", hidden=256, intermediate=128, routed_experts=4, top_k=2,
                 source="test")
I = SHAPE.intermediate


def _projections(w: ExpertWeights) -> dict:
    """``w``'s experts as a model holds them: gate and up ``[I, H]``, down ``[H, I]``, and for
    fp8 each one's 128 x 128 scales."""
    out = {"gate": w.w1[:, :I], "up": w.w1[:, I:], "down": w.w2}
    if w.precision == "fp8":
        sb = w.w1_scale.shape[1] // 2
        out.update(gate_scale=w.w1_scale[:, :sb], up_scale=w.w1_scale[:, sb:],
                   down_scale=w.w2_scale)
    return out


def _same(a: ExpertWeights, b: ExpertWeights) -> None:
    assert a.precision == b.precision
    for name in ("w1", "w2", "w1_scale", "w2_scale"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and x.is_contiguous() and not x.requires_grad, name
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_floating_projections_give_the_seeded_layout_bitwise(precision):
    """The seeded bf16 masters, as a model's projections (float32 here: cast back to the same
    bf16), give the weights ``local_expert_weights`` builds: stacked or as lists of parameters."""
    masters = local_expert_weights(SHAPE, 0, 1, "bf16", seed=5)
    want = local_expert_weights(SHAPE, 0, 1, precision, seed=5)
    p = {k: v.float() for k, v in _projections(masters).items()}
    _same(ExpertWeights.from_projections(p["gate"], p["up"], p["down"], precision), want)
    params = {k: [torch.nn.Parameter(t) for t in v] for k, v in p.items()}
    _same(ExpertWeights.from_projections(params["gate"], params["up"], params["down"],
                                         precision), want)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_projections_land_on_the_device_asked_for(precision):
    """``device`` moves each expert before it is cast or quantized: every stack is allocated
    there (the meta device here, as a GPU would be), the caller's tensors stay where they are."""
    p = _projections(local_expert_weights(SHAPE, 0, 1, "bf16", seed=5))
    w = ExpertWeights.from_projections(p["gate"], p["up"], p["down"], precision, device="meta")
    stacks = [w.w1, w.w2] + ([w.w1_scale, w.w2_scale] if precision == "fp8" else [])
    assert all(t.device.type == "meta" for t in stacks)
    assert [tuple(t.shape) for t in stacks[:2]] == [(4, 2 * I, SHAPE.hidden), (4, SHAPE.hidden, I)]
    assert p["gate"].device.type == "cpu"


def test_quantized_projections_are_taken_as_they_are():
    """e4m3 projections with their scales (a DeepSeek-V3 checkpoint's ``weight`` and
    ``weight_scale_inv``) land unchanged."""
    want = local_expert_weights(SHAPE, 0, 1, "fp8", seed=5)
    p = _projections(want)
    got = ExpertWeights.from_projections(p.pop("gate"), p.pop("up"), p.pop("down"), "fp8", **p)
    _same(got, want)


def _bad(change):
    p = _projections(local_expert_weights(SHAPE, 0, 1, "bf16", seed=5))
    kwargs = {"precision": "bf16"}
    change(p, kwargs)
    return p, kwargs


@pytest.mark.parametrize("change,message", [
    (lambda p, k: p.update(up=p["up"][:3]), "must hold the same experts"),
    (lambda p, k: p.update(gate=p["gate"][:0], up=p["up"][:0], down=p["down"][:0]),
     "at least one"),
    (lambda p, k: p.update({n: v.to(torch.int8) for n, v in p.items()}),
     "must be one of"),
    (lambda p, k: p.update(gate=p["gate"].float()), r"up\[0\] must be torch.float32"),
    (lambda p, k: p.update(up=p["up"][:, :64]), r"up\[0\] must be torch.bfloat16 \[128, 256\]"),
    (lambda p, k: p.update(down=p["down"].transpose(1, 2)), r"down\[0\] must be"),
    (lambda p, k: p.update(gate=p["gate"][:, None]), r"gate\[0\] must be \[I, H\]"),
    (lambda p, k: k.update(gate_scale=torch.ones(4, 1, 2)), "scales come with e4m3"),
    (lambda p, k: k.update(precision="fp4"), "precision must be one of"),
    (lambda p, k: p.update({n: v[:, :, :192] if n != "down" else v[:, :192] for n, v in p.items()})
     or k.update(precision="fp8"), "divisible by the scale block 128"),
])
def test_bad_projections_are_refused(change, message):
    p, kwargs = _bad(change)
    with pytest.raises(MoEContractError, match=message):
        ExpertWeights.from_projections(p["gate"], p["up"], p["down"], **kwargs)


@pytest.mark.parametrize("change,message", [
    (lambda p: p.pop("down_scale"), "e4m3 weights need precision='fp8' and"),
    (lambda p: p.update(gate_scale=p["gate_scale"][:, :, :1]),
     r"gate_scale\[0\] must be torch.float32 \[1, 2\]"),
    (lambda p: p.update(down_scale=p["down_scale"].double()), r"down_scale\[0\] must be"),
    (lambda p: p.update(up_scale=p["up_scale"][:3]), r"must hold the 4 experts, got \[4, 3, 4\]"),
])
def test_bad_quantized_projections_are_refused(change, message):
    p = _projections(local_expert_weights(SHAPE, 0, 1, "fp8", seed=5))
    change(p)
    with pytest.raises(MoEContractError, match=message):
        ExpertWeights.from_projections(p.pop("gate"), p.pop("up"), p.pop("down"), "fp8", **p)
    with pytest.raises(MoEContractError, match="e4m3 weights need precision='fp8'"):
        q = _projections(local_expert_weights(SHAPE, 0, 1, "fp8", seed=5))
        ExpertWeights.from_projections(q["gate"], q["up"], q["down"], "bf16")


def test_construction_checks_the_structure():
    w = local_expert_weights(SHAPE, 0, 1, "fp8", seed=5)
    with pytest.raises(MoEContractError, match="w1 must be a 3-D tensor"):
        ExpertWeights("bf16", w.w1[0], w.w2)
    with pytest.raises(MoEContractError, match=r"disagree: w1 \[4, 256, 256\], w2 \[4, 256, 64\]"):
        ExpertWeights("fp8", w.w1, w.w2[:, :, :64], w.w1_scale, w.w2_scale)
    with pytest.raises(MoEContractError, match="disagree"):
        ExpertWeights("fp8", w.w1, w.w2[:3], w.w1_scale, w.w2_scale)
    with pytest.raises(MoEContractError, match="fp8 weights take w1_scale and w2_scale"):
        ExpertWeights("fp8", w.w1, w.w2, w.w1_scale)
    with pytest.raises(MoEContractError, match="bf16 weights take no scales"):
        ExpertWeights("bf16", w.w1, w.w2, w.w1_scale, w.w2_scale)
    with pytest.raises(MoEContractError, match="precision must be one of"):
        ExpertWeights("int8", w.w1, w.w2)


@pytest.mark.parametrize("precision,change,message", [
    ("bf16", lambda w: ExpertWeights("bf16", w.w1.transpose(1, 2).contiguous().transpose(1, 2),
                                     w.w2), "w1 must be contiguous"),
    ("bf16", lambda w: ExpertWeights("bf16", w.w1.float(), w.w2), "w1 must be torch.bfloat16"),
    ("fp8", lambda w: ExpertWeights("fp8", w.w1, w.w2, w.w1_scale[:, :1].contiguous(),
                                    w.w2_scale), "w1_scale must be torch.float32"),
    ("fp8", lambda w: ExpertWeights("fp8", w.w1, w.w2, w.w1_scale, w.w2_scale.double()),
     "w2_scale must be torch.float32"),
])
def test_fused_moe_refuses_weights_its_kernels_cannot_read(precision, change, message):
    """Before this check a FusedMoE took a transposed view of Linear-1, or float32 weights, and
    its kernels read them by the shapes alone."""
    weights = change(local_expert_weights(SHAPE, 0, 1, precision, seed=5))
    with pytest.raises(MoEContractError, match=message):
        FusedMoE(weights, max_tokens=4, top_k=2)
