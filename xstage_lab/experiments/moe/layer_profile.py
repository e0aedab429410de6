"""Where a fused layer call's device time goes, per kernel (``layer_bench``'s profile columns), as
torch.profiler's CUDA activity records it (``dist_timing.kernel_times_us``: device time per call,
the profiler's own cost apart from none of it, so read beside each other, not against the timed
calls):

- the routing alone (``cell.route``): per kernel (``route_kernels_us``, JSON), its table passes
  (``route_tables_us``) apart from its pass over the activations (``route_gather_us``: the FP8
  quantization of the tokens at EP = 1 in a launch of its own; where the first launch's programs
  quantize them, as up to ``device_tables.QUANT_IN_HISTOGRAM_ROWS`` rows, they are in that
  launch's time, none at 8192 tokens), and the SM clock read as it ends
  (``route_sm_clock_mhz``): right after a cell's heavy calls the GPU may still hold a clock its
  power cap lowered, which these latency-bound kernels follow (a run at 8192 tokens measured the
  kernels at 1380-1980 MHz, and Qwen3.5's table passes at 1.8x the time a routing probe gave
  them at 1980 MHz: moe_layer/h200-x1/20261204T195720Z-25330f5474 against route_small_probe/
  h200-x1/20261204T195341Z-f567ecc776);
- one whole call as a user makes it (``cell.call``: eagerly, its graph launched), per kernel
  (``call_kernels_us``, JSON), and the fused kernel's own time in it (``kernel_in_call_us``);
- the fused kernel launched alone over the same tables (``cell.kernel``, as ``kernel_us`` is
  timed: its row counters' fill, then the kernel): its own time (``kernel_alone_device_us``),
  the fill's (``alone_fill_us``) and the device's time from the fill into the kernel
  (``alone_fill_boundary_us``), which ``layer_view`` takes out of the kernel's timed graph;
- the device's time between consecutive kernels, per pair of their names (``dist_timing.
  kernel_boundaries_us``, JSON), in graphs of ``graph_iters`` calls replayed as ``layer_bench``
  times them: the call's (``call_boundaries_us``) and the kernel alone's, after its counters'
  fill (``alone_boundaries_us``).

The graphed call's time beyond the sum of its kernels' (``layer_view.call_gaps_us``) is then the
device's time between them, which the boundaries split by pair; the fused kernel's time in the
call against alone says whether the kernels before it slow it down."""
from __future__ import annotations

import json

from ...dist_timing import graphed, kernel_boundaries_us, kernel_times_us, read_sm_clock_mhz
from ...ops.moe.fused import KERNEL_ENTRIES

ACTIVATIONS_PASS = "route_quantize"  # the routing kernel that is no table pass


def device_profile(cell, graph_iters: int) -> dict:
    """The profile columns of one ``layer_bench`` cell (module docstring), its graphs of
    ``graph_iters`` calls."""
    route = kernel_times_us(cell.route)
    route_clock = read_sm_clock_mhz()
    gather = sum(v for k, v in route.items() if ACTIVATIONS_PASS in k)
    call = kernel_times_us(cell.call)
    alone = kernel_times_us(cell.kernel)
    fused = KERNEL_ENTRIES[cell.ws.config.kernel][1]
    alone_boundaries = kernel_boundaries_us(graphed(cell.kernel, graph_iters))
    return {"route_tables_us": sum(route.values()) - gather, "route_gather_us": gather,
            "route_kernels_us": json.dumps(route),
            "route_sm_clock_mhz": float("nan") if route_clock is None else route_clock,
            "call_kernels_us": json.dumps(call),
            "kernel_in_call_us": call.get(fused, float("nan")),
            "kernel_alone_device_us": alone.get(fused, float("nan")),
            "alone_fill_us": sum(v for k, v in alone.items() if k != fused),
            "alone_fill_boundary_us": boundary_into_us(alone_boundaries, fused),
            "call_boundaries_us": json.dumps(kernel_boundaries_us(graphed(cell.call,
                                                                          graph_iters))),
            "alone_boundaries_us": json.dumps(alone_boundaries)}


def boundary_into_us(boundaries: dict[str, float], kernel: str) -> float:
    """The device's time per call into ``kernel`` from the kernels before it: the pairs ``A ->
    kernel`` of ``dist_timing.kernel_boundaries_us``, ``A`` another kernel."""
    return sum(us for pair, us in boundaries.items()
               if pair.endswith(f" -> {kernel}") and not pair.startswith(f"{kernel} -> "))
