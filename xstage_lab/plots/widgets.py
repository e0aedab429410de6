"""ipywidgets explorers over a calibration: the burst–gap explorer (eqs. 3, 7) and the design
test calculator (eq. 10). Under papermill each renders once at its defaults."""
from __future__ import annotations

import numpy as np
import pandas as pd
from plotly.subplots import make_subplots

from .. import model
from ..calibration import Calibration
from .publish import mime_bundle
from .style import KIB, MIB


def _live_output(render, controls: dict):
    """An ipywidgets Output showing the MIME bundle ``render(**values of controls)``, shown again
    whenever a control changes. The bundle is set as the widget's state (``outputs``) instead of
    being captured from the kernel's output (``with out: clear_output(wait=True); display``):
    papermill runs of notebook 01 that captured the burst-gap explorer's figure that way hung
    twice in about ten CI runs, the kernel idle and the client still waiting on the cell."""
    import ipywidgets as w

    out = w.Output()

    def update(_=None):
        bundle = render(**{name: c.value for name, c in controls.items()})
        out.outputs = ({"output_type": "display_data", "data": bundle, "metadata": {}},)

    for control in controls.values():
        control.observe(update, names="value")
    update()
    return out


def explore_burst_gap(cal: Calibration, predicted: pd.DataFrame):
    """An ipywidgets explorer: move K, B and G and see eq. 3 and eq. 7 beside the measured gap
    sweep. Under papermill it renders once at its defaults."""
    import ipywidgets as w
    from IPython.display import display

    measured_b = sorted(int(b) for b in predicted["burst_bytes"].unique())
    floor = cal.platform_model()
    ks = w.IntSlider(value=cal.sm_count, min=1, max=cal.sm_count, description="K")
    bs = w.SelectionSlider(options=[(f"{b // KIB} KB", b) for b in
                                    sorted(set(measured_b) | {k * KIB for k in (4, 12, 24, 48, 96)})],
                           value=measured_b[0], description="B")
    gs = w.FloatSlider(value=2.0, min=0.0, max=float(predicted["gap_us"].max()), step=0.5,
                       description="G (µs)")

    def draw(K, B, G):
        t0 = floor.t_iss0_at(K, B)
        v = K * B
        g = np.linspace(0, gs.max + cal.loop_gap_us, 300)
        fig = make_subplots(rows=1, cols=2, subplot_titles=("issue time (eq. 3)", "period (eqs. 1–3)"))
        fig.add_scatter(x=g, y=model.issue_time(g, v, t0, cal.drain_rate_GBps), row=1, col=1,
                        name="model T_iss")
        fig.add_scatter(x=g, y=model.period(g, v, t0, cal.drain_rate_GBps), row=1, col=2,
                        name="model T_period")
        data = predicted[(predicted["path"] == "remote") & (predicted["producers"] == K)
                         & (predicted["burst_bytes"] == B)]
        if len(data):
            fig.add_scatter(x=data["gap_us"] + cal.loop_gap_us, y=data["t_iss_us"], mode="markers",
                            row=1, col=1, name="measured T_iss")
            fig.add_scatter(x=data["gap_us"] + cal.loop_gap_us, y=data["period_us"],
                            mode="markers", row=1, col=2, name="measured T_period")
        for col in (1, 2):
            fig.add_vline(x=G, line=dict(dash="dot"), row=1, col=col)
        fig.update_layout(title=(f"K={K}, B={B // KIB} KB, V={v / MIB:.2f} MiB: "
                                 f"T_iss(G)={float(model.issue_time(G, v, t0, cal.drain_rate_GBps)):.2f} µs, "
                                 f"G*={float(model.recovery_gap(v, t0, cal.drain_rate_GBps)):.2f} µs"),
                          height=380)
        return mime_bundle(fig)

    display(w.VBox([w.HBox([ks, bs, gs]), _live_output(draw, {"K": ks, "B": bs, "G": gs})]))


def design_calculator(cal: Calibration):
    """An ipywidgets calculator of the design test (eq. 10): K producers each storing one
    b_rows × b_cols tile of ``bytes`` per element, separated by a mainloop of G µs, on this
    calibrated platform: "piggyback" or "reshape", the issue overhead and the recovery gap.
    Under papermill it renders once at its defaults (an attention output tile, 128 × 128 bf16)."""
    import ipywidgets as w
    from IPython.display import display

    floor = cal.platform_model()
    ks = w.IntSlider(value=cal.sm_count, min=1, max=cal.sm_count, description="K")
    rows = w.IntText(value=128, description="tile rows")
    cols = w.IntText(value=128, description="tile cols")
    elem = w.Dropdown(options=[1, 2, 4], value=2, description="bytes/elem")
    gap = w.FloatText(value=10.0, description="gap G (µs)")

    def show(K, R_, C_, E_, G):
        b = R_ * C_ * E_
        t0, q = floor.t_iss0_at(K, b), floor.capacity_at(K)
        verdict = model.design_test(K * b, G, t0, cal.drain_rate_GBps, q)
        return {"text/html": (
            f"<b>{verdict.action}</b>: V = {K * b / MIB:.2f} MiB, T_iss⁰ = {t0:.2f} µs; "
            f"rate bound {'holds' if verdict.rate_bound else 'fails'} (V/R = "
            f"{float(model.drain_time(K * b, cal.drain_rate_GBps)):.2f} µs vs T_iss⁰ + G); "
            f"capacity bound {'holds' if verdict.capacity_bound else 'fails'} (q_peak = "
            f"{verdict.peak_outstanding_bytes / MIB:.2f} MiB vs Q = {q / MIB:.2f} MiB); "
            f"issue overhead "
            f"{verdict.issue_overhead_us:.2f} µs, recovery gap G* = "
            f"{verdict.recovery_gap_us:.2f} µs, isolated issue {verdict.isolated_issue_us:.2f} µs")}

    display(w.VBox([w.HBox([ks, gap]), w.HBox([rows, cols, elem]),
                    _live_output(show, {"K": ks, "R_": rows, "C_": cols, "E_": elem, "G": gap})]))
