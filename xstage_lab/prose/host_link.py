"""Passages of the host link (issue 26): the MoE matrix with its Combine into host memory, and
what the traces say where the forecast misses."""
from __future__ import annotations

from ..analysis.moe.host_view import (AUTO_WITHIN, MISS_PP, auto_standing, comparison,
                                      local_sweep_table, misses)
from ..analysis.remote_store.row_chunks import row_chunk_fits
from ..calibration import under_gemm_fits, under_load_fits
from . import Prose, count, rec, span, val

# A measured Expert-Wave stall per Linear-2 burst this far (µs) from the forecast's, or an
# Interleaved time this far (fraction) from its forecast, is what a missed cell is put down to.
STALL_OFF_US = 2.0
INTERLEAVED_OFF = 0.05
# A traced median Linear-2 dependency wait this much longer (µs) under Interleaved than under
# Expert-Wave counts as Interleaved waiting on Linear-1.
WAIT_LONGER_US = 1.0
# A traced mainloop this many times the all-local one the forecast plays counts as slowed.
MAINLOOP_SLOWER = 1.10


def matrix(views) -> Prose:
    """Each platform's host-link matrix: what the host share costs Expert-Wave, what Interleaved
    and the fence do, and how close the forecast came."""
    out = []
    for v in views:
        c = comparison(v)
        per_share = "; ".join(
            f"{int(h)} of 8: {span(g['wave_us'] / g['local_us'], '.2f')}×"
            for h, g in c.groupby("host_share", sort=True))
        faster = c[c["measured_speedup"] > 1]
        met = c[c["speedup_error_pp"].abs() <= MISS_PP]
        out.append(
            f"{', '.join(rec(r) for r in v.records)} (forecast `{v.forecast_record}`, written "
            f"before the run): {count(len(c))} cells. Expert-Wave's time over the all-local "
            f"control, by the number of source ranks whose Combine buffers are host memory: "
            f"{per_share}. Interleaved at the derived lead beats Expert-Wave in "
            f"{count(len(faster))} cells (measured speedup {span(c['measured_speedup'], '.2f')}); "
            f"the fenced, completion-coupled Expert-Wave is {span(c['fenced_us'] / c['wave_us'], '.2f')}× "
            f"the decoupled one. The forecast's Expert-Wave time is within "
            f"{val(c['wave_error_pct'].abs().median(), '.1f')}% of the measured one (median), "
            f"its speedup within {MISS_PP:g} percentage points in {count(len(met))} of "
            f"{count(len(c))} cells." + _auto(v))
    return Prose(*out)


def _auto(view) -> str:
    """How ``auto`` (timed live) stands against the fastest schedule the run timed, by paired
    trials where the run kept them (``auto_standing``), beside the ratio of medians and what two
    timings of one schedule in the same run differ by; in a tuned run, beside how the forecast's
    own pick stood."""
    a = auto_standing(view)
    if not len(a):
        return ""
    paired = "auto_over_fastest_paired" in a
    by = "auto_over_fastest_paired" if paired else "auto_over_fastest"
    same = a["auto_over_same"].dropna()
    tuned = "forecast_over_fastest" in a
    what = ("`auto`, tuned among the schedules the forecast cannot tell apart and timed live,"
            if tuned else "The forecast's `auto`, timed live,")
    how = (" by the median of its per-trial ratios to that schedule (a clock step between "
           "trials moves both times of a trial)" if paired else "")
    medians = (f" By the ratio of the two medians it is within {AUTO_WITHIN:.0%} in "
               f"{count(_within(a['auto_over_fastest']))} cells "
               f"({val(a['auto_over_fastest'].max(), '.3f')}× at worst)." if paired else "")
    alone = ""
    if tuned:
        own = "forecast_over_fastest_paired" if paired else "forecast_over_fastest"
        alone = (f" The forecast's own pick, untuned, is within {AUTO_WITHIN:.0%} of the "
                 f"fastest in {count(_within(a[own]))} of {count(len(a))} cells "
                 f"({val(a[own].max(), '.3f')}× the fastest at worst).")
        tuning = view.table["auto_tune_ms"].dropna() if "auto_tune_ms" in view.table else []
        if len(tuning):
            alone += (f" Tuning, a cost paid once per cell at first use, took "
                      f"{val(tuning.median() / 1e3, '.2f')} s (median of the "
                      f"{count(len(tuning))} cells with more than one candidate).")
    return (f" {what} is within {AUTO_WITHIN:.0%} of the fastest "
            f"schedule the run timed{how} in {count(_within(a[by]))} of {count(len(a))} cells "
            f"({val(a[by].median(), '.3f')}× the fastest at the median, "
            f"{val(a[by].max(), '.3f')}× at worst).{medians} The same schedule timed "
            f"twice in the run, as `auto` and in the sweep, differs by "
            f"{val(same.quantile(0.1), '.3f')}–{val(same.quantile(0.9), '.3f')}× (10th to 90th "
            f"percentile of {count(len(same))} cells, ratio of medians).{alone}")


def _within(ratios) -> int:
    """How many of ``ratios`` are within ``AUTO_WITHIN`` of 1."""
    return int((ratios <= 1 + AUTO_WITHIN).sum())


# Issue 26: Interleaved at the derived lead at least this fraction of Expert-Wave's speed with
# every Combine store local.
LOCAL_BOUND = 0.98


def local_sweep(views) -> Prose:
    """Each platform's local sweep: Interleaved against Expert-Wave with every store local, at
    D_knee, at the derived lead and at the best lead of the sweep, and what the traces measured
    in the cells that stay below ``LOCAL_BOUND`` at every lead."""
    out = []
    for v in views:
        s = local_sweep_table(v)
        below = s[s["at_best"] < LOCAL_BOUND]
        text = (f"{', '.join(rec(r) for r in v.records)}, every Combine store local, "
                f"{count(len(s))} cells: Interleaved runs at {span(s['at_knee'], '.3f')}× "
                f"Expert-Wave's speed at D_knee, {span(s['at_lead'], '.3f')}× at the derived lead "
                f"(at least {LOCAL_BOUND:g} in {count(int((s['at_lead'] >= LOCAL_BOUND).sum()))} "
                f"cells) and {span(s['at_best'], '.3f')}× at the best lead of the sweep.")
        if len(below):
            names = ", ".join(f"{r.model} {r.precision} {r.routing}" for r in below.itertuples())
            text += (f" Below {LOCAL_BOUND:g} at every lead: {names}. There the traced Linear-2 "
                     f"mainloop under Interleaved takes {span(below['mainloop_l2_ratio'], '.2f')}× "
                     f"Expert-Wave's, and the Linear-2 tiles wait "
                     f"{span(below['int_wait_l2_us'], '.2f')} µs on their rows against "
                     f"{span(below['wave_wait_l2_us'], '.2f')} µs: no lead removes the cost, "
                     "the schedule's order itself carries it.")
        out.append(text)
    return Prose(*out)


def forecast_misses(views) -> Prose:
    """Where the forecast's speedup misses the measured one by more than ``MISS_PP``: what the
    traces of those cells measured, cause by cause."""
    out = []
    for v in views:
        m = misses(v)
        if m.empty:
            out.append(f"On {v.platform} the forecast meets every cell within {MISS_PP:g} "
                       "percentage points.")
            continue
        under = m[m["stall_error_us"] < -STALL_OFF_US]
        over = m[m["stall_error_us"] > STALL_OFF_US]
        off = m[(m["interleaved_over_forecast"] - 1).abs() > INTERLEAVED_OFF]
        waits = off[off["int_wait_l2_us"] > off["wave_wait_l2_us"] + WAIT_LONGER_US]
        parts = [f"{count(len(m))} cells miss by more than {MISS_PP:g} percentage points "
                 f"({span(m['speedup_error_pp'], '+.1f')})"]
        if len(under):
            parts.append(
                f"in {count(len(under))} the measured Expert-Wave stall exceeds the forecast's "
                f"by more than {STALL_OFF_US:g} µs per Linear-2 burst "
                f"({span(-under['stall_error_us'], '.1f')} µs; forecast "
                f"{span(under['predicted_stall_us'], '.1f')} µs): the forecast spreads the host "
                f"share evenly over every tile, while a Linear-2 tile's rows come from one or two "
                f"source ranks, so a tile crosses the host link whole or not at all and its "
                f"bursts are lumpier than the average")
        if len(over):
            parts.append(f"in {count(len(over))} the forecast's stall exceeds the measured one "
                         f"({span(over['stall_error_us'], '.1f')} µs per burst)")
        if len(off):
            parts.append(
                f"in {count(len(off))} Interleaved ran at {span(off['interleaved_over_forecast'], '.2f')}× "
                f"its forecast time, which starts from the one-GPU kernel record's Interleaved "
                f"time at D_knee while this run used the derived lead; in {count(len(waits))} of "
                f"them its Linear-2 tiles waited longer on Linear-1 than Expert-Wave's "
                f"({span(waits['int_wait_l2_us'], '.2f')} µs against "
                f"{span(waits['wave_wait_l2_us'], '.2f')} µs, traced medians)" if len(waits) else
                f"in {count(len(off))} Interleaved ran at {span(off['interleaved_over_forecast'], '.2f')}× "
                f"its forecast time, which starts from the one-GPU kernel record's Interleaved "
                f"time at D_knee while this run used the derived lead")
        wave_l2, int_l1 = m["wave_mainloop_l2_over_local"], m["int_mainloop_l1_over_local"]
        slowed = m[(wave_l2 > MAINLOOP_SLOWER) | (int_l1 > MAINLOOP_SLOWER)]
        if len(slowed):
            parts.append(
                f"in {count(len(slowed))} the traced mainloops ran slower than in the all-local "
                f"kernel record the forecast plays (Expert-Wave's Linear-2 "
                f"{span(slowed['wave_mainloop_l2_over_local'], '.2f')}×, Interleaved's Linear-1 "
                f"{span(slowed['int_mainloop_l1_over_local'], '.2f')}× its time there): the "
                f"Combine's backpressure reaching the Tensor Cores through the tiles' local "
                f"staging, as §3 describes, which the forecast's all-local per-tile times leave "
                f"out")
        out.append(f"On {v.platform}: " + "; ".join(parts) + ". The table above lists them "
                   "with their traces (G_wave measured against the forecast's, the Linear-2 "
                   "dependency waits of both schedules). The forecast's base times come from the "
                   "one-GPU kernel record, an earlier run: the all-local control of this run "
                   f"differs from them by {span(m['local_over_record'].sub(1).mul(100), '+.1f')}% "
                   "in these cells.")
    return Prose(*out)


def link_calibration(characterizations) -> Prose:
    """Each host-link platform's M_X^host beside the copy engine's device-to-host rate of the
    same run, and the no-refit gap-sweep error."""
    out = []
    for c in characterizations:
        cal = c.calibration
        if cal.link != "host":
            continue
        iso = {int(k): f for k, f in cal.isolated.items() if f["capacity_bytes"] is not None}
        out.append(
            f"Host link {rec(c.record)} ({c.record.platform}: the same kernels storing into "
            f"pinned host memory over PCIe): R = {val(cal.drain_rate_GBps, '.1f')} GB/s, "
            f"{val(cal.drain_rate_GBps / cal.copy_engine_GBps * 100, '.0f')}% of the copy "
            f"engine's device-to-host rate measured in the same run "
            f"({val(cal.copy_engine_GBps, '.1f')} GB/s); Q(K) = "
            f"{span([f['capacity_bytes'] / 2**20 for f in iso.values()], '.2f')} MiB over "
            f"K = {', '.join(str(k) for k in sorted(iso))}, the knee at "
            f"{span([f['knee_volume_bytes'] / k / 1024 for k, f in iso.items()], '.0f')} KiB per "
            f"producer; the gap sweep predicted with no refit to a median |error| of "
            f"{val(cal.gap_issue_err_pct, '.2f')}% in T_iss ("
            f"{val(cal.gap_drain_branch_err_pct, '.2f')}% on the drain branch, where each "
            f"burst's issue grows toward V/R − G).")
    return Prose(*out)


def row_patterns(records) -> Prose:
    """Each host-link record's ``row_chunks`` sweep: R and Q of the Combine's row patterns
    beside the contiguous burst's of the same run."""
    out = []
    for r in records:
        fits = row_chunk_fits(r.table)
        base = fits[(fits["chunk_bytes"] == 0) & (fits["row_bytes"] == 0)].iloc[0]
        rows = fits[fits["chunk_bytes"] > 0]
        q_mib = rows["capacity_bytes"] / 2**20
        off = max((rows["drain_rate_GBps"] / base["drain_rate_GBps"] - 1).abs().max(),
                  (rows["capacity_bytes"] / base["capacity_bytes"] - 1).abs().max())
        patterns = ", ".join(f"{int(c)} B of each {int(w)}-byte row"
                             for c, w in zip(rows["chunk_bytes"], rows["row_bytes"]))
        out.append(
            f"{rec(r)} ({r.platform}): the fused MoE's Combine stores each Linear-2 tile as one "
            f"chunk per row ({patterns}). At K = {count(int(base['producers']))} producers those "
            f"patterns drain at R = {span(rows['drain_rate_GBps'], '.1f')} GB/s with "
            f"Q = {span(q_mib, '.2f')} MiB, the contiguous burst of the same run at "
            f"{val(base['drain_rate_GBps'], '.1f')} GB/s and "
            f"{val(base['capacity_bytes'] / 2**20, '.2f')} MiB: within "
            f"{val(off * 100, '.1f')}% of it.")
    return Prose(*out)


def under_load(records) -> Prose:
    """Each host platform's ``under_load`` probe: the host stores' drain beside a streaming load
    against alone, and the load's rate beside host stores against beside the same stores kept
    local, per layout and K: whether a backpressured host link slows work that never uses it."""
    out = []
    for r in records:
        fits = under_load_fits(r.table)
        split = fits[fits["layout"] == "split"].sort_values("producers")
        shared = fits[fits["layout"] == "shared"]
        per_k = "; ".join(f"K = {count(k)}: {val(s, '.1f')}×"
                          for k, s in zip(split["producers"], split["load_slowdown"]))
        text = (f"{rec(r)} ({r.platform}): beside the load the host stores drain at "
                f"{span(fits['drain_under_load_GBps'], '.1f')} GB/s, "
                f"{span(fits['drain_under_load_ratio'], '.3f')}× their rate alone. The load "
                f"slows beside host stores against beside the same stores kept local")
        if len(split):
            text += (f", where K SMs store and the others only load (it never touches the "
                     f"link): {per_k}")
        if len(shared):
            text += (f"; where every SM stores and loads, "
                     f"{val(shared['load_slowdown'].iloc[0], '.1f')}× "
                     f"({val(shared['load_beside_host_stores_GBps'].iloc[0], '.0f')} GB/s against "
                     f"{val(shared['load_beside_local_stores_GBps'].iloc[0], '.0f')})")
        out.append(text + ". The MoE forecast plays R under the load; the load's slowdown is a "
                   "streaming load's, not a GEMM mainloop's, and the forecast leaves it out "
                   "(`moe.host_forecast`).")
    return Prose(*out)


def under_gemm(records) -> Prose:
    """Each host platform's ``under_gemm`` probe: cuBLAS's bf16 matmul on the SMs that K store
    warps' CTAs leave, beside host stores against beside the same stores kept local."""
    out = []
    for r in records:
        fits = under_gemm_fits(r.table)
        per_k = "; ".join(
            f"K = {count(k)}: {span(g['gemm_slowdown'], '.1f')}× "
            f"({span(g['gemm_beside_host_stores_tflops'], '.0f')} TF/s against "
            f"{span(g['gemm_beside_local_stores_tflops'], '.0f')})"
            for k, g in fits.groupby("producers", sort=True))
        out.append(f"{rec(r)} ({r.platform}): the matmul ({', '.join(sorted(fits['gemm'].unique()))}"
                   f"; {span(fits['gemm_alone_tflops'], '.0f')} TF/s alone on every SM) slows "
                   f"beside K SMs storing into host memory against beside the same stores kept "
                   f"local, by {per_k}. The MoE forecast does not play this slowdown either "
                   f"(`moe.host_forecast`).")
    return Prose(*out)
