"""The forecast a multi-GPU run will test (paper §4.2, eqs. 10, 12–14): from the fast kernel's
per-tile times measured on one GPU, where every Combine store is local, and a platform's
calibration M_X = (T_iss^0, R, Q), what expert parallelism over P GPUs should do to the
Linear-2 Combine bursts of each model shape.

Per (model, precision) and P:

* remote share of the Combine rows: a rank's rows come from the P source ranks alike (balanced
  and skewed routing alike: hot experts are hot on every rank), so (P − 1)/P of them go to a peer;
* a Linear-2 tile's remote burst V_t = block_m · block_n2 · 2 B · share; under Expert-Wave all
  K_act = programs SMs issue such bursts back to back: V = K_act · V_t (``moe_trace.condition1``'s
  aligned worst case, here with the remote share);
* the gaps of eq. 12 from the measured mainloops: G_wave = T_L2^mma, G_int = T_L2^mma +
  (n1/n2) · T_L1^mma; V/R, the design test of eq. 10 and the per-burst stall of eq. 4;
* the fluid simulator (``simulator``) plays one program's tile order of each schedule (Expert-Wave
  wave by wave, Interleaved with its Linear-1 tiles spread between the Linear-2 tiles), capacity
  Q(K) included, and sums the issue stall beyond T_iss^0, which in this kernel lies on the
  critical path (the consumer warpgroups that issue the Combine stores run the next mainloop):
  ``predicted_stall_us`` is its mean per Linear-2 burst under Expert-Wave (eq. 4's steady state
  and eq. 7's isolated burst are its two limits, reported beside it), the predicted kernel time
  the measured one-GPU time plus the program's stall, the predicted Interleaved speedup their
  ratio.

The calibration is the one-to-one route's (two GPUs); whether its R holds for P = 4 and 8 is part
of what the multi-GPU run tests.

    python -m xstage_lab.analysis.moe.forecast [--kernel-platform h200-x1]
        [--calibration-platform h200-x2] [--records DIR] [--root DIR]

prints the forecast; only with ``--root DIR`` does it write the ``moe_forecast`` record there.
The host link's forecast (``moe_host_forecast``) is ``experiments.moe.host_forecast``'s.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pandas as pd

from ... import model, simulator
from ...records import RECORDS_DIR
from ..remote_store.row_chunks import combine_models, combine_pattern

EXPERT_PARALLEL = (2, 4, 8)
HOST_SHARES = (1, 2, 4, 8)
HOST_SHARE_SOURCES = 8  # the source ranks of the EP = 8 rank workload (kernel_bench.EP)
# What a forecast row needs from the one-GPU kernel record (one row per model and precision).
INPUT_COLUMNS = ("model", "precision", "hidden", "intermediate", "block_m", "block_n1",
                 "block_n2", "programs", "waves", "l1_tiles_per_program", "l2_tiles_per_program",
                 "mainloop_l1_us", "mainloop_l2_us", "kernel_wave_us", "kernel_interleaved_us")


def remote_share(expert_parallel: int) -> float:
    """Share of a rank's Combine rows whose source is another rank: (P − 1)/P."""
    if expert_parallel < 2:
        raise ValueError(f"a forecast needs expert parallelism >= 2, got {expert_parallel}")
    return (expert_parallel - 1) / expert_parallel


def tile_orders(l1_tiles: float, l2_tiles: float, waves: int) -> dict[str, list[str]]:
    """One program's tile kinds in the two schedules. Expert-Wave: per wave, its share of the
    Linear-1 tiles, then its Linear-2 tiles back to back. Interleaved: the Linear-1 tiles spread
    evenly between the Linear-2 tiles (Algorithm 1's steady state, n1/n2 Linear-1 per Linear-2,
    which need not be an integer). Fewer Linear-2 tiles than programs (a small batch: an average
    below one) leave most programs none; the program played is one that holds one."""
    if l1_tiles < 0 or l2_tiles <= 0 or waves < 1:
        raise ValueError(f"need Linear-1 tiles >= 0, Linear-2 tiles > 0, waves >= 1; got "
                         f"{l1_tiles}, {l2_tiles}, {waves}")
    n1, n2 = round(l1_tiles), max(round(l2_tiles), 1)
    wave = []
    for w in range(waves):
        wave += ["L1"] * (n1 * (w + 1) // waves - n1 * w // waves)
        wave += ["L2"] * (n2 * (w + 1) // waves - n2 * w // waves)
    interleaved = []
    for j in range(n2):  # the Linear-1 tiles due before Linear-2 tile j
        interleaved += ["L1"] * (n1 * (j + 1) // n2 - n1 * j // n2) + ["L2"]
    return {"wave": wave, "interleaved": interleaved}


def program_stall(kinds: list[str], mainloop_us: dict[str, float], tile_volume: float,
                  t_iss0: float, drain_rate: float, capacity: float) -> float:
    """Issue stall beyond T_iss^0 summed over one program's Linear-2 bursts (µs), from the fluid
    simulator with the SMs' aggregate burst of each Linear-2 tile."""
    bursts = simulator.tile_schedule_bursts(kinds, mainloop_us, {"L1": 0.0, "L2": tile_volume},
                                            {"L1": 1.0, "L2": t_iss0})
    trace = simulator.simulate(bursts, drain_rate, capacity)
    real = trace[trace["volume"] > 0]
    return float((real["t_iss_us"] - t_iss0).clip(lower=0).sum())


def forecast_row(kernel: dict, platform: model.PlatformModel, expert_parallel: int) -> dict:
    """The forecast of one (model, precision) at P = ``expert_parallel``; ``kernel`` has
    ``INPUT_COLUMNS``."""
    return {"model": kernel["model"], "precision": kernel["precision"], "ep": expert_parallel,
            **combine_forecast(kernel, platform, remote_share(expert_parallel))}


def host_share_fraction(host_share: int) -> float:
    """Share of a rank's Combine rows whose buffer is pinned host memory when the buffers of
    ``host_share`` of the EP = 8 source ranks are (the host link's dial, 1..8)."""
    if not 1 <= host_share <= HOST_SHARE_SOURCES:
        raise ValueError(f"host share must be 1..{HOST_SHARE_SOURCES} source ranks, got "
                         f"{host_share}")
    return host_share / HOST_SHARE_SOURCES


def host_forecast_row(kernel: dict, platform: model.PlatformModel, host_share: int) -> dict:
    """The forecast of one cell of the host-link matrix: ``kernel`` (``INPUT_COLUMNS`` and its
    routing and tokens) with the Combine rows of ``host_share`` of the eight source ranks stored
    into host memory over the host link's ``platform``."""
    return {"model": kernel["model"], "precision": kernel["precision"],
            "routing": kernel["routing"], "tokens": int(kernel["tokens"]),
            "host_share": host_share,
            **combine_forecast(kernel, platform, host_share_fraction(host_share))}


def combine_forecast(kernel: dict, platform: model.PlatformModel, share: float) -> dict:
    """What the Burst–Gap model predicts for the Linear-2 Combine bursts of ``kernel``'s cell
    (``INPUT_COLUMNS``) when ``share`` of its Combine rows cross ``platform``'s link (module
    docstring)."""
    missing = [c for c in INPUT_COLUMNS if c not in kernel]
    if missing:
        raise KeyError(f"forecast input lacks {missing}")
    k_act = int(kernel["programs"])
    tile_bytes = kernel["block_m"] * kernel["block_n2"] * 2 * share
    volume = k_act * tile_bytes
    t_l1, t_l2 = float(kernel["mainloop_l1_us"]), float(kernel["mainloop_l2_us"])
    n1 = kernel["intermediate"] // kernel["block_n1"]
    n2 = kernel["hidden"] // kernel["block_n2"]
    rate = platform.drain_rate
    t_iss0 = platform.t_iss0_at(k_act, math.ceil(tile_bytes))
    capacity = platform.capacity_at(k_act)
    g_wave = model.interleaved_gap(t_l2)
    g_int = model.interleaved_gap(t_l2, t_l1, n1, n2)
    row = {"remote_share": share, "burst_volume": volume, "t_iss0_us": t_iss0,
           "g_wave_us": g_wave, "g_int_us": g_int,
           "v_over_r_us": float(model.drain_time(volume, rate))}
    verdict = model.design_test(volume, g_wave, t_iss0, rate, capacity)
    orders = tile_orders(kernel["l1_tiles_per_program"], kernel["l2_tiles_per_program"],
                         int(kernel["waves"]))
    mainloop = {"L1": t_l1, "L2": t_l2}
    stall = {s: program_stall(kinds, mainloop, volume, t_iss0, rate, capacity)
             for s, kinds in orders.items()}
    wave_us = kernel["kernel_wave_us"] + stall["wave"]
    int_us = kernel["kernel_interleaved_us"] + stall["interleaved"]
    bursts = {s: kinds.count("L2") for s, kinds in orders.items()}
    return {**row, "g_star_us": verdict.recovery_gap_us, "action": verdict.action,
            "steady_stall_wave_us": verdict.issue_overhead_us,
            "isolated_issue_us": verdict.isolated_issue_us,
            "condition1_holds": model.interleaving_sufficient(volume, t_iss0, rate, t_l2, t_l1,
                                                              n1, n2),
            "predicted_stall_us": stall["wave"] / bursts["wave"],
            "predicted_stall_int_us": stall["interleaved"] / bursts["interleaved"],
            "predicted_span_us": t_iss0 + stall["wave"] / bursts["wave"],
            "predicted_wave_us": wave_us, "predicted_interleaved_us": int_us,
            "predicted_speedup": wave_us / int_us}


def forecast(kernels: pd.DataFrame, platform: model.PlatformModel,
             expert_parallel=EXPERT_PARALLEL) -> pd.DataFrame:
    """``forecast_row`` for every row of ``kernels`` and every P."""
    return pd.DataFrame([forecast_row(k, platform, p) for k in kernels.to_dict("records")
                         for p in expert_parallel])


# The cells a forecast starts from: the paper's tokens per rank with balanced routing, where every
# rank carries the same load (a skewed cell's load on this rank depends on where its hot experts
# fall).
BASIS = {"routing": "balanced", "tokens": 8192}


def kernel_inputs(table: pd.DataFrame, basis: dict | None = BASIS) -> pd.DataFrame:
    """``INPUT_COLUMNS`` per (model, precision) from a ``moe_kernel`` record's table (its
    traced cells), at ``basis``; with ``basis=None`` every cell, with its routing and tokens."""
    cells = table if basis is None else table[(table["routing"] == basis["routing"])
                                              & (table["tokens"] == basis["tokens"])]
    if cells.empty:
        raise ValueError(f"the moe_kernel record has no {basis} cell")
    tiles = cells["tile_config"].map(lambda v: json.loads(v) if isinstance(v, str) else v)
    out = cells.assign(block_m=tiles.map(lambda t: t["block_m"]),
                       block_n1=tiles.map(lambda t: t["block_n1"]),
                       block_n2=tiles.map(lambda t: t["block_n2"]),
                       programs=cells["num_programs"])
    columns = list(INPUT_COLUMNS) + ([] if basis is not None else ["routing", "tokens"])
    return out[columns].reset_index(drop=True)


def compute_forecast(kernel_platform: str, calibration_platform: str,
                     root: Path = RECORDS_DIR) -> tuple[pd.DataFrame, dict]:
    """The ``moe_forecast`` table of ``kernel_platform`` (whose latest ``moe_kernel`` record of
    each precision gives the per-tile times: ``kernel_view.latest_view``) on
    ``calibration_platform``'s latest calibration, and the parameters its record keeps."""
    from ...loading import latest as latest_record
    from .kernel_view import latest_view
    from ..remote_store.characterization import latest_calibration

    kernel = latest_view(kernel_platform, root)
    if not kernel.records:
        raise FileNotFoundError(f"no 'moe_kernel' record for platform {kernel_platform!r} "
                                f"under {root}")
    cal_record = latest_record("calibration", calibration_platform, root)
    cal = latest_calibration(calibration_platform, root)
    table = forecast(kernel_inputs(kernel.table), cal.platform_model())
    params = {"kernel_records": [f"moe_kernel/{kernel_platform}/{r.record_id}"
                                 for r in kernel.records],
              "calibration_record": f"calibration/{calibration_platform}/{cal_record.record_id}",
              "basis": BASIS, "expert_parallel": list(EXPERT_PARALLEL),
              "method": __doc__.split("\n\n", 1)[1]}
    return table, params


def write_forecast(kernel_platform: str, calibration_platform: str,
                   root: Path = RECORDS_DIR) -> Path:
    """``compute_forecast`` saved as a ``moe_forecast`` record of ``kernel_platform`` under
    ``root``."""
    from ...platform import provenance
    from ...records import write_record

    table, params = compute_forecast(kernel_platform, calibration_platform, root)
    return write_record("moe_forecast", kernel_platform, table, params, provenance(), root)


def combine_platform(platform: model.PlatformModel, patterns: dict, block_n2: int,
                     hidden: int) -> tuple[model.PlatformModel, str]:
    """The model a cell's Combine stores drain by over the host link, and its name: its row
    pattern's (``analysis.remote_store.row_chunks``: C = 2·block_n2 bytes of each 2·hidden-byte
    row) where ``patterns`` holds it, else the calibration's ``platform`` (contiguous bursts)."""
    key = combine_pattern(block_n2, hidden)
    if key in patterns:
        return patterns[key], f"rows {key[0]}/{key[1]}"
    return platform, "contiguous"


def host_forecast(kernels: pd.DataFrame, platform: model.PlatformModel,
                  host_shares=HOST_SHARES, patterns: dict | None = None) -> pd.DataFrame:
    """``host_forecast_row`` for every cell of ``kernels`` and every host share, each cell on its
    Combine pattern's model (``combine_platform``)."""
    rows = []
    for k in kernels.to_dict("records"):
        cell_platform, drain = combine_platform(platform, patterns or {}, k["block_n2"],
                                                k["hidden"])
        rows += [{**host_forecast_row(k, cell_platform, h), "drain_model": drain}
                 for h in host_shares]
    return pd.DataFrame(rows)


def compute_host_forecast(kernel_platform: str, host_platform: str, tokens: int,
                          root: Path = RECORDS_DIR) -> tuple[pd.DataFrame, dict]:
    """The ``moe_host_forecast`` table of ``host_platform`` (a ``-host`` platform): every cell
    of ``kernel_platform``'s latest ``moe_kernel`` records at ``tokens`` per source rank, both
    routings, each host share, on the host link's latest calibration; and its parameters.
    The averaged forecast: ``experiments.moe.host_forecast`` adds the tile-by-tile one beside it
    and writes the record, before the host-link matrix is measured (``moe.host_bench``)."""
    from ...loading import latest as latest_record
    from .kernel_view import latest_view
    from ..remote_store.characterization import latest_calibration

    kernel = latest_view(kernel_platform, root)
    cal_record = latest_record("calibration", host_platform, root)
    patterns, pattern_record = combine_models(host_platform, root)
    cells = kernel_inputs(kernel.table, basis=None)
    table = host_forecast(cells[cells["tokens"] == tokens].reset_index(drop=True),
                          latest_calibration(host_platform, root).platform_model(),
                          patterns=patterns)
    params = {"link": "host",
              "kernel_records": [f"moe_kernel/{kernel_platform}/{r.record_id}"
                                 for r in kernel.records],
              "calibration_record": f"calibration/{host_platform}/{cal_record.record_id}",
              "row_chunk_record": pattern_record,
              "tokens": tokens, "host_shares": list(HOST_SHARES),
              "method": __doc__.split("\n\n", 1)[1] + "\n\nHost link: the remote share is the "
                        "host share h/8 (the Combine buffers of h of the eight source ranks are "
                        "pinned host memory); the calibration is the host link's, and where its "
                        "row_chunks sweep measured a cell's Combine row pattern, R, Q and the "
                        "issue floor are that pattern's (column drain_model)."}
    return table, params


# The columns of a forecast row that ``summary --json`` keeps and the command prints.
SUMMARY_COLUMNS = ("model", "precision", "ep", "remote_share", "g_wave_us", "v_over_r_us",
                   "predicted_stall_us", "predicted_speedup")


def summary_entry(platform: str, root: Path = RECORDS_DIR) -> dict:
    """The ``moe_forecast`` entry of ``summary --json``: the latest forecast's rows."""
    from ...loading import latest as latest_record

    table = latest_record("moe_forecast", platform, root).table
    return {"rows": [{k: (v.item() if hasattr(v, "item") else v) for k, v in r.items()}
                     for r in table[list(SUMMARY_COLUMNS)].round(4).to_dict("records")]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m xstage_lab.analysis.moe.forecast",
                                description="The moe_forecast from the latest moe_kernel records "
                                            "and a calibration (CPU only): printed, or written as "
                                            "a record with --root.")
    p.add_argument("--kernel-platform", default="h200-x1",
                   help="platform whose moe_kernel record gives the per-tile times")
    p.add_argument("--calibration-platform", default="h200-x2",
                   help="platform whose calibration gives T_iss^0, R and Q")
    p.add_argument("--records", type=Path, default=RECORDS_DIR,
                   help="records read (default: the committed data/records)")
    p.add_argument("--root", type=Path, default=None,
                   help="write the record under this records root, reading its records there "
                        "(default: print the forecast, write nothing)")
    a = p.parse_args(argv)
    try:
        if a.root is not None:
            print(f"wrote {write_forecast(a.kernel_platform, a.calibration_platform, a.root)}")
            return
        table, params = compute_forecast(a.kernel_platform, a.calibration_platform, a.records)
    except (FileNotFoundError, ValueError) as e:
        p.exit(2, f"{p.prog}: error: {' '.join(str(e).split())}\n")
    print(f"moe_forecast of {', '.join(params['kernel_records'])} on "
          f"{params['calibration_record']} (not saved; --root DIR writes it):")
    print(table[list(SUMMARY_COLUMNS)].round(4).to_string(index=False))


if __name__ == "__main__":
    main()
