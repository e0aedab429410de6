"""Records: a measured table plus its provenance, stored append-only under ``data/records``.

A record is one Parquet file, ``data/records/<experiment>/<platform>/<record_id>.parquet``, whose
schema metadata carries a JSON header (experiment, platform, creation time, the parameters of the
run and the platform's provenance). The record id is the UTC creation time plus a digest of the
table, so a rerun adds a new file; writing never replaces an existing one. Corrections to a
record's header go into ``errata.json`` beside the experiments (``Record.git_commit`` reads it);
records it marks invalid are left out of every listing, and reading one raises
``InvalidRecordError``. A record that nothing reads any more may leave the tree only through
``retired.json`` beside the experiments (its id, path, reason and a commit that still holds it);
asking for a retired record raises ``RetiredRecordError``, naming that commit.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
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


def retired(root: Path = RECORDS_DIR) -> dict[str, dict]:
    """The entries of ``root``'s ``retired.json`` by key (``experiment/platform/record_id``)."""
    return {"/".join(Path(e["path"]).with_suffix("").parts[-3:]): e
            for e in _json_file(root / RETIRED_FILE).get("records", [])}


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
# - compressed with zstd at ZSTD_LEVEL.
# The header's "stored" entry (the narrowed columns' dtypes, the columns left out, the column
# order) lets read_record give back the table as written; records from before have none and are
# read as they are.
ZSTD_LEVEL = 9
# column -> (the columns it is derived from, how)
DERIVED = {"gap_eff_us": (("period_us", "t_iss_us"), np.subtract)}  # burst rows: period - T_iss


def _derive(table: pd.DataFrame, column: str) -> pd.Series:
    inputs, how = DERIVED[column]
    return how(*(table[c] for c in inputs))


def _lean(table: pd.DataFrame, resolution: dict[str, float]) -> tuple[pd.DataFrame, dict]:
    """``table`` as stored and its header's "stored" entry (see above)."""
    derived = [c for c, (inputs, _) in DERIVED.items() if {c, *inputs} <= set(table.columns)
               and np.array_equal(_derive(table, c).to_numpy(float), table[c].to_numpy(float),
                                  equal_nan=True)]
    narrow = {}
    for column in table.columns.drop(derived):
        values = table[column].to_numpy()
        if values.dtype.kind == "i" and len(values):
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
    return table.drop(columns=derived).astype(narrow), stored


def _unlean(table: pd.DataFrame, stored: dict) -> pd.DataFrame:
    """The table a lean record was written from: dtypes restored, derived columns again."""
    table = table.astype(stored["dtypes"])
    for column in stored["derived"]:
        table[column] = _derive(table, column)
    return table[stored["columns"]]


def _parquet(arrow: pa.Table, sink) -> None:
    split = [f.name for f in arrow.schema if f.type == pa.float32()]
    pq.write_table(arrow, sink, compression="zstd", compression_level=ZSTD_LEVEL,
                   use_byte_stream_split=split,
                   use_dictionary=[n for n in arrow.column_names if n not in split])


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
    arrow = pa.Table.from_pandas(lean, preserve_index=False)
    sink = io.BytesIO()
    _parquet(arrow, sink)
    digest = hashlib.sha256(sink.getvalue()).hexdigest()[:10]
    record_id = f"{created:%Y%m%dT%H%M%SZ}-{digest}"
    meta = {"record_id": record_id, "experiment": experiment, "platform": platform,
            "created_utc": created.isoformat(), "params": params, "provenance": provenance,
            "stored": stored}
    arrow = arrow.replace_schema_metadata(
        {**(arrow.schema.metadata or {}), _META_KEY: json.dumps(meta, default=str).encode()})
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
        _check_not_retired(path.parents[2], "/".join(path.with_suffix("").parts[-3:]))
    arrow = pq.read_table(path)
    meta_raw = (arrow.schema.metadata or {}).get(_META_KEY)
    if meta_raw is None:
        raise ValueError(f"{path} is not an xstage_lab record (no provenance header)")
    meta = json.loads(meta_raw)
    _check_valid(path, meta)
    table = arrow.to_pandas()
    return Record(path=path, table=_unlean(table, meta["stored"]) if "stored" in meta else table,
                  meta=meta)


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


def import_bench_json(path: Path | str, experiment: str, root: Path = RECORDS_DIR) -> Path:
    """Save a multi-process benchmark's JSON output (``rows`` plus a header holding
    ``provenance``, at top level or under ``metadata``) as a record of ``experiment``."""
    from .platform import platform_key

    doc = json.loads(Path(path).read_text())
    rows = doc.pop("rows")
    header = doc.pop("metadata", doc)
    provenance = header.pop("provenance")
    table = pd.DataFrame([{k: json.dumps(v) if isinstance(v, (dict, list)) else v
                           for k, v in row.items()} for row in rows])
    platform = platform_key(provenance["gpu_name"], provenance["gpu_count"])
    # Named by when the benchmark ran, not when it was imported: "latest" means latest measured.
    measured = provenance.get("date_utc")
    return write_record(experiment, platform, table, header, provenance, root,
                        created=datetime.fromisoformat(measured) if measured else None)
