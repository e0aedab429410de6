"""The host reference the device tables (``device_tables``) equal entry for entry: the Dispatch
layout (``dispatch.build_layout``) and both schedules' tile tables (``schedules``), built on the
host from the same arrivals, and where a device routing differs from it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .device_tables import SCHEDULES, DeviceTables, TableBounds
from .dispatch import DispatchLayout, build_layout
from .schedules import MoEProblem, expert_wave_schedule, interleaved_schedule, tile_table

BITS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}  # compared bitwise


@dataclass(frozen=True)
class HostTables:
    """The reference of one routing: the Dispatch layout, the row of ``x`` each of its rows reads
    (-1 on padding) and each schedule's table and counts."""

    layout: DispatchLayout
    row_origin: np.ndarray  # int32 [rows]
    tiles: dict      # schedule -> int32 ndarray [G, max_tiles, 4]
    num_tiles: dict  # schedule -> int32 ndarray [G]


def host_tables(bounds: TableBounds, expert_ids: torch.Tensor, x: torch.Tensor,
                x_scale: torch.Tensor | None = None, *, top_k: int = 1,
                arrival_src: torch.Tensor | None = None,
                arrival_slot: torch.Tensor | None = None) -> HostTables:
    """The host reference of ``route_to_tables`` for the same arrivals (EP = 1 where
    ``arrival_src`` is None: slot ``i``, source 0, token ``i // top_k`` of ``x``, which the
    caller repeats per pick; an EP rank's arrival ``i`` is row ``i`` of ``x``). Rows are the
    arrivals' own (quantize before, as the device does)."""
    n = expert_ids.numel()
    src = torch.zeros(n, dtype=torch.int64) if arrival_src is None else arrival_src.cpu()
    slot = torch.arange(n) if arrival_slot is None else arrival_slot.cpu()
    world = int(src.max()) + 1 if n else 1
    recv_counts = torch.bincount(src, minlength=world).tolist()
    layout = build_layout(x.cpu(), None if x_scale is None else x_scale.cpu(), slot,
                          expert_ids.cpu().long(), recv_counts, bounds.num_experts, bounds.block_m)
    problem = MoEProblem(layout.blocks_per_expert, bounds.l1_n_blocks, bounds.l2_n_blocks)
    schedules = {"wave": expert_wave_schedule(problem, bounds.num_programs),
                 "interleaved": interleaved_schedule(problem, bounds.num_programs,
                                                     bounds.lead_rows,
                                                     expert_lead=bounds.expert_lead)}
    tables = {name: tile_table(s) for name, s in schedules.items()}
    origin = np.full(layout.num_rows, -1, dtype=np.int32)
    arrivals = layout.arrival_rows.numpy()
    placed = arrivals >= 0
    origin[arrivals[placed]] = np.arange(n)[placed] // (1 if arrival_src is not None else top_k)
    return HostTables(layout, origin, {k: v[0] for k, v in tables.items()},
                      {k: v[1] for k, v in tables.items()})


def table_mismatches(device: DeviceTables, host: HostTables) -> list[str]:
    """Where ``device`` differs from ``host`` (empty where they agree entry for entry): per-expert
    counts and padded offsets, the arrival -> row map, ``row_src``/``row_slot``/``row_origin``
    over the rows in use, where the routing quantized (``a_rows`` names ``x_quant``) every row's
    activations as the fused kernel reads them (bitwise), and each schedule's counts and used
    entries."""
    lay = host.layout
    out = []
    counts = np.asarray(lay.tokens_per_expert)
    blocks = np.asarray(lay.blocks_per_expert)
    offsets = np.concatenate(([0], np.cumsum(blocks))) * lay.block_m
    rows = int(offsets[-1])
    checks = {
        "expert_counts": (device.expert_counts.cpu().numpy(), counts),
        "expert_offsets": (device.expert_offsets.cpu().numpy(), offsets),
        "row_blocks": (device.meta[:1].cpu().numpy(), [rows // lay.block_m]),
        "arrival_rows": (device.arrival_rows[:len(lay.arrival_rows)].cpu().numpy(),
                         lay.arrival_rows.numpy()),
        "row_src": (device.row_src[:rows].cpu().numpy(), lay.row_src.numpy()),
        "row_slot": (device.row_slot[:rows].cpu().numpy(), lay.row_slot.numpy()),
        "row_origin": (device.row_origin[:rows].cpu().numpy(), host.row_origin),
    }
    quantized = (device.x_quant is not None
                 and int(device.a_rows[0]) == device.x_quant.data_ptr())
    if quantized:
        used = torch.from_numpy(host.row_origin >= 0)
        origin = torch.from_numpy(host.row_origin).long()[used]
        # the scales at each layout row where the routing laid them out so, else at its origin's
        scale_at = torch.arange(rows)[used] if int(device.a_rows[2]) else origin
        for name, got, want, at in (("x_quant", device.x_quant, lay.x, origin),
                                    ("x_quant_scale", device.x_quant_scale, lay.x_scale,
                                     scale_at)):
            g, w = got[at.to(got.device)].cpu(), want[used]
            if g.dtype in BITS:  # bitwise
                g, w = g.view(BITS[g.dtype]), w.view(BITS[g.dtype])
            checks[name] = (g.numpy(), w.numpy())
    for s in SCHEDULES:
        want_n = host.num_tiles[s]
        got_n = device.num_tiles[s].cpu().numpy()
        checks[f"{s}.num_tiles"] = (got_n, want_n)
        if np.array_equal(got_n, want_n):
            got_t = device.tiles[s].cpu().numpy()
            for g_, c in enumerate(want_n):
                checks[f"{s}.tiles[{g_}]"] = (got_t[g_, :c], host.tiles[s][g_, :c])
    for name, (got, want) in checks.items():
        if np.shape(got) != np.shape(want) or not np.array_equal(got, want):
            out.append(name)
    return out
