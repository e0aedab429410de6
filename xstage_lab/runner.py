"""``reproduce``: run every notebook headlessly through papermill, collect what they publish,
and write an index page of every figure and table."""
from __future__ import annotations

import html
import json
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"


def notebooks(only: list[str] | None = None) -> list[Path]:
    """The notebooks in run order; ``only`` selects by stem, with or without its number prefix."""
    found = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
    if not only:
        return found
    chosen = [p for p in found if p.stem in only or p.stem.split("_", 1)[-1] in only]
    unknown = set(only) - {p.stem for p in chosen} - {p.stem.split("_", 1)[-1] for p in chosen}
    if unknown:
        raise ValueError(f"no notebook named {sorted(unknown)}; have {[p.stem for p in found]}")
    return chosen


def reproduce(only: list[str] | None = None, backend: str = "auto", out: Path = Path("out")) -> int:
    """Execute the notebooks into ``out`` with ``backend``, which each experiment they measure
    resolves per link (``launch.plan``, printed first and stated in the index); returns 0, or 1
    after the first failing notebook (its failing cell printed)."""
    import papermill as pm

    from .launch import plan, plan_lines
    from .plots.publish import ship_plotlyjs

    steps = plan(backend)
    for line in plan_lines(steps):
        print(line)
    # Where no experiment is measured live the notebooks replay without asking the GPUs again.
    given = backend if any(s.live for s in steps) else "replay"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ship_plotlyjs(out)  # once for every figure page: they load it by relative path, offline
    done, seconds = [], {}
    for nb in tqdm(notebooks(only), desc="notebooks"):
        started = time.monotonic()
        fig_dir = out / nb.stem
        fig_dir.mkdir(exist_ok=True)
        (fig_dir / "manifest.jsonl").unlink(missing_ok=True)
        try:
            # Written once, when it ends or fails (papermill's default rewrites the whole notebook,
            # figures' JSON included, before and after every cell: most of a replay's time).
            pm.execute_notebook(str(nb), str(out / nb.name), cwd=str(NOTEBOOKS_DIR),
                                parameters={"backend": given, "out_dir": str(fig_dir.resolve())},
                                progress_bar=False, kernel_name="python3",
                                request_save_on_cell_execute=False)
        except pm.PapermillExecutionError as e:
            print(f"\n{nb.name} failed in cell {e.exec_count}:\n{e.source}\n{e.ename}: {e.evalue}",
                  file=sys.stderr)
            _write_index(out, done, steps, seconds)
            return 1
        done.append(nb)
        seconds[nb] = time.monotonic() - started
        print(f"{nb.name}: {seconds[nb]:.0f} s")
    index = _write_index(out, done, steps, seconds)
    for line in _no_image_lines(out, done):
        print(line)
    print(f"wrote {index}")
    return 0


def _entries(out: Path, nb: Path) -> list[dict]:
    manifest = out / nb.stem / "manifest.jsonl"
    return [json.loads(line) for line in manifest.read_text().splitlines()] if manifest.exists() else []


def _no_image_lines(out: Path, done: list[Path]) -> list[str]:
    """Why figures have no PNG (``plots.publish.image_engine_problem``'s line), each reason once."""
    reasons = {e["no_image"]: None for nb in done for e in _entries(out, nb)
               if e["kind"] == "figure" and e.get("no_image")}
    return list(reasons)


def _figure_html(nb: Path, e: dict) -> str:
    """A figure of the index: its PNG where one was drawn, else its own HTML page in a frame (which
    loads plotly.js from the output folder, so it shows offline too); the caption under it."""
    caption = f"<figcaption>{html.escape(e.get('caption', ''))}</figcaption>" if e.get("caption") else ""
    if e.get("image"):
        picture = (f'<img src="{nb.stem}/{html.escape(e["image"])}" alt="{html.escape(e["title"])}" '
                   f'loading="lazy">')
    else:
        picture = (f'<iframe src="{nb.stem}/{html.escape(e["files"][0])}" title="{html.escape(e["title"])}" '
                   f'loading="lazy"></iframe>')
    return f"<figure>{picture}{caption}</figure>"


# A table longer than this is linked from the index, not shown in it.
INDEX_TABLE_ROWS = 60


LINK_WORDS = {"nvlink": "NVLink", "host": "host link", "local": "one GPU, no link"}


def drawn_line(drawn: list[dict]) -> str:
    """Which link and backend drew a figure: its sources (``Loaded.drawn``) grouped by link and
    backend, e.g. ``host link, measured live (cuda): h200-x1-host; NVLink, replayed: h200-x2``."""
    groups: dict[tuple[str, str], list[str]] = {}
    for d in drawn:
        groups.setdefault((d["link"], d["backend"]), []).append(d["platform"])
    return "; ".join(f"{LINK_WORDS.get(link, link)}, "
                     f"{'measured live (cuda)' if backend == 'cuda' else 'replayed'}: "
                     f"{', '.join(dict.fromkeys(names))}" for (link, backend), names in groups.items())


def _write_index(out: Path, done: list[Path], steps: list, seconds: dict[Path, float]) -> Path:
    """``out/index.html``: what was measured live and what replayed (``steps``, the
    ``launch.plan``), every figure as a picture with its caption and the link and backend that
    drew it, every table up to ``INDEX_TABLE_ROWS`` rows (the paper's values beside this
    platform's), links to the files; nothing in it loads from the network; how long each notebook
    ran (``seconds``)."""
    from .launch import plan_lines

    lines = "".join(f"<li>{html.escape(line)}</li>" for line in plan_lines(steps))
    requested = html.escape(steps[0].choice.requested) if steps else "replay"
    parts = ["<h1>xstage_lab: reproduced figures and tables</h1>",
             f"<p>Backend {requested}: per experiment and link, what the notebooks measure live "
             f"on this machine and what they replay.</p><ul>{lines}</ul>"]
    for line in _no_image_lines(out, done):
        parts.append(f'<p class="note">{html.escape(line)}. The figures below are shown as '
                     f'interactive frames instead of pictures.</p>')
    for nb in done:
        parts.append(f'<h2>{html.escape(nb.stem)}</h2><p><a href="{nb.name}">executed notebook</a>'
                     f' (ran in {seconds[nb]:.0f} s)</p>')
        for e in _entries(out, nb):
            links = " · ".join(f'<a href="{nb.stem}/{f}">{f}</a>' for f in e["files"])
            if e["kind"] == "figure":
                drawn = drawn_line(e.get("drawn", []))
                drawn = f"drawn by {drawn}" if drawn else "drawn from no record"
                parts.append(f"<h3>{html.escape(e['title'])}</h3>{_figure_html(nb, e)}"
                             f'<p class="drawn">{html.escape(drawn)}</p><p>{links}</p>')
            else:
                long = e.get("rows", 0) > INDEX_TABLE_ROWS
                body = (f"<p>{e['rows']} rows: in the files above, not shown here.</p>" if long
                        else e.get("html", ""))
                parts.append(f"<h3>{html.escape(e['title'])}</h3><p>{html.escape(e.get('caption', ''))}</p>"
                             f"<p>{links}</p>{body}")
    index = out / "index.html"
    index.write_text("<!doctype html><meta charset='utf-8'><title>xstage_lab</title>"
                     "<style>body{font-family:sans-serif;max-width:70em;margin:auto}"
                     "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}"
                     "figure{margin:0}figure img{max-width:100%;height:auto}"
                     "figure iframe{width:100%;height:620px;border:0}"
                     "figcaption{color:#444;font-size:90%}.note{background:#fff3cd;padding:4px 8px}"
                     ".drawn{font-size:90%;color:#225}"
                     "</style>" + "\n".join(parts))
    return index
