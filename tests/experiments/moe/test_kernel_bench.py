"""The single-GPU MoE benchmark's host side on CPU: one rank's EP = 8 workload and its layout, the
unfused grouped-GEMM path, FLOP counting, a whole run with a stand-in for the fused launch and for
the CUDA timing, the record it imports as, the summary and the options.

CPU torch has ``torch._grouped_mm`` (used as is) but no kernel for ``torch._scaled_grouped_mm``:
the ``grouped_loop`` fixture stands in for it with a float32 loop over the groups, after the op's
own meta kernel has checked each call's dtypes, strides, scale shapes and offsets. That loop is a
test helper only; the benchmark has no such fallback.
"""
from __future__ import annotations

import ctypes
import json
import math
from datetime import datetime

import numpy as np
import pandas as pd
import pytest
import torch

from xstage_lab.checks import relative_error
from xstage_lab.experiments import harness
from xstage_lab.experiments.moe import kernel_bench as kb, kernel_cell as kc, kernel_rows as kr
from xstage_lab.analysis.moe import kernel_view as kv
from xstage_lab.experiments.moe.bench import TOLERANCE
from xstage_lab.ops.moe.combine import combine_weighted_sum
from xstage_lab.ops.moe.dispatch import DispatchLayout
from xstage_lab.ops.moe.fused import prepare_fused_moe
from xstage_lab.ops.moe.reference import expert_rows_reference, reference_moe, swiglu
from xstage_lab.ops.moe.routing import router_logits, router_topk
from xstage_lab.ops.moe.schedules import L1, L2
from xstage_lab.ops.moe.shapes import (FP8_SCALE_BLOCK, MoEContractError, MoEShape, PRECISIONS,
                                       load_shapes)
from xstage_lab.ops.moe.unfused import (GroupedWeights, UNFUSED_FP8_RECIPE, UNFUSED_IMPL,
                                        UnfusedPathError, group_offsets, grouped_expert_ffn,
                                        unfused_activations, unfused_expert_weights, unfused_impl)
from xstage_lab.ops.moe.weights import dequantize_blocks_fp8, dequantize_rows_fp8, quantize_rows_fp8
from xstage_lab.records import import_bench_json, read_record

# Four experts' worth of structure at EP = 8 (two local experts per rank), fp8-compatible widths.
TINY = MoEShape("Tiny", "tiny", 256, 128, 16, 2, "test")
TOKENS = 16
SEED = 3


@pytest.fixture
def grouped_loop(monkeypatch):
    """``torch._scaled_grouped_mm`` as a per-group float32 loop behind the real op's meta checks;
    the unfused path's probe cache emptied before and after."""
    real = torch._scaled_grouped_mm

    def loop(a, b, scale_a, scale_b, offs=None, out_dtype=None):
        real(a.to("meta"), b.to("meta"), scale_a.to("meta"), scale_b.to("meta"),
             offs=offs.to("meta"), out_dtype=out_dtype)  # raises where the call breaks the contract
        out = torch.empty(a.shape[0], b.shape[2], dtype=out_dtype)
        start = 0
        for g, end in enumerate(offs.tolist()):
            out[start:end] = ((a[start:end].float() * scale_a[start:end, None])
                              @ (b[g].float() * scale_b[g])).to(out_dtype)
            start = end
        return out

    monkeypatch.setattr(torch, "_scaled_grouped_mm", loop)
    monkeypatch.setattr("xstage_lab.ops.moe.unfused._UNFUSED_CHECKED", set())
    yield loop


def expert_of_rows(layout: DispatchLayout) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(len(layout.blocks_per_expert)),
                                   torch.tensor(layout.blocks_per_expert) * layout.block_m)


# ------------------------------------------------------------------------------------ workload

@pytest.mark.parametrize("rank", [0, 5])
def test_workload_receives_every_pick_of_its_experts_source_by_source(rank):
    wl = kc.build_workload(TINY, "skewed", TOKENS, seed=SEED, rank=rank)
    per_rank = TINY.routed_experts // kc.EP
    assert wl.world == kc.EP and wl.experts_per_rank == per_rank and wl.slots == TOKENS * TINY.top_k
    off = np.concatenate(([0], np.cumsum(wl.recv_counts)))
    for s in range(kc.EP):
        ids = router_topk(router_logits(TOKENS, TINY.routed_experts, "skewed", seed=SEED,
                                                rank=s), TINY.top_k)[0]
        assert torch.equal(wl.topk_ids[s], ids)
        flat = ids.reshape(-1)
        mine = (flat // per_rank == rank).nonzero(as_tuple=True)[0]
        part = slice(int(off[s]), int(off[s + 1]))
        assert wl.recv_counts[s] == len(mine)
        # Dispatch's send order: by expert, then by slot
        order = sorted(mine.tolist(), key=lambda slot: (int(flat[slot]), slot))
        assert wl.recv_slot[part].tolist() == order
        assert torch.equal(wl.recv_expert[part], flat[order] - rank * per_rank)
        tokens = torch.tensor(order, dtype=torch.long) // TINY.top_k
        assert torch.equal(wl.recv_x[part], wl.x[s][tokens])
    assert wl.rows == sum(wl.recv_counts) > 0


@pytest.mark.parametrize("precision", PRECISIONS)
def test_layout_pads_each_expert_and_keeps_source_and_slot(precision):
    wl = kc.build_workload(TINY, "balanced", TOKENS, seed=SEED)
    block_m = 8
    layout = kc.fused_layout(wl, precision, block_m)
    counts = torch.bincount(wl.recv_expert, minlength=wl.experts_per_rank).tolist()
    assert list(layout.tokens_per_expert) == counts
    assert layout.num_rows == sum(-(-c // block_m) for c in counts) * block_m
    src = torch.repeat_interleave(torch.arange(kc.EP), torch.tensor(wl.recv_counts))
    arrived = layout.arrival_rows
    assert torch.equal(layout.row_src[arrived].long(), src)
    assert torch.equal(layout.row_slot[arrived].long(), wl.recv_slot)
    assert torch.equal(expert_of_rows(layout)[arrived], wl.recv_expert)
    padding = torch.ones(layout.num_rows, dtype=torch.bool)
    padding[arrived] = False
    assert (layout.row_slot[padding] == -1).all()
    assert (layout.x[padding].view(torch.uint8) == 0).all()
    if precision == "fp8":
        assert layout.x_scale.shape == (layout.num_rows, TINY.hidden // FP8_SCALE_BLOCK)
        x = dequantize_rows_fp8(layout.x[arrived], layout.x_scale[arrived])
        assert relative_error(x, wl.recv_x) < 0.05
    else:
        assert torch.equal(layout.x[arrived], wl.recv_x)
    for e in range(wl.experts_per_rank):  # inside an expert, arrival order: source, then slot
        mine = arrived[wl.recv_expert == e]
        assert torch.equal(mine, mine.sort().values)
    rows, dest = kc.combine_index(layout, wl.slots)
    assert torch.equal(rows, arrived) and torch.equal(dest, src * wl.slots + wl.recv_slot)


def test_unfused_layout_has_one_scale_per_row():
    wl = kc.build_workload(TINY, "balanced", TOKENS, seed=SEED)
    layout = kc.unfused_layout(wl, "fp8", 8)
    assert layout.x.dtype == torch.float8_e4m3fn and layout.x_scale.shape == (layout.num_rows, 1)
    assert torch.equal(group_offsets(layout),
                       torch.tensor(np.cumsum(layout.blocks_per_expert) * 8, dtype=torch.int32))
    assert kc.unfused_layout(wl, "bf16", 8).x_scale is None


# ---------------------------------------------------------------------------- unfused path

def _loop_ffn(layout: DispatchLayout, w: GroupedWeights) -> torch.Tensor:
    """The unfused recipe expert by expert in float32, rounding where the grouped path rounds."""
    def deq(q, s):
        return q.float() if s is None else q.float() * s

    x = deq(layout.x, layout.x_scale)
    experts = expert_of_rows(layout)
    y = torch.zeros(layout.num_rows, w.hidden, dtype=torch.bfloat16)
    for e in range(w.num_experts):
        rows = experts == e
        w1 = deq(w.w1[e], None if w.w1_scale is None else w.w1_scale[e][:, None])
        w2 = deq(w.w2[e], None if w.w2_scale is None else w.w2_scale[e][:, None])
        h = swiglu((x[rows] @ w1.t()).to(torch.bfloat16))
        h = deq(*unfused_activations(h, w.precision))
        y[rows] = (h @ w2.t()).to(torch.bfloat16)
    return y


@pytest.mark.parametrize("precision", PRECISIONS)
def test_grouped_ffn_matches_a_per_expert_loop(precision, grouped_loop):
    wl = kc.build_workload(TINY, "skewed", TOKENS, seed=SEED)
    layout = kc.unfused_layout(wl, precision, 8)
    w = unfused_expert_weights(TINY, 0, kc.EP, precision, seed=SEED)
    if precision == "fp8":
        assert w.w1_scale.shape == (2, 2 * TINY.intermediate) and w.w2_scale.shape == (2, TINY.hidden)
    y = grouped_expert_ffn(layout, w)
    assert y.dtype == torch.bfloat16 and y.shape == (layout.num_rows, TINY.hidden)
    assert relative_error(y, _loop_ffn(layout, w)) < 1e-2
    assert unfused_impl(torch.device("cpu"), precision) == UNFUSED_IMPL[precision]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_unfused_layer_matches_the_reference(precision, grouped_loop):
    """All eight ranks' grouped FFNs, Combine emulated by scattering into the eight sources'
    buffers: every source's weighted sum against ``reference_moe``."""
    combine = torch.full((kc.EP, TOKENS * TINY.top_k, TINY.hidden), float("nan"),
                         dtype=torch.bfloat16)
    for rank in range(kc.EP):
        wl = kc.build_workload(TINY, "skewed", TOKENS, seed=SEED, rank=rank)
        layout = kc.unfused_layout(wl, precision, 8)
        y = grouped_expert_ffn(layout, unfused_expert_weights(TINY, rank, kc.EP, precision,
                                                                      seed=SEED))
        rows, dest = kc.combine_index(layout, wl.slots)
        combine.view(-1, TINY.hidden)[dest] = y[rows]
    for s in range(kc.EP):
        out = combine_weighted_sum(combine[s], wl.topk_w[s])
        ref = reference_moe(wl.x[s], wl.topk_ids[s], wl.topk_w[s], TINY, seed=SEED,
                                precision=precision)
        assert relative_error(out, ref["fp32"]) <= TOLERANCE[precision]["fp32"]


def test_reference_moe_is_the_weighted_sum_of_expert_rows():
    wl = kc.build_workload(TINY, "skewed", TOKENS, seed=SEED)
    x, ids, w = wl.x[1], wl.topk_ids[1], wl.topk_w[1]
    ref = reference_moe(x, ids, w, TINY, seed=SEED, precision="fp8")
    tok = torch.arange(TOKENS).repeat_interleave(TINY.top_k)
    rows = expert_rows_reference(x[tok], ids.reshape(-1), TINY, seed=SEED, precision="fp8")
    for kind in ("fp32", "fp8_emulated"):
        want = (rows[kind].view(TOKENS, TINY.top_k, -1) * w[..., None]).sum(1)
        assert torch.allclose(ref[kind], want, rtol=1e-5, atol=1e-5)


def test_missing_or_wrong_grouped_gemm_is_an_error(monkeypatch):
    monkeypatch.setattr("xstage_lab.ops.moe.unfused._UNFUSED_CHECKED", set())
    with pytest.raises(UnfusedPathError, match="_scaled_grouped_mm"):
        unfused_impl(torch.device("cpu"), "fp8")  # no CPU kernel, and no loop stands in
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, offs: torch.zeros(a.shape[0], b.shape[2],
                                                                               dtype=a.dtype))
    with pytest.raises(UnfusedPathError, match="wrong"):
        unfused_impl(torch.device("cpu"), "bf16")


def test_grouped_ffn_refuses_the_fused_kernels_fp8_rows(grouped_loop):
    wl = kc.build_workload(TINY, "balanced", TOKENS, seed=SEED)
    w = unfused_expert_weights(TINY, 0, kc.EP, "fp8", seed=SEED)
    with pytest.raises(MoEContractError, match="unfused_activations"):
        grouped_expert_ffn(kc.fused_layout(wl, "fp8", 8), w)


# ------------------------------------------------------------------------------------- FLOPs

def test_flops_and_tflops():
    assert kr.moe_flops(3, 256, 128) == 2 * 3 * 256 * 2 * 128 + 2 * 3 * 128 * 256 == 6 * 3 * 256 * 128
    assert kr.tflops(10**12, 1e6) == pytest.approx(1.0)
    assert math.isnan(kr.tflops(1, 0.0))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_dense_ceiling_runs_the_ffn_shapes(precision):
    a, b = kr.dense_ceiling(24, TINY.hidden, TINY.intermediate, precision, seed=1, device="cpu")()
    assert a.shape == (24, 2 * TINY.intermediate) and b.shape == (24, TINY.hidden)
    assert a.dtype == b.dtype == torch.bfloat16


# ------------------------------------------------------- a whole run with stand-ins for the GPU

def _buffer_at(ptr: int, slots: int, hidden: int) -> torch.Tensor:
    """The bf16 ``[slots, hidden]`` CPU tensor at address ``ptr`` (a peer table entry)."""
    raw = (ctypes.c_char * (slots * hidden * 2)).from_address(ptr)
    return torch.frombuffer(raw, dtype=torch.bfloat16).view(slots, hidden)


class EmulatedLaunch:
    """Stands in for a FusedMoECall on CPU: the kernel's arithmetic in float32 (fp8: the W8A8
    steps of the quantization-matched reference), each routed row stored into its source's
    Combine buffer through the peer table, as the kernel stores it. ``fault``: what a broken
    schedule would do (``skip`` a row, ``perturb`` one)."""

    def __init__(self, layout, weights, schedule, peers, fault=None):
        self.layout, self.weights, self.peers = layout, weights, peers
        self.fault = fault if schedule.name == "interleaved" else None

    def __call__(self):
        lay, w = self.layout, self.weights
        fp8 = w.precision == "fp8"
        x = dequantize_rows_fp8(lay.x, lay.x_scale) if fp8 else lay.x.float()
        experts = expert_of_rows(lay)
        rows = lay.arrival_rows
        if self.fault == "skip":
            rows = rows[1:]
        for r in rows.tolist():
            e = int(experts[r])
            w1 = dequantize_blocks_fp8(w.w1[e], w.w1_scale[e]) if fp8 else w.w1[e].float()
            w2 = dequantize_blocks_fp8(w.w2[e], w.w2_scale[e]) if fp8 else w.w2[e].float()
            h = swiglu(x[r:r + 1] @ w1.t())
            h = (dequantize_rows_fp8(*quantize_rows_fp8(h)) if fp8
                 else h.to(torch.bfloat16).float())
            y = (h @ w2.t()).to(torch.bfloat16)
            if self.fault == "perturb" and r == int(rows[0]):
                y = y * 1.01
            src, slot = int(lay.row_src[r]), int(lay.row_slot[r])
            _buffer_at(self.peers.ptrs[src], self.peers.slots, self.peers.hidden)[slot] = y[0]

    def error_count(self) -> int:
        return 0


def fake_time_methods(methods, *, trials, warmup, graph_iters, eager, clocks):
    """Each method called once (they must run); made-up times, 100 + i us, Interleaved's the
    fastest (the kernel's TF/s stay Expert-Wave's), no clock."""
    assert clocks and eager <= set(kr.TIMED) and graph_iters >= 1 and warmup >= 0
    out = {}
    for i, (name, fn) in enumerate(methods.items()):
        fn()
        us = 50.0 if name == "kernel_interleaved" else 100.0 + i
        out[name] = {"median_us": us, "p25_us": us - 1, "p75_us": us + 1, "trials_us": [us] * trials,
                     "sm_clock_mhz": [None] * trials}
    return out


def parse(argv):
    return harness.parse(kb.EXPERIMENT, argv)


def cells(args) -> list[tuple]:
    """(model, precision, routing, tokens) of every timed cell of the sweep, in run order."""
    sweep, = kb.EXPERIMENT.sweeps(args)
    return [(p["model"], p["precision"], p["routing"], p["tokens"]) for p in sweep.points()
            if p["kind"] == "cell"]


@pytest.fixture
def cpu_bench(monkeypatch, grouped_loop, tmp_path):
    """The experiment run by the harness on CPU (``MoEKernel(device="cpu")``): the Tiny shape as
    the only model, the real contract check of ``prepare_fused_moe`` with an EmulatedLaunch
    returned, the fake timing. Returns ``(args, set_fault)``."""
    monkeypatch.setattr(kb, "load_shapes", lambda: {"Tiny": TINY})
    real_prepare = prepare_fused_moe
    fault = {"kind": None}

    def prepare(layout, weights, schedule, peers, **kw):
        real_prepare(layout, weights, schedule, peers, **kw)
        return EmulatedLaunch(layout, weights, schedule, peers, fault["kind"])

    for module in (kc, kr):
        monkeypatch.setattr(module, "prepare_fused_moe", prepare)
    monkeypatch.setattr(kr, "time_methods", fake_time_methods)
    args = parse(["--out", str(tmp_path / "bench.json"), "--models", "Tiny", "--routing",
                  "skewed", "--tokens", str(TOKENS), "--kernel", "triton", "--programs", "4",
                  "--trials", "3", "--seed", str(SEED), "--no-trace", "--no-progress"])
    return args, lambda kind: fault.update(kind=kind)


def test_run_checks_times_and_imports_as_a_record(cpu_bench, tmp_path, monkeypatch):
    args, _ = cpu_bench
    assert harness.run(kb.MoEKernel(device="cpu"), args) == args.out
    doc = json.loads(args.out.read_text())
    rows, meta = doc["rows"], doc["metadata"]
    assert [(r["model"], r["precision"], r["routing"], r["tokens"], r["kind"]) for r in rows] == \
        [("Tiny", "bf16", "skewed", TOKENS, "cell"), ("Tiny", "fp8", "skewed", TOKENS, "cell")]
    assert meta["experiment"] == "moe_kernel" and meta["world_size"] == 1 and \
        meta["tile_configs"]["Tiny"].keys() == {"bf16", "fp8"}
    for r in rows:
        assert r["spin_errors"] == {"wave": 0, "interleaved": 0} and r["stray_rows"] == 0
        for kind, bound in TOLERANCE[r["precision"]].items():
            assert r[f"max_row_rel_err_{kind}"] <= bound
        assert r["max_row_rel_err_unfused_fp32"] <= TOLERANCE[r["precision"]]["fp32"]
        flops, padded = (kr.moe_flops(r[k], TINY.hidden, TINY.intermediate)
                         for k in ("rows", "padded_rows"))
        us = r["kernel_wave_us"]
        assert r["tflops"] == r["kernel_wave_tflops"] == pytest.approx(flops / (us * 1e6))
        assert r["kernel_wave_tflops_padded"] == pytest.approx(padded / (us * 1e6))
        assert r["ratio_to_cublas"] == pytest.approx(r["tflops"] / r["cublas_dense_tflops"])
        assert r["padded_rows"] % r["tile_config"]["block_m"] == 0 and r["padded_rows"] >= r["rows"]
        assert r["unfused_impl"] == UNFUSED_IMPL[r["precision"]]
        assert all(f"{m}_p25_us" in r and f"{m}_p75_us" in r for m in kr.TIMED)
    overhead = meta["call_overhead"]
    assert overhead["tokens_per_source"] == 1
    assert [(o["precision"], o["tokens"]) for o in overhead["rows"]] == [("bf16", 1), ("fp8", 1)]
    assert all(f"{m}_us" in o for o in overhead["rows"] for m in kr.OVERHEAD_METHODS)
    # the one-token calls' rows as measured: none of a cell's columns, no sweep tags
    assert not any("cublas_dense_us" in o or "point" in o or "call_overhead" in o
                   for o in overhead["rows"])
    assert "call_overhead" not in rows[0]
    assert meta["unfused_fp8_recipe"] == UNFUSED_FP8_RECIPE and meta["kernel"] == "triton"

    # the JSON as written, with the provenance of one H200, imports as a moe_kernel record
    doc["metadata"]["provenance"].update(gpu_name="NVIDIA H200", gpu_count=1)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc, indent=1, default=str))
    rec = read_record(import_bench_json(path, "moe_kernel", root=tmp_path / "records"))
    assert rec.platform == "h200-x1" and len(rec.table) == 2
    assert rec.params["call_overhead"] == json.loads(json.dumps(overhead, default=str))
    from_record = kv.kernel_summary(rec.table, rec.params["call_overhead"])
    assert from_record == kv.kernel_summary(pd.DataFrame(rows), overhead)
    assert kv.summary_entry("h200-x1", tmp_path / "records") == from_record
    assert set(from_record["rows"][0]) == set(kv.SUMMARY_KEYS)


@pytest.mark.parametrize("fault, message", [("skip", "error inf"), ("perturb", "differ")])
def test_a_wrong_schedule_aborts_before_timing(cpu_bench, fault, message, monkeypatch, capsys):
    args, set_fault = cpu_bench
    set_fault(fault)
    timed = []
    monkeypatch.setattr(kr, "time_methods", lambda *a, **k: timed.append(1))
    with pytest.raises(SystemExit, match="correctness failed"):
        harness.run(kb.MoEKernel(device="cpu"), args)
    assert message in capsys.readouterr().err
    assert not timed and not args.out.exists()


def test_the_sweep_puts_each_one_token_call_after_its_cells():
    a = parse(["--out", "x.json", "--models", "Qwen3.5", "DiT-MoE", "--precisions", "fp8",
               "--routing", "balanced", "skewed", "--tokens", "64"])
    sweep, = kb.EXPERIMENT.sweeps(a)
    assert [a.name for a in sweep.axes] == ["model", "precision", "cell"]
    assert [(p["model"], p["kind"], p["routing"], p["tokens"]) for p in sweep.points()] == [
        ("Qwen3.5", "cell", "balanced", 64), ("Qwen3.5", "cell", "skewed", 64),
        ("Qwen3.5", "call_overhead", kb.OVERHEAD_ROUTING, kb.OVERHEAD_TOKENS),
        ("DiT-MoE", "cell", "balanced", 64), ("DiT-MoE", "cell", "skewed", 64),
        ("DiT-MoE", "call_overhead", kb.OVERHEAD_ROUTING, kb.OVERHEAD_TOKENS)]


def test_one_token_calls_move_to_the_header():
    """``finish`` keeps the cells' rows (without the one-token column) and the one-token rows
    as measured, in run order; a chunk without one-token calls leaves them empty."""
    exp = kb.MoEKernel()
    table = pd.DataFrame([{"kind": "cell", "model": "A", "kernel_wave_us": 1.0},
                          {"kind": "call_overhead", "model": "A",
                           "call_overhead": {"model": "A", "g_wave_us": math.nan}},
                          {"kind": "cell", "model": "B", "kernel_wave_us": 2.0},
                          {"kind": "call_overhead", "model": "B", "call_overhead": {"model": "B"}}])
    kept = exp.finish(table, None)
    assert kept.to_dict("records") == [{"kind": "cell", "model": "A", "kernel_wave_us": 1.0},
                                       {"kind": "cell", "model": "B", "kernel_wave_us": 2.0}]
    assert [o["model"] for o in exp.call_overhead] == ["A", "B"]
    assert math.isnan(exp.call_overhead[0]["g_wave_us"]) and "g_wave_us" not in exp.call_overhead[1]
    only_cells = exp.finish(table.iloc[[0]].drop(columns="call_overhead"), None)
    assert len(only_cells) == 1 and exp.call_overhead == []


# ------------------------------------------------------------------------------------ summary

def test_summary_geomean_is_expert_waves_where_the_schedules_differ():
    """Interleaved faster in one cell and slower in the other: the geomean over cells is
    Expert-Wave's TF/s over cuBLAS's, whichever schedule is faster."""
    cublas_us, wave_us, int_us = (100.0, 100.0), (125.0, 200.0), (100.0, 250.0)
    table = pd.DataFrame([dict(model=m, precision="bf16", routing="balanced", tokens=4096,
                               kernel_wave_us=w, kernel_interleaved_us=i, cublas_dense_us=c,
                               tflops=1e4 / w, kernel_wave_tflops=1e4 / w,
                               kernel_interleaved_tflops=1e4 / i, cublas_dense_tflops=1e4 / c,
                               ratio_to_cublas=c / w, ratio_to_cublas_interleaved=c / i,
                               call_wave_us=w, grouped_mm_tflops=1.0, unfused_us=1.0)
                          for m, c, w, i in zip("AB", cublas_us, wave_us, int_us)])
    s = kv.kernel_summary(table, {"rows": []})
    assert s["geomean_ratio_to_cublas"]["bf16"] == round(math.sqrt(0.8 * 0.5), 4)


def test_summary_of_a_hand_made_table():
    common = dict(routing="balanced", tokens=4096, kernel_wave_us=1.0, kernel_interleaved_us=1.0,
                  call_wave_us=2.0, grouped_mm_tflops=100.0, unfused_us=3.0)
    table = pd.DataFrame([
        dict(model="A", precision="bf16", tflops=400.0, cublas_dense_tflops=500.0, **common),
        dict(model="B", precision="bf16", tflops=300.0, cublas_dense_tflops=600.0, **common),
        dict(model="A", precision="fp8", tflops=900.0, cublas_dense_tflops=1000.0, **common)])
    overhead = {"rows": [dict(model="A", precision="bf16", kernel_wave_us=20.0, call_wave_us=40.0),
                         dict(model="B", precision="bf16", kernel_wave_us=25.0, call_wave_us=35.0),
                         dict(model="A", precision="fp8", kernel_wave_us=30.0, call_wave_us=45.0)]}
    s = kv.kernel_summary(table, overhead)
    assert s["geomean_ratio_to_cublas"] == {"bf16": round(math.sqrt(0.8 * 0.5), 4), "fp8": 0.9}
    assert s["call_overhead_us"] == {"bf16": {"kernel_us": 25.0, "call_us": 40.0},
                                     "fp8": {"kernel_us": 30.0, "call_us": 45.0}}
    assert s["rows"][1] == {"model": "B", "precision": "bf16", "routing": "balanced", "tokens": 4096,
                            "kernel_wave_us": 1.0, "kernel_interleaved_us": 1.0, "call_wave_us": 2.0,
                            "tflops": 300.0, "cublas_dense_tflops": 600.0,
                            "grouped_mm_tflops": 100.0, "unfused_us": 3.0}
    only_bf16 = kv.kernel_summary(table[table.precision == "bf16"], overhead)
    assert only_bf16["geomean_ratio_to_cublas"]["fp8"] is None


# ------------------------------------------------------------------------------------ options

def test_defaults_and_smoke():
    a = parse(["--out", "x.json"])
    assert a.tokens == [4096, 8192] and a.kernel == "gluon_ws" and a.trials == kb.DEFAULT_TRIALS
    assert set(a.models) == set(load_shapes()) and len(cells(a)) == 7 * 2 * 2 * 2
    s = parse(["--out", "x.json", "--smoke"])
    assert cells(s) == [("DeepSeek-V4-Flash", "bf16", "balanced", 512),
                           ("DeepSeek-V4-Flash", "fp8", "balanced", 512)]
    assert s.trials < kb.DEFAULT_TRIALS


@pytest.mark.parametrize("bad", [["--models", "NoSuchModel"], ["--precisions", "fp4"],
                                 ["--routing", "uniform"], ["--tokens", "0"], ["--tokens", "x"],
                                 ["--trials", "0"], ["--kernel", "cutlass"], ["--warmup", "-1"],
                                 ["--graph-iters", "0"], ["--programs", "0"],
                                 ["--smoke", "--models", "Qwen3.5"]])
def test_bad_options_are_refused_before_any_cuda_work(bad, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("CUDA touched"))
    with pytest.raises(SystemExit) as e:
        harness.main(kb.EXPERIMENT, ["--out", "x.json", *bad])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_burst_gaps_run_from_one_linear2_epilogue_to_the_next():
    """Program 0: L2 (epilogue 10-12 µs), L1, L2 (epilogue 30-31), L2 (epilogue 35-36): gaps 18
    and 4 µs. Program 1: one Linear-2 tile, no gap."""
    tiles = pd.DataFrame({"program": [0, 0, 0, 0, 1], "position": [0, 1, 2, 3, 0],
                          "kind": [L2, L1, L2, L2, L2],
                          "t2_us": [10.0, 20.0, 30.0, 35.0, 5.0],
                          "t3_us": [12.0, 21.0, 31.0, 36.0, 6.0]})
    assert kr.burst_gaps(tiles).tolist() == [18.0, 4.0]
    assert kr.burst_gaps(tiles[tiles["kind"] == L1]).empty


def _doc(model: str, commit: str = "abc") -> dict:
    meta = {"kernel": "gluon_ws", "timing": "t", "tolerance": {"bf16": 1}, "wall_s": 2.0,
            "tile_configs": {model: {"bf16": {}}}, "args": {"out": f"{model}.json",
                                                            "models": [model], "trials": 10},
            "call_overhead": {"tokens_per_source": 1, "rows": [{"model": model}]},
            "provenance": {"gpu_name": "NVIDIA H200", "gpu_count": 1, "git_commit": commit,
                           "versions": {}, "date_utc": "2026-12-01T00:00:00+00:00"}}
    return {"metadata": meta, "rows": [{"model": model, "tokens": 1}]}


def test_merge_joins_the_invocations_of_one_run():
    merged = kb.merge_documents([_doc("A"), _doc("B")])
    assert [r["model"] for r in merged["rows"]] == ["A", "B"]
    assert [r["model"] for r in merged["metadata"]["call_overhead"]["rows"]] == ["A", "B"]
    assert set(merged["metadata"]["tile_configs"]) == {"A", "B"}
    assert merged["metadata"]["wall_s"] == 4.0 and len(merged["metadata"]["invocations"]) == 2
    assert "models" not in merged["metadata"]["args"] and merged["metadata"]["args"]["trials"] == 10
    with pytest.raises(ValueError, match="git_commit"):
        kb.merge_documents([_doc("A"), _doc("B", commit="def")])
    with pytest.raises(ValueError):
        kb.merge_documents([])


def test_merge_joins_chunks_that_split_a_models_precisions():
    a, b = _doc("A"), _doc("A")
    b["metadata"]["tile_configs"] = {"A": {"fp8": {"block_m": 64}}}
    for doc, chunk in ((a, "0/2"), (b, "1/2")):
        doc["metadata"]["chunk"] = doc["metadata"]["args"]["chunk"] = chunk
    merged = kb.merge_documents([a, b])["metadata"]
    assert merged["tile_configs"] == {"A": {"bf16": {}, "fp8": {"block_m": 64}}}
    assert merged["chunk"] == ["0/2", "1/2"] and "chunk" not in merged["args"]
    assert [i["args"]["chunk"] for i in merged["invocations"]] == ["0/2", "1/2"]


def test_latest_view_takes_each_precision_from_its_newest_record(tmp_path):
    """A newer record with fp8 cells only: the view keeps the older record's bf16 cells and
    one-token calls beside the newer fp8 ones, and names both records."""
    from xstage_lab.records import write_record

    def record(created, precisions, value):
        rows = pd.DataFrame([dict(model="A", precision=p, routing="balanced", tokens=1,
                                  kernel_wave_us=value, kernel_interleaved_us=value,
                                  call_wave_us=value, tflops=value, cublas_dense_tflops=1.0,
                                  grouped_mm_tflops=1.0, unfused_us=value) for p in precisions])
        overhead = {"rows": [dict(model="A", precision=p, kernel_wave_us=value,
                                  call_wave_us=value) for p in precisions]}
        write_record("moe_kernel", "h200-x1", rows, {"kernel": "gluon_ws",
                                                     "call_overhead": overhead},
                     {"git_commit": created}, tmp_path,
                     created=datetime.fromisoformat(created))

    record("2026-12-01T10:00:00+00:00", ["bf16", "fp8"], 1.0)
    record("2026-12-01T11:00:00+00:00", ["fp8"], 2.0)
    view = kv.latest_view("h200-x1", tmp_path)
    assert len(view.records) == 2 and " + " in view.record_id
    assert dict(zip(view.table["precision"], view.table["tflops"])) == {"fp8": 2.0, "bf16": 1.0}
    assert {(o["precision"], o["kernel_wave_us"]) for o in
            view.params["call_overhead"]["rows"]} == {("fp8", 2.0), ("bf16", 1.0)}
    s = kv.summary_entry("h200-x1", tmp_path)
    assert s["geomean_ratio_to_cublas"] == {"bf16": 1.0, "fp8": 2.0}
    record("2026-12-01T12:00:00+00:00", ["bf16", "fp8"], 3.0)  # a full run supersedes both
    assert len(kv.latest_view("h200-x1", tmp_path).records) == 1
