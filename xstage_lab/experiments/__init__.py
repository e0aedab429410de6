"""The experiments, one subpackage per family: ``remote_store`` (§3), ``attention`` (§4.3),
``moe`` (§4.2) and ``probes`` (diagnostics that no notebook replays). Each family holds its
device-side benches and the analysis of their records that runs on the CPU; ``output`` is the one
output shape every benchmark writes."""
