"""Figures and tables, drawn only from records and fits, and their publication for ``reproduce``.

``publish``/``publish_table`` display in a notebook (a figure with a static PNG beside its plotly
JSON, so that any notebook viewer shows it) and, when the runner passes an output folder, also
write HTML that opens offline (plotly.js shipped once with the folder), PNG where kaleido finds a
Chrome or Chromium, CSV and Markdown, and add an entry to the folder's ``manifest.jsonl`` from
which the runner builds the index page.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from . import model
from .calibration import Calibration, IsolatedFit, kb_key

KIB = 1024
MIB = 1024 * 1024
_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"]


def _kb(b) -> str:
    return f"{int(b) // KIB} KB"


def fig3a_issue_time(cal: Calibration, predicted: pd.DataFrame) -> go.Figure:
    """Fig. 3(a): sender-visible issue time against the producer-side gap, remote and local,
    with eq. 3 drawn from the calibrated (T_iss^0, R) and no refit."""
    fig = go.Figure()
    g = np.linspace(0, predicted["gap_us"].max() + cal.loop_gap_us, 400)
    for i, (b, grp) in enumerate(predicted.groupby("burst_bytes")):
        color = _COLORS[i % len(_COLORS)]
        k = int(grp["producers"].iloc[0])
        remote, local = grp[grp["path"] == "remote"], grp[grp["path"] == "local"]
        gap_r = remote["gap_us"] + cal.loop_gap_us
        fig.add_scatter(x=gap_r, y=remote["t_iss_us"], mode="markers", marker=dict(color=color),
                        name=f"remote B={_kb(b)}",
                        error_y=dict(type="data", symmetric=False,
                                     array=remote["t_iss_us_p75"] - remote["t_iss_us"],
                                     arrayminus=remote["t_iss_us"] - remote["t_iss_us_p25"]))
        fig.add_scatter(x=local["gap_us"] + cal.loop_gap_us, y=local["t_iss_us"], mode="markers",
                        marker=dict(color=color, symbol="x"), name=f"local control B={_kb(b)}")
        t0 = cal.t_iss0_us[kb_key(k, b)]
        fig.add_scatter(x=g, y=model.issue_time(g, k * b, t0, cal.drain_rate_GBps), mode="lines",
                        line=dict(color=color, dash="dash"), name=f"eq. 3, B={_kb(b)}")
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
        color = _COLORS[i % len(_COLORS)]
        k = int(remote["producers"].iloc[0])
        t0 = cal.t_iss0_us[kb_key(k, b)]
        fig.add_scatter(x=remote["gap_us"] + cal.loop_gap_us, y=remote["period_us"],
                        mode="markers", marker=dict(color=color), name=f"measured B={_kb(b)}")
        fig.add_scatter(x=g, y=model.period(g, k * b, t0, cal.drain_rate_GBps), mode="lines",
                        line=dict(color=color, dash="dash"), name=f"max law B={_kb(b)}")
        fig.add_scatter(x=g, y=model.period_completion_coupled(g, k * b, cal.drain_rate_GBps),
                        mode="lines", line=dict(color=color, dash="dot", width=1),
                        name=f"sum law (completion-coupled) B={_kb(b)}")
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
        color = _COLORS[i % len(_COLORS)]
        v = k * b
        x = grp["G"] + cal.loop_gap_us
        fig.add_scatter(x=x, y=grp["period_decoupled_us"], mode="markers", marker=dict(color=color),
                        name=f"decoupled B={_kb(b)}")
        fig.add_scatter(x=x, y=grp["period_coupled_us"], mode="markers",
                        marker=dict(color=color, symbol="diamond-open"), name=f"fenced B={_kb(b)}")
        t0 = cal.t_iss0_us.get(kb_key(k, b))
        if t0 is not None:
            fig.add_scatter(x=g, y=model.period(g, v, t0, cal.drain_rate_GBps), mode="lines",
                            line=dict(color=color, dash="dash"), name=f"max law B={_kb(b)}")
        fig.add_scatter(x=g, y=model.period_completion_coupled(g, v, cal.drain_rate_GBps)
                        + fit["completion_latency_us"], mode="lines",
                        line=dict(color=color, dash="dot"), name=f"sum law + T_lat B={_kb(b)}")
    fig.update_layout(title=(f"{cal.platform}: decoupled vs completion-coupled issuer, measured "
                             f"(T_lat = {fit['completion_latency_us']:.2f} µs)"),
                      xaxis_title="producer-side gap G (µs)", yaxis_title="T_period (µs)")
    return fig


def fig3c_isolated(cal: Calibration, isolated: pd.DataFrame) -> go.Figure:
    """Fig. 3(c): isolated-burst issue time against aggregate volume with the eq. 7 fit per K
    and its knee."""
    fig = go.Figure()
    for i, (k, grp) in enumerate(isolated[isolated["path"] == "remote"].groupby("producers")):
        color = _COLORS[i % len(_COLORS)]
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
                        marker=dict(color=_COLORS[i % len(_COLORS)]), name=f"K={k}")
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
        rows.append((f"T_iss^0 (µs) at B={_kb(key.split('B=')[1])}, K=all SMs", value,
                     lambda c, b=key.split("B=")[1]: _t_iss0_text(c, int(b))))
    rows.append(("Q (MiB), K = all SMs", next(iter(paper["Q_MiB"].values())), _capacity_text))
    rows.append(("knee (KB per producer), K = all SMs",
                 next(iter(paper["knee_KB_per_producer"].values())),
                 lambda c: _fmt(_knee_per_producer(c), KIB)))
    for key, value in paper["G_star_us"].items():
        b = int(key.split("B=")[1])
        rows.append((f"G* (µs) at B={_kb(b)}, K=all SMs", value,
                     lambda c, b=b: _fmt(c.recovery_gap_us.get(kb_key(c.sm_count, b)), 1)))
    rows.append(("gap sweep, no-refit median |error| of T_iss (%)", None,
                 lambda c: f"{c.gap_issue_err_pct:.2f} (drain branch {c.gap_drain_branch_err_pct:.2f})"))
    return pd.DataFrame([{"quantity": name, "paper": paper_value,
                          **{c.platform: f(c) for c in calibrations}}
                         for name, paper_value, f in rows])


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
        return pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict())

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


def simulated_gap_sweep(predicted: pd.DataFrame, platform: str) -> go.Figure:
    """The simulator's and the closed form's issue times over the measured gap sweep: the
    simulator with every producer's burst aligned and, where ``predicted`` has it
    (``simulator.check_gap_sweep`` with the record), with the producers spread over their
    measured start skew."""
    fig = go.Figure()
    for i, (b, grp) in enumerate(predicted.groupby("burst_bytes")):
        color = _COLORS[i % len(_COLORS)]
        fig.add_scatter(x=grp["gap_us"], y=grp["t_iss_us"], mode="markers", marker=dict(color=color),
                        name=f"measured B={_kb(b)}")
        fig.add_scatter(x=grp["gap_us"], y=grp["t_iss_sim_us"], mode="lines",
                        line=dict(color=color), name=f"simulator, aligned B={_kb(b)}")
        if "t_iss_skew_sim_us" in grp:
            fig.add_scatter(x=grp["gap_us"], y=grp["t_iss_skew_sim_us"], mode="lines",
                            line=dict(color=color, dash="dash"),
                            name=f"simulator, measured start skew B={_kb(b)}")
        fig.add_scatter(x=grp["gap_us"], y=grp["t_iss_pred_us"], mode="lines",
                        line=dict(color=color, dash="dot"), name=f"eq. 3 B={_kb(b)}")
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


# ------------------------------------------------------------------------------- publication

# plotly.js is shipped once per output folder, as ``plotly.min.js``, and each figure's HTML loads
# it by a relative path (``../plotly.min.js`` from a notebook's folder under ``out/``). A CDN
# reference leaves every page blank without network; inlining works offline too, but puts a copy
# of the 4.8 MB library into every figure file (20 figures from the committed records: ~100 MB
# per reproduce, where one shared copy costs 4.8 MB). The runner
# writes ``out/plotly.min.js``; ``publish`` into a folder without one above it (called by hand)
# ships a copy into that folder itself.
PLOTLYJS = "plotly.min.js"

# Static images (the index's pictures, each notebook figure's image/png) come from kaleido, which
# drives a Chrome or Chromium: a system one on PATH, the one BROWSER_PATH names, or the one
# `plotly_get_chrome` downloads. They are drawn with MathJax off and the plotly.js of the plotly
# package, so that drawing one needs no network either (kaleido's defaults load MathJax from a CDN).
NO_IMAGES_HINT = ("install Chrome or Chromium (e.g. `apt install chromium`, or `plotly_get_chrome` "
                  "once with network access) or set BROWSER_PATH to one, then rerun")
_IMAGE_TIMEOUT_S = 120
_engine: dict = {}  # "problem": None or why no images; "server": kaleido's browser is running


def ship_plotlyjs(folder: Path | str) -> Path:
    """Write plotly.js (``PLOTLYJS``), the version plotly writes its figures for, into ``folder``
    unless it is there already; the figures' HTML under ``folder`` loads it by relative path."""
    from plotly.offline import get_plotlyjs

    path = Path(folder) / PLOTLYJS
    js = get_plotlyjs()
    if not path.is_file() or path.stat().st_size != len(js.encode()):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(js, encoding="utf-8")
    return path


def _plotlyjs_src(out: Path) -> str:
    """The relative path by which a figure written into ``out`` loads plotly.js."""
    if (out.parent / PLOTLYJS).is_file():  # the runner's output folder
        return f"../{PLOTLYJS}"
    ship_plotlyjs(out)
    return PLOTLYJS


def _with_timeout(call, timeout_s: float):
    """``call()`` on a daemon thread: its result, its exception, or TimeoutError after
    ``timeout_s`` (a browser that hangs must not hang the notebook)."""
    import threading

    result: dict = {}

    def run():
        try:
            result["value"] = call()
        except BaseException as e:  # noqa: BLE001 re-raised on the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer from the browser in {timeout_s:g} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__


def image_engine_problem() -> str | None:
    """None where kaleido can draw static images on this machine, else one line: why not and
    what to install. Probed once per process, by drawing an empty figure."""
    if "problem" not in _engine:
        _engine["problem"] = _probe_image_engine()
    return _engine["problem"]


def _probe_image_engine() -> str | None:
    try:
        import kaleido
        from choreographer.errors import ChromeNotFoundError
    except ImportError as e:
        return f"No static images: {e.name} is not installed (`pip install kaleido`)"
    try:
        _with_timeout(lambda: kaleido.calc_fig_sync(
            {"data": [], "layout": {}}, opts=dict(format="png", width=50, height=50),
            kopts={"mathjax": False}), _IMAGE_TIMEOUT_S)
    except ChromeNotFoundError:
        return "No static images: kaleido found no Chrome or Chromium; " + NO_IMAGES_HINT
    except Exception as e:  # noqa: BLE001 any failure of the browser means no images
        return (f"No static images: kaleido could not draw with the browser it found "
                f"({_first_line(e)}); " + NO_IMAGES_HINT)
    return None


def static_image(fig: go.Figure, width: int = 1000, height: int = 600) -> bytes | None:
    """``fig`` as PNG bytes (its layout's size, else ``width`` × ``height``), or None where no
    image engine exists (``image_engine_problem`` says why) or this figure failed to draw."""
    if image_engine_problem():
        return None
    import kaleido

    if not _engine.get("server"):  # one browser for every figure of this process
        kaleido.start_sync_server(mathjax=False, silence_warnings=True)
        _engine["server"] = True
    opts = dict(format="png", width=fig.layout.width or width, height=fig.layout.height or height)
    try:
        return _with_timeout(lambda: kaleido.calc_fig_sync(fig.to_dict(), opts=opts),
                             _IMAGE_TIMEOUT_S)
    except TimeoutError as e:  # the browser hangs: no more images from this process
        _engine["problem"] = (f"No static images: kaleido's browser stopped answering "
                              f"({_first_line(e)})")
    except Exception as e:  # noqa: BLE001 this figure only
        print(f"no static image of {fig.layout.title.text or 'a figure'!r}: {_first_line(e)}")
    return None


_DRAW = object()  # ``show``'s default: draw the static image itself


def show(fig: go.Figure, png: bytes | None = _DRAW) -> None:
    """Display ``fig`` with a static fallback: the plotly JSON (interactive in JupyterLab, VS Code)
    beside an image/png of it (``png``, else drawn here), which nbconvert, repository browsers and
    other viewers show; no text/html, which those viewers would prefer and render blank. Without
    an image engine the figure says so, once per process."""
    import base64

    from IPython.display import display

    if png is _DRAW:
        png = static_image(fig)
    bundle = pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict())
    bundle["text/plain"] = f"<figure: {fig.layout.title.text or 'untitled'}>"
    if png is not None:
        bundle["image/png"] = base64.b64encode(png).decode("ascii")
    display(bundle, raw=True)
    if png is None and image_engine_problem() and not _engine.get("said"):
        _engine["said"] = True
        print(f"{image_engine_problem()}. Until then the figures of this notebook show only where "
              "plotly's own output renders (JupyterLab, VS Code), not in nbconvert or a repository "
              "browser.")


def publish(fig: go.Figure, name: str, out_dir: Path | str | None, caption: str = "") -> None:
    """Show ``fig`` (``show``); with ``out_dir``, also write ``name``.html, which loads plotly.js
    from the output folder (``PLOTLYJS``) and so opens offline, and ``name``.png where an image
    engine exists, and list them in the manifest (``no_image``: why there is no PNG)."""
    png = static_image(fig)
    show(fig, png)
    if out_dir is None:
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig.write_html(out / f"{name}.html", include_plotlyjs=_plotlyjs_src(out), include_mathjax=False)
    files = [f"{name}.html"]
    entry = {"kind": "figure", "name": name, "title": fig.layout.title.text or name,
             "caption": caption}
    if png is not None:
        (out / f"{name}.png").write_bytes(png)
        files.append(f"{name}.png")
        entry["image"] = f"{name}.png"
    else:
        entry["no_image"] = image_engine_problem() or "No static image: this figure failed to draw"
    _manifest(out, {**entry, "files": files})


def publish_table(df: pd.DataFrame, name: str, out_dir: Path | str | None, title: str = "") -> None:
    """Show ``df``; with ``out_dir``, also write ``name``.csv and ``name``.md and list it."""
    from IPython.display import display

    display(df)
    if out_dir is None:
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / f"{name}.csv", index=False)
    (out / f"{name}.md").write_text(df.to_markdown(index=False) + "\n")
    _manifest(out, {"kind": "table", "name": name, "title": title or name,
                    "files": [f"{name}.csv", f"{name}.md"], "html": df.to_html(index=False)})


def _manifest(out: Path, entry: dict) -> None:
    with open(out / "manifest.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


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
        color = _COLORS[i % len(_COLORS)]
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
                            name=m.removesuffix("_us"), line=dict(color=_COLORS[i % len(_COLORS)]),
                            showlegend=col == 1, row=1, col=col)
    fig.update_yaxes(type="log", title_text="time (µs)")
    fig.update_layout(title="FA + post-attention All-to-All: time per method")
    return fig


def moe_speedups(records) -> go.Figure:
    """Fig. 8: Interleaved over Expert-Wave speedup by model, precision and routing."""
    fig = make_subplots(rows=len(records), cols=1, subplot_titles=[r.platform for r in records])
    for row, rec in enumerate(records, start=1):
        t = rec.table
        for i, ((prec, routing), grp) in enumerate(t.groupby(["precision", "routing"])):
            x = (grp["model"] if t["tokens"].nunique() == 1
                 else grp["model"] + " · " + grp["tokens"].astype(int).astype(str))
            fig.add_bar(x=x, y=grp["speedup"], name=f"{prec} {routing}",
                        marker_color=_COLORS[i % len(_COLORS)], showlegend=row == 1, row=row, col=1)
    fig.add_hline(y=1.0, line=dict(dash="dot"))
    fig.update_layout(title="Fig. 8: MoE speedup, Interleaved over Expert-Wave", barmode="group",
                      yaxis_title="T_wave / T_interleaved")
    return fig


def moe_headline(paper: dict, records) -> pd.DataFrame:
    """The MoE headline speedups: the paper's (84 configurations, EP = 8) beside each platform's."""
    from .summary import moe_headline_numbers

    summaries = {r.platform: moe_headline_numbers(r.table) for r in records}
    keys = ("configs", "geomean_speedup", "median_speedup", "max_speedup", "min_speedup")
    rows = [{"source": "paper", **{k: paper.get(k, paper.get("min_speedup_reported")) for k in keys}}]
    rows += [{"source": p, **{k: s[k] for k in keys},
              "fused_vs_unfused_geomean": s["fused_vs_unfused_geomean"]} for p, s in summaries.items()]
    return pd.DataFrame(rows)


def drain_rate_heatmap(points: pd.DataFrame, platform: str) -> go.Figure:
    """Zero-gap aggregate rate V/T_period of every ordered GPU pair (the ``pairs`` sweep), at
    its largest burst: the drain rate R per source → destination."""
    largest = points[points["burst_bytes"] == points["burst_bytes"].max()]
    rate = (largest["burst_volume"] / largest["period_us"] / 1e3).to_numpy()
    grid = pd.DataFrame({"src": largest["src"].to_numpy(), "dst": largest["dst"].to_numpy(),
                         "rate": rate}).pivot(index="src", columns="dst", values="rate")
    fig = go.Figure(go.Heatmap(z=grid.to_numpy(), x=[f"to GPU {d}" for d in grid.columns],
                               y=[f"GPU {s}" for s in grid.index], colorbar=dict(title="GB/s"),
                               text=np.round(grid.to_numpy(), 1), texttemplate="%{text}"))
    fig.update_layout(title=(f"{platform}: zero-gap drain rate per ordered pair, "
                             f"B = {_kb(largest['burst_bytes'].iloc[0])}, K = "
                             f"{int(largest['producers'].iloc[0])}"))
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
            fig.add_box(x=sel["burst_bytes"].map(_kb), y=sel["latency_us"], name=f"G = {g:g} µs",
                        legendgroup=f"G{g}", showlegend=col == 1, boxpoints=False,
                        marker=dict(color=_COLORS[i % len(_COLORS)]), row=1, col=col)
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


# -------------------------------------------------- MoE mechanism (§5.2.2–5.2.3, ``moe_trace``)

def _cell(v):
    """A record cell that held a dict or list (stored as JSON text)."""
    return json.loads(v) if isinstance(v, str) else v


def moe_table2(paper: dict, trace_records) -> pd.DataFrame:
    """Table 2: per model, eq. 15's prediction beside the measured per-tile stall (and its error)
    for both schedules, the paper's row first, then each platform's (``moe_trace.table2``)."""
    from .experiments.moe.trace import table2

    rows = [{"source": "paper", **{k: v for k, v in r.items() if k != "paper_name"}}
            for r in paper["rows"]]
    rows += [{"source": rec.platform, **r} for rec in trace_records for r in table2(rec.table)]
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
    dense, the unfused path, TF/s and the ratios (``moe_kernel_bench.TIMED``)."""
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
            colour = colours.setdefault(label, _COLORS[len(colours) % len(_COLORS)])
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
    fig.update_layout(title="The fused kernel against cuBLAS dense GEMMs of the same rows")
    return fig


def moe_call_overhead(kernel_record) -> pd.DataFrame:
    """The one-token call of a ``moe_kernel`` record and where its time goes: the kernel alone
    and the whole call, the host's launch and per-batch schedule costs, and the traced chain of
    one Linear-1 tile's mainloop, the Linear-2 tile's wait for it and its own mainloop."""
    rows = pd.DataFrame(kernel_record.params["call_overhead"]["rows"])
    cols = ["model", "precision", "rows", "kernel_wave_us", "call_wave_us", "host_launch_us",
            "host_prepare_us", "mainloop_l1_us", "wave_wait_l2_us", "mainloop_l2_us"]
    return rows[[c for c in cols if c in rows.columns]].round(2)


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


def moe_knee_sweep(trace_record, platform) -> go.Figure | None:
    """The X-Stage inside the fused kernel (a SYNTHETIC kernel: a fraction of every mainloop's K
    blocks): Expert-Wave's measured Linear-2 span with remote stores and with the local-store
    control against the gap between bursts, the model's span (eqs. 3–4) beside them, G* marked;
    one panel per model and precision. None where the record has no knee sweep."""
    from .experiments.moe.trace import knee_sweep_rows

    rows = pd.DataFrame(knee_sweep_rows(trace_record.table, platform))
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
                            line=dict(color=_COLORS[["span_remote_us", "span_local_us",
                                                     "span_pred_us"].index(col)], **style),
                            legendgroup=name, showlegend=j == 0, row=1, col=j + 1)
        fig.add_vline(x=float(g["g_star_us"].iloc[0]), line_dash="dot", row=1, col=j + 1,
                      annotation_text="G*")
        fig.update_xaxes(title_text="G_wave: Linear-2 mainloop (µs)", type="log", row=1,
                         col=j + 1)
    fig.update_yaxes(title_text="Expert-Wave Linear-2 span T_RS (µs)", row=1, col=1)
    fig.update_layout(title=f"The X-Stage inside the fused kernel, {trace_record.platform} "
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
            fig.add_box(x=xs, y=ys, name=label, marker_color=_COLORS[i], boxpoints=False,
                        offsetgroup=str(i))
    if paper is not None:
        for key, color in (("span_wave_median_range_us", _COLORS[0]),
                           ("span_int_median_range_us", _COLORS[1])):
            lo, hi = paper["fig10"][key]
            fig.add_hrect(y0=lo, y1=hi, fillcolor=color, opacity=0.12, line_width=0)
            # annotations on a log axis take log10 positions (shapes take data values)
            fig.add_annotation(x=0, xref="paper", xanchor="left", yanchor="bottom", y=np.log10(hi),
                               text=f"paper {key.split('_')[1]} medians", showarrow=False)
    # log axis: this platform's spans and the paper's bands differ by an order of magnitude
    fig.update_layout(boxmode="group", title=f"{trace_record.platform}: Fig. 10, Linear-2 "
                      "remote-store span per tile", yaxis_title="T_RS (µs)", yaxis_type="log")
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
                            name=label, line=dict(color=_COLORS[i + 2]), showlegend=r == 1,
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
        c = _COLORS[i % len(_COLORS)]
        fig.add_scatter(x=grp["d_factor"], y=grp["speedup"], mode="lines+markers", name=m,
                        line=dict(color=c), row=1, col=1)
        fig.add_scatter(x=grp["d_factor"], y=grp["wait_l2_share"], mode="lines+markers", name=m,
                        line=dict(color=c), showlegend=False, row=1, col=2)
    fig.update_xaxes(type="log", title_text="D / D_knee")
    fig.add_hline(y=1.0, line=dict(dash="dot"), row=1, col=1)
    fig.update_layout(title=f"{trace_record.platform}: lead D around D_knee (eq. 16)")
    return fig


def moe_regressions(trace_record, matrix_record) -> pd.DataFrame:
    """Each regressing matrix cell with its measured cause (``moe_trace.regression_rows``):
    Interleaved minus Expert-Wave SM time per component (µs per SM) where the cell was traced,
    "not traced" otherwise, with the measured proxies beside it."""
    from .experiments.moe.trace import regression_rows

    return pd.DataFrame(regression_rows(matrix_record.table, trace_record.table)).round(3)


def moe_regression_groups(trace_record, matrix_record) -> pd.DataFrame:
    """The regressing cells grouped by measured cause ("not traced" is a group), with counts,
    models and the ranges of speedup and per-component SM time (``moe_trace.regression_groups``)."""
    from .experiments.moe.trace import regression_groups, regression_rows

    return pd.DataFrame(regression_groups(regression_rows(matrix_record.table, trace_record.table))).round(3)


def moe_traced_causes(trace_record) -> pd.DataFrame:
    """Per traced configuration, Interleaved minus Expert-Wave SM time per component (µs per SM),
    the makespan ratio and both schedules' Linear-2 dependency-wait shares: where the gain or the
    loss comes from (``moe_trace.traced_causes``)."""
    from .experiments.moe.trace import traced_causes

    rows = [{**{k: v for k, v in r.items() if k != "delta_per_sm_us"},
             **{f"Δ{k} (µs/SM)": v for k, v in r["delta_per_sm_us"].items()}}
            for r in traced_causes(trace_record.table)]
    return pd.DataFrame(rows).round(3)


def moe_counterfactual(trace_record) -> pd.DataFrame:
    """Decoupled (Expert-Wave, Interleaved) and completion-coupled (each Linear-2 tile fenced
    until its stores are visible) times per configuration, measured in one run."""
    from .experiments.moe.trace import KEYS, counterfactual_rows, l2_tiles_per_sm

    df = pd.DataFrame(counterfactual_rows(trace_record.table))
    df["coupled_over_decoupled_wave"] = df["wave_fenced_us"] / df["wave_us"]
    df["coupled_over_decoupled_int"] = df["interleaved_fenced_us"] / df["interleaved_us"]
    # the added time per Linear-2 tile of one SM of the critical rank (its traced launch)
    per_sm = l2_tiles_per_sm(trace_record.table)
    for s, sched in (("wave", "wave"), ("int", "interleaved")):
        tiles = [per_sm.get((*(r[k] for k in KEYS), sched), np.nan) for r in df.to_dict("records")]
        df[f"fence_us_per_l2_tile_{s}"] = (df[f"{sched}_fenced_us"] - df[f"{sched}_us"]) / tiles
    return df.round(3)


def moe_condition1(trace_record, platform) -> pd.DataFrame:
    """Condition 1 (eqs. 12–14) per traced configuration from the calibrated platform
    (``model.PlatformModel``) and the local-control mainloops, beside the measured spans."""
    from .experiments.moe.trace import condition1_rows

    return pd.DataFrame(condition1_rows(trace_record.table, platform))


def _fit_row(fit: dict | None) -> dict:
    """One fit of a patterns/operations summary entry (FIT in docs/summary_json.md) as table
    columns."""
    if not fit:
        return {"fit": "not measured"}
    if "fit_error" in fit:
        return {"fit": f"model fit failed: {fit['fit_error']}"}
    nr = fit.get("no_refit_from_baseline") or {}

    def by_burst(values: dict, name: str) -> dict:  # keys "K=..,B=.." (one K per fit)
        return {f"{name} B={_kb(k.split('B=')[1])} (µs)": v for k, v in values.items()}

    return {"R (GB/s)": fit["R_GBps"], "R IQR": fit["R_GBps_iqr"],
            **by_burst(fit["T_iss0_us"], "T_iss0"),
            "Q (MiB)": next(iter(fit["Q_MiB"].values()), None),
            "knee (KB/producer)": next(iter(fit["knee_KB_per_producer"].values()), None),
            **by_burst(fit["G_star_us"], "G*"),
            "gap err, own fit (%)": fit["gap_prediction_median_abs_err_pct"],
            "drain share": nr.get("share"), "R predicted (GB/s)": nr.get("drain_rate_GBps"),
            "gap err, no refit (%)": nr.get("t_iss_err_pct"),
            "period err, no refit (%)": nr.get("period_err_pct"), "fit": "ok"}


def patterns_table(entry: dict) -> pd.DataFrame:
    """Injection patterns (issue 6): per pattern instance and source GPU, the fitted
    (T_iss⁰, R, Q), the gap sweep's error from its own fit and with no refit from its
    one-to-one route's M_X times its drain share (``summary``'s ``patterns`` entry)."""
    rows = []
    for inst in entry["per_instance"]:
        head = {"pattern": inst["pattern"], "instance": inst["instance"],
                "routes": inst["routes"], "same as": inst["degenerate_of"] or ""}
        for fit in inst["sources"] or [None]:
            rows.append({**head, "src": fit["src"] if fit else None, **_fit_row(fit)})
    return pd.DataFrame(rows)


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
                               y=[f"GPU {s}" for s in grid.index], colorbar=dict(title="GB/s"),
                               zmin=0,  # from zero: equal links must not look apart by noise
                               text=np.round(grid.to_numpy(), 1), texttemplate="%{text}"))
    fig.update_layout(title=f"{platform}: fitted drain rate R per ordered pair (one-to-one)",
                      yaxis=dict(autorange="reversed"))
    return fig


def patterns_rates(entry: dict, platform: str) -> go.Figure:
    """Per pattern instance and source: the fitted R beside the no-refit prediction (the
    one-to-one R times the drain share)."""
    table = patterns_table(entry)
    table = table[table["fit"] == "ok"]
    label = table["pattern"] + " " + table["instance"] + " · src " + table["src"].astype(str)
    fig = go.Figure()
    fig.add_bar(x=label, y=table["R (GB/s)"], name="fitted R")
    fig.add_bar(x=label, y=table["R predicted (GB/s)"], name="one-to-one R × drain share")
    fig.update_layout(title=f"{platform}: drain rate per injection pattern and source",
                      yaxis_title="GB/s", barmode="group")
    return fig


def operations_table(entry: dict, left_out: bool = True) -> pd.DataFrame:
    """Remote operations (issue 6): per operation the fitted (T_iss⁰, R, Q), knee and G*, and
    the gap sweep's error from its own fit and with no refit from the 16-byte stores' M_X;
    with ``left_out``, also the operations left out, with the reason (``summary``'s
    ``operations`` entry; ``operations_left_out`` lists them alone)."""
    rows = [{"operation": op, **_fit_row(fit)} for op, fit in entry["per_op"].items()]
    if left_out:
        rows += [{"operation": r["operation"], "fit": f"not measured: {r['reason']}"}
                 for r in operations_left_out(entry).to_dict("records")]
    return pd.DataFrame(rows)


def operations_left_out(entry: dict) -> pd.DataFrame:
    """The operations a ``remote_ops`` record left out (failed check, fault, time budget),
    each with the record's reason."""
    return pd.DataFrame([{"operation": label.split("=", 1)[1], "reason": why}
                         for label, why in entry["excluded"].items()],
                        columns=["operation", "reason"])


def no_refit_verdict(table: pd.DataFrame, keys: list[str], max_err_pct: float) -> pd.DataFrame:
    """Whether the Burst–Gap model, calibrated once on the baseline (16-byte stores, or a
    pattern's one-to-one route), still describes each row of ``patterns_table`` or
    ``operations_table``: the gap sweep's median |T_iss error| from the row's own fit and with
    no refit, and the fitted R's departure from the predicted one, each against ``max_err_pct``."""
    needed = ["R (GB/s)", "R predicted (GB/s)", "gap err, own fit (%)", "gap err, no refit (%)"]
    table = table.reindex(columns=list(dict.fromkeys([*table.columns, *needed])))  # no row fitted
    ok = table["fit"] == "ok"
    out = table[keys].copy()
    ratio = table["R (GB/s)"] / table["R predicted (GB/s)"]
    out["R / R predicted"] = ratio.round(3)
    # the gap sweep's median can sit on its plateau; R alone decides the drain-bound regime
    out[f"R as predicted (≤ {max_err_pct:g}%)"] = np.where(
        ok, np.where((ratio - 1).abs() * 100 <= max_err_pct, "yes", "no"),
        table["fit"].str.split(":").str[0])
    for col, verdict in (("gap err, own fit (%)", "own fit holds"),
                         ("gap err, no refit (%)", "holds without refit")):
        out[col] = table[col]
        out[f"{verdict} (≤ {max_err_pct:g}%)"] = np.where(
            ok, np.where(table[col] <= max_err_pct, "yes", "no"), table["fit"].str.split(":").str[0])
    return out


def operations_gap_sweeps(record) -> go.Figure:
    """Each operation's remote gap sweep (larger B): measured T_iss against the gap the
    producers saw, with eq. 3 from its own fit and from the 16-byte stores' M_X (no refit)."""
    from .experiments.remote_store.ops import BASELINE_OP, fit_config

    table = record.table
    fits = {op: fit_config(rows, op, int(rows["src"].iloc[0]), record.platform, record.record_id)
            for op, rows in table.groupby("op", sort=False)}
    base = fits[BASELINE_OP].calibration
    ok = {op: f for op, f in fits.items() if f.calibration is not None}
    fig = make_subplots(rows=1, cols=len(ok), subplot_titles=list(ok), shared_yaxes=False)
    for col, (op, f) in enumerate(ok.items(), start=1):
        cal, pts = f.calibration, f.predicted
        pts = pts[(pts["path"] == "remote") & (pts["burst_bytes"] == pts["burst_bytes"].max())]
        v, k, b = pts["burst_volume"].iloc[0], pts["producers"].iloc[0], pts["burst_bytes"].iloc[0]
        first = col == 1
        fig.add_scatter(x=pts["gap_us"] + cal.loop_gap_us, y=pts["t_iss_us"], mode="markers",
                        marker=dict(color=_COLORS[0]), name="measured", showlegend=first,
                        row=1, col=col)
        g = np.linspace(0, (pts["gap_us"] + cal.loop_gap_us).max(), 200)
        fig.add_scatter(x=g, y=model.issue_time(g, v, cal.t_iss0_us[kb_key(k, b)],
                                                cal.drain_rate_GBps),
                        line=dict(color=_COLORS[1]), name="eq. 3, own fit", showlegend=first,
                        row=1, col=col)
        if base is not None:
            fig.add_scatter(x=g, y=model.issue_time(g, v, base.t_iss0_us[kb_key(k, b)],
                                                    base.drain_rate_GBps),
                            line=dict(color=_COLORS[2], dash="dash"),
                            name=f"eq. 3, {BASELINE_OP} M_X (no refit)", showlegend=first,
                            row=1, col=col)
        fig.update_xaxes(title_text="gap G (µs)", row=1, col=col)
    fig.update_yaxes(title_text="T_iss (µs)", row=1, col=1)
    fig.update_layout(title=f"{record.platform}: issue time against gap per remote operation, "
                            f"B = {_kb(b)}, K = {int(k)}")
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
                    marker_color=_COLORS[i], boxpoints="outliers", offsetgroup=str(i))
    # log axis: a stalled tile takes up to ~50x an unstalled one
    fig.update_layout(boxmode="group", title=f"{platform}: fused attention epilogue span per "
                      "remote output tile", xaxis_title="M", yaxis_title="epilogue (µs)",
                      yaxis_type="log")
    return fig
