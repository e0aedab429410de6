"""The regressions: the lead D around D_knee, the regressing cells and their causes, and the
completion-coupled counterfactual (what fencing each Linear-2 tile costs)."""
from __future__ import annotations

import pandas as pd

from .. import Prose, count, plural, rec, span, val, words
from .common import CAUSE_NAMES, COMPONENT_NAMES, all_regress, cell_name


def d_sweep(traces, records) -> Prose:
    """The lead D around D_knee: starvation at small D, the best lead, and the verdict for the
    models whose every matrix cell regresses."""
    from ... import plots
    from ...analysis.moe.trace import counterfactual_rows

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
        for m in all_regress(matrix):
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
    from ...analysis.moe.trace import regression_rows

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
    from ...analysis.moe.trace import COMPONENTS

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
                         + words(f"{cell_name(r)} ({val(r['makespan_ratio'], '.3f')})"
                                 for _, r in hidden.iterrows())
                         + "); for these `cause` names the component that grew in the traced "
                           "launch, not a measured loss.")
        if "speedup_hi" in rows:
            reach = rows[rows["speedup_hi"] >= 1]
            if len(reach):
                text += (f" For {count(len(reach))} cells the quartile range of the matrix trials "
                         f"reaches 1 (`speedup_hi` ≥ 1): {words(cell_name(r) for _, r in reach.iterrows())}.")
        bullets = []
        for cause, g in rows.groupby("cause", sort=False):
            models = words(g["model"].unique())
            head = (f"* **{models}, {count(len(g))} {plural(len(g), 'cell')} "
                    f"({span(g['matrix_speedup'], '.3f')}): "
                    f"{CAUSE_NAMES.get(cause, cause)}.**")
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
                    + "; ".join(f"{COMPONENT_NAMES[name]} {span(g[f'Δ{name} (µs/SM)'], '+.0f')} µs"
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
    from ...analysis.moe.trace import counterfactual_table
    from ...loading import record_paths as list_records, platforms, read as read_record

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
