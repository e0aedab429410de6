"""The matrix passages: the headline speedup, routing, and the findings that close the notebook."""
from __future__ import annotations

import pandas as pd

from .. import Prose, count, rec, span, val, words
from .common import CAUSE_NAMES, all_regress, cell_name, record_ep


def headline(records, paper: dict) -> Prose:
    """The headline speedups of each platform's matrix record against the paper's."""
    from ...analysis.moe.trace import headline_numbers

    out = []
    for r in records:
        t, s = r.table, headline_numbers(r.table)
        hi, lo = t.loc[t["speedup"].idxmax()], t.loc[t["speedup"].idxmin()]
        text = (f"On {r.platform} (EP = {record_ep(r)}, matrix record {rec(r)}, "
                f"{r.params.get('trials', '?')} trials per cell) the geomean speedup of Interleaved "
                f"over Expert-Wave over its {len(t)} cells is **{val(s['geomean_speedup'], '.3f')}** "
                f"(median {val(s['median_speedup'], '.3f')}; max {val(s['max_speedup'], '.3f')} for "
                f"{cell_name(hi)}; min {val(s['min_speedup'], '.3f')} for {cell_name(lo)}), against the "
                f"paper's {paper['geomean_speedup']} (median {paper['median_speedup']}, max "
                f"{paper['max_speedup']}, min {paper['min_speedup_reported']}) over its "
                f"{paper['configs']} configurations at EP = {paper['ep']}.")
        losers = all_regress(t)
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
        losers = all_regress(t)
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


def findings(records, traces, paper: dict, table2_paper: dict) -> Prose:
    """The notebook's findings, each from the records above."""
    from ...analysis.moe.trace import headline_numbers, regression_rows, table2 as table2_rows

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
            items.append(f"Eq. 15 predicts {predicted} at EP = {record_ep(tr)}; the measurement "
                         f"agrees within {val(err_w, '.2f')} µs (Expert-Wave) and "
                         f"{val(err_i, '.2f')} µs (Interleaved); T_RS is "
                         f"{span(t[['span_wave_us', 'span_int_us']].to_numpy().ravel(), '.3f')} µs "
                         f"in both schedules (record {rec(tr)}).")
        if m is not None:
            rows = pd.DataFrame(regression_rows(m.table, tr.table))
            if len(rows):
                traced = rows[rows["cause"] != "not traced"]
                groups = words(f"{count(len(g))} {CAUSE_NAMES.get(k, k)}"
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
