"""The fused MoE call that routes itself (issue 27): up to ``ROUTED_ARRIVALS`` arrivals, every
routed expert one row block, the fused kernel's programs derive their own rows of the tile table
and the row maps from the ids (``kernels/moe_fused_ws.py``'s ``moe_fused_ws_routed_kernel``,
``kernels/moe_program_tables.py``), so a call is the fused kernel (and the weighted sum) with no
routing launch and no kernel boundary before it. That launch is the call's first: it takes the
call's addresses (a graph's node of it is given each call's) and writes the argument block. Its
row counters are its own (``DeviceTables.routed_ready``), zero at allocation and left zero by
each call (after a spin timeout, which raises the error flag, no longer promised).

Where it applies (``routes_in_kernel``): the gluon_ws kernel, a layer built with
``routing="kernel"``, at most ``ROUTED_ARRIVALS`` arrivals (``block_m``). An FP8 layer's bf16
rows are quantized by the programs that read them, as the routing's quantizing programs do
(``quantize``: ``kernels/moe_program_tables.quantize_rows``). Not yet run or timed on a GPU:
the layer's default stays the routing launches (``routing="launch"``)."""
from __future__ import annotations

import torch
import triton

from ...kernel_sources import load_kernel_module
from ..launcher import Launcher
from .call_args import triton_dtype
from .fused import KERNEL_ENTRIES, InKernelSum, KernelBuffers, kernel_launch
from .schedules import WAVE_FILL
from .shapes import MoEContractError

# Where a call's routing runs: its own launches before the fused kernel, or the fused kernel's
# programs (routes_in_kernel).
ROUTINGS = ("launch", "kernel")
# The most arrivals the fused kernel routes itself: every routed expert then holds one row block
# (block_m rows); the ids' pairs are held 32 rows at a time, so that the builds up to 128
# arrivals spill no more than a few bytes more than the base builds (sm_90, Triton 3.6:
# test_kernel_ws).
ROUTED_ARRIVALS = 128
# The fewest arrivals a build holds: at 16 ptxas spills 72-76 bytes in the FP8 builds, at 32 none.
MIN_ARRIVALS = 32
ROUTED_ENTRY = "moe_fused_ws_routed_kernel"  # in kernels/moe_fused_ws.py
# what a routed call writes of the device tables (table_reference.table_mismatches' names),
# beside its schedule's table and counts: the routing launches write the rest
ROUTED_TABLES = ("row_src", "row_slot", "row_origin", "x_quant", "x_quant_scale")
ENTRIES_PER_STEP = 16  # a program's table entries computed at a time (moe_program_tables' J)
# the base entry's arguments the routed entry takes from elsewhere: the argument block's slots
# it writes, the row counters it leaves zero
NOT_ROUTED = ("a_rows", "sum_args", "row_ready")


def routed_mismatches(mismatches: list[str], schedule: str) -> list[str]:
    """Of ``table_reference.table_mismatches``' names, those of the tables a routed call of
    ``schedule`` writes (``ROUTED_TABLES``, its schedule's table and counts)."""
    return [m for m in mismatches if m.startswith((*ROUTED_TABLES, f"{schedule}."))]


def routes_in_kernel(kernel: str, routing: str, capacity: int) -> bool:
    """Whether a call of ``capacity`` arrivals routes in the fused kernel (module docstring)."""
    return routing == "kernel" and kernel == "gluon_ws" and capacity <= ROUTED_ARRIVALS


def check_routing(routing: str, kernel: str) -> None:
    """Raise MoEContractError unless ``routing`` is one of ``ROUTINGS`` that ``kernel`` runs."""
    if routing not in ROUTINGS:
        raise MoEContractError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if routing == "kernel" and kernel != "gluon_ws":
        raise MoEContractError(f"routing='kernel' needs the gluon_ws kernel, not {kernel}")


def arrivals_padded(capacity: int) -> int:
    """The build's arrivals for ``capacity`` (its ``A``): a power of two, ``MIN_ARRIVALS`` at
    least."""
    return max(MIN_ARRIVALS, triton.next_power_of_2(capacity))


def routed_launcher(ws, schedule: str, peers, capacity: int, received: bool,
                    id_dtype: torch.dtype, weighted_sum: InKernelSum | None,
                    quantize: bool) -> Launcher:
    """The routed entry over ``ws``' buffers (an ``op.MoEWorkspace``) for ``schedule`` and the
    Combine ``peers``, for calls of at most ``capacity`` arrivals (``received``: an EP rank's,
    their count on the device; ``quantize``: bf16 rows of an FP8 layer, into the tables'
    ``x_quant``), launched with the call's addresses (``CAPACITY``, ``TOP_K`` and, on an EP
    rank, the arrivals' count, sources and slots too). Its arguments are those
    ``kernel_launch`` gives the base entry over the same buffers, less ``NOT_ROUTED``, with the
    row counters of its own (``tables.routed_ready``) and the table's constants."""
    t, b = ws.tables, ws.bounds
    summed = weighted_sum
    buffers = KernelBuffers(t.tiles[schedule], t.num_tiles[schedule], t.a_rows, t.row_origin,
                            ws.h, ws.h_scale, t.row_ready, t.row_src, t.row_slot, peers.table,
                            t.error, ws.trace, b.l2_splits, ws.l2_partial, ws.l2_ready, summed)
    args, constexprs = kernel_launch(ws.config, ws.weights, buffers,
                                     max_spin_iters=ws.max_spin_iters)
    module = load_kernel_module(KERNEL_ENTRIES["gluon_ws"][0])
    base = dict(zip(getattr(module, KERNEL_ENTRIES["gluon_ws"][1]).arg_names, args))
    static = {k: v for k, v in base.items() if k not in NOT_ROUTED}
    constexprs.pop("FENCE")
    # at EP = 1 no count, sources or slots are read: any pointer stands in
    arrivals = {} if received else dict(n_arrivals=t.meta, arrival_src=t.meta,
                                        arrival_slot=t.meta)
    # without quantizing nothing reads the copy: any pointer stands in
    copy = ((t.x_quant, t.x_quant_scale) if quantize else (t.meta, t.meta))
    return Launcher(getattr(module, ROUTED_ENTRY), **static, **constexprs, **arrivals,
                    x_quant=copy[0], x_quant_scale=copy[1], QUANTIZE=quantize,
                    args=t.args, row_ready=t.routed_ready,
                    P1=b.l1_n_blocks, P2=b.l2_n_blocks, LEAD=b.lead_rows,
                    WAVE_MIN_L1=WAVE_FILL * b.num_programs, RECEIVED=received,
                    WAVE=schedule == "wave", ID_DTYPE=triton_dtype(id_dtype),
                    A=arrivals_padded(capacity), J=ENTRIES_PER_STEP)
