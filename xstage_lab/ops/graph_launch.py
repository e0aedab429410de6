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

A ``GraphCache`` holds an op's ``GraphLauncher``s, one per key of what fixes a call's launches
(``FusedMoE.graph_key``), each captured at its key's first call without a device sync.
"""
from __future__ import annotations

import ctypes
import functools
import gc
from collections import OrderedDict

import torch
from triton.runtime import driver

CU_GRAPH_NODE_TYPE_KERNEL = 0
CUDA_ERROR_INVALID_VALUE = 1
MAX_KERNEL_PARAMS = 1024  # far above any kernel here: ends the parameter scan if the driver never does
WORD = 8  # bytes of one address argument
# Captured graphs a GraphCache (a FusedMoE's or MoEWorkspace's) keeps, least recently launched from
# Python dropped first (one still in flight is freed by the driver when it completes; a FusedMoE's
# compiled path does not reorder them): a graph holds no device memory of its own (a call
# allocates only its output, outside the graph), but each is a driver object of up to eight kernel
# nodes, and a server's token counts are unbounded.
GRAPHS_PER_LAYER = 16


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
        "cuCtxGetDevice": (ctypes.POINTER(ctypes.c_int),),
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def call_functions() -> tuple[int, int, int, int]:
    """The addresses of ``cuGraphExecKernelNodeSetParams``, ``cuGraphLaunch``,
    ``cuStreamIsCapturing`` and ``cuCtxGetDevice`` in the driver: what a compiled host path calls
    (``moe/fused_call.cpp`` takes them instead of linking the driver)."""
    lib = _driver()
    return tuple(ctypes.cast(f, ctypes.c_void_p).value for f in (
        lib.cuGraphExecKernelNodeSetParams_v2, lib.cuGraphLaunch, lib.cuStreamIsCapturing,
        lib.cuCtxGetDevice))


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


class StreamOrder:
    """The stream of the latest call over buffers that every call rewrites (one set of a fused
    MoE's): a call made on another stream first has that stream wait for the work queued on the
    latest one, that call among it, so calls run one at a time in the order they are made,
    whichever stream each is made on, as torch's own ops may be called. ``latest``: that
    stream's ``CUstream`` (-1 before any call), which a compiled host path reads at ``address``
    to hand a call on another stream back (``moe/fused_call.cpp``)."""

    def __init__(self):
        self.latest = ctypes.c_int64(-1)
        self.stream: torch.cuda.Stream | None = None

    @property
    def address(self) -> int:
        return ctypes.addressof(self.latest)

    def follow(self, stream: int, device: torch.device) -> None:
        """A call on ``stream`` (the current ``CUstream`` of ``device``) is about to be queued:
        where the latest call's stream is another, the current stream waits for its queued
        work (an event recorded there now)."""
        if stream == self.latest.value:
            return
        current = torch.cuda.current_stream(device)
        if self.stream is not None:
            current.wait_stream(self.stream)
        self.stream, self.latest.value = current, stream


class GraphCache:
    """The CUDA graphs of one op's calls, keyed by what fixes their launches, at most
    ``GRAPHS_PER_LAYER``, the least recently launched dropped first. ``capture`` records a
    call's launches into a new graph, nothing run and nothing synchronized
    (``torch.cuda.graph`` would synchronize the device first): on a side stream joined to the
    current one both ways (capture needs a stream other than the default), in ``thread_local``
    mode (other threads' CUDA calls cannot break it; this thread makes none: every launch of
    the key was bound by a direct call before)."""

    def __init__(self, device: torch.device, on_capture=None, on_drop=None,
                 order: StreamOrder | None = None):
        """``on_capture(key, launcher)`` / ``on_drop(key)``: told of each graph captured and of
        each dropped (before its launcher is released). ``order``: that of the buffers the
        calls rewrite, which each call launched eagerly follows (``StreamOrder.follow``)."""
        self.device = device
        self.on_capture, self.on_drop, self.order = on_capture, on_drop, order
        self.graphs: OrderedDict[tuple, GraphLauncher] = OrderedDict()
        self.stream: torch.cuda.Stream | None = None  # made at the first capture
        # the current CUstream's getter, looked up once (Triton's driver resolves attributes at
        # every access); off CUDA nothing launches a graph
        self.current_stream = (driver.active.get_current_stream if device.type == "cuda"
                               else None)

    def __len__(self) -> int:
        return len(self.graphs)

    def __iter__(self):
        return iter(self.graphs)

    def __contains__(self, key: tuple) -> bool:
        return key in self.graphs

    def get(self, key: tuple) -> GraphLauncher | None:
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
        return graph

    def call(self, key: tuple, launches, addresses: tuple[int, ...] = (), rewrite=None) -> None:
        """One call of ``launches()``: directly where no graph launches (``launching_graphs``);
        else ``key``'s graph launched with ``addresses``, captured after a direct call at the
        key's first call (which binds every launch new at the key). ``rewrite()``, evaluated at
        a capture only, gives what ``GraphLauncher`` takes as ``rewrite``. On ``device``,
        whichever device is current at the call."""
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            # Triton's launches, a key's first (direct) call among them, go to the current
            # device: a model split over GPUs in one process calls its layers from another
            with torch.cuda.device(self.device):
                return self.call(key, launches, addresses, rewrite)
        if not launching_graphs(self.device):
            launches()
            return
        stream = self.current_stream(self.device.index)
        if self.order is not None:
            self.order.follow(stream, self.device)
        graph = self.get(key)
        if graph is None:
            launches()
            self.capture(key, launches, rewrite() if rewrite is not None else None)
        else:
            graph(stream, addresses)

    def capture(self, key: tuple, launches, rewrite=None) -> GraphLauncher:
        """``launches()`` captured as ``key``'s graph; ``rewrite`` as ``GraphLauncher`` takes it."""
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        here, side = torch.cuda.current_stream(self.device), self.stream
        side.wait_stream(here)
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        # no cyclic collection inside the capture: it may free other graphs (a destroyed graph
        # frees its memory, which a capture forbids); torch.cuda.graph collects before instead,
        # after synchronizing
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    launches()
                finally:
                    graph.capture_end()
        finally:
            if collecting:
                gc.enable()
        here.wait_stream(side)
        launcher = self.graphs[key] = GraphLauncher(graph, rewrite)
        if len(self.graphs) > GRAPHS_PER_LAYER:
            dropped = next(iter(self.graphs))
            if self.on_drop is not None:
                self.on_drop(dropped)
            del self.graphs[dropped]
        if self.on_capture is not None:
            self.on_capture(key, launcher)
        return launcher


def launching_graphs(device: torch.device) -> bool:
    """Whether a call on ``device`` launches its graph (eagerly on CUDA), else launches directly
    (off CUDA, or while the current stream is being captured: into the user's graph)."""
    return device.type == "cuda" and not torch.cuda.is_current_stream_capturing()
