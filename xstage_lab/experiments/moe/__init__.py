"""The fused MoE layer (paper §4.2, §5.2): the host side of the kernels (``layer``) and their tile
schedules (``schedules``: Algorithm 1), the torchrun benchmark (``bench``) and mechanism traces
(``trace_bench``), the one-GPU kernel benchmark (``kernel_bench``), and their CPU analyses
(``trace``: Table 2, Figs. 9–10; ``forecast``: the EP forecast)."""
