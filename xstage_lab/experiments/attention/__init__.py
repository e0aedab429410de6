"""Ulysses attention fused with its post-attention All-to-All (paper §4.3, §5.3): the torchrun
benchmark (``bench``; its shapes and checks in ``cases``, Table 3's timing in ``table3``) and the
per-tile trace (``trace_bench``). The kernels' host side is ``ops.attention``; the CPU analyses are
``analysis.attention``."""
