"""The fused MoE layer's experiments (paper §4.2, §5.2), over the host side of its kernels in
``ops.moe``: the torchrun benchmark (``bench``) and mechanism traces (``trace_bench``), the one-GPU
kernel benchmark (``kernel_bench``) and layer benchmark (``layer_bench``: the op from the router's
output to the layer's output), and their CPU analyses (``trace``: Table 2, Figs. 9–10;
``forecast``: the EP forecast)."""
