"""Per-tile instrumentation of the fused MoE kernel (paper §5.2.2–5.2.3, Figs. 9–10, Table 2).

The instrumented kernel (``INSTRUMENT`` in ``kernels/moe_fused.py``) stamps four points of every
tile with ``%clock64`` and ``%globaltimer``: entry (0), dependency satisfied (1), mainloop end =
epilogue start (2), epilogue end = every store issued (3). From them, per tile:

* ``wait_us`` (0 -> 1): the Linear-2 acquire-spin on the row counter; time a Linear-2 tile is
  starved of its Linear-1 inputs (Condition 2, eq. 16). Zero for Linear-1.
* ``mainloop_us`` (1 -> 2): the tile's MMA mainloop, T^mma.
* ``span_us`` (2 -> 3): the epilogue. For a Linear-2 tile this is the sender-visible remote-store
  span T_RS of its Combine burst.

Adaptation to a kernel that is not warp-specialized (ours; the paper's MegaMoE has separate MMA and
epilogue roles with double-buffered accumulator staging). Here the warps that issued a tile's
Combine stores run the successor tile's mainloop themselves; there is no staging slot to wait for.
Backpressure reaches the compute critical path in two ways: a longer T_RS (issue stalls), and a
longer successor mainloop (its loads queue behind the SM's outstanding remote stores). So:

* the cover window T_cover of a Linear-2 tile is the *uninflated* mainloop time of its successor's
  kind (Linear-1 or Linear-2): the median mainloop of that kind in the local-store control (Combine
  stores redirected to local HBM, same schedule), where no remote store is outstanding;
* the eq. 15 prediction per tile is Δt = [T_RS − T_cover]_+ (``model.critical_path_stall``);
* the measured per-tile stall is the successor's mainloop inflation, successor mainloop − T_cover:
  what the drain of this tile's stores cost the next tile's Tensor-Core work;
* the excess of T_RS over the local-store span floor is reported beside it (``span_excess_us``).

Durations come from ``%clock64`` (one SM's cycles; a program never leaves its SM) over the SM
clock that the trace itself gives (cycles over ``%globaltimer`` ns across each program's whole
run); time-line positions from ``%globaltimer``, common to the SMs of one GPU.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...model import critical_path_stall
from . import L1, L2, geometric_mean

class TraceError(ValueError):
    """A trace that cannot be analysed (a tile the kernel skipped or never stamped)."""


def trace_clock_mhz(trace: np.ndarray, counts: np.ndarray) -> float:
    """The SM clock over the launch: per program, clock64 cycles over %globaltimer ns from its
    first tile's entry to its last tile's end; the median over programs (in MHz)."""
    ratios = []
    for g, c in enumerate(counts):
        if c == 0:
            continue
        cycles = trace[g, c - 1, 3] - trace[g, 0, 0]
        ns = trace[g, c - 1, 7] - trace[g, 0, 4]
        if ns > 0:
            ratios.append(cycles / ns * 1e3)
    if not ratios:
        raise TraceError("no program ran long enough to measure the SM clock")
    return float(np.median(ratios))


def tile_frame(trace: np.ndarray, table: np.ndarray, counts: np.ndarray,
               clock_mhz: float | None = None) -> pd.DataFrame:
    """One row per executed tile: program, position, kind, expert, row_block, n_block, smid,
    spins, ``wait_us``, ``mainloop_us``, ``span_us`` (clock64), ``t0_us``..``t3_us`` (globaltimer,
    from the launch's first entry), and the successor's ``next_kind`` / ``next_mainloop_us`` in the
    same program (-1 / NaN for a program's last tile). Raises TraceError on an unstamped tile."""
    trace = np.asarray(trace, dtype=np.int64)
    counts = np.asarray(counts)
    clock_mhz = trace_clock_mhz(trace, counts) if clock_mhz is None else clock_mhz
    frames = []
    for g, c in enumerate(counts):
        if c == 0:
            continue
        rec = trace[g, :c]
        stamps = rec[:, :8]
        if (stamps < 0).any():
            bad = int(np.argwhere((stamps < 0).any(axis=1))[0, 0])
            raise TraceError(f"program {g} tile {bad} was not stamped (skipped after a spin "
                             "timeout?)")
        f = pd.DataFrame({"program": g, "position": np.arange(c),
                          "kind": table[g, :c, 0], "expert": table[g, :c, 1],
                          "row_block": table[g, :c, 2], "n_block": table[g, :c, 3],
                          "smid": rec[:, 8], "spins": np.where(table[g, :c, 0] == L2, rec[:, 9], 0)})
        for name, a, b in (("wait_us", 0, 1), ("mainloop_us", 1, 2), ("span_us", 2, 3)):
            f[name] = (rec[:, b] - rec[:, a]) / clock_mhz
        for p in range(4):
            f[f"gt{p}"] = rec[:, 4 + p]
        f["next_kind"] = np.append(f["kind"].to_numpy()[1:], -1)
        f["next_mainloop_us"] = np.append(f["mainloop_us"].to_numpy()[1:], np.nan)
        frames.append(f)
    out = pd.concat(frames, ignore_index=True)
    origin = out["gt0"].min()
    for p in range(4):
        out[f"t{p}_us"] = (out.pop(f"gt{p}") - origin) / 1e3
    out.attrs["clock_mhz"] = clock_mhz
    return out


def mainloop_floor(local: pd.DataFrame) -> dict[int, float]:
    """T_cover per tile kind: the median mainloop of Linear-1 and Linear-2 tiles in the
    local-store control (no remote store outstanding)."""
    return {kind: float(local.loc[local["kind"] == kind, "mainloop_us"].median())
            for kind in (L1, L2)}


def linear2_stalls(tiles: pd.DataFrame, local: pd.DataFrame) -> pd.DataFrame:
    """Linear-2 tiles that have a successor, with ``cover_us`` (T_cover of the successor's kind,
    from the local control), ``stall_pred_us`` = [T_RS − T_cover]_+ (eq. 15), ``stall_meas_us`` =
    successor mainloop − T_cover (its inflation) and ``span_excess_us`` = T_RS − the local
    control's median Linear-2 span."""
    floor = mainloop_floor(local)
    span_floor = float(local.loc[local["kind"] == L2, "span_us"].median())
    l2 = tiles[(tiles["kind"] == L2) & (tiles["next_kind"] >= 0)].copy()
    l2["cover_us"] = l2["next_kind"].map(floor).astype(float)
    l2["stall_pred_us"] = critical_path_stall(l2["span_us"].to_numpy(), l2["cover_us"].to_numpy())
    l2["stall_meas_us"] = l2["next_mainloop_us"] - l2["cover_us"]
    l2["span_excess_us"] = l2["span_us"] - span_floor
    return l2


def run_stats(tiles: pd.DataFrame, local: pd.DataFrame | None = None) -> dict:
    """Medians (and p25/p75 of T_RS) of one instrumented launch over all its tiles; with the
    local control of the same schedule, also the eq. 15 prediction and the measured stall."""
    l1, l2 = tiles[tiles["kind"] == L1], tiles[tiles["kind"] == L2]
    stats = {"tiles_l1": len(l1), "tiles_l2": len(l2), "clock_mhz": tiles.attrs.get("clock_mhz"),
             "span_l2_us": _median(l2["span_us"]),
             "span_l2_p25_us": _pct(l2["span_us"], 25), "span_l2_p75_us": _pct(l2["span_us"], 75),
             "span_l2_p90_us": _pct(l2["span_us"], 90),
             "mainloop_l1_us": _median(l1["mainloop_us"]), "mainloop_l2_us": _median(l2["mainloop_us"]),
             "epilogue_l1_us": _median(l1["span_us"]),
             "wait_l2_median_us": _median(l2["wait_us"]), "wait_l2_mean_us": _mean(l2["wait_us"]),
             "wait_l2_share": float(l2["wait_us"].sum() / max(1e-9, (tiles["t3_us"] - tiles["t0_us"]).sum())),
             "spins_l2_max": int(l2["spins"].max()) if len(l2) else 0,
             "makespan_us": float(tiles["t3_us"].max()),
             "programs": int(tiles["program"].nunique())}
    # Totals over the launch's programs: where the SMs' time went (regression causes).
    for name, kind, col in COMPONENTS:
        stats[f"{name}_total_us"] = float(tiles.loc[tiles["kind"] == kind, col].sum())
    stats["busy_total_us"] = float((tiles["t3_us"] - tiles["t0_us"]).sum())
    if local is not None:
        s = linear2_stalls(tiles, local)
        stats.update({"stall_pred_us": _median(s["stall_pred_us"]),
                      "stall_meas_us": _median(s["stall_meas_us"]),
                      "span_excess_us": _median(s["span_excess_us"]),
                      "cover_l1_us": mainloop_floor(local)[L1],
                      "cover_l2_us": mainloop_floor(local)[L2]})
    return stats


# (name, tile kind, column): the parts of a tile's time that the stamps separate
COMPONENTS = (("wait_l2", L2, "wait_us"), ("mainloop_l1", L1, "mainloop_us"),
              ("mainloop_l2", L2, "mainloop_us"), ("epilogue_l1", L1, "span_us"),
              ("span_l2", L2, "span_us"))


def regression_cause(wave: dict, interleaved: dict) -> dict:
    """Where Interleaved spends more SM time than Expert-Wave: per component of ``COMPONENTS``
    (dependency wait = starvation, mainloops = Tensor-Core work incl. cache/locality effects,
    epilogues = store issue), Interleaved's total minus Expert-Wave's, per SM; the cause is the
    component with the largest increase ("none" where no component grows). From two
    ``run_stats`` of the same configuration."""
    per_sm = {name: (interleaved[f"{name}_total_us"] - wave[f"{name}_total_us"]) / wave["programs"]
              for name, _, _ in COMPONENTS}
    worst = max(per_sm, key=per_sm.get)
    return {"delta_per_sm_us": per_sm, "cause": worst if per_sm[worst] > 0 else "none",
            "makespan_ratio": wave["makespan_us"] / interleaved["makespan_us"]}


def tensor_core_activity(tiles: pd.DataFrame, bins: int = 200,
                         programs: int | None = None) -> dict[str, list[float]]:
    """The Fig. 9 equivalent: over ``bins`` equal time bins of the launch, the fraction of programs
    (one per SM) inside a Linear-1 or a Linear-2 mainloop (stamps 1 -> 2), from %globaltimer."""
    programs = int(tiles["program"].nunique()) if programs is None else programs
    end = float(tiles["t3_us"].max())
    edges = np.linspace(0.0, end, bins + 1)
    out = {"t_us": list((edges[:-1] + edges[1:]) / 2)}
    for name, kind in (("l1", L1), ("l2", L2)):
        sel = tiles[tiles["kind"] == kind]
        busy = np.zeros(bins)
        starts, stops = sel["t1_us"].to_numpy(), sel["t2_us"].to_numpy()
        for i in range(0, len(starts), 4096):  # bounded memory: tiles x bins per slice
            lo = np.maximum(starts[i:i + 4096, None], edges[None, :-1])
            hi = np.minimum(stops[i:i + 4096, None], edges[None, 1:])
            busy += np.clip(hi - lo, 0.0, None).sum(axis=0)
        out[name] = list(busy / (np.diff(edges) * programs))
    return out


def sample_tiles(frame: pd.DataFrame, limit: int, seed: int = 0) -> pd.DataFrame:
    """At most ``limit`` rows, drawn without replacement (seeded), in their original order."""
    if len(frame) <= limit:
        return frame
    keep = np.sort(np.random.default_rng(seed).choice(len(frame), limit, replace=False))
    return frame.iloc[keep]


def table2_row(model: str, wave: dict, interleaved: dict) -> dict:
    """One Table 2 row from the ``run_stats`` of the remote runs of both schedules (each with its
    local control). T^mma entries are the local-control (uninflated) mainloop medians of the
    Expert-Wave run: the cover windows that eq. 15 uses."""
    return {"model": model,
            "span_wave_us": wave["span_l2_us"], "span_int_us": interleaved["span_l2_us"],
            "mma_l2_us": wave["cover_l2_us"], "mma_l1_us": wave["cover_l1_us"],
            "stall_pred_wave_us": wave["stall_pred_us"], "stall_meas_wave_us": wave["stall_meas_us"],
            "stall_pred_int_us": interleaved["stall_pred_us"],
            "stall_meas_int_us": interleaved["stall_meas_us"]}


def _median(s) -> float:
    return float(np.median(s)) if len(s) else float("nan")


def _mean(s) -> float:
    return float(np.mean(s)) if len(s) else float("nan")


def _pct(s, q) -> float:
    return float(np.percentile(s, q)) if len(s) else float("nan")


def condition1(t_l2_mma: float, t_l1_mma: float, *, hidden: int, intermediate: int, block_m: int,
               block_n1: int, block_n2: int, programs: int, platform) -> dict:
    """Condition 1 (eqs. 12–14) of one configuration, from its uninflated mainloop times and the
    calibrated platform (``model.PlatformModel``). A Linear-2 tile's Combine burst is
    V_t = block_m·block_n2·2 bytes (bf16 rows); under Expert-Wave all ``programs`` SMs run Linear-2
    tiles back to back, so K_act = programs and V = K_act·V_t. Per scheduler row there are
    n1 = intermediate/block_n1 Linear-1 and n2 = hidden/block_n2 Linear-2 tiles, the steady-state
    mix of Algorithm 1. Returns both gaps (eq. 12), V/R, the issue overheads (eq. 4 for
    Expert-Wave, eq. 13 for Interleaved) and whether eq. 14 holds."""
    from ... import model

    v_t = block_m * block_n2 * 2
    volume = programs * v_t
    n1, n2 = intermediate // block_n1, hidden // block_n2
    t_iss0 = platform.t_iss0_at(programs, v_t)
    rate = platform.drain_rate
    g_wave = model.interleaved_gap(t_l2_mma)
    g_int = model.interleaved_gap(t_l2_mma, t_l1_mma, n1, n2)
    d_wave = float(model.issue_overhead(g_wave, volume, t_iss0, rate))
    return {"K_act": programs, "V_t_bytes": v_t, "n1": n1, "n2": n2, "t_iss0_us": t_iss0,
            "V_over_R_us": float(model.drain_time(volume, rate)), "G_wave_us": g_wave,
            "G_int_us": g_int, "G_star_us": float(model.recovery_gap(volume, t_iss0, rate)),
            "dT_iss_wave_us": d_wave, "dT_iss_int_us": max(0.0, d_wave - n1 / n2 * t_l1_mma),
            "condition1_holds": model.interleaving_sufficient(volume, t_iss0, rate, t_l2_mma,
                                                              t_l1_mma, n1, n2)}


def condition1_rows(table: pd.DataFrame, platform) -> list[dict]:
    """Condition 1 for every model of a ``moe_trace`` record with a local-store control of the
    Expert-Wave schedule (its mainloop medians are the uninflated T^mma), beside the measured
    remote spans of both schedules."""
    traces = table[table["kind"] == "trace"]
    out = []
    for m, runs in traces.groupby("model", sort=False):
        by = {(r["schedule"], r["path"]): r for r in runs.to_dict("records")}
        if ("wave", "local") not in by:
            continue
        local = by[("wave", "local")]
        tiles = _json(local["tile_config"])
        row = {"model": m, "T_l2_mma_us": local["mainloop_l2_us"], "T_l1_mma_us": local["mainloop_l1_us"],
               **condition1(local["mainloop_l2_us"], local["mainloop_l1_us"],
                            hidden=int(local["hidden"]), intermediate=int(local["intermediate"]),
                            block_m=tiles["block_m"], block_n1=tiles["block_n1"],
                            block_n2=tiles["block_n2"], programs=int(local["num_programs"]),
                            platform=platform)}
        for s in ("wave", "interleaved"):
            if (s, "remote") in by:
                row[f"span_{s}_us"] = by[(s, "remote")]["span_l2_us"]
        out.append({k: _round(v) for k, v in row.items()})
    return out


def design_verdicts(table: pd.DataFrame, platform) -> list[dict]:
    """The design test (eq. 10) of every configuration and schedule of a ``moe_trace`` record
    traced with remote stores and with the local-store control, on the kernel's own numbers,
    beside what was measured. The burst is the aligned worst case of ``condition1``
    (V = K_act·V_t, all programs' Linear-2 Combine stores at once); the gap is that schedule's
    uninflated successor mainloop from its local control, T_L2^mma under Expert-Wave and eq. 12's
    T_L2^mma + (n1/n2)·T_L1^mma under Interleaved. Measured: the median Linear-2 T_RS with remote
    stores and in the control, their difference (``excess_us``), and the control's T_RS IQR as
    the tolerance of ``model.verdict_agrees``; ``successor_inflation_us`` is the other route of
    backpressure in this kernel (the successor mainloop's median inflation, ``linear2_stalls``)."""
    from ... import model

    traces = table[table["kind"] == "trace"]
    out = []
    for key, runs in traces.groupby(list(KEYS), sort=False):
        by = {(r["schedule"], r["path"]): r for r in runs.to_dict("records")}
        for schedule in ("wave", "interleaved"):
            if not {(schedule, "local"), (schedule, "remote")} <= by.keys():
                continue
            local, remote = by[(schedule, "local")], by[(schedule, "remote")]
            tiles = _json(local["tile_config"])
            c = condition1(local["mainloop_l2_us"], local["mainloop_l1_us"],
                           hidden=int(local["hidden"]), intermediate=int(local["intermediate"]),
                           block_m=tiles["block_m"], block_n1=tiles["block_n1"],
                           block_n2=tiles["block_n2"], programs=int(local["num_programs"]),
                           platform=platform)
            volume = c["K_act"] * c["V_t_bytes"]
            gap = c["G_wave_us"] if schedule == "wave" else c["G_int_us"]
            verdict = model.design_test(volume, gap, c["t_iss0_us"], platform.drain_rate,
                                        platform.capacity_at(c["K_act"]))
            excess = remote["span_l2_us"] - local["span_l2_us"]
            tolerance = local["span_l2_p75_us"] - local["span_l2_p25_us"]
            row = {**dict(zip(KEYS, key)), "schedule": schedule, "K_act": c["K_act"],
                   "burst_volume": volume, "t_iss0_us": c["t_iss0_us"], "gap_us": gap,
                   "V_over_R_us": c["V_over_R_us"], "g_star_us": verdict.recovery_gap_us,
                   "rate_bound": verdict.rate_bound, "capacity_bound": verdict.capacity_bound,
                   "action": verdict.action, "dT_iss_pred_us": verdict.issue_overhead_us,
                   "t_rs_remote_us": remote["span_l2_us"], "t_rs_local_us": local["span_l2_us"],
                   "excess_us": excess, "tolerance_us": tolerance,
                   "successor_inflation_us": remote.get("stall_meas_us", np.nan),
                   "agrees": "yes" if model.verdict_agrees(verdict.action, excess, tolerance)
                   else "no"}
            out.append({k: _round(v) for k, v in row.items()})
    return out


def _json(v):
    import json
    return json.loads(v) if isinstance(v, str) else v


# ------------------------------------------------------------------- from a ``moe_trace`` record

def latest_trace_table(platform: str, root) -> pd.DataFrame | None:
    """The table of the platform's latest ``moe_trace`` record, or None where there is none."""
    from ...loading import latest as latest_record
    try:
        return latest_record("moe_trace", platform, root).table
    except FileNotFoundError:
        return None


def table2(table: pd.DataFrame) -> list[dict]:
    """Table 2 rows (``table2_row``) of every model whose remote trace rows carry the eq. 15
    quantities (i.e. had a local-store control), in record order."""
    remote = table[(table["kind"] == "trace") & (table["path"] == "remote")]
    out = []
    for model, runs in remote.groupby("model", sort=False):
        by = {r["schedule"]: r for r in runs.to_dict("records")}
        if {"wave", "interleaved"} <= by.keys() and not np.isnan(by["wave"].get("stall_pred_us", np.nan)):
            out.append({k: _round(v) for k, v in table2_row(model, by["wave"], by["interleaved"]).items()})
    return out


FENCED_KEYS = ("model", "precision", "routing", "tokens", "wave_us", "interleaved_us",
               "wave_fenced_us", "interleaved_fenced_us")


def counterfactual_rows(table: pd.DataFrame) -> list[dict]:
    """Per configuration, the measured decoupled (``wave_us``, ``interleaved_us``) and
    completion-coupled (``*_fenced_us``: each Linear-2 tile waits until its stores are visible)
    times of one run."""
    fenced = table[table["kind"] == "fenced"]
    return [{k: _round(row[k]) for k in FENCED_KEYS} for row in fenced.to_dict("records")]


KEYS = ("model", "precision", "routing", "tokens")


def l2_tiles_per_sm(table: pd.DataFrame) -> dict[tuple, float]:
    """Per (configuration, schedule) traced with remote stores, the critical rank's Linear-2
    tiles per program (SM): what a per-launch time difference is divided by to give it per tile."""
    remote = table[(table["kind"] == "trace") & (table["path"] == "remote")]
    return {(*(r[k] for k in KEYS), r["schedule"]): r["tiles_l2"] / r["programs"]
            for r in remote.to_dict("records")}


def traced_causes(table: pd.DataFrame) -> list[dict]:
    """``regression_cause`` of every configuration traced under both schedules with remote stores
    (``trace`` rows), beside both schedules' Linear-2 dependency-wait shares and Tensor-Core
    occupancy (``mma_busy``: the SMs' summed mainloop time over programs x makespan, the mean of
    the Fig. 9 curve): where Interleaved's SM time goes relative to Expert-Wave, for gains and
    losses alike."""
    remote = table[(table["kind"] == "trace") & (table["path"] == "remote")]
    out = []
    for key, runs in remote.groupby(list(KEYS), sort=False):
        by = {r["schedule"]: r for r in runs.to_dict("records")}
        if {"wave", "interleaved"} <= by.keys():
            row = {**dict(zip(KEYS, key)), **regression_cause(by["wave"], by["interleaved"])}
            for s, r in (("wave", by["wave"]), ("int", by["interleaved"])):
                row[f"wait_share_{s}"] = r["wait_l2_share"]
                row[f"mma_busy_{s}"] = ((r["mainloop_l1_total_us"] + r["mainloop_l2_total_us"])
                                        / (r["programs"] * r["makespan_us"]))
            out.append(row)
    return out


MATRIX_ROW_KEYS = ("model", "precision", "routing", "tokens", "wave_us", "interleaved_us",
                   "unfused_us", "speedup")


def headline_numbers(matrix: pd.DataFrame) -> dict:
    """Speedup statistics of a ``moe`` record's table, with its per-configuration rows."""
    speedup = matrix["speedup"].to_numpy(float)
    fused = (matrix["unfused_us"] / matrix[["wave_us", "interleaved_us"]].min(axis=1)).to_numpy(float)
    return {"configs": len(matrix),
            "geomean_speedup": round(geometric_mean(speedup), 4),
            "median_speedup": round(float(np.median(speedup)), 4),
            "max_speedup": round(float(speedup.max()), 4),
            "min_speedup": round(float(speedup.min()), 4),
            "fused_vs_unfused_geomean": round(geometric_mean(fused), 4),
            "per_config": matrix[list(MATRIX_ROW_KEYS)].to_dict("records")}


def regression_rows(matrix: pd.DataFrame, table: pd.DataFrame) -> list[dict]:
    """Every matrix cell with speedup < 1, worst first, with its measured cause where a trace of
    that very cell exists (a ``regression`` row, else a ``trace`` pair: ``traced_causes``): the
    traced launch's makespan ratio (< 1 where it shows the loss itself) and the cell's own
    dependency-wait shares. An untraced cell is "not traced", with proxies instead: the causes of
    the same model's traced regressing cells (``model_traced_regressions``, "none" where there are
    none) and the dependency-wait shares of the model's traced shape. For every cell, the speedup's
    range over the trials' quartiles (wave p25/interleaved p75 .. wave p75/interleaved p25) and the
    model's D sweep at this cell's lead D and at the sweep's best D."""
    exact = {tuple(r[k] for k in KEYS): r for r in traced_causes(table)}
    exact |= {tuple(r[k] for k in KEYS): {**r, "delta_per_sm_us": _json(r["delta_per_sm_us"]),
                                          "wait_share_wave": _json(r["wave"])["wait_l2_share"],
                                          "wait_share_int": _json(r["interleaved"])["wait_l2_share"]}
              for r in table[table["kind"] == "regression"].to_dict("records")}
    by_model = {r["model"]: r for r in traced_causes(table)}
    sweep = table[table["kind"] == "d_sweep"]
    cells = matrix[matrix["speedup"] < 1].sort_values("speedup").to_dict("records")
    traced_regressions = [k for k in (tuple(c[k] for k in KEYS) for c in cells) if k in exact]
    out = []
    for cell in cells:
        key = tuple(cell[k] for k in KEYS)
        row = {**dict(zip(KEYS, key)), "matrix_speedup": cell["speedup"]}
        spread = _json(cell.get("spreads"))
        if isinstance(spread, dict):
            w, i = spread["wave"], spread["interleaved"]
            row["speedup_lo"] = w["p25_us"] / i["p75_us"]
            row["speedup_hi"] = w["p75_us"] / i["p25_us"]
        for k in ("experts_per_wave", "wave_starts", "lead_rows", "d_knee"):
            if k in cell:
                row[k] = cell[k]
        cause = exact.get(key)
        row["cause"] = cause["cause"] if cause else "not traced"
        if cause:
            row["makespan_ratio"] = cause["makespan_ratio"]
            row |= {f"Δ{k} (µs/SM)": v for k, v in cause["delta_per_sm_us"].items()}
            row["wait_share_wave"] = cause["wait_share_wave"]
            row["wait_share_int"] = cause["wait_share_int"]
        else:  # proxies: the same model's traced regressing cells and its traced shape
            row["model_traced_regressions"] = "; ".join(
                f"{'/'.join(str(v) for v in k[1:])}: {exact[k]['cause']}"
                for k in traced_regressions if k[0] == cell["model"]) or "none"
            proxy = by_model.get(cell["model"])
            if proxy:
                row["traced_shape"] = "/".join(str(proxy[k]) for k in KEYS[1:])
                row["traced_wait_share_wave"] = proxy["wait_share_wave"]
                row["traced_wait_share_int"] = proxy["wait_share_int"]
        d = sweep[sweep["model"] == cell["model"]]
        if len(d) and "lead_rows" in cell:
            at = d[d["lead_rows"] == cell["lead_rows"]]
            best = d.loc[d["speedup"].idxmax()]
            row["dsweep_speedup_at_lead"] = float(at["speedup"].iloc[0]) if len(at) else np.nan
            row["dsweep_best_speedup"] = float(best["speedup"])
            row["dsweep_best_d_factor"] = float(best["d_factor"])
        out.append({k: _round(v) for k, v in row.items()})
    return out


def regression_groups(rows: list[dict]) -> list[dict]:
    """``regression_rows`` grouped by cause ("not traced" is a group), worst group first: the
    number of cells, their models, the range of the matrix speedup and, for traced groups, how
    many traced launches show the loss (``traces_with_loss``: makespan ratio < 1), the range of
    their makespan ratio and of each component's Interleaved-minus-Expert-Wave SM time."""
    if not rows:  # no regressing cell: no group (an empty frame has no "cause" column)
        return []
    df = pd.DataFrame(rows)
    out = []
    for cause, g in df.groupby("cause", sort=False):
        row = {"cause": cause, "cells": len(g), "models": ", ".join(g["model"].unique()),
               "speedup_min": g["matrix_speedup"].min(), "speedup_max": g["matrix_speedup"].max()}
        if cause != "not traced":
            row["traces_with_loss"] = int((g["makespan_ratio"] < 1).sum())
            row["makespan_ratio_min"] = g["makespan_ratio"].min()
            row["makespan_ratio_max"] = g["makespan_ratio"].max()
            for name, _, _ in COMPONENTS:
                col = g[f"Δ{name} (µs/SM)"]
                row[f"Δ{name} min..max (µs/SM)"] = f"{col.min():+.0f}..{col.max():+.0f}"
        out.append({k: _round(v) for k, v in row.items()})
    return out


def summary_table2(platform: str, root) -> list[dict]:
    table = latest_trace_table(platform, root)
    return [] if table is None else table2(table)


def summary_counterfactual(platform: str, root) -> list[dict]:
    table = latest_trace_table(platform, root)
    return [] if table is None else counterfactual_rows(table)


def _round(v):
    v = v.item() if hasattr(v, "item") else v
    return round(v, 4) if isinstance(v, float) else v


def knee_sweep_rows(table: pd.DataFrame, platform) -> list[dict]:
    """The knee sweep of a ``moe_trace`` record (a SYNTHETIC kernel: a fraction ``k_fraction`` of
    every mainloop's K blocks, every Combine store kept) beside the Burst–Gap model on the
    calibrated ``platform`` (``model.PlatformModel``). Per row: the gap between Expert-Wave's
    Linear-2 bursts, G_wave = the local control's Linear-2 mainloop; the aggregate remote burst
    V = K_act · block_m · block_n2 · 2 B · (P − 1)/P (the rows whose source is a peer); V/R, G*
    (eq. 5); the predicted span T_iss^0 + [V/R − G − T_iss^0]_+ (eqs. 3–4, steady state) and the
    isolated burst's (eq. 7); the measured Expert-Wave spans with remote and local stores, their
    difference, and Interleaved's speedup."""
    from ... import model

    out = []
    for r in table[table["kind"] == "knee_sweep"].to_dict("records"):
        tiles = _json(r["tile_config"])
        world, k_act = int(r["world_size"]), int(r["num_programs"])
        tile_bytes = tiles["block_m"] * tiles["block_n2"] * 2 * (world - 1) / world
        volume, rate = k_act * tile_bytes, platform.drain_rate
        t_iss0 = platform.t_iss0_at(k_act, int(np.ceil(tile_bytes)))
        gap = float(r["mainloop_l2_us"])
        row = {**{k: r[k] for k in KEYS}, "k_fraction": r["k_fraction"], "g_wave_us": gap,
               "v_over_r_us": float(model.drain_time(volume, rate)),
               "g_star_us": float(model.recovery_gap(volume, t_iss0, rate)),
               "span_pred_us": float(model.issue_time(gap, volume, t_iss0, rate)),
               "span_pred_isolated_us": float(model.isolated_issue_time(
                   volume, t_iss0, platform.capacity_at(k_act), rate)),
               "span_remote_us": r["span_l2_remote_us"], "span_local_us": r["span_l2_local_us"],
               "excess_us": r["span_l2_remote_us"] - r["span_l2_local_us"],
               "speedup": r["speedup"]}
        out.append({k: _round(v) for k, v in row.items()})
    return out


# ------------------------------------------- tables of a ``moe_trace`` record (notebook 03, prose)

def regressions_table(matrix: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """Each regressing matrix cell with its measured cause (``regression_rows``): Interleaved
    minus Expert-Wave SM time per component (µs per SM) where the cell was traced, "not traced"
    otherwise, with the measured proxies beside it."""
    return pd.DataFrame(regression_rows(matrix, table)).round(3)


def regression_groups_table(matrix: pd.DataFrame, table: pd.DataFrame) -> pd.DataFrame:
    """The regressing cells grouped by measured cause ("not traced" is a group), with counts,
    models and the ranges of speedup and per-component SM time (``regression_groups``)."""
    return pd.DataFrame(regression_groups(regression_rows(matrix, table))).round(3)


def traced_causes_table(table: pd.DataFrame) -> pd.DataFrame:
    """Per traced configuration, Interleaved minus Expert-Wave SM time per component (µs per SM),
    the makespan ratio and both schedules' Linear-2 dependency-wait shares: where the gain or the
    loss comes from (``traced_causes``)."""
    rows = [{**{k: v for k, v in r.items() if k != "delta_per_sm_us"},
             **{f"Δ{k} (µs/SM)": v for k, v in r["delta_per_sm_us"].items()}}
            for r in traced_causes(table)]
    return pd.DataFrame(rows).round(3)


def counterfactual_table(table: pd.DataFrame) -> pd.DataFrame:
    """Decoupled (Expert-Wave, Interleaved) and completion-coupled (each Linear-2 tile fenced
    until its stores are visible) times per configuration, measured in one run."""
    df = pd.DataFrame(counterfactual_rows(table))
    df["coupled_over_decoupled_wave"] = df["wave_fenced_us"] / df["wave_us"]
    df["coupled_over_decoupled_int"] = df["interleaved_fenced_us"] / df["interleaved_us"]
    # the added time per Linear-2 tile of one SM of the critical rank (its traced launch)
    per_sm = l2_tiles_per_sm(table)
    for s, sched in (("wave", "wave"), ("int", "interleaved")):
        tiles = [per_sm.get((*(r[k] for k in KEYS), sched), np.nan) for r in df.to_dict("records")]
        df[f"fence_us_per_l2_tile_{s}"] = (df[f"{sched}_fenced_us"] - df[f"{sched}_us"]) / tiles
    return df.round(3)


def condition1_table(table: pd.DataFrame, platform) -> pd.DataFrame:
    """Condition 1 (eqs. 12–14) per traced configuration from the calibrated ``platform``
    (``model.PlatformModel``) and the local-control mainloops, beside the measured spans
    (``condition1_rows``)."""
    return pd.DataFrame(condition1_rows(table, platform))
