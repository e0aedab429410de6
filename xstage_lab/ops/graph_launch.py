"""A captured CUDA graph launched from the host in two driver calls, with new pointer arguments
for one of its kernel nodes: for ops called at every layer, whose host time per call is counted.

``CUDAGraph.replay`` costs the host about as much as a bare kernel launch through torch, and an
op whose tensors change between calls must rewrite their addresses somewhere before the replay:
a kernel launched for that (``call_args.write_args`` through Triton's launcher) costs another
launch of host time. A ``GraphLauncher`` keeps the graph's argument-writer node instead and, per
call, puts the new addresses into a parameter block it owns and hands it to the driver
(``cuGraphExecKernelNodeSetParams``), then launches the executable graph (``cuGraphLaunch``).
The driver copies a kernel node's parameters when the graph is launched, so a launch already
queued keeps the addresses it was launched with (CUDA Driver API, Graph Management).

The driver is called through ``ctypes`` with the parameter block built once: per call only the
address words change, where a binding that marshals the parameter array would rebuild it at
every call. A launcher may hold several executables of its graph (``copies``) and launch them in
turn, so that a call rarely relaunches an executable whose last launch is still queued
(``layer_bench`` times both: ``host_replay_us`` against ``host_replay_one_us``).
"""
from __future__ import annotations

import ctypes
import functools
import weakref

import torch

CU_GRAPH_NODE_TYPE_KERNEL = 0
CUDA_ERROR_INVALID_VALUE = 1
MAX_KERNEL_PARAMS = 1024  # far above any kernel here: ends the parameter scan if the driver never does
WORD = 8  # bytes of one address argument


class _KernelNodeParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS_v2`` (cuda.h)."""

    _fields_ = [("func", ctypes.c_void_p),
                ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.POINTER(ctypes.c_void_p)),
                ("extra", ctypes.POINTER(ctypes.c_void_p)),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class DriverError(RuntimeError):
    """A CUDA driver call failed."""


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    p, size = ctypes.c_void_p, ctypes.c_size_t
    signatures = {
        "cuGetErrorName": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
        "cuGraphGetNodes": (p, ctypes.POINTER(p), ctypes.POINTER(size)),
        "cuGraphNodeGetType": (p, ctypes.POINTER(ctypes.c_int)),
        "cuGraphKernelNodeGetParams_v2": (p, ctypes.POINTER(_KernelNodeParams)),
        "cuFuncGetParamInfo": (p, size, ctypes.POINTER(size), ctypes.POINTER(size)),
        "cuGraphExecKernelNodeSetParams_v2": (p, p, ctypes.POINTER(_KernelNodeParams)),
        "cuGraphInstantiateWithFlags": (ctypes.POINTER(p), p, ctypes.c_ulonglong),
        "cuGraphExecDestroy": (p,),
        "cuGraphLaunch": (p, p),
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def _check(result: int, call: str) -> None:
    if result:
        name = ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        raise DriverError(f"{call} failed: {(name.value or b'?').decode()} ({result})")


def _kernel_nodes(graph: int) -> list[tuple[int, _KernelNodeParams]]:
    """Every kernel node of the ``CUgraph`` ``graph`` with its parameters."""
    lib, count = _driver(), ctypes.c_size_t()
    _check(lib.cuGraphGetNodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(lib.cuGraphGetNodes(graph, nodes, ctypes.byref(count)), "cuGraphGetNodes")
    found = []
    for node in nodes:
        kind = ctypes.c_int()
        _check(lib.cuGraphNodeGetType(node, ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value == CU_GRAPH_NODE_TYPE_KERNEL:
            params = _KernelNodeParams()
            _check(lib.cuGraphKernelNodeGetParams_v2(node, ctypes.byref(params)),
                   "cuGraphKernelNodeGetParams")
            found.append((node, params))
    return found


def _param_layout(function: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of each parameter of the ``CUfunction`` ``function``, in order."""
    lib, layout = _driver(), []
    for index in range(MAX_KERNEL_PARAMS):
        offset, size = ctypes.c_size_t(), ctypes.c_size_t()
        result = lib.cuFuncGetParamInfo(function, index, ctypes.byref(offset), ctypes.byref(size))
        if result == CUDA_ERROR_INVALID_VALUE:  # past the last parameter
            return layout
        _check(result, "cuFuncGetParamInfo")
        layout.append((offset.value, size.value))
    raise DriverError(f"more than {MAX_KERNEL_PARAMS} kernel parameters")


def _destroy(execs: list[ctypes.c_void_p]) -> None:
    """Free ``execs``; one still in flight is freed by the driver when it completes."""
    for e in execs:
        _driver().cuGraphExecDestroy(e)


class GraphLauncher:
    """``graph`` (a ``torch.cuda.CUDAGraph`` captured with ``keep_graph=True``) instantiated
    ``copies`` times here and launched by ``launcher(stream, addresses)``, one executable after
    another. ``rewrite``: ``(function, first, captured)``, the ``CUfunction`` of the graph's one
    kernel node whose arguments ``first ..`` are addresses that change between launches, and the
    values they had at capture (checked: a kernel whose parameters lie otherwise raises
    DriverError here, not at a launch). Without ``rewrite`` a launch takes no addresses. The
    launcher holds ``graph`` (its node handles name the node to rewrite) and frees its
    executables when it is collected."""

    def __init__(self, graph: torch.cuda.CUDAGraph,
                 rewrite: tuple[int, int, tuple[int, ...]] | None = None, copies: int = 1):
        if copies < 1:
            raise ValueError(f"copies must be >= 1, got {copies}")
        self.graph = graph
        self._execs: list[ctypes.c_void_p] = []
        finalizer = weakref.finalize(self, _destroy, self._execs)
        finalizer.atexit = False  # the driver may be gone by then; the process frees them
        for _ in range(copies):
            e = ctypes.c_void_p()
            _check(_driver().cuGraphInstantiateWithFlags(ctypes.byref(e),
                                                         graph.raw_cuda_graph(), 0),
                   "cuGraphInstantiateWithFlags")
            self._execs.append(e)
        self._next = 0
        # the two driver functions of a call, looked up once: a call's host time is counted
        self._set_params = _driver().cuGraphExecKernelNodeSetParams_v2
        self._graph_launch = _driver().cuGraphLaunch
        self.rewrite = rewrite  # another launcher of ``graph`` takes it as is
        self._node = self._params = self._words = None
        if rewrite is not None:
            self._bind(graph, *rewrite)

    @property
    def copies(self) -> int:
        return len(self._execs)

    def _bind(self, graph: torch.cuda.CUDAGraph, function: int, first: int,
              captured: tuple[int, ...]) -> None:
        nodes = [(n, p) for n, p in _kernel_nodes(graph.raw_cuda_graph()) if p.func == function]
        if len(nodes) != 1:
            raise DriverError(f"the graph holds {len(nodes)} kernel nodes of the function to "
                              "rewrite, not one")
        node, params = nodes[0]
        layout = _param_layout(function)
        block = ctypes.create_string_buffer(max((o + s for o, s in layout), default=1))
        for i, (offset, size) in enumerate(layout):  # the captured values of every argument
            ctypes.memmove(ctypes.addressof(block) + offset, params.kernelParams[i], size)
        words = layout[first:first + len(captured)]
        if len(words) != len(captured) or any(
                (o, s) != (layout[first][0] + WORD * i, WORD) for i, (o, s) in enumerate(words)):
            raise DriverError(f"arguments {first}..{first + len(captured) - 1} are not "
                              f"consecutive {WORD}-byte words: {layout}")
        self._words = (ctypes.c_uint64 * len(captured)).from_buffer(block, layout[first][0])
        if tuple(self._words) != tuple(captured):
            raise DriverError("the rewritten node's arguments are not the addresses it was "
                              "captured with")
        self._block = block  # the parameter block the pointers below point into
        self._pointers = (ctypes.c_void_p * len(layout))(
            *(ctypes.addressof(block) + o for o, _ in layout))
        params.kernelParams = ctypes.cast(self._pointers, ctypes.POINTER(ctypes.c_void_p))
        params.extra = None
        self._node, self._params = ctypes.c_void_p(node), ctypes.byref(params)
        self._params_struct = params  # what the reference above points to

    def __call__(self, stream: int, addresses: tuple[int, ...] = ()) -> None:
        """Launch the next executable on ``stream`` (a ``CUstream``), the rewritten node taking
        ``addresses``."""
        e = self._execs[self._next]
        self._next = (self._next + 1) % len(self._execs)
        if self._words is not None:
            self.set_addresses(e, addresses)
        self.launch(e, stream)

    def set_addresses(self, e: ctypes.c_void_p, addresses: tuple[int, ...]) -> None:
        """``addresses`` into the rewritten node of the executable ``e`` (one driver call)."""
        self._words[:] = addresses
        result = self._set_params(e, self._node, self._params)
        if result:
            _check(result, "cuGraphExecKernelNodeSetParams")

    def launch(self, e: ctypes.c_void_p, stream: int) -> None:
        """The executable ``e`` launched on ``stream`` (one driver call)."""
        result = self._graph_launch(e, stream)
        if result:
            _check(result, "cuGraphLaunch")

    @property
    def executables(self) -> tuple[ctypes.c_void_p, ...]:
        return tuple(self._execs)
