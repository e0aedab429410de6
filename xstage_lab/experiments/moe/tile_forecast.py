"""The host-link MoE matrix forecast tile by tile, and the schedule it picks (issue 26 item 3).

``forecast.combine_forecast`` plays one program's tile order with every Linear-2 burst the
average share of a tile; it misses two things the host-link matrix showed: a Linear-2 tile's rows
come from one or two source ranks, so a tile crosses the link whole or not at all (the bursts are
lumpier than the average), and the lead D decides how long Linear-2 tiles wait for their rows'
Linear-1 tiles. This forecast plays the whole tile table instead (``simulator.
simulate_tile_table``): every program's tiles in the schedule's order, each with the kernel's
traced mainloop and epilogue times, Linear-2 tiles waiting on their row blocks, and each
Linear-2 tile's own host bytes (its rows whose source rank is one of the first h) through one
shared X-Stage of the host link's calibration.

The layout is drawn on the CPU from the benchmark's seeds (``kernel_bench.build_workload``):
the CPU's random generator is not the GPU's, so it is the same routing distribution, not the
same draw. The simulated times are scaled per cell by the ratio of the all-local Expert-Wave's
measured time (the one-GPU kernel record) to its simulated one.

``auto_schedule``: of Expert-Wave and Interleaved at each lead of ``schedules.lead_sweep``, the one
this forecast predicts fastest for the cell, the link and the host share.
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd

from ... import model, simulator
from ...ops.moe.schedules import (L1, MoEProblem, d_knee, expert_wave_schedule,
                                  interleaved_schedule, lead_sweep, skew_lead)
from ...ops.moe.shapes import load_shapes
from .bench import cell_seed

BF16_BYTES = 2


def host_rows_per_block(row_src: np.ndarray, row_slot: np.ndarray, block_m: int,
                        host_share: int) -> np.ndarray:
    """Rows of each row block whose Combine buffer is host memory: a real row (slot >= 0) of one
    of the first ``host_share`` source ranks."""
    host = (row_slot >= 0) & (row_src < host_share)
    return host.reshape(-1, block_m).sum(axis=1)


def tile_programs(schedule, block_bytes: np.ndarray) -> list[list[tuple[int, int, float]]]:
    """The schedule's programs as the simulator takes them: (kind, row block, remote bytes)."""
    return [[(simulator.L1_TILE if t.kind == L1 else simulator.L2_TILE, t.row_block,
              0.0 if t.kind == L1 else float(block_bytes[t.row_block])) for t in prog]
            for prog in schedule.programs]


def simulated_us(problem: MoEProblem, schedule, block_bytes: np.ndarray, times: dict,
                 platform: model.PlatformModel, programs: int) -> float:
    """The simulated makespan of ``schedule`` with ``block_bytes`` per Linear-2 tile of a row
    block; ``times``: mainloop and epilogue µs of Linear-1 and Linear-2 tiles."""
    capacity = platform.capacity_at(programs)
    out = simulator.simulate_tile_table(
        tile_programs(schedule, block_bytes), problem.l1_n_blocks,
        (times["mainloop_l1_us"], times["mainloop_l2_us"]),
        (times["epilogue_l1_us"], times["epilogue_l2_us"]),
        platform.drain_rate, capacity if capacity is not None else 0.0)
    return out["makespan_us"]


def cell_forecast(kernel: dict, platform: model.PlatformModel, host_shares, *,
                  seed: int = 0) -> list[dict]:
    """One row per host share of ``kernel``'s cell (a row of a ``moe_kernel`` record): the
    predicted time of Expert-Wave, of Interleaved at each lead of ``lead_sweep`` and all local,
    and the schedule ``auto`` picks."""
    from .kernel_bench import build_workload, fused_layout

    shape = load_shapes()[kernel["model"]]
    tiles = kernel["tile_config"]
    tiles = json.loads(tiles) if isinstance(tiles, str) else tiles
    programs = int(kernel["num_programs"])
    wl = build_workload(shape, kernel["routing"], int(kernel["tokens"]),
                        seed=cell_seed(seed, shape.model, kernel["precision"], kernel["routing"],
                                       int(kernel["tokens"])))
    layout = fused_layout(wl, kernel["precision"], tiles["block_m"])
    problem = MoEProblem(layout.blocks_per_expert, shape.intermediate // tiles["block_n1"],
                         shape.hidden // tiles["block_n2"])
    knee = d_knee(2 * tiles["block_n1"], programs, shape.intermediate)
    lead = skew_lead(knee, programs, problem.l2_n_blocks)
    schedules = {"wave": expert_wave_schedule(problem, programs),
                 **{f"interleaved_d{d}": interleaved_schedule(problem, programs, d)
                    for d in lead_sweep(knee, lead)}}
    times = {name: {"mainloop_l1_us": kernel[f"{p}_mainloop_l1_us"],
                    "mainloop_l2_us": kernel[f"{p}_mainloop_l2_us"],
                    "epilogue_l1_us": kernel[f"{p}_epilogue_l1_us"],
                    "epilogue_l2_us": kernel[f"{p}_span_l2_us"]}
             for name, p in (("wave", "wave"), ("interleaved", "int"))}
    row_src, row_slot = layout.row_src.numpy(), layout.row_slot.numpy()

    def simulate(name, share):
        block_bytes = host_rows_per_block(row_src, row_slot, tiles["block_m"], share) \
            * tiles["block_n2"] * BF16_BYTES
        t = times["wave" if name == "wave" else "interleaved"]
        return simulated_us(problem, schedules[name], block_bytes, t, platform, programs)

    scale = kernel["kernel_wave_us"] / simulate("wave", 0)
    local = {name: simulate(name, 0) * scale for name in schedules}
    rows = []
    for h in host_shares:
        predicted = {name: simulate(name, h) * scale for name in schedules}
        auto = min(predicted, key=predicted.get)
        rows.append({"model": shape.model, "precision": kernel["precision"],
                     "routing": kernel["routing"], "tokens": int(kernel["tokens"]),
                     "host_share": h, "d_knee": knee, "lead_rows": lead,
                     "auto_schedule": auto, "auto_predicted_us": predicted[auto],
                     **{f"tile_{name}_us": us for name, us in predicted.items()},
                     **{f"tile_{name}_local_us": us for name, us in local.items()},
                     "simulated_scale": scale})
    return rows


def tile_forecast(kernels: pd.DataFrame, platform: model.PlatformModel, host_shares,
                  seed: int = 0) -> pd.DataFrame:
    """``cell_forecast`` of every cell of ``kernels`` (``moe_kernel`` rows)."""
    return pd.DataFrame([row for k in kernels.to_dict("records")
                         for row in cell_forecast(k, platform, host_shares, seed=seed)])
