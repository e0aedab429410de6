"""The experiments, one subpackage per family: ``remote_store`` (§3), ``attention`` (§4.3),
``moe`` (§4.2) and ``probes`` (diagnostics that no notebook replays). Each family holds its
device-side experiments (``harness.Experiment``s, run by ``harness``) and the analysis of their
records that runs on the CPU.

``EXPERIMENTS`` names each experiment by the record it writes, and where it is; ``experiment``
imports one (its module pulls in torch or CuPy, so nothing here is imported before it is asked
for). ``MEASURE_ALL``: what ``measure-all`` runs, in its order."""
from __future__ import annotations

import importlib

_PACKAGE = __name__
EXPERIMENTS = {  # record experiment -> "module:attribute" under this package
    "remote_store": "remote_store.characterization:EXPERIMENT",
    "visibility": "remote_store.visibility:EXPERIMENT",
    "remote_patterns": "remote_store.patterns:EXPERIMENT",
    "remote_ops": "remote_store.ops:EXPERIMENT",
    "fa_a2a": "attention.bench:EXPERIMENT",
    "fa_tuning": "attention.bench:FA_TUNING",
    "fa_trace": "attention.trace_bench:EXPERIMENT",
    "moe": "moe.bench:EXPERIMENT",
    "moe_trace": "moe.trace_bench:EXPERIMENT",
    "moe_kernel": "moe.kernel_bench:EXPERIMENT",
    "moe_host": "moe.host_bench:EXPERIMENT",
    "moe_layer": "moe.layer_bench:EXPERIMENT",
    "link_probe": "probes.link:EXPERIMENT",
    "issue_time_probe": "probes.issue_time:EXPERIMENT",
    "fa_kernel_probe": "probes.fa_kernel:EXPERIMENT",
}
MEASURE_ALL = ("remote_store", "visibility", "remote_patterns", "remote_ops", "fa_a2a", "moe",
               "moe_trace", "fa_trace", "moe_kernel")


def module_name(name: str) -> str:
    """The module that runs experiment ``name`` (``python -m`` it)."""
    return f"{_PACKAGE}.{EXPERIMENTS[name].split(':')[0]}"


def experiment(name: str):
    """The ``harness.Experiment`` that writes ``name`` records."""
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; known: {sorted(EXPERIMENTS)}")
    attribute = EXPERIMENTS[name].split(":")[1]
    return getattr(importlib.import_module(module_name(name)), attribute)
