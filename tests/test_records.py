"""Records: append-only Parquet files with a JSON provenance header."""
from __future__ import annotations

import json
import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from xstage_lab import records
from xstage_lab.records import (
    Record, RecordExistsError, latest_record, list_records, platforms, read_record,
    resolve_record, write_record)


def _table(offset: float = 0.0) -> pd.DataFrame:
    return pd.DataFrame({"point": [0, 1, 2], "t_iss_us": [0.5 + offset, 1.25, 2.0],
                         "path": ["remote", "local", "remote"], "warmup": [True, False, False]})


def _freeze(monkeypatch, when: datetime):
    """Make records' clock read ``when``."""
    class Frozen(datetime):
        @classmethod
        def now(cls, tz=None):
            return when
    monkeypatch.setattr(records, "datetime", Frozen)


T1 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
T2 = datetime(2026, 1, 2, 3, 4, 6, tzinfo=timezone.utc)


def test_round_trip(tmp_path):
    df = _table()
    params = {"repeats": 3, "sweeps": ["gap"], "where": Path("/x/y")}
    prov = {"gpu_count": 2, "git_commit": "abc"}
    path = write_record("remote_store", "h200-x2", df, params, prov, root=tmp_path)
    assert path.parent == tmp_path / "remote_store" / "h200-x2"
    assert path.suffix == ".parquet"
    rec = read_record(path)
    assert isinstance(rec, Record)
    pd.testing.assert_frame_equal(rec.table, df)
    assert rec.path == path
    assert rec.platform == "h200-x2"
    assert rec.meta["experiment"] == "remote_store"
    assert rec.params == {"repeats": 3, "sweeps": ["gap"], "where": "/x/y"}  # default=str
    assert rec.provenance == prov
    assert rec.record_id == path.stem
    created = datetime.fromisoformat(rec.meta["created_utc"])
    assert created.tzinfo is not None
    # id = <UTC second>-<10 hex digits of the table digest>
    stamp, digest = rec.record_id.split("-")
    assert stamp == f"{created:%Y%m%dT%H%M%SZ}"
    assert len(digest) == 10 and int(digest, 16) >= 0
    # read_record accepts a str as well
    pd.testing.assert_frame_equal(read_record(str(path)).table, df)


def test_same_table_same_second_collides_and_keeps_the_first(tmp_path, monkeypatch):
    _freeze(monkeypatch, T1)
    path = write_record("remote_store", "h200-x2", _table(), {"run": 1}, {}, root=tmp_path)
    before = path.read_bytes()
    with pytest.raises(RecordExistsError):
        write_record("remote_store", "h200-x2", _table(), {"run": 2}, {}, root=tmp_path)
    assert issubclass(RecordExistsError, FileExistsError)
    assert path.read_bytes() == before
    assert read_record(path).params == {"run": 1}
    assert list_records("remote_store", root=tmp_path) == [path]


def test_different_tables_same_second_are_two_records(tmp_path, monkeypatch):
    _freeze(monkeypatch, T1)
    a = write_record("remote_store", "h200-x2", _table(0.0), {}, {}, root=tmp_path)
    b = write_record("remote_store", "h200-x2", _table(1.0), {}, {}, root=tmp_path)
    assert a != b
    assert a.stem.split("-")[0] == b.stem.split("-")[0] == "20260102T030405Z"
    assert sorted(list_records("remote_store", "h200-x2", root=tmp_path)) == sorted([a, b])


def test_same_table_next_second_is_a_new_record(tmp_path, monkeypatch):
    _freeze(monkeypatch, T1)
    a = write_record("remote_store", "h200-x2", _table(), {}, {}, root=tmp_path)
    _freeze(monkeypatch, T2)
    b = write_record("remote_store", "h200-x2", _table(), {}, {}, root=tmp_path)
    assert a != b
    assert a.stem.split("-")[1] == b.stem.split("-")[1]  # same table, same digest


def test_list_latest_resolve(tmp_path, monkeypatch):
    _freeze(monkeypatch, T2)
    newer = write_record("remote_store", "h200-x2", _table(2.0), {"n": "newer"}, {}, root=tmp_path)
    _freeze(monkeypatch, T1)
    older = write_record("remote_store", "h200-x2", _table(1.0), {"n": "older"}, {}, root=tmp_path)
    other = write_record("remote_store", "h100-x8", _table(3.0), {"n": "other"}, {}, root=tmp_path)
    write_record("calibration", "h200-x2", _table(4.0), {"n": "cal"}, {}, root=tmp_path)

    # oldest first, by id (creation time), whatever the write order
    assert list_records("remote_store", "h200-x2", root=tmp_path) == [older, newer]
    assert set(list_records("remote_store", root=tmp_path)) == {older, newer, other}
    assert list_records("nothing_here", root=tmp_path) == []
    assert platforms("remote_store", root=tmp_path) == ["h100-x8", "h200-x2"]

    assert latest_record("remote_store", "h200-x2", root=tmp_path).path == newer
    assert latest_record("remote_store", "h100-x8", root=tmp_path).params == {"n": "other"}
    with pytest.raises(FileNotFoundError):
        latest_record("remote_store", "a100-x4", root=tmp_path)

    # None → latest; by id; by path (str or Path); unknown → FileNotFoundError
    assert resolve_record("remote_store", "h200-x2", None, root=tmp_path).path == newer
    assert resolve_record("remote_store", "h200-x2", older.stem, root=tmp_path).path == older
    assert resolve_record("remote_store", "h200-x2", str(older), root=tmp_path).params == \
        {"n": "older"}
    # a path is taken as is, even of another platform
    assert resolve_record("remote_store", "h200-x2", str(other), root=tmp_path).path == other
    with pytest.raises(FileNotFoundError):
        resolve_record("remote_store", "h200-x2", "20990101T000000Z-0123456789", root=tmp_path)
    with pytest.raises(FileNotFoundError):  # an id of another platform is not this one's
        resolve_record("remote_store", "h200-x2", other.stem, root=tmp_path)
    with pytest.raises(FileNotFoundError):
        resolve_record("remote_store", "h200-x2", str(tmp_path / "missing.parquet"),
                       root=tmp_path)


def test_parquet_without_header_is_rejected(tmp_path):
    path = tmp_path / "plain.parquet"
    pq.write_table(pa.Table.from_pandas(_table(), preserve_index=False), path)
    with pytest.raises(ValueError, match="not an xstage_lab record"):
        read_record(path)
    with pytest.raises(ValueError):
        resolve_record("remote_store", "h200-x2", str(path), root=tmp_path)


def test_header_is_json_in_schema_metadata(tmp_path):
    path = write_record("remote_store", "h200-x2", _table(), {"a": 1}, {"b": 2}, root=tmp_path)
    meta = json.loads(pq.read_schema(path).metadata[b"xstage_lab"])
    assert meta["params"] == {"a": 1} and meta["provenance"] == {"b": 2}
    assert meta["platform"] == "h200-x2" and meta["experiment"] == "remote_store"


@pytest.mark.parametrize("experiment,platform", [
    ("remote-store", "h200-x2"),     # experiment must be an identifier
    ("../escape", "h200-x2"),
    ("a/b", "h200-x2"),
    ("", "h200-x2"),
    ("remote_store", "h200/x2"),
    ("remote_store", "../h200"),
    ("remote_store", "h200 x2"),
    ("remote_store", ""),
])
def test_bad_names_rejected_before_writing(tmp_path, experiment, platform):
    with pytest.raises(ValueError, match="plain names"):
        write_record(experiment, platform, _table(), {}, {}, root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_imports_are_named_by_when_they_were_measured(tmp_path):
    """Imported in the opposite order, the later measurement is still the latest record."""
    def bench_json(name: str, measured: str) -> Path:
        prov = {"gpu_name": "NVIDIA H200", "gpu_count": 2, "date_utc": measured}
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"metadata": {"provenance": prov}, "rows": [{"run": name}]}))
        return path

    later = records.import_bench_json(bench_json("later", "2026-11-29T22:57:00+00:00"), "fa_tuning",
                                      root=tmp_path)
    records.import_bench_json(bench_json("earlier", "2026-11-29T22:44:26.79+00:00"), "fa_tuning",
                              root=tmp_path)
    assert later.name.startswith("20261129T225700Z-")
    assert latest_record("fa_tuning", "h200-x2", tmp_path).table["run"].tolist() == ["later"]


def test_an_import_keeps_the_record_name_its_run_chose(tmp_path):
    """A run that left out part of its experiment is saved apart (remote_store_partial), also
    when its output is imported later."""
    prov = {"gpu_name": "NVIDIA H200", "gpu_count": 1, "date_utc": "2026-12-02T08:14:24+00:00"}
    out = tmp_path / "rows.json"
    out.write_text(json.dumps({"metadata": {"experiment": "remote_store_partial", "link": "host",
                                            "provenance": prov}, "rows": [{"x": 1}]}))
    path = records.import_bench_json(out, "remote_store", root=tmp_path)
    assert path.parent == tmp_path / "remote_store_partial" / "h200-x1-host"
    other = records.import_bench_json(out, "moe", root=tmp_path)  # not a part of moe: as named
    assert other.parent == tmp_path / "moe" / "h200-x1-host"


def test_git_commit_applies_the_errata_of_the_records_root(tmp_path):
    prov = {"gpu_count": 2, "git_commit": "stale+dirty"}
    first = write_record("moe", "h200-x2", _table(), {}, prov, root=tmp_path)
    second = write_record("moe", "h200-x2", _table(1.0), {}, prov, root=tmp_path / "other")
    (tmp_path / "errata.json").write_text(json.dumps(
        {"provenance.git_commit": {f"moe/h200-x2/{first.stem}": "0123abcd"}}))
    assert read_record(first).git_commit == "0123abcd"
    assert read_record(second).git_commit == "stale+dirty"  # no errata under its root


def test_committed_errata_name_committed_or_retired_records():
    errata = json.loads((records.RECORDS_DIR / records.ERRATA_FILE).read_text())
    named = [*errata["provenance.git_commit"], *errata["invalid"]["records"]]
    for key in named:
        assert (records.RECORDS_DIR / f"{key}.parquet").is_file() or key in records.retired(), key


def _mark_invalid(root: Path, *paths: Path) -> None:
    (root / "errata.json").write_text(json.dumps({"invalid": {
        "why": "measured with the wrong kernel",
        "records": [f"{p.parents[1].name}/{p.parent.name}/{p.stem}" for p in paths]}}))


def test_records_the_errata_mark_invalid_are_never_listed(tmp_path, monkeypatch):
    _freeze(monkeypatch, T1)
    good = write_record("remote_ops", "h200-x2", _table(0.0), {"n": "good"}, {}, root=tmp_path)
    _freeze(monkeypatch, T2)
    bad = write_record("remote_ops", "h200-x2", _table(1.0), {"n": "bad"}, {}, root=tmp_path)
    alone = write_record("remote_ops", "h100-x8", _table(2.0), {}, {}, root=tmp_path)
    _mark_invalid(tmp_path, bad, alone)

    assert list_records("remote_ops", root=tmp_path) == [good]
    assert platforms("remote_ops", root=tmp_path) == ["h200-x2"]
    assert latest_record("remote_ops", "h200-x2", root=tmp_path).path == good
    assert resolve_record("remote_ops", "h200-x2", None, root=tmp_path).path == good
    with pytest.raises(FileNotFoundError):
        latest_record("remote_ops", "h100-x8", root=tmp_path)
    # the same file under a root without errata is an ordinary record
    other = tmp_path / "other" / "remote_ops" / "h200-x2" / bad.name
    other.parent.mkdir(parents=True)
    other.write_bytes(bad.read_bytes())
    assert latest_record("remote_ops", "h200-x2", root=tmp_path / "other").path == other


def test_loading_an_invalid_record_by_name_names_the_errata_entry(tmp_path):
    bad = write_record("remote_ops", "h200-x2", _table(), {}, {}, root=tmp_path)
    _mark_invalid(tmp_path, bad)
    key = f"remote_ops/h200-x2/{bad.stem}"
    for load in (lambda: resolve_record("remote_ops", "h200-x2", bad.stem, root=tmp_path),
                 lambda: resolve_record("remote_ops", "h200-x2", str(bad), root=tmp_path),
                 lambda: read_record(bad)):
        with pytest.raises(records.InvalidRecordError) as e:
            load()
        assert key in str(e.value) and str(tmp_path / "errata.json") in str(e.value)
        assert "measured with the wrong kernel" in str(e.value)


def test_errata_are_reread_when_they_change(tmp_path):
    path = write_record("remote_ops", "h200-x2", _table(), {}, {}, root=tmp_path)
    assert list_records("remote_ops", root=tmp_path) == [path]  # no errata yet
    _mark_invalid(tmp_path, path)
    assert list_records("remote_ops", root=tmp_path) == []


def test_summary_leaves_out_invalid_records(tmp_path):
    from xstage_lab.summary import FA_A2A_KEYS, summary

    def moe(speedup):
        return pd.DataFrame([{"model": "m", "precision": "fp8", "routing": "skewed", "tokens": 4096,
                              "wave_us": 10.0 * speedup, "interleaved_us": 10.0,
                              "unfused_us": 30.0, "speedup": speedup}])

    def fa_a2a(fa_us):
        return pd.DataFrame([dict(dict.fromkeys(FA_A2A_KEYS, 1.0), M=8192, heads=24, head_dim=128,
                                  P=2, fa_us=fa_us)])

    def at(hour):
        return datetime(2026, 12, 1, hour, tzinfo=timezone.utc)

    write_record("moe", "test-x2", moe(1.5), {}, {}, tmp_path, created=at(1))
    bad_moe = write_record("moe", "test-x2", moe(0.5), {}, {}, tmp_path, created=at(2))
    write_record("fa_a2a", "test-x2", fa_a2a(100.0), {}, {}, tmp_path, created=at(1))
    bad_fa = write_record("fa_a2a", "test-x2", fa_a2a(999.0), {}, {}, tmp_path, created=at(2))
    only_bad = write_record("moe", "test-x8", moe(0.5), {}, {}, tmp_path, created=at(2))
    _mark_invalid(tmp_path, bad_moe, bad_fa, only_bad)

    s = summary(root=tmp_path)["platforms"]
    assert set(s) == {"test-x2"}
    assert s["test-x2"]["moe"]["max_speedup"] == 1.5
    assert [row["fa_us"] for row in s["test-x2"]["fa_a2a"]] == [100.0]


def test_committed_invalid_records_are_out_of_replay():
    errata = json.loads((records.RECORDS_DIR / records.ERRATA_FILE).read_text())
    for key in errata["invalid"]["records"]:
        experiment, platform, record_id = key.split("/")
        assert record_id not in [p.stem for p in list_records(experiment, platform)]
        assert latest_record(experiment, platform).record_id != record_id
        error = (records.RetiredRecordError if key in records.retired()
                 else records.InvalidRecordError)
        with pytest.raises(error, match=key):
            resolve_record(experiment, platform, record_id)


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=records.DATA_DIR.parent, capture_output=True,
                          text=True)


# The commits that hold retired and transcoded records' original bytes are history: a shallow
# clone lacks them, and these checks then cannot be made there (a full clone makes them).
needs_history = pytest.mark.skipif(
    _git("rev-parse", "--is-shallow-repository").stdout.strip() != "false",
    reason="needs the repository's full git history (shallow clone or no git)")


@needs_history
def test_retired_records_are_out_of_the_tree_and_in_their_commit():
    """Issue 21: a record leaves the tree only through retired.json, whose commit still holds it;
    no record in the tree is listed there."""
    gone = records.retired()
    assert gone, "no retired.json entries"
    for key, entry in gone.items():
        assert entry["path"] == f"data/records/{key}.parquet" and entry["id"] == key.split("/")[2]
        assert entry["reason"]
        assert not (records.DATA_DIR.parent / entry["path"]).exists(), key
        assert _git("cat-file", "-e", f"{entry['commit']}:{entry['path']}").returncode == 0, key
    tracked = _git("ls-files", "data/records").stdout.split()
    present = {p.removeprefix("data/records/").removesuffix(".parquet")
               for p in tracked if p.endswith(".parquet")}
    assert not present & set(gone)


def test_nothing_read_or_named_is_retired():
    """What the summary and the notebooks read (their snapshots' records) is in the tree, and no
    tracked text file but the errata and the manifest names a retired record."""
    gone = records.retired()
    snapshots = Path(__file__).parent / "snapshots"
    for read in (snapshots / "summary.json", snapshots / "tables" / "records.json"):
        assert not set(json.loads(read.read_text())["records"]) & set(gone), read.name
    # one git grep for every id (a process per id took 5 s): "path\0id" per match
    patterns = [a for entry in gone.values() for a in ("-e", entry["id"])]
    found = _git("grep", "-I", "-o", "-F", "--null", *patterns, "--", ".",
                 f":!data/records/{records.ERRATA_FILE}",
                 f":!data/records/{records.RETIRED_FILE}").stdout
    files: dict[str, list[str]] = {}
    for line in found.splitlines():
        path, record_id = line.split("\0", 1)
        files.setdefault(record_id, []).append(path)
    for key, entry in gone.items():
        named = list(dict.fromkeys(files.get(entry["id"], [])))
        assert named == [], (key, named)


# How far from a retired record's stamp a text must say that it is retired (a sentence that cites
# several says so once)
RETIRED_CONTEXT = 500


def test_a_text_citing_a_retired_record_by_its_stamp_says_it_is_retired():
    """A tracked text (code, docs, notebooks; the errata and the manifest are JSON) that cites a
    retired record by its stamp (``YYYYMMDDTHHMMSSZ``, or ``…HHMMSSZ`` where no record in the
    tree has that time) says "retired" within ``RETIRED_CONTEXT`` characters, so that a reader
    looks for its bytes in retired.json's commit, not in the tree."""
    stamp = re.compile(r"(\d{8}T\d{6}Z)")
    tracked = _git("ls-files").stdout.split()
    live = {m.group(1) for p in tracked if p.endswith(".parquet") and (m := stamp.search(p))}
    gone = {r["id"].split("-")[0] for r in records.retired().values()} - live
    short = {s.split("T")[1] for s in gone} - {s.split("T")[1] for s in live}
    cited = re.compile(r"(\d{8}T\d{6}Z|…\d{6}Z)")
    silent = []
    for path in tracked:
        if not path.endswith((".py", ".md", ".ipynb", ".cu", ".cpp")):
            continue
        text = (records.DATA_DIR.parent / path).read_text(encoding="utf-8")
        for m in cited.finditer(text):
            key = m.group(1)
            if (key in gone or key.lstrip("…") in short) and "retired" not in text[
                    max(0, m.start() - RETIRED_CONTEXT):m.end() + RETIRED_CONTEXT].lower():
                line = text.count("\n", 0, m.start()) + 1
                silent.append(f"{path}:{line}: {key}")
    assert silent == []


def test_asking_for_a_retired_record_names_its_commit(tmp_path, monkeypatch):
    _freeze(monkeypatch, T1)
    path = write_record("remote_store", "h200-x2", _table(), {}, {}, tmp_path)
    key = f"remote_store/h200-x2/{path.stem}"
    (tmp_path / records.RETIRED_FILE).write_text(json.dumps({"records": [
        {"id": path.stem, "path": f"data/records/{key}.parquet", "reason": "superseded",
         "commit": "0123abcd"}]}))
    path.unlink()
    assert list_records("remote_store", root=tmp_path) == []
    for ask in (lambda: resolve_record("remote_store", "h200-x2", path.stem, root=tmp_path),
                lambda: read_record(path),
                lambda: records.select_records([key], tmp_path / "view", tmp_path)):
        with pytest.raises(records.RetiredRecordError,
                           match=f"{key} left the tree \\(superseded\\).*git show 0123abcd:data/"):
            ask()


def test_select_records_makes_a_root_of_the_named_records_only(tmp_path, monkeypatch):
    source = tmp_path / "source"
    _freeze(monkeypatch, T1)
    older = write_record("remote_store", "h200-x2", _table(), {}, {}, source)
    _freeze(monkeypatch, T2)
    write_record("remote_store", "h200-x2", _table(1.0), {}, {}, source)
    (source / "errata.json").write_text("{}")
    root = records.select_records([f"remote_store/h200-x2/{older.stem}"], tmp_path / "view", source)
    assert latest_record("remote_store", "h200-x2", root).record_id == older.stem
    assert (root / "errata.json").read_text() == "{}"
    with pytest.raises(FileNotFoundError, match="no record remote_store/h200-x2/2099"):
        records.select_records(["remote_store/h200-x2/20990101T000000Z-0123456789"],
                               tmp_path / "other", source)


def test_lean_record_round_trip(tmp_path):
    """Issue 21: integers in their smallest type, floats with a resolution as float32 where that
    keeps a quarter of it, a column derivable from others left out; all read back as written."""
    period = np.array([2.5, 3.0, np.nan, 700.0])
    table = pd.DataFrame({
        "point": [0, 1, 2, 3], "order": [0, 200, 40_000, 3_000_000_000],
        "t_iss_us": [0.123456789, 2.0, np.nan, 127.6345544], "period_us": period,
        "gap_eff_us": period - [0.123456789, 2.0, np.nan, 127.6345544],
        "window_us": [1e3, 2e3, 3e3, 9e3],   # past float32's half-ns spacing: kept as float64
        "rate_GBps": [1 / 3, 2 / 3, 1.0, 4 / 3], "path": ["remote", "local", "remote", "local"],
        "warmup": [True, False, False, False]})
    resolution = {"t_iss_us": 5e-4, "period_us": 5e-4, "window_us": 1e-3}
    path = write_record("remote_store", "h200-x2", table, {}, {}, tmp_path, resolution=resolution)

    schema = pq.read_schema(path)
    assert [str(schema.field(c).type) for c in ("point", "order", "t_iss_us", "window_us")] == \
        ["int8", "int64", "float", "double"]
    assert "gap_eff_us" not in schema.names
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"
    back = read_record(path).table
    assert list(back.columns) == list(table.columns)
    assert (back.dtypes == table.dtypes).all()
    for column in ("point", "order", "window_us", "rate_GBps", "path", "warmup"):
        pd.testing.assert_series_equal(back[column], table[column])
    # a stored value moves by at most a quarter of its resolution, a derived one by half
    for column, error in (("t_iss_us", 1.25e-4), ("period_us", 1.25e-4), ("gap_eff_us", 2.5e-4)):
        assert np.allclose(back[column], table[column], rtol=0, atol=error, equal_nan=True)


def test_a_derivable_column_that_differs_from_its_derivation_is_kept(tmp_path):
    table = pd.DataFrame({"t_iss_us": [1.0, 2.0], "period_us": [3.0, 4.0],
                          "gap_eff_us": [2.0, 0.0]})
    path = write_record("remote_store", "h200-x2", table, {}, {}, tmp_path)
    assert "gap_eff_us" in pq.read_schema(path).names
    pd.testing.assert_frame_equal(read_record(path).table, table)


def test_records_from_before_the_lean_format_are_read_as_they_are():
    rec = latest_record("remote_patterns", "h200-x2")
    assert "stored" not in rec.meta
    assert pq.ParquetFile(rec.path).metadata.row_group(0).column(0).compression == "SNAPPY"
    assert rec.table["gap_eff_us"].dtype == np.float64 and rec.table["point"].dtype == np.int64


# Issue 21's budgets: what a full calibration run (its remote_store and calibration records) may
# add to the tree, and what the tracked data/records may hold.
CALIBRATION_RUN_BUDGET = 4_000_000
TREE_BUDGET = 40_000_000


def test_a_calibration_run_fits_its_budget_and_calibrates_the_same(tmp_path):
    """The latest committed characterization (every row and column of a full calibration run),
    written anew as a lean record, with the calibration fitted from it: at most 4 MB, and the
    same calibration as the committed one to four significant digits."""
    from tests.test_summary_snapshot import assert_close
    from xstage_lab.experiments.remote_store.characterization import BURST_RESOLUTION, write_calibration

    source = latest_record("remote_store", "h200-x2")
    path = write_record("remote_store", "h200-x2", source.table, source.params, source.provenance,
                        tmp_path, resolution=BURST_RESOLUTION)
    calibration = write_calibration(path, tmp_path)
    assert path.stat().st_size + calibration.stat().st_size <= CALIBRATION_RUN_BUDGET

    def quantities(rec):
        return {row.quantity: json.loads(row.value) for row in rec.table.itertuples()
                if row.quantity != "source_record"}
    committed = latest_record("calibration", "h200-x2")
    assert committed.params["source_record"] == source.record_id
    assert_close(quantities(read_record(calibration)), quantities(committed), "calibration")


def test_tracked_records_fit_their_budget():
    tracked = _git("ls-files", "data/records").stdout.split()
    assert sum((records.DATA_DIR.parent / p).stat().st_size for p in tracked) <= TREE_BUDGET


# Transcoding (issue 21): a record of the format before the lean one, rewritten once in the lean
# format, the original's bytes kept in a commit that retired.json's "transcoded" section names.

def _repo(tmp_path: Path) -> Path:
    """A git work tree at ``tmp_path`` whose records root is ``data/records``."""
    for args in (("init", "-q"), ("config", "user.email", "t@example.com"),
                 ("config", "user.name", "t"), ("config", "commit.gpgsign", "false")):
        subprocess.run(["git", *args], cwd=tmp_path, check=True)
    root = tmp_path / "data" / "records"
    root.mkdir(parents=True)
    return root


def _commit(root: Path, message: str = "records") -> str:
    top = root.parents[1]
    subprocess.run(["git", "add", "-A", "."], cwd=top, check=True)
    subprocess.run(["git", "commit", "-q", "-m", message], cwd=top, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=top, check=True, capture_output=True,
                          text=True).stdout.strip()


def _old_record(root: Path, table: pd.DataFrame, record_id: str = "20261129T120000Z-0123456789",
                experiment: str = "remote_store") -> Path:
    """A record as written before the lean format: pyarrow's defaults, no "stored" entry."""
    meta = {"record_id": record_id, "experiment": experiment, "platform": "h200-x2",
            "created_utc": "2026-11-29T12:00:00+00:00", "params": {"repeats": 3},
            "provenance": {"git_commit": "abc"}}
    arrow = pa.Table.from_pandas(table, preserve_index=False)
    arrow = arrow.replace_schema_metadata({**arrow.schema.metadata,
                                           b"xstage_lab": json.dumps(meta).encode()})
    path = root / experiment / "h200-x2" / f"{record_id}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(arrow, path)
    return path


def _fat_table(n: int = 2000) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    t_iss = rng.uniform(0.1, 120.0, n)
    period = t_iss + rng.uniform(0.0, 5.0, n)
    return pd.DataFrame({
        "point": np.arange(n) % 7, "order": np.arange(n), "t_iss_us": t_iss, "period_us": period,
        "gap_eff_us": period - t_iss, "rate_GBps": rng.uniform(1, 400, n),
        "path": np.where(np.arange(n) % 2, "remote", "local"), "warmup": np.arange(n) < 5,
        "entry_ns": [json.dumps((np.arange(i % 9) * 32 + i).tolist()) for i in range(n)]})


RESOLUTION = {"t_iss_us": 5e-4, "period_us": 5e-4}


def test_transcode_round_trip_keeps_id_header_and_measurements(tmp_path):
    root = _repo(tmp_path)
    table = _fat_table()
    path = _old_record(root, table)
    original = path.read_bytes()
    before = read_record(path)
    commit = _commit(root)
    when = datetime(2026, 12, 1, 17, tzinfo=timezone.utc)

    assert records.transcode("remote_store/h200-x2/" + path.stem, commit[:7], RESOLUTION, root,
                             date=when) == path
    rec = read_record(path)
    assert rec.meta == {**before.meta, "stored": rec.meta["stored"], "transcoded": {
        "from_format": records.OLD_FORMAT, "commit": commit, "date": when.isoformat()}}
    assert rec.meta["stored"]["derived"] == ["gap_eff_us"]
    assert rec.meta["stored"]["json_lists"] == ["entry_ns"]
    schema = pq.read_schema(path)
    assert str(schema.field("t_iss_us").type) == "float" and "gap_eff_us" not in schema.names
    assert str(schema.field("entry_ns").type) == "list<element: int64>"
    assert path.stat().st_size < len(original)
    # the same table: exact but for the narrowed columns, within a quarter of their resolution
    assert list(rec.table.columns) == list(table.columns)
    assert (rec.table.dtypes == table.dtypes).all()
    for column in ("point", "order", "rate_GBps", "path", "warmup", "entry_ns"):
        pd.testing.assert_series_equal(rec.table[column], table[column])
    for column, error in (("t_iss_us", 1.25e-4), ("period_us", 1.25e-4), ("gap_eff_us", 2.5e-4)):
        assert np.allclose(rec.table[column], table[column], rtol=0, atol=error)
    # still the record it was, for every loader
    assert latest_record("remote_store", "h200-x2", root).record_id == path.stem
    assert resolve_record("remote_store", "h200-x2", path.stem, root).path == path
    # the manifest entry, and the original bytes where it says
    key = f"remote_store/h200-x2/{path.stem}"
    entry = records.transcoded(root)[key]
    assert entry == {"id": path.stem, "path": f"data/records/{key}.parquet", "commit": commit,
                     "reason": f"transcoded to the lean format; the original bytes are at {commit}",
                     "date": when.isoformat()}
    shown = subprocess.run(["git", "show", f"{commit}:{entry['path']}"], cwd=tmp_path,
                           capture_output=True, check=True).stdout
    assert shown == original
    assert records.retired(root) == {}  # a transcoded record is not a retired one


def test_transcode_refuses_a_lean_record_and_a_second_transcoding(tmp_path):
    root = _repo(tmp_path)
    lean = write_record("remote_store", "h200-x2", _fat_table(50), {}, {}, root,
                        resolution=RESOLUTION)
    old = _old_record(root, _fat_table(50))
    _commit(root)
    before = lean.read_bytes()
    with pytest.raises(ValueError, match="lean format already"):
        records.transcode(lean, "HEAD", RESOLUTION, root)
    assert lean.read_bytes() == before and not (root / records.RETIRED_FILE).exists()
    records.transcode(old, "HEAD", RESOLUTION, root)
    _commit(root, "transcoded")
    after = old.read_bytes()
    with pytest.raises(ValueError, match=r"lean format already \(transcoded\)"):
        records.transcode(old, "HEAD~1", RESOLUTION, root)
    assert old.read_bytes() == after and len(records.transcoded(root)) == 1


def test_transcode_needs_a_commit_holding_the_original(tmp_path):
    root = _repo(tmp_path)
    path = _old_record(root, _fat_table(50))
    _commit(root)
    other = _old_record(root, _fat_table(60), "20261129T130000Z-0123456789")  # not committed
    for record in (other, path):
        if record == path:
            path.write_bytes(path.read_bytes())  # same bytes: the commit holds them
            record = other
        before = record.read_bytes()
        with pytest.raises(ValueError, match="does not hold"):
            records.transcode(record, "HEAD", RESOLUTION, root)
        assert record.read_bytes() == before
    with pytest.raises(ValueError, match="does not hold"):
        records.transcode(path, "0" * 40, RESOLUTION, root)
    assert records.transcoded(root) == {}


def test_transcode_restores_the_original_where_the_table_read_back_differs(tmp_path, monkeypatch):
    root = _repo(tmp_path)
    path = _old_record(root, _fat_table(50))
    _commit(root)
    original = path.read_bytes()
    unlean = records._unlean

    def off_by_a_cycle(table, stored):
        table = unlean(table, stored)
        return table.assign(t_iss_us=table["t_iss_us"] + 5e-4)
    monkeypatch.setattr(records, "_unlean", off_by_a_cycle)
    with pytest.raises(ValueError, match="t_iss_us moved by more than.*original is restored"):
        records.transcode(path, "HEAD", RESOLUTION, root)
    assert path.read_bytes() == original
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    assert records.transcoded(root) == {}


def test_append_only_allows_exactly_the_listed_transcodings(tmp_path):
    with pytest.raises(ValueError, match="not in a git work tree"):
        records.append_only_violations(tmp_path)
    root = _repo(tmp_path)
    kept = _old_record(root, _fat_table(50), "20261129T120000Z-0123456789")
    other = _old_record(root, _fat_table(60), "20261129T130000Z-0123456789")
    gone = _old_record(root, _fat_table(70), "20261129T140000Z-0123456789")
    _commit(root)
    assert records.append_only_violations(root) == []

    records.transcode(kept, "HEAD", RESOLUTION, root)
    assert records.append_only_violations(root) == []  # in the work tree
    _commit(root, "transcode")
    assert records.append_only_violations(root) == []  # and committed

    # a record rewritten without a manifest entry (even in the lean format)
    other.write_bytes(kept.read_bytes())
    assert records.append_only_violations(root) == [
        f"remote_store/h200-x2/{other.stem}: rewritten without a transcoded entry in retired.json"]
    _commit(root, "rewrite")
    assert len(records.append_only_violations(root)) == 1
    subprocess.run(["git", "reset", "-q", "--hard", "HEAD~1"], cwd=tmp_path, check=True)

    # a transcoded record rewritten again
    kept.write_bytes(kept.read_bytes() + b"\0")
    violations = records.append_only_violations(root)
    assert f"remote_store/h200-x2/{kept.stem}: rewritten 2 times (a transcoding happens once)" \
        in violations and all(kept.stem in v for v in violations)
    subprocess.run(["git", "checkout", "-q", "--", "."], cwd=tmp_path, check=True)

    # a record removed without a retired entry; a transcoded entry for a record never rewritten
    gone.unlink()
    manifest = json.loads((root / records.RETIRED_FILE).read_text())
    manifest["transcoded"].append({**manifest["transcoded"][0], "id": other.stem,
                                   "path": f"data/records/remote_store/h200-x2/{other.name}"})
    (root / records.RETIRED_FILE).write_text(json.dumps(manifest))
    assert sorted(records.append_only_violations(root)) == sorted([
        f"data/records/remote_store/h200-x2/{gone.name}: removed without a retired.json entry",
        f"remote_store/h200-x2/{other.stem}: listed transcoded, but its header or history "
        "disagrees"])

    # a removal undone (the record back with the bytes it had) keeps the rule; put back with
    # other bytes, both removals break it
    subprocess.run(["git", "checkout", "-q", "--", "."], cwd=tmp_path, check=True)
    original = gone.read_bytes()
    gone.unlink()
    _commit(root, "remove")
    gone.write_bytes(original)
    _commit(root, "restore")
    assert records.append_only_violations(root) == []
    gone.unlink()
    _commit(root, "remove again")
    gone.write_bytes(original + b"\0")
    _commit(root, "put back changed")
    removed = f"data/records/remote_store/h200-x2/{gone.name}: removed without a retired.json entry"
    assert records.append_only_violations(root) == [removed, removed]


@needs_history
def test_committed_records_keep_the_append_only_rule():
    """Issue 21: no committed record was ever changed but the transcodings retired.json lists;
    each of those reads back as its original (at the commit named) to the lean format's rules."""
    from xstage_lab.experiments import resolution as writer_resolution

    assert records.append_only_violations() == []
    listed = records.transcoded()
    assert listed, "no transcoded records"
    for key, entry in listed.items():
        assert entry["path"] == f"data/records/{key}.parquet" and entry["id"] == key.split("/")[2]
        assert entry["reason"] == records.TRANSCODED_REASON.format(commit=entry["commit"])
        rec = read_record(records.RECORDS_DIR / f"{key}.parquet")
        assert rec.meta["transcoded"]["commit"] == entry["commit"]
        original = pq.read_table(pa.BufferReader(_git_bytes(f"{entry['commit']}:{entry['path']}")))
        meta = json.loads(original.schema.metadata[b"xstage_lab"])
        assert {k: v for k, v in rec.meta.items() if k not in ("stored", "transcoded")} == meta
        assert records._transcoding_error(original.to_pandas(), rec.table, rec.meta["stored"],
                                          writer_resolution(meta["experiment"])) is None, key


def _git_bytes(spec: str) -> bytes:
    return subprocess.run(["git", "show", spec], cwd=records.DATA_DIR.parent, capture_output=True,
                          check=True).stdout


def test_synthetic_sources_alike_fitted_once_write_the_same_record(tmp_path):
    """``tests.synthetic`` fits the sources whose rows are alike once (the 8-GPU records of the
    ``eight_gpu_root`` fixture: 135 sources, 20 s of fits otherwise): on two GPUs without noise
    the records read back the same, parameters and tables, as those fitted source by source."""
    from tests.synthetic import write_synthetic_beyond_records

    once = write_synthetic_beyond_records(tmp_path / "once", noise=0.0)
    each = write_synthetic_beyond_records(tmp_path / "each", noise=0.0, fit_alike_once=False)
    for a, b in zip(once, each):
        a, b = read_record(a), read_record(b)
        assert a.params == b.params and a.table.equals(b.table)
