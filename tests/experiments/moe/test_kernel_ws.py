"""The warp-specialized Gluon MoE kernel (kernels/moe_fused_ws.py) on the CPU: its launch contract
and its sm_90 build (Gluon kernels do not run in the interpreter; tests/experiments/
test_moe_kernel_gpu.py runs it on a Hopper GPU against the reference).

The sm_90 build is checked for what the kernel's speed rests on: no spills, wgmma not serialized,
registers reallocated between the partitions, TMA loads, 16-byte ``cp.async`` row gathers and
Combine stores, a shared-memory footprint that ``ws_shared_memory_bytes`` (the launcher's
contract) bounds, and the ordering of the Linear-1 -> Linear-2 handoff (release, acquire, proxy
fences).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import re
import sys

import pytest
import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from tests.experiments.triton_testing import (HOPPER_SMEM_PER_BLOCK, compile_sm90, ptxas_report,
                                              sass_bytes)
from xstage_lab.kernel_sources import kernel_path, load_kernel_module
from xstage_lab.ops.moe.combine import local_combine_peers
from xstage_lab.ops.moe.dispatch import build_layout
from xstage_lab.ops.moe.fused import (KERNEL_ENTRIES, TRACE_FIELDS, InKernelSum, KernelBuffers,
                                      check_expert_weights, kernel_launch, prepare_fused_moe,
                                      synthetic_k_blocks)
from xstage_lab.ops.moe.schedules import MoEProblem, expert_wave_schedule
from xstage_lab.ops.moe.shapes import MoEContractError, PRECISIONS, load_shapes
from xstage_lab.ops.moe.tiles import (HOPPER_SMEM_PER_CTA, WS_ROW_TILES, TileConfig,
                                      check_tile_config, default_tile_config,
                                      ws_shared_memory_bytes, ws_tile_rows)
from xstage_lab.ops.moe.weights import local_expert_weights, quantize_rows_fp8

SHAPES = load_shapes()
SASS_LIMIT_BYTES = 75 * 1024  # the largest build measured: 74.3 KiB (FP8, 256-wide Linear-2)
# (stored, reloaded) bytes the split builds spill, by default build, with the weighted sum or
# not (Triton 3.6): FP8's, and bf16's at 256 rows (the split sum's 128-row halves)
SPLIT_SPILL_BYTES = {("fp8", 128, 128, 4): (8, 8), ("fp8", 128, 256, 4): (32, 44),
                     ("bf16", 256, 128, 4): (8, 8)}
# ... and with the atomic sum's adds (SUM_ATOMIC) the FP8 split builds', as compiled (sm_90,
# Triton 3.6): 4 bytes stored and 8-12 reloaded more than without
ATOMIC_SPILL_BYTES = {("fp8", 128, 128, 4): (12, 16), ("fp8", 128, 256, 4): (36, 56)}


@pytest.fixture(scope="module")
def ws_module():
    """A private copy of kernels/moe_fused_ws.py (compiled here, never launched)."""
    spec = importlib.util.spec_from_file_location("_test_moe_fused_ws_sm90",
                                                  kernel_path("moe_fused_ws.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache  # the plain builds serve several tests of a worker: compiled once each
def _compile(module, precision: str, cfg: TileConfig, instrument: bool = False,
             fence: bool = False, split_k: bool = False, sum_top_k: int = 0,
             sum_weight_dtype=gl.float32, sum_atomic: bool = False):
    """The kernel for sm_90 with the argument types ``kernel_launch`` passes."""
    dtype, name = (gl.float8e4nv, "fp8e4nv") if precision == "fp8" else (gl.bfloat16, "bf16")
    half, bk = cfg.block_m // 2, cfg.block_k

    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, bk], dtype)
        return f"tensordesc<{name}[{rows}, {bk}],{layout!r}>"

    scale = "*fp32" if precision == "fp8" else "*i32"  # bf16: the error flag stands in
    signature = {"tiles": "*i32", "num_tiles": "*i32", "max_tiles": "i32", "a_rows": "*i64",
                 "row_origin": "*i32", "w1_desc": desc(cfg.block_n1), "h_desc": desc(half),
                 "w2_desc": desc(cfg.block_n2), "w1_scale": scale,
                 "w2_scale": scale, "h": f"*{name}", "h_scale": scale, "row_ready": "*i32",
                 "row_src": "*i32", "row_slot": "*i32", "combine_ptrs": "*i64", "error": "*i32",
                 "max_spin": "i32", "num_experts": "i32",
                 "trace": "*i64" if instrument else "*i32", "HIDDEN": "i32", "INTER": "i32", "l1_k_blocks": "i32", "l2_k_blocks": "i32",
                 "l2_splits": "i32", "l2_partial": "*fp32" if split_k else "*i32",
                 "l2_ready": "*i32", "sum_args": "*i64" if sum_top_k else "*i32",
                 "sum_arrivals": "*i64" if sum_top_k else "*i32", "sum_tokens": "i32",
                 "FP8": "constexpr", "BLOCK_M": "constexpr",
                 "BLOCK_N1": "constexpr", "BLOCK_N2": "constexpr", "BLOCK_K": "constexpr",
                 "STAGES": "constexpr", "INSTRUMENT": "constexpr", "FENCE": "constexpr",
                 "SPLIT_K": "constexpr", "SUM_TOP_K": "constexpr",
                 "SUM_WEIGHT_DTYPE": "constexpr", "SUM_ATOMIC": "constexpr",
                 "ONE_HALF": "constexpr"}
    names = list(signature)
    constexprs = {(names.index(k),): v for k, v in dict(
        FP8=precision == "fp8", BLOCK_M=cfg.block_m, BLOCK_N1=cfg.block_n1,
        BLOCK_N2=cfg.block_n2, BLOCK_K=bk,
        STAGES=cfg.num_stages, INSTRUMENT=instrument, FENCE=fence, SPLIT_K=split_k,
        SUM_TOP_K=sum_top_k, SUM_WEIGHT_DTYPE=sum_weight_dtype, SUM_ATOMIC=sum_atomic,
        ONE_HALF=cfg.a_halves == 1).items()}
    # what Triton's launcher specializes: 16-byte aligned tensors, ints divisible by 16
    aligned = {(names.index(k),): [["tt.divisibility", 16]]
               for k, v in signature.items() if v.startswith("*")}
    aligned.update({(names.index(k),): [["tt.divisibility", 16]] for k in ("HIDDEN", "INTER")})
    return compile_sm90(GluonASTSource(module.moe_fused_ws_kernel, signature, constexprs,
                                       aligned), num_warps=4)


def _default_configs(one_half: bool = False):
    """Every default gluon_ws configuration of the model shapes (what the benchmarks run), at
    each tile height of the precision, keyed (precision, block_m, block_n2, stages); with
    ``one_half``, also where every expert's rows fit a tile's first half (a ring of one A half a
    stage where that is deeper: the plain and split builds here; its in-kernel sums run in
    tests/ops/moe/test_op_gpu.py)."""
    configs = {}
    for block_m, rows in WS_ROW_TILES.items():
        for precision in rows["precisions"]:
            for shape in SHAPES.values():
                for expert_rows in (None, block_m // 2) if one_half else (None,):
                    cfg = default_tile_config(precision, "gluon_ws", hidden=shape.hidden,
                                              block_m=block_m, expert_rows=expert_rows)
                    configs[(precision, block_m, cfg.block_n2, cfg.num_stages)] = cfg
    return configs


@pytest.mark.parametrize("key", list(_default_configs(one_half=True)),
                         ids=lambda k: "-".join(map(str, k)))
def test_compiles_for_hopper(ws_module, key):
    precision, cfg = key[0], _default_configs(one_half=True)[key]
    k = _compile(ws_module, precision, cfg)
    ptx = k.asm["ptx"]
    report = ptxas_report(ptx)
    # no build spills (the 256-wide FP8 one spilled 12 bytes while the producer was one warp)
    assert report["spill_store_bytes"] == 0 and report["spill_load_bytes"] == 0, report
    assert not report["wgmma_serialized"]
    assert k.metadata.shared <= ws_shared_memory_bytes(
        precision, cfg.block_m, cfg.block_n1, cfg.block_n2, cfg.block_k,
        cfg.num_stages, cfg.a_halves) <= HOPPER_SMEM_PER_BLOCK
    kind = "e4m3.e4m3" if precision == "fp8" else "bf16.bf16"
    # Linear-1's gate and up: a wgmma group each at 128 rows (m64n128), one group for both at
    # 256 rows (m64n128 over 64 + 64 columns, never two m64n64)
    assert "wgmma.mma_async.sync.aligned.m64n128k" in ptx and kind in ptx
    assert cfg.block_m == 128 or "wgmma.mma_async.sync.aligned.m64n64k" not in ptx
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
    assert "cp.async.bulk.tensor.2d" in ptx
    # Linear-1's rows gathered in 16-byte copies, tracked by the stage's barrier, and fenced
    # into the async proxy by the consumers before wgmma reads them
    assert "cp.async.cg.shared.global" in ptx and ", 0x10," in ptx
    assert "cp.async.mbarrier.arrive.shared.b64" in ptx
    assert ptx.count("fence.proxy.async.shared::cta") >= 2
    assert "st.global.v4" in ptx  # 16-byte h and Combine stores
    # the Linear-1 -> Linear-2 handoff: release by the writers, acquire by the producer, proxy
    # fences on both sides (h is written by generic stores and read by TMA)
    assert "ld.acquire.gpu" in ptx and "atom.global.gpu.release.add" in ptx
    assert ptx.count("fence.proxy.async.global") >= 3  # two consumer partitions, the producer
    assert "atom.global.sys.release" in ptx  # every Combine store performed before the program exits
    # machine code that other kernels' code does not push out of the instruction caches: after
    # straight-line code on every SM the FP8 builds at 81-91 KiB took 1.006-1.24x their time, at
    # 64-74 KiB 1.00-1.08x (moe_call_probe/h200-x1/20261204T210002Z against …205903Z and
    # …210043Z); the SiLU and the re-quantization without exp's and division's fix-ups
    assert sass_bytes(k.asm["cubin"], "moe_fused_ws_kernel") <= SASS_LIMIT_BYTES
    assert "ex2.approx.ftz.f32" in ptx and "rcp.approx.ftz.f32" in ptx


@pytest.mark.parametrize("key", list(_default_configs(one_half=True)),
                         ids=lambda k: "-".join(map(str, k)))
def test_the_split_builds_spill_no_more_than_measured(ws_module, key):
    """The builds that split Linear-2 along K (``SPLIT_K``) spill what they did when measured
    (Triton 3.6), no more: the 256-wide FP8 one 32 bytes stored and 44 reloaded (24 and 32 with
    the weighted sum), the 128-wide FP8 one 8 and 8, the bf16 one at 256 rows 8 and 8 (44 and 116
    before Linear-1's gate and up shared one wgmma there), the other bf16 ones none."""
    report = ptxas_report(_compile(ws_module, key[0], _default_configs(one_half=True)[key],
                                   split_k=True).asm["ptx"])
    stored, reloaded = SPLIT_SPILL_BYTES.get(key, (0, 0))
    assert report["spill_store_bytes"] <= stored and report["spill_load_bytes"] <= reloaded, \
        report


def test_default_configs_follow_the_shapes():
    bf16 = default_tile_config("bf16", "gluon_ws", hidden=4096)
    assert (bf16.block_m, bf16.block_n1, bf16.block_n2, bf16.block_k) == (128, 128, 256, 64)
    assert default_tile_config("bf16", "gluon_ws", hidden=1408).block_n2 == 128  # DiT-MoE
    fp8 = default_tile_config("fp8", "gluon_ws", hidden=4096)
    assert (fp8.block_n2, fp8.block_k) == (256, 128)
    tall = default_tile_config("bf16", "gluon_ws", hidden=4096, block_m=256)
    assert (tall.block_m, tall.block_n1, tall.block_n2, tall.num_stages) == (256, 64, 128, 4)
    for cfg, precision in ((bf16, "bf16"), (fp8, "fp8"), (tall, "bf16")):
        check_tile_config(cfg, precision, 4096, 2048)
        assert ws_shared_memory_bytes(precision, cfg.block_m, cfg.block_n1, cfg.block_n2,
                                      cfg.block_k, cfg.num_stages + 1) > HOPPER_SMEM_PER_CTA
    with pytest.raises(MoEContractError, match="not one of"):
        default_tile_config("fp8", "gluon_ws", hidden=4096, block_m=256)
    # no GPU here: the default is the portable kernel
    assert default_tile_config("bf16", device="cpu").kernel == "triton"
    assert default_tile_config("bf16").kernel == "triton"


def test_a_ring_of_one_a_half_where_every_experts_rows_fit_the_first_half(monkeypatch):
    """bf16 128-row tiles whose bound keeps each expert's rows in a tile's first half: a ring of
    one A half a stage, one stage deeper (DiT-MoE: 5); two halves where a row may pass the half,
    in fp8, at 256 rows, or where one half buys no stage (256-wide Linear-2 tiles). The launch
    builds it (``ONE_HALF``) and the host refuses it for a bound past the half."""
    dit = default_tile_config("bf16", "gluon_ws", hidden=1408, expert_rows=64)
    assert (dit.a_halves, dit.num_stages) == (1, 5)
    check_tile_config(dit, "bf16", 1408, 5632)
    assert ws_shared_memory_bytes("bf16", 128, 128, 128, 64, 5, 1) <= HOPPER_SMEM_PER_CTA < \
        ws_shared_memory_bytes("bf16", 128, 128, 128, 64, 6, 1)
    for precision, hidden, rows in (("bf16", 1408, 65), ("fp8", 1408, 64), ("bf16", 4096, 64),
                                    ("bf16", 1408, None)):
        cfg = default_tile_config(precision, "gluon_ws", hidden=hidden, expert_rows=rows)
        assert (cfg.a_halves, cfg.num_stages) == (2, 4), (precision, hidden, rows)
    tall = default_tile_config("bf16", "gluon_ws", hidden=1408, block_m=256, expert_rows=128)
    assert (tall.a_halves, tall.num_stages) == (2, 4)
    with pytest.raises(MoEContractError, match="1 or 2 A tile halves"):
        check_tile_config(dataclasses.replace(dit, a_halves=3), "bf16", 1408, 5632)
    with pytest.raises(MoEContractError, match="Triton kernel's tiles are whole"):
        check_tile_config(TileConfig(a_halves=1), "bf16", 1408, 5632)
    one_half = dataclasses.replace(default_tile_config("bf16", "gluon_ws", hidden=4096),
                                   a_halves=1)
    check_expert_weights(_tiny_weights("bf16"), one_half, expert_rows=64)
    with pytest.raises(MoEContractError, match="holds 64 routed rows an expert; the bound "
                                               "allows 65"):
        check_expert_weights(_tiny_weights("bf16"), one_half, expert_rows=65)
    monkeypatch.setattr("xstage_lab.ops.moe.fused.kernel_unsupported", lambda kernel, device: None)
    assert not _tiny_call("bf16").constexprs["ONE_HALF"]
    assert _tiny_call("bf16", config=one_half).constexprs["ONE_HALF"]


def test_tall_tiles_where_experts_hold_one_to_eight_row_blocks_in_bf16():
    rows = (None, 1, 96, 127, 128, 192, 1024, 1025, 2048)
    for hidden in (None, 4096, 7168):
        assert [ws_tile_rows("bf16", r, hidden) for r in rows] == [128, 128, 128, 128, 256, 256,
                                                                   256, 128, 128]
    assert {ws_tile_rows("fp8", r, h) for r in rows for h in (None, 1408)} == {128}


def test_tall_tiles_above_eight_row_blocks_where_linear2_tiles_are_narrow():
    """DiT-MoE's hidden size (1408) gives its 128-row kernel 128-wide Linear-2 tiles: 256-row
    tiles only from more than eight 128-row blocks an expert, with no bound above."""
    assert default_tile_config("bf16", "gluon_ws", hidden=1408).block_n2 == 128
    rows = (None, 128, 512, 1024, 1025, 4096, 8192)
    assert [ws_tile_rows("bf16", r, 1408) for r in rows] == [128, 128, 128, 128, 256, 256, 256]


@pytest.mark.parametrize("change,message", [
    (dict(block_m=64), "not one of"), (dict(block_k=128), "fixes"),
    (dict(block_n2=512), "block_n2"), (dict(block_m=256), "fixes"),
    (dict(block_m=256, block_n1=64, block_n2=256), "block_n2"),
    (dict(num_stages=6), "shared memory"), (dict(num_stages=1), "2 or more stages"),
    (dict(kernel="cuda"), "kernel must be one of")])
def test_bad_tiles_rejected(change, message):
    cfg = default_tile_config("bf16", "gluon_ws", hidden=4096)
    with pytest.raises(MoEContractError, match=message):
        check_tile_config(TileConfig(**{**cfg.__dict__, **change}), "bf16", 4096, 2048)


def test_linear2_tiles_are_256_wide_where_hidden_allows():
    for precision in PRECISIONS:
        assert default_tile_config(precision, "gluon_ws", hidden=4096).block_n2 == 256
        assert default_tile_config(precision, "gluon_ws", hidden=1408).block_n2 == 128


@functools.cache  # the same seeded weights for every call (0.7 s in bf16, 1.5 s in fp8); read only
def _tiny_weights(precision: str):
    return local_expert_weights(SHAPES["DeepSeek-V4-Flash"], 0, 128, precision, seed=0)


def _tiny_call(precision: str, l2_splits: int = 1, kernel: str = "gluon_ws",
               config: TileConfig | None = None, **kwargs):
    shape = SHAPES["DeepSeek-V4-Flash"]
    cfg = config or default_tile_config(precision, kernel, hidden=shape.hidden)
    weights = _tiny_weights(precision)
    rows, counts = 200, [120, 80]
    x = torch.randn(rows, shape.hidden).to(torch.bfloat16)
    xq, xs = quantize_rows_fp8(x) if precision == "fp8" else (x, None)
    expert = torch.arange(rows) % 2
    slot = torch.cat([torch.arange(c) for c in counts])
    layout = build_layout(xq, xs, slot, expert, counts, 2, cfg.block_m)
    problem = MoEProblem(layout.blocks_per_expert, shape.intermediate // cfg.block_n1,
                         shape.hidden // cfg.block_n2 * l2_splits)
    buffers = [torch.empty(128, shape.hidden, dtype=torch.bfloat16) for _ in counts]
    return prepare_fused_moe(layout, weights, expert_wave_schedule(problem, 4),
                             local_combine_peers(buffers), config=cfg, l2_splits=l2_splits,
                             **kwargs)


def test_needs_a_hopper_gpu():
    with pytest.raises(MoEContractError, match="sm_90"):
        _tiny_call("bf16")


@pytest.mark.parametrize("precision", PRECISIONS)
def test_launch_arguments(monkeypatch, precision):
    """The launch the kernel's signature expects (as the compile test types it), built without
    a GPU: descriptors over the 2-D views with their block shapes, the scales in fp8."""
    monkeypatch.setattr("xstage_lab.ops.moe.fused.kernel_unsupported", lambda kernel, device: None)
    call = _tiny_call(precision)
    assert call.kernel == "gluon_ws" and call.trace is None
    a_rows, row_origin, w1_desc, h_desc, w2_desc = call.args[3:8]
    assert h_desc.block_shape == [64, call.constexprs["BLOCK_K"]]
    # Linear-1 reads the layout's own rows in place, none on padding rows (slot -1)
    row_slot = call.args[14]
    assert row_origin.tolist() == [r if s >= 0 else -1 for r, s in enumerate(row_slot.tolist())]
    assert (row_slot < 0).any() and a_rows.dtype == torch.int64 and a_rows.shape == (3,)
    assert (a_rows[1] != 0).item() == (precision == "fp8")
    assert w1_desc.block_shape[0] == 128 and w2_desc.block_shape[0] == call.constexprs["BLOCK_N2"]
    assert w1_desc.shape == [2 * 2 * 2048, 4096] and w2_desc.shape == [2 * 4096, 2048]
    assert (call.args[8].dtype == torch.float32) == (precision == "fp8")  # w1_scale
    assert call.constexprs["FP8"] == (precision == "fp8")
    bk, a = call.constexprs["BLOCK_K"], _named(call)
    # every K block: the layer; unsplit, the error flag stands in for the split buffers, and
    # without the weighted sum for its buffers
    assert [a[k] for k in ("HIDDEN", "INTER", "l1_k_blocks", "l2_k_blocks")] == \
        [4096, 2048, 4096 // bk, 2048 // bk]
    assert a["l2_splits"] == 1 and a["l2_partial"] is a["l2_ready"] is a["error"]
    assert a["sum_args"] is a["sum_arrivals"] is a["error"] and a["sum_tokens"] == 0
    assert "SUM_TOP_K" not in call.constexprs
    assert _tiny_call(precision, fence=True).constexprs["FENCE"] and not call.constexprs["FENCE"]
    synthetic = _named(_tiny_call(precision, synthetic_k_fraction=0.3))
    assert (synthetic["l1_k_blocks"], synthetic["l2_k_blocks"]) == \
        (math.ceil(0.3 * 4096 / bk), math.ceil(0.3 * 2048 / bk))
    assert call.synthetic_k_fraction is None
    assert _tiny_call(precision, synthetic_k_fraction=0.3).synthetic_k_fraction == 0.3
    traced = _tiny_call(precision, instrument=True)
    assert traced.constexprs["INSTRUMENT"] and _named(traced)["trace"] is traced.trace
    assert traced.trace.shape == (4, traced.args[2], TRACE_FIELDS) and (traced.trace == -1).all()


def _named(call) -> dict:
    """A prepared launch's arguments by the kernel's parameter names."""
    module, entry = KERNEL_ENTRIES[call.kernel]
    names = getattr(load_kernel_module(module), entry).arg_names
    assert len(call.args) == names.index("FP8")  # every argument before the constexprs
    return dict(zip(names, call.args))


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_launch_that_ends_with_the_weighted_sum_passes_its_block_and_counter(precision):
    """``InKernelSum``: the addresses' block, the arrivals and the tokens as arguments, the picks
    and the weights' dtype as the build's constexprs; the Triton kernel refuses it."""
    weights = _tiny_weights(precision)
    cfg = default_tile_config(precision, "gluon_ws", hidden=weights.hidden)
    summed = InKernelSum(torch.zeros(3, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                         5, 2, torch.bfloat16)
    t = torch.zeros(8, dtype=torch.int32)
    h = torch.empty(128, weights.intermediate, dtype=weights.w1.dtype)
    buffers = KernelBuffers(torch.zeros(1, 1, 4, dtype=torch.int32), t, t, t, h, t, t, t, t, t,
                            t, t, weighted_sum=summed)
    args, constexprs = kernel_launch(cfg, weights, buffers, max_spin_iters=7)
    names = load_kernel_module("moe_fused_ws").moe_fused_ws_kernel.arg_names
    a = dict(zip(names, args))
    assert a["sum_args"] is summed.args and a["sum_arrivals"] is summed.arrivals
    assert a["sum_tokens"] == 5 and a["max_spin"] == 7
    assert constexprs["SUM_TOP_K"] == 2 and constexprs["SUM_WEIGHT_DTYPE"] == gl.bfloat16
    triton_cfg = default_tile_config(precision, "triton", hidden=weights.hidden)
    with pytest.raises(MoEContractError, match="gluon_ws"):
        kernel_launch(triton_cfg, weights, buffers, max_spin_iters=7)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_instrumented_build_stamps_each_tile_and_keeps_its_resources(ws_module, precision):
    """The traced build reads %clock64 and %globaltimer at the four points of a tile (in one
    consumer partition) and %smid, and stays free of spills and serialized wgmma, so the mainloops it
    times are the timed build's."""
    cfg = default_tile_config(precision, "gluon_ws", hidden=4096)
    plain = _compile(ws_module, precision, cfg).asm["ptx"]
    k = _compile(ws_module, precision, cfg, instrument=True)
    ptx, report = k.asm["ptx"], ptxas_report(k.asm["ptx"])
    assert "%globaltimer" not in plain
    # entry, first K block, epilogue end, and the mainloop end in each tile kind's branch
    assert ptx.count("%globaltimer;") == ptx.count("%clock64;") == 5
    assert ptx.count("%smid;") == 1
    assert report["spill_store_bytes"] <= 16 and not report["wgmma_serialized"]


@pytest.mark.parametrize("fraction", [0.0, 1.5, -0.1])
def test_synthetic_fraction_outside_0_1_is_rejected(fraction):
    cfg = default_tile_config("bf16", "gluon_ws", hidden=4096)
    with pytest.raises(MoEContractError, match="synthetic_k_fraction"):
        synthetic_k_blocks(fraction, cfg, 4096, 2048)


def test_synthetic_fraction_needs_the_gluon_kernel_and_keeps_one_block():
    cfg = default_tile_config("bf16", "gluon_ws", hidden=4096)
    assert synthetic_k_blocks(None, cfg, 4096, 2048) == (64, 32)
    assert synthetic_k_blocks(1e-6, cfg, 4096, 2048) == (1, 1)
    assert synthetic_k_blocks(0.5, cfg, 4096, 2048) == (32, 16)
    with pytest.raises(MoEContractError, match="gluon_ws"):
        synthetic_k_blocks(0.5, default_tile_config("bf16", "triton"), 4096, 2048)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fenced_build_releases_at_system_scope_after_each_linear2_tile(ws_module, precision):
    """FENCE adds a call to the system-scope release in each consumer partition (beside the one
    at program exit), after the warpgroup's barrier; without FENCE there is no such call."""
    cfg = default_tile_config(precision, "gluon_ws", hidden=4096)
    plain = _compile(ws_module, precision, cfg).asm["ptx"]
    fenced = _compile(ws_module, precision, cfg, fence=True)
    ptx = fenced.asm["ptx"]
    assert "_release_system" not in plain and ptx.count("call.uni") >= 2
    assert "_release_system" in ptx and "atom.global.sys.release" in ptx
    report = ptxas_report(ptx)
    assert report["spill_store_bytes"] <= 16 and not report["wgmma_serialized"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_split_linear2_launch_passes_its_partials_and_counters(monkeypatch, precision):
    """A schedule of Linear-2 tiles split in 3 along K: the SPLIT_K build, fp32 partials for the
    layout's row blocks times the splits, one zeroed counter per tile half; the Triton kernel
    refuses such a table."""
    monkeypatch.setattr("xstage_lab.ops.moe.fused.kernel_unsupported", lambda kernel, device: None)
    call = _tiny_call(precision, l2_splits=3)
    a = _named(call)
    splits, partial, ready = a["l2_splits"], a["l2_partial"], a["l2_ready"]
    p2 = 4096 // call.constexprs["BLOCK_N2"]
    assert call.constexprs["SPLIT_K"] and not _tiny_call(precision).constexprs["SPLIT_K"]
    # two row blocks (120 and 80 rows)
    assert splits == 3 and partial.dtype == torch.float32 and partial.shape == (2 * 3 * 128, 4096)
    assert ready.dtype == torch.int32 and ready.shape == (2 * p2 * 2,) and not ready.any()
    with pytest.raises(MoEContractError, match="gluon_ws"):
        _tiny_call(precision, l2_splits=3, kernel="triton")


@pytest.mark.parametrize("key", list(_default_configs()), ids=lambda k: "-".join(map(str, k)))
def test_split_k_build_sums_released_partials(ws_module, key):
    """The SPLIT_K build: each split's partial released to its tile half's counter
    (release-add), acquired before the sums, which read the partials at L2; wgmma not
    serialized. Its few spilled bytes (the producer's split arithmetic at 56 registers) cost
    little where it runs, at a few tokens, bound by the weights' stream."""
    precision, cfg = key[0], _default_configs()[key]
    ptx = _compile(ws_module, precision, cfg, split_k=True).asm["ptx"]
    plain = _compile(ws_module, precision, cfg).asm["ptx"]
    report = ptxas_report(ptx)
    assert report["spill_load_bytes"] <= 128 and not report["wgmma_serialized"], report
    release = "atom.global.gpu.release.add"
    assert ptx.count(release) > plain.count(release)
    assert "ld.global.cg" in ptx and ptx.count("ld.acquire.gpu") >= 2


# Machine code the weighted sum adds to a build (one copy, called by the first consumer
# warpgroup; both arrive): 7.5-9.0 KiB over the default builds with 8 picks, split or not
# (sm_90 builds here, Triton 3.6). It runs once, after the mainloops.
SUM_CODE_LIMIT_BYTES = 12 * 1024


@pytest.mark.parametrize("split_k", [False, True], ids=["unsplit", "split"])
@pytest.mark.parametrize("key", list(_default_configs()), ids=lambda k: "-".join(map(str, k)))
def test_the_weighted_sum_build_arrives_then_sums(ws_module, key, split_k):
    """``SUM_TOP_K``: the control block written at the start (the arrivals' count read with
    acquire), each consumer warpgroup's release-add after its mainloops, the first one's call
    (not inlined) acquire-spinning on the count and reading the Combine rows at L2 in 16-byte
    vectors, one per pick; wgmma not serialized; no spills unsplit, and split no more than the
    split builds' measured bytes (``SPLIT_SPILL_BYTES``); none of the sum kept in registers
    across the mainloops; its shared memory within the launcher's bound."""
    precision, cfg = key[0], _default_configs()[key]
    k = _compile(ws_module, precision, cfg, split_k=split_k, sum_top_k=8,
                 sum_weight_dtype=gl.bfloat16)
    plain = _compile(ws_module, precision, cfg, split_k=split_k)
    ptx = k.asm["ptx"]
    release = "atom.global.gpu.release.add.u64"
    assert ptx.count(release) == 2 and release not in plain.asm["ptx"]
    assert ptx.count("ld.acquire.gpu.global.b64") >= 2  # the start's read, the spin's
    assert len(re.findall(r"call\.uni\s+\S*_weighted_sum_share", ptx)) == 1
    assert ptx.count("ld.global.cg.v4") - plain.asm["ptx"].count("ld.global.cg.v4") == 8
    report = ptxas_report(ptx)
    assert not report["wgmma_serialized"]
    # unsplit none; split, no more than the split build's measured bound (ptxas moves a few of
    # the producer's bytes: the 256-wide FP8 one reloads 44 without the sum, 32 with it)
    stored, reloaded = SPLIT_SPILL_BYTES.get(key, (0, 0)) if split_k else (0, 0)
    assert report["spill_store_bytes"] <= stored and report["spill_load_bytes"] <= reloaded, \
        report
    assert k.metadata.shared <= ws_shared_memory_bytes(precision, cfg.block_m, cfg.block_n1,
                                                       cfg.block_n2, cfg.block_k, cfg.num_stages,
                                                       cfg.a_halves)
    added = sass_bytes(k.asm["cubin"], "moe_fused_ws_kernel") - \
        sass_bytes(plain.asm["cubin"], "moe_fused_ws_kernel")
    assert 0 < added <= SUM_CODE_LIMIT_BYTES


@pytest.mark.parametrize("split_k", [False, True], ids=["unsplit", "split"])
@pytest.mark.parametrize("key", list(_default_configs()), ids=lambda k: "-".join(map(str, k)))
def test_the_atomic_sum_build_adds_its_rows_and_waits_for_nothing(ws_module, key, split_k):
    """``SUM_ATOMIC``: the Linear-2 epilogues' rows go out as relaxed vector bf16 adds (no Combine
    stores through the peer table's bf16 rows), with no control block, arrival or spin of the
    in-kernel sum; wgmma not serialized, spills as the build without it (split: as measured,
    ``ATOMIC_SPILL_BYTES``)."""
    precision, cfg = key[0], _default_configs()[key]
    k = _compile(ws_module, precision, cfg, split_k=split_k, sum_top_k=8,
                 sum_weight_dtype=gl.bfloat16, sum_atomic=True)
    plain = _compile(ws_module, precision, cfg, split_k=split_k)
    ptx = k.asm["ptx"]
    # 8 bf16 (16 bytes) an add; 4 (8 bytes) in the split sums' layout of 4 columns a thread
    add = r"atom\.global\.gpu\.relaxed\.add\.noftz\.v[48]\.bf16"
    assert re.search(add, ptx) and not re.search(add, plain.asm["ptx"])
    assert "_weighted_sum_share" not in ptx and "atom.global.gpu.release.add.u64" not in ptx
    # the Combine rows' stores of the plain build's epilogues are gone
    assert ptx.count("st.global.") < plain.asm["ptx"].count("st.global.")
    report, base = ptxas_report(ptx), ptxas_report(plain.asm["ptx"])
    assert not report["wgmma_serialized"]
    stored, reloaded = ATOMIC_SPILL_BYTES.get(key, (0, 0)) if split_k else (0, 0)
    assert report["spill_store_bytes"] <= max(stored, base["spill_store_bytes"]) and \
        report["spill_load_bytes"] <= max(reloaded, base["spill_load_bytes"]), report


def test_a_prepared_launch_keeps_its_local_combine_buffers_alive(monkeypatch):
    """The peer table and ``a_rows`` hold bare addresses: the launch must own the buffers they
    point into, or a caller that drops its own reference leaves the kernel storing into (reading
    from) freed memory."""
    import gc
    import weakref

    monkeypatch.setattr("xstage_lab.ops.moe.fused.kernel_unsupported", lambda kernel, device: None)
    call = _tiny_call("bf16")
    refs = [weakref.ref(b) for b in call.owners]
    gc.collect()
    assert refs and all(r() is not None for r in refs)
    table, a_rows = call.args[15], call.args[3]
    assert table.tolist() == [b.data_ptr() for b in call.owners[:len(table)]]
    assert a_rows.tolist() == [call.owners[len(table)].data_ptr(), 0, 0]  # the layout's rows
