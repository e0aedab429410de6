"""Device code lives in ``<repo>/kernels`` (CUDA C++, Triton and Gluon sources) and imports nothing
of this package: CUDA sources are compiled from their text, Python sources imported from that
folder as the private package ``KERNELS_PACKAGE`` (``kernels`` is a name taken on PyPI)."""
from __future__ import annotations

import hashlib
import importlib
import sys
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


# The package the Triton and Gluon sources of ``kernels/`` are imported into. A source imports
# its siblings relatively (``from .flash_attention import ...``), so that device code never
# imports this host package.
KERNELS_PACKAGE = "xstage_lab._kernels"


def kernels_package() -> ModuleType:
    """The package ``KERNELS_PACKAGE``, whose one folder is ``kernels/``, made on first use."""
    package = sys.modules.get(KERNELS_PACKAGE)
    if package is None:
        package = ModuleType(KERNELS_PACKAGE)
        package.__path__ = [str(KERNELS_DIR)]
        sys.modules[KERNELS_PACKAGE] = package
    return package


def load_kernel_module(name: str) -> ModuleType:
    """Import the Triton or Gluon source ``kernels/<name>.py`` as ``KERNELS_PACKAGE.<name>``
    (once per process: Triton's JIT resolves globals through that module)."""
    kernel_path(f"{name}.py")
    kernels_package()
    return importlib.import_module(f"{KERNELS_PACKAGE}.{name}")
