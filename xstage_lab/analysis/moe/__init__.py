"""What is read of the MoE records (§4.2): the traces (``trace``: Table 2, Figs. 9–10), the one-GPU
kernel records (``kernel_view``) and layer records (``layer_view``), and the EP forecast
(``forecast``).

The record vocabulary the kernels write, without importing them: a tile table entry's ``kind``
(``L1``: Linear-1, ``L2``: Linear-2) and the precisions (``ops.moe`` holds the same values; a test
keeps them equal)."""
L1, L2 = 0, 1
PRECISIONS = ("bf16", "fp8")
