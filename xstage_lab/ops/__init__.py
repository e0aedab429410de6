"""The host side of the kernels in ``kernels/``: per kernel, the functions that check its contract
and launch it, with its reference beside them. Nothing here imports an experiment."""
