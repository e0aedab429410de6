"""The compiled eager call (``ops/moe/fused_call.cpp``) on CPU, with the driver's four functions
stood in for by ctypes callbacks that record their arguments: a captured key's call writes the
argument block's addresses in slot order, sets the node's parameters and launches, returning a
fresh output; everything it must not take (no graph of the key, the stream capturing, an input
the contract check refuses, a misaligned tensor, an input autograd records, another device
current or none, a stream other than the latest call's) comes back as None with nothing
launched; a driver error raises. The real driver and the GPU are ``test_op_gpu``'s."""
from __future__ import annotations

import ctypes

import pytest
import torch

from xstage_lab.ops.moe.op import CALL_TENSORS, WEIGHT_DTYPES, fused_call_module
from xstage_lab.ops.moe.call_args import ALIGN_BYTES, slot_order

pytestmark = pytest.mark.early  # the first test builds the extension (about 35 s on 2 cores)

SET_PARAMS = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
IS_CAPTURING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
CURRENT_DEVICE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))
HIDDEN, TOP_K, MAX_TOKENS, OWN, COMBINE, STREAM = 64, 2, 16, 0x1000, 0x2000, 0x77
EXEC, NODE, PARAMS = 0x10, 0x20, 0x30


class FakeDriver:
    """The four driver functions as callbacks: what each was called with, what each returns.
    The current device is the fixture's (the CPU's index, -1), unless a test makes it another."""

    def __init__(self):
        self.calls, self.capturing, self.result = [], 0, 0
        self.device, self.context_result = -1, 0
        self.latest_stream = ctypes.c_int64(STREAM)  # StreamOrder's word: the latest call's

        def set_params(exec_, node, params):
            self.calls.append(("set_params", exec_, node, params))
            return self.result

        def launch(exec_, stream):
            self.calls.append(("launch", exec_, stream))
            return 0

        def is_capturing(stream, status):
            status[0] = self.capturing
            return 0

        def current_device(device):
            device[0] = self.device
            return self.context_result

        self.functions = (SET_PARAMS(set_params), LAUNCH(launch), IS_CAPTURING(is_capturing),
                          CURRENT_DEVICE(current_device))

    def addresses(self) -> list[int]:
        return [ctypes.cast(f, ctypes.c_void_p).value for f in self.functions]


@pytest.fixture
def fake():
    driver = FakeDriver()
    order, aligned = slot_order(*CALL_TENSORS)
    call = fused_call_module().FusedCall(
        [-1 if i is None else i for i in order], list(aligned), ALIGN_BYTES, OWN, COMBINE,
        HIDDEN, TOP_K, MAX_TOKENS, list(WEIGHT_DTYPES), torch.device("cpu"), driver.addresses(),
        ctypes.addressof(driver.latest_stream))
    words = (ctypes.c_uint64 * len(order))()
    call.add(8, torch.int64, torch.float32, False, EXEC, NODE, PARAMS, ctypes.addressof(words))
    return call, driver, words, order


def inputs(tokens=8, ids_dtype=torch.int64, weights_dtype=torch.float32):
    x = torch.randn(tokens, HIDDEN).to(torch.bfloat16)
    ids = torch.randint(0, 4, (tokens, TOP_K), dtype=ids_dtype)
    w = torch.rand(tokens, TOP_K, dtype=weights_dtype)
    return x, ids, w


def test_a_captured_keys_call_writes_the_addresses_and_launches(fake):
    call, driver, words, order = fake
    x, ids, w = inputs()
    y = call(x, ids, w, STREAM)
    assert y is not None and y.shape == x.shape and y.dtype == torch.bfloat16
    assert y.data_ptr() != x.data_ptr()
    tensors = (ids.data_ptr(), x.data_ptr(), COMBINE, w.data_ptr(), y.data_ptr())
    assert list(words) == [OWN if i is None else tensors[i] for i in order]
    assert driver.calls == [("set_params", EXEC, NODE, PARAMS), ("launch", EXEC, STREAM)]


def test_what_the_compiled_path_does_not_take_comes_back_as_none(fake):
    call, driver, words, _ = fake
    x, ids, w = inputs()
    refused = {
        "no graph of T = 9": inputs(9),
        "int32 ids: another key": inputs(ids_dtype=torch.int32),
        "int16 ids": inputs(ids_dtype=torch.int16),
        "float64 weights": inputs(weights_dtype=torch.float64),
        "x not bf16": (x.float(), ids, w),
        "x of another width": (torch.zeros(8, HIDDEN + 8, dtype=torch.bfloat16), ids, w),
        "ids of another k": (x, torch.zeros(8, TOP_K + 1, dtype=torch.int64), w),
        "T above the bound": inputs(MAX_TOKENS + 1),
        "non-contiguous x": (torch.zeros(8, 2 * HIDDEN, dtype=torch.bfloat16)[:, ::2], ids, w),
        "misaligned x": (torch.zeros(8 * HIDDEN + 1, dtype=torch.bfloat16)[1:].view(8, HIDDEN),
                         ids, w),
    }
    before = list(words)
    for why, args in refused.items():
        assert call(*args, STREAM) is None, why
    driver.capturing = 1
    assert call(x, ids, w, STREAM) is None, "the stream capturing"
    driver.capturing = 0
    driver.device = 0
    assert call(x, ids, w, STREAM) is None, "another device current: Python makes it the layer's"
    driver.device, driver.context_result = -1, 201  # CUDA_ERROR_INVALID_CONTEXT
    assert call(x, ids, w, STREAM) is None, "no context current"
    driver.context_result = 0
    assert call(x, ids, w, STREAM + 1) is None, "a stream not the latest call's: it must wait"
    torch.use_deterministic_algorithms(True)
    try:
        assert call(x, ids, w, STREAM) is None, "torch's deterministic flag: another key"
    finally:
        torch.use_deterministic_algorithms(False)
    call.remove(8, torch.int64, torch.float32, False)
    assert call(x, ids, w, STREAM) is None and len(call) == 0, "the graph dropped"
    assert driver.calls == [] and list(words) == before


def test_inputs_autograd_records_come_back_as_none_unless_grad_is_off(fake):
    """An ``x`` or weights that require grad: the Python path's (the custom op, whose output's
    backward raises), unless grad mode is off."""
    call, driver, _, _ = fake
    x, ids, w = inputs()
    for args in ((x.clone().requires_grad_(), ids, w), (x, ids, w.clone().requires_grad_())):
        assert call(*args, STREAM) is None
        with torch.no_grad():
            assert call(*args, STREAM) is not None
    assert [c[0] for c in driver.calls] == ["set_params", "launch"] * 2


def test_a_driver_error_raises(fake):
    call, driver, _, _ = fake
    driver.result = 700  # CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(RuntimeError, match="cuGraphExecKernelNodeSetParams failed: CUresult 700"):
        call(*inputs(), STREAM)
