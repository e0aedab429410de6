"""Figures of the fluid simulator (``simulator``) against the measured gap sweep, and of
schedules played through it."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from .style import COLORS, kb_text


def simulated_gap_sweep(predicted: pd.DataFrame, platform: str) -> go.Figure:
    """The simulator's and the closed form's issue times over the measured gap sweep: the
    simulator with every producer's burst aligned and, where ``predicted`` has it
    (``simulator.check_gap_sweep`` with the record), with the producers spread over their
    measured start skew."""
    fig = go.Figure()
    for i, (b, grp) in enumerate(predicted.groupby("burst_bytes")):
        color = COLORS[i % len(COLORS)]
        fig.add_scatter(x=grp["gap_us"], y=grp["t_iss_us"], mode="markers", marker=dict(color=color),
                        name=f"measured B={kb_text(b)}")
        fig.add_scatter(x=grp["gap_us"], y=grp["t_iss_sim_us"], mode="lines",
                        line=dict(color=color), name=f"simulator, aligned B={kb_text(b)}")
        if "t_iss_skew_sim_us" in grp:
            fig.add_scatter(x=grp["gap_us"], y=grp["t_iss_skew_sim_us"], mode="lines",
                            line=dict(color=color, dash="dash"),
                            name=f"simulator, measured start skew B={kb_text(b)}")
        fig.add_scatter(x=grp["gap_us"], y=grp["t_iss_pred_us"], mode="lines",
                        line=dict(color=color, dash="dot"), name=f"eq. 3 B={kb_text(b)}")
    fig.update_layout(title=f"{platform}: fluid simulator against the measured gap sweep",
                      xaxis_title="set gap G (µs)", yaxis_title="T_iss (µs)", yaxis_type="log")
    return fig


def simulated_schedules(traces: dict[str, pd.DataFrame]) -> go.Figure:
    """Per-burst issue times of several schedules played through the simulator."""
    fig = go.Figure()
    for name, trace in traces.items():
        trace = trace[trace["volume"] > 0]
        fig.add_scatter(x=trace["start_us"], y=trace["t_iss_us"], mode="lines+markers", name=name)
    fig.update_layout(title="Simulated schedules: issue time of each remote-store burst",
                      xaxis_title="burst start (µs)", yaxis_title="T_iss (µs)")
    return fig
