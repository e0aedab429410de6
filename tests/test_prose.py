"""Issue 20, prose computed from records: no notebook's Markdown carries a typed number, and the
sentences that quote results follow the records they are run on.

Two checks, each shown to fail on a number typed back in:
- ``prose.typed_numbers`` scans every Markdown cell: outside code, references (eq., Fig., §, ...)
  and kinds (16-byte, 128-row) no number may stand in it.
- every notebook runs on the committed records and on a synthetic record set with other values
  (``synthetic.write_synthetic_record_set``); where a generated sentence reads the same in both
  runs, each measured value in it must differ, and no committed record id, nor any value the
  committed run quoted, may be left in the synthetic run's text.
"""
import difflib
import re

import nbformat
import pytest

from xstage_lab import prose, runner
from xstage_lab.prose import (PROSE_KEY, COUNT_SLOT, VALUE_SLOT, Prose, count, count_span, span,
                              typed_numbers, val, vals)

NOTEBOOKS = sorted(runner.NOTEBOOKS_DIR.glob("*.ipynb"))
RECORD_ID = re.compile(r"\b\d{8}T\d{6}Z-[0-9a-f]{10}\b")
_TOKEN = re.compile(f"{VALUE_SLOT}|{COUNT_SLOT}|\\s+|[^\\s⟨]+|⟨")
# Values the synthetic run reads the same by chance, each checked by hand (passage, value): why.
# Three significant digits round alike about once in a thousand comparisons.
COINCIDENCES = {
    (("local-sweep", 0), "0.990"): "the best lead's lowest speed over Expert-Wave: the committed "
    "record's is Hy3 fp8 balanced's, the synthetic set's DeepSeek-V4-Flash bf16 skewed's "
    "(moe_host/h200-x1-host/20261202T234337Z-436394c7e6, 2026-12-02)",
    (("a579076c", 0), "2.3"): "the smallest excess of the measured Expert-Wave stall over the "
    "forecast's among the cells where it exceeds 2 µs (so near 2 µs in any record set): the "
    "committed record's is GLM-5.x bf16 skewed h=4's, the synthetic set's MiMo-V2.5 fp8 skewed "
    "h=1's (moe_host/h200-x1-host/20261203T183751Z-baa09de5b9, 2026-12-03)",
    (("c5e9a2b7", 0), "0.999"): "a least ratio of the fused kernel's time after a sequence over "
    "its time right after itself: ratios within a thousandth of 1 keep their three decimals "
    "under the synthetic set's power of a ratio (moe_call_probe/h200-x1, 2026-12-04)",
    (("c24cb15c", 1), "12"): "the largest one-token graphed call's time less its kernels' "
    "device times: the committed records' is DeepSeek-V4-Pro bf16 EP = 8 rank's (11.7 µs), the "
    "synthetic set's DiT-MoE fp8 EP = 1's (11.6 µs), a difference of two columns it scales by "
    "1.79 and 1.89 (moe_layer/h200-x1/20261206T004931Z-9d04154fcc, 2026-12-06)",
}


# ------------------------------------------------------------------------------- Prose itself

def test_prose_keeps_values_counts_and_skeleton_beside_the_text():
    p = Prose(f"T_RS is {span([0.446, 0.601], '.3f')} µs in {count(7)} shapes",
              Prose(f"drift {val(-0.4167, '+.2f')} µs and {vals([1, 2.5], '.1f', ' µs')}"))
    assert p == "T_RS is 0.446–0.601 µs in 7 shapes\n\ndrift −0.42 µs and 1.0 and 2.5 µs"
    assert p.values == ["0.446", "0.601", "−0.42", "1.0", "2.5"]
    assert p.counts == ["7"]
    assert p.skeleton == (f"T_RS is {VALUE_SLOT}–{VALUE_SLOT} µs in {COUNT_SLOT} shapes\n\n"
                          f"drift {VALUE_SLOT} µs and {VALUE_SLOT} and {VALUE_SLOT} µs")
    text, meta = p._repr_markdown_()
    assert text == str(p) and meta[PROSE_KEY]["values"] == p.values


def test_span_reads_one_value_where_both_ends_print_alike_and_no_negative_zero():
    assert span([0.5001, 0.4999], ".2f") == val(0.5, ".2f")
    assert str(Prose(span([-0.3, 0.2], ".1f"))) == "−0.3 to 0.2"
    assert str(Prose(span([1, 2], "+.0f"))) == "+1 to +2"
    assert str(Prose(val(-0.0004, ".2f"))) == "0.00"


def test_a_span_of_counts_is_counts_not_values():
    p = Prose(f"{count_span([88, 44, 66])} tiles on {count_span([44, 44])} SMs")
    assert p == "44–88 tiles on 44 SMs"
    assert p.counts == ["44", "88", "44"] and p.values == []


# ------------------------------------------------------------------ numbers typed into Markdown

@pytest.mark.parametrize("text", [
    "eqs. 12–14, eq. 3, Fig. 3(a), Figs. 3a, 3b, §5.2.2–5.2.3, Table 2, Algorithm 1, eqs. 1 and 3",
    "Qwen3.5, GLM-5.x, DeepSeek-V4-Flash, sm_90, H200, fp8, L2, Linear-1, commit 5aa02f2",
    "16-byte stores, 128-row tiles, two-stage rings, `gluon_ws_128x128_s2`, `R = 717` in code",
    "every cell with speedup < 1, a makespan ratio below 1, notebook 02, Condition 1, issue 8",
])
def test_references_names_and_code_are_not_typed_numbers(text):
    assert typed_numbers(text) == []


@pytest.mark.parametrize("text, numbers", [
    ("34 of 36 skewed cells gain (median 1.074)", ["34", "36", "1.074"]),
    ("the recovery gap G* is 5.40 µs", ["5.40"]),
    ("T_RS is 0.446–0.601 µs, stalls −0.12 to −0.47 µs", ["0.446", "0.601", "0.12", "0.47"]),
    ("on 2026-12-01 at K = 132, R = 369.2 GB/s (P = 2)", ["2026", "132", "369.2", "2"]),
    ("the speedup is 1.5 at M = 16384", ["1.5", "16384"]),
])
def test_measured_values_are_typed_numbers(text, numbers):
    assert typed_numbers(text) == numbers


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_notebook_markdown_cell_types_a_number(notebook):
    assert prose.notebook_typed_numbers(notebook) == {}


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_number_typed_back_into_a_markdown_cell_is_found(notebook, tmp_path):
    nb = nbformat.read(notebook, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "markdown")
    cell.source += "\n\nOutside DiT-MoE, 34 of 36 skewed cells gain (median 1.074); G* = 5.40 µs."
    copy = tmp_path / notebook.name
    nbformat.write(nb, copy)
    assert prose.notebook_typed_numbers(copy) == {cell.id: ["34", "36", "1.074", "5.40"]}


# ---------------------------------------------------- the notebooks on a synthetic record set

def _prose_outputs(nb) -> dict:
    """{(cell id, n): the n-th generated passage's metadata} of an executed notebook."""
    out = {}
    for cell in nb.cells:
        passages = [o.get("metadata", {}).get("text/markdown", {}).get(PROSE_KEY)
                    for o in cell.get("outputs", [])]
        out |= {(cell.id, n): p for n, p in enumerate(x for x in passages if x)}
    return out


def _text(nb) -> str:
    """Everything a reader of an executed notebook reads: its Markdown and its text outputs."""
    parts = [c.source for c in nb.cells if c.cell_type == "markdown"]
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            parts += [v for k, v in o.get("data", {}).items() if k.startswith("text/")]
            parts.append(o.get("text", ""))
    return "\n".join(p if isinstance(p, str) else "".join(p) for p in parts)


def _significant(value: str) -> int:
    return len(re.sub(r"^0+", "", re.sub(r"\D", "", value)).rstrip("0"))


def _aligned_values(a: dict, b: dict):
    """The values of two passages that stand at the same place of the same wording: the
    skeletons' tokens aligned (``difflib``), each value slot of an equal run paired."""
    ta, tb = _TOKEN.findall(a["skeleton"]), _TOKEN.findall(b["skeleton"])

    def slots(tokens):
        n, out = 0, []
        for t in tokens:
            out.append(n if t == VALUE_SLOT else None)
            n += t == VALUE_SLOT
        return out

    sa, sb = slots(ta), slots(tb)
    for block in difflib.SequenceMatcher(None, ta, tb, autojunk=False).get_matching_blocks():
        for j in range(block.size):
            if sa[block.a + j] is not None:
                yield a["values"][sa[block.a + j]], b["values"][sb[block.b + j]]


def committed_values_left(committed, synthetic) -> tuple[list[str], int]:
    """What of the committed run's quotes is left in the synthetic run of the same notebook
    (both executed): measured values that read the same at the same place of a passage (values
    of one significant digit, like 0.07 or 100%, can round alike and are not counted), committed
    record ids anywhere in its text, and committed values (two significant digits or more) typed
    into its Markdown. Returns (what is left, how many values were compared)."""
    a, b = _prose_outputs(committed), _prose_outputs(synthetic)
    left, compared = [], 0
    for key, passage in a.items():
        if key not in b:
            left.append(f"passage {key} is missing from the synthetic run")
            continue
        for x, y in _aligned_values(passage, b[key]):
            compared += 1
            if x == y and _significant(x) > 1 and (key, x) not in COINCIDENCES:
                left.append(f"{x} in passage {key}")
    text = _text(synthetic)
    ids = {i for p in a.values() for i in RECORD_ID.findall(p["skeleton"])}
    left += [f"record {i}" for i in sorted(ids) if i in text]
    quoted = {v.lstrip("+−") for p in a.values() for v in p["values"] if _significant(v) > 1}
    for cell in synthetic.cells:
        if cell.cell_type == "markdown":
            left += [f"{n} typed in cell {cell.id}" for n in typed_numbers(cell.source)
                     if n in quoted]
    return left, compared


@pytest.fixture(scope="module")
def runs(tmp_path_factory, reproduced):
    """Every notebook executed on the committed records (the session's ``reproduced``, which
    tests/test_notebooks.py reads too) and on a synthetic record set made from them with other
    values: {"committed"|"synthetic": output folder}."""
    from tests.one_kernel import replay
    from tests.synthetic import write_synthetic_record_set
    from xstage_lab.records import RECORDS_ENV

    base = tmp_path_factory.mktemp("prose")
    write_synthetic_record_set(base / "records")
    out = {"committed": reproduced, "synthetic": base / "synthetic"}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RECORDS_ENV, str(base / "records"))
        assert replay(out["synthetic"]) == 0
    return out


@pytest.mark.parametrize("notebook", [p.name for p in NOTEBOOKS])
def test_a_synthetic_record_set_leaves_none_of_the_committed_quotes(runs, notebook):
    committed = nbformat.read(runs["committed"] / notebook, as_version=4)
    synthetic = nbformat.read(runs["synthetic"] / notebook, as_version=4)
    left, compared = committed_values_left(committed, synthetic)
    assert left == []
    values = sum(len(p["values"]) for p in _prose_outputs(committed).values())
    assert compared >= 0.75 * values  # most passages keep their wording: the check is not idle
    if notebook != "05_beyond_the_paper.ipynb":  # 05 quotes nothing: its results are tables
        assert values > 0


def test_a_committed_value_typed_back_is_left_in_the_synthetic_run(runs, tmp_path):
    name = "03_fused_moe.ipynb"
    committed = nbformat.read(runs["committed"] / name, as_version=4)
    synthetic = nbformat.read(runs["synthetic"] / name, as_version=4)
    first = next(iter(_prose_outputs(committed).values()))
    value = next(v for v in first["values"] if _significant(v) > 1)
    cell = next(c for c in synthetic.cells if c.cell_type == "markdown")
    cell.source += f"\n\nThe geomean speedup is {value}."
    copy = tmp_path / name
    nbformat.write(synthetic, copy)
    left, _ = committed_values_left(committed, nbformat.read(copy, as_version=4))
    assert left == [f"{value} typed in cell {cell.id}"]
