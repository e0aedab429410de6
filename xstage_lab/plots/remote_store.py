"""Figures and tables of the remote-store experiments: the Fig. 3 characterization and Table 1
(``remote_store``), the drain rate per GPU pair, receiver-seen visibility (``visibility``), and
the injection patterns and remote operations beyond the paper (``injection_patterns``,
``remote_ops``), each from its record and the fits made when it was written or loaded."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .. import model
from ..calibration import Calibration, IsolatedFit, kb_key
from .style import COLORS, KIB, MIB, kb_text


def fig3a_issue_time(cal: Calibration, predicted: pd.DataFrame) -> go.Figure:
    """Fig. 3(a): sender-visible issue time against the producer-side gap, remote and local,
    with eq. 3 drawn from the calibrated (T_iss^0, R) and no refit."""
    fig = go.Figure()
    g = np.linspace(0, predicted["gap_us"].max() + cal.loop_gap_us, 400)
    for i, (b, grp) in enumerate(predicted.groupby("burst_bytes")):
        color = COLORS[i % len(COLORS)]
        k = int(grp["producers"].iloc[0])
        remote, local = grp[grp["path"] == "remote"], grp[grp["path"] == "local"]
        gap_r = remote["gap_us"] + cal.loop_gap_us
        fig.add_scatter(x=gap_r, y=remote["t_iss_us"], mode="markers", marker=dict(color=color),
                        name=f"remote B={kb_text(b)}",
                        error_y=dict(type="data", symmetric=False,
                                     array=remote["t_iss_us_p75"] - remote["t_iss_us"],
                                     arrayminus=remote["t_iss_us"] - remote["t_iss_us_p25"]))
        fig.add_scatter(x=local["gap_us"] + cal.loop_gap_us, y=local["t_iss_us"], mode="markers",
                        marker=dict(color=color, symbol="x"), name=f"local control B={kb_text(b)}")
        t0 = cal.t_iss0_us[kb_key(k, b)]
        fig.add_scatter(x=g, y=model.issue_time(g, k * b, t0, cal.drain_rate_GBps), mode="lines",
                        line=dict(color=color, dash="dash"), name=f"eq. 3, B={kb_text(b)}")
    fig.update_layout(title=f"Fig. 3(a) {cal.platform}: issue time vs gap (K={cal.sm_count})",
                      xaxis_title="producer-side gap G (µs, incl. loop overhead)",
                      yaxis_title="T_iss (µs)", yaxis_type="log")
    return fig


def fig3b_period(cal: Calibration, predicted: pd.DataFrame) -> go.Figure:
    """Fig. 3(b): start-to-start period against the gap: the max law T_iss^0 + G vs V/R (eqs. 1–3)
    against the completion-coupled sum law G + V/R."""
    fig = go.Figure()
    remote_all = predicted[predicted["path"] == "remote"]
    g = np.linspace(0, remote_all["gap_us"].max() + cal.loop_gap_us, 400)
    for i, (b, remote) in enumerate(remote_all.groupby("burst_bytes")):
        color = COLORS[i % len(COLORS)]
        k = int(remote["producers"].iloc[0])
        t0 = cal.t_iss0_us[kb_key(k, b)]
        fig.add_scatter(x=remote["gap_us"] + cal.loop_gap_us, y=remote["period_us"],
                        mode="markers", marker=dict(color=color), name=f"measured B={kb_text(b)}")
        fig.add_scatter(x=g, y=model.period(g, k * b, t0, cal.drain_rate_GBps), mode="lines",
                        line=dict(color=color, dash="dash"), name=f"max law B={kb_text(b)}")
        fig.add_scatter(x=g, y=model.period_completion_coupled(g, k * b, cal.drain_rate_GBps),
                        mode="lines", line=dict(color=color, dash="dot", width=1),
                        name=f"sum law (completion-coupled) B={kb_text(b)}")
    fig.update_layout(title=f"Fig. 3(b) {cal.platform}: burst period vs gap",
                      xaxis_title="producer-side gap G (µs)", yaxis_title="T_period (µs)")
    return fig


def fig_two_worlds(cal: Calibration) -> go.Figure:
    """The decoupled and the completion-coupled issuer measured side by side (issue 8): periods
    of the periodic and the fenced sweep against the gap, with the max law (eqs. 1–3) and the sum
    law G + V/R + T_lat."""
    fit = cal.completion
    periods = pd.DataFrame(fit["periods"])
    k = fit["producers"]
    fig = go.Figure()
    g = np.linspace(0, periods["G"].max() + cal.loop_gap_us, 300)
    for i, (b, grp) in enumerate(periods.groupby("B")):
        color = COLORS[i % len(COLORS)]
        v = k * b
        x = grp["G"] + cal.loop_gap_us
        fig.add_scatter(x=x, y=grp["period_decoupled_us"], mode="markers", marker=dict(color=color),
                        name=f"decoupled B={kb_text(b)}")
        fig.add_scatter(x=x, y=grp["period_coupled_us"], mode="markers",
                        marker=dict(color=color, symbol="diamond-open"), name=f"fenced B={kb_text(b)}")
        t0 = cal.t_iss0_us.get(kb_key(k, b))
        if t0 is not None:
            fig.add_scatter(x=g, y=model.period(g, v, t0, cal.drain_rate_GBps), mode="lines",
                            line=dict(color=color, dash="dash"), name=f"max law B={kb_text(b)}")
        fig.add_scatter(x=g, y=model.period_completion_coupled(g, v, cal.drain_rate_GBps)
                        + fit["completion_latency_us"], mode="lines",
                        line=dict(color=color, dash="dot"), name=f"sum law + T_lat B={kb_text(b)}")
    fig.update_layout(title=(f"{cal.platform}: decoupled vs completion-coupled issuer, measured "
                             f"(T_lat = {fit['completion_latency_us']:.2f} µs)"),
                      xaxis_title="producer-side gap G (µs)", yaxis_title="T_period (µs)")
    return fig


def fig3c_isolated(cal: Calibration, isolated: pd.DataFrame) -> go.Figure:
    """Fig. 3(c): isolated-burst issue time against aggregate volume with the eq. 7 fit per K
    and its knee."""
    fig = go.Figure()
    for i, (k, grp) in enumerate(isolated[isolated["path"] == "remote"].groupby("producers")):
        color = COLORS[i % len(COLORS)]
        fit = IsolatedFit(**cal.isolated[str(int(k))])
        v = np.geomspace(grp["burst_volume"].min(), grp["burst_volume"].max(), 300)
        fig.add_scatter(x=grp["burst_volume"] / MIB, y=grp["t_iss_us"], mode="markers",
                        marker=dict(color=color), name=f"remote K={k}")
        fig.add_scatter(x=v / MIB, y=fit.predict(v), mode="lines",
                        line=dict(color=color, dash="dash"), name=f"eq. 7 fit K={k}")
        if fit.knee_volume_bytes is not None:
            fig.add_vline(x=fit.knee_volume_bytes / MIB, line=dict(color=color, dash="dot"))
    local = isolated[isolated["path"] == "local"]
    for k, grp in local.groupby("producers"):
        fig.add_scatter(x=grp["burst_volume"] / MIB, y=grp["t_iss_us"], mode="markers",
                        marker=dict(symbol="x", color="gray"), name=f"local control K={k}")
    fig.update_layout(title=f"Fig. 3(c) {cal.platform}: isolated burst, capacity knee",
                      xaxis_title="aggregate burst volume V (MiB)", yaxis_title="T_iss^iso (µs)",
                      xaxis_type="log", yaxis_type="log")
    return fig


def fig3d_drain_rate(cal: Calibration, zero_gap: pd.DataFrame) -> go.Figure:
    """Fig. 3(d): zero-gap steady-state period over K/B decompositions with T = V/R (eq. 1)."""
    fig = go.Figure()
    aligned = zero_gap[zero_gap["align"] == "each"]
    for i, (k, grp) in enumerate(aligned.groupby("producers")):
        fig.add_scatter(x=grp["burst_volume"] / MIB, y=grp["period_us"], mode="markers",
                        marker=dict(color=COLORS[i % len(COLORS)]), name=f"K={k}")
    v = np.linspace(0, aligned["burst_volume"].max(), 100)
    fig.add_scatter(x=v / MIB, y=model.drain_time(v, cal.drain_rate_GBps), mode="lines",
                    line=dict(color="black", dash="dash"),
                    name=f"V/R, R = {cal.drain_rate_GBps:.0f} GB/s")
    fig.update_layout(title=f"Fig. 3(d) {cal.platform}: zero-gap period, shared drain rate",
                      xaxis_title="aggregate burst volume V (MiB)",
                      yaxis_title="steady-state T_period (µs)")
    return fig


def calibration_summary_table(calibrations: list[Calibration]) -> pd.DataFrame:
    """Every platform's ``summary --json`` calibration entry side by side."""
    return (pd.DataFrame({c.platform: c.summary() for c in calibrations})
            .rename_axis("quantity").reset_index().astype(str))


def table1_comparison(paper: dict, calibrations: list[Calibration]) -> pd.DataFrame:
    """Table 1's parameters: the paper's beside each platform's, with the spread measured."""
    rows = [("SMs per GPU (K max)", paper["sm_count"], lambda c: c.sm_count),
            ("R (GB/s)", paper["R_GBps"],
             lambda c: f"{c.drain_rate_GBps:.1f} [IQR {c.drain_rate_p25:.1f}–{c.drain_rate_p75:.1f}]")]
    for key, value in paper["T_iss0_us"].items():
        rows.append((f"T_iss^0 (µs) at B={kb_text(key.split('B=')[1])}, K=all SMs", value,
                     lambda c, b=key.split("B=")[1]: _t_iss0_text(c, int(b))))
    rows.append(("Q (MiB), K = all SMs", next(iter(paper["Q_MiB"].values())), _capacity_text))
    rows.append(("knee (KB per producer), K = all SMs",
                 next(iter(paper["knee_KB_per_producer"].values())),
                 lambda c: _fmt(_knee_per_producer(c), KIB)))
    for key, value in paper["G_star_us"].items():
        b = int(key.split("B=")[1])
        rows.append((f"G* (µs) at B={kb_text(b)}, K=all SMs", value,
                     lambda c, b=b: _fmt(c.recovery_gap_us.get(kb_key(c.sm_count, b)), 1)))
    rows.append(("gap sweep, no-refit median |error| of T_iss (%)", None,
                 lambda c: f"{c.gap_issue_err_pct:.2f} (drain branch {c.gap_drain_branch_err_pct:.2f})"))
    return pd.DataFrame([{"quantity": name, "paper": _paper_text(paper_value),
                          **{c.platform: f(c) for c in calibrations}}
                         for name, paper_value, f in rows])


def _paper_text(value) -> str:
    """A value of the paper as printed: integers as integers, a blank where it gives none."""
    return "" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _fmt(value, unit) -> str:
    return "—" if value is None else f"{value / unit:.3g}"


def _capacity_text(c: Calibration) -> str:
    q = c.isolated.get(str(c.sm_count), {}).get("capacity_bytes")
    spread = c.capacity_spread.get(str(c.sm_count))
    if q is None or spread is None:
        return _fmt(q, MIB)
    return f"{q / MIB:.3g} [IQR {spread[0] / MIB:.3g}–{spread[1] / MIB:.3g}]"


def _knee_per_producer(c: Calibration):
    fit = c.isolated.get(str(c.sm_count), {})
    knee = fit.get("knee_volume_bytes")
    return None if knee is None else knee / c.sm_count


def _t_iss0_text(c: Calibration, b: int) -> str:
    key = kb_key(c.sm_count, b)
    if key not in c.t_iss0_us:
        return "—"
    lo, hi = c.t_iss0_spread[key]
    return f"{c.t_iss0_us[key]:.3f} [IQR {lo:.3f}–{hi:.3f}]"


def drain_rate_heatmap(points: pd.DataFrame, platform: str) -> go.Figure:
    """Zero-gap aggregate rate V/T_period of every ordered GPU pair (the ``pairs`` sweep), at
    its largest burst: the drain rate R per source → destination."""
    largest = points[points["burst_bytes"] == points["burst_bytes"].max()]
    rate = (largest["burst_volume"] / largest["period_us"] / 1e3).to_numpy()
    grid = pd.DataFrame({"src": largest["src"].to_numpy(), "dst": largest["dst"].to_numpy(),
                         "rate": rate}).pivot(index="src", columns="dst", values="rate")
    fig = go.Figure(go.Heatmap(z=grid.to_numpy(), x=[f"to GPU {d}" for d in grid.columns],
                               y=[f"GPU {s}" for s in grid.index],
                               colorbar=dict(title="GB/s (scale from 0)"),
                               zmin=0,  # from zero: equal links must not look apart by noise
                               text=np.round(grid.to_numpy(), 1), texttemplate="%{text}"))
    fig.update_layout(title=(f"{platform}: zero-gap drain rate per ordered pair, "
                             f"B = {kb_text(largest['burst_bytes'].iloc[0])}, K = "
                             f"{int(largest['producers'].iloc[0])}"),
                      xaxis_title="destination", yaxis_title="source")
    return fig


def fig_visibility_latency(vis) -> go.Figure:
    """Issue-to-visibility latency seen from the receiver (issue 8 part 2): every (burst,
    producer) of a ``visibility`` record, boxes per burst volume B, one colour per gap G, one
    panel per producer count K."""
    table = vis.record.table
    ks = sorted(table["producers"].unique())
    gaps = sorted(table["gap_us"].unique())
    fig = make_subplots(rows=1, cols=len(ks), shared_yaxes=True,
                        subplot_titles=[f"K = {k}" for k in ks])
    for col, k in enumerate(ks, start=1):
        for i, g in enumerate(gaps):
            sel = table[(table["producers"] == k) & (table["gap_us"] == g)]
            fig.add_box(x=sel["burst_bytes"].map(kb_text), y=sel["latency_us"], name=f"G = {g:g} µs",
                        legendgroup=f"G{g}", showlegend=col == 1, boxpoints=False,
                        marker=dict(color=COLORS[i % len(COLORS)]), row=1, col=col)
    a = vis.alignment
    fig.update_layout(boxmode="group", yaxis_title="issue end → flag visible at the receiver (µs)",
                      title=(f"{vis.record.platform}: remote-visible completion seen from the "
                             f"receiver (clock offset ±{a['uncertainty_ns']:.0f} ns)"))
    fig.update_xaxes(title_text="burst volume per producer B")
    return fig


def visibility_alignment_table(visibilities) -> pd.DataFrame:
    """The measured alignment of the two GPUs' %globaltimers, per platform."""
    rows = []
    for v in visibilities:
        a = v.alignment
        rows.append({"platform": v.record.platform,
                     "θ before (ns)": a["before"]["offset_ns"], "θ after (ns)": a["after"]["offset_ns"],
                     "drift (ns)": a["drift_ns"], "over (s)": round(a["span_s"], 2),
                     "RTT min before/after (ns)": f"{a['before']['rtt_min_ns']}/"
                                                  f"{a['after']['rtt_min_ns']}",
                     "RTT median (ns)": a["before"]["rtt_median_ns"],
                     "swap check before/after (ns)": f"{a['swap_check_ns'][0]:g}/"
                                                     f"{a['swap_check_ns'][1]:g}",
                     "timer step src/dst (ns)": f"{a['resolution_src']['resolution_ns']}/"
                                                f"{a['resolution_dst']['resolution_ns']}",
                     "± bound (ns)": a["uncertainty_ns"]})
    return pd.DataFrame(rows)


def visibility_latency_table(vis, column: str = "latency_us") -> pd.DataFrame:
    """Median per-producer latency (µs; every burst and repeat) per (K, B), one column per G."""
    t = vis.points.pivot(index=["producers", "burst_bytes"], columns="gap_us", values=column)
    t.columns = [f"G = {g:g} µs" for g in t.columns]
    return t.rename_axis(index=["K", "B"]).round(3).reset_index()


def visibility_first_burst_table(vis) -> pd.DataFrame:
    """The aligned first burst per (K, B, G) against T_complete(K, V), with the fraction of
    launches whose next burst overlapped it (those gaps are left out of the comparison)."""
    cols = {"producers": "K", "burst_bytes": "B", "gap_us": "G (µs)",
            "visible_from_start_us": "visible from start (µs)",
            "aggregate_visible_us": "last flag visible (µs)",
            "T_complete_model_us": "T_complete (µs)", "diff_us": "difference (µs)",
            "overlapped": "next burst overlapped", "isolated": "isolated"}
    return vis.first_burst[list(cols)].rename(columns=cols).round(3)


def visibility_completion_table(vis) -> pd.DataFrame:
    """The aligned first burst's receiver-seen completion over the isolated gaps (G ≥ gap_min)
    against the fenced sweep's T_complete(K, V) = V/R + T_lat."""
    cols = {"producers": "K", "burst_bytes": "B", "visible_from_start_us": "visible from start (µs)",
            "aggregate_visible_us": "last flag visible (µs)",
            "T_complete_model_us": "T_complete = V/R + T_lat (µs)", "diff_us": "difference (µs)",
            "aggregate_diff_us": "last flag − T_complete (µs)",
            "T_complete_fenced_us": "fenced sweep measured (µs)",
            "fenced_diff_us": "difference to fenced (µs)", "gap_min_us": "gaps ≥ (µs)",
            "launches": "launches"}
    return vis.comparison[list(cols)].rename(columns=cols).round(3)


def patterns_drain_heatmap(entry: dict, platform: str) -> go.Figure:
    """Fitted drain rate R of every ordered GPU pair, one-to-one (aligned zero-gap bursts,
    eq. 1), from the patterns record: the topology heat map."""
    cells = [(inst["sources"][0]["src"], int(inst["routes"].split(">")[1]),
              inst["sources"][0].get("R_GBps", np.nan))
             for inst in entry["per_instance"]
             if inst["pattern"] == "one_to_one" and inst["sources"]]
    grid = pd.DataFrame(cells, columns=["src", "dst", "rate"]).pivot(index="src", columns="dst",
                                                                     values="rate")
    fig = go.Figure(go.Heatmap(z=grid.to_numpy(), x=[f"to GPU {d}" for d in grid.columns],
                               y=[f"GPU {s}" for s in grid.index],
                               colorbar=dict(title="GB/s (scale from 0)"),
                               zmin=0,  # from zero: equal links must not look apart by noise
                               text=np.round(grid.to_numpy(), 1), texttemplate="%{text}"))
    fig.update_layout(title=f"{platform}: fitted drain rate R per ordered pair (one-to-one)",
                      xaxis_title="destination", yaxis=dict(autorange="reversed", title="source"))
    return fig


def patterns_rates(table: pd.DataFrame, platform: str) -> go.Figure:
    """Per pattern instance and source: the fitted R beside the no-refit prediction (the
    one-to-one R times the drain share); ``table``: ``remote_store.tables.patterns_table``."""
    table = table[table["fit"] == "ok"]
    label = table["pattern"] + " " + table["instance"] + " · src " + table["src"].astype(str)
    fig = go.Figure()
    fig.add_bar(x=label, y=table["R (GB/s)"], name="fitted R")
    fig.add_bar(x=label, y=table["R predicted (GB/s)"], name="one-to-one R × drain share")
    fig.update_layout(title=f"{platform}: drain rate per injection pattern and source",
                      xaxis_title="pattern, instance and source GPU", yaxis_title="GB/s",
                      barmode="group")
    return fig


def operations_gap_sweeps(fits: dict, baseline: str, platform: str) -> go.Figure:
    """Each operation's remote gap sweep (larger B): measured T_iss against the gap the
    producers saw, with eq. 3 from its own fit and from the ``baseline`` operation's M_X (the
    16-byte stores; no refit). ``fits``: a ``remote_ops`` record's fits per operation
    (``remote_ops.operation_fits``)."""
    base = fits[baseline].calibration
    ok = {op: f for op, f in fits.items() if f.calibration is not None}
    fig = make_subplots(rows=1, cols=len(ok), subplot_titles=list(ok), shared_yaxes=False)
    for col, (op, f) in enumerate(ok.items(), start=1):
        cal, pts = f.calibration, f.predicted
        pts = pts[(pts["path"] == "remote") & (pts["burst_bytes"] == pts["burst_bytes"].max())]
        v, k, b = pts["burst_volume"].iloc[0], pts["producers"].iloc[0], pts["burst_bytes"].iloc[0]
        first = col == 1
        fig.add_scatter(x=pts["gap_us"] + cal.loop_gap_us, y=pts["t_iss_us"], mode="markers",
                        marker=dict(color=COLORS[0]), name="measured", showlegend=first,
                        row=1, col=col)
        g = np.linspace(0, (pts["gap_us"] + cal.loop_gap_us).max(), 200)
        fig.add_scatter(x=g, y=model.issue_time(g, v, cal.t_iss0_us[kb_key(k, b)],
                                                cal.drain_rate_GBps),
                        line=dict(color=COLORS[1]), name="eq. 3, own fit", showlegend=first,
                        row=1, col=col)
        if base is not None:
            fig.add_scatter(x=g, y=model.issue_time(g, v, base.t_iss0_us[kb_key(k, b)],
                                                    base.drain_rate_GBps),
                            line=dict(color=COLORS[2], dash="dash"),
                            name=f"eq. 3, {baseline} M_X (no refit)", showlegend=first,
                            row=1, col=col)
        fig.update_xaxes(title_text="gap G (µs)", row=1, col=col)
    fig.update_yaxes(title_text="T_iss (µs)", row=1, col=1)
    fig.update_layout(title=f"{platform}: issue time against gap per remote operation, "
                            f"B = {kb_text(b)}, K = {int(k)}")
    return fig
