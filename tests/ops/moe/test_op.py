"""``FusedMoE`` on the CPU: the whole call (device tables, the Triton kernel, the weighted sum) in
the interpreter against the float32 reference in both precisions and schedules, successive calls
on new tensors (int32 ids and bf16 weights among them) each against its own reference, an id out
of range raising the error flag instead of writing; input errors raised before launch; the custom
op's fake implementation traced by ``torch.compile(fullgraph=True)`` in a block (router,
FusedMoE, residual) on FakeTensors; a call autograd records going through the custom op, whose
backward raises; a model's own experts (``nn.Linear`` projections) against
the model's forward; two layers on one set of buffers, and sizes that cannot share refused."""
from __future__ import annotations

import sys

import pytest
import torch

from tests.experiments.triton_testing import child_main, interpreter_case_tests
from xstage_lab.experiments.moe.bench import TOLERANCE
from xstage_lab.kernel_sources import load_kernel_module
from xstage_lab.ops.moe.combine import local_combine_peers
from xstage_lab.ops.moe import op
from xstage_lab.ops.moe.op import FusedMoE, MoEWorkspace
from xstage_lab.ops.moe.reference import reference_moe
from xstage_lab.ops.moe.routing import router_logits, router_topk
from xstage_lab.ops.moe.shapes import MoEContractError, MoEShape
from xstage_lab.ops.moe.tiles import default_tile_config
from xstage_lab.ops.moe.weights import ExpertWeights, local_expert_weights, quantize_rows_fp8

TINY = MoEShape("Tiny", "test", hidden=256, intermediate=256, routed_experts=8, top_k=2,
                source="test")
MODULE = "tests.ops.moe.test_op"


def _layer(precision: str, schedule: str = "auto", max_tokens: int = 16) -> FusedMoE:
    weights = local_expert_weights(TINY, 0, 1, precision, seed=3)
    return FusedMoE(weights, max_tokens=max_tokens, top_k=TINY.top_k, schedule=schedule)


def _inputs(tokens: int, seed: int = 0):
    x = torch.randn(tokens, TINY.hidden, generator=torch.Generator().manual_seed(seed))
    logits = router_logits(tokens, TINY.routed_experts, "skewed", seed=seed)
    ids, w = router_topk(logits, TINY.top_k)
    return x.to(torch.bfloat16), ids, w


def case_matches_reference(precision: str, schedule: str) -> dict:
    """Three routings through one layer (the later ones reuse every buffer), each within issue
    18's tolerance of the reference; nothing flagged. The third's arrivals are above
    ``route_tiny``'s bound: the three launches, in FP8 the scales laid out by layout row."""
    layer = _layer(precision, schedule, max_tokens=40)
    assert 40 * TINY.top_k > layer.workspace.tables.tiny_arrivals
    errors = []
    for tokens, seed in ((11, 0), (5, 1), (40, 2)):
        x, ids, w = _inputs(tokens, seed)
        y = layer(x, ids, w)
        refs = reference_moe(x, ids, w, TINY, seed=3, precision=precision)
        for kind, ref in refs.items():
            err = float((y.float() - ref).norm() / ref.norm())
            assert err <= TOLERANCE[precision][kind], (tokens, kind, err)
            errors.append(err)
    assert int(layer.error) == 0
    return {"max_error": max(errors)}


def case_successive_calls_read_their_own_tensors() -> dict:
    """Three calls at one T on tensors at new addresses (int64 ids with fp32 weights twice, then
    int32 ids with bf16 weights), the Combine buffer poisoned with NaN before each: each output
    within tolerance of the reference of its own inputs, and left alone by the later calls (the
    kernels read this call's tensors from the argument block)."""
    layer = _layer("bf16", "interleaved")
    outputs, errors = [], []
    for seed, id_dtype, weight_dtype in ((0, torch.int64, torch.float32),
                                         (1, torch.int64, torch.float32),
                                         (2, torch.int32, torch.bfloat16)):
        x, ids, w = _inputs(6, seed)
        ids, w = ids.to(id_dtype), w.to(weight_dtype)
        layer.combine.fill_(float("nan"))
        y = layer(x, ids, w)
        for kind, ref in reference_moe(x, ids, w, TINY, seed=3, precision="bf16").items():
            err = float((y.float() - ref).norm() / ref.norm())
            assert err <= TOLERANCE["bf16"][kind], (seed, kind, err)
            errors.append(err)
        outputs.append((y, y.clone()))
    assert len({y.data_ptr() for y, _ in outputs}) == len(outputs)
    for y, kept in outputs:
        assert torch.equal(y.view(torch.int16), kept.view(torch.int16))
    assert int(layer.error) == 0
    return {"max_error": max(errors)}


def case_out_of_range_id_flags_and_writes_nothing_outside() -> dict:
    """Called past ``forward``'s host check: the bad pick is counted on the device and gets no row;
    the other tokens' outputs stay right."""
    layer = _layer("bf16")
    x, ids, w = _inputs(4)
    ids[2, 1] = TINY.routed_experts + 3
    y = layer.run(x, ids, w, layer.schedule)
    assert int(layer.error) == 1
    good = [0, 1, 3]
    ref = reference_moe(x[good], ids[good], w[good], TINY, seed=3, precision="bf16")["fp32"]
    err = float((y[good].float() - ref).norm() / ref.norm())
    assert err <= TOLERANCE["bf16"]["fp32"]
    return {"error": int(layer.error)}


def case_layers_sharing_buffers_keep_their_own_results() -> dict:
    """Two layers of other weights on one set of buffers, called in turn (at token counts through
    ``route_tiny`` and through the three launches, FP8 quantizing into the shared copy), the
    Combine rows poisoned before each call: each output within tolerance of its own weights'
    reference, the earlier outputs left alone."""
    first = _layer("fp8", max_tokens=40)
    second = FusedMoE(local_expert_weights(TINY, 0, 1, "fp8", seed=4), max_tokens=40,
                      top_k=TINY.top_k, buffers=first.moe_buffers)
    assert second.moe_buffers is first.moe_buffers and second.combine is first.combine
    outputs, errors = [], []
    for layer, seed, tokens in ((first, 3, 11), (second, 4, 40), (first, 3, 40), (second, 4, 5)):
        x, ids, w = _inputs(tokens, seed + tokens)
        first.combine.fill_(float("nan"))
        y = layer(x, ids, w)
        for kind, ref in reference_moe(x, ids, w, TINY, seed=seed, precision="fp8").items():
            err = float((y.float() - ref).norm() / ref.norm())
            assert err <= TOLERANCE["fp8"][kind], (seed, tokens, kind, err)
            errors.append(err)
        outputs.append((y, y.clone()))
    for y, kept in outputs:
        assert torch.equal(y.view(torch.int16), kept.view(torch.int16))
    assert int(first.error) == 0
    return {"max_error": max(errors)}


class SwiGLUExpert(torch.nn.Module):
    """One expert as a model writes it (Qwen3-MoE, DeepSeek-V3): ``down(silu(gate(x)) *
    up(x))``."""

    def __init__(self, hidden: int, inter: int, generator: torch.Generator):
        super().__init__()
        self.gate_proj, self.up_proj = (torch.nn.Linear(hidden, inter, bias=False)
                                        for _ in range(2))
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            torch.nn.init.normal_(lin.weight, std=lin.in_features ** -0.5, generator=generator)

    def forward(self, x):
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def case_model_experts_match_their_module() -> dict:
    """A model's own experts (float32 ``nn.Linear`` parameters) through
    ``ExpertWeights.from_projections`` into a FusedMoE, in each precision: within issue 18's
    tolerance of the model's float32 forward of each pick, weighted and summed; nothing
    flagged."""
    g = torch.Generator().manual_seed(7)
    experts = torch.nn.ModuleList(SwiGLUExpert(TINY.hidden, TINY.intermediate, g)
                                  for _ in range(TINY.routed_experts))
    x, ids, w = _inputs(9, seed=4)
    with torch.no_grad():
        ref = sum(w[:, j, None] * torch.stack([experts[int(e)](x[t].float())
                                               for t, e in enumerate(ids[:, j])])
                  for j in range(TINY.top_k))
    errors = {}
    for precision in ("bf16", "fp8"):
        weights = ExpertWeights.from_projections(
            *([getattr(m, f"{n}_proj").weight for m in experts] for n in ("gate", "up", "down")),
            precision)
        layer = FusedMoE(weights, max_tokens=16, top_k=TINY.top_k)
        y = layer(x, ids, w)
        errors[precision] = float((y.float() - ref).norm() / ref.norm())
        assert errors[precision] <= TOLERANCE[precision]["fp32"], (precision, errors)
        assert int(layer.error) == 0
    return errors


def interpreter_cases() -> dict:
    # each precision under one schedule, each schedule once (the tables of both are compared
    # with the host reference entry for entry in test_device_tables)
    cases = {f"{p}_{s}": (case_matches_reference, p, s)
             for p, s in (("bf16", "wave"), ("fp8", "interleaved"))}
    cases["successive_calls"] = (case_successive_calls_read_their_own_tensors,)
    cases["out_of_range_id"] = (case_out_of_range_id_flags_and_writes_nothing_outside,)
    cases["model_experts"] = (case_model_experts_match_their_module,)
    cases["shared_buffers"] = (case_layers_sharing_buffers_keep_their_own_results,)
    return cases


interpreter_results, test_interpreter_case = interpreter_case_tests(MODULE, interpreter_cases())


@pytest.mark.parametrize("change,message", [
    (lambda x, ids, w: (x.float(), ids, w), "x must be bf16"),
    (lambda x, ids, w: (x[:, :128], ids, w), "x must be bf16"),
    (lambda x, ids, w: (x, ids.float(), w), "topk_ids must be int32 or int64"),
    (lambda x, ids, w: (x, ids[:, :1], w), "topk_ids must be"),
    (lambda x, ids, w: (x, ids, w[:2]), "topk_weights must be"),
    (lambda x, ids, w: (x, ids, w.to(torch.float8_e4m3fn)), "topk_weights must be"),
    (lambda x, ids, w: (x, ids.clamp(max=TINY.routed_experts - 1) + 1, w), "expert ids must lie"),
    (lambda x, ids, w: (x, ids - 1, w), "expert ids must lie"),
    (lambda x, ids, w: (x, ids, w.to("meta")), "topk_weights on meta"),
    (lambda x, ids, w: (torch.cat([x] * 5), torch.cat([ids] * 5), torch.cat([w] * 5)),
     "T=20 tokens above max_tokens=16"),
    (lambda x, ids, w: (torch.cat([x.reshape(-1)[:1], x.reshape(-1)])[1:].view(x.shape), ids, w),
     "x must start 16-byte aligned"),
])
def test_bad_input_is_refused_before_launch(change, message):
    layer = _layer("bf16")
    with pytest.raises(MoEContractError, match=message):
        layer(*change(*_inputs(4)))
    assert int(layer.error) == 0 and (layer.workspace.tables.meta == 0).all()  # nothing ran


def test_an_empty_batch_gives_an_empty_output_and_launches_nothing():
    """T = 0 (an EP rank's batch that got no tokens): an empty bf16 ``y``, the ids' check
    (``check_ids``) passed over, nothing launched, eagerly and through the custom op."""
    layer = FusedMoE(local_expert_weights(TINY, 0, 1, "bf16", seed=3), max_tokens=16,
                     top_k=TINY.top_k, check_ids=True)
    x, ids, w = (t[:0] for t in _inputs(4))
    for args in ((x, ids, w), (x.clone().requires_grad_(), ids, w)):
        y = layer(*args)
        assert y.shape == (0, TINY.hidden) and y.dtype == torch.bfloat16
    assert int(layer.error) == 0 and (layer.workspace.tables.meta == 0).all()


def test_a_model_printout_names_the_layer():
    text = repr(torch.nn.Sequential(_layer("fp8", "interleaved")))
    assert ("FusedMoE(experts=8, hidden=256, intermediate=256, top_k=2, precision=fp8, "
            "max_tokens=16, schedule=interleaved, kernel=triton, weighted_sum=auto)") in text


def test_bad_construction_is_refused():
    weights = local_expert_weights(TINY, 0, 1, "bf16", seed=3)
    with pytest.raises(MoEContractError, match="schedule must be one of"):
        FusedMoE(weights, max_tokens=4, top_k=2, schedule="fastest")
    with pytest.raises(MoEContractError, match="top_k=9"):
        FusedMoE(weights, max_tokens=4, top_k=9)
    with pytest.raises(MoEContractError, match="weighted_sum must be one of"):
        FusedMoE(weights, max_tokens=4, top_k=2, weighted_sum="fused")
    with pytest.raises(MoEContractError, match="needs the gluon_ws kernel, not triton"):
        FusedMoE(weights, max_tokens=4, top_k=2, weighted_sum="kernel")
    with pytest.raises(MoEContractError, match="'atomic' needs the gluon_ws kernel, not triton"):
        FusedMoE(weights, max_tokens=4, top_k=2, weighted_sum="atomic")


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_the_kernel_ends_with_the_weighted_sum_where_one_pass_covers_the_tokens(
        precision, monkeypatch):
    """``weighted_sum="kernel"`` (gluon_ws, built here, never launched): up to one piece of
    ``SUM_COLS`` columns a program (Tiny's 256 columns: one a token; four programs), the fused
    launch takes the sum over the call's argument block (the Combine rows', weights' and
    output's slots) or the block it is given, the layer's arrivals, the tokens, the picks and
    the weights' dtype; beyond, and with ``"launch"``, none."""
    weights = local_expert_weights(TINY, 0, 1, precision, seed=3)
    config = default_tile_config(precision, "gluon_ws", hidden=TINY.hidden)
    layer = FusedMoE(weights, max_tokens=8, top_k=TINY.top_k, config=config, num_programs=4,
                     weighted_sum="kernel")
    assert [layer.sums_in_kernel(t) for t in (1, 4, 5, 8)] == [True, True, False, False]
    apart = FusedMoE(weights, max_tokens=8, top_k=TINY.top_k, config=config, num_programs=4,
                     weighted_sum="launch")
    assert not apart.sums_in_kernel(1)
    launched = []
    monkeypatch.setattr(layer.workspace, "launch",
                        lambda schedule, peers, **kw: launched.append(kw["weighted_sum"]))
    layer.fused_kernel(3, torch.float32, "wave", routed=True)
    own = torch.zeros(3, dtype=torch.int64)
    layer.fused_kernel(4, torch.bfloat16, "wave", sum_args=own)
    layer.fused_kernel(5, torch.float32, "wave")
    summed, given, beyond = launched
    args = layer.workspace.tables.args
    assert summed.args.data_ptr() == args[3:].data_ptr() and summed.args.shape == (3,)
    assert summed.arrivals is layer.moe_buffers.sum_arrivals and summed.arrivals.item() == 0
    assert (summed.tokens, summed.top_k, summed.weight_dtype) == (3, 2, torch.float32)
    assert given.args is own and given.weight_dtype == torch.bfloat16 and beyond is None


def test_the_atomic_sum_adds_in_the_kernel_after_the_first_launch_zeroes_the_output(monkeypatch):
    """``weighted_sum="atomic"`` (gluon_ws, built here, never launched): up to
    ``ATOMIC_SUM_TOKENS`` (here 40), a call's fused launch takes the atomic sum over the call's
    block, and its first routing launch, ``route_tiny`` up to ``tiny_arrivals`` picks (Tiny's
    top-2, 32 tokens) and ``route_histogram`` beyond, has one program more per ``ZERO_BLOCK`` of
    the output's elements (``[T, H]``) that zeroes it; beyond, the sum's own launch and the
    routing of a layer without the atomic sum."""
    monkeypatch.setattr(op, "ATOMIC_SUM_TOKENS", 40)
    weights = local_expert_weights(TINY, 0, 1, "bf16", seed=3)
    config = default_tile_config("bf16", "gluon_ws", hidden=TINY.hidden)
    layer, plain = (FusedMoE(weights, max_tokens=48, top_k=TINY.top_k, config=config,
                             num_programs=4, weighted_sum=s) for s in ("atomic", "launch"))
    tiny = layer.workspace.tables.tiny_arrivals // TINY.top_k
    assert [layer.sums_in_kernel(t) for t in (1, tiny, tiny + 1, 40, 41)] == [True] * 4 + [False]
    block = load_kernel_module("moe_routing").ZERO_BLOCK.value
    for tokens in (3, tiny + 1, 40, 41):
        routing, base = (m.routing(torch.int32, tokens) for m in (layer, plain))
        assert routing.zeroed_hidden == (TINY.hidden if tokens <= 40 else 0)
        (launch, (grid,)), (first, (base_grid,)) = (
            r.first(tokens * TINY.top_k, TINY.top_k) for r in (routing, base))
        assert launch.fn is first.fn
        assert launch.fn.__name__ == ("route_tiny" if tokens <= tiny else "route_histogram")
        assert bool(launch.static.get("ZERO_OUT")) == (tokens <= 40)
        assert grid - base_grid == (-(-tokens * TINY.hidden // block) if tokens <= 40 else 0)
    launched = []
    monkeypatch.setattr(layer.workspace, "launch",
                        lambda schedule, peers, **kw: launched.append(kw["weighted_sum"]))
    layer.fused_kernel(3, torch.float32, "wave", routed=True)
    layer.fused_kernel(40, torch.float32, "wave")
    layer.fused_kernel(41, torch.float32, "wave")
    summed, most, beyond = launched
    assert summed.atomic and most.atomic and summed.top_k == 2 and beyond is None


@pytest.mark.parametrize("change,message", [
    ({"max_tokens": 32}, "capacity 32 where the layer needs 64"),
    ({"lead_rows": 5}, "lead_rows 1 where the layer needs 5"),
    ({"top_k": 1, "max_tokens": 32}, "source_rows 16 where the layer needs 32"),
    ({"precision": "fp8"}, "precision bf16 where the layer needs fp8"),
    ({"shape": MoEShape("Wide", "test", hidden=512, intermediate=256, routed_experts=8, top_k=2,
                        source="test")}, "hidden 256 where the layer needs 512"),
])
def test_buffers_are_shared_only_where_they_fit(change, message):
    """Sizes that differ anywhere are refused before anything is launched, each named."""
    first = _layer("bf16")
    shape = change.get("shape", TINY)
    weights = local_expert_weights(shape, 0, 1, change.get("precision", "bf16"), seed=4)
    with pytest.raises(MoEContractError, match=message):
        FusedMoE(weights, max_tokens=change.get("max_tokens", 16), top_k=change.get("top_k", 2),
                 lead_rows=change.get("lead_rows"), buffers=first.moe_buffers)
    assert int(first.error) == 0 and (first.workspace.tables.meta == 0).all()


def test_a_layer_keeps_torchs_module_interface():
    """``buffers()`` stays ``torch.nn.Module``'s (the layer's own are ``moe_buffers``): PyTorch's
    tools call it on every module (``make_graphed_callables``, ``torch.export``)."""
    layer = _layer("bf16")
    assert list(layer.buffers()) == [] and list(torch.nn.Sequential(layer).buffers()) == []


def test_autograd_records_a_call_through_the_custom_op_whose_backward_raises(monkeypatch):
    """Where grad mode records ``x`` or ``topk_weights`` the call goes through
    ``xstage::fused_moe``: ``y`` has a backward, which raises (the op has no autograd formula),
    where the plain call's ``y`` would have no history and leave the layer out of the gradients.
    Without such an input, under ``torch.no_grad`` and in inference mode, the plain call. No
    kernel runs here: ``run`` stands in, counting its calls."""
    layer = _layer("bf16")
    runs = []
    monkeypatch.setattr(layer, "run", lambda x, ids, w, schedule: runs.append(schedule) or
                        torch.full_like(x, float("nan")))
    x, ids, w = _inputs(4)
    for args in ((x.clone().requires_grad_(), ids, w), (x, ids, w.clone().requires_grad_())):
        y = layer(*args)
        assert y.requires_grad and y.grad_fn is not None
        with pytest.raises(RuntimeError, match="no autograd formula"):
            y.float().sum().backward()
        for off in (torch.no_grad, torch.inference_mode):
            with off():
                assert not layer(*args).requires_grad
    assert layer(x, ids, w).grad_fn is None
    assert len(runs) == 7


def _rank_call(precision: str, capacity: int = 24) -> dict:
    """An EP rank's received rows as its receive buffers hold them (rows as Dispatch sent them:
    e4m3 with their scales in FP8), and its Combine buffer."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(capacity, TINY.hidden, generator=g).to(torch.bfloat16)
    x, x_scale = quantize_rows_fp8(x) if precision == "fp8" else (x, None)
    return dict(schedule="wave",
                peers=local_combine_peers([torch.empty(capacity, TINY.hidden,
                                                       dtype=torch.bfloat16)]),
                expert_ids=torch.randint(0, TINY.routed_experts, (capacity,), generator=g,
                                         dtype=torch.int32),
                x=x, x_scale=x_scale, n_arrivals=torch.tensor([capacity], dtype=torch.int32),
                arrival_src=torch.zeros(capacity, dtype=torch.int32),
                arrival_slot=torch.arange(capacity, dtype=torch.int32))


@pytest.mark.parametrize("precision,change,message", [
    ("bf16", lambda c: c.update(schedule="fastest"), "schedule must be one of"),
    ("bf16", lambda c: c.update(expert_ids=c["expert_ids"][:20]),
     r"expert_ids must be torch.int32 or torch.int64 \[24\]"),
    ("bf16", lambda c: c.update(expert_ids=c["expert_ids"].float()), "expert_ids must be"),
    ("bf16", lambda c: c.update(arrival_src=c["arrival_src"].long()),
     r"arrival_src must be torch.int32 \[24\]"),
    ("bf16", lambda c: c.update(arrival_slot=c["arrival_slot"][:23]),
     "arrival_slot must be"),
    ("bf16", lambda c: c.update(n_arrivals=c["n_arrivals"].long()), "n_arrivals must be"),
    ("bf16", lambda c: c.update(x=c["x"][:, :128]), r"x must be torch.bfloat16 \[24, 256\]"),
    ("bf16", lambda c: c.update(x=c["x"].t().contiguous().t()), "contiguous"),
    ("bf16", lambda c: c.update(x=quantize_rows_fp8(c["x"])[0]), "x must be torch.bfloat16"),
    ("bf16", lambda c: c.update(x_scale=torch.ones(24, 2)), "x_scale goes with e4m3 rows"),
    ("bf16", lambda c: c.update(peers=local_combine_peers([torch.empty(24, 128,
                                                                       dtype=torch.bfloat16)])),
     "Combine buffers of 128 columns"),
    ("fp8", lambda c: c.update(x_scale=c["x_scale"][:, :1].contiguous()),
     r"x_scale must be torch.float32 \[24, 2\]"),
    ("fp8", lambda c: c.update(x_scale=None), "x_scale must be"),
])
def test_an_ep_ranks_bad_buffers_are_refused_before_launch(precision, change, message):
    """``MoEWorkspace.received_call`` over receive buffers its kernels would read past (each
    read up to the capacity) or misread: refused, nothing launched."""
    ws = MoEWorkspace(local_expert_weights(TINY, 0, 1, precision, seed=3), 24, source_rows=0)
    call = _rank_call(precision)
    ws.check_received(**call)  # the buffers as they should be
    change(call)
    with pytest.raises(MoEContractError, match=message):
        ws.received_call(**call)
    assert int(ws.error) == 0 and (ws.tables.meta == 0).all()


class Block(torch.nn.Module):
    """A transformer block's MoE half: router, FusedMoE, residual."""

    def __init__(self, moe: FusedMoE):
        super().__init__()
        self.router = torch.nn.Linear(TINY.hidden, TINY.routed_experts, dtype=torch.bfloat16)
        self.moe = moe

    def forward(self, x):
        ids, w = router_topk(self.router(x), TINY.top_k)
        return x + self.moe(x, ids, w)


def test_compile_fullgraph_traces_the_custom_op():
    """Dynamo traces the block in one graph with ``xstage::fused_moe`` in it; the graph runs on
    FakeTensors through the op's fake implementation (no kernel runs on the CPU here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    block = Block(_layer("bf16"))
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    torch._dynamo.reset()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.zeros(6, TINY.hidden, dtype=torch.bfloat16))
        y = compiled(x)
    assert y.shape == (6, TINY.hidden) and y.dtype == torch.bfloat16
    assert len(graphs) == 1
    assert any("xstage.fused_moe" in str(n.target) for n in graphs[0].graph.nodes)



def test_compile_with_dynamic_tokens_keeps_the_bound():
    """Traced once for any T (``dynamic=True``): two token counts run through one graph; a T above
    ``max_tokens`` is refused with the bound named (the check's guard fails, the retrace raises),
    never launched into buffers sized for fewer."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(Block(_layer("bf16")), fullgraph=True, backend=backend,
                             dynamic=True)
    torch._dynamo.reset()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        for tokens in (6, 9):
            x = mode.from_tensor(torch.zeros(tokens, TINY.hidden, dtype=torch.bfloat16))
            assert compiled(x).shape == (tokens, TINY.hidden)
        assert len(graphs) == 1
        with pytest.raises(RuntimeError, match="T=20 tokens above max_tokens=16"):
            compiled(mode.from_tensor(torch.zeros(20, TINY.hidden, dtype=torch.bfloat16)))


def test_the_default_sum_adds_in_the_kernel_at_few_tokens_unless_torch_asks_for_determinism(
        monkeypatch):
    """``weighted_sum="auto"`` (the default): with gluon_ws (built here, never launched) the
    atomic sum's adds up to ``AUTO_ATOMIC_TOKENS`` and the sum's launch beyond, or at every T
    while ``torch.use_deterministic_algorithms(True)`` holds (the adds' order, and so the bits,
    may change from call to call); with the portable Triton kernel, the launch; a call's graph
    is keyed by the flag, so one captured under either is never replayed under the other."""
    weights = local_expert_weights(TINY, 0, 1, "bf16", seed=3)
    config = default_tile_config("bf16", "gluon_ws", hidden=TINY.hidden)
    layer = FusedMoE(weights, max_tokens=16, top_k=TINY.top_k, config=config, num_programs=4)
    at = op.AUTO_ATOMIC_TOKENS
    assert layer.weighted_sum == "auto"
    assert [layer.adds_into_output(t) for t in (1, at, at + 1)] == [True, True, False]
    assert layer.routing(torch.int32, at).zeroed_hidden == TINY.hidden
    torch.use_deterministic_algorithms(True)
    try:
        assert not any(layer.sums_in_kernel(t) for t in (1, at))
        assert layer.routing(torch.int32, 1).zeroed_hidden == 0
    finally:
        torch.use_deterministic_algorithms(False)
    portable = FusedMoE(weights, max_tokens=16, top_k=TINY.top_k)
    assert portable.workspace.config.kernel == "triton" and not portable.sums_in_kernel(1)
    keys = []
    monkeypatch.setattr(layer.graphs, "call", lambda key, *a, **kw: keys.append(key))
    try:
        for deterministic in (False, True):
            torch.use_deterministic_algorithms(deterministic)
            layer.run(*_inputs(2), layer.schedule)
    finally:
        torch.use_deterministic_algorithms(False)
    assert [k[-1] for k in keys] == [False, True] and keys[0][:-1] == keys[1][:-1]


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:], interpreter_cases(), {}))
