"""The gluon_ws fused MoE kernel on a Hopper GPU (skipped elsewhere: CI has no GPU).

Run on the device machine: ``python -m pytest -q tests/experiments/moe/test_kernel_gpu.py``.
Each case draws fresh inputs, poisons the Combine buffers with NaN, runs both schedules and checks
them against each other (bitwise), against the float32 layer (quantization-matched in fp8), and
that no row outside the routed ones was written.
"""
from __future__ import annotations

import pytest
import torch

from xstage_lab.checks import relative_error
from xstage_lab.experiments.moe.bench import TOLERANCE
from xstage_lab.ops.moe.combine import local_combine_peers
from xstage_lab.ops.moe.dispatch import build_layout
from xstage_lab.ops.moe.fused import prepare_fused_moe, synthetic_k_blocks
from xstage_lab.ops.moe.schedules import (L1, L2, MoEProblem, Schedule, Tile, d_knee,
                                          expert_wave_schedule, interleaved_schedule)
from xstage_lab.ops.moe.shapes import PRECISIONS, load_shapes
from xstage_lab.ops.moe.tiles import default_tile_config
from xstage_lab.ops.moe.weights import (dequantize_blocks_fp8, dequantize_rows_fp8,
                                        expert_master_weights, local_expert_weights,
                                        quantize_rows_fp8)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs an sm_90 GPU")

SOURCES = 8          # Combine buffers standing for the source ranks
LOCAL_EXPERTS = 4


def _swiglu(v: torch.Tensor) -> torch.Tensor:
    gate, up = v.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _case(model: str, precision: str, rows: int, seed: int):
    """A layout of ``rows`` routed rows over four local experts from eight sources, the experts'
    weights, and the float32 reference of every routed row (quantization-matched in fp8)."""
    shape = load_shapes()[model]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    world = shape.routed_experts // LOCAL_EXPERTS
    weights = local_expert_weights(shape, 0, world, precision, seed=seed, device=dev)
    expert = torch.randint(0, LOCAL_EXPERTS, (rows,), generator=g, device=dev)
    counts = torch.bincount(torch.randint(0, SOURCES, (rows,), generator=g, device=dev),
                            minlength=SOURCES).tolist()
    slots = max(counts)
    slot = torch.cat([torch.randperm(slots, generator=g, device=dev)[:c] for c in counts])
    x = torch.randn(rows, shape.hidden, generator=g, device=dev).to(torch.bfloat16)
    xq, xs = quantize_rows_fp8(x) if precision == "fp8" else (x, None)
    cfg = default_tile_config(precision, "gluon_ws", hidden=shape.hidden)
    layout = build_layout(xq, xs, slot, expert, counts, LOCAL_EXPERTS, cfg.block_m)
    ref = torch.empty(rows, shape.hidden, device=dev)
    for e in range(LOCAL_EXPERTS):
        w1, w2 = expert_master_weights(shape, e, seed=seed, device=dev)
        sel = expert == e
        if precision == "fp8":
            a = dequantize_rows_fp8(xq[sel], xs[sel])
            w1f = dequantize_blocks_fp8(weights.w1[e], weights.w1_scale[e])
            w2f = dequantize_blocks_fp8(weights.w2[e], weights.w2_scale[e])
            h = dequantize_rows_fp8(*quantize_rows_fp8(_swiglu(a @ w1f.t())))
        else:
            h = _swiglu(x[sel].float() @ w1.float().t()).to(torch.bfloat16).float()
            w2f = w2.float()
        ref[sel] = h @ w2f.t()
    src = torch.repeat_interleave(torch.arange(SOURCES, device=dev), torch.tensor(counts, device=dev))
    return shape, weights, layout, cfg, ref, src, slot, slots


def _run(call, buffers):
    for b in buffers:
        b.fill_(float("nan"))
    call()
    torch.cuda.synchronize()
    return torch.stack(buffers).clone()


@pytest.mark.parametrize("rows", [1500, 150])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("model", ["DeepSeek-V4-Flash", "DiT-MoE"])
def test_both_schedules_match_the_reference(model, precision, rows):
    """1500 rows: full row blocks and each expert's last one partial; 150 rows (about 37 an
    expert): one row block an expert whose second half is padding, which its consumer skips."""
    torch.backends.cuda.matmul.allow_tf32 = False
    shape, weights, layout, cfg, ref, src, slot, slots = _case(model, precision, rows, seed=11)
    if rows == 150:
        assert max(layout.blocks_per_expert) == 1
    buffers = [torch.empty(slots, shape.hidden, dtype=torch.bfloat16, device="cuda")
               for _ in range(SOURCES)]
    peers = local_combine_peers(buffers)
    problem = MoEProblem(layout.blocks_per_expert, shape.intermediate // cfg.block_n1,
                         shape.hidden // cfg.block_n2)
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    schedules = [expert_wave_schedule(problem, programs),
                 interleaved_schedule(problem, programs, d_knee(2 * cfg.block_n1, programs,
                                                                shape.intermediate))]
    outs = []
    for schedule in schedules:
        call = prepare_fused_moe(layout, weights, schedule, peers, config=cfg)
        outs.append(_run(call, buffers))
        assert call.error_count() == 0
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    got = outs[0][src, slot].float()
    bound = TOLERANCE[precision]["fp8_emulated" if precision == "fp8" else "fp32"]
    assert relative_error(got, ref) <= bound
    written = torch.zeros(SOURCES, slots, dtype=torch.bool, device="cuda")
    written[src, slot] = True
    assert not outs[0][written].isnan().any() and outs[0][~written].isnan().all()


def test_unsatisfiable_schedule_ends_with_a_spin_error():
    """A Linear-2 tile whose Linear-1 tiles never run: the bounded spin expires, the call returns
    and reports it instead of hanging the GPU."""
    shape, weights, layout, cfg, *_ , slots = _case("DeepSeek-V4-Flash", "bf16", 200, seed=3)
    buffers = [torch.empty(slots, shape.hidden, dtype=torch.bfloat16, device="cuda")
               for _ in range(SOURCES)]
    first_expert = next(e for e, b in enumerate(layout.blocks_per_expert) if b)
    row = sum(layout.blocks_per_expert[:first_expert])
    schedule = Schedule("stuck", ((Tile(L2, first_expert, row, 0),),))
    call = prepare_fused_moe(layout, weights, schedule, local_combine_peers(buffers),
                                 config=cfg, max_spin_iters=1000, verify_schedule=False)
    call()
    torch.cuda.synchronize()
    assert call.error_count() == 1
    assert L1 != L2


@pytest.mark.parametrize("precision", PRECISIONS)
def test_instrumented_build_stamps_every_tile_and_changes_no_output(precision):
    shape, weights, layout, cfg, ref, src, slot, slots = _case("Qwen3.5", precision, 1200, seed=5)
    buffers = [torch.empty(slots, shape.hidden, dtype=torch.bfloat16, device="cuda")
               for _ in range(SOURCES)]
    peers = local_combine_peers(buffers)
    problem = MoEProblem(layout.blocks_per_expert, shape.intermediate // cfg.block_n1,
                         shape.hidden // cfg.block_n2)
    schedule = expert_wave_schedule(problem, torch.cuda.get_device_properties(0).multi_processor_count)
    plain = _run(prepare_fused_moe(layout, weights, schedule, peers, config=cfg), buffers)
    traced_call = prepare_fused_moe(layout, weights, schedule, peers, config=cfg,
                                        instrument=True)
    traced = _run(traced_call, buffers)
    assert traced_call.error_count() == 0
    assert torch.equal(plain.view(torch.int16), traced.view(torch.int16))
    counts = [len(p) for p in schedule.programs]
    trace = traced_call.trace.cpu()
    for g, c in enumerate(counts):
        stamps = trace[g, :c, :8]
        assert (stamps >= 0).all() and (stamps[:, 1:4] >= stamps[:, 0:3]).all()
        assert (trace[g, c:] == -1).all()


def _run_schedule(case, **kwargs):
    shape, weights, layout, cfg, ref, src, slot, slots = case
    buffers = [torch.empty(slots, shape.hidden, dtype=torch.bfloat16, device="cuda")
               for _ in range(SOURCES)]
    problem = MoEProblem(layout.blocks_per_expert, shape.intermediate // cfg.block_n1,
                         shape.hidden // cfg.block_n2)
    schedule = expert_wave_schedule(problem,
                                    torch.cuda.get_device_properties(0).multi_processor_count)
    call = prepare_fused_moe(layout, weights, schedule, local_combine_peers(buffers),
                                 config=cfg, **kwargs)
    out = _run(call, buffers)
    assert call.error_count() == 0
    return out


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fenced_build_changes_no_output(precision):
    case = _case("Hy3", precision, 1000, seed=7)
    plain, fenced = _run_schedule(case), _run_schedule(case, fence=True)
    assert torch.equal(plain.view(torch.int16), fenced.view(torch.int16))


def test_synthetic_fraction_computes_the_layer_over_its_k_blocks():
    """The knee sweep's synthetic kernel: Linear-1 over the first K1 hidden columns, Linear-2
    over the first K2 intermediate columns (bf16), every Combine row still written."""
    torch.backends.cuda.matmul.allow_tf32 = False
    case = _case("DeepSeek-V4-Flash", "bf16", 1000, seed=9)
    shape, weights, layout, cfg, _, src, slot, _ = case
    k1, k2 = synthetic_k_blocks(0.3, cfg, shape.hidden, shape.intermediate)
    k1, k2 = k1 * cfg.block_k, k2 * cfg.block_k
    out = _run_schedule(case, synthetic_k_fraction=0.3)
    x = layout.x[layout.arrival_rows].float()
    ends = torch.tensor(layout.blocks_per_expert, device="cuda").cumsum(0) * cfg.block_m
    expert_of_row = torch.bucketize(layout.arrival_rows, ends, right=True)  # arrival order
    ref = torch.empty(x.shape[0], shape.hidden, device="cuda")
    for e in range(LOCAL_EXPERTS):
        sel = expert_of_row == e
        w1, w2 = weights.w1[e].float(), weights.w2[e].float()
        h = _swiglu(x[sel][:, :k1] @ w1[:, :k1].t()).to(torch.bfloat16).float()
        ref[sel] = h[:, :k2] @ w2[:, :k2].t()
    got = out[layout.row_src[layout.arrival_rows].long(),
              layout.row_slot[layout.arrival_rows].long()].float()
    assert relative_error(got, ref) <= TOLERANCE["bf16"]["fp32"]


def test_wide_fp8_linear2_tiles_match_the_128_wide_ones():
    """FP8 Linear-2 tiles of 256 columns (two 128-column halves, as Linear-1's gate and up)
    store the same bits as 128-column tiles: the same promotions in the same order."""
    import dataclasses

    shape, weights, layout, cfg, ref, src, slot, slots = case = _case("DeepSeek-V4-Flash", "fp8",
                                                                    1500, seed=13)
    outs = []
    for width in (128, 256):
        wide = dataclasses.replace(cfg, block_n2=width)
        outs.append(_run_schedule((shape, weights, layout, wide, ref, src, slot, slots)))
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    del case


@pytest.mark.parametrize("inject", [False, True])
def test_a_spin_error_in_a_timed_replay_aborts_the_run_with_nothing_written(
        inject, tmp_path, monkeypatch, capsys):
    """``moe.kernel_bench`` on one small cell. Injected: each timed replay of the Interleaved
    kernel is followed by a launch that cannot finish (a Linear-2 tile whose Linear-1 tiles never
    run: its bounded spin expires) adding its spin error to the kernel's flag. The check after the
    cell's timing finds it and the run aborts with nothing written; without it the run writes."""
    from xstage_lab.experiments import harness
    from xstage_lab.experiments.moe import kernel_bench as kb, kernel_cell as kc, kernel_rows as kr

    real_prepare, real_time = prepare_fused_moe, kr.time_methods
    made = {}

    def prepare(layout, weights, schedule, peers, **kw):
        call = real_prepare(layout, weights, schedule, peers, **kw)
        made[id(call)] = (layout, weights, peers, kw["config"])
        return call

    def time_with_a_stuck_launch(methods, **kw):
        call = methods["kernel_interleaved"]
        layout, weights, peers, cfg = made[id(call)]
        expert = next(e for e, b in enumerate(layout.blocks_per_expert) if b)
        row = sum(layout.blocks_per_expert[:expert])
        stuck = real_prepare(layout, weights, Schedule("stuck", ((Tile(L2, expert, row, 0),),)),
                             peers, config=cfg, max_spin_iters=1000, verify_schedule=False)

        def interleaved_then_stuck():
            call()
            stuck()
            call.error.add_(stuck.error)
            stuck.error.zero_()

        return real_time({**methods, "kernel_interleaved": interleaved_then_stuck}, **kw)

    for module in (kc, kr):
        monkeypatch.setattr(module, "prepare_fused_moe", prepare)
    if inject:
        monkeypatch.setattr(kr, "time_methods", time_with_a_stuck_launch)
    root = tmp_path / "records"
    args = harness.parse(kb.EXPERIMENT, [
        "--root", str(root), "--models", "DeepSeek-V4-Flash", "--precisions", "bf16",
        "--routing", "balanced", "--tokens", "512", "--trials", "2", "--no-trace",
        "--no-progress"])
    if not inject:
        assert harness.run(kb.MoEKernel(), args).is_file()
        return
    with pytest.raises(SystemExit, match="correctness failed for .* after timing"):
        harness.run(kb.MoEKernel(), args)
    assert "spin errors" in capsys.readouterr().err
    assert not root.exists() or not any(root.rglob("*.parquet"))
