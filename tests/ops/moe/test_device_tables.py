"""Routing to tile tables on the device (kernels/moe_routing.py) in the interpreter: the layout and
both schedules' tables equal the host reference (``dispatch.build_layout``, the host schedules)
entry for entry, on random routings of every model shape, zero-row experts, one token, skewed
routing, an EP rank's received rows, and ids out of range (flagged, left out); plus the sm_90
build of the five kernels."""
from __future__ import annotations

import sys
import zlib

import pytest
import torch

from tests.experiments.triton_testing import (assert_case_ok, child_main, child_results,
                                              interpreter_case_tests)
from xstage_lab.ops.moe import device_tables as dt
from xstage_lab.ops.moe.device_tables import (TableBounds, allocate_tables, quant_grid,
                                              route_to_tables, scales_by_layout_row)
from xstage_lab.ops.moe.routing import router_logits, router_topk
from xstage_lab.ops.moe.shapes import MoEContractError, load_shapes
from xstage_lab.ops.moe.table_reference import host_tables, table_mismatches
from xstage_lab.ops.moe.tiles import default_tile_config
from xstage_lab.ops.moe.weights import quantize_rows_fp8

SHAPES = load_shapes()
MODULE = "tests.ops.moe.test_device_tables"


def _bounds(model: str, capacity: int, programs: int, lead: int, experts: int | None = None,
            expert_lead: bool | None = None, split_k: bool = False, block_m: int = 128):
    shape = SHAPES[model]
    config = default_tile_config("bf16", "gluon_ws", hidden=shape.hidden, block_m=block_m)
    return shape, TableBounds.of(capacity, experts or shape.routed_experts, shape.hidden,
                                 shape.intermediate, config, programs, lead, expert_lead,
                                 split_k=split_k)


def _assert_counters_in_use_zeroed(tables) -> None:
    """The fused kernel's counters of the row blocks in use are zero (the others it never
    reads), and some are in use."""
    in_use = int(tables.meta[0])
    assert in_use > 0 and not tables.row_ready[:in_use].any()


def case_ep1(model: str, precision: str, tokens: int, routing: str, programs: int, lead: int,
             seed: int = 0, topk_ids: torch.Tensor | None = None,
             expert_lead: bool | None = None, split_k: bool = False, block_m: int = 128) -> dict:
    """EP = 1 from ``topk_ids`` (the router's on ``routing`` unless given): device == host;
    ``split_k``: Linear-2 tiles split along K where the bounds say so; ``block_m`` the tiles'
    rows."""
    shape = SHAPES[model]
    if topk_ids is None:
        logits = router_logits(tokens, shape.routed_experts, routing, seed=seed)
        topk_ids = router_topk(logits, shape.top_k)[0]
    _, bounds = _bounds(model, 2 * tokens * topk_ids.shape[1], programs, lead,
                        expert_lead=expert_lead, split_k=split_k, block_m=block_m)
    x = torch.randn(tokens, shape.hidden, generator=torch.Generator().manual_seed(seed))
    x = x.to(torch.bfloat16)
    tables = allocate_tables(bounds, shape.hidden, precision, "cpu")
    tables.row_ready.fill_(7)  # a launch's counts: the routing zeroes them for the next launch
    route_to_tables(tables, topk_ids.reshape(-1), x, top_k=topk_ids.shape[1])
    _assert_counters_in_use_zeroed(tables)
    assert int(tables.scan_done) == 0  # the scan's last program took its ticket back
    # the fused kernel reads the tokens in place (bf16), or their quantized copy, whose scales
    # route_quantize lays out by layout row where they are narrower than a line (the first
    # launch's quantizing programs, up to the rows it quantizes, by token)
    by_row = tokens > tables.quant_rows and scales_by_layout_row(shape.hidden)
    assert tables.a_rows.tolist() == ([tables.x_quant.data_ptr(), tables.x_quant_scale.data_ptr(),
                                       int(by_row)] if precision == "fp8" else
                                      [x.data_ptr(), tables.args.data_ptr(), 0])
    rows = x.repeat_interleave(topk_ids.shape[1], dim=0)
    xq, xs = quantize_rows_fp8(rows) if precision == "fp8" else (rows, None)
    host = host_tables(bounds, topk_ids.reshape(-1), xq, xs, top_k=topk_ids.shape[1])
    bad = table_mismatches(tables, host)
    assert not bad, bad
    assert int(tables.error) == 0
    return {"rows": int(tables.expert_offsets[-1]), "tiles": int(tables.meta[1]),
            "expert_lead": bounds.expert_lead, "l2_splits": bounds.l2_splits,
            "interleaved_crc": zlib.crc32(host.tiles["interleaved"].tobytes())}


def case_lead_from_the_row_and_from_the_expert() -> dict:
    """Experts of several row blocks (DiT-MoE, 200 skewed tokens, lead 3), Interleaved's lead
    counted from each Linear-2 tile's row and from its expert's end (``route_rows``'
    ``EXPERT_LEAD``); by default from the expert, DiT-MoE's P_2 being below its P_1."""
    shape = SHAPES["DiT-MoE"]
    ids = router_topk(router_logits(200, shape.routed_experts, "skewed", seed=4), shape.top_k)[0]
    out = {str(flag): case_ep1("DiT-MoE", "bf16", 200, "skewed", 7, 3, topk_ids=ids,
                               expert_lead=flag) for flag in (False, True, None)}
    crc = {k: v["interleaved_crc"] for k, v in out.items()}
    assert out["None"]["expert_lead"] and crc["None"] == crc["True"]
    # the two counts give different tables here, so each one's equality above tells
    assert crc["False"] != crc["True"]
    return out


def case_one_token_split_k() -> dict:
    """DiT-MoE at one token on 132 programs: a bound of 4 arrivals, at most 4 row blocks of 11
    Linear-2 tiles, each split in 3 along K (88 K blocks: 30, 30, 28)."""
    out = case_ep1("DiT-MoE", "bf16", 1, "skewed", 132, 2, split_k=True)
    assert out["l2_splits"] == 3
    return out


def case_zero_row_experts() -> dict:
    """Every pick on experts 3 and 5 of 16: fourteen idle experts around them."""
    ids = torch.tensor([[3, 5], [5, 3], [3, 5]])
    return case_ep1("DiT-MoE", "bf16", 3, "balanced", 4, 1, topk_ids=ids)


def case_ep_rank(model: str, precision: str, world: int, per_source: int, programs: int,
                 lead: int, seed: int = 0, counts: list[int] | None = None,
                 block_m: int = 128) -> dict:
    """An EP rank's received rows, source by source (``world`` sources, up to ``per_source``
    each, some none; or ``counts``), local expert ids and slots; the count on the device, a
    capacity above it."""
    shape = SHAPES[model]
    e_loc = shape.routed_experts // world
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, per_source + 1, (world,), generator=g) if counts is None else \
        torch.tensor(counts)
    counts[1] = 0
    n = int(counts.sum())
    capacity = world * per_source + 5
    _, bounds = _bounds(model, capacity, programs, lead, experts=e_loc, block_m=block_m)
    src = torch.repeat_interleave(torch.arange(world), counts)
    expert = torch.randint(0, e_loc, (n,), generator=g)
    slot = torch.cat([torch.randperm(per_source * 2, generator=g)[:int(c)] for c in counts])
    rows = torch.randn(n, shape.hidden, generator=g).to(torch.bfloat16)
    xq, xs = quantize_rows_fp8(rows) if precision == "fp8" else (rows, None)

    def padded(t, fill):
        out = torch.full((capacity, *t.shape[1:]), fill, dtype=t.dtype)
        out[:n] = t
        return out

    # received e4m3 rows come with their scales: no quantized copy
    tables = allocate_tables(bounds, shape.hidden, precision, "cpu", source_rows=0)
    assert tables.x_quant is None
    tables.row_ready.fill_(7)
    x_in = padded(xq.view(torch.uint8), 0).view(xq.dtype)
    scale_in = None if xs is None else padded(xs, 1.0)
    route_to_tables(tables, padded(expert.int(), 7), x_in, scale_in,
                    n_arrivals=torch.tensor([n], dtype=torch.int32),
                    arrival_src=padded(src.int(), 9), arrival_slot=padded(slot.int(), 9))
    _assert_counters_in_use_zeroed(tables)
    # the fused kernel reads the received rows and their scales in place
    assert tables.a_rows.tolist() == [x_in.data_ptr(), (tables.args if scale_in is None
                                                        else scale_in).data_ptr(), 0]
    host = host_tables(bounds, expert, xq, xs, arrival_src=src, arrival_slot=slot)
    bad = table_mismatches(tables, host)
    assert not bad, bad
    assert int(tables.error) == 0
    return {"arrivals": n, "rows": int(tables.expert_offsets[-1])}


def case_out_of_range_ids_are_flagged() -> dict:
    """Ids outside 0..E-1 raise the error flag and get no row; the rest are laid out as if they
    were not there."""
    ids = torch.tensor([[0, 16], [-1, 2], [2, 0]])
    _, bounds = _bounds("DiT-MoE", 6, 4, 1)
    x = torch.randn(3, 1408).to(torch.bfloat16)
    tables = allocate_tables(bounds, 1408, "bf16", "cpu")
    route_to_tables(tables, ids.reshape(-1), x, top_k=2)
    assert int(tables.error) == 2
    assert tables.arrival_rows[[1, 2]].tolist() == [-1, -1]
    assert tables.expert_counts[[0, 2]].tolist() == [2, 2] and int(tables.expert_counts.sum()) == 4
    return {"error": int(tables.error)}


def case_scan_in_steps() -> dict:
    """The chunk counts scanned in several steps, the carry from step to step, over the 7 chunks
    of 400 skewed picks at EP = 1 and on an EP rank (the arrivals' count read on the device):
    by ``route_offsets`` in the three launches (``SCAN_IN_HISTOGRAM_CHUNKS`` 0), two chunks a
    step (a small ``SCAN_TILE``), and by ``route_histogram``'s last program, two chunks a step
    (``SCAN_ONE_TILE`` two chunks of every expert: 16 at EP = 1, 2 on the rank)."""
    from xstage_lab.ops.moe import device_tables as dt

    saved = dt.SCAN_TILE, dt.SCAN_IN_HISTOGRAM_CHUNKS, dt.SCAN_ONE_TILE, dt.RECEIVED_SCAN_STEPS
    out = {}
    try:  # read as each call's tables bind
        dt.SCAN_TILE, dt.SCAN_IN_HISTOGRAM_CHUNKS = 2 * dt.SCAN_EXPERTS, 0
        dt.RECEIVED_SCAN_STEPS = 0
        out["route_offsets"] = {"ep1": case_ep1("DiT-MoE", "bf16", 200, "skewed", 7, 3, 4),
                                "ep_rank": case_ep_rank("DiT-MoE", "bf16", 8, 120, 5, 1, 3)}
        dt.SCAN_TILE, dt.SCAN_IN_HISTOGRAM_CHUNKS = saved[:2]
        dt.RECEIVED_SCAN_STEPS = saved[3]
        dt.SCAN_ONE_TILE = 2 * 16
        ep1 = case_ep1("DiT-MoE", "bf16", 200, "skewed", 7, 3, 4)
        dt.SCAN_ONE_TILE = 2 * 2
        out["route_histogram"] = {"ep1": ep1,
                                  "ep_rank": case_ep_rank("DiT-MoE", "bf16", 8, 120, 5, 1, 3)}
    finally:
        dt.SCAN_TILE, dt.SCAN_IN_HISTOGRAM_CHUNKS, dt.SCAN_ONE_TILE, dt.RECEIVED_SCAN_STEPS = saved
    assert out["route_offsets"] == out["route_histogram"]
    return out


def case_one_step_scan_beyond_the_chunk_bound() -> dict:
    """The scan in ``route_histogram``'s last program over more chunks than
    ``SCAN_IN_HISTOGRAM_CHUNKS`` (2 here), where one step (``SCAN_TILE`` counts over DiT-MoE's 16
    experts: 8 chunks here) takes them all (``scan_chunk_bound``): the 7 chunks of 400 skewed
    picks, equal to the host reference as the three launches are (``case_scan_in_steps``)."""
    from xstage_lab.ops.moe import device_tables as dt

    saved = dt.SCAN_IN_HISTOGRAM_CHUNKS, dt.SCAN_TILE
    try:  # read as each call's tables are allocated
        dt.SCAN_IN_HISTOGRAM_CHUNKS, dt.SCAN_TILE = 2, 8 * 16
        assert dt.scan_chunk_bound(16) == 8
        return case_ep1("DiT-MoE", "bf16", 200, "skewed", 7, 3, 4)
    finally:
        dt.SCAN_IN_HISTOGRAM_CHUNKS, dt.SCAN_TILE = saved


def case_received_scan_in_steps_beyond_the_chunk_bound() -> dict:
    """An EP rank's scan in ``route_histogram``'s last program over more chunks than
    ``scan_chunks`` (``SCAN_TILE`` 8 counts over DiT-MoE's two experts of an EP = 8 rank: 4
    chunks a step, and the bound), where the bound's 8 chunks take at most
    ``RECEIVED_SCAN_STEPS`` steps: the 630 rows received (5 chunks) scanned in two steps, equal
    to the host reference and to the tables of ``route_offsets``' launch (``RECEIVED_SCAN_STEPS``
    0)."""
    saved = dt.SCAN_IN_HISTOGRAM_CHUNKS, dt.SCAN_TILE, dt.RECEIVED_SCAN_STEPS
    out = {}
    try:  # read as each call's tables are allocated and its launches bound
        dt.SCAN_IN_HISTOGRAM_CHUNKS, dt.SCAN_TILE = 2, 8
        for steps in (saved[2], 0):
            dt.RECEIVED_SCAN_STEPS = steps
            _, bounds = _bounds("DiT-MoE", 8 * 120 + 5, 5, 1, experts=2)
            tables = allocate_tables(bounds, 1408, "bf16", "meta")
            assert tables.scan_chunks == 4 and bounds.chunks == 8
            scanned = tables.routing(True, False, torch.int32).scanned_first(bounds.capacity)
            out["route_histogram" if scanned else "route_offsets"] = case_ep_rank(
                "DiT-MoE", "bf16", 8, 120, 5, 1, 3, counts=[120, 0, 110, 100, 90, 80, 70, 60])
    finally:
        dt.SCAN_IN_HISTOGRAM_CHUNKS, dt.SCAN_TILE, dt.RECEIVED_SCAN_STEPS = saved
    assert out["route_histogram"] == out["route_offsets"]
    assert out["route_histogram"]["arrivals"] == 630
    return out


def case_narrow_scales_by_layout_row() -> dict:
    """``route_quantize``'s launch after the tables (above ``QUANT_IN_HISTOGRAM_ROWS`` rows: 16
    here), DiT-MoE's 44-byte scales at the layout rows of each token's arrivals: 40 skewed
    tokens."""
    saved = dt.QUANT_IN_HISTOGRAM_ROWS
    try:  # the tables' default, read as each call's tables are allocated
        dt.QUANT_IN_HISTOGRAM_ROWS = 16
        return case_ep1("DiT-MoE", "fp8", 40, "skewed", 16, 2, 5)
    finally:
        dt.QUANT_IN_HISTOGRAM_ROWS = saved


def case_every_shape() -> dict:
    """Each model shape once, at two to four tokens (every expert with rows is a program of
    ``route_rows`` to interpret), alternating precision, programs and lead."""
    out = {}
    for i, model in enumerate(SHAPES):
        out[model] = case_ep1(model, ("bf16", "fp8")[i % 2], 2 + i % 3,
                              ("balanced", "skewed")[i % 2],
                              (5, 16, 132)[i % 3], 1 + i % 3, seed=i)
    return out


def case_work_deal_with_a_remainder() -> dict:
    """A shape no model has: P_1 = 5 Linear-1 tiles a row against w_1 = 2 P_2 work units, so the
    Linear-1 deal (``schedules.l1_deal``) has both early rounds (u >= 1) and a remainder
    (f > 0); the models' shapes give u = 0 or f = 0."""
    from xstage_lab.ops.moe.shapes import MoEShape
    from xstage_lab.ops.moe.schedules import MoEProblem, tile_work

    SHAPES["Synthetic"] = MoEShape("Synthetic", "u and f", 256, 640, 8, 2, "test")
    _, bounds = _bounds("Synthetic", 1, 7, 2)
    w1, w2 = tile_work(MoEProblem((), bounds.l1_n_blocks, bounds.l2_n_blocks))
    assert w2 // w1 >= 1 and w2 % w1 > 0, (w1, w2)
    return {s: case_ep1("Synthetic", "bf16", 40, s, 7, 2, seed=i)
            for i, s in enumerate(("balanced", "skewed"))}


def _with_tiny_arrivals(limit: int, cases: dict) -> dict:
    """``cases`` (name -> (function, *args)) run with ``device_tables.TINY_ARRIVALS`` and
    ``TINY_RECEIVED`` both ``limit``: up to ``limit`` arrivals (and never above ``block_m``) one
    launch (``route_tiny``) writes the tables they allocate."""
    from xstage_lab.ops.moe import device_tables

    saved = device_tables.TINY_ARRIVALS, device_tables.TINY_RECEIVED
    device_tables.TINY_ARRIVALS = device_tables.TINY_RECEIVED = limit
    try:
        return {name: fn(*args) for name, (fn, *args) in cases.items()}
    finally:
        device_tables.TINY_ARRIVALS, device_tables.TINY_RECEIVED = saved


def case_one_launch_up_to_block_m() -> dict:
    """``route_tiny`` at the most arrivals it takes, ``block_m`` (one skewed expert then holds a
    whole row block; DiT-MoE's 16 experts' row blocks over four tile programs, Qwen3.5's up to
    120 over thirty), an EP rank's received rows below its capacity, and, with no lower limit
    than ``block_m``, the launches above it."""
    return _with_tiny_arrivals(1 << 20, {
        "block_m_skewed": (case_ep1, "DiT-MoE", "bf16", 64, "skewed", 7, 3, 4),
        "qwen_fp8": (case_ep1, "Qwen3.5", "fp8", 12, "skewed", 132, 2, 6),
        "ep_rank_fp8": (case_ep_rank, "DiT-MoE", "fp8", 8, 14, 5, 1, 3),
        "above_block_m": (case_ep1, "DiT-MoE", "bf16", 65, "skewed", 7, 3, 4)})


def case_few_received_under_a_large_bound() -> dict:
    """An EP rank's 23 received rows under a bound of 101 (``route_tiny`` over 128 arrivals):
    its programs hold the 32 of ``TINY_FEW_RECEIVED``, and with that at 16 (fewer than the
    rows) all 128."""
    from xstage_lab.ops.moe import device_tables

    saved = device_tables.TINY_FEW_RECEIVED
    out = {}
    try:
        for few in (32, 16):
            device_tables.TINY_FEW_RECEIVED = few
            out[few] = case_ep_rank("Qwen3.5", "bf16", 8, 12, 16, 2, 5,
                                    counts=[3, 0, 4, 2, 5, 1, 6, 2])
    finally:
        device_tables.TINY_FEW_RECEIVED = saved
    assert out[32] == out[16] and out[32]["arrivals"] == 23
    return out


def case_launch_by_launch_at_few_arrivals() -> dict:
    """The three launches over the few arrivals that take ``route_tiny`` by default."""
    return _with_tiny_arrivals(0, {
        "one_token": (case_ep1, "DeepSeek-V4-Flash", "fp8", 1, "balanced", 132, 2),
        "zero_row_experts": (case_zero_row_experts,),
        "out_of_range_ids": (case_out_of_range_ids_are_flagged,),
        "ep_rank_few": (case_ep_rank, "MiMo-V2.5", "bf16", 8, 1, 16, 2)})


def case_tall_row_blocks() -> dict:
    """Tiles of 256 rows (the gluon_ws kernel's bf16 tiles for experts of several 128-row
    blocks): skewed DiT-MoE with experts of one to three row blocks, one token (``route_tiny``),
    an EP rank's received rows."""
    return {"skewed": case_ep1("DiT-MoE", "bf16", 300, "skewed", 7, 3, block_m=256),
            "one_token": case_ep1("DeepSeek-V4-Flash", "bf16", 1, "balanced", 132, 2,
                                  block_m=256),
            "ep_rank": case_ep_rank("MiMo-V2.5", "bf16", 8, 200, 16, 2, block_m=256)}


def case_first_launch_zeroes_the_output() -> dict:
    """``zeroed_hidden`` (a layer whose Linear-2 epilogues add into its output): the first
    routing launch zeroes the poisoned output ``[T, H]``: ``route_tiny``'s of DiT-MoE's 20
    tokens (40 picks, 28,160 elements: 14 programs of ``ZERO_BLOCK``, the last one partial) and
    of DeepSeek-V4-Flash's one token in FP8 (its quantizing programs after the zeroing ones),
    ``route_histogram``'s of DiT-MoE's 40 tokens (80 picks), in bf16 and in FP8 (its chunk's
    program, then the zeroing ones, then the quantizing ones), and writes the tables that the
    same routing writes without it, entry for entry; nothing past the output is touched."""
    out = {}
    for model, precision, tokens in (("DiT-MoE", "bf16", 20), ("DeepSeek-V4-Flash", "fp8", 1),
                                     ("DiT-MoE", "bf16", 40), ("DiT-MoE", "fp8", 40)):
        shape = SHAPES[model]
        ids = router_topk(router_logits(tokens, shape.routed_experts, "skewed", seed=6),
                          shape.top_k)[0]
        _, bounds = _bounds(model, tokens * shape.top_k, 16, 2)
        x = torch.randn(tokens, shape.hidden, generator=torch.Generator().manual_seed(6))
        x = x.to(torch.bfloat16)
        y = torch.full((tokens + 1, shape.hidden), float("nan"), dtype=torch.bfloat16)
        tables = allocate_tables(bounds, shape.hidden, precision, "cpu")
        routing = tables.routing(False, precision == "fp8", ids.dtype, shape.hidden)
        assert routing.tiny_at(ids.numel()) == (ids.numel() <= 64)
        routing(ids.numel(), shape.top_k, dt.slot_addresses(tables.args, expert_ids=ids, x=x,
                                                            out=y))
        assert (y[:tokens] == 0).all() and y[tokens:].isnan().all()
        rows = x.repeat_interleave(shape.top_k, dim=0)
        xq, xs = quantize_rows_fp8(rows) if precision == "fp8" else (rows, None)
        bad = table_mismatches(tables, host_tables(bounds, ids.reshape(-1), xq, xs,
                                                   top_k=shape.top_k))
        assert not bad, bad
        out[f"{model}-{precision}-{tokens}"] = int(tables.meta[1])
    return out


def interpreter_cases() -> dict:
    return {
        "every_shape": (case_every_shape,),
        "one_token": (case_ep1, "DeepSeek-V4-Flash", "fp8", 1, "balanced", 132, 2),
        "one_token_split_k": (case_one_token_split_k,),
        "lead_from_the_row_and_from_the_expert": (case_lead_from_the_row_and_from_the_expert,),
        "skewed_fp8": (case_ep1, "Hy3", "fp8", 12, "skewed", 16, 2, 5),
        # 80 arrivals (two launches) of 44-byte scales: route_histogram's quantizing programs
        "skewed_fp8_narrow_scales": (case_ep1, "DiT-MoE", "fp8", 40, "skewed", 16, 2, 5),
        "narrow_scales_by_layout_row": (case_narrow_scales_by_layout_row,),
        "zero_row_experts": (case_zero_row_experts,),
        "scan_in_steps": (case_scan_in_steps,),
        "one_step_scan_beyond_the_chunk_bound": (case_one_step_scan_beyond_the_chunk_bound,),
        "received_scan_in_steps_beyond_the_chunk_bound": (
            case_received_scan_in_steps_beyond_the_chunk_bound,),
        "ep_rank_bf16": (case_ep_rank, "MiMo-V2.5", "bf16", 8, 40, 16, 2),
        "ep_rank_fp8": (case_ep_rank, "DiT-MoE", "fp8", 8, 150, 5, 1, 3),
        "ep_rank_few": (case_ep_rank, "Hy3", "fp8", 8, 1, 16, 2, 4),
        "out_of_range_ids": (case_out_of_range_ids_are_flagged,),
        "work_deal_with_a_remainder": (case_work_deal_with_a_remainder,),
        "one_launch_up_to_block_m": (case_one_launch_up_to_block_m,),
        "few_received_under_a_large_bound": (case_few_received_under_a_large_bound,),
        "launch_by_launch_at_few_arrivals": (case_launch_by_launch_at_few_arrivals,),
        "tall_row_blocks": (case_tall_row_blocks,),
        "first_launch_zeroes_the_output": (case_first_launch_zeroes_the_output,),
    }


def test_scales_by_layout_row_where_a_rows_scales_are_narrower_than_a_line():
    assert scales_by_layout_row(SHAPES["DiT-MoE"].hidden)  # 11 scales: 44 bytes
    assert scales_by_layout_row(3968) and not scales_by_layout_row(4096)
    assert not any(scales_by_layout_row(s.hidden) for s in SHAPES.values() if s.hidden >= 4096)


def _compile_sm90(name: str, e_pad: int = 512, scan: bool = False, by_row: bool = True,
                  quantize: bool = True, arrivals: int = 128, zero_out: bool = False) -> dict:
    """One routing kernel built for sm_90 (as the op launches it on an H200); ``route_tiny``
    with ``e_pad`` experts over 128 arrivals of an EP rank or 32 where the count is that or less
    (512: from all pairs, 64: from the scan, with the 32 from all pairs), or over fewer
    ``arrivals`` at EP = 1 (16: a token's picks, each expert's count from all pairs);
    ``route_histogram`` over ``e_pad`` experts, with the scan in its last program where ``scan``
    (a step's chunks: ``scan_step_rows``), quantizing programs after its chunks' unless the
    scales lie ``by_row``; without ``quantize`` (a bf16 layer) ``x_quant`` and its scales are
    ``meta`` (int32), as the op passes them; ``zero_out``: the build zeroing the output."""
    import triton.language as tl
    from triton.compiler import ASTSource

    from tests.experiments.triton_testing import compile_sm90, ptxas_report
    from xstage_lab.kernel_sources import load_kernel_module
    from xstage_lab.ops.moe.device_tables import _jump_levels, scan_step_rows

    kernel = getattr(load_kernel_module("moe_routing"), name)
    ptr, i = "*i32", "i32"
    # the scan's and the layout's buffers and sizes (route_offsets', route_histogram's with SCAN)
    layout = {k: ptr for k in ("chunk_start", "expert_counts", "scan_done", "expert_offsets",
                               "wave_lo", "wave_hi", "wave_jumps", "meta", "wave_num_tiles",
                               "inter_num_tiles")}
    layout_ints = {k: i for k in ("CAPACITY", "NUM_EXPERTS", "WAVE_MIN_L1")}
    # the call's addresses, by value (the first launch writes the argument block)
    addresses = {k: "i64" for k in ("expert_ids", "x", "x_scale", "combine_rows",
                                    "topk_weights", "out")}
    quant = ({"x_quant": "*fp8e4nv", "x_quant_scale": "*fp32"} if quantize
             else {"x_quant": ptr, "x_quant_scale": ptr})
    signatures = {
        "route_histogram": ({"args": "*i64", **addresses, "n_arrivals_ptr": ptr,
                             "chunk_counts": ptr, "error": ptr, **quant, "arrival_rows": ptr,
                             **layout,
                             **layout_ints, "TOP_K": i, "HIDDEN": i},
                            dict(RECEIVED=False, QUANTIZE=quantize, SCALES_BY_ROW=by_row,
                                 E_PAD=e_pad,
                                 CHUNK=128, ID_DTYPE=tl.int64, SCAN=scan, BLOCK_M=128, G_PAD=256,
                                 E_LOG2=e_pad.bit_length() - 1,
                                 CHUNK_ROWS=scan_step_rows(e_pad),
                                 JUMP_LEVELS=_jump_levels(e_pad), JUMP_STRIDE=e_pad + 1,
                                 JUMP_PAD=2 * e_pad, QUANT_ROWS=32)),
        "route_offsets": ({"chunk_counts": ptr, "n_arrivals_ptr": ptr, **layout, **layout_ints},
                          dict(RECEIVED=True, BLOCK_M=128, E_PAD=512, E_BLOCK=4, G_PAD=256,
                               CHUNK=128, CHUNK_ROWS=1024, E_LOG2=9, JUMP_LEVELS=10,
                               JUMP_STRIDE=513, JUMP_PAD=1024)),
        "route_quantize": ({"args": "*i64", "n_arrivals_ptr": ptr, "x_quant": "*fp8e4nv",
                            "x_quant_scale": "*fp32", "arrival_rows": ptr, "CAPACITY": i,
                            "HIDDEN": i, "TOP_K": i},
                           dict(RECEIVED=False, BY_ROW=True, ROWS=32)),
        "route_rows": ({"args": "*i64",
                        **{k: ptr for k in ("arrival_src", "arrival_slot", "n_arrivals_ptr",
                                            "chunk_start", "expert_counts", "expert_offsets",
                                            "wave_lo", "wave_hi", "meta", "arrival_rows",
                                            "row_src", "row_slot", "row_origin", "row_ready",
                                            "wave_tiles", "inter_tiles")},
                        **{k: i for k in ("CAPACITY", "NUM_EXPERTS", "TOP_K", "WAVE_MIN_L1",
                                          "LEAD", "MAX_TILES")}},
                       dict(RECEIVED=False, CHUNK=128, ID_DTYPE=tl.int64, BLOCK_M=128,
                            E_PAD=256, P_PAD=16, EXPERT_LEAD=True)),
        "route_tiny": ({"args": "*i64", **addresses,
                        **{k: ptr for k in ("arrival_src", "arrival_slot", "n_arrivals_ptr",
                                            "expert_counts", "expert_offsets", "meta",
                                            "wave_num_tiles", "inter_num_tiles",
                                            "arrival_rows", "row_src", "row_slot",
                                            "row_origin", "row_ready", "wave_tiles",
                                            "inter_tiles", "error")},
                        **quant,
                        **{k: i for k in ("CAPACITY", "NUM_EXPERTS", "WAVE_MIN_L1", "LEAD",
                                          "MAX_TILES", "TOP_K", "HIDDEN")}},
                       dict(RECEIVED=arrivals == 128, QUANTIZE=quantize, BLOCK_M=128,
                            E_PAD=e_pad, A_PAD=arrivals, A_FEW=min(32, arrivals), G_PAD=256,
                            ID_DTYPE=tl.int32, P_PAD=16, ROW_BLOCKS=4,
                            TILE_PROGRAMS=min(arrivals, e_pad) // 4, QUANT_ROWS=32)),
    }
    signature, constexprs = signatures[name]
    if zero_out:
        signature = {**signature, "OUT_HIDDEN": i}
        constexprs = {**constexprs, "ZERO_OUT": True}
    if name != "route_quantize":  # the tables' geometry: an H200's 132 programs, 16-tile rows
        constexprs = {**constexprs, "G": 132, "P1": 16, "P2": 16}
    signature = {**signature, **{k: "constexpr" for k in constexprs}}
    names = kernel.arg_names
    # every pointer 16-byte aligned, as the launcher specializes torch's allocations
    aligned = {(names.index(k),): [["tt.divisibility", 16]]
               for k, v in signature.items() if v.startswith("*")}
    compiled = compile_sm90(ASTSource(kernel, signature,
                                      {(names.index(k),): v for k, v in constexprs.items()},
                                      attrs=aligned),
                            num_warps=8 if name in ("route_offsets", "route_tiny") or scan else 4)
    return {"has_cubin": bool(compiled.asm.get("cubin")), "shared": compiled.metadata.shared,
            **ptxas_report(compiled.asm["ptx"])}


COMPILE_CASES = {**{f"compile_sm90_{n}": (_compile_sm90, n)
                    for n in ("route_histogram", "route_offsets", "route_rows", "route_quantize",
                              "route_tiny")},
                 # the chunks' programs and the quantizing ones (scales by the rows of x)
                 "compile_sm90_route_histogram_quantizing": (_compile_sm90, "route_histogram",
                                                             512, False, False),
                 "compile_sm90_route_tiny_scan": (_compile_sm90, "route_tiny", 64),
                 # one token of Qwen3.5 at EP = 1: ten picks over 512 experts
                 "compile_sm90_route_tiny_one_token": (_compile_sm90, "route_tiny", 512, False,
                                                       True, True, 16),
                 # ... zeroing the output of a layer whose Linear-2 epilogues add into it
                 "compile_sm90_route_tiny_zeroing": (_compile_sm90, "route_tiny", 512, False,
                                                     True, True, 16, True),
                 # ... and route_histogram: the chunks', zeroing and quantizing programs
                 "compile_sm90_route_histogram_zeroing": (_compile_sm90, "route_histogram", 512,
                                                          False, False, True, 128, True),
                 # bf16 layers: nothing to quantize, x_quant an int32 stand-in
                 "compile_sm90_route_histogram_bf16": (_compile_sm90, "route_histogram", 512,
                                                       False, False, False),
                 "compile_sm90_route_histogram_scan_bf16": (_compile_sm90, "route_histogram",
                                                            256, True, True, False),
                 "compile_sm90_route_tiny_bf16": (_compile_sm90, "route_tiny", 64, False, True,
                                                  False),
                 "compile_sm90_route_histogram_scan": (_compile_sm90, "route_histogram", 256,
                                                       True),
                 # DiT-MoE's two experts of an EP = 8 rank: a step of 2048 chunks
                 "compile_sm90_route_histogram_scan_two_experts": (_compile_sm90,
                                                                   "route_histogram", 2, True)}

interpreter_results, test_interpreter_case = interpreter_case_tests(MODULE, interpreter_cases())


def test_routing_kernels_compile_for_sm90_without_spilling():
    """Every routing build compiles for sm_90 and keeps its registers: the scan's steps in
    ``route_histogram`` sized so (``scan_step_rows``)."""
    results = child_results(MODULE, "--compile-sm90", interpret=False, timeout=600)
    for name in COMPILE_CASES:
        assert_case_ok(results, name)
        detail = results[name]["detail"]
        assert detail["has_cubin"]
        assert detail["spill_store_bytes"] == detail["spill_load_bytes"] == 0, (name, detail)


def test_bounds_cover_every_row_a_routing_can_use():
    """The row blocks' bound covers every way of spreading up to ``capacity`` arrivals over the
    experts (each expert's rows padded to whole row blocks), and every row block's tiles fit
    either table."""
    from itertools import product

    from xstage_lab.ops.moe.device_tables import row_blocks_in_use

    for capacity, experts, block_m in ((5, 2, 4), (7, 3, 2), (9, 4, 4), (3, 5, 4)):
        worst = max(sum(-(-c // block_m) for c in counts)
                    for counts in product(range(capacity + 1), repeat=experts)
                    if sum(counts) <= capacity)
        assert worst <= row_blocks_in_use(capacity, experts, block_m), (capacity, experts)
    b = TableBounds(capacity=100, num_experts=7, block_m=128, l1_n_blocks=3, l2_n_blocks=2,
                    num_programs=5, lead_rows=1, expert_lead=False)
    assert b.row_blocks == 7 and b.rows == 7 * 128  # one partial row block per expert
    assert b.max_tiles * 5 >= b.row_blocks * 5
    assert b.chunks == 1


def test_linear2_tiles_split_along_k_only_where_they_leave_most_programs_idle():
    from xstage_lab.ops.moe.device_tables import l2_split_count, row_blocks_in_use

    # one partial row block per expert with rows, plus the full ones
    assert row_blocks_in_use(2, 16, 128) == 2 and row_blocks_in_use(300, 2, 128) == 4
    assert l2_split_count(22, 132, 88) == 6   # 15 K blocks a split, the last 13
    assert l2_split_count(11, 132, 44) == 11  # 4 each
    assert l2_split_count(11, 132, 88) == 11  # 12 wanted: 8 blocks a split cover 88 in 11
    assert l2_split_count(66, 132, 88) == 2 and l2_split_count(67, 132, 88) == 1
    assert l2_split_count(22, 132, 3) == 3    # at most one split a K block
    shape = SHAPES["DiT-MoE"]
    config = default_tile_config("bf16", "gluon_ws", hidden=shape.hidden)
    one_token = TableBounds.of(2, 16, shape.hidden, shape.intermediate, config, 132, 1,
                               split_k=True)
    assert (one_token.l2_splits, one_token.l2_n_blocks) == (6, 66)
    assert TableBounds.of(2, 16, shape.hidden, shape.intermediate, config, 132, 1).l2_splits == 1
    assert TableBounds.of(16, 16, shape.hidden, shape.intermediate, config, 132, 1,
                          split_k=True).l2_splits == 1  # 16 row blocks: 176 tiles


def test_the_scan_runs_in_the_histogram_up_to_one_steps_chunks():
    """``route_histogram``'s last program scans up to ``SCAN_IN_HISTOGRAM_CHUNKS`` chunks, or as
    many as one step takes (``SCAN_TILE`` counts where the experts are fewer than 64, else
    ``SCAN_ONE_TILE``), on an EP rank in the narrow steps as many as ``RECEIVED_SCAN_STEPS``
    steps take: the first launch of a call is the histogram with the scan there, else the
    histogram of the three launches."""
    from xstage_lab.ops.moe.device_tables import (SCAN_IN_HISTOGRAM_CHUNKS, SCAN_ONE_TILE,
                                                  SCAN_TILE, SCAN_WIDE_EXPERTS, scan_chunk_bound,
                                                  scan_step_rows)

    assert scan_chunk_bound(2) == scan_step_rows(2) == SCAN_TILE // 2 > SCAN_IN_HISTOGRAM_CHUNKS
    assert scan_chunk_bound(32) == SCAN_TILE // 32 and scan_chunk_bound(64) == SCAN_ONE_TILE // 64
    assert scan_chunk_bound(512) == scan_chunk_bound(300) == SCAN_IN_HISTOGRAM_CHUNKS
    # DiT-MoE's two experts of an EP = 8 rank at 512 tokens: 64 chunks, one step
    _, rank = _bounds("DiT-MoE", 8192, 132, 1, experts=2)
    routing = allocate_tables(rank, 1408, "bf16", "meta").routing(True, False, torch.int32)
    assert routing.first(8192, 1)[0] is routing.histograms[True, False]
    # Qwen3.5's 512 experts at 512 tokens: 40 chunks, more than one step
    _, ep1 = _bounds("Qwen3.5", 5120, 132, 1)
    routing = allocate_tables(ep1, 4096, "bf16", "meta").routing(False, False, torch.int32)
    assert routing.first(5120, 10)[0] is routing.histograms[False, False]
    # Hy3's 24 experts of an EP = 8 rank (narrow steps: SCAN_TILE counts over 32) at 768 tokens:
    # a bound of 384 chunks, three steps of 128 (the rows a rank receives from balanced routing:
    # 48 chunks), at 1024 tokens four; Qwen3.5's 64 (wide steps) route_offsets' launch at 512
    # tokens, its 320 chunks three steps too
    for model, experts, tokens, scanned in (("Hy3", 24, 768, True), ("Hy3", 24, 1024, False),
                                            ("Qwen3.5", 64, 512, False)):
        _, rank = _bounds(model, tokens * SHAPES[model].top_k * 8, 132, 1, experts=experts)
        routing = allocate_tables(rank, 4096, "bf16", "meta").routing(True, False, torch.int32)
        assert routing.scan_rows == 128 and routing.wide_scan == (experts >= SCAN_WIDE_EXPERTS)
        assert routing.first(rank.capacity, 1)[0] is routing.histograms[scanned, False]
    # at EP = 1 the steps never count: DiT-MoE's 16 experts (narrow, 256 chunks a step) over
    # 313 chunks, above its scan_chunks
    _, ep1 = _bounds("DiT-MoE", 40000, 132, 1)
    routing = allocate_tables(ep1, 1408, "bf16", "meta").routing(False, False, torch.int32)
    assert routing.scan_rows == 256 and not routing.scanned_first(ep1.capacity)
    # the three launches where the tables say so (route_small_probe's path): two chunks, each a
    # step where the tables scan no chunks in the histogram (Hy3's rank)
    _, rank = _bounds("Hy3", 768 * 8 * 8, 132, 1, experts=24)
    assert [allocate_tables(rank, 4096, "bf16", "meta", scan_chunks=0, received_scan_steps=steps)
            .routing(True, False, torch.int32).scanned_first(256) for steps in (None, 0)] == \
        [True, False]


def test_the_first_launch_quantizes_a_few_rows_by_the_rows_of_x():
    """An FP8 layer's bf16 tokens are quantized by the first launch's own programs up to
    ``QUANT_IN_HISTOGRAM_ROWS`` rows, their scales by the rows of ``x`` (route_tiny's or
    route_histogram's, one program a block after the tables'); above them by ``route_quantize``
    after the tables, by layout row where they are narrower than a line (DiT-MoE's)."""
    from xstage_lab.ops.moe.device_tables import QUANT_IN_HISTOGRAM_ROWS

    def routing(model, tokens, precision="fp8"):
        shape, bounds = _bounds(model, tokens * SHAPES[model].top_k, 132, 1)
        return allocate_tables(bounds, shape.hidden, precision, "meta").routing(
            False, precision == "fp8", torch.int32)

    over = QUANT_IN_HISTOGRAM_ROWS + 1
    hy3 = routing("Hy3", over)  # top-8: 8 tokens route_tiny's
    assert [hy3.quantized_first(8 * t, 8) for t in (8, 12, QUANT_IN_HISTOGRAM_ROWS, over)] == \
        [True, True, True, False]
    launch, grid = hy3.first(8 * 12, 8)
    assert launch is hy3.histograms[True, False] and grid == (1 + 32,)  # 1 chunk, 32 blocks
    assert hy3.first(8 * over, 8)[1] == (33,)  # 33 chunks only
    dit = routing("DiT-MoE", over)  # 11 scales a row: by layout row above the bound
    assert dit.quantized_first(2 * 40, 2) and not dit.quantized_first(2 * over, 2)
    assert dit.first(2 * 40, 2)[0] is dit.histograms[True, False]
    assert dit.first(2 * over, 2)[0] is dit.histograms[True, True]  # 9 chunks: the scan
    assert not routing("Hy3", 12, "bf16").quantized_first(8 * 12, 8)


def test_each_quantizing_program_takes_one_scale_block_of_its_rows():
    assert quant_grid(1, 4096) == (1, 32)
    assert quant_grid(8192, 4096) == (256, 32)
    assert quant_grid(33, 1408) == (2, 11)  # DiT-MoE: 11 scale blocks


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:], interpreter_cases(), COMPILE_CASES))


def test_rows_the_tables_cannot_take_are_refused_before_any_launch():
    _, bounds = _bounds("DiT-MoE", 8, 4, 1)
    tables = allocate_tables(bounds, 1408, "fp8", "cpu")
    args = tables.args.clone()
    x = torch.zeros(8, 1408).to(torch.float8_e4m3fn)
    with pytest.raises(MoEContractError, match="scales"):
        route_to_tables(tables, torch.zeros(8, dtype=torch.int32), x,
                        n_arrivals=torch.tensor([8], dtype=torch.int32),
                        arrival_src=torch.zeros(8, dtype=torch.int32),
                        arrival_slot=torch.arange(8, dtype=torch.int32))
    assert torch.equal(tables.args, args)  # nothing written
    # tables without a quantized copy refuse bf16 rows
    tables = allocate_tables(bounds, 1408, "fp8", "cpu", source_rows=0)
    with pytest.raises(MoEContractError, match="quantize no bf16 rows"):
        route_to_tables(tables, torch.zeros(8, dtype=torch.int32), x.to(torch.bfloat16),
                        n_arrivals=torch.tensor([8], dtype=torch.int32),
                        arrival_src=torch.zeros(8, dtype=torch.int32),
                        arrival_slot=torch.arange(8, dtype=torch.int32))
