"""The experiments, one subpackage per family: ``remote_store`` (§3), ``attention`` (§4.3),
``moe`` (§4.2) and ``probes`` (diagnostics that no notebook replays)."""
