"""Figures of the host link (issue 26): the MoE matrix with its Combine into host memory,
forecast beside measurement."""
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
