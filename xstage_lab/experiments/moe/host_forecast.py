"""The host-link MoE forecast (``moe_host_forecast``): the averaged forecast
(``analysis.moe.forecast.compute_host_forecast``) and beside it the forecast tile by tile, with
the schedule it picks (issue 26 items 2-3). Written before the host-link matrix is measured
(``moe.host_bench``), which refuses to run without it and names it.

    python -m xstage_lab.experiments.moe.host_forecast [HOST_PLATFORM] [--kernel-platform h200-x1]
        [--tokens 4096] [--records DIR] [--root DIR]

prints the forecast; only with ``--root DIR`` does it write the record there.

``forecast.combine_forecast`` plays one program's tile order with every Linear-2 burst the
average share of a tile; it misses two things the host-link matrix showed: a Linear-2 tile's rows
come from one or two source ranks, so a tile crosses the link whole or not at all (the bursts are
lumpier than the average), and the lead D decides how long Linear-2 tiles wait for their rows'
Linear-1 tiles. This forecast plays the whole tile table instead (``simulator.
simulate_tile_table``): every program's tiles in the schedule's order, each with the kernel's
traced mainloop and epilogue times, Linear-2 tiles waiting on their row blocks, and each
Linear-2 tile's own host bytes (its rows whose source rank is one of the first h) through one
shared X-Stage of the host link's calibration.

The layout is drawn on the CPU from the benchmark's seeds (``kernel_cell.build_workload``):
the CPU's random generator is not the GPU's, so it is the same routing distribution, not the
same draw. The simulated times are scaled per cell by the ratio of the all-local Expert-Wave's
measured time (the one-GPU kernel record) to its simulated one.

Where the host platform has the ``under_load`` probe (``analysis.remote_store.under_load``), the
tile forecast plays R scaled by the probe's R under a concurrent load over R alone; where it has
none, R as calibrated. The mainloops stay as traced all local, although a full host X-Stage slows
the GPU's other work: on one H200 a streaming load by up to 36x
(``remote_store_partial/h200-x1-host/20261202T124212Z-777eb0edc1``) and cuBLAS's bf16 matmul by
9-38x beside K = 16-66 SMs storing into host memory (``…/20261202T131555Z-44b85f84b5``, the
``under_gemm`` probe). Played on the mainloops, that slowdown made ``auto``'s picks worse on a
matrix of the platform (``moe_host/h200-x1-host/20261202T104749Z``, since retired: 81 of 112 cells
within 3% of the fastest as traced; 39 with the streaming load's 36x and 41 with the matmul's 37x,
each stretching a mainloop that starts with q outstanding by 1 + (s − 1)·min(1, q/Q); 59 with the
matmul's 37x on mainloops that start with the X-Stage full, only): the fused kernel's mainloops do
not meet the sustained backpressure the probes hold, and how they do meet it is not modelled.

``auto_schedule`` (``pick_auto``): Expert-Wave where this forecast predicts it the fastest of
Expert-Wave and Interleaved at each lead of ``schedules.lead_sweep`` for the cell, the link and the
host share; else Interleaved at ``AUTO_LEAD_MULTIPLE`` times the derived lead. The forecast plays
every tile at its median time, so it tells whether the X-Stage stalls Expert-Wave, but not which
lead is fastest: the leads' predictions lie within a fraction of a percent, while measured, a lead
of one D lets the Linear-2 tiles catch up with the Linear-1 tiles they wait for once the host
link's stalls spread the tile times, and a lead of 4D puts the Linear-2 tiles far enough behind
that the L2 cache keeps less of what both read (``schedules.derived_lead``). Scored on the two
matrices at the derived lead from each schedule's measured time
(``analysis.moe.host_view.pick_over_fastest``; ``moe_host/h200-x1-host``
``20261203T144659Z-cade274a5a`` with ``…145106Z-be4fce343b``, then ``…162414Z-3ef5ccf57b`` with
``…162902Z-c52dc2b2b5``), the pick is within 3% of the fastest in 99 and 105 of 112 cells at 2D,
83 and 82 at D, 90 and 99 at 4D; the rule before it (of the schedules predicted within 0.5% of the
fastest, the longest lead) in 93 and 98, and timed live as ``auto`` in 82 and 88. Timed live on
the matrix measured after it (``20261203T164242Z-33ddf8caaf`` with ``…164708Z-e98459381c``), this
rule was within 3% in 94 of 112 cells (offline there: 102), then in 96 and in 102 on the two
matrices of ``make reproduce`` (``…183751Z-baa09de5b9``, ``20261204T000038Z-571f7889c6``).
Which schedule is fastest moves from run to run, and two timings of one schedule in one run differ
by up to 6% (``auto_standing``'s ``auto_over_same``).

So ``moe_host``'s ``auto`` tunes where the forecast cannot tell: of the schedules the forecast
predicts within ``AUTO_TUNE_MARGIN`` of its fastest (``tune_candidates``), the one timed fastest
on the cell's own buffers before the cell is measured, as an autotuner picks a kernel's
configuration at first use. The forecast alone decides where one schedule stands that far
ahead. The margin is the smallest that held every cell of both ``make reproduce`` matrices above:
there, the fastest measured of its candidates was within 3% of the fastest of all in 112 and
112 of 112 cells (at 5%: 110 and 112; at 3%: 109 and 111), with 3.6 candidates of 4.1 on average.
Timed live on the matrix measured with it (``moe_host/h200-x1-host/20261204T113750Z-3ffe57e5ac``
with ``…114214Z-6ee2074c98``, this forecast record ``20261203T235350Z-9ddd054425``), the tuned
``auto`` was within 3% of the fastest in 110 of 112 cells, the forecast's own pick in 99; the two
misses (1.030x and 1.032x) are cells where ``auto`` and the same schedule in the sweep, timed in
one run, differ by 2.3% and 2.5%. Tuning took 0.21 s per cell (median; at most 0.67 s). In the
matrix of ``make reproduce --backend auto`` after it (``20261204T120202Z-041061d1e8``, forecast
``20261204T115402Z-9ddd054425``): 108 of 112, the forecast's own pick 105; the four misses
(1.043-1.075x) are cells where those two timings of one schedule differ by 3.8-7.3%: the bound
is at the repeatability of the timing there, not at the pick.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pandas as pd

from ... import model, simulator
from ...analysis.moe.forecast import HOST_SHARES, combine_platform, compute_host_forecast
from ...records import RECORDS_DIR
from ...ops.moe.schedules import (L1, MoEProblem, d_knee, expert_wave_schedule,
                                  derived_interleaved_schedule, lead_sweep, derived_lead)
from ...ops.moe.shapes import load_shapes
from .bench import cell_seed

BF16_BYTES = 2
# ``auto``'s Interleaved lead over the derived lead (``pick_auto``); one of LEAD_MULTIPLES
AUTO_LEAD_MULTIPLE = 2
# ``auto`` is tuned among the schedules predicted within this fraction of the fastest prediction
AUTO_TUNE_MARGIN = 0.08


def schedule_lead(name: str) -> int:
    """The lead of a schedule named ``"interleaved_d<D>"``; 0 for Expert-Wave (``"wave"``)."""
    return 0 if name == "wave" else int(name.removeprefix("interleaved_d"))


def pick_auto(predicted: dict[str, float], lead: int) -> str:
    """``"wave"`` where it is the fastest of the schedules ``predicted`` (``"wave"`` or
    ``"interleaved_d<D>"`` -> µs), else Interleaved at ``AUTO_LEAD_MULTIPLE`` times the derived
    lead ``lead`` (a schedule ``predicted`` holds)."""
    if min(predicted, key=predicted.get) == "wave":
        return "wave"
    name = f"interleaved_d{AUTO_LEAD_MULTIPLE * lead}"
    if name not in predicted:
        raise ValueError(f"{name} is not among the predicted schedules {sorted(predicted)}")
    return name


def tune_candidates(predicted: dict[str, float]) -> list[str]:
    """The schedules of ``predicted`` (name -> µs) within ``AUTO_TUNE_MARGIN`` of its fastest,
    in its order: what ``moe_host`` times to pick ``auto`` (one where the forecast stands alone)."""
    if not predicted:
        raise ValueError("no predicted schedule to tune among")
    limit = min(predicted.values()) * (1 + AUTO_TUNE_MARGIN)
    return [name for name, us in predicted.items() if us <= limit]


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
                  seed: int = 0, patterns: dict | None = None,
                  under_load: dict | None = None) -> list[dict]:
    """One row per host share of ``kernel``'s cell (a row of a ``moe_kernel`` record): the
    predicted time of Expert-Wave, of Interleaved at each lead of ``lead_sweep`` and all local,
    and the schedule ``auto`` picks; the Combine drains by its row pattern's model where
    ``patterns`` holds it (``forecast.combine_platform``), at R scaled by ``under_load``'s
    ``drain_under_load_ratio`` where given (``calibration.under_load_terms``)."""
    from .kernel_cell import build_workload, fused_layout

    shape = load_shapes()[kernel["model"]]
    tiles = kernel["tile_config"]
    tiles = json.loads(tiles) if isinstance(tiles, str) else tiles
    platform, _ = combine_platform(platform, patterns or {}, tiles["block_n2"], shape.hidden)
    under_load = under_load or {}
    platform = dataclasses.replace(
        platform, drain_rate=platform.drain_rate * under_load.get("drain_under_load_ratio", 1.0))
    programs = int(kernel["num_programs"])
    wl = build_workload(shape, kernel["routing"], int(kernel["tokens"]),
                        seed=cell_seed(seed, shape.model, kernel["precision"], kernel["routing"],
                                       int(kernel["tokens"])))
    layout = fused_layout(wl, kernel["precision"], tiles["block_m"])
    problem = MoEProblem(layout.blocks_per_expert, shape.intermediate // tiles["block_n1"],
                         shape.hidden // tiles["block_n2"])
    knee = d_knee(2 * tiles["block_n1"], programs, shape.intermediate)
    lead = derived_lead(knee, programs, problem.l1_n_blocks, problem.l2_n_blocks)
    schedules = {"wave": expert_wave_schedule(problem, programs),
                 **{f"interleaved_d{d}": derived_interleaved_schedule(problem, programs, d)
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
        auto = pick_auto(predicted, lead)
        rows.append({"model": shape.model, "precision": kernel["precision"],
                     "routing": kernel["routing"], "tokens": int(kernel["tokens"]),
                     "host_share": h, "d_knee": knee, "lead_rows": lead,
                     "auto_schedule": auto, "auto_predicted_us": predicted[auto],
                     **{f"tile_{name}_us": us for name, us in predicted.items()},
                     **{f"tile_{name}_local_us": us for name, us in local.items()},
                     "simulated_scale": scale})
    return rows


def tile_forecast(kernels: pd.DataFrame, platform: model.PlatformModel, host_shares,
                  seed: int = 0, patterns: dict | None = None,
                  under_load: dict | None = None) -> pd.DataFrame:
    """``cell_forecast`` of every cell of ``kernels`` (``moe_kernel`` rows), in their order.

    The cells are independent and each is seconds of single-threaded work (most of it drawing
    the cell's workload on the CPU), so they run in a pool of processes, one per core: on a
    16-core GPU host the forecast that ``reproduce`` writes before the host-link matrix takes
    seconds instead of minutes. Spawned, not forked: torch's thread pools do not survive a
    fork."""
    cells = kernels.to_dict("records")
    call = functools.partial(cell_forecast, platform=platform, host_shares=host_shares,
                             seed=seed, patterns=patterns, under_load=under_load)
    workers = min(len(cells), os.cpu_count() or 1)
    if workers <= 1:
        per_cell = list(map(call, cells))
    else:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_one_thread) as pool:
            per_cell = list(pool.map(call, cells))
    return pd.DataFrame([row for rows in per_cell for row in rows])


def _one_thread() -> None:
    """A pool worker's torch on one thread: the pool already takes a core per worker."""
    import torch
    torch.set_num_threads(1)


def compute(kernel_platform: str, host_platform: str, tokens: int,
            root: Path = RECORDS_DIR) -> tuple[pd.DataFrame, dict]:
    """The ``moe_host_forecast`` table: ``compute_host_forecast``'s rows joined with
    ``tile_forecast``'s for the same cells, and its parameters (with the ``under_load`` probe's
    record and terms where the platform has one)."""
    from ...analysis.moe.kernel_view import latest_view
    from ...analysis.remote_store.characterization import latest_calibration
    from ...analysis.remote_store.row_chunks import combine_models
    from ...analysis.remote_store.under_load import forecast_terms

    table, params = compute_host_forecast(kernel_platform, host_platform, tokens, root)
    kernels = latest_view(kernel_platform, root).table
    under_load, under_load_record = forecast_terms(host_platform, root)
    tiles = tile_forecast(kernels[kernels["tokens"] == tokens],
                          latest_calibration(host_platform, root).platform_model(), HOST_SHARES,
                          patterns=combine_models(host_platform, root)[0], under_load=under_load)
    table = table.merge(tiles, on=["model", "precision", "routing", "tokens", "host_share"],
                        how="left", validate="one_to_one")
    probe = ({"under_load_record": under_load_record, **under_load} if under_load_record
             else {})
    return table, {**params, **probe, "method": params["method"] + "\n\n" + __doc__}


def write(kernel_platform: str, host_platform: str, tokens: int,
          root: Path = RECORDS_DIR) -> Path:
    """``compute`` saved as a ``moe_host_forecast`` record under ``root``."""
    from ...platform import provenance
    from ...records import write_record

    table, params = compute(kernel_platform, host_platform, tokens, root)
    return write_record("moe_host_forecast", host_platform, table, params, provenance(), root)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m xstage_lab.experiments.moe.host_forecast",
                                description="The host-link MoE forecast (CPU only): printed, or "
                                            "written as a moe_host_forecast record with --root.")
    p.add_argument("host_platform", nargs="?", default="h200-x1-host",
                   help="the -host platform whose calibration gives T_iss^0, R and Q")
    p.add_argument("--kernel-platform", default="h200-x1",
                   help="platform whose moe_kernel record gives the per-tile times")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per source rank")
    p.add_argument("--records", type=Path, default=RECORDS_DIR,
                   help="records read (default: the committed data/records)")
    p.add_argument("--root", type=Path, default=None,
                   help="write the record under this records root, reading its records there")
    a = p.parse_args(argv)
    try:
        if a.root is not None:
            print(f"wrote {write(a.kernel_platform, a.host_platform, a.tokens, a.root)}")
            return
        table, params = compute(a.kernel_platform, a.host_platform, a.tokens, a.records)
    except (FileNotFoundError, ValueError) as e:
        p.exit(2, f"{p.prog}: error: {' '.join(str(e).split())}\n")
    print(f"moe_host_forecast of {', '.join(params['kernel_records'])} on "
          f"{params['calibration_record']} (not saved; --root DIR writes it):")
    print(table[list(PRINTED)].round(4).to_string(index=False))


PRINTED = ("model", "precision", "routing", "host_share", "v_over_r_us", "predicted_stall_us",
           "predicted_speedup", "auto_schedule", "auto_predicted_us")

if __name__ == "__main__":
    main()
