"""The subset of Gluon that ``kernels/moe_program_tables.py`` uses, in numpy, so that its programs
run on the CPU one after another (Gluon kernels do not run in Triton's interpreter): tensors
without layouts, pointers as (buffer, offsets), integer division and remainder truncating as on
the GPU. Only for the tests of that module's arithmetic: what compiles, and how, the sm_90 builds
and the GPU tests check."""
from __future__ import annotations

import types
from pathlib import Path

import numpy as np

from xstage_lab.kernel_sources import kernel_path


def _value(x):
    return x.a if isinstance(x, Tensor) else x


E4M3 = "float8e4nv"  # the e4m3 dtype's stand-in: its values converted by torch, kept as bytes


def _convert(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` as ``dtype``; to e4m3 its bytes, rounded to nearest even as torch (and the GPU's
    cvt.rn) rounds."""
    if dtype == E4M3:
        import torch

        return torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(
            torch.float8_e4m3fn).view(torch.uint8).numpy()
    return a.astype(dtype)


def _trunc_div(a, b):
    q = np.abs(a) // np.abs(b)
    return np.where((np.asarray(a) < 0) != (np.asarray(b) < 0), -q, q)


class Tensor:
    """A numpy array with the operators Gluon code applies to tensors."""

    def __init__(self, a):
        self.a = np.asarray(a)

    shape = property(lambda self: self.a.shape)

    def to(self, dtype):
        return Tensor(_convert(self.a, dtype))

    def __getitem__(self, key):
        return Tensor(self.a[key])

    def __bool__(self):
        return bool(self.a)

    def __index__(self):
        return int(self.a)

    def __floordiv__(self, other):
        return Tensor(_trunc_div(self.a, _value(other)))

    def __rfloordiv__(self, other):
        return Tensor(_trunc_div(_value(other), self.a))

    def __mod__(self, other):
        return Tensor(self.a - _trunc_div(self.a, _value(other)) * _value(other))

    def __rmod__(self, other):
        return Tensor(_value(other) - _trunc_div(_value(other), self.a) * self.a)

    def __invert__(self):
        return Tensor(~self.a)

    def __neg__(self):
        return Tensor(-self.a)


for _name in ("add", "sub", "mul", "and", "or", "lt", "le", "gt", "ge", "eq", "ne", "lshift",
              "rshift"):
    def _binary(op):
        return lambda self, other: Tensor(getattr(self.a, op)(_value(other)))
    setattr(Tensor, f"__{_name}__", _binary(f"__{_name}__"))
    if _name in ("add", "sub", "mul", "and", "or"):
        setattr(Tensor, f"__r{_name}__", _binary(f"__r{_name}__"))


class Pointer:
    """``buffer`` (a flat numpy array the test owns) at element ``offsets``."""

    def __init__(self, buffer: np.ndarray, offsets=0):
        self.buffer, self.offsets = buffer, np.asarray(offsets)

    def __add__(self, other):
        return Pointer(self.buffer, self.offsets + _value(other))

    __radd__ = __add__


def _load(pointer, mask=None, other=0):
    mask = np.ones(pointer.offsets.shape, bool) if mask is None else np.broadcast_to(
        _value(mask), pointer.offsets.shape)
    out = np.full(pointer.offsets.shape, _value(other), dtype=pointer.buffer.dtype)
    out[mask] = pointer.buffer[pointer.offsets[mask]]
    return Tensor(out)


def _store(pointer, value, mask=None):
    offsets = np.broadcast_to(pointer.offsets, np.broadcast(pointer.offsets,
                                                             _value(value)).shape)
    value = np.broadcast_to(_value(value), offsets.shape)
    mask = np.ones(offsets.shape, bool) if mask is None else np.broadcast_to(_value(mask),
                                                                             offsets.shape)
    pointer.buffer[offsets[mask]] = value[mask]


def _atomic_add(pointer, value, **_):
    old = pointer.buffer[pointer.offsets].copy()
    pointer.buffer[pointer.offsets] += _value(value)
    return Tensor(old)


class _Program:
    """The program a launch runs now, and the launch's programs."""
    pid = 0
    programs = 1


def language() -> types.SimpleNamespace:
    """The ``gl`` these kernels call."""
    def layout(*args, **kwargs):
        return None

    return types.SimpleNamespace(
        constexpr=lambda x: x, BlockedLayout=layout, SliceLayout=layout,
        int32=np.int32, int64=np.int64, float32=np.float32, float8e4nv=E4M3,
        pointer_type=lambda dtype: None,
        arange=lambda start, end, layout=None: Tensor(np.arange(start, end)),
        load=_load, store=_store, atomic_add=_atomic_add,
        sum=lambda x, axis: Tensor(np.sum(_value(x), axis=axis)),
        max=lambda x, axis: Tensor(np.max(_value(x), axis=axis)),
        reduce_or=lambda x, axis: Tensor(np.bitwise_or.reduce(_value(x), axis=axis)),
        abs=lambda x: Tensor(np.abs(_value(x))),
        div_rn=lambda a, b: Tensor(np.float32(_value(a)) / np.float32(_value(b))),
        where=lambda c, a, b: Tensor(np.where(_value(c), _value(a), _value(b))),
        gather=lambda src, index, axis: Tensor(np.take(_value(src), _value(index), axis=axis)),
        minimum=lambda a, b: Tensor(np.minimum(_value(a), _value(b))),
        maximum=lambda a, b: Tensor(np.maximum(_value(a), _value(b))),
        cdiv=lambda a, b: Tensor(_trunc_div(_value(a) + _value(b) - 1, _value(b))),
        zeros_like=lambda x: Tensor(np.zeros_like(_value(x))),
        full_like=lambda x, v: Tensor(np.full_like(_value(x), v)),
        program_id=lambda axis: Tensor(_Program.pid),
        num_programs=lambda axis: Tensor(_Program.programs))


def load_kernels(name: str) -> types.SimpleNamespace:
    """``kernels/<name>.py`` executed over this module's ``gl``, its ``gluon.jit`` the plain
    function; its functions, called program by program (``launch``)."""
    source = Path(kernel_path(f"{name}.py")).read_text()
    source = source.replace("from triton.experimental import gluon\n", "").replace(
        "from triton.experimental.gluon import language as gl\n", "")
    jit = types.SimpleNamespace(jit=lambda fn=None, **_: fn if fn is not None else (lambda f: f))
    namespace = {"gluon": jit, "gl": language(), "__name__": f"gluon_numpy.{name}"}
    exec(compile(source, str(kernel_path(f"{name}.py")), "exec"), namespace)
    return types.SimpleNamespace(**{k: v for k, v in namespace.items() if callable(v)})


def launch(kernel, programs: int, *args, **kwargs) -> None:
    """``kernel`` run as a launch of ``programs`` programs, one after another."""
    _Program.programs = programs
    for pid in range(programs):
        _Program.pid = pid
        kernel(*args, **kwargs)
