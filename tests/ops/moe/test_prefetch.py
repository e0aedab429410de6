"""The weights' L2 prefetch beside the routing (kernels/moe_prefetch.py) in the interpreter: the
experts each program picks equal the host reference (the first touched experts in id order) at
EP = 1 and on an EP rank, with ids out of range, repeated ids, ids past the count and fewer
experts touched than programs; its programs from the budget; and the sm_90 build, prefetch
instructions included."""
from __future__ import annotations

import sys

import pytest
import torch

from tests.experiments.triton_testing import (assert_case_ok, child_main, child_results,
                                              interpreter_case_tests)
from xstage_lab.ops.moe.call_args import allocate_args, write_args
from xstage_lab.ops.moe.prefetch import LANE_BYTES, LANES, PIECE, WeightPrefetch, prefetched_experts
from xstage_lab.ops.moe.weights import ExpertWeights

MODULE = "tests.ops.moe.test_prefetch"
HIDDEN, INTER = 512, 256  # one expert's Linear-1 weights: 2 * 256 * 512 bf16 = 512 KiB, 2 pieces
EXPERT_BYTES = 2 * INTER * HIDDEN * 2


def _weights(experts: int) -> ExpertWeights:
    return ExpertWeights("bf16", torch.zeros(experts, 2 * INTER, HIDDEN, dtype=torch.bfloat16),
                         torch.zeros(experts, HIDDEN, INTER, dtype=torch.bfloat16))


def _picked(experts: int, budget: int, ids: torch.Tensor, n: int | None = None) -> tuple:
    args = allocate_args("cpu")
    prefetch = WeightPrefetch(_weights(experts), args, budget, issue=False)
    prefetch.prefetched.fill_(-7)  # poisoned: every program writes its entry
    write_args(args, expert_ids=ids)
    prefetch.launch(ids.numel(), ids.dtype,
                    None if n is None else torch.tensor([n], dtype=torch.int32))
    want = prefetched_experts(ids if n is None else ids[:n], experts, prefetch)
    return prefetch.prefetched.tolist(), want


def case_ep1_picks_the_first_touched_experts() -> dict:
    """T k ids (int64), repeated and out of range, over more arrivals than one step reads."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(20, 60, (1500, 4), generator=g)
    ids[5, 1], ids[900, 0] = -1, 64  # out of range: left out
    ids[1400, 2] = 9  # touched once, past the first step of 1024 ids
    got, want = _picked(64, 5 * EXPERT_BYTES, ids.reshape(-1))
    assert want == [9, 9, 20, 20, 21, 21, 22, 22, 23, 23] and got == want, (got, want)
    return {"picked": got}


def case_ep_rank_reads_only_the_counted_ids() -> dict:
    """int32 local expert ids, a count on the device below the capacity: the rest ignored."""
    ids = torch.tensor([6, 2, 6, 2, 0, 1, 1, 1], dtype=torch.int32)
    got, want = _picked(8, 3 * EXPERT_BYTES, ids, n=4)
    assert got == want == [2, 2, 6, 6, -1, -1], (got, want)
    return {"picked": got}


def case_no_arrivals_picks_nothing() -> dict:
    got, want = _picked(8, EXPERT_BYTES, torch.zeros(4, dtype=torch.int32), n=0)
    assert got == want == [-1, -1], (got, want)
    return {"picked": got}


def interpreter_cases() -> dict:
    return {
        "ep1_picks_the_first_touched_experts": (case_ep1_picks_the_first_touched_experts,),
        "ep_rank_reads_only_the_counted_ids": (case_ep_rank_reads_only_the_counted_ids,),
        "no_arrivals_picks_nothing": (case_no_arrivals_picks_nothing,),
    }


def _compile_sm90() -> dict:
    """The kernel built for sm_90 as an H200 launches it: one bulk L2 prefetch per lane."""
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource

    from tests.experiments.triton_testing import hopper_target
    from xstage_lab.kernel_sources import load_kernel_module

    kernel = load_kernel_module("moe_prefetch").prefetch_weights
    constexprs = dict(NUM_EXPERTS=384, RECEIVED=True, E_PAD=512, BLOCK=1024,
                      EXPERT_BYTES=EXPERT_BYTES, LANES=LANES, LANE_BYTES=LANE_BYTES,
                      ID_DTYPE=tl.int64, ISSUE=True)
    signature = {"args": "*i64", "n_arrivals_ptr": "*i32", "w1": "*bf16", "prefetched": "*i32",
                 "CAPACITY": "i32", **{k: "constexpr" for k in constexprs}}
    names = kernel.arg_names
    compiled = triton.compile(ASTSource(kernel, signature,
                                        {(names.index(k),): v for k, v in constexprs.items()}),
                              target=hopper_target(), options={"num_warps": LANES // 32})
    return {"has_cubin": bool(compiled.asm.get("cubin")),
            "prefetches": compiled.asm["ptx"].count("cp.async.bulk.prefetch.L2.global")}


COMPILE_CASES = {"compile_sm90": (_compile_sm90,)}

interpreter_results, test_interpreter_case = interpreter_case_tests(MODULE, interpreter_cases())


def test_prefetch_compiles_for_sm90():
    results = child_results(MODULE, "--compile-sm90", interpret=False, timeout=600)
    assert_case_ok(results, "compile_sm90")
    detail = results["compile_sm90"]["detail"]
    assert detail["has_cubin"] and detail["prefetches"] >= 1, detail


@pytest.mark.parametrize("budget,programs", [(PIECE, 1), (PIECE + 1, 1),
                                             (7 * EXPERT_BYTES // 2, 7)])
def test_programs_follow_the_budget(budget, programs):
    assert WeightPrefetch(_weights(8), allocate_args("cpu"), budget, False).programs == programs


def test_a_budget_or_experts_under_one_piece_are_refused():
    with pytest.raises(ValueError, match="must hold"):
        WeightPrefetch(_weights(8), allocate_args("cpu"), PIECE - 1, False)
    small = ExpertWeights("bf16", torch.zeros(8, 2 * 64, 512, dtype=torch.bfloat16),
                          torch.zeros(8, 512, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="must hold"):
        WeightPrefetch(small, allocate_args("cpu"), 4 * PIECE, False)


def test_no_prefetch_off_hopper():
    assert WeightPrefetch.for_device(_weights(8), allocate_args("cpu")) is None


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:], interpreter_cases(), COMPILE_CASES))
