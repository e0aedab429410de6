"""The argument block of a fused MoE call (``kernels/moe_args.py``): an int64 device tensor holding
the addresses of the tensors that change between calls of one shape (the router's output, the
activations, the Combine rows, the top-k weights, the output), which the routing kernels and the
weighted sum read instead of taking them as launch arguments. ``write_args`` rewrites it with one
launch on the current stream, so every later kernel of the call, launched directly or replayed
from a CUDA graph captured once, reads this call's tensors; a graph that captured the writer too
takes the addresses as new arguments of that node instead (``graph_launch.GraphLauncher``). The
fused MoE has no writer launch: its first routing launch takes the same addresses, in the same
parameters (``check_address_params``), and writes the block as it routes (``device_tables``)."""
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
# a first launch's parameters: the block, then from this one on one address per slot (the writer's
# order)
FIRST_ADDRESS_PARAM = 1
# what a reader casts an address to, by the tensor's dtype
TRITON_DTYPES = {torch.int32: tl.int32, torch.int64: tl.int64, torch.float16: tl.float16,
                 torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
                 torch.float64: tl.float64}


def allocate_args(device) -> torch.Tensor:
    """A call's argument block on ``device``: int64 ``[moe_args.ARGS]``, uninitialized (every
    call writes all of it before any kernel reads it: the writer its slots, the routing the
    fused kernel's ``a_rows``)."""
    return torch.empty(load_kernel_module("moe_args").ARGS.value, dtype=torch.int64,
                       device=device)


def a_rows_view(args: torch.Tensor) -> torch.Tensor:
    """The slots of ``args`` where the routing points at the rows the fused kernel's Linear-1
    reads and at their scales, and says how the scales are laid out (``moe_args.ARG_A_ROWS``):
    the fused kernel's ``a_rows``."""
    k = load_kernel_module("moe_args")
    return args[k.ARG_A_ROWS.value:k.ARG_A_ROWS.value + k.A_ROWS_SLOTS.value]


def sum_args_view(args: torch.Tensor) -> torch.Tensor:
    """The slots of ``args`` the weighted sum reads, in the block's order: the Combine rows, the
    top-k weights, the output (``moe_args``; ``fused.InKernelSum.args``)."""
    k = load_kernel_module("moe_args")
    first = k.ARG_COMBINE_ROWS.value
    if (k.ARG_TOPK_WEIGHTS.value, k.ARG_OUT.value) != (first + 1, first + 2):
        raise MoEContractError("the weighted sum's slots of the argument block are not adjacent")
    return args[first:first + 3]


def triton_dtype(dtype: torch.dtype):
    """The element type a kernel reads a tensor of ``dtype`` through."""
    if dtype not in TRITON_DTYPES:
        raise MoEContractError(f"no kernel reads {dtype} through the argument block")
    return TRITON_DTYPES[dtype]


def slot_order(*names: str) -> tuple[tuple[int | None, ...], tuple[int, ...]]:
    """Per slot of the argument block, the index in ``names`` of the tensor it takes (None: the
    block's own address), and the indices of the tensors that must start 16-byte aligned
    (``ALIGNED``). Raises MoEContractError where a name is no slot."""
    slots = slot_names()
    unknown = set(names) - set(slots)
    if unknown:
        raise MoEContractError(f"no argument slot named {sorted(unknown)}")
    return (tuple(names.index(s) if s in names else None for s in slots),
            tuple(i for i, n in enumerate(names) if n in ALIGNED))


def slot_packer(args: torch.Tensor, *names: str):
    """``pack(*tensors)``: the address each slot of ``args`` takes, in the block's order, given
    the tensors ``names`` name, in that order: that of the tensor named by the slot, else
    ``args``' own (read by no kernel of the call). The slots are placed once, here: a call
    only reads its tensors' addresses. Raises MoEContractError where a name is no slot (here) or
    a tensor of an aligned slot (``ALIGNED``) does not start 16-byte aligned (at ``pack``)."""
    order, aligned = slot_order(*names)
    own = args.data_ptr()

    def pack(*tensors: torch.Tensor) -> tuple[int, ...]:
        addresses = [t.data_ptr() for t in tensors]
        for i in aligned:
            if addresses[i] % ALIGN_BYTES:
                raise MoEContractError(f"{names[i]} must start {ALIGN_BYTES}-byte aligned")
        return tuple(own if i is None else addresses[i] for i in order)
    return pack


def slot_addresses(args: torch.Tensor, **tensors: torch.Tensor) -> tuple[int, ...]:
    """``slot_packer`` of ``args`` for the slots ``tensors`` name, applied to them."""
    return slot_packer(args, *tensors)(*tensors.values())


def write_addresses(args: torch.Tensor, addresses: tuple[int, ...]) -> None:
    """One launch on the current stream (``moe_args.write_args``): ``addresses``
    (``slot_addresses``) into ``args``."""
    launch, slots = _writer()
    # every slot at every call, in the kernel's order: the launcher keys on the same names
    launch((1,), args=args, **dict(zip(slots, addresses)))


def write_args(args: torch.Tensor, **tensors: torch.Tensor) -> None:
    """``write_addresses`` of ``slot_addresses``: each tensor's address, named by its slot, into
    ``args``, checked before the launch."""
    write_addresses(args, slot_addresses(args, **tensors))


def writer_function() -> int:
    """The ``CUfunction`` of the writer, launched at least once before: a captured graph's
    writer node is found by it (``graph_launch.GraphLauncher``), its addresses being its
    arguments from ``FIRST_ADDRESS_PARAM`` on."""
    return _writer()[0].function()


def check_address_params(kernel) -> None:
    """Raise MoEContractError unless ``kernel`` (a first launch of a call, in place of the
    writer) takes the block first and then every slot's address, in the writer's order: a graph
    gives that node its call's addresses there."""
    slots = slot_names()
    names = tuple(kernel.arg_names[FIRST_ADDRESS_PARAM:FIRST_ADDRESS_PARAM + len(slots)])
    if names != slots:
        raise MoEContractError(f"{kernel.__name__} takes {names} where the slots {slots} go")


@functools.cache
def _writer() -> tuple[Launcher, tuple[str, ...]]:
    """The writer's launcher (bound once) and its slot names, in its parameters' order."""
    kernel = load_kernel_module("moe_args").write_args
    return Launcher(kernel), tuple(kernel.arg_names[FIRST_ADDRESS_PARAM:])


def slot_names() -> tuple[str, ...]:
    """The argument block's slots, in the order a first launch takes their addresses."""
    return _writer()[1]
