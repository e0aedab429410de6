"""The ``moe_trace`` passages: what was traced, Table 2, the remote-store spans, Condition 1,
the timeline, the traced causes and the synthetic knee sweep."""
from __future__ import annotations

import numpy as np
import pandas as pd

from .. import Prose, count, rec, span, val, words
from .common import COMPONENT_NAMES, record_ep


def _source_matrix(trace) -> str | None:
    """The matrix record whose regressing cells a ``moe_trace`` record traced."""
    from pathlib import Path

    sources = trace.params.get("regression_sources") or []
    return Path(sources[0]).stem if sources else None


def trace_scope(traces, records) -> Prose:
    """What each ``moe_trace`` record traced."""
    matrices = {r.platform: r for r in records}
    out = []
    for tr in traces:
        t, p = tr.table, tr.params
        shapes = t[t["kind"] == "trace"]["model"].nunique()
        regressions = int((t["kind"] == "regression").sum())
        text = (f"The `moe_trace` record {rec(tr)} ({tr.platform}, printed above) traces the "
                f"{shapes} shapes at {p.get('precision')}, {p.get('routing')} routing, "
                f"{p.get('tokens_per_rank')} tokens per rank, under both schedules, with remote "
                "Combine stores and with the local-store control (the same kernel storing to local "
                "HBM).")
        source = _source_matrix(tr)
        if regressions:
            of = ""
            m = matrices.get(tr.platform)
            if m is not None and m.record_id == source:
                of = f" (of its {count((m.table['speedup'] < 1).sum())} cells with speedup < 1)"
            text += (f" It also traces {count(regressions)} regressing cells of the matrix record "
                     f"`{source}`{of}, each at its own precision, routing, tokens and lead D, under "
                     "both schedules with remote stores (the regression tables below).")
        out.append(text)
    return Prose(*out)


def table2(traces, paper: dict) -> Prose:
    """Table 2 (eq. 15): spans, cover windows, predicted and measured stalls against the paper's."""
    from ...analysis.moe.trace import table2 as rows

    ref = pd.DataFrame(paper["rows"])
    out = []
    for tr in traces:
        t = pd.DataFrame(rows(tr.table))
        if t.empty:
            continue
        text = (f"In record {rec(tr)} ({tr.platform}) the Linear-2 spans T_RS are "
                f"{span(t['span_wave_us'], '.3f')} µs (Expert-Wave) and "
                f"{span(t['span_int_us'], '.3f')} µs (Interleaved), against the paper's "
                f"{ref['span_wave_us'].min()}–{ref['span_wave_us'].max()} and "
                f"{ref['span_int_us'].min()}–{ref['span_int_us'].max()} µs. The T^mma (cover) "
                f"windows are {span(t['mma_l2_us'], '.1f')} µs (Linear-2) and "
                f"{span(t['mma_l1_us'], '.1f')} µs (Linear-1). ")
        pred = t[["stall_pred_wave_us", "stall_pred_int_us"]].to_numpy()
        if (pred == 0).all():
            text += "Eq. 15 predicts **no stall** for any model or schedule. "
        else:
            text += (f"Eq. 15 predicts up to {val(pred.max(), '.2f')} µs "
                     f"({words(t.loc[t[['stall_pred_wave_us', 'stall_pred_int_us']].max(axis=1) > 0, 'model'])}). ")
        err = {s: t[f"stall_pred_{s}_us"] - t[f"stall_meas_{s}_us"] for s in ("wave", "int")}
        worst = {s: t.loc[err[s].abs().idxmax()] for s in err}
        text += (f"The measured stalls run from {span(t['stall_meas_wave_us'], '+.2f')} µs under "
                 f"Expert-Wave and {span(t['stall_meas_int_us'], '+.2f')} µs under Interleaved, so "
                 f"eq. 15's error is at most {val(err['wave'].abs().max(), '.2f')} µs under "
                 f"Expert-Wave ({worst['wave']['model']}) and "
                 f"{val(err['int'].abs().max(), '.2f')} µs under Interleaved "
                 f"({worst['int']['model']}).")
        meas = t[["stall_meas_wave_us", "stall_meas_int_us"]].to_numpy()
        if (meas < 0).any():
            text += (f" {count((meas < 0).sum())} of the {meas.size} measured stalls are negative:"
                     " the successor mainloop ran *faster* than the local control's median, so the"
                     " local control is not an exact floor here; the cause is not measured.")
        paper_meas = ref["stall_meas_wave_us"][ref["stall_pred_wave_us"] > 0]
        wave_max = t["stall_meas_wave_us"].max()
        text += (f" The paper's Expert-Wave stalls reach {ref['stall_pred_wave_us'].max()} µs "
                 f"predicted and {ref['stall_meas_wave_us'].max()} µs measured; here the largest "
                 f"Expert-Wave stall measured is {val(wave_max, '+.2f')} µs.")
        if (pred == 0).all() and len(paper_meas) and wave_max < paper_meas.min():
            text += (" **The paper's Expert-Wave stalls have no counterpart here: eq. 15 predicts "
                     "none, and every stall measured is below the smallest the paper measured "
                     f"where it predicts one ({paper_meas.min()} µs). The X-Stage stall that "
                     f"Table 2 tests does not appear on this platform at EP = {record_ep(tr)}.**")
        out.append(text)
    return Prose(*out)


def spans(traces, paper: dict) -> Prose:
    """Fig. 10: the remote spans against the local-store controls and the paper's bands."""
    from ... import plots

    band = paper["fig10"]
    out = []
    for tr in traces:
        runs = plots.moe_trace_runs(tr)
        remote = runs[runs["path"] == "remote"]
        if "span_excess_us" not in remote or remote["span_excess_us"].isna().all():
            continue
        excess = remote.dropna(subset=["span_excess_us"])
        med = runs.pivot_table(index=["model", "path"], columns="schedule", values="span_l2_us")
        text = (f"Fig. 10's numbers are in the table above (record {rec(tr)}). The median excess "
                "of T_RS over the local control's Linear-2 span (`span_excess_us`) is "
                f"{span(excess['span_excess_us'], '+.3f')} µs for all {len(excess)} remote "
                "(model, schedule) runs.")
        if {"wave", "interleaved"} <= set(med.columns):
            diff = (med["wave"] - med["interleaved"]).unstack("path")
            if "remote" in diff:
                m = diff["remote"].idxmax()
                text += (f" Expert-Wave's median spans exceed Interleaved's by at most "
                         f"{val(diff['remote'].max(), '.3f')} µs ({m}, "
                         f"{val(med.loc[(m, 'remote'), 'wave'], '.3f')} against "
                         f"{val(med.loc[(m, 'remote'), 'interleaved'], '.3f')} µs)")
                if "local" in diff and not np.isnan(diff.loc[m, "local"]):
                    text += (f", and its local controls differ by "
                             f"{val(diff.loc[m, 'local'], '+.3f')} µs "
                             f"({val(med.loc[(m, 'local'), 'wave'], '.3f')} against "
                             f"{val(med.loc[(m, 'local'), 'interleaved'], '.3f')} µs)")
                text += "."
        lo_w, hi_w = band["span_wave_median_range_us"]
        lo_i, hi_i = band["span_int_median_range_us"]
        top = remote["span_l2_us"].max()
        text += (f" The paper's median bands, {lo_w}–{hi_w} µs (Expert-Wave) and {lo_i}–{hi_i} µs "
                 f"(Interleaved), lie {val(lo_i / top, '.1f')}× or more above the largest median "
                 f"span here ({val(top, '.3f')} µs).")
        out.append(text)
    return Prose(*out)


def condition1(traces) -> Prose:
    """Condition 1 (eqs. 12–14) from each platform's latest calibration, with the measured spans."""
    from ... import plots
    from ...analysis.moe.trace import condition1_table
    from ...analysis.remote_store.characterization import latest_calibration
    from ...loading import latest as latest_record

    out = []
    for tr in traces:
        cal_record = latest_record("calibration", tr.platform)
        c = condition1_table(tr.table, latest_calibration(tr.platform).platform_model())
        if c.empty:
            continue
        runs = plots.moe_trace_runs(tr)
        local = runs[(runs["path"] == "local") & (runs["schedule"] == "wave")].set_index("model")
        first = c.iloc[0]
        volume = first["K_act"] * first["V_t_bytes"]
        text = (f"One Expert-Wave Linear-2 wave is K_act = {int(first['K_act'])} SMs × "
                f"{int(first['V_t_bytes']) // 1024} KiB (one Linear-2 tile's Combine rows each) = "
                f"{volume / 1e6:.2f} MB, which drains in V/R = "
                f"{val(first['V_over_R_us'], '.2f')} µs at the calibrated R (calibration "
                f"{rec(cal_record)}); the recovery gap G* is {val(first['G_star_us'], '.2f')} µs.")
        covered = c[c["G_wave_us"] >= c["G_star_us"]]
        short = c[c["G_wave_us"] < c["G_star_us"]]
        if len(covered):
            text += (f" The Expert-Wave gap G_wave = T^mma_L2 (table above) is "
                     f"{span(covered['G_wave_us'], '.1f')} µs for {count(len(covered))} models, so "
                     "eq. 4 predicts no issue overhead for them even without interleaving")
            text += ";" if len(short) else "."
        for _, row in short.iterrows():
            m = row["model"]
            text += (f" {m} (G_wave = {val(row['G_wave_us'], '.2f')} µs) is predicted "
                     f"{val(row['dT_iss_wave_us'], '.2f')} µs")
            if "span_wave_us" in row and m in local.index:
                rel = "below" if row["span_wave_us"] < local.loc[m, "span_l2_us"] else "above"
                text += (f", and its measured Expert-Wave span ({val(row['span_wave_us'], '.3f')} µs)"
                         f" is {rel} its local control's ({val(local.loc[m, 'span_l2_us'], '.3f')} µs,"
                         " table under Fig. 10)")
            text += "."
        holds = c["condition1_holds"].astype(bool)
        text += (" Eq. 14 holds for all of them." if holds.all() else
                 f" Eq. 14 holds for {count(holds.sum())} of the {len(c)} "
                 f"(not {words(c.loc[~holds, 'model'])}).")
        if holds.all() and (c["dT_iss_wave_us"] <= c["t_iss0_us"]).all():
            text += (" The model therefore predicts what was measured: the Linear-2 mainloops are "
                     "long against the drain time of one aligned wave, and interleaving has no "
                     "backpressure to relieve.")
        text += (" (The volume counts every Combine row as remote; rows whose source is the "
                 "issuing GPU itself only lower V.)")
        out.append(text)
    return Prose(*out)


def timeline(traces, models) -> Prose:
    """Fig. 9: Tensor-Core occupancy and makespan ratio of the models drawn."""
    from ...analysis.moe.trace import traced_causes_table

    out = []
    for tr in traces:
        causes = traced_causes_table(tr.table).set_index("model")
        parts = [f"{m} keeps {val(causes.loc[m, 'mma_busy_wave'], '.3f')} of the SMs in a mainloop"
                 f" under Expert-Wave and {val(causes.loc[m, 'mma_busy_int'], '.3f')} under "
                 f"Interleaved (makespan ratio {val(causes.loc[m, 'makespan_ratio'], '.3f')})"
                 for m in models if m in causes.index]
        if parts:
            out.append(f"On {tr.platform} (record {rec(tr)}): " + "; ".join(parts) + ".")
    return Prose(*out)


def traced_causes(traces) -> Prose:
    """Where Interleaved's SM time goes in the traced shapes, gains and losses."""
    from ...analysis.moe.trace import counterfactual_rows, traced_causes_table

    out = []
    for tr in traces:
        c = traced_causes_table(tr.table)
        if c.empty:
            continue
        d = lambda k: f"Δ{k} (µs/SM)"  # noqa: E731
        gain, loss = c[c["makespan_ratio"] > 1], c[c["makespan_ratio"] <= 1]
        text = (f"Read from the table above (record {rec(tr)}); `cause` names the component that "
                "grew most under Interleaved, whether the shape gains or loses.")
        if len(gain):
            text += (f" In {count(len(gain))} shapes Interleaved gains (makespan ratio "
                     f"{span(gain['makespan_ratio'], '.3f')}: {words(gain['model'])}): the "
                     f"Linear-2 dependency-wait share falls from {span(gain['wait_share_wave'], '.3f')}"
                     f" of SM time to {span(gain['wait_share_int'], '.3f')} "
                     f"({span(gain[d('wait_l2')], '+.0f')} µs per SM), paid back in part by "
                     f"Linear-1 mainloops ({span(gain[d('mainloop_l1')], '+.0f')} µs per SM) and "
                     f"Linear-2 mainloops ({span(gain[d('mainloop_l2')], '+.0f')} µs per SM). "
                     f"Remote-store spans change by {span(gain[d('span_l2')], '+.1f')} µs per SM.")
            relief = (gain[d("span_l2")].abs() < 0.05 * gain[d("wait_l2")].abs()).all()
            if relief and (gain[d("wait_l2")] < 0).all():
                text += (" So on this platform interleaving's gains are **not X-Stage relief**: "
                         "they come from filling the Expert-Wave schedule's dependency waits "
                         "(Linear-2 tiles waiting for their wave's Linear-1 tiles) with Linear-1 "
                         "work.")
        for _, row in loss.iterrows():
            comp = row["cause"]
            text += (f" {row['model']} loses (makespan ratio {val(row['makespan_ratio'], '.3f')}): "
                     f"its largest growth is {COMPONENT_NAMES.get(comp, comp)}, "
                     f"{val(row[d(comp)], '+.0f')} µs per SM (Linear-2 dependency-wait share "
                     f"{val(row['wait_share_wave'], '.3f')} → {val(row['wait_share_int'], '.3f')}).")
        timed = {r["model"]: r for r in counterfactual_rows(tr.table)}
        for _, row in c.iterrows():
            run = timed.get(row["model"])
            if run is None:
                continue
            speedup = run["wave_us"] / run["interleaved_us"]
            if (speedup > 1) != (row["makespan_ratio"] > 1):
                text += (f" For {row['model']} the traced launch and this record's timed run "
                         f"disagree: makespan ratio {val(row['makespan_ratio'], '.3f')} against "
                         f"{val(run['wave_us'], '.1f')} µs Expert-Wave and "
                         f"{val(run['interleaved_us'], '.1f')} µs Interleaved (completion-coupled "
                         "table below); why is not measured.")
        out.append(text)
    return Prose(*out)


def knee_sweep(traces, calibrations: dict) -> Prose:
    """The synthetic knee sweep of each ``moe_trace`` record that has one, against the model;
    ``calibrations``: platform -> ``model.PlatformModel``."""
    from ...analysis.moe.trace import knee_sweep_rows

    out = []
    for tr in traces:
        rows = pd.DataFrame(knee_sweep_rows(tr.table, calibrations[tr.platform])) \
            if tr.platform in calibrations else pd.DataFrame()
        if rows.empty:
            out.append(f"Record {rec(tr)} ({tr.platform}) has no knee sweep: it was made before "
                       f"the synthetic kernel existed, or without `--knee-models`.")
            continue
        below = rows[rows["g_wave_us"] < rows["g_star_us"]]
        above = rows[rows["g_wave_us"] >= rows["g_star_us"]]
        out.append(f"In record {rec(tr)} ({tr.platform}, a synthetic kernel), where G_wave falls "
                   f"below G* ({count(len(below))} of {count(len(rows))} points) the remote span "
                   f"exceeds the local control's by {span(below['excess_us'], '+.2f')} µs"
                   + (f", against {span(above['excess_us'], '+.2f')} µs above G*"
                      if len(above) else "")
                   + f"; the model's span error is at most "
                   f"{val((rows['span_pred_us'] - rows['span_remote_us']).abs().max(), '.2f')} µs.")
    return Prose(*out)
