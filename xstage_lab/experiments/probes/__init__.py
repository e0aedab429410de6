"""Diagnostic probes: one-off questions about a measurement, each a runnable module whose record
has a README beside it (``data/records/<probe>/``) saying what ran and what it found. No notebook
replays them."""
