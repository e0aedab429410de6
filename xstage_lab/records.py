"""Records: a measured table plus its provenance, stored append-only under ``data/records``.

A record is one Parquet file, ``data/records/<experiment>/<platform>/<record_id>.parquet``, whose
schema metadata carries a JSON header (experiment, platform, creation time, the parameters of the
run and the platform's provenance). The record id is the UTC creation time plus a digest of the
table, so a rerun adds a new file; writing never replaces an existing one. Corrections to a
record's header go into ``errata.json`` beside the experiments (``Record.git_commit`` reads it);
records it marks invalid are left out of every listing, and reading one raises
``InvalidRecordError``. A record that nothing reads any more may leave the tree only through
``retired.json`` beside the experiments (its id, path, reason and a commit that still holds it);
asking for a retired record raises ``RetiredRecordError``, naming that commit. A record written
before the lean format (below) may be rewritten once, by ``transcode``, in that format: the same id,
header and measurements (to the resolution the lean format keeps), its header noting the
transcoding and ``retired.json``'s "transcoded" section naming the commit that holds the original
bytes; ``append_only_violations`` finds any other change to a committed record.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
# The records root every loader reads by default: the committed records, or the folder that the
# environment variable RECORDS_ENV names (read at import), e.g. a synthetic record set for the
# notebooks to run on.
RECORDS_ENV = "XSTAGE_LAB_RECORDS"
RECORDS_DIR = (Path(os.environ[RECORDS_ENV]).resolve() if os.environ.get(RECORDS_ENV)
               else DATA_DIR / "records")
_META_KEY = b"xstage_lab"
ERRATA_FILE = "errata.json"
RETIRED_FILE = "retired.json"


class RecordExistsError(FileExistsError):
    """Raised instead of overwriting a record: records are append-only."""


class InvalidRecordError(ValueError):
    """Raised on reading a record that the errata of its records root mark invalid."""


class RetiredRecordError(FileNotFoundError):
    """Raised on asking for a record that ``retired.json`` lists: it is in git history only."""


@dataclass(frozen=True)
class Record:
    """One record: ``table`` and the JSON-serialisable ``meta`` header."""

    path: Path
    table: pd.DataFrame
    meta: dict

    @property
    def record_id(self) -> str:
        return self.meta["record_id"]

    @property
    def platform(self) -> str:
        return self.meta["platform"]

    @property
    def params(self) -> dict:
        return self.meta["params"]

    @property
    def provenance(self) -> dict:
        return self.meta["provenance"]

    @property
    def git_commit(self) -> str:
        """The commit that produced the record: its provenance's, unless the errata of its
        records root correct it."""
        key = f"{self.meta['experiment']}/{self.platform}/{self.record_id}"
        corrected = _json_file(self.path.parents[2] / ERRATA_FILE).get("provenance.git_commit", {})
        return corrected.get(key, self.provenance.get("git_commit", "unknown"))


def _json_file(path: Path) -> dict:
    """The errata or retired file ``path`` ({} where there is none), reread when it changes."""
    try:
        stamp = path.stat().st_mtime_ns
    except FileNotFoundError:
        return {}
    return _read_json(path, stamp)


@lru_cache(maxsize=None)
def _read_json(path: Path, stamp: int) -> dict:
    return json.loads(path.read_text())


def _invalid(root: Path) -> set[str]:
    """Keys (``experiment/platform/record_id``) of the records that ``root``'s errata mark
    invalid."""
    return set(_json_file(root / ERRATA_FILE).get("invalid", {}).get("records", []))


def _check_valid(path: Path, meta: dict) -> None:
    """Raise ``InvalidRecordError`` where the errata of ``path``'s records root list it invalid."""
    parents = path.resolve().parents
    if len(parents) < 3:
        return
    errata_path = parents[2] / ERRATA_FILE
    key = f"{meta['experiment']}/{meta['platform']}/{meta['record_id']}"
    invalid = _json_file(errata_path).get("invalid", {})
    if key in invalid.get("records", []):
        raise InvalidRecordError(f"record {key} is listed under 'invalid' in {errata_path}: "
                                 f"{invalid.get('why', 'no reason given')}")


def _record_key(path: Path | str) -> str:
    """``experiment/platform/record_id`` of a record file's path."""
    return "/".join(Path(path).with_suffix("").parts[-3:])


def _manifest(root: Path, section: str) -> dict[str, dict]:
    """A section of ``root``'s ``retired.json`` by record key."""
    return {_record_key(e["path"]): e for e in _json_file(root / RETIRED_FILE).get(section, [])}


def retired(root: Path = RECORDS_DIR) -> dict[str, dict]:
    """The entries of ``root``'s ``retired.json`` by key (``experiment/platform/record_id``)."""
    return _manifest(root, "records")


def _check_not_retired(root: Path, key: str) -> None:
    """Raise ``RetiredRecordError`` where ``root``'s ``retired.json`` lists the record ``key``."""
    entry = retired(root).get(key)
    if entry:
        raise RetiredRecordError(
            f"record {key} left the tree ({entry['reason']}); it is in commit {entry['commit']}: "
            f"git show {entry['commit']}:{entry['path']} > {Path(entry['path']).name}")


# Lean records (issue 21). A new record's table is stored
# - with each integer column in the smallest integer type that holds its values;
# - with each float column the writer gives a resolution for (the finest step its values were
#   measured in, in the column's unit) as float32 where float32's spacing at the column's largest
#   magnitude is at most half that step, so that rounding moves no value by more than a quarter of
#   it; float32 columns are byte-stream-split, which lets zstd pack their exponents (the others
#   keep Parquet's dictionary encoding, smaller for the float64 ones' repeated values);
# - without the columns of DERIVED that equal their derivation from the other columns exactly;
# - with each text column whose every value is a JSON list of integers (import_bench_json's lists,
#   e.g. fa_trace's per-tile %globaltimer stamps) as a list<int64> column, where json.dumps gives
#   every value back exactly (int64 without a dictionary packs these lists best with zstd);
# - compressed with zstd at ZSTD_LEVEL.
# The header's "stored" entry (the narrowed columns' dtypes, the columns left out, the JSON list
# columns, the column order) lets read_record give back the table as written; records from before
# have none and are read as they are (or transcoded: ``transcode``).
ZSTD_LEVEL = 9
# column -> (the columns it is derived from, how)
DERIVED = {"gap_eff_us": (("period_us", "t_iss_us"), np.subtract)}  # burst rows: period - T_iss


def _derive(table: pd.DataFrame, column: str) -> pd.Series:
    inputs, how = DERIVED[column]
    return how(*(table[c] for c in inputs))


def _int_lists(values) -> list[list[int]] | None:
    """``values`` (text) parsed as JSON lists of int64 integers, or None unless every one is such
    a list that ``json.dumps`` writes back exactly."""
    if not len(values) or not all(isinstance(v, str) and v.startswith("[") for v in values):
        return None
    lists = []
    for text in values:
        try:
            parsed = json.loads(text)
        except ValueError:
            return None
        if (not all(type(x) is int and -2**63 <= x < 2**63 for x in parsed)
                or json.dumps(parsed) != text):
            return None
        lists.append(parsed)
    return lists


def _lean(table: pd.DataFrame, resolution: dict[str, float]) -> tuple[pd.DataFrame, dict]:
    """``table`` as stored and its header's "stored" entry (see above)."""
    derived = [c for c, (inputs, _) in DERIVED.items() if {c, *inputs} <= set(table.columns)
               and np.array_equal(_derive(table, c).to_numpy(float), table[c].to_numpy(float),
                                  equal_nan=True)]
    narrow, json_lists = {}, {}
    for column in table.columns.drop(derived):
        values = table[column].to_numpy()
        if values.dtype == object and (lists := _int_lists(values)) is not None:
            json_lists[column] = lists
        elif values.dtype.kind == "i" and len(values):
            narrow[column] = next(t for t in (np.int8, np.int16, np.int32, np.int64)
                                  if np.iinfo(t).min <= values.min()
                                  and values.max() <= np.iinfo(t).max)
        elif values.dtype == np.float64 and column in resolution:
            largest = np.float32(np.nanmax(np.abs(values), initial=0.0))
            if np.spacing(largest) <= resolution[column] / 2:
                narrow[column] = np.float32
    narrow = {c: t for c, t in narrow.items() if t != table[c].dtype}
    stored = {"dtypes": {c: str(table[c].dtype) for c in narrow}, "derived": derived,
              "columns": list(table.columns)}
    if json_lists:
        stored["json_lists"] = list(json_lists)
    lean = table.drop(columns=derived).astype(narrow)
    for column, lists in json_lists.items():
        lean[column] = pd.Series(lists, index=lean.index, dtype=object)
    return lean, stored


def _arrow(lean: pd.DataFrame, stored: dict) -> pa.Table:
    arrow = pa.Table.from_pandas(lean, preserve_index=False)
    for column in stored.get("json_lists", []):  # int64 whatever the values (empty lists too)
        i = arrow.schema.get_field_index(column)
        arrow = arrow.set_column(i, column, arrow.column(i).cast(pa.list_(pa.int64())))
    return arrow


def _unlean(table: pd.DataFrame, stored: dict) -> pd.DataFrame:
    """The table a lean record was written from: dtypes restored, derived columns again, JSON
    lists as text again."""
    table = table.astype(stored["dtypes"])
    for column in stored["derived"]:
        table[column] = _derive(table, column)
    for column in stored.get("json_lists", []):
        table[column] = [json.dumps(v.tolist()) for v in table[column]]
    return table[stored["columns"]]


def _parquet(arrow: pa.Table, sink) -> None:
    split = [f.name for f in arrow.schema if f.type == pa.float32()]
    lists = [f.name for f in arrow.schema if pa.types.is_list(f.type)]
    pq.write_table(arrow, sink, compression="zstd", compression_level=ZSTD_LEVEL,
                   use_byte_stream_split=split,
                   use_dictionary=[n for n in arrow.column_names if n not in split + lists])


def _with_header(arrow: pa.Table, meta: dict) -> pa.Table:
    return arrow.replace_schema_metadata(
        {**(arrow.schema.metadata or {}), _META_KEY: json.dumps(meta, default=str).encode()})


def write_record(experiment: str, platform: str, table: pd.DataFrame, params: dict,
                 provenance: dict, root: Path = RECORDS_DIR, created: datetime | None = None,
                 resolution: dict[str, float] | None = None) -> Path:
    """Write ``table`` as a new lean record (above) and return its path; never overwrites
    (append-only). ``created`` (default: now) names the record, so records sort by when they were
    measured; ``resolution`` maps float columns to the finest step their values were measured in
    (the others are kept as float64)."""
    if not experiment.isidentifier() or not platform.replace("-", "_").isidentifier():
        raise ValueError(f"experiment {experiment!r} and platform {platform!r} must be plain names")
    created = datetime.now(timezone.utc) if created is None else created.astimezone(timezone.utc)
    lean, stored = _lean(table, resolution or {})
    arrow = _arrow(lean, stored)
    sink = io.BytesIO()
    _parquet(arrow, sink)
    digest = hashlib.sha256(sink.getvalue()).hexdigest()[:10]
    record_id = f"{created:%Y%m%dT%H%M%SZ}-{digest}"
    meta = {"record_id": record_id, "experiment": experiment, "platform": platform,
            "created_utc": created.isoformat(), "params": params, "provenance": provenance,
            "stored": stored}
    arrow = _with_header(arrow, meta)
    path = root / experiment / platform / f"{record_id}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "xb") as f:
            _parquet(arrow, f)
    except FileExistsError as e:
        raise RecordExistsError(f"record {path} exists; records are never replaced") from e
    return path


def read_record(path: Path | str) -> Record:
    path = Path(path)
    if not path.exists() and len(path.parents) > 2:
        _check_not_retired(path.parents[2], _record_key(path))
    arrow = pq.read_table(path)
    meta_raw = (arrow.schema.metadata or {}).get(_META_KEY)
    if meta_raw is None:
        raise ValueError(f"{path} is not an xstage_lab record (no provenance header)")
    meta = json.loads(meta_raw)
    _check_valid(path, meta)
    table = arrow.to_pandas()
    return Record(path=path, table=_unlean(table, meta["stored"]) if "stored" in meta else table,
                  meta=meta)


# The format of the records written before the lean one: pyarrow's defaults (Snappy, dictionaries),
# every column as the writer gave it. ``transcode`` rewrites such a record in the lean format.
OLD_FORMAT = "parquet, pyarrow defaults (snappy, dictionary), every column as written"
TRANSCODED_REASON = "transcoded to the lean format; the original bytes are at {commit}"


def transcoded(root: Path = RECORDS_DIR) -> dict[str, dict]:
    """The entries of the "transcoded" section of ``root``'s ``retired.json`` by key
    (``experiment/platform/record_id``)."""
    return _manifest(root, "transcoded")


def _git(cwd: Path, *args: str, text: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=text)


def _record_path(record: str | Path, root: Path) -> Path:
    """The file of ``record``: a path, a key (``experiment/platform/record_id``) or an id."""
    candidate = Path(record)
    if candidate.suffix == ".parquet":
        return candidate
    if len(candidate.parts) == 3:
        return root / f"{record}.parquet"
    matches = sorted(root.glob(f"*/*/{record}.parquet"))
    if len(matches) != 1:
        raise FileNotFoundError(f"{len(matches)} records with id {record!r} under {root}")
    return matches[0]


def _transcoding_error(original: pd.DataFrame, back: pd.DataFrame, stored: dict,
                       resolution: dict[str, float]) -> str | None:
    """Why ``back`` (a transcoded record's table) is not ``original`` to the lean format's rules:
    a float column narrowed by its resolution within a quarter of it, a derived column within the
    sum of its inputs', every other column exactly; None where it is."""
    if list(back.columns) != list(original.columns) or not (back.dtypes == original.dtypes).all():
        return "columns or dtypes differ"
    if len(back) != len(original):
        return "row counts differ"
    quarter = {c: resolution[c] / 4 for c, t in stored["dtypes"].items()
               if t == "float64" and c in resolution}
    for column in stored["derived"]:
        quarter[column] = sum(quarter.get(c, 0.0) for c in DERIVED[column][0])
    for column in original.columns:
        a, b = original[column].to_numpy(), back[column].to_numpy()
        if column in quarter:
            nan = np.isnan(a)
            slack = quarter[column] * (1 + 1e-9) + 1e-15 * np.abs(a[~nan])
            if not np.array_equal(nan, np.isnan(b)) or np.any(np.abs(a[~nan] - b[~nan]) > slack):
                return f"{column} moved by more than {quarter[column]:g}"
        elif not original[column].equals(back[column]):
            return f"{column} differs"
    return None


def transcode(record: str | Path, commit: str, resolution: dict[str, float] | None = None,
              root: Path = RECORDS_DIR, date: datetime | None = None) -> Path:
    """Rewrite a record of the format before the lean one in the lean format, once, and return its
    path: the same id, header and measurements (``resolution`` as for ``write_record``: the
    writer's), the header noting ``transcoded`` (the format it had, ``commit``, ``date``), and an
    entry in the "transcoded" section of ``root``'s ``retired.json``. ``commit`` must hold the
    record's present bytes at its path (``git show <commit>:<path>`` gives the original back).
    Refuses a lean record; restores the original and raises where the table read back is not the
    original's to the lean format's rules."""
    root = Path(root).resolve()
    path = _record_path(record, root).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no record {record} under {root}")
    rec = read_record(path)
    key = f"{rec.meta['experiment']}/{rec.platform}/{rec.record_id}"
    if path != (root / f"{key}.parquet").resolve():
        raise ValueError(f"{path} is not the record {key} of the records root {root}")
    if "stored" in rec.meta:
        raise ValueError(f"record {key} is in the lean format already"
                         + (" (transcoded)" if "transcoded" in rec.meta else ""))
    original = path.read_bytes()
    top = _git(path.parent, "rev-parse", "--show-toplevel")
    if top.returncode:
        raise ValueError(f"{path} is not in a git work tree; the original bytes must stay in a "
                         "commit")
    rel = path.relative_to(Path(top.stdout.strip()).resolve()).as_posix()
    full = _git(path.parent, "rev-parse", "--verify", f"{commit}^{{commit}}")
    held = _git(path.parent, "cat-file", "blob", f"{commit}:{rel}", text=False)
    if full.returncode or held.returncode or held.stdout != original:
        raise ValueError(f"commit {commit} does not hold {rel} as it is now; transcoding needs a "
                         "commit that keeps the original bytes")
    commit = full.stdout.strip()

    resolution = resolution or {}
    lean, stored = _lean(rec.table, resolution)
    when = datetime.now(timezone.utc) if date is None else date.astimezone(timezone.utc)
    meta = {**rec.meta, "stored": stored,
            "transcoded": {"from_format": OLD_FORMAT, "commit": commit,
                           "date": when.isoformat()}}
    sink = io.BytesIO()
    _parquet(_with_header(_arrow(lean, stored), meta), sink)
    scratch = path.with_name(f".{path.name}.transcoding")
    try:
        scratch.write_bytes(sink.getvalue())
        os.replace(scratch, path)
        back = read_record(path)
        error = (_transcoding_error(rec.table, back.table, stored, resolution)
                 or (None if back.meta == json.loads(json.dumps(meta, default=str))
                     else "header differs"))
        if error:
            raise ValueError(f"transcoding {key} changed it ({error}); the original is restored")
    except BaseException:
        path.write_bytes(original)
        scratch.unlink(missing_ok=True)
        raise

    manifest_path = root / RETIRED_FILE
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest.setdefault("transcoded", []).append(
        {"id": rec.record_id, "path": rel, "reason": TRANSCODED_REASON.format(commit=commit),
         "commit": commit, "date": when.isoformat()})
    manifest_path.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    return path


def append_only_violations(root: Path = RECORDS_DIR) -> list[str]:
    """Every change to a record file under ``root`` in its git history and work tree that the
    append-only rule does not allow: a record may be added, removed where ``retired.json`` lists
    it retired or where it is back in the tree with the bytes it had (a removal undone), and
    rewritten once where its "transcoded" section lists it (into a lean record whose header
    names the same commit); nothing else. Empty where the rule holds."""
    root = Path(root).resolve()
    found = _git(root, "rev-parse", "--show-toplevel")
    if found.returncode:
        raise ValueError(f"{root} is not in a git work tree: no history to check")
    top = Path(found.stdout.strip()).resolve()
    prefix = root.relative_to(top).as_posix()
    # each commit's changes after a line "\0<commit>"; the work tree's under None
    changes, commit = [], None
    for line in _git(top, "log", "--format=%x00%H", "--name-status", "--no-renames", "HEAD",
                     "--", prefix).stdout.splitlines():
        if line.startswith("\0"):
            commit = line[1:]
        elif line:
            changes.append((commit, *line.split("\t")))
    work = _git(top, "diff", "--name-status", "--no-renames", "HEAD", "--", prefix)
    changes += [(None, *line.split("\t")) for line in work.stdout.splitlines() if line]
    gone, rewritten = retired(root), transcoded(root)
    violations, rewrites = [], {}
    for commit, status, path in changes:
        if not path.endswith(".parquet"):
            continue
        key = _record_key(path)
        if status == "D" and key not in gone and not _restored(top, commit, path):
            violations.append(f"{path}: removed without a retired.json entry")
        elif status == "M":
            rewrites[key] = rewrites.get(key, 0) + 1
        elif status not in "AD":
            violations.append(f"{path}: {status}")
    for key, n in rewrites.items():
        if key not in rewritten:
            violations.append(f"{key}: rewritten without a transcoded entry in retired.json")
        elif n > 1:
            violations.append(f"{key}: rewritten {n} times (a transcoding happens once)")
    for key, entry in rewritten.items():
        path = root / f"{key}.parquet"
        if not path.is_file():
            violations.append(f"{key}: listed transcoded, not in the tree")
            continue
        try:
            note = read_record(path).meta.get("transcoded", {})
        except (ValueError, OSError) as e:
            violations.append(f"{key}: listed transcoded, unreadable ({e})")
            continue
        if note.get("commit") != entry["commit"] or key not in rewrites:
            violations.append(f"{key}: listed transcoded, but its header or history disagrees")
        elif _git(top, "cat-file", "-e", f"{entry['commit']}:{entry['path']}").returncode:
            violations.append(f"{key}: commit {entry['commit']} does not hold {entry['path']}")
    return violations


def _restored(top: Path, commit: str | None, path: str) -> bool:
    """Whether the record at ``path`` that ``commit`` removed is in the work tree again with the
    bytes it had before (never for a removal in the work tree itself)."""
    before = _git(top, "rev-parse", "--verify", "-q", f"{commit}^:{path}") if commit else None
    now = _git(top, "hash-object", "--", path) if (top / path).is_file() else None
    return bool(before and now and not before.returncode and not now.returncode
                and before.stdout.strip() == now.stdout.strip())


def _all_records(experiment: str, platform: str | None, root: Path) -> list[Path]:
    pattern = f"{platform}/*.parquet" if platform else "*/*.parquet"
    return sorted((root / experiment).glob(pattern), key=lambda p: p.name)


def list_records(experiment: str, platform: str | None = None,
                 root: Path = RECORDS_DIR) -> list[Path]:
    """Paths of the records of ``experiment`` (on ``platform`` if given), oldest first, less those
    the errata of ``root`` mark invalid."""
    invalid = _invalid(root)
    return [p for p in _all_records(experiment, platform, root)
            if f"{experiment}/{p.parent.name}/{p.stem}" not in invalid]


def platforms(experiment: str, root: Path = RECORDS_DIR) -> list[str]:
    return sorted({p.parent.name for p in list_records(experiment, root=root)})


def latest_record(experiment: str, platform: str, root: Path = RECORDS_DIR) -> Record:
    paths = list_records(experiment, platform, root)
    if not paths:
        raise FileNotFoundError(f"no {experiment!r} record for platform {platform!r} under {root}")
    return read_record(paths[-1])


def resolve_record(experiment: str, platform: str, record: str | None,
                   root: Path = RECORDS_DIR) -> Record:
    """The record named ``record`` (an id or a path), or the platform's latest when None; one the
    errata mark invalid raises ``InvalidRecordError``."""
    if record is None:
        return latest_record(experiment, platform, root)
    candidate = Path(record)
    if candidate.suffix == ".parquet" and candidate.exists():
        return read_record(candidate)
    matches = [p for p in _all_records(experiment, platform, root) if p.stem == record]
    if not matches:
        _check_not_retired(root, f"{experiment}/{platform}/{record}")
        raise FileNotFoundError(f"no {experiment!r} record {record!r} for platform {platform!r}")
    return read_record(matches[0])


def select_records(keys, dest: Path, root: Path = RECORDS_DIR) -> Path:
    """A records root at ``dest`` holding only the records ``keys`` (``experiment/platform/
    record_id``) of ``root``, as links, beside ``root``'s errata: what a summary or a figure read
    once, to be read again whatever records came later."""
    dest = Path(dest)
    for key in keys:
        source = root / f"{key}.parquet"
        if not source.is_file():
            _check_not_retired(root, key)
            raise FileNotFoundError(f"no record {key} under {root}")
        link = dest / f"{key}.parquet"
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(source.resolve())
    if (root / ERRATA_FILE).is_file():
        (dest / ERRATA_FILE).symlink_to((root / ERRATA_FILE).resolve())
    return dest


def _json_scalar(value):
    """JSON for a numpy scalar or array inside a cell."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def save_output(metadata: dict, table: pd.DataFrame, experiment: str,
                root: Path = RECORDS_DIR, resolution: dict[str, float] | None = None) -> Path:
    """Save an experiment's output (``experiments.harness``: its rows and a header holding
    ``provenance``) as a record of ``experiment``: the header less its provenance becomes the
    record's parameters; dict and list cells are kept as JSON text."""
    from .platform import platform_key

    header = dict(metadata)
    provenance = header.pop("provenance")
    table = table.apply(lambda col: col.map(
        lambda v: json.dumps(v, default=_json_scalar) if isinstance(v, (dict, list)) else v)
        if col.dtype == object else col)
    platform = platform_key(provenance["gpu_name"], provenance["gpu_count"],
                            header.get("link", "nvlink"))
    # Named by when the experiment ran, not when it was saved: "latest" means latest measured.
    measured = provenance.get("date_utc")
    return write_record(experiment, platform, table, header, provenance, root,
                        created=datetime.fromisoformat(measured) if measured else None,
                        resolution=resolution)


def read_output(path: Path | str) -> dict:
    """A benchmark's output as ``experiments.output.write_output`` wrote it; ``ValueError`` (one
    sentence) where the file is not JSON or not of that shape."""
    try:
        doc = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not JSON ({e})") from None
    if not (isinstance(doc, dict) and isinstance(doc.get("metadata"), dict)
            and isinstance(doc.get("rows"), list)):
        raise ValueError(f'{path} is not a benchmark\'s output: it needs a "metadata" object and '
                         f'a "rows" list')
    provenance = doc["metadata"].get("provenance")
    missing = [k for k in ("gpu_name", "gpu_count")
               if not isinstance(provenance, dict) or k not in provenance]
    if missing:
        raise ValueError(f"{path}: its metadata's provenance lacks {missing}")
    return doc


def import_bench_json(path: Path | str, experiment: str, root: Path = RECORDS_DIR,
                      resolution: dict[str, float] | None = None) -> Path:
    """Save a benchmark's JSON output (``experiments.output.write_output``) as a record of
    ``experiment`` (``save_output``), or of the name its header gives where the run saved itself
    apart under ``experiment``'s name (``Experiment.record_name``: ``remote_store_partial`` of a
    ``remote_store`` run); ``ValueError`` where the file is not such an output."""
    doc = read_output(path)
    named = str(doc["metadata"].get("experiment", ""))
    if named.startswith(f"{experiment}_"):
        experiment = named
    return save_output(doc["metadata"], pd.DataFrame(doc["rows"]), experiment, root, resolution)
