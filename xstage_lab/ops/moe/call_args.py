"""The argument block of a fused MoE call (``kernels/moe_args.py``): an int64 device tensor holding
the addresses of the tensors that change between calls of one shape (the router's output, the
activations, the Combine rows, the top-k weights, the output), which the routing kernels and the
weighted sum read instead of taking them as launch arguments. ``write_args`` rewrites it with one
launch on the current stream, so every later kernel of the call, launched directly or replayed
from a CUDA graph captured once, reads this call's tensors."""
from __future__ import annotations

import functools

import torch
import triton.language as tl

from ...kernel_sources import load_kernel_module
from ...platform import ALIGN_BYTES
from ..launcher import Launcher
from .shapes import MoEContractError

# the slots whose readers assume 16-byte aligned addresses (vectorized rows)
ALIGNED = ("x", "combine_rows", "out")
# what a reader casts an address to, by the tensor's dtype
TRITON_DTYPES = {torch.int32: tl.int32, torch.int64: tl.int64, torch.float16: tl.float16,
                 torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
                 torch.float64: tl.float64}


def allocate_args(device) -> torch.Tensor:
    """A call's argument block on ``device``: int64 ``[moe_args.ARGS]``, uninitialized (every
    call writes all of it before any kernel reads it)."""
    return torch.empty(load_kernel_module("moe_args").ARGS.value, dtype=torch.int64,
                       device=device)


def triton_dtype(dtype: torch.dtype):
    """The element type a kernel reads a tensor of ``dtype`` through."""
    if dtype not in TRITON_DTYPES:
        raise MoEContractError(f"no kernel reads {dtype} through the argument block")
    return TRITON_DTYPES[dtype]


def write_args(args: torch.Tensor, **tensors: torch.Tensor) -> None:
    """One launch on the current stream (``moe_args.write_args``): the address of each tensor,
    named by its slot, into ``args``; a slot not named holds ``args``' own address (read by no
    kernel of the call). Raises MoEContractError, before the launch, where a tensor of an aligned
    slot (``ALIGNED``) does not start 16-byte aligned."""
    launch, slots = _writer()
    unknown = tensors.keys() - slots
    if unknown:
        raise MoEContractError(f"no argument slot named {sorted(unknown)}")
    for name in ALIGNED:
        if name in tensors and tensors[name].data_ptr() % ALIGN_BYTES:
            raise MoEContractError(f"{name} must start {ALIGN_BYTES}-byte aligned")
    # every slot at every call, in the kernel's order: the launcher keys on the same names
    launch((1,), args=args, **{s: tensors.get(s, args).data_ptr() for s in slots})


@functools.cache
def _writer() -> tuple[Launcher, tuple[str, ...]]:
    """The writer's launcher (bound once) and its slot names, in its parameters' order."""
    kernel = load_kernel_module("moe_args").write_args
    return Launcher(kernel), tuple(kernel.arg_names[1:])
