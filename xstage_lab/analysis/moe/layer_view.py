"""The fused MoE layer read on the CPU (issue 27): a platform's ``moe_layer`` cells
(``layer_bench``'s records), each from the router's output to the layer's output, beside the
unfused torch path, today's host-scheduled call and the floors; how each cell stands against the
issue's acceptance; where a call's device time goes; and the ``moe_layer`` entry of ``summary
--json``.

A platform's matrix may be measured in several runs (by model, precision or setting, one device
session each): ``layer_view`` joins every record of the platform's variant (``PLATFORM_VARIANT``:
the layer as it ships, timed as the matrix is; ``platform_rows``), a cell from the newest record
that holds it."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from ...loading import read, record_paths
from . import L1, L2, VARIANT, CellView
from ...records import RECORDS_DIR, Record

# The writer of a call's argument block (kernels/moe_args.py) as a record's per-kernel profile
# (route_kernels_us) names it: launched with the routing kernels, not one of them.
ARGS_WRITER = "write_args"
WEIGHTED_SUM_KERNEL = "weighted_sum"  # kernels/moe_combine.py's, in a call's profile
# call_excess' parts of a graphed call's time beyond the bound's unit, which add up to its
# graph_over_kernel less 1 (window_excess NaN where a record did not profile the boundaries)
CALL_EXCESS = ("kernel_excess", "routing_excess", "weighted_sum_excess", "boundary_excess",
               "window_excess")
CELL = ["model", "precision", "setting", "tokens"]
# The options of layer_bench's runs whose records make a platform's matrix (its defaults): the
# op's default weighted sum, trials from an idle GPU, the tiles the layer's rule picks (no
# ``tile_rows``). A record naming other options (its params' ``VARIANT``; none named: the sum's
# launch, the default before "auto") is an A/B's side, compared by ``compare``, not a cell of the
# matrix, but for the cells where "auto" picks the sum it ran (``auto_weighted_sum``)
PLATFORM_VARIANT = {"weighted_sum": "auto", "graph_start": "idle"}
# ops.moe.op's (a test keeps them equal): "auto" adds in the kernel at EP = 1 up to this many
# tokens, with torch's deterministic algorithms off, as layer_bench runs
AUTO_ATOMIC_TOKENS = 8
SUMMARY_KEYS = ("model", "precision", "setting", "tokens", "fused_eager_us", "fused_graph_us",
                "schedule_us", "host_overhead_us", "kernel_us", "weighted_sum_floor_us",
                "unfused_eager_us", "unfused_graph_us", "host_scheduled_us", "weight_floor_us")
# Issue 27's acceptance, per call: below this many tokens the fused layer may be this much slower
# than the unfused path; the graphed call within this factor of the kernel plus the weighted
# sum's memory time; the schedule kernels and the eager host overhead within these times (the
# schedule at the largest T per rank); the one-token graphed call within
# ``T1_FLOOR_FACTOR * weight_floor + T1_FLOOR_US``.
SMALL_T = 64
SMALL_T_SLOWDOWN = 1.10
GRAPH_OVER_KERNEL = 1.05
SCHEDULE_LIMIT_US = 30.0
SCHEDULE_LIMIT_TOKENS = 8192
HOST_OVERHEAD_LIMIT_US = 30.0
T1_FLOOR_FACTOR, T1_FLOOR_US = 1.5, 10.0
# from this many tokens the kernel over the device tables within this factor of the time (the
# TF/s) of the same kernel over the host-built layout and schedule
KERNEL_PARITY_TOKENS = 4096
KERNEL_PARITY = 1.02


@dataclass(frozen=True)
class LayerView(CellView):
    """One platform's ``moe_layer`` records, oldest first, and their cells."""

    CELL = CELL

    @property
    def sources(self) -> tuple[Record, ...]:
        """The records ``table`` takes a row from (each cell's newest), oldest first: a record
        whose every cell a later one measured again is left out."""
        seen, held = set(), []
        for r in reversed(self.records):
            cells = set(r.table[CELL].itertuples(index=False, name=None))
            if cells - seen:
                held.append(r)
            seen |= cells
        return tuple(reversed(held))


def layer_view(platform: str, root: Path = RECORDS_DIR) -> LayerView:
    """The platform's records of ``PLATFORM_VARIANT``, oldest first, each holding its cells of
    the matrix only (``platform_rows``)."""
    records = tuple(replace(r, table=platform_rows(r))
                    for r in map(read, record_paths("moe_layer", platform, root)))
    records = tuple(r for r in records if len(r.table))
    if not records:
        raise FileNotFoundError(f"no 'moe_layer' record of {PLATFORM_VARIANT} for platform "
                                f"{platform!r} under {root}")
    return LayerView(platform, records)


def auto_weighted_sum(setting: str, tokens: int) -> str:
    """The sum ``weighted_sum="auto"`` runs in a cell as layer_bench measures it: the adds
    (``"atomic"``) at EP = 1 up to ``AUTO_ATOMIC_TOKENS``, else the launch (an EP rank's call
    has no weighted sum: its records name the launch)."""
    return "atomic" if setting == "ep1" and tokens <= AUTO_ATOMIC_TOKENS else "launch"


def platform_rows(record: Record) -> pd.DataFrame:
    """The rows of ``record`` that are cells of its platform's matrix: every row where its run
    had ``PLATFORM_VARIANT``'s options (each it names, ``VARIANT`` of its params, as there); where
    it ran the default's options but another weighted sum, the rows whose cells
    ``auto_weighted_sum`` runs with that sum (a record naming none ran the launch); else none."""
    named = dict(record.params.get(VARIANT) or {})
    summed = named.pop("weighted_sum", "launch")
    t = record.table
    if not all(PLATFORM_VARIANT.get(k) == v for k, v in named.items()):
        return t.iloc[:0]
    if summed == PLATFORM_VARIANT["weighted_sum"]:
        return t
    picks = [auto_weighted_sum(s, n) for s, n in zip(t["setting"], t["tokens"])]
    return t[[p == summed for p in picks]].reset_index(drop=True)


def acceptance(table: pd.DataFrame) -> pd.DataFrame:
    """Per cell, each measure of issue 27's acceptance and whether it holds (``*_ok``):
    ``eager_speedup``/``graph_speedup``, the unfused path's time over the fused layer's (at least
    1 from ``SMALL_T`` tokens, at least 1/``SMALL_T_SLOWDOWN`` below); ``graph_over_kernel``,
    the graphed call over the kernel alone plus the weighted sum's memory time (and by how many
    µs the call exceeds ``GRAPH_OVER_KERNEL`` times that: ``graph_over_kernel_excess_us``,
    negative within it; ``graph_over_kernel_fill_out``: the kernel's time without its counters'
    fill, ``kernel_alone_us``); the schedule kernels' time (``schedule_tables_us``) at
    ``SCHEDULE_LIMIT_TOKENS`` tokens, beside the whole routing's graphed time
    (``schedule_us``); ``host_overhead_us``; at one token the graphed call against
    ``T1_FLOOR_FACTOR`` times the weight-read floor plus ``T1_FLOOR_US``; from
    ``KERNEL_PARITY_TOKENS`` tokens the kernel over the device tables against the same kernel
    over the host-built schedule (``kernel_over_host_kernel``: paired where the record allows)."""
    out = table[CELL].copy()
    small = table["tokens"] < SMALL_T
    need = small.map({True: 1 / SMALL_T_SLOWDOWN, False: 1.0})
    for path in ("eager", "graph"):
        out[f"{path}_speedup"] = table[f"unfused_{path}_us"] / table[f"fused_{path}_us"]
        out[f"{path}_speedup_ok"] = out[f"{path}_speedup"] >= need
    kernel_and_sum = kernel_and_sum_us(table)
    out["graph_over_kernel"] = table["fused_graph_us"] / kernel_and_sum
    out["graph_over_kernel_ok"] = out["graph_over_kernel"] <= GRAPH_OVER_KERNEL
    out["graph_over_kernel_excess_us"] = (table["fused_graph_us"]
                                          - GRAPH_OVER_KERNEL * kernel_and_sum)
    out["graph_over_kernel_fill_out"] = counters_fill_us(table).notna()
    out["schedule_us"] = table["schedule_us"]
    out["schedule_tables_us"] = schedule_tables_us(table)
    out["schedule_ok"] = (table["tokens"] != SCHEDULE_LIMIT_TOKENS) | \
        (out["schedule_tables_us"] <= SCHEDULE_LIMIT_US)
    out["host_overhead_us"] = table["host_overhead_us"]
    out["host_overhead_ok"] = table["host_overhead_us"] <= HOST_OVERHEAD_LIMIT_US
    out["t1_limit_us"] = T1_FLOOR_FACTOR * table["weight_floor_us"] + T1_FLOOR_US
    out["t1_ok"] = (table["tokens"] != 1) | (table["fused_graph_us"] <= out["t1_limit_us"])
    out["kernel_over_host_kernel"] = kernel_over_host_kernel(table)
    out["kernel_parity_ok"] = (table["tokens"] < KERNEL_PARITY_TOKENS) | \
        (out["kernel_over_host_kernel"] <= KERNEL_PARITY)
    return out


def kernel_over_host_kernel(table: pd.DataFrame) -> pd.Series:
    """Per cell, the kernel over the device tables against the same kernel over the host-built
    schedule: the median of their per-trial ratios where the record kept it
    (``kernel_over_host_kernel_paired``: a step in the clocks between trials moves both), else
    the ratio of their medians; NaN (not met) in records from before the host-scheduled kernel
    was timed alone."""
    medians = table["kernel_us"] / table.get("host_scheduled_kernel_us", float("nan"))
    if "kernel_over_host_kernel_paired" not in table:
        return medians
    return table["kernel_over_host_kernel_paired"].fillna(medians)


def kernel_trial_ratios(table: pd.DataFrame) -> pd.DataFrame:
    """Per cell, the least and greatest of the kernel's per-trial times over the host-scheduled
    kernel's in the same trial (``trial_ratio_min``, ``trial_ratio_max``: the pairs whose median
    is ``kernel_over_host_kernel``) and how many trials (``trials``): the trials' own spread
    beside the parity bound; NaN and 0 where a record kept no trials."""
    out = pd.DataFrame({"trial_ratio_min": float("nan"), "trial_ratio_max": float("nan"),
                        "trials": 0}, index=table.index)
    if "kernel_trials_us" not in table:
        return out
    for i, (k, h) in table[["kernel_trials_us", "host_scheduled_kernel_trials_us"]].iterrows():
        if isinstance(k, str) and isinstance(h, str):
            ratios = pd.Series(json.loads(k)) / pd.Series(json.loads(h))
            out.loc[i] = ratios.min(), ratios.max(), len(ratios)
    return out.astype({"trials": int})


def schedule_tables_us(table: pd.DataFrame) -> pd.Series:
    """Per cell, the device time of the schedule kernels: the routing kernels' table passes
    (``route_tables_us``, from the per-kernel profile), without the pass over the activations
    (``route_gather_us``: their FP8 quantization, or in records from before the fused kernel
    gathered its rows, their move into the layout), which is data movement in proportion to the
    tokens, not a schedule; it stays in every end-to-end time. A record from before the
    profile has only the whole routing, graphed (``schedule_us``)."""
    whole = table["schedule_us"]
    return table["route_tables_us"].fillna(whole) if "route_tables_us" in table else whole


def call_profile(table: pd.DataFrame) -> pd.DataFrame:
    """Per cell whose record profiled a whole call (``layer_profile``; none before): the device's
    time between the graphed call's kernels (``call_gaps_us``: its time less the sum of its
    kernels' device times) and the fused kernel's own time in the call over alone
    (``kernel_in_call_over_alone``: above 1, the kernels before it slow it down)."""
    if "call_kernels_us" not in table:
        return table[CELL].iloc[:0].assign(call_gaps_us=[], kernel_in_call_over_alone=[])
    t = table[table["call_kernels_us"].notna()]
    return t[CELL].assign(call_gaps_us=t["fused_graph_us"] - profile_total_us(t["call_kernels_us"]),
                          kernel_in_call_over_alone=t["kernel_in_call_us"]
                          / t["kernel_alone_device_us"])


def call_excess(table: pd.DataFrame) -> pd.DataFrame:
    """Per cell whose record profiled a whole call (``call_profile``'s): the graphed call's time
    beyond the bound's unit, the kernel alone plus the weighted sum's memory time
    (``graph_over_kernel`` of ``acceptance`` less 1), in that unit, split into what adds up to
    it: the fused kernel's device time in the call beyond alone (``kernel_excess``: where it
    ends with the weighted sum, the sum's time in it too), the call's other kernels, the routing
    and at EP = 1 in FP8 its quantization (``routing_excess``), the weighted sum's device time
    beyond its memory time (``weighted_sum_excess``: its own launch's; below zero, the memory
    time, where the kernel summed), the device's time between the call's kernels beyond the
    kernel alone's (``boundary_excess``, ``boundaries_per_call_us``), and the rest of the call's
    timed span beyond the kernel alone's (``window_excess``: where a trial starts from an idle
    GPU, a share of its replay's launch; the events; the timed and profiled runs' difference).
    The kernel
    alone is timed as the call is (``kernel_us``: a replayed graph), so it too has time beyond
    its kernel's device time (its launches and boundaries, the events, and where
    ``counters_fill_us`` is unknown its counters' fill); only the call's beyond that count.
    Where a record did not profile the boundaries, ``boundary_excess`` holds the whole of it
    and ``window_excess`` is NaN.
    Device times are profiled in a run of their own, beside the timed one (``layer_profile``):
    a part below zero is the two runs' difference."""
    p = call_profile(table)
    if p.empty:
        return p[CELL].assign(**{c: [] for c in ("graph_over_kernel", *CALL_EXCESS)})
    t = table.loc[p.index]
    unit = kernel_and_sum_us(t)
    summed = profile_kernel_us(t["call_kernels_us"], WEIGHTED_SUM_KERNEL).fillna(0.0)
    kernels = t["fused_graph_us"] - p["call_gaps_us"]
    beyond_alone = p["call_gaps_us"] - (kernel_alone_us(t) - t["kernel_alone_device_us"])
    b = boundaries_per_call_us(t)
    between = (b["call_between_us"] - b["alone_between_us"]).reindex(t.index)
    return p[CELL].assign(
        graph_over_kernel=t["fused_graph_us"] / unit,
        kernel_excess=(t["kernel_in_call_us"] - t["kernel_alone_device_us"]) / unit,
        routing_excess=(kernels - t["kernel_in_call_us"] - summed) / unit,
        weighted_sum_excess=(summed - t["weighted_sum_floor_us"]) / unit,
        boundary_excess=between.fillna(beyond_alone) / unit,
        window_excess=(beyond_alone - between) / unit)


def boundaries_per_call_us(table: pd.DataFrame) -> pd.DataFrame:
    """Per cell whose record measured the device's time between kernels (``layer_profile``'s
    ``call_boundaries_us``, ``alone_boundaries_us``; none before): per call, the medians of the
    call's pairs of consecutive kernels summed (each pair once a call, from one call to the next
    included: ``call_between_us``), and the kernel alone's, its counters' fill then the kernel,
    less the time from the fill into the kernel where profiled, as the bound's unit has it
    (``alone_between_us``: ``kernel_alone_us``)."""
    if "call_boundaries_us" not in table:
        return table[CELL].iloc[:0].assign(call_between_us=[], alone_between_us=[])
    t = table[table["call_boundaries_us"].notna()]
    into_kernel = (t["alone_fill_boundary_us"].fillna(0.0) if "alone_fill_boundary_us" in t
                   else 0.0)
    return t[CELL].assign(call_between_us=profile_total_us(t["call_boundaries_us"]),
                          alone_between_us=profile_total_us(t["alone_boundaries_us"])
                          - into_kernel)


def kernel_and_sum_us(table: pd.DataFrame) -> pd.Series:
    """Per cell, the kernel alone plus the weighted sum's memory time: what the graphed call is
    held against (``GRAPH_OVER_KERNEL`` times it). The kernel alone is the fused kernel without
    the sum, also where the call's kernel ends with it (``weighted_sum_in_kernel``: an A/B's
    side): the sum's time in the kernel beyond its memory time is the call's, not the bound's."""
    return kernel_alone_us(table) + table["weighted_sum_floor_us"]


def kernel_alone_us(table: pd.DataFrame) -> pd.Series:
    """Per cell, the fused kernel alone: its timed graph (``kernel_us``: the row counters' fill,
    then the kernel, per call) less the fill (``counters_fill_us``), which a call's routing
    does; ``kernel_us`` itself where the record did not profile the fill."""
    return table["kernel_us"] - counters_fill_us(table).fillna(0.0)


def counters_fill_us(table: pd.DataFrame) -> pd.Series:
    """Per cell, the time per call the kernel alone's timed graph spends on its row counters'
    fill: the fill's device time and the device's time from it into the kernel
    (``layer_profile``'s ``alone_fill_us``, ``alone_fill_boundary_us``); NaN in records from
    before them. The time from the kernel to the next fill stays: it stands for the time from
    one kernel to the next."""
    if "alone_fill_us" not in table:
        return pd.Series(float("nan"), index=table.index)
    return table["alone_fill_us"] + table["alone_fill_boundary_us"]


def profile_kernel_us(profiles: pd.Series, name: str) -> pd.Series:
    """Per cell, the device time of kernel ``name`` in a per-kernel profile (a JSON column of
    ``layer_profile``'s), NaN where the profile has no such kernel."""
    return profiles.map(lambda k: json.loads(k).get(name, float("nan"))).astype(float)


def profile_total_us(profiles: pd.Series) -> pd.Series:
    """Per cell, the times of a per-kernel profile (a JSON column of ``layer_profile``'s:
    ``route_kernels_us``, ``call_kernels_us``, the boundaries') summed, as floats (a record's
    JSON column reads back as strings, which ``map`` keeps); NaN where a cell has no profile."""
    return profiles.map(lambda k: sum(json.loads(k).values()) if isinstance(k, str)
                        else float("nan")).astype(float)


def acceptance_counts(table: pd.DataFrame) -> dict:
    """How many cells meet each measure of ``acceptance``, out of the cells it applies to."""
    a = acceptance(table)
    at_t = {"schedule_ok": a["tokens"] == SCHEDULE_LIMIT_TOKENS, "t1_ok": a["tokens"] == 1,
            "kernel_parity_ok": a["tokens"] >= KERNEL_PARITY_TOKENS}
    return {k: (int(a.loc[at_t.get(k, slice(None)), k].sum()),
                int(at_t[k].sum()) if k in at_t else len(a))
            for k in a.columns if k.endswith("_ok")}


def summary_entry(table: pd.DataFrame) -> dict:
    """The ``moe_layer`` entry of ``summary --json``: one row per cell, ``SUMMARY_KEYS``."""
    return {"rows": [{k: (r[k].item() if hasattr(r[k], "item") else r[k]) for k in SUMMARY_KEYS}
                     for r in table.to_dict("records")]}


def kernel_phases(tiles: pd.DataFrame, l1_tile_bytes: int, l2_tile_bytes: int) -> dict:
    """Where one launch's kernel time goes, from its per-tile stamps (``trace.tile_frame``):
    per tile kind the tiles and the SMs that ran them, the median mainloop and the weight bytes
    a tile streams over it (``*_tile_gbps``: one SM's stream rate, beside the HBM's); the last
    Linear-1 tile's end, the first Linear-2 mainloop's start, the median Linear-2 wait for its
    rows and the makespan (µs from the launch's first tile entry). Around the mainloops: the
    last program's first tile entry (``trace_entry_us``: the programs' start spread), the
    median Linear-1 wait from a tile's entry to its first weights (``trace_l1_wait_us``) and
    epilogue (``trace_l1_epilogue_us``), and the makespan past the last Linear-2 mainloop's end
    (``trace_l2_tail_us``: the epilogues, the split sums). ``trace_`` columns of ``moe_layer``
    at one token."""
    out = {}
    for name, kind, nbytes in (("l1", L1, l1_tile_bytes), ("l2", L2, l2_tile_bytes)):
        k = tiles[tiles["kind"] == kind]
        mainloop = float(k["mainloop_us"].median())
        out.update({f"trace_{name}_tiles": len(k), f"trace_{name}_sms": int(k["smid"].nunique()),
                    f"trace_{name}_mainloop_us": mainloop,
                    f"trace_{name}_tile_gbps": nbytes / (mainloop * 1e-6) / 1e9})
    l1, l2 = tiles[tiles["kind"] == L1], tiles[tiles["kind"] == L2]
    out.update({"trace_l1_end_us": float(l1["t3_us"].max()),
                "trace_l2_start_us": float(l2["t1_us"].min()),
                "trace_l2_wait_us": float(l2["wait_us"].median()),
                "trace_makespan_us": float(tiles["t3_us"].max()),
                "trace_entry_us": float(tiles.groupby("program")["t0_us"].min().max()),
                "trace_l1_wait_us": float(l1["wait_us"].median()),
                "trace_l1_epilogue_us": float((l1["t3_us"] - l1["t2_us"]).median()),
                "trace_l2_tail_us": float(tiles["t3_us"].max() - l2["t2_us"].max())})
    return out
