"""A Triton or Gluon kernel launched from the host in microseconds, for ops called at every layer.

``kernel[grid](*args, **constexprs)`` binds its arguments in Python at every call: it specializes
each one (a tensor's dtype and 16-byte alignment, an integer's equality to 1 and divisibility by
16), builds the cache key, looks the compiled kernel up and only then calls the driver's
launcher. For the fused MoE's launches per call (seven then) that binding was most of a call's
host time (``layer_bench``: ``host_route_us``, ``host_launch_us``). A ``Launcher`` binds its
``static`` arguments once; per call it specializes only the arguments that vary, and where that
specialization was seen before it hands the compiled kernel's argument list, with the new values
put in, straight to the driver's launcher (as ``JITFunction.run`` does after its lookup). A new
specialization goes through Triton once (compiling if needed). Under ``TRITON_INTERPRET=1`` every
call goes through Triton.
"""
from __future__ import annotations

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.interpreter import InterpretedFunction


def _specialization(value) -> tuple:
    """What Triton's binder specializes on for ``value`` (a kernel compiled for one
    specialization must not run with another): a tensor's dtype and 16-byte alignment, an
    integer's width, equality to 1 and divisibility by 16, else its type."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool) or not isinstance(value, int):
        return type(value), value if isinstance(value, bool) else None
    return -2**31 <= value < 2**31, value == 1, value % 16 == 0


class Launcher:
    """``fn`` (a ``@triton.jit`` or ``@gluon.jit`` function) with ``static`` (by name: arguments,
    constexprs and launch options such as ``num_warps``) bound once; ``launcher(grid,
    **varying)`` launches it on the current stream with the arguments that change between calls
    (the same names at every call). The launcher holds its static tensors; they must keep their
    storage (no ``resize_`` or ``set_``)."""

    def __init__(self, fn, **static):
        self.fn, self.static = fn, static
        self.interpreted = isinstance(fn, InterpretedFunction)
        self._bound: dict[tuple, tuple] = {}

    def __call__(self, grid: tuple[int, ...], **varying) -> None:
        if self.interpreted:
            self.fn[grid](**self.static, **varying)
            return
        device = driver.active.get_current_device()
        key = (device, *(_specialization(v) for v in varying.values()))
        bound = self._bound.get(key)
        if bound is None:
            self._bound[key] = self._bind(grid, varying, device)
            return
        kernel, values, positions = bound
        values = list(values)
        for name, value in varying.items():
            values[positions[name]] = _address(value)
        stream = driver.active.get_current_stream(device)
        g = (*grid, 1, 1)
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata,
                   *_launch_hooks(kernel, grid, stream, values), *values)

    def function(self) -> int:
        """The ``CUfunction`` this launcher launches (one kernel for every specialization seen
        so far; a CUDA graph's node of it is found by it). Raises ValueError before a launch or
        where specializations compiled to different kernels."""
        functions = {bound[0].function for bound in self._bound.values()}
        if len(functions) != 1:
            raise ValueError(f"{len(functions)} compiled kernels behind this launcher, not one")
        return functions.pop()

    def _bind(self, grid: tuple[int, ...], varying: dict, device: int) -> tuple:
        """Launch through Triton (compiling if needed, checking every pointer with the driver)
        and keep the compiled kernel, its bound argument list with tensors as their addresses,
        and where the varying arguments sit in it."""
        kernel = self.fn[grid](**self.static, **varying)
        binder = self.fn.device_caches[device][-1]
        arguments = binder(**self.static, **varying)[0]
        names = list(arguments)
        return (kernel, tuple(_address(v) for v in arguments.values()),
                {n: names.index(n) for n in varying})


def _address(value):
    """A tensor as its device address, which the driver's launcher takes as it is (for a tensor
    it calls ``data_ptr()`` and ``cuPointerGetAttribute`` at every launch); anything else as it
    is."""
    return value.data_ptr() if isinstance(value, torch.Tensor) else value


def _launch_hooks(kernel, grid, stream, values) -> tuple:
    """The launch metadata and Triton's enter and exit hooks (``knobs.runtime``), as
    ``JITFunction.run`` passes them; None for all three while no hook is registered (the
    metadata is built only for a hook)."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if not (getattr(enter, "calls", enter) or getattr(leave, "calls", leave)):
        return None, None, None
    return kernel.launch_metadata(grid, stream, *values), enter, leave
