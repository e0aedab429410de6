"""Whether a published output folder opens without network access.

``network_loads`` parses every HTML page under a folder and lists each resource a browser would
fetch on opening it (scripts, stylesheets, images, frames, media, CSS ``url()``/``@import``) that
is not a file inside the folder: a URL with a scheme or host (``https://cdn...``, ``//cdn...``), a
relative path to a missing file, or one that leaves the folder. Links a reader may follow
(``<a href>``) load nothing and are not listed. ``render_offline`` opens one page in a headless
Chrome or Chromium with every network request sent to a dead proxy and says whether plotly drew
the figure.

    python -m xstage_lab.offline out     # exit 1 and one line per problem where any is found
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

# the attributes by which each element makes the browser fetch something
_LOADING = {"script": ("src",), "link": ("href",), "img": ("src", "srcset"),
            "iframe": ("src",), "frame": ("src",), "embed": ("src",), "object": ("data",),
            "source": ("src", "srcset"), "video": ("src", "poster"), "audio": ("src",),
            "track": ("src",), "input": ("src",), "image": ("href", "xlink:href"),
            "use": ("href", "xlink:href")}
_CSS_URL = re.compile(r"""url\(\s*['"]?([^'")\s]+)|@import\s+['"]([^'"]+)""")
_LOCAL_SCHEMES = {"data", "blob", "about", "javascript"}


class _Refs(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.refs: list[tuple[str, str]] = []  # (where, reference)
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in _LOADING.get(tag, ()):
            value = attrs.get(name)
            if not value:
                continue
            urls = ([u.strip().split()[0] for u in value.split(",") if u.strip()]
                    if name == "srcset" else [value.strip()])
            self.refs += [(f"<{tag} {name}>", u) for u in urls]
        if attrs.get("style"):
            self._css(f"<{tag} style>", attrs["style"])
        self._in_style = tag == "style"

    def handle_endtag(self, tag):
        if tag == "style":
            self._in_style = False

    def handle_data(self, data):
        if self._in_style:
            self._css("<style>", data)

    def _css(self, where, text):
        self.refs += [(where, a or b) for a, b in _CSS_URL.findall(text)]


def page_references(page: Path) -> list[tuple[str, str]]:
    """(where, reference) for every resource ``page`` makes a browser fetch."""
    parser = _Refs()
    parser.feed(page.read_text(encoding="utf-8", errors="replace"))
    return parser.refs


def network_loads(folder: Path | str) -> list[str]:
    """One line per resource that an HTML page under ``folder`` would fetch from the network or
    cannot find inside ``folder``; empty where every page opens offline."""
    folder = Path(folder).resolve()
    problems = []
    for page in sorted(folder.rglob("*.html")):
        for where, ref in page_references(page):
            parts = urlsplit(ref)
            if parts.scheme.lower() in _LOCAL_SCHEMES or ref.startswith("#"):
                continue
            name = page.relative_to(folder)
            if parts.scheme or parts.netloc:
                problems.append(f"{name}: {where} loads {ref} from the network")
                continue
            target = (page.parent / unquote(parts.path)).resolve()
            if not target.is_relative_to(folder):
                problems.append(f"{name}: {where} loads {ref}, outside {folder}")
            elif not target.is_file():
                problems.append(f"{name}: {where} loads {ref}, which does not exist")
    return problems


def find_browser() -> str | None:
    """The Chrome or Chromium kaleido would use (its own download, BROWSER_PATH, one on PATH or
    in a usual place), or None."""
    try:
        from choreographer.browsers.chromium import Chromium
    except ImportError:
        return None
    path = Chromium.find_browser(skip_local=False)
    return path if path and Path(path).is_file() and os.access(path, os.X_OK) else None


def render_offline(page: Path | str, browser: str, timeout_s: float = 60) -> bool:
    """Whether ``page`` shows a plotly figure in headless ``browser`` with the network cut off
    (every request goes to a proxy on a closed local port)."""
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
           "--virtual-time-budget=10000", "--dump-dom", Path(page).resolve().as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s).stdout
    return 'class="main-svg"' in dom


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python -m xstage_lab.offline OUTPUT_FOLDER", file=sys.stderr)
        return 2
    problems = network_loads(argv[0])
    for line in problems:
        print(line)
    if not problems:
        print(f"every page under {argv[0]} loads only files inside it")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
