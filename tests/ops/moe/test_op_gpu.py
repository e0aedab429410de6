"""``FusedMoE`` and the device tables on a Hopper GPU (skipped elsewhere: CI has no GPU): the
tables equal the host reference (DiT-MoE's Interleaved with the lead counted from the expert
too), an eager call runs under ``set_sync_debug_mode("error")``, one
CUDA graph replayed with five routings matches the reference each time, and
``torch.compile(fullgraph=True)`` of a block (router, FusedMoE, residual) matches eager. The
eager call's own graphs (issue 27): calls at interleaved token counts on fresh tensors each match
the reference and leave earlier outputs alone, one graph captured per token count; calls of one
token count queued behind a long kernel, each keeping its own addresses; eager calls
around a user's graph capture, and the user's graph replayed after them; the first calls at
token counts never seen under ``set_sync_debug_mode("error")``; two layers on one set of
buffers, each replaying its own graphs; calls on two streams, one at a time. The fused kernel
ending with the weighted sum (``weighted_sum="kernel"``) and its adds into the output
(``"atomic"``), call after call and replayed. A call autograd records, through the custom
op, whose backward raises; an empty batch launching nothing."""
from __future__ import annotations

import pytest
import torch

from xstage_lab.experiments.moe.bench import TOLERANCE
from xstage_lab.ops.moe import device_tables
from xstage_lab.ops.moe.combine import combine_weighted_sum, local_combine_peers
from xstage_lab.ops.moe.dispatch import build_layout
from xstage_lab.ops.moe.fused import prepare_fused_moe
from xstage_lab.ops.moe.table_reference import host_tables, table_mismatches
from xstage_lab.ops.graph_launch import GRAPHS_PER_LAYER
from xstage_lab.ops.moe.op import AUTO_ATOMIC_TOKENS, FusedMoE
from xstage_lab.ops.moe.reference import reference_moe
from xstage_lab.ops.moe.routing import router_logits, router_topk
from xstage_lab.ops.moe.schedules import MoEProblem, expert_wave_schedule
from xstage_lab.ops.moe.shapes import PRECISIONS, MoEShape, load_shapes
from xstage_lab.ops.moe.weights import local_expert_weights, quantize_rows_fp8

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper (sm_90) GPU")

SHAPES = load_shapes()
# Linear-2 tiles 256 wide and few enough at one token to split along K: no model shape's are
# (DiT-MoE's are 128 wide), so the split builds of the 256-wide tiles run here only
WIDE_SPLIT = "wide-split"
SHAPES[WIDE_SPLIT] = MoEShape(WIDE_SPLIT, "test", hidden=1024, intermediate=1024,
                              routed_experts=16, top_k=2, source="tests/ops/moe/test_op_gpu.py")
MODEL = "DeepSeek-V4-Flash"
SEED = 5
HOLD_CYCLES = 200_000_000  # about 0.1 s at H200 clocks: the calls after it queue behind it
RACE_SPIN_ITERS = 1 << 16  # polls: enough for ordered calls (H100); a racing call errs in seconds
QUEUED_CALLS = 6


@pytest.fixture(scope="module", params=PRECISIONS)
def layer(request):
    weights = local_expert_weights(SHAPES[MODEL], 0, 1, request.param, seed=SEED, device="cuda")
    return FusedMoE(weights, max_tokens=256, top_k=SHAPES[MODEL].top_k, schedule="wave")


def _inputs(tokens: int, seed: int, routing: str = "balanced", model: str = MODEL):
    shape = SHAPES[model]
    g = torch.Generator("cuda").manual_seed(seed)
    x = torch.randn(tokens, shape.hidden, generator=g, device="cuda").to(torch.bfloat16)
    ids, w = router_topk(router_logits(tokens, shape.routed_experts, routing, seed=seed,
                                       device="cuda"), shape.top_k)
    return x, ids, w


def _check(layer: FusedMoE, y, x, ids, w, model: str = MODEL, seed: int = SEED):
    precision = layer.workspace.weights.precision
    for kind, ref in reference_moe(x, ids, w, SHAPES[model], seed=seed,
                                   precision=precision).items():
        err = float((y.float() - ref).norm() / ref.norm())
        assert err <= TOLERANCE[precision][kind], (kind, err)


@pytest.mark.parametrize("tokens,routing,limits", [
    (1, "balanced", {}), (1, "balanced", {"TINY_ARRIVALS": 0}),
    (21, "skewed", {"TINY_ARRIVALS": 128}), (37, "skewed", {}),
    (37, "skewed", {"SCAN_IN_HISTOGRAM_CHUNKS": 0}), (256, "balanced", {}),
    (256, "balanced", {"SCAN_IN_HISTOGRAM_CHUNKS": 0})])
def test_device_tables_equal_the_host_reference(layer, tokens, routing, limits, monkeypatch):
    """Each token count through the launches its arrivals take: one token through
    ``route_tiny``, 37 and 256 through the two table launches (the scan in ``route_histogram``'s
    last program) and through the three (``route_offsets``); one token through the launches as
    well, and 21 (126 arrivals, at most ``block_m``) through ``route_tiny``."""
    if limits:  # a layer of its own: the module's has its tables
        for name, value in limits.items():
            monkeypatch.setattr(device_tables, name, value)
        layer = FusedMoE(layer.workspace.weights, max_tokens=256, top_k=SHAPES[MODEL].top_k,
                         schedule="wave")
    x, ids, w = _inputs(tokens, tokens, routing)
    layer.combine.fill_(float("nan"))
    y = layer(x, ids, w)
    ws, k = layer.workspace, SHAPES[MODEL].top_k
    rows = x.repeat_interleave(k, dim=0)
    xq, xs = quantize_rows_fp8(rows) if ws.weights.precision == "fp8" else (rows, None)
    assert table_mismatches(ws.tables, host_tables(ws.bounds, ids.reshape(-1), xq, xs,
                                                   top_k=k)) == []
    _check(layer, y, x, ids, w)
    assert int(layer.error) == 0


@pytest.mark.parametrize("precision", PRECISIONS)
def test_interleaved_counts_its_lead_from_the_expert_where_p2_is_below_p1(precision):
    """DiT-MoE (P_2 < P_1): Interleaved's table with the lead counted from the end of each
    Linear-2 tile's expert (``route_rows``' ``EXPERT_LEAD``) equals the host reference where
    experts span several row blocks, and the call matches the reference."""
    model = "DiT-MoE"
    shape = SHAPES[model]
    weights = local_expert_weights(shape, 0, 1, precision, seed=SEED, device="cuda")
    layer = FusedMoE(weights, max_tokens=2048, top_k=shape.top_k, schedule="interleaved")
    ws, k = layer.workspace, shape.top_k
    assert ws.bounds.expert_lead
    x, ids, w = _inputs(2048, 7, "skewed", model)
    layer.combine.fill_(float("nan"))
    y = layer(x, ids, w)
    assert int(ws.tables.expert_counts.max()) > ws.bounds.block_m  # several row blocks
    rows = x.repeat_interleave(k, dim=0)
    xq, xs = quantize_rows_fp8(rows) if precision == "fp8" else (rows, None)
    assert table_mismatches(ws.tables, host_tables(ws.bounds, ids.reshape(-1), xq, xs,
                                                   top_k=k)) == []
    _check(layer, y, x, ids, w, model)
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


def test_an_empty_batch_launches_nothing_and_never_synchronizes(layer):
    """T = 0 with the ids' host check on (``check_ids``, a device-to-host copy at T > 0): an empty
    bf16 output, no synchronization, no graph captured, nothing flagged."""
    moe = FusedMoE(layer.workspace.weights, max_tokens=64, top_k=SHAPES[MODEL].top_k,
                   check_ids=True)
    x, ids, w = (t[:0] for t in _inputs(4, 2))
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = moe(x, ids, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert y.shape == (0, x.shape[1]) and y.dtype == torch.bfloat16
    assert len(moe.graphs) == 0 and int(moe.error) == 0


def test_one_graph_replays_five_routings(layer):
    _replay_routings(layer, 64, range(10, 15))
    assert int(layer.error) == 0


def _replay_routings(layer: FusedMoE, tokens: int, seeds, model: str = MODEL) -> None:
    """One call bound on a side stream, then captured into a user's graph, replayed with a
    routing per seed (balanced and skewed in turn), its output and Combine rows poisoned before
    each replay, each checked against the reference."""
    x, ids, w = _inputs(tokens, 2, model=model)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x, ids, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = layer(x, ids, w)
    for i, seed in enumerate(seeds):
        nx, nids, nw = _inputs(tokens, seed, ("balanced", "skewed")[i % 2], model=model)
        x.copy_(nx)
        ids.copy_(nids)
        w.copy_(nw)
        y.fill_(float("nan"))
        layer.combine.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(layer, y, nx, nids, nw, model=model)


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


def _fresh_layer(layer: FusedMoE, max_tokens: int = 512, **kwargs) -> FusedMoE:
    """A layer of no graphs yet over the fixture's experts."""
    return FusedMoE(layer.workspace.weights, max_tokens=max_tokens, top_k=SHAPES[MODEL].top_k,
                    schedule="wave", **kwargs)


@pytest.fixture
def captures(monkeypatch):
    """The graphs captured while the test runs: a list the capture of each appends to."""
    done = []
    end = torch.cuda.CUDAGraph.capture_end

    def counted(graph):
        end(graph)
        done.append(graph)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", counted)
    return done


def test_eager_calls_at_interleaved_token_counts_replay_one_graph_each(layer, captures):
    """T = 1, 64, 1, 512, 64, each call on fresh tensors at new addresses (the earlier ones kept
    alive), the Combine buffer poisoned before each: every output within the reference's
    tolerance, every earlier output unchanged by the later calls, one capture per T."""
    moe = _fresh_layer(layer)
    calls = []
    for i, tokens in enumerate((1, 64, 1, 512, 64)):
        x, ids, w = _inputs(tokens, 100 + i, ("balanced", "skewed")[i % 2])
        moe.combine.fill_(float("nan"))
        y = moe(x, ids, w)
        torch.cuda.synchronize()
        _check(moe, y, x, ids, w)
        calls.append((y, y.clone(), x, ids, w))
    assert len({c[2].data_ptr() for c in calls}) == len(calls)  # new addresses each call
    for y, kept, *_ in calls:
        assert torch.equal(y.view(torch.int16), kept.view(torch.int16))
    assert len(captures) == 3 and sorted(shape[0] for shape in moe.graphs) == [1, 64, 512]
    assert int(moe.error) == 0


def test_layers_sharing_buffers_replay_their_own_graphs(layer, captures):
    """Two layers of other weights on one set of buffers (a model's MoE layers), called in turn
    at T = 64, 1, 64, 1, 512 each on fresh tensors, each call queued right behind the other
    layer's, the Combine rows poisoned before each call: every output within tolerance of its
    own weights' reference and unchanged by the later calls; one capture per layer and T."""
    first = _fresh_layer(layer)
    weights = local_expert_weights(SHAPES[MODEL], 0, 1, first.workspace.weights.precision,
                                   seed=SEED + 1, device="cuda")
    second = FusedMoE(weights, max_tokens=first.max_tokens, top_k=first.top_k, schedule="wave",
                      buffers=first.moe_buffers)
    assert second.combine.data_ptr() == first.combine.data_ptr()
    calls = []
    for i, tokens in enumerate((64, 1, 64, 1, 512)):
        pair = []
        for moe, seed in ((first, SEED), (second, SEED + 1)):
            x, ids, w = _inputs(tokens, 200 + 2 * i + seed - SEED)
            first.combine.fill_(float("nan"))
            pair.append((moe(x, ids, w), seed, x, ids, w))
        torch.cuda.synchronize()
        for y, seed, x, ids, w in pair:
            _check(first, y, x, ids, w, seed=seed)
            calls.append((y, y.clone()))
    for y, kept in calls:
        assert torch.equal(y.view(torch.int16), kept.view(torch.int16))
    assert len(captures) == 6 and sorted(t for t, *_ in second.graphs) == [1, 64, 512]
    assert int(first.error) == 0


def test_queued_calls_of_one_token_count_relaunch_its_graph(layer, captures):
    """``QUEUED_CALLS`` calls at one T on fresh tensors, all queued behind a long kernel (the
    graph relaunched while its last launches wait, each with its own addresses): every output
    right, one capture. The layer's buffers are shared in stream order, so queued calls stay
    apart."""
    moe = _fresh_layer(layer)
    moe(*_inputs(8, 70))  # the graph of T = 8 captured
    torch.cuda.synchronize()
    calls = [_inputs(8, 71 + i, ("balanced", "skewed")[i % 2]) for i in range(QUEUED_CALLS)]
    torch.cuda._sleep(HOLD_CYCLES)
    ys = [moe(*inputs) for inputs in calls]
    torch.cuda.synchronize()
    for y, inputs in zip(ys, calls):
        _check(moe, y, *inputs)
    assert len(captures) == 1 and int(moe.error) == 0


def test_calls_on_two_streams_run_one_at_a_time(layer, captures):
    """Calls on two streams, alternating at T = 64 and 8, each stream held behind one long
    kernel so that both are released at once: the layer's buffers are the latest call's until it
    ends, so each call on the other stream waits for it (``StreamOrder``); the compiled path
    hands such a call back. Every output right, on poisoned Combine rows. Spins bounded short
    (``RACE_SPIN_ITERS``) so that calls racing on the buffers count errors within seconds
    instead of polling for minutes."""
    moe = _fresh_layer(layer, max_spin_iters=RACE_SPIN_ITERS)
    for tokens in (64, 8):
        moe(*_inputs(tokens, 90 + tokens))  # both graphs captured
    calls = [_inputs((64, 8)[i % 2], 100 + i) for i in range(4)]
    moe.combine.fill_(float("nan"))
    torch.cuda.synchronize()
    hold, streams = torch.cuda.Stream(), (torch.cuda.Stream(), torch.cuda.Stream())
    released = torch.cuda.Event()
    with torch.cuda.stream(hold):
        torch.cuda._sleep(HOLD_CYCLES)
        released.record()
    ys = []
    for i, inputs in enumerate(calls):
        stream = streams[i % 2]
        stream.wait_event(released)
        with torch.cuda.stream(stream):
            ys.append(moe(*inputs))
    torch.cuda.synchronize()
    for y, inputs in zip(ys, calls):
        _check(moe, y, *inputs)
    assert len(captures) == 2 and int(moe.error) == 0


def test_graphs_per_layer_are_bounded(layer, captures):
    """Past ``GRAPHS_PER_LAYER`` token counts the least recently replayed graph goes; a call at
    its token count captures again and stays right."""
    moe = _fresh_layer(layer, max_tokens=GRAPHS_PER_LAYER + 2)
    for tokens in range(1, GRAPHS_PER_LAYER + 2):
        moe(*_inputs(tokens, tokens))
    assert len(moe.graphs) == GRAPHS_PER_LAYER and 1 not in {s[0] for s in moe.graphs}
    x, ids, w = _inputs(1, 7)
    y = moe(x, ids, w)
    torch.cuda.synchronize()
    _check(moe, y, x, ids, w)
    assert len(captures) == GRAPHS_PER_LAYER + 2 and len(moe.graphs) == GRAPHS_PER_LAYER
    assert len(moe.compiled) == GRAPHS_PER_LAYER  # the dropped graph left the compiled path too


def test_a_layer_with_graphs_is_freed_by_reference_counting(layer, captures):
    """No reference cycle through the compiled path's hooks: a layer freed by the cyclic
    collector at an arbitrary moment could destroy its graphs inside another layer's capture,
    which invalidates that capture (seen at 26e502b)."""
    import gc
    import weakref

    moe = _fresh_layer(layer)
    moe(*_inputs(8, 90))
    torch.cuda.synchronize()
    gone = weakref.ref(moe)
    gc.disable()
    try:
        del moe
        assert gone() is None
    finally:
        gc.enable()


def test_the_compiled_path_takes_a_captured_calls_and_hands_back_the_rest(layer, captures):
    """Once T = 8 is captured its calls go through ``fused_call.cpp`` (right against the
    reference on a poisoned Combine buffer); a T without a graph, a non-contiguous ``x`` and a
    misaligned one it hands back (None), and the Python path serves or refuses them."""
    from xstage_lab.ops.moe.shapes import MoEContractError

    moe = _fresh_layer(layer)
    moe(*_inputs(8, 80))
    stream = moe.graphs.current_stream(moe.device.index)
    x, ids, w = _inputs(8, 81, "skewed")
    moe.combine.fill_(float("nan"))
    y = moe.compiled(x, ids, w, stream)
    torch.cuda.synchronize()
    assert y is not None and y.shape == x.shape and len(moe.compiled) == 1
    _check(moe, y, x, ids, w)
    assert moe.compiled(*_inputs(9, 82), stream) is None  # no graph of T = 9 yet
    wide = torch.zeros(8, 2 * x.shape[1], dtype=x.dtype, device="cuda")
    wide[:, ::2] = x
    strided = wide[:, ::2]
    assert moe.compiled(strided, ids, w, stream) is None
    y = moe(strided, ids, w)  # the Python path makes it contiguous
    torch.cuda.synchronize()
    _check(moe, y, x, ids, w)
    flat = torch.zeros(8 * x.shape[1] + 1, dtype=x.dtype, device="cuda")
    shifted = flat[1:].view(8, x.shape[1])
    shifted.copy_(x)
    assert moe.compiled(shifted, ids, w, stream) is None
    with pytest.raises(MoEContractError, match="aligned"):
        moe(shifted, ids, w)
    assert len(captures) == 1 and int(moe.error) == 0


def test_a_call_autograd_records_goes_through_the_op_and_its_backward_raises(layer, captures):
    """Once T = 8 is captured, a call whose ``x`` or ``topk_weights`` requires grad is handed
    back by the compiled path and goes through the custom op: right against the reference on a
    poisoned Combine buffer, its output recorded by autograd, and its backward raises instead of
    leaving the layer out of the gradients; under ``torch.no_grad`` the compiled path takes it."""
    moe = _fresh_layer(layer)
    moe(*_inputs(8, 83))
    stream = moe.graphs.current_stream(moe.device.index)
    x, ids, w = _inputs(8, 84, "skewed")
    for args in ((x.clone().requires_grad_(), ids, w), (x, ids, w.clone().requires_grad_())):
        assert moe.compiled(*args, stream) is None
        moe.combine.fill_(float("nan"))
        y = moe(*args)
        torch.cuda.synchronize()
        assert y.requires_grad
        _check(moe, y.detach(), x, ids, w)
        with pytest.raises(RuntimeError, match="no autograd formula"):
            y.float().sum().backward()
        with torch.no_grad():
            assert moe.compiled(*args, stream) is not None
    torch.cuda.synchronize()
    assert len(captures) == 1 and int(moe.error) == 0


def test_eager_calls_around_a_users_graph(layer, captures):
    """A user's graph captured around a call (its launches direct: no graph of the layer's
    captured inside), eager calls after it at the captured T and at a new one, then the user's
    graph replayed on new routings: each output right (the argument block is rewritten before
    every reader, by the eager call or by the user's graph)."""
    moe = _fresh_layer(layer)
    x, ids, w = _inputs(64, 20)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe(x, ids, w)  # the user's warm-up: eager, so the layer's graph for T = 64 too
    torch.cuda.current_stream().wait_stream(stream)
    assert len(captures) == 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_user = moe(x, ids, w)
    assert len(captures) == 2 and len(moe.graphs) == 1  # the user's own, nothing of the layer's
    for i, tokens in enumerate((64, 8, 64)):
        nx, nids, nw = _inputs(tokens, 30 + i)
        moe.combine.fill_(float("nan"))
        y = moe(nx, nids, nw)
        torch.cuda.synchronize()
        _check(moe, y, nx, nids, nw)
        ux, uids, uw = _inputs(64, 40 + i, "skewed")
        x.copy_(ux)
        ids.copy_(uids)
        w.copy_(uw)
        y_user.fill_(float("nan"))
        moe.combine.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(moe, y_user, ux, uids, uw)
    assert len(captures) == 3  # T = 8's
    assert int(moe.error) == 0


def test_first_calls_at_new_token_counts_never_synchronize(layer, captures):
    """Under ``set_sync_debug_mode("error")``: a call at a T never seen (its direct launches,
    then its graph captured), the same T again (replayed), another new T; all right after."""
    moe = _fresh_layer(layer)
    moe(*_inputs(3, 50))  # the kernels compiled and the layer's launches bound
    torch.cuda.synchronize()
    calls = [_inputs(t, 60 + t) for t in (16, 16, 200)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        ys = [moe(*inputs) for inputs in calls]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert len(captures) == 3  # T = 3, 16, 200
    for y, inputs in zip(ys, calls):
        _check(moe, y, *inputs)


def test_an_ep_ranks_graph_follows_new_rows_in_its_receive_buffers(captures):
    """``MoEWorkspace.received_call`` over one set of receive buffers, refilled between calls
    with two routings' received rows (A, B, A): the first call launches directly and captures,
    the next two launch that graph; each time every source's Combine rows (poisoned first) are
    the reference's for the rows the buffers then held."""
    from xstage_lab.experiments.moe.layer_cells import EP, Ep8RankCell
    from xstage_lab.ops.moe.reference import expert_rows_reference
    from xstage_lab.ops.moe.unfused import GroupedWeights

    shape = SHAPES[MODEL]
    weights = local_expert_weights(shape, 0, EP, "bf16", seed=SEED, device="cuda")
    grouped = GroupedWeights("bf16", weights.w1, weights.w2)
    cell, other = (Ep8RankCell(shape, "bf16", 64, weights, grouped, seed, "cuda")
                   for seed in (SEED, SEED + 1))
    inputs = ("in_expert", "in_x", "in_src", "in_slot", "n")
    held = {name: getattr(cell, name).clone() for name in inputs}
    for source, fill in ((cell, held), (other, None), (cell, held)):
        for name in inputs:
            getattr(cell, name).copy_(fill[name] if fill else getattr(other, name))
        for buffer in cell.buffers:
            buffer.fill_(float("nan"))
        cell.call()
        torch.cuda.synchronize()
        got = torch.stack(cell.buffers)[source.src, source.slot]
        ref = expert_rows_reference(source.rows, source.expert, shape, seed=SEED,
                                    precision="bf16")["fp32"]
        err = float((got.float() - ref).norm() / ref.norm())
        assert err <= TOLERANCE["bf16"]["fp32"], err
    assert len(captures) == 1 and int(cell.ws.error) == 0


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("model,block_n2", [("DiT-MoE", 128), (WIDE_SPLIT, 256)])
def test_one_token_splits_linear2_along_k_and_matches_the_reference_call_after_call(
        precision, model, block_n2):
    """One token: two experts' Linear-2 tiles (DiT-MoE's 22, 128 wide; 8 of 256 columns, in
    FP8 two 128-column halves) on 132 SMs, split along K (the kernel's ``SPLIT_K`` build). Five
    routings through the layer's graph, its Combine rows poisoned before each call: each
    matches the reference, the same routing again gives the same bits (the splits summed in
    split order), and the split counters are left zero."""
    shape = SHAPES[model]
    weights = local_expert_weights(shape, 0, 1, precision, seed=SEED, device="cuda")
    layer = FusedMoE(weights, max_tokens=1, top_k=shape.top_k, schedule="wave",
                     weighted_sum="launch")
    assert layer.workspace.bounds.l2_splits > 1
    assert layer.workspace.config.block_n2 == block_n2
    for i in range(5):
        x, ids, w = _inputs(1, 40 + i, ("balanced", "skewed")[i % 2], model=model)
        layer.combine.fill_(float("nan"))
        y = layer(x, ids, w)
        torch.cuda.synchronize()
        _check(layer, y, x, ids, w, model=model)
        layer.combine.fill_(float("nan"))
        assert torch.equal(layer(x, ids, w).view(torch.int16), y.view(torch.int16))
    assert int(layer.error) == 0 and not layer.workspace.l2_ready.any()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("model,tokens", [("DiT-MoE", 1), ("DiT-MoE", 64), (MODEL, 1),
                                          (MODEL, 8), (WIDE_SPLIT, 1)])
def test_the_kernel_ends_with_the_weighted_sum_call_after_call(precision, model, tokens):
    """``weighted_sum="kernel"`` where one pass of the programs covers the tokens (DiT-MoE's
    and the wide shape's one token through the split Linear-2 builds, the rest unsplit): five
    routings, the Combine rows poisoned before each call, each output matching the reference
    and equal bit for bit to the weighted sum's own launch over the same rows, the same
    routing again the same bits; then one user graph replayed with three routings, its output
    poisoned before each replay. Every launch counts two arrivals a program."""
    shape = SHAPES[model]
    weights = local_expert_weights(shape, 0, 1, precision, seed=SEED, device="cuda")
    layer = FusedMoE(weights, max_tokens=tokens, top_k=shape.top_k, schedule="wave",
                     weighted_sum="kernel")
    assert layer.sums_in_kernel(tokens)
    rows = tokens * shape.top_k
    launches = 0
    for i in range(5):
        x, ids, w = _inputs(tokens, 60 + i, ("balanced", "skewed")[i % 2], model=model)
        layer.combine.fill_(float("nan"))
        y = layer(x, ids, w)
        torch.cuda.synchronize()
        _check(layer, y, x, ids, w, model=model)
        apart = combine_weighted_sum(layer.combine[:rows], w)
        assert torch.equal(y.view(torch.int16), apart.view(torch.int16))
        layer.combine.fill_(float("nan"))
        assert torch.equal(layer(x, ids, w).view(torch.int16), y.view(torch.int16))
        launches += 2
    _replay_routings(layer, tokens, range(80, 83), model)
    launches += 1 + 3  # the call on the side stream, the replays
    assert int(layer.error) == 0
    programs = layer.workspace.bounds.num_programs
    assert int(layer.moe_buffers.sum_arrivals) == 2 * programs * launches


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("model,tokens", [("DiT-MoE", 1), ("DiT-MoE", 32), (MODEL, 1),
                                          (MODEL, 8), (WIDE_SPLIT, 1), ("DiT-MoE", 300),
                                          (MODEL, 64), (MODEL, 512)])
def test_the_atomic_sum_adds_into_the_output_call_after_call(precision, model, tokens):
    """``weighted_sum="atomic"``, routed by ``route_tiny`` (up to 8 tokens of MODEL, 32 of DiT-MoE;
    DiT-MoE's and the wide shape's one token through the split Linear-2 builds) or by
    ``route_histogram`` and the launches after it (64 to 512 tokens, ``ATOMIC_SUM_TOKENS``, the FP8
    layer's quantization in that launch too): five routings, the output memory poisoned before each
    call (the routing zeroes it), each output matching the reference and, within bf16's rounding of
    its adds, the output of a layer of the same weights whose sum has its own launch, on the same
    routing; then one user graph replayed with three routings, its output poisoned before each
    replay."""
    shape = SHAPES[model]
    weights = local_expert_weights(shape, 0, 1, precision, seed=SEED, device="cuda")
    layer = FusedMoE(weights, max_tokens=tokens, top_k=shape.top_k, schedule="wave",
                     weighted_sum="atomic")
    apart = FusedMoE(weights, max_tokens=tokens, top_k=shape.top_k, schedule="wave",
                     weighted_sum="launch")
    assert layer.sums_in_kernel(tokens) and not apart.sums_in_kernel(tokens)
    for i in range(5):
        x, ids, w = _inputs(tokens, 60 + i, ("balanced", "skewed")[i % 2], model=model)
        # the caching allocator hands the call this block back for its output
        torch.empty(tokens, shape.hidden, dtype=torch.bfloat16, device="cuda").fill_(
            float("nan"))
        y = layer(x, ids, w)
        want = apart(x, ids, w)
        torch.cuda.synchronize()
        _check(layer, y, x, ids, w, model=model)
        # each element top_k bf16 adds, each rounding, where the launch's fp32 sum rounds once
        assert (y.float() - want.float()).abs().max() <= \
            2.0 ** -8 * shape.top_k * want.float().abs().max()
    _replay_routings(layer, tokens, range(80, 83), model)
    assert int(layer.error) == 0


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_default_sum_adds_at_few_tokens_and_launches_under_torchs_determinism(precision):
    """``weighted_sum="auto"`` (the default), MODEL at 1 and ``AUTO_ATOMIC_TOKENS`` tokens: each
    call's output, poisoned first, matches the reference and, within bf16's rounding of its
    adds, the sum's launch; under ``torch.use_deterministic_algorithms(True)`` the same layer
    launches the sum (another graph) and gives the launch's bits, call after call."""
    shape = SHAPES[MODEL]
    weights = local_expert_weights(shape, 0, 1, precision, seed=SEED, device="cuda")
    layer = FusedMoE(weights, max_tokens=AUTO_ATOMIC_TOKENS, top_k=shape.top_k,
                     schedule="wave")
    apart = FusedMoE(weights, max_tokens=AUTO_ATOMIC_TOKENS, top_k=shape.top_k,
                     schedule="wave", weighted_sum="launch")
    for i, tokens in enumerate((1, AUTO_ATOMIC_TOKENS) * 2):
        assert layer.adds_into_output(tokens)
        x, ids, w = _inputs(tokens, 70 + i, ("balanced", "skewed")[i % 2])
        want = apart(x, ids, w)
        for deterministic in (False, True):
            torch.use_deterministic_algorithms(deterministic)
            try:
                torch.empty(tokens, shape.hidden, dtype=torch.bfloat16, device="cuda").fill_(
                    float("nan"))
                y = layer(x, ids, w)
            finally:
                torch.use_deterministic_algorithms(False)
            torch.cuda.synchronize()
            _check(layer, y, x, ids, w)
            if deterministic:
                assert torch.equal(y.view(torch.int16), want.view(torch.int16))
            else:
                assert (y.float() - want.float()).abs().max() <= \
                    2.0 ** -8 * shape.top_k * want.float().abs().max()
    assert sorted(k[-1] for k in layer.graphs) == [False, False, True, True]
    assert int(layer.error) == 0


def test_a_ring_of_one_a_half_a_stage_at_a_few_tokens_and_its_flag():
    """bf16 DiT-MoE built for 32 tokens (64 routed rows at most an expert: a tile's first half)
    takes the ring of one A half a stage, 5 deep, and matches the reference over routings,
    balanced and skewed; built for 33, two halves. The host-scheduled launch of that build over
    a layout whose expert holds 100 rows (its first row block's second half routed) flags each
    of that row block's tiles, Linear-1's and Linear-2's, on the device."""
    shape = SHAPES["DiT-MoE"]
    weights = local_expert_weights(shape, 0, 1, "bf16", seed=SEED, device="cuda")
    layer = FusedMoE(weights, max_tokens=32, top_k=shape.top_k, schedule="wave")
    cfg = layer.workspace.config
    assert (cfg.a_halves, cfg.num_stages) == (1, 5)
    wider = FusedMoE(weights, max_tokens=33, top_k=shape.top_k, schedule="wave")
    assert (wider.workspace.config.a_halves, wider.workspace.config.num_stages) == (2, 4)
    for i, tokens in enumerate((1, 8, 32, 32)):
        x, ids, w = _inputs(tokens, 90 + i, ("balanced", "skewed")[i % 2], model="DiT-MoE")
        torch.empty(tokens, shape.hidden, dtype=torch.bfloat16, device="cuda").fill_(
            float("nan"))
        y = layer(x, ids, w)
        torch.cuda.synchronize()
        _check(layer, y, x, ids, w, model="DiT-MoE")
    assert int(layer.error) == 0
    rows = 100
    x = torch.randn(rows, shape.hidden, device="cuda").to(torch.bfloat16)
    expert = torch.zeros(rows, dtype=torch.int64, device="cuda")
    layout = build_layout(x, None, torch.arange(rows, device="cuda"), expert, [rows],
                          shape.routed_experts, cfg.block_m)
    problem = MoEProblem(layout.blocks_per_expert, shape.intermediate // cfg.block_n1,
                         shape.hidden // cfg.block_n2)
    combine = [torch.full((rows, shape.hidden), float("nan"), dtype=torch.bfloat16,
                          device="cuda")]
    call = prepare_fused_moe(layout, weights, expert_wave_schedule(problem, 8),
                             local_combine_peers(combine), config=cfg)
    call()
    torch.cuda.synchronize()
    assert call.error_count() == problem.l1_n_blocks + problem.l2_n_blocks
