"""The host side of the remote-store kernels (paper §3): the Burst–Gap microbenchmark (``burst``)."""
