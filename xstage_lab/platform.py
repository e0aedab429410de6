"""The platform: which GPUs this process sees, which pairs are peers, and the provenance of a run.

The backend decides where numbers come from: ``cuda`` measures live on this machine's GPUs,
``replay`` reads the committed records in ``data/``; ``auto`` takes ``cuda`` where at least two
peer-capable GPUs exist, otherwise ``replay``.
"""
from __future__ import annotations

import itertools
import os
import platform as _py_platform
import re
import subprocess
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache
from importlib import metadata
from pathlib import Path

BACKENDS = ("auto", "cuda", "replay")
# NVLink multicast stays off: on shared machines a program that uses it can take the host's GPUs
# out of service. Every multi-process run sets these and refuses other values.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
_REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    sm_count: int
    l2_bytes: int
    max_smem_per_sm: int
    max_smem_per_block_optin: int
    compute_capability: str


@dataclass(frozen=True)
class Inventory:
    """The GPUs visible to this process and the peer-access matrix between them."""

    gpus: tuple[GPU, ...] = ()
    peer: tuple[tuple[bool, ...], ...] = ()
    driver_version: str | None = None
    runtime_version: str | None = None
    error: str | None = field(default=None, compare=False)

    def can_access_peer(self, src: int, dst: int) -> bool:
        return src != dst and self.peer[src][dst]

    @property
    def peer_capable_gpus(self) -> int:
        """Size of the largest group of GPUs of which every ordered pair is a peer pair."""
        n = len(self.gpus)
        for size in range(n, 1, -1):
            for group in itertools.combinations(range(n), size):
                if all(self.peer[i][j] and self.peer[j][i]
                       for i, j in itertools.combinations(group, 2)):
                    return size
        return min(n, 1)


@lru_cache(maxsize=1)
def inventory() -> Inventory:
    """Read the GPUs through CuPy; an empty inventory (with the reason) where there are none."""
    try:
        import cupy
        rt = cupy.cuda.runtime
        n = rt.getDeviceCount()
    except Exception as e:  # no CuPy, no driver or no device: the replay backend still works
        return Inventory(error=f"{type(e).__name__}: {e}")
    gpus = []
    for i in range(n):
        p = rt.getDeviceProperties(i)
        gpus.append(GPU(index=i, name=p["name"].decode() if isinstance(p["name"], bytes) else p["name"],
                        sm_count=p["multiProcessorCount"], l2_bytes=p["l2CacheSize"],
                        max_smem_per_sm=p["sharedMemPerMultiprocessor"],
                        max_smem_per_block_optin=p["sharedMemPerBlockOptin"],
                        compute_capability=f"{p['major']}.{p['minor']}"))
    peer = tuple(tuple(i != j and bool(rt.deviceCanAccessPeer(i, j)) for j in range(n))
                 for i in range(n))
    return Inventory(gpus=tuple(gpus), peer=peer,
                     driver_version=_cuda_version_str(rt.driverGetVersion()),
                     runtime_version=_cuda_version_str(rt.runtimeGetVersion()))


def _cuda_version_str(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


@dataclass(frozen=True)
class BackendChoice:
    name: str       # "cuda" or "replay"
    requested: str
    reason: str

    def banner(self) -> str:
        return f"backend: {self.name} (requested {self.requested}; {self.reason})"


def choose_backend(requested: str = "auto", inv: Inventory | None = None) -> BackendChoice:
    """Resolve ``auto`` to ``cuda`` where two or more peer-capable GPUs exist, else ``replay``."""
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    inv = inventory() if inv is None else inv
    n_peer = inv.peer_capable_gpus
    seen = f"{len(inv.gpus)} GPU(s), {n_peer} peer-capable" + (f"; {inv.error}" if inv.error else "")
    if requested == "replay":
        return BackendChoice("replay", requested, f"committed records; {seen}")
    if n_peer >= 2:
        return BackendChoice("cuda", requested, f"measuring live on {seen}")
    if requested == "cuda":
        raise RuntimeError(f"the cuda backend needs two peer-capable GPUs; this machine has {seen}")
    return BackendChoice("replay", requested, f"no two peer-capable GPUs ({seen}): committed records")


def platform_name(inv: Inventory | None = None) -> str:
    """A short platform key such as ``h200-x4``: GPU model and count."""
    inv = inventory() if inv is None else inv
    if not inv.gpus:
        raise RuntimeError(f"no GPU visible ({inv.error})")
    return platform_key(inv.gpus[0].name, len(inv.gpus))


def platform_key(gpu_name: str, gpu_count: int) -> str:
    model = re.sub(r"^nvidia\s+", "", gpu_name.strip(), flags=re.I)
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return f"{slug}-x{gpu_count}"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit() -> str:
    """``XSTAGE_GIT_COMMIT`` where set, else the checkout's commit (``+dirty`` when it has
    changes). The variable wins: the GPU machine's copy of the tree carries a stale ``.git`` whose
    HEAD is not the commit that was copied, so the sender names the commit it sent."""
    named = os.environ.get("XSTAGE_GIT_COMMIT")
    if named:
        return named
    head = _run(["git", "-C", str(_REPO), "rev-parse", "HEAD"])
    if head:
        dirty = _run(["git", "-C", str(_REPO), "status", "--porcelain", "--untracked-files=no"])
        return head.strip() + ("+dirty" if dirty else "")
    return "unknown"


def provenance(inv: Inventory | None = None) -> dict:
    """Everything a record needs to say where it came from."""
    inv = inventory() if inv is None else inv
    return {
        "date_utc": datetime.now(timezone.utc).isoformat(),
        "host": _py_platform.node(),
        "python": _py_platform.python_version(),
        "gpu_name": inv.gpus[0].name if inv.gpus else None,
        "gpu_count": len(inv.gpus),
        "gpus": [g.__dict__ for g in inv.gpus],
        "peer_access": [list(row) for row in inv.peer],
        "driver_cuda_version": inv.driver_version,
        "runtime_cuda_version": inv.runtime_version,
        "driver": (_run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
                   or "").strip().splitlines()[:1],
        "topology": _run(["nvidia-smi", "topo", "-m"]),
        "versions": {d: _version(d) for d in ("torch", "triton", "cupy-cuda13x", "cupy-cuda12x",
                                               "numpy", "pandas", "xstage_lab")},
        "git_commit": git_commit(),
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                               "NVSHMEM_DISABLE_NVLS", "CUDA_VISIBLE_DEVICES")},
    }
