"""Device code lives in ``<repo>/kernels`` (CUDA C++ and Triton sources), loaded by path: that
folder is not an importable package (``kernels`` is a name taken on PyPI)."""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"
DEVICE_HEADER = "xstage_device.cuh"  # the helpers every CUDA source includes


def kernel_path(filename: str) -> Path:
    path = KERNELS_DIR / filename
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {path} not found")
    return path


def cuda_source(filename: str) -> str:
    """The text of a CUDA C++ source in ``kernels/``, for ``cupy.RawModule``."""
    return kernel_path(filename).read_text()


def cuda_options() -> tuple[str, ...]:
    """The compiler options of every CUDA source in ``kernels/``, for NVRTC and nvcc alike."""
    header_sha = hashlib.sha256(kernel_path(DEVICE_HEADER).read_bytes()).hexdigest()[:16]
    # CuPy's cubin cache keys on source text + options, not includes: a header edit changes this
    return ("--std=c++17", f"-I{KERNELS_DIR}", f"-DXSTAGE_DEVICE_HEADER_SHA={header_sha}")


def cuda_module(filename: str):
    """``kernels/<filename>`` compiled by CuPy/NVRTC for the current device (the cuda backend
    only: imports CuPy)."""
    import cupy

    return cupy.RawModule(code=cuda_source(filename), options=cuda_options())


@lru_cache(maxsize=None)
def load_kernel_module(name: str) -> ModuleType:
    """Import the Triton source ``kernels/<name>.py`` under a private module name."""
    path = kernel_path(f"{name}.py")
    module_name = f"xstage_lab._kernels.{name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # Triton's JIT resolves globals through the module
    spec.loader.exec_module(module)
    return module
