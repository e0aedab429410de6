"""``graph_launch``'s view of the CUDA driver's ABI against ``cuda.h`` (no GPU needed): the kernel
node parameter struct's size and field offsets and the two enum values it reads, as a host
program compiled by nvcc against the toolkit's own header prints them. ``StreamOrder`` with
CUDA's streams stood in for; ``GraphCache.call`` on its device with CUDA's current device
stood in for."""
from __future__ import annotations

import ctypes
import subprocess

import torch

from tests.experiments.cuda_testing import needs_nvcc
from xstage_lab.ops import graph_launch
from xstage_lab.ops.graph_launch import GraphCache, StreamOrder, _KernelNodeParams

PROGRAM = """
#include <cstddef>
#include <cstdio>
#include <cuda.h>
int main() {
  printf("size %zu\\n", sizeof(CUDA_KERNEL_NODE_PARAMS_v2));
FIELDS
  printf("CU_GRAPH_NODE_TYPE_KERNEL %d\\n", (int)CU_GRAPH_NODE_TYPE_KERNEL);
  printf("CUDA_ERROR_INVALID_VALUE %d\\n", (int)CUDA_ERROR_INVALID_VALUE);
}
"""


@needs_nvcc
def test_kernel_node_params_match_cuda_h(tmp_path):
    fields = "\n".join(f'  printf("{name} %zu\\n", offsetof(CUDA_KERNEL_NODE_PARAMS_v2, {name}));'
                       for name, _ in _KernelNodeParams._fields_)
    source, exe = tmp_path / "abi.cpp", tmp_path / "abi"
    source.write_text(PROGRAM.replace("FIELDS", fields))
    r = subprocess.run(["nvcc", "-o", str(exe), str(source)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    printed = dict(line.split() for line in subprocess.run(
        [str(exe)], capture_output=True, text=True, check=True).stdout.splitlines())
    ours = {name: getattr(_KernelNodeParams, name).offset for name, _ in _KernelNodeParams._fields_}
    ours["size"] = ctypes.sizeof(_KernelNodeParams)
    ours["CU_GRAPH_NODE_TYPE_KERNEL"] = graph_launch.CU_GRAPH_NODE_TYPE_KERNEL
    ours["CUDA_ERROR_INVALID_VALUE"] = graph_launch.CUDA_ERROR_INVALID_VALUE
    assert {k: int(v) for k, v in printed.items()} == ours


class FakeStream:
    def __init__(self, handle: int):
        self.handle, self.waited_for = handle, []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited_for.append(other.handle)


def test_a_call_on_another_stream_waits_for_the_latest_calls(monkeypatch):
    """Calls on streams 11, 11, 22, 22, 11: the first and those on the latest call's stream wait
    for nothing, each that changes stream waits for the one before; the word at ``address``
    (what the compiled path reads) holds the latest call's stream, -1 before any."""
    streams = {h: FakeStream(h) for h in (11, 22)}
    current = [11]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams[current[0]])
    order = StreamOrder()
    latest = ctypes.c_int64.from_address(order.address)
    assert latest.value == -1
    for handle in (11, 11, 22, 22, 11):
        current[0] = handle
        order.follow(handle, torch.device("cuda", 0))
        assert latest.value == handle
    assert streams[11].waited_for == [22] and streams[22].waited_for == [11]


def test_a_call_launches_on_the_caches_device_whichever_is_current(monkeypatch):
    """A model split over GPUs in one process calls a layer on ``cuda:1`` while ``cuda:0`` is
    current: ``call`` makes its device current for the launches (Triton's, and a key's first
    call, go to the current device), then gives the caller's back; where its device is current
    it enters nothing. The cache is built off CUDA (Triton's driver needs a GPU), then given
    ``cuda:1``; the launches go directly (``launching_graphs`` stood in) and record the device
    current at them."""
    cache = GraphCache(torch.device("cpu"))
    cache.device = torch.device("cuda", 1)
    current, entered, launched = [0], [], []

    class Device:
        def __init__(self, device):
            self.index = torch.device(device).index

        def __enter__(self):
            entered.append(self.index)
            self.caller, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.caller

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(graph_launch, "launching_graphs", lambda device: False)
    for caller in (0, 1):
        current[0] = caller
        cache.call("key", lambda: launched.append(current[0]))
        assert current[0] == caller
    assert launched == [1, 1] and entered == [1]
