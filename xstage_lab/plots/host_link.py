"""Figures of the host link (issue 26): the MoE matrix with its Combine into host memory,
forecast beside measurement; the attention model on the host link's M_X beside NVLink's."""
from __future__ import annotations

import plotly.graph_objects as go

from .style import COLORS


def moe_host_speedups(comparison, platform: str, miss_pp: float) -> go.Figure:
    """Interleaved's speedup over Expert-Wave per cell of the host-link matrix, the forecast's
    (x) against the measured (y), one colour per host share; the diagonal and the ±``miss_pp``
    band within which the forecast counts as met."""
    fig = go.Figure()
    lo = float(min(comparison["predicted_speedup"].min(), comparison["measured_speedup"].min()))
    hi = float(max(comparison["predicted_speedup"].max(), comparison["measured_speedup"].max()))
    edge = [lo - 0.05, hi + 0.05]
    band = miss_pp / 100
    fig.add_scatter(x=edge + edge[::-1], y=[edge[0] + band, edge[1] + band,
                                            edge[1] - band, edge[0] - band],
                    fill="toself", mode="none", fillcolor="rgba(128,128,128,0.15)",
                    name=f"±{miss_pp:g} percentage points")
    fig.add_scatter(x=edge, y=edge, mode="lines", line=dict(color="grey", dash="dot"),
                    name="forecast = measured")
    for i, (h, g) in enumerate(comparison.groupby("host_share", sort=True)):
        text = g["model"] + " " + g["precision"] + " " + g["routing"]
        fig.add_scatter(x=g["predicted_speedup"], y=g["measured_speedup"], mode="markers",
                        marker=dict(color=COLORS[i % len(COLORS)], size=8), text=text,
                        name=f"{int(h)} of 8 sources in host memory")
    fig.update_xaxes(title_text="forecast T_wave / T_interleaved")
    fig.update_yaxes(title_text="measured T_wave / T_interleaved")
    fig.update_layout(title=f"Host link ({platform}): Interleaved speedup, forecast against "
                            "measurement")
    return fig


def attention_links(paper: dict, by_link: dict) -> go.Figure:
    """E_res/T_FA against M: the paper's FA4 (measured on NVLink), and per (``fa_a2a``
    platform, host-link platform) of ``by_link`` (``attention_model.host_link_comparisons``)
    the X-Stage (eqs. 18–19) and completion-coupled (eq. 17) predictions on the platform's
    NVLink M_X (dashed) and on the host link's (solid): predictions only, nothing measured over
    the host link."""
    fig = go.Figure()
    fa4 = paper["FA4"]
    fig.add_scatter(x=paper["M"], y=[e / t * 100 for e, t in zip(fa4["e_res_us"], fa4["fa_us"])],
                    mode="lines+markers", name="paper FA4, P=8 (measured, NVLink)",
                    line=dict(color="gray"))
    for i, ((platform, host), t) in enumerate(by_link.items()):
        color = COLORS[i % len(COLORS)]
        group = dict(legendgroup=f"{platform}/{host}",
                     legendgrouptitle_text=f"{platform} FA-only times on {host}'s M_X and NVLink's")
        for link, dash in (("nvlink", "dash"), ("host", "solid")):
            for model, symbol, what in (("e_drain", "circle", "X-Stage"),
                                        ("e_cc", "x", "completion-coupled")):
                fig.add_scatter(x=t["M"], y=t[f"{link}_{model}_us"] / t["fa_us"] * 100,
                                mode="lines+markers", marker=dict(symbol=symbol),
                                line=dict(color=color, dash=dash),
                                name=f"{what} predicted, {link} M_X", **group)
    fig.update_layout(title="The attention model per link: predicted E_res/T_FA",
                      xaxis_title="M (tokens)", yaxis_title="E_res / T_FA (%)",
                      legend=dict(groupclick="toggleitem"))
    return fig
