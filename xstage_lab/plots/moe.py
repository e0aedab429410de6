"""Figures and tables of the fused MoE layer (paper §5.2): Fig. 8 and the headline speedups
(``moe`` records), the kernel against cuBLAS (``moe_kernel``), the forecast (``moe_forecast``),
and the mechanism from the per-tile traces (``moe_trace``: Table 2, Figs. 9–10, the lead D and
the knee sweep). The tables that the analysis derives from a trace (regressions, causes, the
fenced counterfactual, Condition 1) are ``moe_trace``'s."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import COLORS


def _cell(v):
    """A record cell that held a dict or list (stored as JSON text)."""
    return json.loads(v) if isinstance(v, str) else v


def moe_speedups(records) -> go.Figure:
    """Fig. 8: Interleaved over Expert-Wave speedup by model, precision and routing."""
    fig = make_subplots(rows=len(records), cols=1, subplot_titles=[r.platform for r in records])
    for row, rec in enumerate(records, start=1):
        t = rec.table
        for i, ((prec, routing), grp) in enumerate(t.groupby(["precision", "routing"])):
            x = (grp["model"] if t["tokens"].nunique() == 1
                 else grp["model"] + " · " + grp["tokens"].astype(int).astype(str))
            fig.add_bar(x=x, y=grp["speedup"], name=f"{prec} {routing}",
                        marker_color=COLORS[i % len(COLORS)], showlegend=row == 1, row=row, col=1)
    fig.add_hline(y=1.0, line=dict(dash="dot"))
    fig.update_layout(title="Fig. 8: MoE speedup, Interleaved over Expert-Wave", barmode="group",
                      yaxis_title="T_wave / T_interleaved")
    fig.update_xaxes(title_text="model" if all(r.table["tokens"].nunique() == 1 for r in records)
                     else "model · tokens per rank")
    return fig


def moe_headline(paper: dict, summaries: dict[str, dict]) -> pd.DataFrame:
    """The MoE headline speedups: the paper's (84 configurations, EP = 8) beside each platform's
    (``summaries``: platform -> ``moe_trace.headline_numbers`` of its matrix record)."""
    keys = ("configs", "geomean_speedup", "median_speedup", "max_speedup", "min_speedup")
    rows = [{"source": "paper", **{k: paper.get(k, paper.get("min_speedup_reported")) for k in keys}}]
    rows += [{"source": p, **{k: s[k] for k in keys},
              "fused_vs_unfused_geomean": s["fused_vs_unfused_geomean"]} for p, s in summaries.items()]
    return pd.DataFrame(rows)


def moe_table2(paper: dict, table2: dict[str, list[dict]]) -> pd.DataFrame:
    """Table 2: per model, eq. 15's prediction beside the measured per-tile stall (and its error)
    for both schedules, the paper's row first, then each platform's (``table2``: platform ->
    ``moe_trace.table2`` of its trace record)."""
    rows = [{"source": "paper", **{k: v for k, v in r.items() if k != "paper_name"}}
            for r in paper["rows"]]
    rows += [{"source": platform, **r} for platform, rs in table2.items() for r in rs]
    df = pd.DataFrame(rows)
    for s in ("wave", "int"):
        df[f"err_{s}_us"] = df[f"stall_pred_{s}_us"] - df[f"stall_meas_{s}_us"]
    order = {m: i for i, m in enumerate(r["model"] for r in paper["rows"])}
    return (df.assign(_o=df["model"].map(order)).sort_values(["_o", "source"], kind="stable")
            .drop(columns="_o").round(3).reset_index(drop=True))


MOE_KERNEL_COLUMNS = ("model", "precision", "routing", "tokens", "rows", "kernel_wave_us",
                      "kernel_interleaved_us", "call_wave_us", "cublas_dense_us", "unfused_us",
                      "tflops", "cublas_dense_tflops", "grouped_mm_tflops", "ratio_to_cublas",
                      "ratio_to_cublas_interleaved", "fused_vs_unfused", "sm_clock_mhz_min")


def moe_kernel_cells(kernel_record) -> pd.DataFrame:
    """A ``moe_kernel`` record's cells: the kernel alone (both schedules), the whole call, cuBLAS
    dense, the unfused path, TF/s and the ratios (``moe.kernel_rows.TIMED``)."""
    return kernel_record.table[list(MOE_KERNEL_COLUMNS)].round(3)


def moe_kernel_ratio(kernel_records) -> go.Figure:
    """The fused kernel's TF/s over cuBLAS dense per cell, Expert-Wave (filled) and Interleaved
    (open), one panel per precision, one colour per routing and tokens per rank."""
    precisions = ["bf16", "fp8"]
    fig = make_subplots(rows=1, cols=2, subplot_titles=precisions, shared_yaxes=True)
    colours = {}
    for rec in kernel_records:
        for (routing, tokens), g in rec.table.groupby(["routing", "tokens"], sort=True):
            label = f"{rec.platform}, {routing}, {tokens} tokens"
            colour = colours.setdefault(label, COLORS[len(colours) % len(COLORS)])
            for j, p in enumerate(precisions):
                cells = g[g["precision"] == p]
                for col, symbol, name in (("ratio_to_cublas", "circle", "Expert-Wave"),
                                          ("ratio_to_cublas_interleaved", "circle-open",
                                           "Interleaved")):
                    fig.add_scatter(x=cells["model"], y=cells[col], mode="markers",
                                    marker=dict(color=colour, symbol=symbol, size=9),
                                    name=f"{label}, {name}", legendgroup=label,
                                    showlegend=j == 0, row=1, col=j + 1)
    fig.update_yaxes(title_text="kernel TF/s / cuBLAS dense TF/s", row=1, col=1)
    fig.update_xaxes(title_text="model")
    fig.update_layout(title="The fused kernel against cuBLAS dense GEMMs of the same rows")
    return fig


def moe_layer_speedups(layer_view) -> go.Figure:
    """The fused layer's speedup over the unfused torch path per call (``moe_layer``), graphed
    (filled) and eager (open), against tokens, one panel per setting, one colour per model and
    precision."""
    t = layer_view.table
    settings = sorted(t["setting"].unique())
    fig = make_subplots(rows=1, cols=len(settings), subplot_titles=settings, shared_yaxes=True)
    for i, ((model, precision), g) in enumerate(t.groupby(["model", "precision"], sort=True)):
        colour = COLORS[i % len(COLORS)]
        for j, setting in enumerate(settings):
            cells = g[g["setting"] == setting].sort_values("tokens")
            for path, symbol in (("graph", "circle"), ("eager", "circle-open")):
                fig.add_scatter(x=cells["tokens"], y=cells[f"unfused_{path}_us"]
                                / cells[f"fused_{path}_us"], mode="lines+markers",
                                marker=dict(color=colour, symbol=symbol), line=dict(color=colour),
                                name=f"{model} {precision}, {path}",
                                legendgroup=f"{model} {precision}", showlegend=j == 0,
                                row=1, col=j + 1)
    fig.add_hline(y=1.0, line_dash="dot")
    fig.update_xaxes(type="log", title_text="tokens per call (per source rank for ep8_rank)")
    fig.update_yaxes(title_text="unfused time / fused time", row=1, col=1)
    fig.update_layout(title=f"The fused layer against the unfused torch path, {layer_view.platform}")
    return fig


def moe_layer_call_excess(layer_view) -> go.Figure | None:
    """Where the graphed call's time beyond the kernel alone plus the weighted sum's memory time
    goes, in each profiled cell over issue 27's bound (``layer_view.call_excess``, in units of
    that time), stacked: the routing's kernels, the weighted sum beyond its memory time, the
    device's time between kernels beyond the kernel alone's, the rest of the call's timed span
    beyond the kernel alone's (the replay's launch, the events), the fused kernel in the call
    beyond alone (a part below zero: the profiled run's difference from the timed one); the
    bound's 5% dashed. One panel per setting; None where no profiled cell is over the bound."""
    from ..analysis.moe.layer_view import GRAPH_OVER_KERNEL, call_excess

    excess = call_excess(layer_view.table)
    over = excess[excess["graph_over_kernel"] > GRAPH_OVER_KERNEL]
    if over.empty:
        return None
    settings = sorted(over["setting"].unique())
    fig = make_subplots(rows=1, cols=len(settings), subplot_titles=settings, shared_yaxes=True)
    parts = (("routing_excess", "routing kernels"),
             ("weighted_sum_excess", "weighted sum beyond its memory time"),
             ("boundary_excess", "between kernels, beyond the kernel alone's"),
             ("window_excess", "rest of the timed window (replay launch, events), beyond the "
              "kernel alone's"),
             ("kernel_excess", "fused kernel in the call, beyond alone"))
    for j, setting in enumerate(settings):
        cells = over[over["setting"] == setting].sort_values("graph_over_kernel",
                                                             ascending=False)
        names = [f"{m} {p} T={t}" for m, p, t in
                 cells[["model", "precision", "tokens"]].itertuples(index=False)]
        for i, (column, label) in enumerate(parts):
            fig.add_bar(x=names, y=cells[column], name=label, legendgroup=label,
                        marker_color=COLORS[i % len(COLORS)], showlegend=j == 0,
                        row=1, col=j + 1)
    fig.add_hline(y=GRAPH_OVER_KERNEL - 1, line_dash="dash")
    fig.update_layout(barmode="relative", title="Where the graphed call's time beyond the kernel "
                      f"goes, cells over the bound, {layer_view.platform}")
    fig.update_xaxes(title_text="cell")
    fig.update_yaxes(title_text="time / (kernel alone + weighted sum's memory time)", row=1, col=1,
                     tickformat=".0%")
    return fig


def moe_call_overhead(kernel_record) -> pd.DataFrame:
    """The one-token call of a ``moe_kernel`` record and where its time goes: the kernel alone
    and the whole call, the host's launch and per-batch schedule costs, and the traced chain of
    one Linear-1 tile's mainloop, the Linear-2 tile's wait for it and its own mainloop."""
    rows = pd.DataFrame(kernel_record.params["call_overhead"]["rows"])
    cols = ["model", "precision", "rows", "kernel_wave_us", "call_wave_us", "host_launch_us",
            "host_prepare_us", "mainloop_l1_us", "wave_wait_l2_us", "mainloop_l2_us"]
    return rows[[c for c in cols if c in rows.columns]].round(2)


def moe_call_probe_table(probe_records) -> pd.DataFrame:
    """A platform's ``moe_call_probe`` records (``call_probe.sequence_spans``): per record,
    precision and sequence, the fused kernel's time over its time right after itself, to three
    decimals, beside its time after its own launch (µs)."""
    from ..analysis.moe.call_probe import sequence_spans

    return sequence_spans(probe_records).round(
        {"alone_us_min": 1, "alone_us_max": 1, "over_alone_min": 3, "over_alone_median": 3,
         "over_alone_max": 3})


def moe_forecast_table(forecast_records, paper: dict) -> pd.DataFrame:
    """The forecast per model, precision and P (``moe_forecast``), with the paper's Table 2 row
    of the model beside it (measured at EP = 8, W8A8, skewed routing, on its platform)."""
    ref = {r["model"]: r for r in paper["rows"]}
    cols = ["model", "precision", "ep", "remote_share", "g_wave_us", "g_int_us", "v_over_r_us",
            "g_star_us", "action", "predicted_stall_us", "predicted_stall_int_us",
            "predicted_span_us", "predicted_speedup"]
    frames = []
    for rec in forecast_records:
        t = rec.table[cols].copy()
        t.insert(0, "source", rec.platform)
        for k in ("span_wave_us", "span_int_us", "stall_meas_wave_us"):
            t[f"paper_{k}"] = t["model"].map(lambda m, k=k: ref.get(m, {}).get(k))
        frames.append(t)
    return pd.concat(frames, ignore_index=True).round(3)


def moe_knee_sweep(rows: list[dict], platform: str) -> go.Figure | None:
    """The X-Stage inside the fused kernel (a SYNTHETIC kernel: a fraction of every mainloop's K
    blocks): Expert-Wave's measured Linear-2 span with remote stores and with the local-store
    control against the gap between bursts, the model's span (eqs. 3–4) beside them, G* marked;
    one panel per model and precision (``rows``: ``moe_trace.knee_sweep_rows``). None where the
    record has no knee sweep."""
    rows = pd.DataFrame(rows)
    if rows.empty:
        return None
    groups = list(rows.groupby(["model", "precision"], sort=False))
    fig = make_subplots(rows=1, cols=len(groups),
                        subplot_titles=[f"{m} {p}" for (m, p), _ in groups])
    for j, ((m, p), g) in enumerate(groups):
        g = g.sort_values("g_wave_us")
        for col, name, style in (("span_remote_us", "measured, remote stores", {}),
                                 ("span_local_us", "measured, local-store control",
                                  dict(dash="dot")),
                                 ("span_pred_us", "model (eqs. 3–4)", dict(dash="dash"))):
            fig.add_scatter(x=g["g_wave_us"], y=g[col], mode="lines+markers", name=name,
                            line=dict(color=COLORS[["span_remote_us", "span_local_us",
                                                     "span_pred_us"].index(col)], **style),
                            legendgroup=name, showlegend=j == 0, row=1, col=j + 1)
        fig.add_vline(x=float(g["g_star_us"].iloc[0]), line_dash="dot", row=1, col=j + 1,
                      annotation_text="G*")
        fig.update_xaxes(title_text="G_wave: Linear-2 mainloop (µs)", type="log", row=1,
                         col=j + 1)
    fig.update_yaxes(title_text="Expert-Wave Linear-2 span T_RS (µs)", row=1, col=1)
    fig.update_layout(title=f"The X-Stage inside the fused kernel, {platform} "
                            "(synthetic: a fraction of every mainloop's K blocks)")
    return fig


def moe_span_distributions(trace_record, paper: dict | None = None) -> go.Figure:
    """Fig. 10: the sampled Linear-2 remote-store spans T_RS per model, Expert-Wave and
    Interleaved, with the local-store controls; the paper's median ranges as bands."""
    t = trace_record.table
    runs = t[t["kind"] == "trace"]
    fig = go.Figure()
    series = (("wave", "remote", "Expert-Wave"), ("interleaved", "remote", "Interleaved"),
              ("wave", "local", "Expert-Wave, local stores"),
              ("interleaved", "local", "Interleaved, local stores"))
    for i, (sched, path, label) in enumerate(series):
        sel = runs[(runs["schedule"] == sched) & (runs["path"] == path)]
        xs, ys = [], []
        for row in sel.to_dict("records"):
            sample = _cell(row["sample"])
            if isinstance(sample, dict):  # rows without a sample: nothing to draw
                xs += [row["model"]] * len(sample["span_us"])
                ys += sample["span_us"]
        if ys:
            fig.add_box(x=xs, y=ys, name=label, marker_color=COLORS[i], boxpoints=False,
                        offsetgroup=str(i))
    if paper is not None:
        for key, color in (("span_wave_median_range_us", COLORS[0]),
                           ("span_int_median_range_us", COLORS[1])):
            lo, hi = paper["fig10"][key]
            fig.add_hrect(y0=lo, y1=hi, fillcolor=color, opacity=0.12, line_width=0)
            # annotations on a log axis take log10 positions (shapes take data values)
            fig.add_annotation(x=0, xref="paper", xanchor="left", yanchor="bottom", y=np.log10(hi),
                               text=f"paper {key.split('_')[1]} medians", showarrow=False)
    # log axis: this platform's spans and the paper's bands differ by an order of magnitude
    fig.update_layout(boxmode="group", title=f"{trace_record.platform}: Fig. 10, Linear-2 "
                      "remote-store span per tile", xaxis_title="model",
                      yaxis_title="T_RS (µs)", yaxis_type="log")
    return fig


def moe_trace_runs(trace_record) -> pd.DataFrame:
    """Fig. 10's numbers: per traced shape, schedule and store path, the Linear-2 T_RS median and
    quartiles, its excess over the local-store control (``span_excess_us``), the mainloop medians,
    the Linear-2 dependency-wait share and the makespan of the traced launch."""
    t = trace_record.table
    cols = ["model", "precision", "routing", "tokens", "schedule", "path", "span_l2_us",
            "span_l2_p25_us", "span_l2_p75_us", "span_excess_us", "mainloop_l1_us",
            "mainloop_l2_us", "wait_l2_share", "makespan_us"]
    runs = t[t["kind"] == "trace"]
    return runs[[c for c in cols if c in runs]].round(3).reset_index(drop=True)


def moe_d_sweep_rows(trace_record) -> pd.DataFrame:
    """The D sweep's numbers (``moe_d_sweep``): per model and lead D, both schedules' times of one
    run, the speedup and the traced launch's Linear-2 dependency-wait share."""
    t = trace_record.table
    cols = ["model", "precision", "routing", "tokens", "d_knee", "lead_rows", "d_factor",
            "wave_us", "interleaved_us", "speedup", "wait_l2_share"]
    sweep = t[t["kind"] == "d_sweep"]
    return sweep[[c for c in cols if c in sweep]].round(3).reset_index(drop=True)


def moe_tensor_core_timeline(trace_record, model: str) -> go.Figure:
    """Fig. 9 equivalent: the fraction of SMs inside a Linear-1 or Linear-2 mainloop over time
    (from the in-kernel %globaltimer stamps), Expert-Wave above Interleaved, same time axis."""
    t = trace_record.table
    runs = t[(t["kind"] == "trace") & (t["path"] == "remote") & (t["model"] == model)]
    names = {"wave": "Expert-Wave", "interleaved": "Interleaved"}
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, subplot_titles=list(names.values()))
    for r, sched in enumerate(names, start=1):
        row = runs[runs["schedule"] == sched]
        if row.empty:
            continue
        line = _cell(row.iloc[0]["timeline"])
        for i, (key, label) in enumerate((("l1", "Linear-1 mainloop"), ("l2", "Linear-2 mainloop"))):
            fig.add_scatter(x=line["t_us"], y=np.asarray(line[key]) * 100, stackgroup=f"s{r}",
                            name=label, line=dict(color=COLORS[i + 2]), showlegend=r == 1,
                            row=r, col=1)
    fig.update_yaxes(title_text="SMs in a mainloop (%)", range=[0, 100])
    fig.update_xaxes(title_text="time since the first tile (µs)", row=2, col=1)
    fig.update_layout(title=f"{trace_record.platform}: Fig. 9 equivalent, {model} "
                            f"(Tensor-Core activity from per-tile stamps)")
    return fig


def moe_d_sweep(trace_record) -> go.Figure:
    """Interleaved speedup over Expert-Wave against the lead D / D_knee (eq. 16), with the share
    of SM time Linear-2 tiles spend waiting for their Linear-1 inputs (starvation)."""
    t = trace_record.table
    sweep = t[t["kind"] == "d_sweep"].sort_values("lead_rows")
    fig = make_subplots(rows=1, cols=2, subplot_titles=["T_wave / T_interleaved",
                                                        "Linear-2 dependency wait, share of SM time"])
    for i, (m, grp) in enumerate(sweep.groupby("model", sort=False)):
        c = COLORS[i % len(COLORS)]
        fig.add_scatter(x=grp["d_factor"], y=grp["speedup"], mode="lines+markers", name=m,
                        line=dict(color=c), row=1, col=1)
        fig.add_scatter(x=grp["d_factor"], y=grp["wait_l2_share"], mode="lines+markers", name=m,
                        line=dict(color=c), showlegend=False, row=1, col=2)
    fig.update_xaxes(type="log", title_text="D / D_knee")
    fig.update_yaxes(title_text="T_wave / T_interleaved", row=1, col=1)
    fig.update_yaxes(title_text="share of SM time", row=1, col=2)
    fig.add_hline(y=1.0, line=dict(dash="dot"), row=1, col=1)
    fig.update_layout(title=f"{trace_record.platform}: lead D around D_knee (eq. 16)")
    return fig
