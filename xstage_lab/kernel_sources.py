"""Device code lives in ``<repo>/kernels`` (CUDA C++ and Triton sources), loaded by path: that
folder is not an importable package (``kernels`` is a name taken on PyPI)."""
from __future__ import annotations

import importlib.util
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"


def kernel_path(filename: str) -> Path:
    path = KERNELS_DIR / filename
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {path} not found")
    return path


def cuda_source(filename: str) -> str:
    """The text of a CUDA C++ source in ``kernels/``, for ``cupy.RawModule``."""
    return kernel_path(filename).read_text()


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
