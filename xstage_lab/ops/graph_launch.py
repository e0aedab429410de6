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
every call.
"""
from __future__ import annotations

import ctypes
import functools

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
        "cuGraphLaunch": (p, p),
        "cuStreamIsCapturing": (p, ctypes.POINTER(ctypes.c_int)),
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def call_functions() -> tuple[int, int, int]:
    """The addresses of ``cuGraphExecKernelNodeSetParams``, ``cuGraphLaunch`` and
    ``cuStreamIsCapturing`` in the driver: what a compiled host path calls (``moe/fused_call.cpp``
    takes them instead of linking the driver)."""
    lib = _driver()
    return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in (
        lib.cuGraphExecKernelNodeSetParams_v2, lib.cuGraphLaunch, lib.cuStreamIsCapturing))


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


class GraphLauncher:
    """``graph`` (a ``torch.cuda.CUDAGraph`` captured with ``keep_graph=True``, instantiated here)
    launched by ``launcher(stream, addresses)``. ``rewrite``: ``(function, first, captured)``,
    the ``CUfunction`` of the graph's one kernel node whose arguments ``first ..`` are addresses
    that change between launches, and the values they had at capture (checked: a kernel whose
    parameters lie otherwise raises DriverError here, not at a launch). Without ``rewrite`` a
    launch takes no addresses. The launcher holds ``graph``: its executable lives as long."""

    def __init__(self, graph: torch.cuda.CUDAGraph,
                 rewrite: tuple[int, int, tuple[int, ...]] | None = None):
        graph.instantiate()
        self.graph = graph
        self._exec = ctypes.c_void_p(graph.raw_cuda_graph_exec())
        # the two driver functions of a call, looked up once: a call's host time is counted
        self._set_params = _driver().cuGraphExecKernelNodeSetParams_v2
        self._graph_launch = _driver().cuGraphLaunch
        self._node = self._params = self._words = None
        if rewrite is not None:
            self._bind(graph, *rewrite)

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

    def handles(self) -> tuple[int, int, int, int]:
        """``(exec, node, params, words)``: the executable graph, the rewritten node, the address of
        its ``CUDA_KERNEL_NODE_PARAMS`` and of its first address word in the parameter block,
        which this launcher keeps alive (for ``moe/fused_call.cpp``). Only with ``rewrite``."""
        if self._words is None:
            raise DriverError("a launcher without rewrite has no node to hand over")
        return (self._exec.value, self._node.value, ctypes.addressof(self._params_struct),
                ctypes.addressof(self._words))

    def __call__(self, stream: int, addresses: tuple[int, ...] = ()) -> None:
        """Launch on ``stream`` (a ``CUstream``), the rewritten node taking ``addresses``."""
        if self._words is not None:
            self.set_addresses(addresses)
        self.launch(stream)

    def set_addresses(self, addresses: tuple[int, ...]) -> None:
        """``addresses`` into the rewritten node (one driver call)."""
        self._words[:] = addresses
        result = self._set_params(self._exec, self._node, self._params)
        if result:
            _check(result, "cuGraphExecKernelNodeSetParams")

    def launch(self, stream: int) -> None:
        """The executable graph launched on ``stream`` (one driver call)."""
        result = self._graph_launch(self._exec, stream)
        if result:
            _check(result, "cuGraphLaunch")
