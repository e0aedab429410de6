"""The top-k weighted sum (kernels/moe_combine.py) in the interpreter against its float32
reference, on a hidden size no slab divides and bf16 or fp32 weights, its output poisoned first;
its contract errors; its sm_90 build."""
from __future__ import annotations

import sys

import pytest
import torch

from tests.experiments.triton_testing import (assert_case_ok, child_main, child_results,
                                              interpreter_case_tests)
from xstage_lab.ops.moe.combine import combine_weighted_sum, weighted_sum_reference
from xstage_lab.ops.moe.shapes import MoEContractError

MODULE = "tests.ops.moe.test_combine"


def case_matches_reference(tokens: int, top_k: int, hidden: int, weight_dtype: str) -> dict:
    """Rows past ``T k`` are ignored; every output element within one bf16 rounding of the
    reference's."""
    g = torch.Generator().manual_seed(tokens * 31 + top_k)
    rows = torch.randn(tokens * top_k + 3, hidden, generator=g).to(torch.bfloat16)
    w = torch.rand(tokens, top_k, generator=g).to(getattr(torch, weight_dtype))
    got = combine_weighted_sum(rows, w)
    want = weighted_sum_reference(rows, w)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, hidden)
    assert not got.isnan().any()
    diff = (got.float() - want.float()).abs()
    assert (diff <= 2 ** -7 * want.float().abs() + 1e-6).all(), float(diff.max())
    return {"max_diff": float(diff.max())}


def interpreter_cases() -> dict:
    return {"fp32_weights": (case_matches_reference, 5, 3, 1300, "float32"),
            "bf16_weights_top10": (case_matches_reference, 2, 10, 256, "bfloat16"),
            "one_token_one_pick": (case_matches_reference, 1, 1, 1024, "float32")}


def _compile_sm90() -> dict:
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource

    from tests.experiments.triton_testing import hopper_target
    from xstage_lab.kernel_sources import load_kernel_module
    from xstage_lab.ops.moe.combine import WEIGHTED_SUM_BLOCK_H

    kernel = load_kernel_module("moe_combine").weighted_sum
    names = kernel.arg_names
    constexprs = {"TOP_K": 8, "BLOCK_H": WEIGHTED_SUM_BLOCK_H, "WEIGHT_DTYPE": tl.float32}
    signature = {"args": "*i64", "HIDDEN": "i32", **{k: "constexpr" for k in constexprs}}
    compiled = triton.compile(ASTSource(kernel, signature,
                                        {(names.index(k),): v for k, v in constexprs.items()}),
                              target=hopper_target())
    return {"has_cubin": bool(compiled.asm.get("cubin"))}


COMPILE_CASES = {"compile_sm90_weighted_sum": (_compile_sm90,)}

interpreter_results, test_interpreter_case = interpreter_case_tests(MODULE, interpreter_cases())


def test_weighted_sum_compiles_for_sm90():
    results = child_results(MODULE, "--compile-sm90", interpret=False, timeout=600)
    assert_case_ok(results, "compile_sm90_weighted_sum")
    assert results["compile_sm90_weighted_sum"]["detail"]["has_cubin"]


@pytest.mark.parametrize("rows,w", [
    (torch.zeros(6, 8, dtype=torch.float32), torch.ones(3, 2)),     # rows not bf16
    (torch.zeros(5, 8, dtype=torch.bfloat16), torch.ones(3, 2)),    # fewer rows than T k
    (torch.zeros(6, 8, dtype=torch.bfloat16), torch.ones(3, 2, dtype=torch.int32)),
])
def test_bad_input_is_refused(rows, w):
    with pytest.raises(MoEContractError):
        combine_weighted_sum(rows, w)


def test_cpu_tensors_outside_the_interpreter_take_the_reference():
    rows = torch.randn(6, 8).to(torch.bfloat16)
    w = torch.rand(3, 2)
    assert torch.equal(combine_weighted_sum(rows, w), weighted_sum_reference(rows, w))


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:], interpreter_cases(), COMPILE_CASES))
