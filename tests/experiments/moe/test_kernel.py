"""The fused MoE kernel on CPU: Triton's interpreter, P ranks simulated in one process.

How the interpreter is used, and why:

* ``TRITON_INTERPRET`` must be set before Triton decides how to wrap a ``@triton.jit`` function,
  and other test modules may need the compiler in the same pytest process. So every kernel run
  happens in one child process (``python -m tests.experiments.moe.test_kernel --interpreter``)
  started with ``TRITON_INTERPRET=1``; it runs all cases and returns a JSON verdict per case. This
  module imports no Triton itself.
* The interpreter runs the programs of a grid one after another, each to completion. A program
  that waits on a Linear-1 tile owned by a *later* program can never see it: its bounded spin
  expires and the error flag is set (``interpreter_sequential_caveat`` shows exactly that on a
  valid Interleaved schedule). The correctness cases therefore run every schedule in an order that
  is valid without concurrency: the completion order of the all-resident simulation
  (``execution_order``), as one program, or cut into consecutive chunks, one per program, so that
  every dependency lies in an earlier program or earlier in the same one. Tile order is all that
  differs between schedules; concurrency itself is only exercised on the GPU.
* P ranks are P calls of the kernel, one per simulated rank, each with its own local experts,
  dispatched rows and row counters; their Combine buffers are P ordinary CPU tensors and the peer
  pointer table is built from their ``data_ptr()``: the same kernel code path that stores to
  peers over NVLink on the GPU.
* Two Triton 3.6 interpreter defects are patched in the child only
  (``triton_testing.interpreter_fixes``); the GPU path does not go through them.

The last case compiles the kernel for sm_90 (no GPU needed) in a child without the interpreter.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.experiments.triton_testing import (HOPPER_SMEM_PER_BLOCK, assert_case_ok, child_main,
                                              child_results, interpreter_case_tests)
from xstage_lab.checks import relative_error
from xstage_lab.experiments.moe.bench import TOLERANCE
from xstage_lab.ops.moe.combine import (CombinePeers, SymmetricCombine, combine_weighted_sum,
                                        local_combine_peers)
from xstage_lab.ops.moe.dispatch import _bytes, build_layout, plan_send
from xstage_lab.ops.moe.fused import prepare_fused_moe
from xstage_lab.ops.moe.reference import reference_moe
from xstage_lab.ops.moe.routing import router_logits, router_topk
from xstage_lab.ops.moe.schedules import (
    L1, L2, MoEProblem, Schedule, ScheduleError, Tile, check_schedule, d_knee, execution_order,
    expert_wave_schedule, interleaved_schedule)
from xstage_lab.ops.moe.shapes import (MoEContractError, MoEShape, PRECISIONS,
                                       check_expert_parallel, load_shapes)
from xstage_lab.ops.moe.tiles import TileConfig, check_tile_config, default_tile_config
from xstage_lab.ops.moe.weights import ExpertWeights, local_expert_weights, quantize_rows_fp8

# Tiny shapes with the kernel's structure intact: several experts per rank, P_1 = P_2 = 2 tiles,
# two K blocks, and 32-wide fp8 scale blocks (128 on the GPU) so that each K block has its scales.
TINY = dict(hidden=64, intermediate=64, top_k=2, tokens=8)
TINY_TILES = TileConfig(block_m=16, block_n1=32, block_n2=32, block_k=32, scale_block=32,
                            num_warps=4, num_stages=2)
SIM_PROGRAMS = 3
WORLDS = (2, 4, 8)


# ------------------------------------------------------------------- P ranks simulated in-process

@dataclass
class SimulatedLayer:
    shape: MoEShape
    precision: str
    seed: int
    x: list            # per rank: bf16 [T, H] source tokens
    topk_ids: list
    topk_w: list
    plans: list        # per rank: SendPlan
    layouts: list      # per rank: DispatchLayout of the rows it received
    weights: list      # per rank: ExpertWeights of its local experts

    @property
    def world(self) -> int:
        return len(self.x)


def simulate_layer(precision: str, world: int, *, seed: int = 0, routing: str = "skewed",
                   experts: int | None = None, config: TileConfig = TINY_TILES) -> SimulatedLayer:
    """Router, quantization and Dispatch of ``world`` ranks; all_to_all_single emulated by
    concatenating, for each destination, the rows every source sends it, in source order."""
    experts = experts or 2 * world
    shape = MoEShape("tiny", "tiny", TINY["hidden"], TINY["intermediate"], experts,
                         TINY["top_k"], "test")
    sb, per_rank = config.scale_block, experts // world
    xs, ids, ws, plans, sent = [], [], [], [], []
    for r in range(world):
        x = torch.randn(TINY["tokens"], shape.hidden,
                        generator=torch.Generator().manual_seed(1000 * seed + r)).to(torch.bfloat16)
        i, w = router_topk(router_logits(TINY["tokens"], experts, routing, seed=seed, rank=r),
                               shape.top_k)
        xs.append(x)
        ids.append(i)
        ws.append(w)
        plans.append(plan_send(i, experts, world))
        sent.append(quantize_rows_fp8(x, sb) if precision == "fp8" else (x, None))
    layouts = []
    for dst in range(world):
        parts = {"x": [], "scale": [], "slot": [], "expert": []}
        counts = []
        for src in range(world):
            off = np.concatenate(([0], np.cumsum(plans[src].counts)))
            part = slice(int(off[dst]), int(off[dst + 1]))
            tokens = plans[src].order[part] // shape.top_k
            parts["x"].append(_bytes(sent[src][0])[tokens])
            if sent[src][1] is not None:
                parts["scale"].append(sent[src][1][tokens])
            parts["slot"].append(plans[src].order[part])
            parts["expert"].append(plans[src].experts[part] % per_rank)
            counts.append(plans[src].counts[dst])
        layouts.append(build_layout(
            torch.cat(parts["x"]).view(sent[0][0].dtype),
            torch.cat(parts["scale"]) if parts["scale"] else None,
            torch.cat(parts["slot"]), torch.cat(parts["expert"]), counts, per_rank, config.block_m))
    weights = [local_expert_weights(shape, r, world, precision, seed=seed, scale_block=sb)
               for r in range(world)]
    return SimulatedLayer(shape, precision, seed, xs, ids, ws, plans, layouts, weights)


def problem_of(layer: SimulatedLayer, rank: int, config: TileConfig = TINY_TILES) -> MoEProblem:
    return MoEProblem(layer.layouts[rank].blocks_per_expert,
                      layer.shape.intermediate // config.block_n1, layer.shape.hidden // config.block_n2)


def poisoned_buffers(layer: SimulatedLayer) -> list[torch.Tensor]:
    slots = TINY["tokens"] * layer.shape.top_k
    return [torch.full((slots, layer.shape.hidden), float("nan"), dtype=torch.bfloat16)
            for _ in range(layer.world)]


def rank_schedules(layer: SimulatedLayer, rank: int, programs: int = SIM_PROGRAMS) -> dict[str, Schedule]:
    problem = problem_of(layer, rank)
    knee = d_knee(2 * TINY_TILES.block_n1, programs, layer.shape.intermediate)
    return {"wave": expert_wave_schedule(problem, programs),
            "interleaved": interleaved_schedule(problem, programs, knee)}


def in_program_order(problem: MoEProblem, schedule: Schedule, programs: int) -> Schedule:
    """The all-resident completion order cut into ``programs`` consecutive chunks: every dependency
    sits in an earlier chunk or earlier in the same one, so sequential programs never wait."""
    order = [t for _, t in execution_order(problem, schedule)]
    bounds = np.linspace(0, len(order), programs + 1).astype(int)
    return Schedule(schedule.name, tuple(tuple(order[a:b]) for a, b in zip(bounds[:-1], bounds[1:])))


# --------------------------------------------------------------- preconditions (no kernel, no Triton)

@pytest.fixture(scope="module")
def bf16_layer():
    return simulate_layer("bf16", 2)


def _prepare(layer, rank=0, schedule=None, buffers=None, config=TINY_TILES, **kw):
    schedule = schedule or rank_schedules(layer, rank)["interleaved"]
    peers = local_combine_peers(buffers or poisoned_buffers(layer))
    return prepare_fused_moe(layer.layouts[rank], layer.weights[rank], schedule, peers,
                                 config=config, **kw)


@pytest.mark.parametrize("world", WORLDS)
def test_dispatch_layout_is_consistent(world):
    """Every rank's rows: its own local experts (contiguous placement, E/P each), padded per
    expert, each row the token and slot its source sent, across P = 2, 4, 8 ranks."""
    layer = simulate_layer("bf16", world, seed=world)
    assert sum(sum(lay.recv_counts) for lay in layer.layouts) == world * TINY["tokens"] * TINY["top_k"]
    for rank, layout in enumerate(layer.layouts):
        assert len(layout.recv_counts) == world and len(layout.tokens_per_expert) == 2
        assert layout.num_rows == TINY_TILES.block_m * sum(layout.blocks_per_expert)
        valid = layout.row_slot >= 0
        assert int(valid.sum()) == sum(layout.tokens_per_expert) == sum(layout.recv_counts)
        assert (layout.x[~valid].float() == 0).all()
        first = np.concatenate(([0], np.cumsum(layout.blocks_per_expert))) * TINY_TILES.block_m
        for row in valid.nonzero().flatten().tolist():
            src, slot = int(layout.row_src[row]), int(layout.row_slot[row])
            expert = int(np.searchsorted(first, row, side="right")) - 1
            assert torch.equal(layout.x[row], layer.x[src][slot // layer.shape.top_k])
            assert int(layer.topk_ids[src].flatten()[slot]) == rank * len(layout.tokens_per_expert) + expert


def test_model_shapes_fit_the_kernel():
    """Every shape of data/moe_shapes.json divides into the GPU tiles of both precisions, splits
    over EP = 4 and 8, and has a top-k within its experts and a source."""
    shapes = load_shapes()
    assert len(shapes) == 7
    for s in shapes.values():
        for precision in PRECISIONS:
            check_tile_config(default_tile_config(precision), precision, s.hidden, s.intermediate)
        assert check_expert_parallel(s.routed_experts, 4) * 4 == s.routed_experts
        assert check_expert_parallel(s.routed_experts, 8) * 8 == s.routed_experts
        assert 1 <= s.top_k <= s.routed_experts and s.source


def test_bench_arguments():
    from xstage_lab.experiments import harness
    from xstage_lab.experiments.moe import bench

    def parse_args(argv):
        return harness.parse(bench.EXPERIMENT, argv)

    a = parse_args(["--out", "x.json"])
    assert a.models == list(load_shapes()) and a.precisions == ["bf16", "fp8"]
    assert a.routing == ["balanced", "skewed"] and a.tokens == [4096]
    a = parse_args(["--out", "x.json", "--models", "Hy3,DiT-MoE", "--precisions", "fp8", "--tokens", "512"])
    assert a.models == ["Hy3", "DiT-MoE"] and a.precisions == ["fp8"] and a.tokens == [512]
    with pytest.raises(SystemExit):
        parse_args(["--out", "x.json", "--models", "GPT-5"])


@pytest.mark.parametrize("model", list(load_shapes()))
def test_model_shapes_at_ep8_schedule_on_the_loaded_rank(model):
    """EP = 8, skewed routing, 2048 tokens per rank (the matrix's least): the rank that
    receives the most rows (hot experts) gets both schedules on 132 programs with D_knee, every
    rule of ``check_schedule`` holding, and every routed slot lands on exactly one rank."""
    world, tokens, programs = 8, 2048, 132
    shape = load_shapes()[model]
    cfg = default_tile_config("fp8")
    plans = [plan_send(router_topk(router_logits(tokens, shape.routed_experts,
                                                             "skewed", seed=1, rank=r),
                                           shape.top_k)[0], shape.routed_experts, world)
             for r in range(world)]
    received = np.sum([p.counts for p in plans], axis=0)
    assert received.sum() == world * tokens * shape.top_k
    per_rank = check_expert_parallel(shape.routed_experts, world)
    loaded = int(received.argmax())
    experts = torch.cat([p.experts for p in plans])
    mine = experts[experts // per_rank == loaded] % per_rank
    tokens_per_expert = torch.bincount(mine, minlength=per_rank).tolist()
    problem = MoEProblem(tuple(-(-n // cfg.block_m) for n in tokens_per_expert),
                         shape.intermediate // cfg.block_n1, shape.hidden // cfg.block_n2)
    knee = d_knee(2 * cfg.block_n1, programs, shape.intermediate)
    for schedule in (expert_wave_schedule(problem, programs),
                     interleaved_schedule(problem, programs, knee)):
        check_schedule(problem, schedule)
        assert schedule.num_programs == programs


def test_top_k_above_experts_rejected():
    with pytest.raises(MoEContractError, match="top_k"):
        router_topk(torch.randn(4, 8), 9)


def test_ranks_must_divide_experts():
    with pytest.raises(MoEContractError, match="divide"):
        plan_send(torch.zeros(4, 2, dtype=torch.int64), 6, 4)
    with pytest.raises(MoEContractError, match="divide"):
        local_expert_weights(MoEShape("m", "m", 64, 64, 6, 2, ""), 0, 4, "bf16", seed=0)


def test_shapes_not_divisible_by_tile_rejected(bf16_layer):
    with pytest.raises(MoEContractError, match="hidden=4000 is not divisible"):
        check_tile_config(default_tile_config("bf16"), "bf16", 4000, 2048)
    with pytest.raises(MoEContractError, match="intermediate"):
        check_tile_config(default_tile_config("fp8"), "fp8", 4096, 1000)
    with pytest.raises(MoEContractError, match="power of two"):
        check_tile_config(TileConfig(block_m=48), "bf16", 4096, 2048)
    with pytest.raises(MoEContractError, match="block_n1 == scale_block"):
        check_tile_config(TileConfig(block_n1=64, block_k=128), "fp8", 4096, 2048)
    with pytest.raises(MoEContractError, match="not divisible"):
        _prepare(bf16_layer, config=TileConfig(block_m=16, block_n1=32, block_n2=32, block_k=128))


def test_missing_peer_rejected(bf16_layer):
    buffers = poisoned_buffers(bf16_layer)
    with pytest.raises(MoEContractError, match="mapped Combine buffer"):
        CombinePeers((buffers[0].data_ptr(), 0), torch.zeros(2, dtype=torch.int64), 16, 64)
    with pytest.raises(MoEContractError, match="peer table has 3 ranks"):
        _prepare(bf16_layer, buffers=buffers + poisoned_buffers(bf16_layer)[:1])
    with pytest.raises(MoEContractError, match="16-byte aligned"):
        CombinePeers((buffers[0].data_ptr() + 2, buffers[1].data_ptr()),
                         torch.zeros(2, dtype=torch.int64), 16, 64)


def test_small_combine_buffer_rejected(bf16_layer):
    small = [torch.zeros(2, bf16_layer.shape.hidden, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(MoEContractError, match="cannot take slot"):
        _prepare(bf16_layer, buffers=small)


def test_weight_dtype_and_layout_mismatch_rejected(bf16_layer):
    w = bf16_layer.weights[0]
    e, sb = w.num_experts, TINY_TILES.scale_block
    wrong = ExpertWeights("fp8", w.w1, w.w2,
                          torch.ones(e, 2 * w.intermediate // sb, w.hidden // sb),
                          torch.ones(e, w.hidden // sb, w.intermediate // sb))
    peers = local_combine_peers(poisoned_buffers(bf16_layer))
    with pytest.raises(MoEContractError, match="w1 must be torch.float8_e4m3fn"):
        prepare_fused_moe(bf16_layer.layouts[0], wrong, rank_schedules(bf16_layer, 0)["wave"],
                              peers, config=TINY_TILES)
    with pytest.raises(MoEContractError, match="block_m"):
        _prepare(bf16_layer, config=TileConfig(block_m=32, block_n1=32, block_n2=32, block_k=32))


def test_bad_schedule_rejected_before_launch(bf16_layer):
    good = rank_schedules(bf16_layer, 0)["wave"]
    dropped = Schedule("dropped", (good.programs[0][1:],) + good.programs[1:])
    with pytest.raises(ScheduleError, match="missing"):
        _prepare(bf16_layer, schedule=dropped)


def test_out_of_range_tiles_rejected_even_unverified(bf16_layer):
    """The bounds of every table entry are checked even where the schedule rules are skipped."""
    problem = problem_of(bf16_layer, 0)
    for bad in (Tile(L1, 0, problem.num_rows, 0), Tile(L2, 0, 0, problem.l2_n_blocks),
                Tile(L1, len(problem.blocks_per_expert), 0, 0),
                Tile(L1, 1 - problem.row_expert[0], 0, 0)):
        with pytest.raises(MoEContractError, match="tile table entry"):
            _prepare(bf16_layer, schedule=Schedule("bad", ((bad,),)), verify_schedule=False)


# ----------------------------------------------------------------- cases run under the interpreter

def _run(layer: SimulatedLayer, schedules: list[Schedule], max_spin: int = 1000,
         verify: bool = True):
    """One kernel call per rank into fresh poisoned buffers; returns buffers and error counts."""
    buffers = poisoned_buffers(layer)
    peers = local_combine_peers(buffers)
    errors = []
    for rank, schedule in enumerate(schedules):
        call = prepare_fused_moe(layer.layouts[rank], layer.weights[rank], schedule, peers,
                                     config=TINY_TILES, max_spin_iters=max_spin,
                                     verify_schedule=verify)
        call()
        errors.append(call.error_count())
    return buffers, errors


def _check_against_reference(layer: SimulatedLayer, buffers) -> dict:
    worst = {}
    for rank in range(layer.world):
        out = combine_weighted_sum(buffers[rank], layer.topk_w[rank])
        refs = reference_moe(layer.x[rank], layer.topk_ids[rank], layer.topk_w[rank], layer.shape,
                                 seed=layer.seed, precision=layer.precision,
                                 scale_block=TINY_TILES.scale_block)
        for kind, want in refs.items():
            err = relative_error(out, want)
            assert err <= TOLERANCE[layer.precision][kind], f"rank {rank} {kind}: {err:.3g}"
            worst[kind] = max(worst.get(kind, 0.0), err)
    return worst


def case_schedules_match_reference(precision: str, world: int) -> dict:
    """Both schedules on P simulated ranks: no spin error, no poison left, bitwise-identical Combine
    buffers, and the float32 reference within the benchmark's tolerance."""
    layer = simulate_layer(precision, world, seed=world)
    results = {}
    for name in ("wave", "interleaved"):
        linear = []
        for rank in range(world):
            sched = rank_schedules(layer, rank)[name]
            order = execution_order(problem_of(layer, rank), sched)
            linear.append(Schedule(sched.name + "_linearized", (tuple(t for _, t in order),)))
        buffers, errors = _run(layer, linear)
        assert errors == [0] * world, errors
        assert all(not torch.isnan(b.float()).any() for b in buffers), "poisoned rows left"
        results[name] = buffers
    for rank in range(world):
        assert torch.equal(results["wave"][rank], results["interleaved"][rank]), f"rank {rank}"
    return _check_against_reference(layer, results["interleaved"])


def case_program_order_grid(precision: str) -> dict:
    """Several programs in one launch (table rows by program id), dependencies satisfiable in
    program order: bitwise equal to the single-program run."""
    layer = simulate_layer(precision, 2, seed=11)
    runs = {}
    for programs in (1, SIM_PROGRAMS):
        scheds = [in_program_order(problem_of(layer, r), rank_schedules(layer, r)["interleaved"],
                                   programs) for r in range(2)]
        buffers, errors = _run(layer, scheds)
        assert errors == [0, 0], errors
        runs[programs] = buffers
    assert all(torch.equal(a, b) for a, b in zip(runs[1], runs[SIM_PROGRAMS]))
    return _check_against_reference(layer, runs[SIM_PROGRAMS])


def case_bounded_spin() -> dict:
    """A Linear-2 tile placed before the Linear-1 tiles of its row in the only program can never be
    satisfied: the spin expires, the error flag counts it, the kernel returns, its rows stay NaN."""
    layer = simulate_layer("bf16", 2, seed=5)
    problem = problem_of(layer, 0)
    starved = problem.l2_tile(0)
    tiles = [starved] + [t for t in sorted(problem.all_tiles()) if t != starved]
    bad = Schedule("unsatisfiable", (tuple(tiles),))
    valid = in_program_order(problem_of(layer, 1), rank_schedules(layer, 1)["wave"], 1)
    buffers, errors = _run(layer, [bad, valid], max_spin=20, verify=False)
    assert errors == [1, 0], errors
    cols = slice(starved.n_block * TINY_TILES.block_n2, (starved.n_block + 1) * TINY_TILES.block_n2)
    rows = slice(starved.row_block * TINY_TILES.block_m, (starved.row_block + 1) * TINY_TILES.block_m)
    slots = layer.layouts[0].row_slot[rows]
    srcs = layer.layouts[0].row_src[rows]
    for slot, src in zip(slots.tolist(), srcs.tolist()):
        if slot >= 0:
            assert torch.isnan(buffers[src][slot, cols].float()).all()
    return {"timed_out_tiles": errors[0]}


def case_interpreter_sequential_caveat() -> dict:
    """A valid Interleaved schedule launched as is, two programs: the interpreter runs program 0 to
    completion first, so its Linear-2 tiles that need program 1's Linear-1 tiles time out."""
    layer = simulate_layer("bf16", 2, seed=5)
    scheds = [rank_schedules(layer, r, programs=2)["interleaved"] for r in range(2)]
    _, errors = _run(layer, scheds, max_spin=20)
    assert sum(errors) > 0, errors
    return {"timed_out_tiles": errors}


def interpreter_cases() -> dict:
    cases = {f"reference_{p}_P{w}": (case_schedules_match_reference, p, w)
             for p in PRECISIONS for w in WORLDS}
    cases.update({f"program_order_grid_{p}": (case_program_order_grid, p) for p in PRECISIONS})
    cases["bounded_spin"] = (case_bounded_spin,)
    cases["interpreter_sequential_caveat"] = (case_interpreter_sequential_caveat,)
    return cases


_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv", torch.float32: "fp32",
                 torch.int32: "i32", torch.int64: "i64"}


def _compile_sm90(precision: str, with_ptx: bool = False, **variant) -> dict:
    """Compile the launch that ``prepare_fused_moe`` builds (real argument list, GPU tile config and
    the divisibility hints Triton's JIT derives for 16-aligned pointers and multiples of 16) for an
    H100/H200 target, down to a cubin; report shared memory and ptxas spills. ``variant``:
    ``instrument`` / ``fence`` of ``prepare_fused_moe``; ``with_ptx`` adds the PTX text."""
    from triton.compiler import ASTSource

    from tests.experiments.triton_testing import compile_sm90, ptxas_report
    from xstage_lab.kernel_sources import load_kernel_module

    layer = simulate_layer(precision, 2, seed=1)
    call = _prepare(layer, **variant)
    kernel = load_kernel_module("moe_fused").fused_moe_kernel
    names = kernel.arg_names
    signature, attrs = {}, {}
    constexprs = {k: v for k, v in call.constexprs.items() if k not in ("num_warps", "num_stages")}
    gpu = default_tile_config(precision)
    constexprs.update(BLOCK_M=gpu.block_m, BLOCK_N1=gpu.block_n1, BLOCK_N2=gpu.block_n2,
                      BLOCK_K=gpu.block_k, SCALE_BLOCK=gpu.scale_block)
    ints = {"HIDDEN": 4096, "INTER": 2048}
    for name, arg in zip(names, call.args):
        if arg is None:
            signature[name] = "constexpr"
            constexprs[name] = None
        elif isinstance(arg, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[arg.dtype]
            attrs[(names.index(name),)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if ints.get(name, arg) % 16 == 0:
                attrs[(names.index(name),)] = [["tt.divisibility", 16]]
    for name in constexprs:
        signature.setdefault(name, "constexpr")
    compiled = compile_sm90(ASTSource(kernel, signature, constexprs, attrs),
                            num_warps=gpu.num_warps, num_stages=gpu.num_stages)
    ptxas = ptxas_report(compiled.asm["ptx"])
    return {"shared_bytes": compiled.metadata.shared, "spill_store_bytes": ptxas["spill_store_bytes"],
            "registers": ptxas["registers"], "has_cubin": bool(compiled.asm.get("cubin")),
            "wgmma": compiled.asm["ptx"].count("wgmma.mma_async"),
            # counter release (gpu) and end-of-program fence (sys); the acquire polls of a zero
            # add become acquire loads
            "release_ops": compiled.asm["ptx"].count(".release."),
            "acquire_loads": compiled.asm["ptx"].count(".acquire."),
            "vector_stores": compiled.asm["ptx"].count("st.global.v4"),
            **({"ptx": compiled.asm["ptx"]} if with_ptx else {})}


interpreter_results, test_interpreter_case = interpreter_case_tests(
    "tests.experiments.moe.test_kernel", interpreter_cases())


def test_compiles_for_sm90():
    results = child_results("tests.experiments.moe.test_kernel", "--compile-sm90", interpret=False,
                            timeout=600)
    for name, result in results.items():
        assert_case_ok(results, name)
        detail = result["detail"]
        assert detail["has_cubin"] and detail["wgmma"] > 0, (name, detail)
        assert detail["shared_bytes"] <= HOPPER_SMEM_PER_BLOCK, (name, detail)
        assert detail["spill_store_bytes"] == 0, (name, detail)
        assert detail["release_ops"] >= 2 and detail["acquire_loads"] >= 1, (name, detail)
        assert detail["vector_stores"] > 0, (name, detail)


def test_symmetric_combine_views_its_buffer(monkeypatch):
    """``SymmetricCombine`` over a CPU stand-in for the symmetric buffer (no process group)."""
    from tests.test_platform import fake_symmetric_buffer

    sym = fake_symmetric_buffer(16 * 64, world=2)
    seen = []
    monkeypatch.setattr("xstage_lab.ops.moe.combine.symmetric_buffer",
                        lambda numel, dtype, group: seen.append((numel, dtype, group)) or sym)
    combine = SymmetricCombine(16 * 64)
    assert seen == [(16 * 64, torch.bfloat16, None)]
    rows = combine.rows(8, 64)
    assert rows.shape == (8, 64) and rows.data_ptr() == sym.tensor.data_ptr()
    peers = combine.peers(8, 64)
    assert (peers.ptrs, peers.table, peers.world) == (sym.ptrs, sym.table, 2)
    combine.barrier()
    assert sym.handle.barriers == [0]
    with pytest.raises(MoEContractError, match="exceeds the 1024 elements"):
        combine.peers(32, 64)


if __name__ == "__main__":
    raise SystemExit(child_main(
        sys.argv[1:], interpreter_cases(),
        {f"compile_sm90_{p}": (_compile_sm90, p) for p in PRECISIONS}))
