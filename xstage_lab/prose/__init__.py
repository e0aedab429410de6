"""Prose computed from records: the sentences of the notebooks that quote results.

No measured number is typed into a notebook's Markdown. A notebook cell calls one function per
passage (``prose.characterization``, ``prose.attention``, ``prose.moe``, ``prose.design``) on
the records it has just loaded; the function returns ``Prose``, Markdown that names the records it
quotes and that the notebook displays as its cell's result.

Inside a passage every measured value is written with ``val`` (or ``span``/``vals``), every count
of measured outcomes with ``count``: the text a reader sees is plain, and ``Prose`` keeps beside
it (in the output's metadata, ``PROSE_KEY``) the list of values and counts and the text with
those replaced by placeholders. ``tests/test_prose.py`` uses that to check that the notebooks run
on a synthetic record set quote none of the committed records' values. The paper's numbers come
from ``data/paper`` (``paper.published``) and are written plainly: they are not this platform's.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

PROSE_KEY = "xstage_lab/prose"
_VALUE, _COUNT, _END = "\x1e", "\x1d", "\x1f"
_MARKED = re.compile(f"([{_VALUE}{_COUNT}])([^{_END}]*){_END}")
VALUE_SLOT, COUNT_SLOT = "⟨v⟩", "⟨n⟩"


def _num(x, spec: str) -> str:
    text = format(float(x), spec)
    if text.startswith("-") and float(text) == 0:  # no "−0" for a value that rounds to zero
        text = text[1:]
    return text.replace("-", "−")


def val(x, spec: str = ".2f") -> str:
    """A measured value (or one computed from measurements), formatted with ``spec``; a minus
    sign is written as such."""
    return f"{_VALUE}{_num(x, spec)}{_END}"


def count(n) -> str:
    """A count of measured outcomes (cells that gain, verdicts that agree, ...)."""
    return f"{_COUNT}{int(n)}{_END}"


def count_span(values: Iterable) -> str:
    """The range of counts (a trace's tiles, the SMs that ran them): ``lo–hi``, or the one count
    where both ends are the same. Counts follow the routing and the shapes, not a timing, so a
    rerun elsewhere may quote the same ones."""
    lo, hi = int(min(values)), int(max(values))
    return count(lo) if lo == hi else count(lo) + "–" + count(hi)


def vals(values: Iterable, spec: str = ".2f", unit: str = "") -> str:
    """``a, b and c`` (each a measured value), then ``unit``."""
    items = [val(x, spec) for x in values]
    text = items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]
    return text + unit


def span(values: Iterable, spec: str = ".2f", unit: str = "") -> str:
    """The range of measured ``values``: ``lo–hi`` (``lo to hi`` where one is negative), or the
    one value where both ends read the same."""
    xs = [float(x) for x in values]
    lo, hi = min(xs), max(xs)
    if _num(lo, spec) == _num(hi, spec):
        return val(lo, spec) + unit
    joint = " to " if lo < 0 or "+" in spec else "–"
    return val(lo, spec) + joint + val(hi, spec) + unit


def words(items: Iterable[str]) -> str:
    """``a, b and c``."""
    items = [str(i) for i in items]
    if not items:
        return "none"
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def plural(n, word: str, many: str | None = None) -> str:
    """``word`` or its plural (``many``, default ``word + "s"``) as ``n`` asks."""
    return word if int(n) == 1 else (many or word + "s")


def rec(record) -> str:
    """A record named in the text: its id, as code."""
    return f"`{record.record_id if hasattr(record, 'record_id') else record}`"


class Prose(str):
    """Markdown generated from records: the text, displayed as Markdown, with ``values`` and
    ``counts`` (each as printed) and ``skeleton`` (the text with every value ``VALUE_SLOT`` and
    every count ``COUNT_SLOT``) kept in the output's metadata."""

    values: list[str]
    counts: list[str]
    skeleton: str
    marked: str

    def __new__(cls, *paragraphs: str):
        """``paragraphs`` (text made with ``val``, ``count``, ...; or ``Prose``), joined by blank
        lines; empty ones are left out."""
        marked = "\n\n".join(getattr(p, "marked", p).strip("\n") for p in paragraphs if p)
        self = super().__new__(cls, _MARKED.sub(lambda m: m.group(2), marked))
        self.marked = marked
        found = _MARKED.findall(marked)
        self.values = [v for kind, v in found if kind == _VALUE]
        self.counts = [v for kind, v in found if kind == _COUNT]
        self.skeleton = _MARKED.sub(lambda m: VALUE_SLOT if m.group(1) == _VALUE else COUNT_SLOT,
                                    marked)
        return self

    def _repr_markdown_(self):
        return str(self), {PROSE_KEY: {"values": self.values, "counts": self.counts,
                                       "skeleton": self.skeleton}}

    def __repr__(self) -> str:  # the plain-text view of the output: the text itself
        return str(self)


# ------------------------------------------------------------------ numbers typed into Markdown

# What a notebook's Markdown may carry with digits in it: code spans and blocks, references to
# equations, sections, figures, tables, algorithms, conditions and issues (``eqs. 12–14``,
# ``Fig. 3(a)``, ``§5.2.2–5.2.3``), and widths and counts that name a kind of thing
# (``16-byte``, ``128-row``). Digits inside a word (``Qwen3.5``, ``sm_90``, ``H200``, ``L2``,
# a commit) are not numbers, nor is unity or zero as a threshold (``speedup < 1``).
_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
_REF_NUM = r"\d+(?:\.\d+)*[a-z]?(?:\([a-z]\))?"
_REFERENCE = re.compile(
    r"(?:\beqs?\.|\bEqs?\.|§|\bFigs?\.|\bTables?|\bAlgorithm|\bissues?|\bConditions?|\bSection|\b[Nn]otebooks?)"
    rf"\s*{_REF_NUM}(?:\s*(?:–|-|,|/|and|or|to)\s*(?:§|eq\.\s*)?{_REF_NUM})*")
_KIND = re.compile(r"\b\d+-(?:byte|bit|warp|row|stage|GPU|way|word|lane|thread)s?\b")
_UNITY = re.compile(r"(?:[<>≤≥]|\b(?:below|above|under|over|exceeds?|reaches))\s*[01]\b(?![.,]\d)")
_NUMBER = re.compile(r"(?<![\w.\-])\d+(?:[.,]\d+)*(?![\w]|\.\w)")


def typed_numbers(markdown: str) -> list[str]:
    """The numbers typed into ``markdown`` outside what ``_CODE``, ``_REFERENCE`` and ``_KIND``
    allow: every one is a number a reader would take for a result (or a setting that belongs to a
    record, not to the text)."""
    text = _UNITY.sub(" ", _KIND.sub(" ", _REFERENCE.sub(" ", _CODE.sub(" ", markdown))))
    return _NUMBER.findall(text)


def notebook_typed_numbers(path) -> dict[str, list[str]]:
    """Per Markdown cell of the notebook at ``path`` (by cell id) with typed numbers: them."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    found = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and (numbers := typed_numbers(cell.source)):
            found[cell.get("id", str(i))] = numbers
    return found
