"""Live runs on this machine's GPUs, each writing a record: in process (CuPy) or one process per
GPU under torchrun, whose JSON output becomes a record. ``measure-all`` runs them all; ``load``'s
``cuda`` backend runs one (``live_record``)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from .platform import SAFE_ENV
from .records import RECORDS_DIR, import_bench_json

MOE_MATRIX = Path(__file__).resolve().parent.parent / "data" / "moe_matrix.json"


# The multi-process experiments: record name -> the module torchrun runs.
BENCHMARKS = {"fa_a2a": "xstage_lab.experiments.attention.bench",
              "moe": "xstage_lab.experiments.moe.bench",
              "moe_trace": "xstage_lab.experiments.moe.trace_bench",
              "fa_trace": "xstage_lab.experiments.attention.trace_bench",
              "moe_kernel": "xstage_lab.experiments.moe.kernel_bench"}
# Benchmarks of one GPU (one rank of the paper's setting on its own): one process, not one per GPU.
ONE_GPU = frozenset({"moe_kernel"})


def processes(experiment: str, peer_capable_gpus: int) -> int:
    """How many processes torchrun starts for ``experiment``."""
    return 1 if experiment in ONE_GPU else peer_capable_gpus


def torchrun_record(module: str, experiment: str, nproc: int, args: list[str] = (),
                    root: Path = RECORDS_DIR) -> Path:
    """Run ``python -m torch.distributed.run --nproc_per_node=nproc -m module --out FILE args``
    and save its output as a record of ``experiment``; raises with the output on failure."""
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, **SAFE_ENV,
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", "-m", module, "--out", str(out), *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}"
                               f"\n{proc.stderr[-4000:]}")
        return import_bench_json(out, experiment, root)


def _remote_store(root: Path) -> list[Path]:
    """The remote-store characterization (Fig. 3 sweeps) and the calibration fitted from it."""
    from .experiments.remote_store.characterization import run_characterization, write_calibration

    characterization = run_characterization(root=root)
    return [characterization, write_calibration(characterization, root=root)]


def _visibility(root: Path) -> list[Path]:
    """Receiver-side remote-visible completion latency (issue 8 part 2)."""
    from .experiments.remote_store.visibility import run_visibility

    return [run_visibility(root=root)]


def _remote_patterns(root: Path) -> list[Path]:
    """Multi-peer injection patterns on every GPU (issue 6, part 1)."""
    from .experiments.remote_store.patterns import run_patterns

    return [run_patterns(root=root)]


def _remote_ops(root: Path) -> list[Path]:
    """Remote operations beyond 16-byte stores (issue 6, part 2)."""
    from .experiments.remote_store.ops import run_operations

    return [run_operations(root=root)]


# The in-process (CuPy) measurements: name -> function(root) returning the records it wrote.
IN_PROCESS = {"remote_store": _remote_store, "visibility": _visibility,
              "remote_patterns": _remote_patterns, "remote_ops": _remote_ops}


def live_record(experiment: str) -> Callable[[Path], Path] | None:
    """How ``loading.load`` measures ``experiment`` live: a function(root) that runs it on this
    machine's GPUs and returns its new record (the remote-store characterization's, its
    calibration written beside it); None where its records come from other records."""
    if experiment in IN_PROCESS:
        return lambda root: IN_PROCESS[experiment](root)[0]
    if experiment in BENCHMARKS:
        from .platform import inventory

        return lambda root: torchrun_record(
            BENCHMARKS[experiment], experiment,
            processes(experiment, inventory().peer_capable_gpus), [], root)
    return None


def measurement_names() -> list[str]:
    """Every measurement ``measure_all`` runs, in its order."""
    return [*IN_PROCESS, *BENCHMARKS]


def _benchmark_args(name: str, written: dict[str, Path], root: Path) -> list[str]:
    """What ``measure_all`` passes a benchmark: the declared MoE matrix, the attention trace's
    repeated launches, and to the MoE trace benchmark the MoE record whose regressing cells it
    explains (the one this run wrote, else the latest of this platform under ``root``)."""
    from .platform import platform_name
    from .records import list_records

    if name == "moe":
        return ["--matrix", str(MOE_MATRIX)]
    if name == "fa_trace":
        return ["--repeat-build"]  # the state the Table 3 replays run in (notebook 04)
    if name == "moe_trace":
        moe = written.get("moe") or next(reversed(list_records("moe", platform_name(), root)), None)
        return ["--regressions", str(moe)] if moe else []
    return []


def measure_all(root: Path = RECORDS_DIR, only: list[str] | None = None) -> list[Path]:
    """Every experiment (or those named in ``only``) live on this machine's GPUs, in one go: the
    in-process measurements, then each multi-process benchmark on all peer-capable GPUs. Returns
    the records written."""
    from .platform import choose_backend, inventory

    names = measurement_names() if only is None else list(only)
    unknown = sorted(set(names) - set(measurement_names()))
    if unknown:
        raise ValueError(f"unknown measurements {unknown}; known: {measurement_names()}")
    choose_backend("cuda")  # raises without two peer-capable GPUs
    n = inventory().peer_capable_gpus
    paths, written = [], {}
    for name in names:
        if name in IN_PROCESS:
            paths.extend(IN_PROCESS[name](root))
        else:
            written[name] = torchrun_record(BENCHMARKS[name], name, processes(name, n),
                                            _benchmark_args(name, written, root), root)
            paths.append(written[name])
            if name == "moe_kernel":  # its forecast, on this platform's calibration if any
                from .experiments.moe.forecast import write_forecast
                from .platform import platform_name
                from .records import platforms

                if platform_name() in platforms("calibration", root):
                    paths.append(write_forecast(platform_name(), platform_name(), root))
    return paths
