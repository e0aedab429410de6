"""The call's argument block (kernels/moe_args.py): the writer in the interpreter stores each named
tensor's address into its slot and the block's own address into the others; misaligned tensors of
the aligned slots and unknown slot names refused before the launch; the writer's sm_90 build."""
from __future__ import annotations

import sys

import pytest
import torch

from tests.experiments.triton_testing import (assert_case_ok, child_main, child_results,
                                              interpreter_case_tests)
from xstage_lab.kernel_sources import load_kernel_module
from xstage_lab.ops.moe.call_args import allocate_args, write_args
from xstage_lab.ops.moe.shapes import MoEContractError

MODULE = "tests.ops.moe.test_call_args"


def case_slots_hold_the_addresses() -> dict:
    """Two writes into one block: each leaves exactly its own tensors' addresses in the writer's
    slots (the two after them, ``a_rows``, are the routing's)."""
    k = load_kernel_module("moe_args")
    args = allocate_args("cpu")
    ids, x = torch.zeros(4, dtype=torch.int64), torch.zeros(2, 8, dtype=torch.bfloat16)
    write_args(args, expert_ids=ids, x=x)
    own = args.data_ptr()
    written = k.ARG_A_ROWS.value
    assert args.tolist()[:written] == [ids.data_ptr(), x.data_ptr(), own, own, own, own]
    rows, w, out = (torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(3),
                    torch.zeros(1, 8, dtype=torch.bfloat16))
    write_args(args, combine_rows=rows, topk_weights=w, out=out)
    want = {k.ARG_EXPERT_IDS.value: own, k.ARG_X.value: own,
            k.ARG_COMBINE_ROWS.value: rows.data_ptr(), k.ARG_TOPK_WEIGHTS.value: w.data_ptr(),
            k.ARG_OUT.value: out.data_ptr()}
    assert args.tolist()[:written] == [want.get(i, own) for i in range(written)]
    return {"slots": k.ARGS.value}


def interpreter_cases() -> dict:
    return {"slots_hold_the_addresses": (case_slots_hold_the_addresses,)}


def _compile_sm90() -> dict:
    import triton
    from triton.compiler import ASTSource

    from tests.experiments.triton_testing import hopper_target

    kernel = load_kernel_module("moe_args").write_args
    signature = {"args": "*i64", **{n: "i64" for n in kernel.arg_names[1:]}}
    compiled = triton.compile(ASTSource(kernel, signature, {}), target=hopper_target(),
                              options={"num_warps": 1})
    return {"has_cubin": bool(compiled.asm.get("cubin"))}


COMPILE_CASES = {"compile_sm90_write_args": (_compile_sm90,)}

interpreter_results, test_interpreter_case = interpreter_case_tests(MODULE, interpreter_cases())


def test_write_args_compiles_for_sm90():
    results = child_results(MODULE, "--compile-sm90", interpret=False, timeout=600)
    assert_case_ok(results, "compile_sm90_write_args")
    assert results["compile_sm90_write_args"]["detail"]["has_cubin"]


@pytest.mark.parametrize("tensors,message", [
    (lambda: {"x": torch.zeros(9, dtype=torch.bfloat16)[1:]}, "x must start 16-byte aligned"),
    (lambda: {"out": torch.zeros(9, dtype=torch.bfloat16)[1:]}, "out must start 16-byte"),
    (lambda: {"y": torch.zeros(8)}, "no argument slot named"),
])
def test_bad_tensors_are_refused_before_the_launch(tensors, message):
    args = allocate_args("cpu").fill_(-1)
    with pytest.raises(MoEContractError, match=message):
        write_args(args, **tensors())
    assert (args == -1).all()  # nothing written


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:], interpreter_cases(), COMPILE_CASES))
