"""The host reference the device tables (``device_tables``) equal entry for entry: the Dispatch
layout (``dispatch.build_layout``) and both schedules' tile tables (``schedules``), built on the
host from the same arrivals, and where a device routing differs from it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .device_tables import SCHEDULES, DeviceTables, TableBounds
from .dispatch import DispatchLayout, build_layout
from .schedules import (L1, L2, WAVE_FILL, MoEProblem, expert_wave_schedule,
                        interleaved_schedule, tile_table)

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


def program_tiles(schedule: str, g: int, row_experts, num_programs: int, l1_n_blocks: int,
                  l2_n_blocks: int, lead_rows: int) -> np.ndarray:
    """Program ``g``'s row of ``schedule``'s table (int32 ``[tiles, 4]``) where every routed
    expert holds one row block (at most ``block_m`` arrivals), from the row blocks' experts
    (``row_experts``, ascending) alone: the closed forms of ``kernels/moe_routing.py`` solved
    for the tiles of one program instead of the program of each tile, so that a program of the
    fused kernel can derive its own row. With one row block an expert the lead counted from the
    expert's end is the row lead.

    Expert-Wave: stream items ``g + j G``; a wave holds ``w = cdiv(WAVE_FILL G, P_1)`` row blocks
    (the last the rest), ``w (P_1 + P_2)`` items: its Linear-1 tiles, then its Linear-2 tiles.
    Interleaved: Linear-2 stream indices ``g + j G`` at position ``j`` plus the program's
    Linear-1 tiles before index ``min((p_2 + D) P_1, n_1)``; Linear-1 indices (``l1_deal`` in
    closed form) ``(g - r_2) + j n_B`` for ``j < u`` where ``g >= r_2``, then ``u n_B + rank_g +
    m G``, at their own index plus the program's Linear-2 tiles before ``min((p_1 - D + 1) P_2,
    n_2)``."""
    experts = np.asarray(row_experts, dtype=np.int64)
    G, P1, P2, D = num_programs, l1_n_blocks, l2_n_blocks, lead_rows
    n1, n2 = len(experts) * P1, len(experts) * P2
    if schedule == "wave":
        k = np.arange(g, n1 + n2, G)
        w = -(-WAVE_FILL * G // P1)
        lo = k // (w * (P1 + P2)) * w
        in_wave = np.minimum(lo + w, len(experts)) - lo
        o = k - lo * (P1 + P2)
        first = o < in_wave * P1
        o2 = o - in_wave * P1
        kind = np.where(first, L1, L2)
        row = np.where(first, lo + o // P1, lo + o2 // P2)
        n = np.where(first, o % P1, o2 % P2)
    elif schedule == "interleaved":
        r2 = n2 % G
        nb, u, f = G - r2, P1 // (2 * P2), P1 % (2 * P2)
        rank = g if f == 0 else (g - r2 if g >= r2 else nb + g)
        early = (g - r2) + np.arange(u) * nb if g >= r2 else np.arange(0)
        late = u * nb + rank + np.arange(0, max(n1 - u * nb - rank, 0), G)
        k1 = np.concatenate((early, late))
        own1 = np.arange(len(k1))
        k1, own1 = k1[k1 < n1], own1[k1 < n1]
        k2 = np.arange(g, n2, G)

        def l2_below(limit):  # program g's Linear-2 stream indices below limit
            return np.maximum(limit - g + G - 1, 0) // G

        def l1_below(limit):  # program g's Linear-1 stream indices below limit
            return np.searchsorted(k1, limit)

        kind = np.concatenate((np.full(len(k1), L1), np.full(len(k2), L2)))
        row = np.concatenate((k1 // P1, k2 // P2))
        n = np.concatenate((k1 % P1, k2 % P2))
        at = np.concatenate((own1 + l2_below(np.minimum((k1 // P1 - D + 1) * P2, n2)),
                             np.arange(len(k2)) + l1_below(np.minimum((k2 // P2 + D) * P1, n1))))
        order = np.argsort(at)  # a permutation of the row's positions
        kind, row, n = kind[order], row[order], n[order]
    else:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return np.stack((kind, experts[row] if len(row) else row, row, n), axis=1).astype(np.int32)
