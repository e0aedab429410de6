"""The X-Stage-fused attention epilogue as measured per tile (``trace_bench``), held
against the design test (eq. 10) and the CPU simulator.

Per output tile the trace gives the Q-loop and the epilogue span (the tile's stores issued; T_RS
of §5.2 for this kernel) in two launches of one instrumented build: Fused, whose tiles owned by
another rank go through NVLink, and the local control, the same code storing on this GPU (§3.1).
Backpressure shows as Fused's epilogue outlasting the control's on the remote tiles.

The burst the design test needs is the kernel's own: a wave of the grid (one tile per resident
program) ends its Q-loops nearly together, and its remote tiles form one aggregate burst of
V = (remote tiles of the wave)·b_m·d·2 bytes. The programs do not end exactly together: in the
control, most of a wave's tiles start their epilogues within half a microsecond and a few start
microseconds later. The burst's backpressure-free issue time is therefore read from its measured
arrival curve: each remote tile issuing its bytes over its control epilogue from its control
start, played through the fluid queue with no capacity limit, reaches a peak outstanding volume
q_peak; the uniform burst with that peak (eq. 6) has T_iss = (V − q_peak)/R, and eq. 10's
capacity bound reads q_peak ≤ Q. (A p5–p95 spread of the starts as T_iss reads a clustered
wave with a few late tiles as if it were spread out.) The first wave starts aligned; later waves
inherit the drift of the earlier Q-loops. Each is tested on its own, and the simulator
(``simulator.simulate_producers``) plays the control's measured epilogue starts through the fluid
queue at the calibrated Q for the per-tile stall it predicts.
What the first wave meets also depends on the launch before it (the bench's ``--repeat-build``;
``first_wave_by_launch_order``).
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd

from ... import model
from ...simulator import simulate_producers

LIST_COLUMNS = ("entry_ns", "q_loop_ns", "epilogue_ns", "smid")
WAVE_CLASSES = ("first", "later")  # the grid's first wave (starts aligned), every later one


def _values(v):
    return json.loads(v) if isinstance(v, str) else v


def trace_geometry(record) -> tuple[int, int]:
    """(rows per trace row, trace rows resident at once) of an ``fa_trace`` record: b_m and the
    programs of the grid's first wave for the Triton kernel; b_m/2 and two per program (its two
    consumer warpgroups) for gluon_ws. Records from before ``trace_block_m`` are the Triton's."""
    cfg = record.params["config"]
    block_m = int(record.params["params"].get("trace_block_m", cfg["BLOCK_M"]))
    programs = record.provenance["gpus"][0]["sm_count"] * cfg["ctas_per_sm"]
    return block_m, programs * cfg["BLOCK_M"] // block_m


def tile_table(record) -> pd.DataFrame:
    """One row per trace row (``trace_geometry``: an output tile, or a half tile) of an
    ``fa_trace`` record: M, rank, build, launch, tile, times (µs: entry, epilogue start and end
    from the launch's first entry, Q-loop, epilogue), SM id, whether its rows belong to another
    rank (``remote``), and its grid wave (tile // resident trace rows)."""
    cfg = record.params["config"]
    bm, programs = trace_geometry(record)
    if cfg["persistent"]:
        raise ValueError("waves are defined for the one-program-per-tile grid; this record "
                         "traced a persistent one")
    # one frame for every trace row: each list column concatenated, each row's scalars repeated
    # over its tiles (a frame per row, concatenated, took three times as long)
    table = record.table
    if table.empty:
        raise ValueError("an fa_trace record without rows has no tiles")
    lists = {c: [np.asarray(_values(v), dtype=np.int64) for v in table[c]] for c in LIST_COLUMNS}
    tiles = np.array([len(v) for v in lists["entry_ns"]])
    cols = {c: np.concatenate(v) for c, v in lists.items()}

    def each(column, dtype=np.int64):
        return np.repeat(table[column].to_numpy().astype(dtype), tiles)

    M, P, rank = each("M"), each("P"), each("rank")
    tile = np.concatenate([np.arange(n) for n in tiles])
    owner = (tile % (M // bm)) * bm // (M // P)
    entry = cols["entry_ns"] / 1e3
    q_loop, epilogue = cols["q_loop_ns"] / 1e3, cols["epilogue_ns"] / 1e3
    out = pd.DataFrame(dict(
        M=M, P=P, head_dim=each("head_dim"), rank=rank, build=each("build", object),
        launch=each("launch"), tile=tile, entry_us=entry, epilogue_start_us=entry + q_loop,
        epilogue_end_us=entry + q_loop + epilogue, q_loop_us=q_loop, epilogue_us=epilogue,
        smid=cols["smid"], remote=owner != rank, wave=tile // programs))
    out["wave_class"] = np.where(out["wave"] == 0, *WAVE_CLASSES)
    return out


def _iqr(x) -> float:
    lo, hi = np.percentile(x, [25, 75])
    return float(hi - lo)


def epilogue_excess(tiles: pd.DataFrame) -> pd.DataFrame:
    """Per M, wave class and rank (``remote_tiles``: Fused's remote tiles over all its traced
    launches): the remote tiles' median epilogue in Fused and in the control,
    Fused's p90 and maximum, the excess (Fused − control; positive: backpressure at issue) of
    the means (``excess_us``) and of the medians, the control's IQR (the tile-to-
    tile spread with nothing outstanding, the tolerance of ``model.verdict_agrees``), the same
    excess on the local tiles (no NVLink traffic: a check of the comparison), and the median
    Q-loop inflation of the tiles that follow (Fused − control, all tiles: local staging).
    A wave class with no remote tile on a rank has no row: nothing of it crosses NVLink (with
    tiles numbered m blocks first, a wave of a one-tile-per-CTA grid can lie wholly inside the
    rank's own rows)."""
    rows = []
    for (M, wave_class, rank), g in tiles.groupby(["M", "wave_class", "rank"]):
        fused, control = g[g["build"] == "fused"], g[g["build"] == "control"]
        if not fused["remote"].any():
            continue
        remote = {b: t.loc[t["remote"], "epilogue_us"] for b, t in (("fused", fused),
                                                                    ("control", control))}
        local = {b: t.loc[~t["remote"], "epilogue_us"] for b, t in (("fused", fused),
                                                                    ("control", control))}
        row = dict(M=M, wave_class=wave_class, rank=rank, remote_tiles=int(fused["remote"].sum()),
                   epilogue_fused_us=float(remote["fused"].median()),
                   epilogue_control_us=float(remote["control"].median()),
                   tolerance_us=_iqr(remote["control"]),
                   q_loop_fused_us=float(fused["q_loop_us"].median()),
                   q_loop_control_us=float(control["q_loop_us"].median()))
        row["epilogue_fused_p90_us"] = float(remote["fused"].quantile(0.9))
        row["epilogue_fused_max_us"] = float(remote["fused"].max())
        row["excess_median_us"] = row["epilogue_fused_us"] - row["epilogue_control_us"]
        # the mean carries the tail of stalled tiles, which the median hides; a stalled tile
        # holds its SM slot, so the mean is the excess the launch pays
        row["excess_us"] = float(remote["fused"].mean() - remote["control"].mean())
        row["local_excess_us"] = (float(local["fused"].median() - local["control"].median())
                                  if len(local["fused"]) else np.nan)
        row["q_loop_inflation_us"] = row["q_loop_fused_us"] - row["q_loop_control_us"]
        rows.append(row)
    return pd.DataFrame(rows)


def arrival_peak(start_us, epilogue_us, tile_bytes: float, drain_rate: float) -> float:
    """The peak outstanding volume (bytes) of remote tiles that each issue ``tile_bytes`` over
    their epilogue from their start, into a queue draining at R with no capacity limit: eq. 6's
    [V − R·T_iss]_+ for the measured arrival curve instead of a uniform burst."""
    sim = simulate_producers(start_us, np.full(len(start_us), float(tile_bytes)), epilogue_us,
                             drain_rate, np.inf)
    return float(sim["q_end_bytes"].max())


def wave_bursts(tiles: pd.DataFrame, tile_bytes, drain_rate: float) -> pd.DataFrame:
    """Per M, wave class and rank, from the control launches (no backpressure): each wave's
    remote volume V (bytes), the spread of its remote tiles' epilogue starts (p5 to p95, µs),
    their arrival curve's peak outstanding volume at R (``arrival_peak``, bytes), and the gap
    before the programs' next epilogue (the median Q-loop, which the next tile of each program
    runs); the medians over the waves and launches. ``tile_bytes(M, head_dim)`` = b_m·d·2."""
    control = tiles[(tiles["build"] == "control") & tiles["remote"]]
    rows = []
    for (M, d, wave_class, rank, launch, wave), g in control.groupby(
            ["M", "head_dim", "wave_class", "rank", "launch", "wave"]):
        start, volume = g["epilogue_start_us"].to_numpy(), len(g) * tile_bytes(M, d)
        peak = arrival_peak(start, g["epilogue_us"].to_numpy(), tile_bytes(M, d), drain_rate)
        rows.append(dict(
            M=M, wave_class=wave_class, rank=rank, wave=wave, tiles=len(g), burst_volume=volume,
            sms=g["smid"].nunique(),
            spread_us=float(np.percentile(start, 95) - np.percentile(start, 5)),
            arrival_peak_bytes=peak,
            epilogue_us=float(g["epilogue_us"].median()),
            q_loop_us=float(g["q_loop_us"].median())))
    return pd.DataFrame(rows).groupby(["M", "wave_class", "rank"]).agg(
        waves=("wave", "nunique"), burst_volume=("burst_volume", "median"),
        sms=("sms", "median"), spread_us=("spread_us", "median"),
        arrival_peak_bytes=("arrival_peak_bytes", "median"),
        epilogue_us=("epilogue_us", "median"), gap_us=("q_loop_us", "median")).reset_index()


def design_verdicts(tiles: pd.DataFrame, excess: pd.DataFrame, platform, block_m: int,
                    programs: int) -> pd.DataFrame:
    """The design test (eq. 10) per M, wave class and rank on the measured burst
    (``wave_bursts``): issue time (V − q_peak)/R, the uniform burst of the median volume V with
    the median arrival-curve peak q_peak (eq. 6; the capacity bound then tests that peak; each
    wave's peak is below its volume, so the medians keep the issue time positive), gap the
    Q-loop, Q(K) at K = resident programs; the issue overhead (eq. 4) and, for one burst from
    empty, the stall beyond the issue time (eq. 7); beside the measured excess and its tolerance
    (``excess``: ``epilogue_excess(tiles)``) and whether they agree (``model.verdict_agrees``)."""
    both = wave_bursts(tiles, lambda M, d: model.tile_burst_bytes(block_m, d),
                       platform.drain_rate).merge(
        excess[["M", "wave_class", "rank", "excess_us", "tolerance_us"]],
        on=["M", "wave_class", "rank"])
    capacity = platform.capacity_at(programs)
    rows = []
    for b in both.to_dict("records"):
        b["issue_us"] = float(model.drain_time(b["burst_volume"] - b["arrival_peak_bytes"],
                                               platform.drain_rate))
        verdict = model.design_test(b["burst_volume"], b["gap_us"], b["issue_us"],
                                    platform.drain_rate, capacity)
        rows.append({**b, "capacity_bytes": capacity,
                     "V_over_R_us": float(model.drain_time(b["burst_volume"], platform.drain_rate)),
                     "peak_outstanding_bytes": verdict.peak_outstanding_bytes,
                     "rate_bound": verdict.rate_bound, "capacity_bound": verdict.capacity_bound,
                     "action": verdict.action, "dT_iss_pred_us": verdict.issue_overhead_us,
                     "isolated_stall_pred_us": verdict.isolated_issue_us - b["issue_us"],
                     "agrees": "yes" if model.verdict_agrees(verdict.action, b["excess_us"],
                                                             b["tolerance_us"]) else "no"})
    return pd.DataFrame(rows)


def simulated_stalls(tiles: pd.DataFrame, platform, block_m: int, programs: int) -> pd.DataFrame:
    """The simulator on the measured schedule: per control launch, every remote tile a burst of
    b_m·d·2 bytes starting at its measured epilogue start, its backpressure-free issue time its
    measured control epilogue, through one fluid queue (R, Q(K) at K = resident programs). Per M
    and wave class: the mean predicted stall per remote tile beside the measured mean excess per
    remote tile (Fused − control epilogue of the same tile, averaged over launches)."""
    control = tiles[(tiles["build"] == "control") & tiles["remote"]]
    predicted = []
    for _, launch in control.groupby(["M", "rank", "launch"]):
        sim = simulate_producers(launch["epilogue_start_us"].to_numpy(),
                                 np.full(len(launch), float(model.tile_burst_bytes(
                                     block_m, int(launch["head_dim"].iloc[0])))),
                                 launch["epilogue_us"].to_numpy(), platform.drain_rate,
                                 platform.capacity_at(programs))
        predicted.append(launch[["M", "rank", "tile", "wave_class"]].assign(
            stall_pred_us=sim["stall_us"].to_numpy()))
    predicted = pd.concat(predicted).groupby(["M", "rank", "tile", "wave_class"])[
        "stall_pred_us"].mean()
    per_tile = tiles[tiles["remote"]].groupby(["M", "rank", "tile", "wave_class", "build"])[
        "epilogue_us"].mean().unstack("build")
    both = pd.DataFrame({"stall_pred_us": predicted,
                         "excess_us": per_tile["fused"] - per_tile["control"]}).reset_index()
    return both.groupby(["M", "wave_class"]).agg(
        remote_tiles=("tile", "size"), stall_pred_mean_us=("stall_pred_us", "mean"),
        excess_mean_us=("excess_us", "mean"),
        stall_pred_total_us=("stall_pred_us", "sum"),
        excess_total_us=("excess_us", "sum")).reset_index()


def record_verdicts(record) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """``tile_table``, ``epilogue_excess``, ``design_verdicts`` and ``simulated_stalls`` of an
    ``fa_trace`` record on its platform's latest calibration, each table built once."""
    from ..remote_store.characterization import latest_calibration

    block_m, programs = trace_geometry(record)
    platform = latest_calibration(record.platform, record.path.parents[2]).platform_model()
    tiles = tile_table(record)
    excess = epilogue_excess(tiles)
    return (tiles, excess, design_verdicts(tiles, excess, platform, block_m, programs),
            simulated_stalls(tiles, platform, block_m, programs))


def first_wave_by_launch_order(records) -> pd.DataFrame:
    """Per ``fa_trace`` record and M, the first wave's remote tiles on the rank that sends the
    most in it: the mean excess and Fused's maximum epilogue, with what each traced launch
    followed (``repeat_build``: an untraced launch of the same build; ``prime_copy``: the
    remote-store All-to-All to the same addresses; else the other build)."""
    rows = []
    for record in records:
        e = epilogue_excess(tile_table(record))
        first = e[e["wave_class"] == "first"].sort_values("remote_tiles").groupby("M").tail(1)
        params = record.params["params"]
        after = ("the same build" if params.get("repeat_build")
                 else "the remote-store copy to the same addresses" if params.get("prime_copy")
                 else "the other build")
        rows += [dict(record=record.record_id, traced_launch_follows=after, M=r["M"],
                      rank=r["rank"], remote_tiles=r["remote_tiles"], excess_us=r["excess_us"],
                      epilogue_fused_max_us=r["epilogue_fused_max_us"],
                      local_excess_us=r["local_excess_us"])
                 for r in first.sort_values("M").to_dict("records")]
    return pd.DataFrame(rows)


def latest_replayed_trace(platform: str, root=None):
    """The platform's latest ``fa_trace`` record traced with ``--repeat-build``, each launch after
    one of itself: the state of the Table 3 replays, which ``record_verdicts`` is read in."""
    from ...records import RECORDS_DIR
    from ...loading import record_paths as list_records, read as read_record

    for path in reversed(list_records("fa_trace", platform, root or RECORDS_DIR)):
        record = read_record(path)
        if record.params["params"].get("repeat_build"):
            return record
    raise FileNotFoundError(f"no fa_trace record of {platform} traced with --repeat-build")
