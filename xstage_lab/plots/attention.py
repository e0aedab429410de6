"""Figures and tables of Ulysses attention fused with its All-to-All (paper §4.3, §5.3: Table 3,
Fig. 11) and of its per-tile trace, each labelled from its record."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import COLORS

# How tables and legends name an ``fa_a2a`` record's attention kernel (``attention.KERNELS``).
FA_KERNEL_LABELS = {"triton": "Triton FA", "gluon_ws": "Gluon FA (warp-specialized)"}


def fa_kernel(record) -> str:
    """The attention kernel an ``fa_a2a`` record ran: its ``config["kernel"]``. Records from before
    the Gluon kernel (bf9ad5f) have no such key; the Triton kernel was the only one then."""
    return (record.params.get("config") or {}).get("kernel", "triton")


def fa_label(record, row=None) -> str:
    """``<platform> <kernel>, P=.., H=.., d=..``, every part read from the record: the kernel from
    its config, P, heads and head dim from ``row`` (a row of its table; default its first)."""
    r = record.table.iloc[0] if row is None else row
    kernel = fa_kernel(record)
    return (f"{record.platform} {FA_KERNEL_LABELS.get(kernel, kernel)}, P={int(r['P'])}, "
            f"H={int(r['heads'])}, d={int(r['head_dim'])}")


def table3_comparison(paper: dict, records) -> pd.DataFrame:
    """Table 3: the paper's FA4 and FA3 rows (P = 8) beside each platform's measured rows, each
    labelled from its record (``fa_label``)."""
    rows = []
    for gen in ("FA4", "FA3"):
        for i, m in enumerate(paper["M"]):
            p = paper[gen]
            rows.append({"source": f"paper {gen}, P=8", "M": m, "fa_us": p["fa_us"][i],
                         "serial_us": p["serial_us"][i], "fused_us": p["fused_us"][i],
                         "speedup": p["speedup"][i], "hiding_ratio": p["hiding_ratio_pct"][i] / 100})
    for rec in records:
        for _, r in rec.table.iterrows():
            rows.append({"source": fa_label(rec, r), "M": int(r["M"]),
                         "fa_us": r["fa_us"], "serial_us": r["serial_us"], "fused_us": r["fused_us"],
                         "speedup": r["speedup"], "hiding_ratio": r["hiding_ratio"],
                         "a2a_nccl_us": r["a2a_nccl_us"], "a2a_remote_us": r["a2a_remote_us"],
                         "sdpa_nccl_us": r["sdpa_nccl_us"], "fa_tflops": r["fa_tflops"],
                         "cudnn_tflops": r["cudnn_tflops"],
                         # the fenced (completion-coupled) epilogue, where the record has it
                         **{k: r[k] for k in ("fused_fenced_us", "hiding_ratio_fenced")
                            if k in r}})
    return pd.DataFrame(rows).round(3)


def fig11_residual(paper: dict, records, predictions: dict) -> go.Figure:
    """Fig. 11: relative residual E_res/T_FA against M: the paper's FA4, each platform's measured
    residual (against FA-only, and against the same-code FA-only control from paired trials, of
    the decoupled Fused epilogue and, where measured, of the fenced completion-coupled one),
    and the no-refit
    predictions, X-Stage (eqs. 18–19) and completion-coupled (eq. 17), with M*_ub (eq. 20).
    ``predictions`` maps a platform to ``attention_model.residual_predictions``'s table."""
    fig = go.Figure()
    fa4 = paper["FA4"]
    fig.add_scatter(x=paper["M"], y=np.array(fa4["e_res_us"]) / np.array(fa4["fa_us"]) * 100,
                    mode="lines+markers", name="paper FA4, P=8", line=dict(color="gray"))
    for i, rec in enumerate(records):
        color = COLORS[i % len(COLORS)]
        t, pred = rec.table, predictions[rec.platform]
        # one legend group per record, titled with its labels (``fa_label``)
        group = dict(legendgroup=rec.platform, legendgrouptitle_text=fa_label(rec))
        fig.add_scatter(x=t["M"], y=t["e_res_us"] / t["fa_us"] * 100, mode="lines+markers",
                        line=dict(color=color), name="measured vs FA-only", **group)
        for name, what, marker in (("e_res", "Fused", "circle"),
                                   ("e_res_fenced", "Fused-fenced (coupled)", "x")):
            tag = f"{name}_paired_fa_same_code"
            if f"{tag}_us" not in pred:
                continue
            base = pred[f"{tag}_us"] / pred[f"{tag}_rel_pct"]
            fig.add_scatter(
                x=pred["M"], y=pred[f"{tag}_rel_pct"], mode="lines+markers",
                line=dict(color=color, dash="dash"), marker=dict(symbol=marker),
                error_y=dict(type="data", symmetric=False,
                             array=(pred[f"{tag}_p75_us"] - pred[f"{tag}_us"]) / base,
                             arrayminus=(pred[f"{tag}_us"] - pred[f"{tag}_p25_us"]) / base),
                name=f"{what} vs same-code FA-only, paired trials (median, IQR)", **group)
        fig.add_scatter(x=pred["M"], y=pred["e_drain_us"] / pred["fa_us"] * 100, mode="lines",
                        line=dict(color=color, dash="dot"), name="X-Stage prediction", **group)
        fig.add_scatter(x=pred["M"], y=pred["e_cc_us"] / pred["fa_us"] * 100, mode="lines",
                        line=dict(color=color, dash="longdash"),
                        name=f"completion-coupled prediction "
                             f"(T_lat = {pred['t_lat_us'].iloc[0]:.2f} µs)", **group)
        fig.add_vline(x=int(pred["m_star_ub"].max()), line=dict(color=color, dash="dot"),
                      annotation_text=f"M*_ub = {int(pred['m_star_ub'].max())}")
    fig.add_hrect(y0=-2, y1=2, fillcolor="lightblue", opacity=0.3, line_width=0,
                  annotation_text="±2% DVFS envelope (paper)")
    fig.update_layout(title="Fig. 11: sender-visible residual E_res/T_FA", xaxis_title="M (tokens)",
                      yaxis_title="E_res / T_FA (%)", legend=dict(groupclick="toggleitem"))
    return fig


def fa_a2a_times(records) -> go.Figure:
    """Per-method sender-visible time against M, one panel per platform."""
    fig = make_subplots(rows=1, cols=len(records), subplot_titles=[fa_label(r) for r in records])
    methods = ("fa_us", "serial_us", "fused_us", "sdpa_nccl_us", "a2a_nccl_us", "a2a_remote_us")
    for col, rec in enumerate(records, start=1):
        for i, m in enumerate(methods):
            fig.add_scatter(x=rec.table["M"], y=rec.table[m], mode="lines+markers",
                            name=m.removesuffix("_us"), line=dict(color=COLORS[i % len(COLORS)]),
                            showlegend=col == 1, row=1, col=col)
    fig.update_yaxes(type="log", title_text="time (µs)")
    fig.update_xaxes(title_text="M (sequence length)")
    fig.update_layout(title="FA + post-attention All-to-All: time per method")
    return fig


def attention_epilogue_spans(tiles: pd.DataFrame, platform: str) -> go.Figure:
    """The fused attention kernel's per-tile epilogue spans (``attention_trace.tile_table``) per
    M: remote tiles of the grid's first wave and of the later waves, Fused beside its local
    control, as boxes with every point beyond the whiskers (the stalled tiles)."""
    fig = go.Figure()
    series = (("first", "fused", "first wave, Fused"), ("first", "control", "first wave, control"),
              ("later", "fused", "later waves, Fused"),
              ("later", "control", "later waves, control"))
    remote = tiles[tiles["remote"]]
    for i, (wave_class, build, label) in enumerate(series):
        sel = remote[(remote["wave_class"] == wave_class) & (remote["build"] == build)]
        fig.add_box(x=sel["M"].astype(str), y=sel["epilogue_us"], name=label,
                    marker_color=COLORS[i], boxpoints="outliers", offsetgroup=str(i))
    # log axis: a stalled tile takes up to ~50x an unstalled one
    fig.update_layout(boxmode="group", title=f"{platform}: fused attention epilogue span per "
                      "remote output tile", xaxis_title="M", yaxis_title="epilogue (µs)",
                      yaxis_type="log")
    return fig
