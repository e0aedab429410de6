"""Synthetic records: remote-store records made from known platform parameters, for the fit
tests; the committed records with different values (``write_synthetic_record_set``), for the
notebooks to run on in ``test_prose``."""
from __future__ import annotations

import contextlib
import functools
import re
import zlib

import numpy as np
import pandas as pd

from xstage_lab import model
from xstage_lab.experiments.remote_store.characterization import characterization_sweeps

KNOWN = dict(drain_rate=700.0, fixed_us=0.25, issue_rate_per_producer_GBps=45.0,
             capacity_per_producer=32 * 1024, loop_gap_us=1.2, sm_count=132)


def issue_floor(k: int, v):
    return model.IssueFloor(k, KNOWN["fixed_us"], KNOWN["issue_rate_per_producer_GBps"] * k)(v)


def capacity(k: int) -> float:
    return KNOWN["capacity_per_producer"] * k


def issue_time(p: dict, k: int, v: float, t0: float, g: float, R: float) -> float:
    """The Burst–Gap model's issue time of point ``p``'s bursts of volume ``v`` from ``k``
    producers: the floor ``t0`` on the local path; isolated, the capacity-limited time; periodic
    with period gap ``g``, the larger of the steady-state and the isolated time."""
    if p["path"] == "local":
        return t0
    isolated = float(model.isolated_issue_time(v, t0, capacity(k), R))
    if p["mode"] == "isolated":
        return isolated
    return float(max(model.issue_time(g, v, t0, R), isolated))


def synthetic_table(noise: float = 0.0, seed: int = 0) -> pd.DataFrame:
    """Per-burst rows shaped like ``RemoteStoreBench.measure``'s, from the Burst–Gap model."""
    rng = np.random.default_rng(seed)
    R, bar = KNOWN["drain_rate"], KNOWN["loop_gap_us"]
    rows = []
    for sw in characterization_sweeps(KNOWN["sm_count"], 2, repeats=3):
        for idx, p in enumerate(sw.points()):
            k, b = p["producers"], p["burst_bytes"]
            v = k * b
            t0 = float(issue_floor(k, v))
            g = p["gap_us"] + bar
            t = issue_time(p, k, v, t0, g, R)
            for rep in range(sw.repeats):
                jitter = 1 + noise * rng.standard_normal(4)
                rows.append(dict(p, sweep=sw.name, point=idx, repeat=rep, burst=5, warmup=False,
                                 producers_in_window=k, window_rate_GBps=min(R, v / (t + g) / 1e3),
                                 t_iss_us=t * jitter[0], period_us=(t + g) * jitter[1],
                                 gap_eff_us=g * jitter[1] + t * (jitter[1] - jitter[0]),
                                 start_skew_ns=50.0, sm_clock_mhz=1980.0, burst_volume=v))
    return pd.DataFrame(rows)


def synthetic_beyond_table(sweeps, drain_rate=None, noise: float = 0.0, seed: int = 0
                           ) -> pd.DataFrame:
    """Per-burst rows shaped like ``RemoteOpsBench.measure``'s for ``remote_ops.config_sweeps``:
    every source of a point's routes drains at ``drain_rate(point)`` (default KNOWN's) times its
    drain share, with KNOWN's issue floor, capacity and loop gap."""
    from xstage_lab.analysis.remote_store.routes import drain_share
    from xstage_lab.experiments.remote_store.ops import parse_routes

    rng = np.random.default_rng(seed)
    bar = KNOWN["loop_gap_us"]
    rows = []
    for sw in sweeps:
        for idx, p in enumerate(sw.points()):
            routes = parse_routes(p["routes"])
            share = drain_share(routes)
            k, b = p["producers"], p["burst_bytes"]
            v = k * b
            t0 = float(issue_floor(k, v))
            g = p["gap_us"] + bar
            for src, dsts in routes:
                R = (drain_rate(p) if drain_rate else KNOWN["drain_rate"]) * share[src]
                t = issue_time(p, k, v, t0, g, R)
                for rep in range(sw.repeats):
                    jitter = 1 + noise * rng.standard_normal(2)
                    rows.append(dict(p, sweep=sw.name, point=idx, repeat=rep, burst=5,
                                     warmup=False, producers_in_window=k, src=src,
                                     dst=dsts[0] if len(dsts) == 1 else -1, n_dst=len(dsts),
                                     window_rate_GBps=min(R, v / (t + g) / 1e3),
                                     t_iss_us=t * jitter[0], period_us=(t + g) * jitter[1],
                                     gap_eff_us=g * jitter[1] + t * (jitter[1] - jitter[0]),
                                     start_skew_ns=50.0, gpu_start_spread_ns=800.0,
                                     sm_clock_mhz=1980.0, burst_volume=v))
    return pd.DataFrame(rows)


# Columns that name where a configuration's rows come from: rows alike in everything else are
# one measurement to ``calibrate`` (``_calibrate_alike_once``).
_LABEL_COLUMNS = ["routes", "src", "dst", "n_dst"]


@contextlib.contextmanager
def _calibrate_alike_once():
    """``calibrate`` (as ``analysis.remote_store.operations`` calls it) fitting each table once:
    without noise, a route set's sources of one drain share, and the route sets alike, have the
    same rows but for their labels (``_LABEL_COLUMNS``), and so the same fit (an 8-GPU patterns
    record has 135 sources, a few shares). The fit of the first is returned for the others:
    a record written with it is the one written without (tests/test_records.py checks)."""
    from unittest import mock

    from xstage_lab.analysis.remote_store import operations

    fits, calibrate = {}, operations.calibrate

    def once(table, platform, record_id):
        rows = table.drop(columns=[c for c in _LABEL_COLUMNS if c in table]).reset_index(drop=True)
        key = (platform, record_id, tuple(rows.columns), rows.shape,
               pd.util.hash_pandas_object(rows, index=False).to_numpy().tobytes())
        if key not in fits:
            try:
                fits[key] = calibrate(table, platform, record_id)
            except (ValueError, np.linalg.LinAlgError) as e:
                fits[key] = e
        if isinstance(fits[key], Exception):
            raise fits[key]
        return fits[key]

    with mock.patch.object(operations, "calibrate", once):
        yield


def write_synthetic_beyond_records(root, n_gpus: int = 2, noise: float = 0.01,
                                   fit_alike_once: bool = True):
    """A ``remote_ops`` and a ``remote_patterns`` record under ``root`` from the model: 16-byte
    stores at KNOWN's rate, every other operation at its own rate (the reductions far slower),
    each all-to-one source at its drain share. Returns (ops path, patterns path).
    ``fit_alike_once``: sources with the same rows fitted once (``_calibrate_alike_once``)."""
    with _calibrate_alike_once() if fit_alike_once else contextlib.nullcontext():
        return _write_synthetic_beyond_records(root, n_gpus, noise)


def _write_synthetic_beyond_records(root, n_gpus: int, noise: float):
    from xstage_lab.experiments.remote_store.patterns import (pattern_instances, patterns_params,
                                                          route_sets)
    from xstage_lab.experiments.remote_store.ops import OPS, config_sweeps, operations_params, parse_routes
    from xstage_lab.analysis.remote_store.routes import drain_share
    from xstage_lab.experiments.remote_store.characterization import (BURST_RESOLUTION,
                                                                  BenchSettings)
    from xstage_lab.records import write_record

    rates = dict(zip(OPS, (700.0, 650.0, 400.0, 300.0, 690.0, 120.0, 110.0)))
    provenance = {"gpu_name": "NVIDIA H200", "gpu_count": n_gpus, "synthetic": True}
    facts = {"excluded": {}, "rates_GBps": {}, "clocks": {}, "sweeps": [], "elapsed_s": 0.0,
             "seed": 0, "settings": {}}
    sweeps = [sw for op in OPS for sw in config_sweeps({"op": op}, 132, dict(routes="0>1"),
                                                       rates[op], BenchSettings(), repeats=3)]
    ops = synthetic_beyond_table(sweeps, drain_rate=lambda p: rates[p["op"]], noise=noise)
    platform = f"h200-x{n_gpus}"
    ops_path = write_record("remote_ops", platform, ops,
                            operations_params(ops, facts, 0, 1, platform), provenance, root,
                            resolution=BURST_RESOLUTION)
    sweeps = [sw for r in route_sets(pattern_instances(n_gpus))
              for sw in config_sweeps({"routes": r}, 132, dict(op="store16"),
                                      KNOWN["drain_rate"] * min(drain_share(parse_routes(r)).values()),
                                      BenchSettings(), repeats=3)]
    patterns = synthetic_beyond_table(sweeps, noise=noise)
    return ops_path, write_record("remote_patterns", platform, patterns,
                                  patterns_params(patterns, facts, n_gpus, platform), provenance,
                                  root, resolution=BURST_RESOLUTION)


def write_eight_gpu_beside_committed(root) -> None:
    """A records root with the committed h200-x2 records (all of each experiment: the summary
    reads every ``fa_a2a`` record) and an h200-x8 platform beside them, made from the latest
    ones: the same measurements relabelled for eight GPUs (8 in the provenance, P = 8 in the
    attention record, world_size = 8 in the MoE records) and injection patterns and operations
    made from the model on eight GPUs."""
    import copy
    import shutil
    from datetime import datetime

    from xstage_lab.records import latest_record, list_records, write_record

    for experiment in ("calibration", "remote_store", "visibility", "fa_a2a", "moe", "moe_trace",
                       "remote_patterns", "remote_ops"):
        for path in list_records(experiment, "h200-x2"):
            copied = root / experiment / "h200-x2" / path.name
            copied.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copied)
        rec = latest_record(experiment, "h200-x2")
        if experiment in ("remote_patterns", "remote_ops"):
            continue
        table, params = rec.table.copy(), copy.deepcopy(rec.params)
        for column in ("P", "world_size"):
            if column in table:
                table[column] = 8
        if experiment == "fa_a2a":
            params["params"]["P"] = 8
        if "world_size" in params:
            params["world_size"] = 8
        write_record(experiment, "h200-x8", table, params, {**rec.provenance, "gpu_count": 8},
                     root, created=datetime.fromisoformat(rec.meta["created_utc"]))
    write_synthetic_beyond_records(root, n_gpus=8, noise=0.0)


# ------------------------------------------------- the committed records with different values

# Float columns that are settings of a run, not measurements: kept as they are (integer settings
# read as floats too where a record's other sweeps leave them empty: the host-link probes' rows
# have no burst).
SETTING_COLUMNS = {"gap_us", "gap_set_us", "d_factor", "lead_rows", "world_size", "hidden",
                   "burst", "burst_bytes", "burst_volume",
                   "intermediate", "top_k", "num_programs", "rank", "tiles_l1", "tiles_l2",
                   "programs", "bursts", "src", "dst", "n_dst", "dst_used", "recovery_rate_GBps",
                   "spin_errors_after_timing", "d_knee"}
# Columns that say what kind of row it is (a row's quantities change by the factor of their
# column and kind, ``perturb_table``): the host-link probes' store destination and load among
# them, whose rows' rates the probes' ratios divide.
ROW_KINDS = ("method", "build", "kernel", "variant", "kind", "schedule", "path", "stores", "load")
# A quantity's quantiles and spreads change by the quantity's factor; ratios (speedups,
# TF/s over cuDNN's) are raised to it, shares to its inverse.
_QUANTILE = re.compile(r"_(?:p\d+|iqr|median|mean|max|min|lo|hi)(?=_|$)")
_RATIO = re.compile(r"speedup|ratio|over_|_vs_")
_SHARE = re.compile(r"share|frac")
# Integer stamp lists (``fa_trace``) that are measurements.
STAMP_LISTS = {"entry_ns", "q_loop_ns", "epilogue_ns"}
# Integer columns that are measurements (NVML reads the SM clock in whole MHz).
MEASURED_INT_COLUMNS = {"route_sm_clock_mhz"}
# Subtrees of a record's parameters that hold measurements, per experiment.
MEASURED_PARAMS = {"calibration": ("calibration",), "visibility": ("clock_alignment",),
                   "fa_a2a": ("raw",), "fa_tuning": ("raw",), "remote_ops": ("fits",),
                   "remote_patterns": ("fits",), "moe_kernel": ("call_overhead",),
                   "remote_store": ("copy_engine_d2h",)}
# Parameter subtrees whose integers are measurements too (round trips, timer steps).
INT_PARAMS = {"clock_alignment"}
# Experiments whose latest record per platform is enough for the notebooks (large tables).
LATEST_ONLY = {"remote_store", "visibility", "remote_ops", "remote_patterns"}


@functools.cache  # asked again for every element of a JSON list
def factor(name: str) -> float:
    """The factor a measured quantity called ``name`` is multiplied by: 1.6 to 2.4, a different
    one for each name, so that ratios and differences of two quantities change too, and by enough
    that a value printed to one significant digit changes as well."""
    return 1.6 + 0.8 * (zlib.crc32(name.encode()) % 997) / 997


def perturb_json(value, key: str = "", ints: bool = False):
    """``value`` (parsed JSON) with every float multiplied by the factor of the path of keys it
    sits under (a list's items take the list's), and ints too where ``ints``."""
    if isinstance(value, dict):
        return {k: perturb_json(v, f"{key}/{k}", ints) for k, v in value.items()}
    if isinstance(value, list):  # the scalars inline: stamp lists hold millions of them
        f = factor(key)
        types = set(map(type, value))  # in one pass in C
        if ints and types <= {int}:  # round() as np.rint: half to even
            return np.rint(np.array(value, dtype=np.int64) * f).astype(np.int64).tolist()
        if not ints and not any(t is float or issubclass(t, (dict, list)) for t in types):
            return list(value)  # nothing in it changes (the list below, item by item)
        return [v * f if type(v) is float
                else int(round(v * f)) if type(v) is int and ints
                else perturb_json(v, key, ints) if isinstance(v, (dict, list)) else v
                for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, float):
        return value * factor(key)
    if isinstance(value, int) and ints:
        return int(round(value * factor(key)))
    return value


def _json_cells(s: pd.Series) -> np.ndarray:
    """The positions of the cells of a text column that start like JSON (``[`` or ``{``), found
    in bulk where the column is of pandas' string dtype (tables of 300k rows)."""
    if str(s.dtype) in ("str", "string"):
        return np.flatnonzero(s.str.startswith(("[", "{"), na=False).to_numpy(bool))
    return np.flatnonzero([isinstance(v, str) and v[:1] in "[{" for v in s])


def perturb_table(table: pd.DataFrame, experiment: str) -> pd.DataFrame:
    """A record's table with every measurement multiplied by its ``factor``: float columns other
    than ``SETTING_COLUMNS``, ``MEASURED_INT_COLUMNS`` (rounded), the floats inside JSON text
    cells, ``STAMP_LISTS``; for
    ``visibility`` the receiver's and release stamps, as intervals from the issue start."""
    import json

    out = table.copy()
    # a row's kind (its method, build, schedule, ...) and the record's experiment join the column
    # in naming a quantity, so that two methods' times, say, or the same column measured by two
    # experiments (a host-link cell's traced mainloop and the kernel record's), change by
    # different factors and their ratio changes too
    kinds = [c for c in ROW_KINDS if c in table.columns]
    kind = pd.Series("", index=table.index)
    for c in kinds:
        kind = kind + "|" + table[c].astype(object).where(table[c].notna(), "").astype(str)
    codes, kinds_found = pd.factorize(kind)  # once for every column (tables of 300k rows)
    for col in out.columns:
        s = out[col]
        if s.dtype == float and col not in SETTING_COLUMNS:
            base = _QUANTILE.sub("", col)  # a quantity's quartiles change with it
            f = pd.Series(np.array([factor(f"{base}{k}@{experiment}")
                                    for k in kinds_found])[codes],
                          index=kind.index)
            if _RATIO.search(col):  # stays on its side of 1 (and of 0)
                out[col] = np.sign(s) * np.abs(s) ** f
            elif _SHARE.search(col):  # stays in [0, 1]
                out[col] = s ** (1 / f)
            else:
                out[col] = s * f
        elif col in MEASURED_INT_COLUMNS and pd.api.types.is_integer_dtype(s):
            out[col] = np.rint(s.to_numpy(np.int64) * factor(f"{col}@{experiment}")
                               ).astype(np.int64)
        elif s.dtype == object or str(s.dtype) in ("str", "string"):
            def one(v, k, col=col):
                if not isinstance(v, str) or v[:1] not in "[{":
                    return v
                try:
                    parsed = json.loads(v)
                except ValueError:
                    return v
                return json.dumps(perturb_json(parsed, f"{col}{k}", ints=col in STAMP_LISTS))
            cells = _json_cells(s)
            if not len(cells) and str(s.dtype) in ("str", "string"):
                continue  # as it is (set from its own list, it read back the same, in 1.5 s)
            values = s.tolist()
            for i in cells:  # ``one`` leaves every other cell as it is
                values[i] = one(values[i], kind.iloc[i])
            out[col] = values
    if {"t_iss_us", "period_us", "gap_eff_us", "burst_bytes"} <= set(out.columns):
        # Burst–Gap tables: the issue time of each burst size changes by its own few percent
        # (as much as a gap sweep still reaches its recovered plateau with), and the period is
        # that issue time plus the effective gap, as measured. The isolated sweep and each row
        # pattern take their own few percent: a knee (where the isolated bursts' issue time
        # meets the drain rate of the other sweeps) and a pattern's rate over the contiguous
        # one's would read the same if all of them scaled alike.
        size = out["burst_bytes"].astype(str)
        if "pattern" in out.columns:
            size = out["pattern"].astype(str) + " " + size
        if "sweep" in out.columns:
            size = size.where(out["sweep"] != "isolated", "isolated " + size)
        scale = size.map({k: 1.04 + 0.1 * (zlib.crc32(f"t_iss {k}".encode()) % 997) / 997
                          for k in size.unique()})
        for col in ("t_iss_us", "t_iss_median_us", "t_iss_max_us", "t_iss_min_us"):
            if col in out:
                out[col] = table[col] * scale
        out["period_us"] = out["t_iss_us"] + table["gap_eff_us"]
        out["gap_eff_us"] = table["gap_eff_us"]
    if experiment == "visibility":
        start = out["t_iss_start_ns"].to_numpy(np.int64)
        for col in ("t_iss_end_ns", "t_release_ns", "t_visible_ns", "t_visible_src_ns"):
            if col in out:
                span = out[col].to_numpy(np.int64) - start
                out[col] = start + np.rint(span * factor(col)).astype(np.int64)
    return out


def write_synthetic_record_set(root, source=None, shift_days: int = 400) -> dict:
    """The records the notebooks read, from ``source`` (default: the committed records) with
    different values (``perturb_table``, ``MEASURED_PARAMS``), written under ``root`` with new
    record ids (created ``shift_days`` later, another digest), every id they name rewritten to the
    new ones. Records the errata mark invalid are left out. Returns {old id: new id}."""
    import hashlib
    import io
    import json
    from datetime import datetime, timedelta
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    from xstage_lab.records import (_META_KEY, RECORDS_DIR, list_records, platforms, read_record,
                                    retired)

    source = Path(source or RECORDS_DIR)
    root = Path(root)
    experiments = sorted(p.name for p in source.iterdir() if p.is_dir())
    chosen = []
    for experiment in experiments:
        for platform in platforms(experiment, source):
            paths = list_records(experiment, platform, source)
            chosen += paths[-1:] if experiment in LATEST_ONLY else paths
    new_ids = {}
    # the records' headers name records that left the tree too (a calibration its source)
    for record_id in [*(p.stem for e in experiments for p in (source / e).glob("*/*.parquet")),
                      *(e["id"] for e in retired(source).values())]:
        stamp, digest = record_id.split("-", 1)
        created = datetime.strptime(stamp, "%Y%m%dT%H%M%SZ") + timedelta(days=shift_days)
        new_ids[record_id] = (f"{created:%Y%m%dT%H%M%SZ}-"
                              f"{hashlib.sha256(digest.encode()).hexdigest()[:10]}")

    def renamed(obj):
        text = json.dumps(obj)
        for old, new in new_ids.items():
            text = text.replace(old, new)
        return json.loads(text)

    for path in chosen:
        rec = read_record(path)
        experiment = rec.meta["experiment"]
        params = dict(rec.params)
        for key in MEASURED_PARAMS.get(experiment, ()):
            if key in params:
                params[key] = perturb_json(params[key], key, ints=key in INT_PARAMS)
        created = datetime.fromisoformat(rec.meta["created_utc"]) + timedelta(days=shift_days)
        # written as records were before the lean format: no "stored" entry (the table is the
        # one read back), nothing transcoded
        header = {k: v for k, v in rec.meta.items() if k not in ("stored", "transcoded")}
        meta = renamed({**header, "record_id": rec.record_id, "params": params,
                        "created_utc": created.isoformat()})
        arrow = pa.Table.from_pandas(perturb_table(rec.table, experiment), preserve_index=False)
        arrow = arrow.replace_schema_metadata({**(arrow.schema.metadata or {}),
                                               _META_KEY: json.dumps(meta).encode()})
        out = root / experiment / rec.platform / f"{meta['record_id']}.parquet"
        out.parent.mkdir(parents=True, exist_ok=True)
        sink = io.BytesIO()
        pq.write_table(arrow, sink)
        out.write_bytes(sink.getvalue())
    return new_ids
