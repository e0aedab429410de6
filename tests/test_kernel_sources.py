"""kernel_sources: the header the CUDA sources share, and the options that find it and key
CuPy's cache of compiled modules."""
import re
import shutil
import sys
from types import SimpleNamespace

from xstage_lab import kernel_sources
from xstage_lab.kernel_sources import DEVICE_HEADER, KERNELS_DIR, cuda_module, cuda_options

CUDA_FILES = ("remote_store_burst.cu", "visibility_latency.cu", "host_store_load.cu")


def test_the_options_change_with_the_header_and_nothing_else(tmp_path, monkeypatch):
    kernels = tmp_path / "kernels"
    shutil.copytree(KERNELS_DIR, kernels)
    monkeypatch.setattr(kernel_sources, "KERNELS_DIR", kernels)
    before = cuda_options()
    assert f"-I{kernels}" in before
    header = kernels / DEVICE_HEADER
    header.write_text(header.read_text() + "// an edit\n")
    after = cuda_options()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert len(before) == len(after) and len(changed) == 1, changed
    assert all(re.fullmatch(r"-DXSTAGE_DEVICE_HEADER_SHA=[0-9a-f]{16}", o) for o in changed[0])


def test_every_cuda_source_includes_the_header_and_redefines_none_of_it():
    header = (KERNELS_DIR / DEVICE_HEADER).read_text()
    helpers = re.findall(r"__device__ __forceinline__ \w+ (\w+)\(", header)
    assert {"global_timer_ns", "load_relaxed_gpu", "add_relaxed_gpu", "burst_pattern"} <= {*helpers}
    for name in CUDA_FILES:
        source = kernel_sources.cuda_source(name)
        assert f'#include "{DEVICE_HEADER}"' in source, name
        assert "typedef" not in source, name
        for helper in helpers:
            assert not re.search(rf"__device__[^;{{]*\b{helper}\(", source), (name, helper)


def test_cuda_module_compiles_with_the_options(monkeypatch):
    built = []
    fake = SimpleNamespace(RawModule=lambda code, options: built.append((code, options)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    cuda_module("visibility_latency.cu")
    assert built == [(kernel_sources.cuda_source("visibility_latency.cu"), cuda_options())]
