"""The experiments, one subpackage per family: ``remote_store`` (§3), ``attention`` (§4.3),
``moe`` (§4.2) and ``probes`` (diagnostics that no notebook replays). Each holds the benchmarks
that measure (``harness.Experiment``s, run by ``harness``) over the kernels' host side in ``ops``;
what is read of their records is ``analysis``.

The registry: ``EXPERIMENTS`` names each experiment by the record it writes and where it is
(``"module:attribute"``), in ``measure-all``'s order. It is the one place an experiment is
registered; everything else is read from the ``Experiment`` itself (``in_measure_all``,
``measure_all_args``, ``optional``, ``links``, ``analyse``, ``resolution``, its options) and
derived here: ``measure_all_names``, ``is_optional``, ``links``, ``resolution``. ``experiment``
imports one (its module may pull in torch or CuPy, so nothing here is imported before it is asked
for)."""
from __future__ import annotations

import importlib

EXPERIMENTS = {  # record experiment -> "module:attribute"; measure-all runs them in this order
    "remote_store": "xstage_lab.experiments.remote_store.characterization:EXPERIMENT",
    "visibility": "xstage_lab.experiments.remote_store.visibility:EXPERIMENT",
    "remote_patterns": "xstage_lab.experiments.remote_store.patterns:EXPERIMENT",
    "remote_ops": "xstage_lab.experiments.remote_store.ops:EXPERIMENT",
    "fa_a2a": "xstage_lab.experiments.attention.bench:EXPERIMENT",
    "moe": "xstage_lab.experiments.moe.bench:EXPERIMENT",
    "moe_trace": "xstage_lab.experiments.moe.trace_bench:EXPERIMENT",
    "fa_trace": "xstage_lab.experiments.attention.trace_bench:EXPERIMENT",
    "moe_kernel": "xstage_lab.experiments.moe.kernel_bench:EXPERIMENT",
    "fa_tuning": "xstage_lab.experiments.attention.bench:FA_TUNING",
    "moe_host": "xstage_lab.experiments.moe.host_bench:EXPERIMENT",
    "moe_layer": "xstage_lab.experiments.moe.layer_bench:EXPERIMENT",
    "link_probe": "xstage_lab.experiments.probes.link:EXPERIMENT",
    "issue_time_probe": "xstage_lab.experiments.probes.issue_time:EXPERIMENT",
    "fa_kernel_probe": "xstage_lab.experiments.probes.fa_kernel:EXPERIMENT",
    "moe_schedule_probe": "xstage_lab.experiments.probes.moe_schedule:EXPERIMENT",
    "route_small_probe": "xstage_lab.experiments.probes.route_small:EXPERIMENT",
    "moe_gather_probe": "xstage_lab.experiments.probes.moe_gather:EXPERIMENT",
    "moe_call_probe": "xstage_lab.experiments.probes.moe_call:EXPERIMENT",
    "moe_ring_probe": "xstage_lab.experiments.probes.moe_ring:EXPERIMENT",
}


def module_name(name: str) -> str:
    """The module that runs experiment ``name`` (``python -m`` it)."""
    return _entry(name)[0]


def _entry(name: str) -> tuple[str, str]:
    if name not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {name!r}; known: {sorted(EXPERIMENTS)}")
    module, attribute = EXPERIMENTS[name].split(":")
    return module, attribute


def experiment(name: str):
    """The ``harness.Experiment`` that writes ``name`` records."""
    module, attribute = _entry(name)
    return getattr(importlib.import_module(module), attribute)


def measure_all_names() -> list[str]:
    """What ``measure-all`` runs, in its order: every experiment that says ``in_measure_all``
    (importing each)."""
    return [name for name in EXPERIMENTS if experiment(name).in_measure_all]


def is_optional(name: str) -> bool:
    """Whether a notebook shows ``name`` only where it has records (``Experiment.optional``);
    records that no experiment writes (a calibration, a forecast) are not optional."""
    return name in EXPERIMENTS and experiment(name).optional


def links(name: str) -> tuple[str, ...]:
    """What experiment ``name`` needs of the machine: the links it measures over
    (``Experiment.links``; ``platform.link_problem`` says what each asks). Records that no
    experiment writes (a calibration, a forecast) have none: they are computed, never measured."""
    return experiment(name).links if name in EXPERIMENTS else ()


def resolution(name: str) -> dict[str, float]:
    """The ``resolution`` that experiment ``name``'s records are written with ({} where none; a
    partial run's records as its experiment's)."""
    base = name.removesuffix("_partial")
    return experiment(base).resolution if base in EXPERIMENTS else {}
