"""Publication, the one place that writes what ``reproduce`` collects.

``publish``/``publish_table`` display in a notebook (a figure with a static PNG beside its plotly
JSON, so that any notebook viewer shows it) and, when the runner passes an output folder, also
write HTML that opens offline (plotly.js shipped once with the folder), PNG where kaleido finds a
Chrome or Chromium, CSV and Markdown, and add an entry to the folder's ``manifest.jsonl`` from
which the runner builds the index page.
"""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

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


def mime_bundle(fig: go.Figure) -> dict:
    """``fig`` as plotly's mimetype renderer (``pio.renderers["plotly_mimetype"]``) bundles it,
    without importing plotly's renderers: their import loads nbformat's JSON-schema validators,
    over two seconds of CPU in every notebook kernel."""
    return {"application/vnd.plotly.v1+json": json.loads(
        pio.to_json(fig.to_dict(), validate=False, remove_uids=False))}


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
    bundle = mime_bundle(fig)
    bundle["text/plain"] = f"<figure: {fig.layout.title.text or 'untitled'}>"
    if png is not None:
        bundle["image/png"] = base64.b64encode(png).decode("ascii")
    display(bundle, raw=True)
    if png is None and image_engine_problem() and not _engine.get("said"):
        _engine["said"] = True
        print(f"{image_engine_problem()}. Until then the figures of this notebook show only where "
              "plotly's own output renders (JupyterLab, VS Code), not in nbconvert or a repository "
              "browser.")


def _sources(drawn) -> list[dict]:
    """``drawn`` as a list of ``Loaded.drawn`` entries: a ``Loaded`` stands for all its views,
    a list may mix ``Loaded``s and entries."""
    items = [drawn] if hasattr(drawn, "drawn") else list(drawn)
    entries = [e for item in items for e in (item.drawn() if hasattr(item, "drawn") else [item])]
    return [dict(t) for t in dict.fromkeys(tuple(e.items()) for e in entries)]


def publish(fig: go.Figure, name: str, out_dir: Path | str | None, caption: str = "",
            drawn=()) -> None:
    """Show ``fig`` (``show``); with ``out_dir``, also write ``name``.html, which loads plotly.js
    from the output folder (``PLOTLYJS``) and so opens offline, and ``name``.png where an image
    engine exists, and list them in the manifest (``no_image``: why there is no PNG) with what
    drew it (``drawn``: the ``Loaded`` it was drawn from, or ``Loaded.drawn`` entries: platform,
    link and backend, which the index states)."""
    png = static_image(fig)
    show(fig, png)
    if out_dir is None:
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig.write_html(out / f"{name}.html", include_plotlyjs=_plotlyjs_src(out), include_mathjax=False)
    files = [f"{name}.html"]
    entry = {"kind": "figure", "name": name, "title": fig.layout.title.text or name,
             "caption": caption, "untitled_axes": untitled_axes(fig), "drawn": _sources(drawn)}
    if png is not None:
        (out / f"{name}.png").write_bytes(png)
        files.append(f"{name}.png")
        entry["image"] = f"{name}.png"
    else:
        entry["no_image"] = image_engine_problem() or "No static image: this figure failed to draw"
    _manifest(out, {**entry, "files": files})


def untitled_axes(fig: go.Figure) -> list[str]:
    """The directions (``x``, ``y``) of the figure's traces whose axes all lack a title (a grid of
    panels titled once along an edge counts as titled)."""
    used = {"x": set(), "y": set()}
    for trace in fig.data:
        for d in used:
            if f"{d}axis" in trace:  # a cartesian trace: on axis "x" ("y") unless told another
                used[d].add(f"{d}axis{(trace[f'{d}axis'] or d)[1:]}")
    return [d for d, axes in used.items()
            if axes and not any(fig.layout[a].title.text for a in axes)]


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
    _manifest(out, {"kind": "table", "name": name, "title": title or name, "rows": len(df),
                    "files": [f"{name}.csv", f"{name}.md"],
                    "html": df.to_html(index=False, na_rep="")})


def _manifest(out: Path, entry: dict) -> None:
    with open(out / "manifest.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
