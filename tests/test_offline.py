"""Published outputs open without network access (issue 20): on a small synthetic notebook run
through the runner, no figure page or index loads anything from the network, plotly.js is shipped
once in the output folder, the index shows every figure with its caption, and the executed
notebook carries a static image beside each figure's plotly JSON where an image engine exists
(and says once why not where none does)."""
import json

import nbformat
import pytest

from xstage_lab import offline, runner

FIGURES = {"line": "a line, caption one", "bars": "bars, caption two"}


def _reproduce_synthetic(tmp_path, monkeypatch):
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"},
                                            "language_info": {"name": "python"}})
    params = nbformat.v4.new_code_cell("backend = 'auto'\nout_dir = None")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(
        "import pandas as pd\nimport plotly.graph_objects as go\nfrom xstage_lab import plots\n"
        f"captions = {FIGURES!r}\n"
        "plots.publish(go.Figure(go.Scatter(x=[1, 2, 3], y=[2, 1, 3]), layout=dict(title='Line')),\n"
        "              'line', out_dir, captions['line'])\n"
        "plots.publish(go.Figure(go.Bar(x=['a', 'b'], y=[1, 2]), layout=dict(title='Bars')),\n"
        "              'bars', out_dir, captions['bars'])\n"
        "plots.publish_table(pd.DataFrame({'quantity': ['R'], 'paper': [717.0], 'here': [369.0]}),\n"
        "                    'table', out_dir, 'A table')")]
    (tmp_path / "nb").mkdir()
    nbformat.write(nb, tmp_path / "nb" / "01_synthetic.ipynb")
    monkeypatch.setattr(runner, "NOTEBOOKS_DIR", tmp_path / "nb")
    out = tmp_path / "out"
    assert runner.reproduce(backend="replay", out=out) == 0
    return out


def _figure_outputs(out):
    executed = nbformat.read(out / "01_synthetic.ipynb", as_version=4)
    outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs]
    figures = [o for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    return figures, text


def _check_offline(out):
    assert offline.network_loads(out) == []
    assert (out / "plotly.min.js").stat().st_size > 1_000_000  # shipped once, at the top
    assert not list((out / "01_synthetic").glob("*.js"))
    for name in FIGURES:
        page = (out / "01_synthetic" / f"{name}.html").read_text()
        assert 'src="../plotly.min.js"' in page and "cdn.plot.ly" not in page
    index = (out / "index.html").read_text()
    for caption in FIGURES.values():
        assert caption in index
    assert "717.0" in index  # tables: the paper's value beside this platform's
    return index


def test_network_loads_flags_cdn_scripts_and_missing_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "here.js").write_text("")
    (tmp_path / "sub" / "page.html").write_text(
        '<script src="../here.js"></script><script src="https://cdn.plot.ly/plotly.min.js"></script>'
        '<link rel="stylesheet" href="//fonts.example.org/a.css"><img src="missing.png">'
        '<style>@import "http://example.org/b.css"; div{background:url(data:image/png;base64,AA)}</style>'
        '<a href="https://arxiv.org/abs/2607.23264">the paper</a>')
    problems = offline.network_loads(tmp_path)
    assert len(problems) == 4, problems
    assert any("cdn.plot.ly" in p for p in problems) and any("missing.png" in p for p in problems)
    assert any("fonts.example.org" in p for p in problems) and any("b.css" in p for p in problems)
    assert offline.main([str(tmp_path)]) == 1


def test_without_an_image_engine_figures_open_offline_and_say_why(tmp_path, monkeypatch):
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-browser-here"))
    if offline.find_browser():  # kaleido's own Chrome download wins over BROWSER_PATH
        pytest.skip("a browser kaleido finds first is installed")
    out = _reproduce_synthetic(tmp_path, monkeypatch)
    index = _check_offline(out)
    # every figure shown, as a frame of its own offline page; one line says what to install
    for name in FIGURES:
        assert f'<iframe src="01_synthetic/{name}.html"' in index
    assert index.count('class="note"') == 1 and "install Chrome or Chromium" in index
    figures, text = _figure_outputs(out)
    assert len(figures) == 2 and all("text/html" not in o.data for o in figures)
    assert text.count("No static images") == 1
    entries = [json.loads(line) for line in (out / "01_synthetic" / "manifest.jsonl").read_text().splitlines()]
    assert all("Chrome" in e["no_image"] for e in entries if e["kind"] == "figure")


def test_with_an_image_engine_figures_carry_pictures_and_render_offline(tmp_path, monkeypatch):
    browser = offline.find_browser()
    if browser is None:
        pytest.skip("no Chrome or Chromium here for kaleido (see README: static images)")
    out = _reproduce_synthetic(tmp_path, monkeypatch)
    index = _check_offline(out)
    for name in FIGURES:
        assert f'<img src="01_synthetic/{name}.png"' in index
        assert (out / "01_synthetic" / f"{name}.png").read_bytes().startswith(b"\x89PNG")
        assert offline.render_offline(out / "01_synthetic" / f"{name}.html", browser)
    assert 'class="note"' not in index
    figures, text = _figure_outputs(out)
    assert len(figures) == 2 and all("image/png" in o.data and "text/html" not in o.data
                                      for o in figures)
    assert "No static images" not in text


def test_a_figure_s_bundle_is_plotly_s_mimetype_renderer_s():
    """``publish.mime_bundle`` gives what ``pio.renderers["plotly_mimetype"]`` would, without
    importing plotly's renderers."""
    import plotly.graph_objects as go
    import plotly.io as pio

    from xstage_lab.plots.publish import mime_bundle

    fig = go.Figure(go.Scatter(x=[1.5, 2, 3], y=[2, None, 3], name="µs"),
                    layout=dict(title="Line", yaxis_type="log"))
    assert mime_bundle(fig) == pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict())
