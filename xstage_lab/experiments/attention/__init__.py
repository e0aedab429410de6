"""Ulysses attention fused with its post-attention All-to-All (paper §4.3, §5.3): the host side
of the kernels (``ulysses``), the torchrun benchmark (``bench``) and per-tile trace
(``trace_bench``), and their CPU analyses (``model``: eqs. 17–20; ``trace``: the design test)."""
