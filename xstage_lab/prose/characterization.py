"""Notebook 01 (remote-store characterization): the passages that quote the issue-time probe,
the calibrations, and the receiver-side visibility record."""
from __future__ import annotations

import pandas as pd

from . import Prose, count, rec, span, val, words

KIB = 1024


def issue_probes(burst_bytes: int = 16 * KIB) -> Prose:
    """The one-GPU ``issue_time_probe`` records: at ``burst_bytes``, what each patch of the burst
    kernel saves against ``burst_gap`` as it was, and the kernel as committed against
    ``burst_gap_ops``' 16-byte stores."""
    from ..loading import record_paths as list_records, platforms, read as read_record

    out = []
    for platform in platforms("issue_time_probe"):
        for path in list_records("issue_time_probe", platform):
            r = read_record(path)
            t = r.table[~r.table["warmup"] & (r.table["burst_bytes"] == burst_bytes)]
            med = t.groupby("variant")["t_iss_us"].median()
            if "burst_gap" not in med:
                continue
            p = r.params
            head = (f"Record {rec(r)} ({platform}; K = {p.get('producers')}, {p.get('mode')} "
                    f"bursts on the {p.get('path')} path, B = {burst_bytes // KIB} KiB): ")
            patches = p.get("patches") or {}
            saves = [f"{desc}: {val((med[f'burst_gap_{k}'] - med['burst_gap']) * 1e3, '+.0f')} ns"
                     for k, desc in patches.items() if f"burst_gap_{k}" in med]
            if saves:
                out.append(head + f"`burst_gap` as it was issues in {val(med['burst_gap'], '.3f')}"
                           " µs; each patch changes that by " + "; ".join(saves) + ".")
            elif "ops_store16" in med:
                out.append(head + f"`burst_gap` ({p.get('kernels', 'as recorded')}) issues in "
                           f"{val(med['burst_gap'], '.3f')} µs against "
                           f"{val(med['ops_store16'], '.3f')} µs for `burst_gap_ops`.")
    return Prose(*out)


def _calibration_records(platform: str) -> list:
    """A platform's calibration records, one per characterization they were fitted on (the
    latest fit of each), oldest first."""
    from ..loading import record_paths as list_records, read as read_record

    by_source = {}
    for path in list_records("calibration", platform):
        r = read_record(path)
        by_source[r.params["source_record"]] = r
    return list(by_source.values())


def calibration_change(characterizations) -> Prose:
    """Each platform's latest calibration against the one fitted on the characterization before:
    T_iss^0 at every burst size of the gap sweep, R, Q and the fenced sweep's T_lat."""
    out = []
    for c in characterizations:
        cals = _calibration_records(c.record.platform)
        if not cals:
            continue
        now = cals[-1]
        cal = now.params["calibration"]
        text = (f"{c.record.platform}: the latest calibration, {rec(now)}, is fitted on "
                f"characterization `{now.params['source_record']}` (commit "
                f"`{str(now.params.get('calibrated_with_commit', now.git_commit))[:7]}`); the "
                f"tables and figures here refit characterization {rec(c.record)}.")
        if len(cals) > 1:
            before = cals[-2].params["calibration"]
            k = str(max(int(x) for x in cal["isolated"]))
            keys = [key for key in cal["t_iss0_us"] if key in before["t_iss0_us"]
                    and key.startswith(f"K={k},")]
            sizes = [int(key.split("B=")[1]) // KIB for key in keys]
            text += (f" Against {rec(cals[-2])} (fitted on `{cals[-2].params['source_record']}`), "
                     f"at K = {k}: T_iss⁰ is "
                     + words(val(cal["t_iss0_us"][key], ".3f") for key in keys)
                     + f" µs at B = {words(sizes)} KiB ("
                     + words(val(before["t_iss0_us"][key], ".3f") for key in keys)
                     + f" before); R is {val(cal['drain_rate_GBps'], '.1f')} GB/s "
                     f"({val(before['drain_rate_GBps'], '.1f')})")
            q_now, q_then = (x["isolated"].get(k, {}).get("capacity_bytes") for x in (cal, before))
            if q_now and q_then:
                text += f"; Q is {val(q_now / 1e6, '.2f')} MB ({val(q_then / 1e6, '.2f')})"
            lat = [(x.get("completion") or {}).get("completion_latency_us") for x in (cal, before)]
            if lat[0] is not None:
                text += (f"; the fenced sweep's T_lat is {val(lat[0], '.2f')} µs"
                         + (f" ({val(lat[1], '.2f')})" if lat[1] is not None else
                            " (no fenced sweep before)"))
            text += "."
        out.append(text)
    return Prose(*out)


def clock_alignment(visibilities) -> Prose:
    """The two GPUs' timer offset, its drift and the bound it puts on every cross-GPU time."""
    out = []
    for v in visibilities:
        a = v.alignment
        b, e = a["before"], a["after"]
        res = (a["resolution_src"]["resolution_ns"], a["resolution_dst"]["resolution_ns"])
        out.append(
            f"In the latest record, {rec(v.record)} ({v.record.platform}, commit "
            f"`{v.record.git_commit[:7]}`): θ = {val(b['offset_ns'] / 1e3, '.2f')} µs before and "
            f"{val(e['offset_ns'] / 1e3, '.2f')} µs after, {val(a['span_s'], '.2f')} s apart, so "
            f"the timers drift {val(a['drift_ns'] / 1e3, '+.2f')} µs over the run "
            f"({val(a['drift_ns_per_s'] / 1e3, '+.2f')} µs/s): a single θ would misplace the last "
            f"stamps by that much. RTT_min = {val(b['rtt_min_ns'] / 1e3, '.3f')} µs before and "
            f"{val(e['rtt_min_ns'] / 1e3, '.3f')} µs after (median "
            f"{val(b['rtt_median_ns'] / 1e3, '.3f')} µs), the timer step is {val(res[0], '.0f')} "
            f"ns on the source and {val(res[1], '.0f')} ns on the destination, so every "
            f"cross-GPU time carries **±{val(a['uncertainty_ns'] / 1e3, '.2f')} µs**; the "
            f"receiver-initiated check agrees to {words(val(x, '.0f') for x in a['swap_check_ns'])}"
            " ns.")
    return Prose(*out)


def _drain_us(k, b, rate_GBps: float) -> float:
    return k * b / (rate_GBps * 1e3)


def visibility_latency(visibilities) -> Prose:
    """Issue end to flag visible per (K, B): at the gaps at least the burst's own drain V/R, and
    at the shorter ones, where the next burst's stores are issued before the flag's release."""
    from ..analysis.remote_store.visibility import calibration_completion as _calibration_completion

    out = []
    for v in visibilities:
        cal = _calibration_completion(v.record.platform, v.record.path.parents[2])
        pts = v.points
        if cal is None or pts.empty:
            continue
        rate = cal[0]
        bullets = []
        for k, gk in pts.groupby("producers"):
            parts = []
            for b, g in gk.groupby("burst_bytes"):
                drain = _drain_us(k, b, rate)
                long_, short = g[g["gap_us"] >= drain], g[g["gap_us"] < drain]
                at = []
                for sel, rel in ((long_, "≥"), (short, "≤")):
                    if len(sel):
                        lo, hi = sel["gap_us"].min(), sel["gap_us"].max()
                        where = (f"G = {lo:g} µs" if lo == hi else
                                 f"G {rel} {lo if rel == '≥' else hi:g} µs")
                        at.append(f"{span(sel['latency_us'], '.2f', ' µs')} at {where}")
                parts.append(f"{b // KIB} KiB: " + ", ".join(at))
            bullets.append(f"* K = {int(k)}: " + "; ".join(parts) + ".")
        out.append(f"Record {rec(v.record)}, median latency from issue end, split at the burst's "
                   f"own drain time V/R (R = {val(rate, '.1f')} GB/s):\n\n" + "\n".join(bullets))
    return Prose(*out)


def visibility_vs_complete(visibilities) -> Prose:
    """The aligned first burst over the isolated gaps against T_complete = V/R + T_lat, per K,
    held against the clock bound; the fenced sweep's own measurement where it has the point."""
    from ..analysis.remote_store.visibility import calibration_completion as _calibration_completion
    from ..loading import latest as latest_record

    out = []
    for v in visibilities:
        c = v.comparison
        cal = _calibration_completion(v.record.platform, v.record.path.parents[2])
        if c is None or c.empty or cal is None:
            continue
        bound = v.alignment["uncertainty_ns"] / 1e3
        cal_rec = latest_record("calibration", v.record.platform, v.record.path.parents[2])
        text = (f"In {rec(v.record)} with R = {val(cal[0], '.1f')} GB/s and T_lat = "
                f"{val(v.completion_latency_us, '.2f')} µs (calibration {rec(cal_rec)}), clock "
                f"bound ±{val(bound, '.2f')} µs:")
        bullets = []
        for k, g in c.groupby("producers"):
            inside = g["diff_us"].abs() <= bound
            line = (f"* **K = {int(k)}**: the per-producer mean is "
                    f"{span(g['diff_us'], '+.2f')} µs from V/R + T_lat at B = "
                    f"{words(int(b) // KIB for b in g['burst_bytes'])} KiB, the last flag "
                    f"{span(g['aggregate_diff_us'], '+.2f')} µs; "
                    + ("all within the clock bound" if inside.all() else
                       f"{count((~inside).sum())} of {len(g)} past it "
                       f"({words(f'{int(b) // KIB} KiB' for b in g.loc[~inside, 'burst_bytes'])})")
                    + ".")
            fenced = g.dropna(subset=["T_complete_fenced_us"])
            for r in fenced.itertuples():
                line += (f" At {int(r.burst_bytes) // KIB} KiB (gaps ≥ {r.gap_min_us:g} µs) it "
                         f"reads {val(r.visible_from_start_us, '.2f')} µs against "
                         f"{val(r.T_complete_fenced_us, '.2f')} µs measured by the fenced sweep "
                         f"({val(r.fenced_diff_us, '+.2f')} µs).")
            bullets.append(line)
        first = v.first_burst
        over = first[~first["isolated"]] if first is not None else pd.DataFrame()
        if len(over):
            worst = over.loc[over["diff_us"].idxmax()]
            bullets.append(f"* **Where the next burst overlaps** ({count(len(over))} of "
                           f"{len(first)} (K, B, G) points), the first burst's flag shows two "
                           f"bursts' drain: up to {val(worst['diff_us'], '+.2f')} µs over "
                           f"T_complete per producer (K = {int(worst['producers'])}, "
                           f"{int(worst['burst_bytes']) // KIB} KiB, G = {worst['gap_us']:g} µs).")
        out.append(text + "\n\n" + "\n".join(bullets))
    return Prose(*out)


def paper_isolated(table1: dict) -> str:
    """The paper's isolated-burst numbers (``data/paper/table1.json``) for a caption: its knee per
    producer and Q at each K it gives."""
    return "; ".join(f"{kb} KB per producer, Q = {table1['Q_MiB'][k]} MiB at {k.replace('=', ' = ')}"
                     for k, kb in table1["knee_KB_per_producer"].items() if k in table1["Q_MiB"])
