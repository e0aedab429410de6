"""Notebook 03 (fused MoE): the passages that quote the ``moe`` matrix and ``moe_trace`` records.

Each function takes the records the notebook has loaded (every platform's latest) and returns
``Prose``, one paragraph per platform, naming the records it quotes."""
from __future__ import annotations

import numpy as np
import pandas as pd
from scipy.stats import gmean

from . import Prose, count, plural, rec, span, val, words

_CAUSES = {"wait_l2": "Linear-2 dependency wait (starvation)",
           "mainloop_l1": "Linear-1 mainloop growth", "mainloop_l2": "Linear-2 mainloop growth",
           "epilogue_l1": "Linear-1 epilogue growth", "span_l2": "remote-store span growth",
           "not traced": "not traced"}
_COMPONENTS = {"wait_l2": "Linear-2 dependency wait", "mainloop_l1": "Linear-1 mainloops",
               "mainloop_l2": "Linear-2 mainloops", "epilogue_l1": "Linear-1 epilogues",
               "span_l2": "remote-store spans"}


def _name(row) -> str:
    return f"{row['model']} {row['precision']} {row['routing']} {int(row['tokens'])}"


def _all_regress(table: pd.DataFrame) -> list[str]:
    """Models of a matrix whose every cell has speedup < 1."""
    return [m for m, g in table.groupby("model", sort=False) if (g["speedup"] < 1).all()]


def _ep(record) -> int:
    return int(record.params.get("world_size", record.table["world_size"].iloc[0]))


def _source_matrix(trace) -> str | None:
    """The matrix record whose regressing cells a ``moe_trace`` record traced."""
    from pathlib import Path

    sources = trace.params.get("regression_sources") or []
    return Path(sources[0]).stem if sources else None


def headline(records, paper: dict) -> Prose:
    """The headline speedups of each platform's matrix record against the paper's."""
    from ..analysis.moe.trace import headline_numbers

    out = []
    for r in records:
        t, s = r.table, headline_numbers(r.table)
        hi, lo = t.loc[t["speedup"].idxmax()], t.loc[t["speedup"].idxmin()]
        text = (f"On {r.platform} (EP = {_ep(r)}, matrix record {rec(r)}, "
                f"{r.params.get('trials', '?')} trials per cell) the geomean speedup of Interleaved "
                f"over Expert-Wave over its {len(t)} cells is **{val(s['geomean_speedup'], '.3f')}** "
                f"(median {val(s['median_speedup'], '.3f')}; max {val(s['max_speedup'], '.3f')} for "
                f"{_name(hi)}; min {val(s['min_speedup'], '.3f')} for {_name(lo)}), against the "
                f"paper's {paper['geomean_speedup']} (median {paper['median_speedup']}, max "
                f"{paper['max_speedup']}, min {paper['min_speedup_reported']}) over its "
                f"{paper['configs']} configurations at EP = {paper['ep']}.")
        losers = _all_regress(t)
        if losers:
            lost = t[t["model"].isin(losers)]
            rest = t[~t["model"].isin(losers)]
            text += (f" {words(losers)}: all {len(lost)} cells regress "
                     f"({span(lost['speedup'], '.3f')}); without them, "
                     f"{count((rest['speedup'] > 1).sum())} of the other {len(rest)} cells gain.")
        else:
            text += f" {count((t['speedup'] > 1).sum())} of the {len(t)} cells gain."
        if "unfused_impl" in t:
            impls = []
            for impl, g in t.groupby("unfused_impl", sort=False):
                name = impl.strip('[]"').replace('", "', ", ")
                impls.append(f"{words(sorted(g['precision'].unique()))}: `{name}`, "
                             f"{span(g['unfused_us'] / 1e3, '.3g', ' ms')} per layer")
            text += (" The fused-vs-unfused column compares against unfused implementations of "
                     f"very different quality ({'; '.join(impls)}), so it is not a verdict on "
                     "fusion.")
        out.append(text)
    return Prose(*out)


def routing(records) -> Prose:
    """Skewed against balanced routing, outside the models whose every cell regresses."""
    out = []
    for r in records:
        t = r.table
        losers = _all_regress(t)
        rest = t[~t["model"].isin(losers)]
        by = {k: g["speedup"] for k, g in rest.groupby("routing")}
        if not {"skewed", "balanced"} <= by.keys():
            continue
        sk, ba = by["skewed"], by["balanced"]
        more = ("Skewed routing gains more than balanced" if sk.median() > ba.median()
                else "Skewed routing gains no more than balanced")
        where = f"outside {words(losers)}, " if losers else ""
        out.append(f"On {r.platform} (record {rec(r)}): {more}: {where}{count((sk > 1).sum())} of "
                   f"{len(sk)} skewed cells gain (median {val(sk.median(), '.3f')}) against "
                   f"{count((ba > 1).sum())} of {len(ba)} balanced (median {val(ba.median(), '.3f')}).")
    return Prose(*out)


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
    from ..analysis.moe.trace import table2 as rows

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
                     f"Table 2 tests does not appear on this platform at EP = {_ep(tr)}.**")
        out.append(text)
    return Prose(*out)


def spans(traces, paper: dict) -> Prose:
    """Fig. 10: the remote spans against the local-store controls and the paper's bands."""
    from .. import plots

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
    from .. import plots
    from ..analysis.moe.trace import condition1_table
    from ..analysis.remote_store.characterization import latest_calibration
    from ..loading import latest as latest_record

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
    from ..analysis.moe.trace import traced_causes_table

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
    from ..analysis.moe.trace import counterfactual_rows, traced_causes_table

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
                     f"its largest growth is {_COMPONENTS.get(comp, comp)}, "
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


def d_sweep(traces, records) -> Prose:
    """The lead D around D_knee: starvation at small D, the best lead, and the verdict for the
    models whose every matrix cell regresses."""
    from .. import plots
    from ..analysis.moe.trace import counterfactual_rows

    matrices = {r.platform: r.table for r in records}
    out = []
    for tr in traces:
        sweep = plots.moe_d_sweep_rows(tr)
        if sweep.empty:
            continue
        smallest = sweep.loc[sweep.groupby("model", sort=False)["d_factor"].idxmin()]
        at = words(f"{r.d_factor:.2f} D_knee for {r.model}" for r in smallest.itertuples())
        speedups = words(val(r.speedup, ".3f") + f" ({r.model}, D = {int(r.lead_rows)})"
                         for r in smallest.itertuples())
        text = (f"In record {rec(tr)}, too small a lead starves Linear-2: at the smallest D ({at})"
                f" the speedup is {speedups}, with Linear-2 wait shares "
                f"{span(smallest['wait_l2_share'], '.2f')}.")
        for m, g in sweep.groupby("model", sort=False):
            best = g.loc[g["speedup"].idxmax()]
            knee = g[g["d_factor"] == 1]
            text += (f" {m}: the best lead measured is D = {best['d_factor']:g} D_knee "
                     f"({val(best['speedup'], '.3f')}, wait share {val(best['wait_l2_share'], '.3f')})")
            if len(knee) and best["d_factor"] != 1:
                text += (f", against {val(knee['speedup'].iloc[0], '.3f')} at D = D_knee (wait "
                         f"share {val(knee['wait_l2_share'].iloc[0], '.3f')})")
            text += "."
        out.append(text)
        matrix = matrices.get(tr.platform)
        if matrix is None:
            continue
        timed = {r["model"]: r for r in counterfactual_rows(tr.table)}
        for m in _all_regress(matrix):
            g = sweep[sweep["model"] == m].sort_values("lead_rows")
            if g.empty:
                continue
            cells = matrix[matrix["model"] == m]
            knee = int(g["d_knee"].iloc[0])
            best = g.loc[g["speedup"].idxmax()]
            at_knee, at_two = g[g["d_factor"] == 1], g[g["d_factor"] == 2]
            verdict = (f"**{m} verdict.** Every one of its {len(cells)} matrix cells regresses. "
                       f"Speedup at D = {'/'.join(str(int(d)) for d in g['lead_rows'])}: "
                       f"{'/'.join(val(s, '.3f') for s in g['speedup'])}")
            if len(at_knee) and len(at_two):
                verdict += (f"; at D = D_knee = {knee} the wait share is "
                            f"{val(at_knee['wait_l2_share'].iloc[0], '.3f')}, at 2 D_knee "
                            f"{val(at_two['wait_l2_share'].iloc[0], '.3f')} with speedup "
                            f"{val(at_two['speedup'].iloc[0], '.3f')}")
            verdict += "."
            leads = sorted(cells["lead_rows"].unique()) if "lead_rows" in cells else []
            run = timed.get(m)
            if run is not None and leads:
                verdict += (f" Its Interleaved time in the completion-coupled run "
                            f"({val(run['interleaved_us'], '.1f')} µs against "
                            f"{val(run['wave_us'], '.1f')} µs for Expert-Wave) is at the lead the "
                            f"matrix used (D = {words(int(x) for x in leads)} in its cells).")
            gain = (best["speedup"] - 1) * 100
            verdict += (f" At the best lead measured ({val(best['speedup'], '.3f')} at D = "
                        f"{best['d_factor']:g} D_knee) interleaving "
                        + (f"gains {val(gain, '.1f')}%." if gain > 0 else
                           f"still loses {val(-gain, '.1f')}%."))
            out.append(verdict)
    return Prose(*out)


def _regression_tables(traces, records):
    """Per trace record whose platform has a matrix record: (trace, matrix, its regressing
    cells as ``moe_trace.regression_rows`` gives them)."""
    from ..analysis.moe.trace import regression_rows

    matrices = {r.platform: r for r in records}
    for tr in traces:
        m = matrices.get(tr.platform)
        if m is not None:
            yield tr, m, pd.DataFrame(regression_rows(m.table, tr.table))


def regressions_scope(traces, records) -> Prose:
    """How many of the matrix's regressing cells the trace record covers."""
    out = []
    for tr, m, rows in _regression_tables(traces, records):
        if rows.empty:
            out.append(f"No cell of matrix record {rec(m)} has speedup < 1.")
            continue
        untraced = int((rows["cause"] == "not traced").sum())
        text = (f"Of the {count(len(rows))} regressing cells of matrix record {rec(m)}, trace "
                f"record {rec(tr)} traces {count(len(rows) - untraced)}")
        text += (", so every one has a traced cause." if not untraced else
                 f"; {count(untraced)} are not traced and show as \"not traced\", with the "
                 "model's traced cells and traced shape beside them as proxies, not as causes.")
        out.append(text)
    return Prose(*out)


def regressions(traces, records) -> Prose:
    """Every regressing cell, by measured cause."""
    from ..analysis.moe.trace import COMPONENTS

    out = []
    for tr, m, rows in _regression_tables(traces, records):
        if rows.empty:
            continue
        traced = rows[rows["cause"] != "not traced"]
        text = (f"{count(len(rows))} of {len(m.table)} cells of matrix record {rec(m)} have "
                f"speedup < 1; record {rec(tr)} traces {count(len(traced))} of them.")
        if len(traced):
            shown = traced[traced["makespan_ratio"] < 1]
            hidden = traced[traced["makespan_ratio"] >= 1]
            text += (f" A trace is one launch per schedule; in {count(len(shown))} of the "
                     f"{count(len(traced))} it shows the loss itself (makespan ratio < 1; "
                     "`traces_with_loss` in the group table).")
            if len(hidden):
                text += (f" In {count(len(hidden))} it does not (makespan ratio ≥ 1: "
                         + words(f"{_name(r)} ({val(r['makespan_ratio'], '.3f')})"
                                 for _, r in hidden.iterrows())
                         + "); for these `cause` names the component that grew in the traced "
                           "launch, not a measured loss.")
        if "speedup_hi" in rows:
            reach = rows[rows["speedup_hi"] >= 1]
            if len(reach):
                text += (f" For {count(len(reach))} cells the quartile range of the matrix trials "
                         f"reaches 1 (`speedup_hi` ≥ 1): {words(_name(r) for _, r in reach.iterrows())}.")
        bullets = []
        for cause, g in rows.groupby("cause", sort=False):
            models = words(g["model"].unique())
            head = (f"* **{models}, {count(len(g))} {plural(len(g), 'cell')} "
                    f"({span(g['matrix_speedup'], '.3f')}): "
                    f"{_CAUSES.get(cause, cause)}.**")
            if cause == "not traced":
                bullets.append(head + " No trace of these cells; their rows carry the same model's"
                               " traced cells and traced shape as proxies.")
                continue
            routings = g["routing"].value_counts()
            body = (f" {count((g['makespan_ratio'] < 1).sum())} of its {count(len(g))} traced "
                    f"{plural(len(g), 'launch', 'launches')} "
                    f"{'shows' if (g['makespan_ratio'] < 1).sum() == 1 else 'show'} the loss (makespan ratio {span(g['makespan_ratio'], '.3f')}); "
                    f"routing: {words(f'{n} {k}' for k, n in routings.items())}. Interleaved minus "
                    "Expert-Wave per SM: "
                    + "; ".join(f"{_COMPONENTS[name]} {span(g[f'Δ{name} (µs/SM)'], '+.0f')} µs"
                                for name, _, _ in COMPONENTS if f"Δ{name} (µs/SM)" in g)
                    + ".")
            if cause == "wait_l2" and "dsweep_speedup_at_lead" in g:
                leads = words(int(x) for x in sorted(g["lead_rows"].unique()))
                body += (f" This is starvation at the lead these cells used (D = {leads}), where "
                         f"the D sweep above measures {span(g['dsweep_speedup_at_lead'], '.3f')}"
                         f" against {span(g['dsweep_best_speedup'], '.3f')} at its best lead.")
            if cause.startswith("mainloop"):
                body += (" **Mainloop growth is what was measured.** The paper attributes such "
                         "regressions to lost L2 locality of the expert weights; the growth is "
                         "consistent with that explanation, but L2 hit rates were not measured.")
            bullets.append(head + body)
        out.append(text + "\n\n" + "\n".join(bullets))
    return Prose(*out)


def counterfactual(traces) -> Prose:
    """The completion-coupled counterfactual: what fencing each Linear-2 tile costs, with the
    one-GPU fence probe (``moe_fence_probe``) for the fence's local share."""
    from ..analysis.moe.trace import counterfactual_table
    from ..loading import record_paths as list_records, platforms, read as read_record

    probes = [read_record(p) for pl in platforms("moe_fence_probe")
              for p in list_records("moe_fence_probe", pl)]
    probe = (pd.concat([counterfactual_table(p.table) for p in probes], ignore_index=True)
             if probes else pd.DataFrame())
    out = []
    for tr in traces:
        c = counterfactual_table(tr.table)
        if c.empty:
            continue
        text = ("Fencing every Linear-2 tile (a system-scope fence after its Combine stores, so "
                "the SM waits for remote completion as a completion-coupled issuer would) costs "
                f"{span(c['coupled_over_decoupled_wave'], '.3f', '×')} under Expert-Wave and "
                f"{span(c['coupled_over_decoupled_int'], '.3f', '×')} under Interleaved (record "
                f"{rec(tr)}; table above). Under Expert-Wave the added time is "
                f"{span(c['fence_us_per_l2_tile_wave'], '.2f')} µs per Linear-2 tile of the "
                "critical rank (`fence_us_per_l2_tile_wave`) for all "
                f"{len(c)} shapes: the per-tile completion wait that the decoupled kernel overlaps "
                "with its successor's mainloop.")
        if len(probe):
            shared = probe[probe["model"].isin(c["model"])]
            if len(shared):
                local = shared.groupby("model")["fence_us_per_l2_tile_wave"]
                remote = c.set_index("model")["fence_us_per_l2_tile_wave"]
                share = remote[local.median().index] - local.median()
                text += (f" Not all of it is remote. The same bench on one GPU at EP = 1, where "
                         f"every Combine store is local (`moe_fence_probe`, {len(probes)} runs: "
                         f"{words(rec(p) for p in probes)}), still adds "
                         f"{span(shared['fence_us_per_l2_tile_wave'], '.2f')} µs per Linear-2 tile"
                         f" under Expert-Wave for {words(local.median().index)}: the fence's wait "
                         "for the SM's own stores and its two barriers. Remote completion's own "
                         f"share is therefore about {span(share, '.2f')} µs per tile for those "
                         "shapes.")
        faster = c[c["interleaved_fenced_us"] < c["interleaved_us"]]
        text += (f" Under Interleaved the per-tile figure is "
                 f"{span(c['fence_us_per_l2_tile_int'], '.2f')} µs"
                 + (f" ({words(faster['model'])}: the fenced run was faster than the unfenced one)"
                    if len(faster) else "") + ".")
        diff = c["wave_us"] - c["interleaved_us"]
        cost = c["wave_fenced_us"] - c["wave_us"]
        beats = c[diff > cost]
        still = c[c["interleaved_fenced_us"] < c["wave_us"]]
        text += (f" The schedule difference (Expert-Wave minus Interleaved) exceeds the Expert-Wave "
                 f"coupling cost in {count(len(beats))} of {len(c)} shapes"
                 + (f" ({words(beats['model'])})" if len(beats) else "")
                 + f", and fenced Interleaved is still faster than unfenced Expert-Wave in "
                 f"{count(len(still))} of {len(c)}"
                 + (f" (not {words(c.loc[~c.index.isin(still.index), 'model'])})"
                    if len(still) < len(c) else "") + ".")
        out.append(text)
    return Prose(*out)


def findings(records, traces, paper: dict, table2_paper: dict) -> Prose:
    """The notebook's findings, each from the records above."""
    from ..analysis.moe.trace import headline_numbers, regression_rows, table2 as table2_rows

    matrices = {r.platform: r for r in records}
    ref = pd.DataFrame(table2_paper["rows"])
    out = []
    for tr in traces:
        m = matrices.get(tr.platform)
        items = []
        if m is not None:
            s = headline_numbers(m.table)
            items.append(f"Interleaved over Expert-Wave: geomean {val(s['geomean_speedup'], '.3f')}, "
                         f"median {val(s['median_speedup'], '.3f')} over {s['configs']} cells "
                         f"(matrix record {rec(m)}; paper: {paper['geomean_speedup']} / "
                         f"{paper['median_speedup']} at EP = {paper['ep']}).")
        t = pd.DataFrame(table2_rows(tr.table))
        if len(t):
            pred = t[["stall_pred_wave_us", "stall_pred_int_us"]].to_numpy()
            err_w = (t["stall_pred_wave_us"] - t["stall_meas_wave_us"]).abs().max()
            err_i = (t["stall_pred_int_us"] - t["stall_meas_int_us"]).abs().max()
            predicted = ("no stall" if (pred == 0).all() else
                         f"at most {val(pred.max(), '.2f')} µs of stall")
            items.append(f"Eq. 15 predicts {predicted} at EP = {_ep(tr)}; the measurement "
                         f"agrees within {val(err_w, '.2f')} µs (Expert-Wave) and "
                         f"{val(err_i, '.2f')} µs (Interleaved); T_RS is "
                         f"{span(t[['span_wave_us', 'span_int_us']].to_numpy().ravel(), '.3f')} µs "
                         f"in both schedules (record {rec(tr)}).")
        if m is not None:
            rows = pd.DataFrame(regression_rows(m.table, tr.table))
            if len(rows):
                traced = rows[rows["cause"] != "not traced"]
                groups = words(f"{count(len(g))} {_CAUSES.get(k, k)}"
                               for k, g in rows.groupby("cause", sort=False))
                items.append(f"{count(len(rows))} cells regress; {count(len(traced))} are traced, "
                             f"{count((traced['makespan_ratio'] < 1).sum())} of those traces show "
                             f"the loss. By measured cause: {groups}.")
        if len(t):
            items.append(f"The paper's Expert-Wave spans ({ref['span_wave_us'].min()}–"
                         f"{ref['span_wave_us'].max()} µs) and measured stalls (up to "
                         f"{ref['stall_meas_wave_us'].max()} µs) against "
                         f"{span(t['span_wave_us'], '.3f')} µs and at most "
                         f"{val(t['stall_meas_wave_us'].max(), '+.2f')} µs here. Whether the "
                         "mechanism appears at larger EP (more of each burst remote, more sources "
                         "per destination) is not tested by these records.")
        out.append(f"On {tr.platform}:\n\n" + "\n".join(f"{i}. {x}" for i, x in enumerate(items, 1)))
    return Prose(*out)


def kernel(kernel_records) -> Prose:
    """The fused kernel on one GPU (``moe_kernel``): its TF/s against cuBLAS dense per precision,
    the weakest cell, and the whole call against the unfused path."""
    out = []
    for r in kernel_records:
        t = r.table
        kernel_name = r.params.get("kernel", "?")
        parts = []
        for p, g in t.groupby("precision", sort=True):
            worst = g.loc[g["ratio_to_cublas"].idxmin()]
            parts.append(f"in {p} the kernel alone (Expert-Wave) reaches a geometric mean of "
                         f"**{val(gmean(g['ratio_to_cublas']), '.3f')}** of cuBLAS dense TF/s "
                         f"over {count(len(g))} cells ({span(g['tflops'], '.0f')} TF/s), the "
                         f"lowest {val(worst['ratio_to_cublas'], '.3f')} for {_name(worst)}, and "
                         f"Interleaved {val(gmean(g['ratio_to_cublas_interleaved']), '.3f')}")
        faster = int((t["call_wave_us"] < t["unfused_us"]).sum())
        text = (f"On {r.platform} (record {rec(r)}, the `{kernel_name}` kernel, one rank of "
                f"EP = {int(t['ep'].iloc[0])}): {'; '.join(parts)}. The whole fused call is "
                f"faster than torch's grouped GEMMs + SwiGLU + Combine in {count(faster)} of "
                f"{count(len(t))} cells ({span(t['fused_vs_unfused'], '.2f')}× its time). "
                f"Building a batch's schedule and checked launch on the host takes "
                f"{span(t['host_prepare_us'] / 1e3, '.1f')} ms per batch, outside these times.")
        out.append(text)
    return Prose(*out)


def call_overhead(kernel_records) -> Prose:
    """Where a one-token call's time goes (``moe_kernel``'s ``call_overhead``)."""
    out = []
    for r in kernel_records:
        o = pd.DataFrame(r.params["call_overhead"]["rows"])
        chain = o["mainloop_l1_us"] + o["wave_wait_l2_us"] + o["mainloop_l2_us"]
        out.append(f"On {r.platform} (record {rec(r)}) a one-token call ({span(o['rows'], '.0f')} "
                   f"routed rows on this rank) takes {span(o['kernel_wave_us'], '.0f')} µs in the "
                   f"kernel and {span(o['call_wave_us'], '.0f')} µs as a whole call. The host's "
                   f"Python launch takes {span(o['host_launch_us'], '.0f')} µs per call; in the "
                   f"kernel, one Linear-1 tile's mainloop, the Linear-2 tile's wait for it and "
                   f"that tile's mainloop add up to {span(chain, '.0f')} µs (traced): two "
                   f"tiles' whole K loops in series.")
    return Prose(*out)


def forecast(forecast_records, paper: dict) -> Prose:
    """The forecast for EP = 2, 4, 8 (``moe_forecast``), against the paper's Table 2."""
    ref = pd.DataFrame(paper["rows"])
    out = []
    for r in forecast_records:
        t = r.table
        parts = []
        for ep, g in t.groupby("ep", sort=True):
            reshape = g[g["action"] == "reshape"]
            gain = g[g["predicted_speedup"] > 1]
            parts.append(f"at EP = {int(ep)} the design test says *reshape* for "
                         f"{count(len(reshape))} of {count(len(g))} shapes, with a predicted "
                         f"stall of {span(g['predicted_stall_us'], '.2f')} µs per Linear-2 burst "
                         f"under Expert-Wave, and Interleaved predicted faster for "
                         f"{count(len(gain))}")
        bound = t[(t["action"] == "reshape") & (t["g_wave_us"] >= t["v_over_r_us"])]
        out.append(f"Forecast {rec(r)} (kernel times of {r.platform}, calibration "
                   f"`{r.params['calibration_record']}`): {'; '.join(parts)}. In "
                   f"{count(len(bound))} of the {count(len(t))} rows the gap between bursts "
                   f"already exceeds V/R, so the stall comes from the burst itself exceeding the "
                   f"capacity Q (eq. 7), which interleaving does not shorten. The paper measured "
                   f"Expert-Wave spans of {ref['span_wave_us'].min()}–{ref['span_wave_us'].max()} "
                   f"µs and Interleaved {ref['span_int_us'].min()}–{ref['span_int_us'].max()} µs "
                   f"at EP = 8 on its platform; the two-GPU run tests this forecast.")
    return Prose(*out)


def knee_sweep(traces, calibrations: dict) -> Prose:
    """The synthetic knee sweep of each ``moe_trace`` record that has one, against the model;
    ``calibrations``: platform -> ``model.PlatformModel``."""
    from ..analysis.moe.trace import knee_sweep_rows

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
