"""The platform: which GPUs this process sees, which pairs are peers, the peer memory that remote
stores write through, and the provenance of a run.

Links: a remote store leaves the SM for a peer GPU over NVLink (``nvlink``), or for pinned host
memory mapped into the device's address space over PCIe (``host``), a path every GPU has. A
platform's records of the host link are kept under its own name (``h200-x1-host``).

The backend decides where an experiment's numbers come from, per experiment and link
(``choose_backend``): ``cuda`` measures live on this machine's GPUs where they can run it,
``replay`` reads the committed records in ``data/``; ``auto`` takes ``cuda`` for every experiment
where two peer-capable GPUs exist, and for the host link's wherever a GPU maps pinned host memory,
otherwise ``replay``.

Peer memory (``symmetric_buffer``): one flat tensor of torch symmetric memory per rank, and the
table of its address on every rank that the REMOTE epilogues and Combine stores use.
"""
from __future__ import annotations

import ctypes
import itertools
import os
import platform as _py_platform
import re
import socket
import subprocess
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

BACKENDS = ("auto", "cuda", "replay")
LINKS = ("nvlink", "host")
# An experiment with no link: one GPU storing into its own memory (its records are the GPU's
# platform, ``h200-x1``).
LOCAL = "local"
# NVLink multicast stays off: on shared machines a program that uses it can take the host's GPUs
# out of service. Every multi-process run sets these and refuses other values.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
# Remote stores are 16 bytes wide (vector and TMA stores): every peer address must allow them.
ALIGN_BYTES = 16
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
    # Stores into pinned host memory (unified addressing and mapped host memory): the host link.
    maps_host_memory: bool = True


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
                        compute_capability=f"{p['major']}.{p['minor']}",
                        maps_host_memory=bool(p["unifiedAddressing"] and p["canMapHostMemory"])))
    peer = tuple(tuple(i != j and bool(rt.deviceCanAccessPeer(i, j)) for j in range(n))
                 for i in range(n))
    return Inventory(gpus=tuple(gpus), peer=peer,
                     driver_version=_cuda_version_str(rt.driverGetVersion()),
                     runtime_version=_cuda_version_str(rt.runtimeGetVersion()))


def _cuda_version_str(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


class PeerError(RuntimeError):
    """The ranks cannot share peer memory; raised before anything stores through it."""


@dataclass(frozen=True, eq=False)
class SymmetricBuffer:
    """One flat tensor of torch symmetric memory per rank and its address on every rank."""

    tensor: torch.Tensor      # this rank's, flat
    handle: object            # torch's rendezvous handle (barrier)
    ptrs: tuple[int, ...]     # the tensor's address on rank r, mapped into this process
    table: torch.Tensor       # ``ptrs`` as int64 [P] on this rank's GPU, for kernels
    rank: int
    world: int

    def barrier(self) -> None:
        """Consumer-side completion: a device barrier over the signal pads (release/acquire at
        system scope) on the current stream, after which every rank's stores issued earlier on
        its stream are visible to every rank's later work."""
        self.handle.barrier(channel=0)


def check_peer_places(places: Sequence[tuple[str, int]], rank: int,
                      can_access_peer: Callable[[int, int], bool]) -> None:
    """``places[r]`` is rank r's (host, GPU index). Remote stores need every rank on one host and
    peer access from this rank's GPU to every other rank's."""
    host, gpu = places[rank]
    for peer, (peer_host, peer_gpu) in enumerate(places):
        if peer_host != host:
            raise PeerError(f"rank {peer} is on host {peer_host}, rank {rank} on {host}: "
                            "remote stores need every rank on one host")
        if peer != rank and not can_access_peer(gpu, peer_gpu):
            raise PeerError(f"GPU {gpu} (rank {rank}) has no peer access to GPU {peer_gpu} "
                            f"(rank {peer}): remote stores need peer access between all GPUs")


def peer_base_pointers(data_ptr: int, buffer_ptrs: Sequence[int], rank: int,
                       offsets: Sequence[int]) -> tuple[int, ...]:
    """The address of one symmetric tensor on every rank, in rank order.

    ``buffer_ptrs`` (the rendezvous handle's, one per rank) are the bases of the ranks'
    allocations; the tensor, at ``data_ptr`` on this rank, may start at an offset into its
    allocation (pooled symmetric allocations), so rank r's address is ``buffer_ptrs[r] + offset``.
    That holds only where the offset is the same on every rank: ``offsets`` is every rank's
    ``data_ptr - buffer_ptrs[rank]``, gathered in rank order.
    """
    world = len(offsets)
    if len(buffer_ptrs) != world:
        raise PeerError(f"rendezvous returned {len(buffer_ptrs)} peer pointers for {world} ranks")
    if not 0 <= rank < world:
        raise PeerError(f"rank {rank} is not in [0, P={world})")
    offset = data_ptr - buffer_ptrs[rank]
    if offset < 0:
        raise PeerError(f"the tensor at {data_ptr:#x} lies before its allocation at "
                        f"{buffer_ptrs[rank]:#x} (rank {rank})")
    if any(o != offset for o in offsets):
        raise PeerError(f"symmetric buffer offsets differ across ranks: {list(offsets)}")
    ptrs = tuple(p + offset for p in buffer_ptrs)
    if any(p == 0 or p % ALIGN_BYTES for p in ptrs):
        raise PeerError(f"peer pointers must be non-null and {ALIGN_BYTES}-byte aligned: "
                        f"{[hex(p) for p in ptrs]}")
    return ptrs


def symmetric_buffer(numel: int, dtype: torch.dtype,
                     group: dist.ProcessGroup | None = None) -> SymmetricBuffer:
    """Allocate ``numel`` elements of ``dtype`` of torch symmetric memory on every rank, on the
    current GPU, and exchange the addresses. Collective over ``group`` (default: WORLD).

    Checks first, with a ``PeerError``, that NVLink multicast is off (``SAFE_ENV``), that all ranks
    are on one host with peer access between all their GPUs, then that the tensor sits at the same
    offset into every rank's allocation.
    """
    wrong = {k: os.environ.get(k) for k, v in SAFE_ENV.items() if os.environ.get(k) != v}
    if wrong:
        raise PeerError(f"NVLink multicast stays off: symmetric memory needs {SAFE_ENV}, got {wrong}")
    if numel < 1:
        raise ValueError(f"a symmetric buffer needs at least one element, got {numel}")
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD if group is None else group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device())
    places = [None] * world
    dist.all_gather_object(places, (socket.gethostname(), device.index), group=group)
    check_peer_places(places, rank, torch.cuda.can_device_access_peer)
    tensor = symm_mem.empty(numel, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(tensor, group)
    offsets = [None] * world
    dist.all_gather_object(offsets, tensor.data_ptr() - handle.buffer_ptrs[rank], group=group)
    ptrs = peer_base_pointers(tensor.data_ptr(), handle.buffer_ptrs, rank, offsets)
    return SymmetricBuffer(tensor, handle, ptrs, torch.tensor(ptrs, dtype=torch.int64, device=device),
                           rank, world)


class LinkError(ValueError):
    """The link a run asks for does not exist on this machine; raised before any launch."""


# cudaHostAlloc flags (driver_types.h): the allocation is pinned for every device (portable) and
# mapped into their address spaces.
_HOST_ALLOC_PORTABLE = 1
_HOST_ALLOC_MAPPED = 2


def gpu_numa_node(device: int) -> dict:
    """The host NUMA node GPU ``device`` hangs off, from sysfs (``numa_node`` of its PCI
    function), and that node's CPUs; ``node`` is None where the machine does not say (one node,
    or a VM that hides it)."""
    import cupy

    bus_id = cupy.cuda.Device(device).pci_bus_id.lower()
    try:
        node = int(Path(f"/sys/bus/pci/devices/{bus_id}/numa_node").read_text())
    except (OSError, ValueError):
        node = -1
    if node < 0:
        return {"pci_bus_id": bus_id, "node": None, "cpus": None}
    cpulist = Path(f"/sys/devices/system/node/node{node}/cpulist").read_text().strip()
    return {"pci_bus_id": bus_id, "node": node, "cpus": cpulist}


def _cpu_set(cpulist: str) -> set[int]:
    """``0-3,8,10-11`` as a set of CPU numbers."""
    cpus = set()
    for part in cpulist.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


@dataclass(frozen=True, eq=False)
class MappedHostBuffer:
    """Pinned host memory mapped into GPU ``device``'s address space: the destination of the host
    link's remote stores. Under unified addressing its host pointer is also its device pointer
    (checked at allocation); the CPU reads it through ``words``. Freed with the object."""

    ptr: int
    nbytes: int
    device: int
    numa: dict

    def words(self) -> np.ndarray:
        """The buffer as uint32 words, a view the CPU reads and writes in place."""
        raw = (ctypes.c_uint32 * (self.nbytes // 4)).from_address(self.ptr)
        return np.frombuffer(raw, dtype=np.uint32)


def check_mapped_host(ptr: int) -> None:
    """``LinkError`` unless the host address ``ptr`` (pinned memory) is also its device address:
    the host link's remote stores go to the host address as it is."""
    import cupy

    device_ptr = cupy.cuda.runtime.pointerGetAttributes(ptr).devicePointer
    if device_ptr != ptr:
        raise LinkError(f"pinned host memory at {ptr:#x} has device address {device_ptr:#x}: "
                        "the host link's stores need unified addressing")


def mapped_host_buffer(nbytes: int, device: int) -> MappedHostBuffer:
    """``nbytes`` of pinned, mapped host memory for GPU ``device`` (cudaHostAlloc, portable and
    mapped), its pages placed on the GPU's own NUMA node where the machine names one: the
    allocating thread runs on that node's CPUs while the pages are pinned (first touch).

    ``LinkError`` where the GPU cannot store into host memory directly (no unified addressing or
    no mapped host memory) or the mapped pointer differs from the host pointer."""
    import cupy

    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(device)
    if not (props["unifiedAddressing"] and props["canMapHostMemory"]):
        raise LinkError(f"GPU {device} cannot store into host memory directly (unified addressing "
                        f"{props['unifiedAddressing']}, mapped host memory {props['canMapHostMemory']})")
    numa = gpu_numa_node(device)
    before = os.sched_getaffinity(0)
    bound = numa["cpus"] is not None and bool(_cpu_set(numa["cpus"]) & before)
    if bound:
        os.sched_setaffinity(0, _cpu_set(numa["cpus"]) & before)
    try:
        with cupy.cuda.Device(device):
            ptr = rt.hostAlloc(nbytes, _HOST_ALLOC_PORTABLE | _HOST_ALLOC_MAPPED)
    finally:
        if bound:
            os.sched_setaffinity(0, before)
    try:
        check_mapped_host(ptr)
    except LinkError:
        rt.freeHost(ptr)
        raise
    buf = MappedHostBuffer(ptr, nbytes, device, {**numa, "pages_bound_to_node": bound})
    weakref.finalize(buf, rt.freeHost, ptr)
    return buf


@dataclass(frozen=True)
class BackendChoice:
    name: str       # "cuda" or "replay"
    requested: str
    reason: str

    def banner(self) -> str:
        return f"backend: {self.name} (requested {self.requested}; {self.reason})"


def _seen(inv: Inventory) -> str:
    return (f"{len(inv.gpus)} GPU(s), {inv.peer_capable_gpus} peer-capable"
            + (f"; {inv.error}" if inv.error else ""))


def link_problem(link: str, inv: Inventory | None = None) -> str | None:
    """Why this machine cannot run an experiment over ``link`` (None: it can): ``nvlink`` needs
    two peer-capable GPUs, ``host`` a GPU that maps pinned host memory (``mapped_host_buffer``
    then checks each buffer's address, ``check_mapped_host``), ``local`` a GPU."""
    if link not in (*LINKS, LOCAL):
        raise ValueError(f"link must be one of {(*LINKS, LOCAL)}, got {link!r}")
    inv = inventory() if inv is None else inv
    if link == "nvlink" and inv.peer_capable_gpus < 2:
        return f"the nvlink link needs two peer-capable GPUs; this machine has {_seen(inv)}"
    if link == "host" and not any(g.maps_host_memory for g in inv.gpus):
        return (f"the host link needs a GPU that maps pinned host memory; this machine has "
                f"{_seen(inv)}")
    if link == LOCAL and not inv.gpus:
        return f"a one-GPU experiment needs a GPU; this machine has {_seen(inv)}"
    return None


def choose_backend(requested: str = "auto", inv: Inventory | None = None,
                   link: str = "nvlink") -> BackendChoice:
    """The backend of an experiment over ``link`` (``LINKS``, or ``LOCAL``).

    ``auto``: ``cuda`` where this machine can run it and has two peer-capable GPUs (an NVLink node
    measures every experiment), or where the link is the host's and a GPU maps host memory (the
    one remote path a lone GPU has); else ``replay``, the one-GPU local experiments included.
    ``cuda``: ``cuda`` wherever this machine can run it; else ``replay``, the reason saying what
    it lacks; a ``RuntimeError`` where it has no GPU at all."""
    if requested not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {requested!r}")
    inv = inventory() if inv is None else inv
    problem = link_problem(link, inv)
    if requested == "replay":
        return BackendChoice("replay", requested, f"committed records; {_seen(inv)}")
    if not inv.gpus:
        if requested == "cuda":
            raise RuntimeError(f"the cuda backend needs a GPU; this machine has {_seen(inv)}")
        return BackendChoice("replay", requested, f"no GPU ({_seen(inv)}): committed records")
    if problem is not None:
        return BackendChoice("replay", requested, f"{problem}: committed records")
    if requested == "cuda" or link == "host" or inv.peer_capable_gpus >= 2:
        where = "on one GPU, no link" if link == LOCAL else f"over {link}"
        return BackendChoice("cuda", requested, f"measuring live {where}: {_seen(inv)}")
    return BackendChoice("replay", requested,
                         f"no two peer-capable GPUs ({_seen(inv)}): auto measures the one-GPU "
                         f"experiments on an NVLink node only (cuda measures them here): "
                         f"committed records")


def platform_link(platform: str) -> str:
    """The link whose records ``platform`` holds: ``host`` for ``<gpu>-host``, else ``nvlink``."""
    return "host" if platform.endswith("-host") else "nvlink"


def platform_name(inv: Inventory | None = None, link: str = "nvlink") -> str:
    """A short platform key such as ``h200-x4``: GPU model and count (and the link, where it is
    the host's: ``h200-x1-host``)."""
    inv = inventory() if inv is None else inv
    if not inv.gpus:
        raise RuntimeError(f"no GPU visible ({inv.error})")
    return platform_key(inv.gpus[0].name, len(inv.gpus), link)


def platform_key(gpu_name: str, gpu_count: int, link: str = "nvlink") -> str:
    """``h200-x2``; the host link's records are a platform of their own, ``h200-x1-host``; a
    local experiment's are the GPUs' (``h200-x1``)."""
    if link not in (*LINKS, LOCAL):
        raise ValueError(f"link must be one of {(*LINKS, LOCAL)}, got {link!r}")
    model = re.sub(r"^nvidia\s+", "", gpu_name.strip(), flags=re.I)
    slug = re.sub(r"[^a-z0-9]+", "-", model.lower()).strip("-")
    return f"{slug}-x{gpu_count}" + ("-host" if link == "host" else "")


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


# a commit's hash, abbreviated or whole, and ``+dirty`` where the tree sent had uncommitted changes
COMMIT_NAME = re.compile(r"[0-9a-f]{7,40}(\+dirty)?")


def git_commit() -> str:
    """``XSTAGE_GIT_COMMIT`` where set, else the checkout's commit (``+dirty`` when it has
    changes). The variable wins: the GPU machine's copy of the tree carries a stale ``.git`` whose
    HEAD is not the commit that was copied, so the sender names the commit it sent. A value that
    is not a commit's hash (``COMMIT_NAME``) is a ValueError, which ``experiments.harness`` raises
    before a run launches anything (a record once named ``7444daf-UNKNOWN``: errata.json)."""
    named = os.environ.get("XSTAGE_GIT_COMMIT")
    if named:
        if not COMMIT_NAME.fullmatch(named):
            raise ValueError(f"XSTAGE_GIT_COMMIT={named!r} is not a commit's hash (7-40 lowercase "
                             "hex digits, '+dirty' after it where the tree sent had changes)")
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
