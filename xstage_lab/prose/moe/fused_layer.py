"""The fused MoE layer from the router's output (``moe_layer``, issue 27): how each platform's
cells stand against the issue's acceptance, and where a call's time goes."""
from __future__ import annotations

import json

import pandas as pd

from ...analysis.moe.layer_view import (ARGS_WRITER, HOST_OVERHEAD_LIMIT_US, KERNEL_PARITY,
                                        KERNEL_PARITY_TOKENS, SCHEDULE_LIMIT_TOKENS,
                                        SCHEDULE_LIMIT_US, SMALL_T, WEIGHTED_SUM_KERNEL,
                                        acceptance, acceptance_counts, boundaries_per_call_us,
                                        call_excess, call_profile, counters_fill_us,
                                        kernel_and_sum_us, kernel_trial_ratios, profile_kernel_us,
                                        profile_total_us, schedule_tables_us)
from .. import Prose, count, count_span, plural, rec, span, val, words


def sources(view) -> str:
    """The records a layer view's cells come from (``LayerView.sources``), and how many earlier
    records of the view hold only cells measured again since."""
    held = view.sources
    later = len(view.records) - len(held)
    return (f"{count(len(held))} {plural(len(held), 'record')}, "
            f"{', '.join(rec(r) for r in held)}"
            + (f"; {count(later)} earlier {plural(later, 'record')} "
               f"{plural(later, 'holds', 'hold')} only cells measured again since" if later
               else ""))


# the words of a setting in a sentence
SETTING_WORDS = {"ep1": "at EP = 1", "ep8_rank": "on the EP = 8 rank"}


def excess_parts(cells: pd.DataFrame) -> str:
    """Of ``cells``' graphed calls beyond the bound's unit, where their records profiled them
    (``layer_view.call_excess``), each part in µs, its median per setting; "" where none was
    profiled."""
    excess = call_excess(cells)
    if excess.empty:
        return ""
    us = excess[["setting"]].assign(
        **{c: excess[c] * kernel_and_sum_us(cells.loc[excess.index])
           for c in ("routing_excess", "weighted_sum_excess", "boundary_excess",
                     "window_excess")})
    medians = us.groupby("setting").median()

    def per_setting(column, settings=tuple(medians.index)):
        return " and ".join(f"{val(medians.loc[s, column], '.1f')} µs {SETTING_WORDS[s]}"
                            for s in settings)
    summed = [s for s in medians.index if s == "ep1"]  # an EP rank sums nothing
    # where the records profiled the boundaries, the call's timed span beyond them is a part
    windowed = tuple(medians["window_excess"].dropna().index)
    return (f"; of their time beyond the kernel plus the weighted sum's memory time "
            f"({count(len(excess))} profiled {plural(len(excess), 'call')}, medians), the "
            f"routing kernels take {per_setting('routing_excess')}"
            + (f", the weighted sum beyond its memory time "
               f"{per_setting('weighted_sum_excess', summed)}" if summed else "")
            + f"{',' if windowed else ', and'} the time between kernels beyond the kernel "
            f"alone's {per_setting('boundary_excess')}" + measured_boundaries(cells)
            + (f", and the rest of the call's timed span beyond the kernel alone's (where a "
               f"trial starts from an idle GPU, a share of its replay's launch; the events; the "
               f"timed and profiled runs' difference) {per_setting('window_excess', windowed)}"
               if windowed else ""))


def measured_boundaries(cells: pd.DataFrame) -> str:
    """Where ``cells``' records measured the device's time between kernels
    (``layer_view.boundaries_per_call_us``): per call, the call's against the kernel alone's
    (their medians per setting); "" where none did."""
    between = boundaries_per_call_us(cells)
    if between.empty:
        return ""
    medians = between.groupby("setting")[["call_between_us", "alone_between_us"]].median()
    return (" (measured in graphed calls, the device's time between a call's kernels "
            + "; ".join(f"{val(m.call_between_us, '.1f')} µs a call against the kernel alone's "
                        f"{val(m.alone_between_us, '.1f')} µs {SETTING_WORDS[s]}"
                        for s, m in medians.iterrows())
            + f", medians over {count(len(between))} {plural(len(between), 'cell')})")


def layer(layer_views) -> Prose:
    """The fused layer from the router's output (``moe_layer``, issue 27): against the unfused
    torch path, and how many cells meet each measure of the issue's acceptance, with where the
    schedule's and the host's time go."""
    out = []
    for v in layer_views:
        t, a = v.table, acceptance(v.table)
        n = acceptance_counts(t)
        big = a[a["tokens"] >= SMALL_T]
        at_limit = t[t["tokens"] == SCHEDULE_LIMIT_TOKENS]

        def met(key):
            return f"{count(n[key][0])} of {count(n[key][1])}"

        def measured(frame, column):
            return column in frame and frame[column].notna().all() and len(frame)
        tables = schedule_tables_us(at_limit)
        schedule = (f"at {SCHEDULE_LIMIT_TOKENS} tokens the routing kernels take "
                    f"{span(at_limit['schedule_us'], '.0f')} µs graphed" if len(at_limit)
                    else f"no cell at {SCHEDULE_LIMIT_TOKENS} tokens")
        if measured(at_limit, "route_gather_us"):
            schedule += (f": the pass over the activations (bytes in proportion to the "
                         f"tokens) {span(at_limit['route_gather_us'], '.0f')} µs, and the "
                         f"schedule kernels, the table passes, {span(tables, '.0f')} µs")
        if len(at_limit):
            schedule += (f" (the issue asks for at most {SCHEDULE_LIMIT_US:.0f} µs of schedule "
                         f"kernels: {met('schedule_ok')} cells"
                         f"{schedule_misses(at_limit, tables, a['schedule_ok'])})")
        host = (f"an eager call's host time is {span(t['host_overhead_us'], '.0f')} µs (at most "
                f"{HOST_OVERHEAD_LIMIT_US:.0f} asked: {met('host_overhead_ok')} cells"
                f"{host_misses(t, a['host_overhead_ok'])})")
        # records from before the single calls were kept lack them
        calls = t[t["host_first_call_us"].notna()] if "host_first_call_us" in t else t.iloc[:0]
        if len(calls):
            host += (f"; in the {count(len(calls))} cells that keep single calls, a run's first "
                     f"call, the host back from waiting for the device, takes "
                     f"{span(calls['host_first_call_us'], '.0f')} µs and the median call "
                     f"{span(calls['host_call_median_us'], '.0f')} µs")
        if measured(t, "host_launch_floor_us"):
            host += (f"; one bare kernel launch costs this machine's host "
                     f"{span(t['host_launch_floor_us'], '.0f')} µs, measured in the same runs")
            kernels = t["route_kernels_us"].map(json.loads)
            passes = kernels.map(lambda k: len(set(k) - {ARGS_WRITER}))
            # records from before the first routing kernel wrote the argument block have the
            # writer's launch
            writer = kernels.map(lambda k: ARGS_WRITER in k)
            if _graph_launched(t) and (writer.all() or not writer.any()):
                ep1, ep8 = (t[t["setting"] == s]["host_overhead_us"] for s in ("ep1", "ep8_rank"))
                parts = ([f"EP = 1: {span(ep1, '.0f')} µs"] if len(ep1) else []) + (
                    [f"the EP = 8 rank workload, the graph of its receive buffers: "
                     f"{span(ep8, '.0f')} µs"] if len(ep8) else [])
                one = one_routing_kernel(passes)
                routing = ("routing kernel" if one
                           else f"{count_span(passes)} routing kernels")
                first, node = ((f"the writer of its argument block, its {routing}",
                                "the writer's")
                               if writer.all() else
                               (f"its {routing} ({'which writes' if one else 'the first writing'}"
                                f" its argument block)", f"{first_routing_kernel(passes)}'s"))
                host += (f". An eager call launches one CUDA graph of {first}, the fused kernel "
                         f"and, at EP = 1, the weighted sum, in two driver calls: {node} node "
                         f"given the call's addresses, then the graph's launch"
                         + (f" ({'; '.join(parts)})" if parts else ""))
            elif writer.all():
                ep1, ep8 = (t[t["setting"] == s]["host_overhead_us"] for s in ("ep1", "ep8_rank"))
                host += (f". At EP = 1 an eager call launches the writer of its argument block, "
                         f"then replays one CUDA graph of its {count_span(passes)} routing "
                         f"kernels, the fused kernel and the weighted sum"
                         + (f" ({span(ep1, '.0f')} µs)" if len(ep1) else "")
                         + "; the EP = 8 rank workload launches the writer, the routing kernels "
                         "and the fused kernel one by one"
                         + (f" ({span(ep8, '.0f')} µs)" if len(ep8) else ""))
            else:
                host += (f", and a call launches {count_span(passes)} routing kernels, the fused "
                         f"kernel and, at EP = 1, the weighted sum")
        # records before the eager call's steps were timed alone lack them
        timed = t["host_replay_us"].notna() if "host_replay_us" in t else False
        steps = t[(t["setting"] == "ep1") & timed]
        if len(steps):
            args, replay = (("the addresses gathered", "the graph launched with them")
                            if _graph_launched(steps) else
                            ("the argument block's write", "the graph's replay"))
            more = "".join(f", {name} {span(steps[col], '.0f')} µs" for col, name in
                           (("host_output_us", "the output's allocation"),
                            ("host_capturing_us", "the stream's capture state"))
                           if col in steps and steps[col].notna().all())
            host += (f"; each step of an EP = 1 eager call timed alone: the inputs' check "
                     f"{span(steps['host_check_us'], '.0f')} µs{more}, {args} "
                     f"{span(steps['host_args_us'], '.0f')} µs, {replay} "
                     f"{span(steps['host_replay_us'], '.0f')} µs ({count(len(steps))} cells)")
            # the node given the addresses: the writer's in records that profiled it
            profiles = (steps["route_kernels_us"].dropna().map(json.loads)
                        if "route_kernels_us" in steps else pd.Series(dtype=object))
            node = (f"{first_routing_kernel(profiles.map(len))}'s" if len(profiles) and
                    not profiles.map(lambda k: ARGS_WRITER in k).any() else "the writer's")
            if measured(steps, "host_graph_launch_us"):
                host += (f"; of the launch, {node} node given the addresses takes "
                         f"{span(steps['host_set_addresses_us'], '.0f')} µs and the graph's "
                         f"launch {span(steps['host_graph_launch_us'], '.0f')} µs")
            if measured(steps, "host_graph_launch_kernel_us"):
                host += (f" (a graph of the call's first launches alone: the routing kernels "
                         f"{span(steps['host_graph_launch_route_us'], '.0f')} "
                         f"µs, with the fused kernel "
                         f"{span(steps['host_graph_launch_kernel_us'], '.0f')} µs)")
        if measured(t, "host_floor_graph8_queued_us"):
            busy = t["host_floor_graph8_busy_us"].dropna() if "host_floor_graph8_busy_us" in t \
                else ()
            host += (f"; on the same hosts a graph of eight one-element kernels launches in "
                     f"{span(t['host_floor_graph8_idle_us'], '.0f')} µs with the GPU idle and "
                     f"{span(t['host_floor_graph8_queued_us'], '.0f')} µs behind a long kernel"
                     + (f" ({span(busy, '.0f')} µs behind device copies that keep HBM busy as "
                        f"long)" if len(busy) else "")
                     + f", and one bare torch kernel launch behind the long kernel takes "
                     f"{span(t['host_floor_kernel_queued_us'], '.0f')} µs")
        one = t[t["tokens"] == 1]
        t1 = ""
        if measured(one, "route_kernels_us"):
            # the weighted sum as a call runs it comes next, from the call's profile: graphed
            # alone (weighted_sum_us) a one-token sum took 2.2-6.2x its device time in the call
            # (every one-token EP = 1 cell of moe_layer h100-80gb-hbm3-x1 and h200-x1)
            routing = profile_total_us(one["route_kernels_us"])
            t1 = (f" Where a one-token call's time goes: the kernel takes "
                  f"{span(one['kernel_us'] / one['weight_floor_us'], '.1f')}× the weight-read "
                  f"floor ({span(one['kernel_us'], '.0f')} µs against "
                  f"{span(one['weight_floor_us'], '.0f')} µs), the routing kernels "
                  f"{span(routing, '.0f')} µs (profiled).")
        profiled = call_profile(one)
        if len(profiled):
            summed = profile_kernel_us(
                one.loc[profiled.index].query("setting == 'ep1'")["call_kernels_us"],
                WEIGHTED_SUM_KERNEL).dropna()
            t1 += (f" Profiled in a whole call ({count(len(profiled))} "
                   f"{plural(len(profiled), 'cell')}), the fused kernel "
                   f"takes {span(profiled['kernel_in_call_over_alone'], '.2f')}× its device "
                   f"time alone"
                   + (f", the weighted sum's kernel {span(summed, '.1f')} µs at EP = 1"
                      if len(summed) else "")
                   + f", and the graphed call's time less its kernels' device times (the "
                   f"launches and the boundaries between them) is "
                   f"{span(profiled['call_gaps_us'], '.0f')} µs.")
        if measured(one, "trace_makespan_us"):
            # a phase's weight bytes (tiles x one tile's: its stream rate x its mainloop) over
            # the phase: Linear-1 from the first entry to its last tile's end, Linear-2 from its
            # first mainloop's start to the last tile's end
            moved = {k: one[f"trace_{k}_tiles"] * one[f"trace_{k}_tile_gbps"]
                     * one[f"trace_{k}_mainloop_us"] for k in ("l1", "l2")}
            rate = {"l1": moved["l1"] / one["trace_l1_end_us"],
                    "l2": moved["l2"] / (one["trace_makespan_us"] - one["trace_l2_start_us"])}
            # a phase whose tiles outnumber the SMs that ran them ran a second round of tiles
            rounds = {k: int((one[f"trace_{k}_tiles"] > one[f"trace_{k}_sms"]).sum())
                      for k in ("l1", "l2")}
            t1 += (f" Traced (the instrumented build of the same kernel and schedule), the "
                   f"Linear-1 phase ends by {span(one['trace_l1_end_us'], '.0f')} µs, each tile "
                   f"streaming its weights at {span(one['trace_l1_tile_gbps'], '.0f')} GB/s over "
                   f"its mainloop; the Linear-2 tiles wait "
                   f"{span(one['trace_l2_wait_us'], '.0f')} µs (median) for their rows and "
                   f"stream at {span(one['trace_l2_tile_gbps'], '.0f')} GB/s. The Linear-1 "
                   f"phase moves its weights at {span(rate['l1'] / one['hbm_gbps'], '.2f')} and "
                   f"the Linear-2 phase at {span(rate['l2'] / one['hbm_gbps'], '.2f')} of the "
                   f"HBM bandwidth measured in the run; some SM ran a second tile of the phase "
                   f"in {count(rounds['l1'])} (Linear-1) and {count(rounds['l2'])} (Linear-2) of "
                   f"{count(len(one))} cells.")
            above = one[~a.loc[one.index, "t1_ok"]]
            if len(above):
                t1 += (f" The {count(len(above))} one-token "
                       f"{plural(len(above), 'cell')} above the bound ("
                       + ", ".join(f"{r.model} {r.precision} {r.setting}"
                                   for r in above.itertuples())
                       + f") {plural(len(above), 'takes', 'take')} "
                       f"{span(above['kernel_us'] / above['weight_floor_us'], '.1f')}× the floor: "
                       f"{plural(len(above), 'its', 'their')} Linear-1 phase runs "
                       f"{count_span(above['trace_l1_tiles'])} tiles on "
                       f"{count_span(above['trace_l1_sms'])} SMs and moves its weights at "
                       f"{span(rate['l1'][above.index] / above['hbm_gbps'], '.2f')} of the HBM "
                       f"bandwidth, the Linear-2 phase at "
                       f"{span(rate['l2'][above.index] / above['hbm_gbps'], '.2f')}.")
                if measured(above, "trace_entry_us"):
                    t1 += (f" Around their mainloops: the last program enters "
                           f"{span(above['trace_entry_us'], '.1f')} µs after the first, a "
                           f"Linear-1 tile waits {span(above['trace_l1_wait_us'], '.1f')} µs "
                           f"from its entry for its first weights and ends "
                           f"{span(above['trace_l1_epilogue_us'], '.1f')} µs after its "
                           f"mainloop (medians), and the last tile ends "
                           f"{span(above['trace_l2_tail_us'], '.1f')} µs after the last "
                           f"Linear-2 mainloop (the epilogues, the split sums).")
        missed = a[~a["graph_over_kernel_ok"]]
        misses = ""
        if len(missed):
            misses = (f", the other {count(len(missed))} above that bound by "
                      f"{span(missed['graph_over_kernel_excess_us'], '.1f')} µs")
            routed = t.loc[missed.index]
            if measured(routed, "route_kernels_us"):
                misses += (f", where their routing kernels take "
                           f"{span(profile_total_us(routed['route_kernels_us']), '.1f')} µs "
                           f"(profiled)")
            misses += excess_parts(t.loc[missed.index])
        parity = a[a["tokens"] >= KERNEL_PARITY_TOKENS]
        trials = kernel_trial_ratios(t.loc[parity.index])
        spread = (f", which themselves span "
                  f"{span(trials[['trial_ratio_min', 'trial_ratio_max']].stack(), '.3f')}×"
                  if len(trials) and trials["trials"].all() else "")
        kernel = (f" From {KERNEL_PARITY_TOKENS} tokens the kernel over the device tables takes "
                  f"{span(parity['kernel_over_host_kernel'], '.3f')}× the time of the same "
                  f"kernel over the host-built schedule (the median of their per-trial "
                  f"ratios{spread}, where a record kept the trials; within "
                  f"{KERNEL_PARITY - 1:.0%} in {met('kernel_parity_ok')} cells"
                  f"{parity_misses(trials, parity)})."
                  if measured(parity, "kernel_over_host_kernel") else "")
        out.append(
            f"On {v.platform} ({count(len(t))} cells of {count(t['model'].nunique())} models from "
            f"{sources(v)}), from the "
            f"router's output to the layer's output, the fused layer is at least as fast as the "
            f"unfused torch path (routing by torch ops, grouped GEMMs, weighted sum; below "
            f"{SMALL_T} tokens at most 10% slower, as the issue allows) eagerly in "
            f"{met('eager_speedup_ok')} cells and graphed in {met('graph_speedup_ok')}"
            f"{speedup_misses(a)}"
            + (f"; from {SMALL_T} tokens the graphed unfused path takes "
               f"{span(big['graph_speedup'], '.2f')}× the graphed fused layer's time" if len(big)
               else f" (no cell of {SMALL_T} tokens or more)")
            + f". The "
            f"graphed call stays within 5% of the kernel plus the weighted sum's memory time in "
            f"{met('graph_over_kernel_ok')} cells ({span(a['graph_over_kernel'], '.2f')}×"
            f"{fill_kept(t, a)}){misses}; "
            f"{schedule}; {host}; the one-token graphed call meets 1.5× the weight-read floor + "
            f"10 µs in {met('t1_ok')} cells.{t1}{kernel}{weight_passes(t, a)}{tall_tiles(t)} "
            f"Today's host-scheduled call takes "
            f"{span(t['host_scheduled_us'] / t['fused_eager_us'], '.1f')}× the fused eager "
            f"call's time.")
    return Prose(*out)


def weight_passes(cells: pd.DataFrame, accepted: pd.DataFrame) -> str:
    """From ``KERNEL_PARITY_TOKENS`` tokens, the kernel alone over the time its experts' weights
    take to read once at the HBM bandwidth measured in the run (``weight_floor_us``), also in the
    cells where the graphed fused layer is slower than the unfused path (``accepted``'s); "" where
    no cell has that many tokens."""
    big = cells[cells["tokens"] >= KERNEL_PARITY_TOKENS]
    if big.empty:
        return ""
    passes = big["kernel_us"] / big["weight_floor_us"]
    slower = passes[~accepted.loc[big.index, "graph_speedup_ok"]]
    where = (f", {span(slower, '.1f')}× in the {count(len(slower))} "
             f"{plural(len(slower), 'cell')} where the graphed fused layer is slower than the "
             f"unfused path" if len(slower) else "")
    return (f" At {KERNEL_PARITY_TOKENS} tokens and more the kernel alone takes "
            f"{span(passes, '.1f')}× the time its experts' weights take to read once at the HBM "
            f"bandwidth measured in the run{where}.")


def tall_tiles(cells: pd.DataFrame) -> str:
    """The cells whose record says the kernel ran 256-row tiles (``tile_rows``; records before
    the column ran 128), by setting and token count; "" where none did."""
    if "tile_rows" not in cells or not (cells["tile_rows"] == 256).any():
        return ""
    tall = cells[cells["tile_rows"] == 256]
    where = words(f"{SETTING_WORDS[s]} at {words(count(n) for n in sorted(g['tokens'].unique()))}"
                  f" tokens" for s, g in tall.groupby("setting"))
    return (f" The kernel's tiles are 256 rows in {count(len(tall))} "
            f"{words(sorted(tall['precision'].unique()))} {plural(len(tall), 'cell')} ({where}), "
            "128 in the others, as the layer's rule chose them when the record ran (by the routed "
            "rows an expert holds on average and the hidden size: `tiles.ws_tile_rows`).")


def speedup_misses(accepted: pd.DataFrame) -> str:
    """Of the cells of ``accepted`` (``layer_view.acceptance``), those where the fused layer
    misses the speed asked of it, eagerly or graphed, each with the unfused path's time over the
    fused layer's both ways; "" where none misses."""
    slower = accepted[~(accepted["eager_speedup_ok"] & accepted["graph_speedup_ok"])]
    return _named((f"{_cell_at_tokens(r)}: the unfused path takes "
                   f"{val(r.eager_speedup, '.2f')}× the fused layer's time eagerly and "
                   f"{val(r.graph_speedup, '.2f')}× graphed"
                   for r in slower.itertuples()), "; it is slower in")


def schedule_misses(cells: pd.DataFrame, tables: pd.Series, ok: pd.Series) -> str:
    """Of ``cells`` (at the schedule's token count), those whose table passes (``tables``) miss
    the limit (not ``ok``), each with that time and, where the record read it, the SM clock as
    the routing's profile ended (``route_sm_clock_mhz``: these latency-bound kernels follow it),
    beside every cell's such clock and its fused kernel's timed trials' (``sm_clock_mhz``); ""
    where none misses."""
    above = cells[~ok.loc[cells.index]]
    if above.empty:
        return ""
    clocked = "route_sm_clock_mhz" in cells and cells["route_sm_clock_mhz"].notna().all()
    named = _named((f"{_cell_words(r)}: {val(tables[i], '.0f')} µs"
                    + (f", its SM clock {val(r.route_sm_clock_mhz, '.0f')} MHz as the "
                       f"routing's profile ended" if clocked else "")
                    for i, r in above.iterrows()), "; above it")
    return (named + (
        f" (the cells' routing profiles ended at {span(cells['route_sm_clock_mhz'], '.0f')} MHz,"
        f" their fused kernels' timed trials ran at {span(cells['sm_clock_mhz'], '.0f')} MHz)"
        if clocked else ""))


def host_misses(cells: pd.DataFrame, ok: pd.Series) -> str:
    """Of ``cells``, those whose eager call's host time misses the limit (not ``ok``), each with
    that time and, where the record kept single calls, its median and slowest call; "" where
    none misses."""
    above = cells[~ok.loc[cells.index]]
    single = "host_call_median_us" in cells and above["host_call_median_us"].notna().all()
    return _named((
        f"{_cell_at_tokens(r)}: {val(r.host_overhead_us, '.0f')} µs"
        + (f", its median call {val(r.host_call_median_us, '.0f')} µs and its slowest "
           f"{val(r.host_call_max_us, '.0f')} µs" if single else "")
        for r in above.itertuples()), "; above it")


def parity_misses(trials: pd.DataFrame, accepted: pd.DataFrame) -> str:
    """Of the cells of ``accepted`` (from the parity's token count), those whose kernel over the
    device tables misses parity with the host-scheduled kernel, each with its ratio and, where
    the record kept the trials, the least and greatest of its per-trial ratios (``trials``:
    ``kernel_trial_ratios``, how far the trials themselves spread beside the bound); "" where
    none misses."""
    above = accepted[~accepted["kernel_parity_ok"]]
    return _named((
        f"{_cell_at_tokens(r)}: {val(r.kernel_over_host_kernel, '.3f')}×"
        + (f", its {count(trials.at[i, 'trials'])} trials' own ratios "
           f"{span(trials.loc[i, ['trial_ratio_min', 'trial_ratio_max']], '.3f')}×"
           if trials.at[i, "trials"] else "")
        for i, r in above.iterrows()), "; above it")


# misses a sentence names, the rest counted
NAMED_MISSES = 3


def _named(parts, lead: str) -> str:
    """``lead`` and the first ``NAMED_MISSES`` of ``parts`` (a miss each), then how many more;
    "" for none."""
    parts = list(parts)
    if not parts:
        return ""
    more = len(parts) - NAMED_MISSES
    return (f"{lead} " + "; ".join(parts[:NAMED_MISSES])
            + (f"; and {count(more)} more {plural(more, 'cell')}" if more > 0 else ""))


def _cell_words(r) -> str:
    """A layer cell's model, precision and setting in a sentence."""
    return f"{r.model} {r.precision} {SETTING_WORDS[r.setting]}"


def _cell_at_tokens(r) -> str:
    """``_cell_words`` and the cell's token count."""
    return f"{_cell_words(r)} at {count(r.tokens)} {plural(r.tokens, 'token')}"


def one_routing_kernel(passes: pd.Series) -> bool:
    """Whether the calls' ``passes`` (routing kernels a call) are one kernel each."""
    return passes.max() == 1


def first_routing_kernel(passes: pd.Series) -> str:
    """The routing kernel that writes a call's argument block, named for the calls' ``passes``:
    the first of several, or the only one."""
    return "the routing kernel" if one_routing_kernel(passes) else "the first routing kernel"


def fill_kept(cells: pd.DataFrame, accepted: pd.DataFrame) -> str:
    """The kernel alone's row counters' fill as the bound takes it (``layer_view.kernel_alone_us``):
    out, by how much a call where profiled; kept, in how many cells (records from before the fill
    was profiled)."""
    out = accepted["graph_over_kernel_fill_out"]
    kept = int((~out).sum())
    return ((f"; the kernel's time without its row counters' fill, "
             f"{span(counters_fill_us(cells)[out], '.1f')} µs a call as profiled" if out.any()
             else "")
            + (f"; in {count(kept)} {plural(kept, 'cell')}, from records made before that fill "
               f"was profiled, with it" if kept else ""))


def _graph_launched(table) -> bool:
    """Whether every cell's eager call launched its graph with the writer inside (``layer_bench``
    ``eager_path``; records before it launched the writer through Triton first)."""
    return "eager_path" in table and bool((table["eager_path"] == "graph_launch").all())
