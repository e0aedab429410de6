"""``summary --json``: the headline numbers of the committed records, keyed by platform.

Each experiment contributes one key per platform (schema in docs/summary_json.md); this module
gathers them from the latest record of each platform (for ``fa_a2a``, of each attention shape),
leaving out the records the errata mark invalid. ``summary`` without ``--json`` prints
``format_summary``'s tables.
"""
from __future__ import annotations

import json
from pathlib import Path

from tabulate import tabulate

from .analysis.moe import trace as moe_trace
from .analysis.attention.model import summary_counterfactual as attention_counterfactual
from .analysis.remote_store.visibility import summary_entry as visibility_entry
from .loading import load
from .loading import platforms, read as read_record, record_paths as list_records
from .records import RECORDS_DIR, Record


def _latest(experiment: str, platform: str, root: Path) -> Record:
    """The platform's latest record of ``experiment``, as the notebooks replay it."""
    return load(experiment, platform, backend="replay", root=root)[0]


def calibration_entry(platform: str, root: Path) -> dict:
    """The ``calibration`` entry: the latest calibration record's quantities."""
    rec = _latest("calibration", platform, root)
    return {row.quantity: json.loads(row.value) for row in rec.table.itertuples()}


def host_link_entry(platform: str, root: Path) -> dict:
    """The ``host_link`` entry of a host-link platform (``<gpu>-host``, issue 26): M_X^host from
    its latest calibration, R beside the copy engine's device-to-host rate of the same run, and
    the no-refit gap-sweep error (median |error| of T_iss, %). Empty for an NVLink platform."""
    cal = calibration_entry(platform, root)
    if cal.get("link") != "host":
        return {}
    probe = ("drain_under_load_ratio", "load_slowdown_full",  # where the record had the probes
             "gemm_slowdown_full")
    return {"t_iss0_us": cal["T_iss0_us"], "drain_rate_gbs": cal["R_GBps"],
            "copy_engine_gbs": cal["copy_engine_GBps"], "capacity_mib": cal["Q_MiB"],
            "knee_kib_per_producer": cal["knee_KB_per_producer"],
            "gap_error_median": cal["gap_prediction_median_abs_err_pct"],
            **{k: cal[k] for k in probe if k in cal}}


def moe_host_link_entry(platform: str, root: Path) -> dict:
    """The ``moe_host_link`` entry: the host-link MoE matrix, forecast beside measurement."""
    from .analysis.moe.host_view import summary_entry

    return summary_entry(platform, root)


def counterfactual_entry(platform: str, root: Path) -> dict:
    """The ``counterfactual`` entry: the fenced (completion-coupled) microbenchmark beside the
    decoupled one, from the latest calibration record (absent where its characterization had no
    fenced sweep)."""
    completion = _latest("calibration", platform, root).params["calibration"].get("completion")
    if completion is None:
        return {}
    return {"T_complete_us": completion["t_complete_us"],
            "T_lat_us": completion["completion_latency_us"],
            "completion_rate_GBps": completion["completion_rate_GBps"],
            "sum_law_err_pct": completion["sum_law_err_pct"],
            "max_law_err_pct": completion["max_law_err_pct"],
            "microbenchmark": completion["periods"],
            **({"visibility": vis} if (vis := visibility_entry(platform, root)) else {}),
            **({"moe": cc} if (cc := moe_trace.summary_counterfactual(platform, root)) else {}),
            **({"attention": a} if (a := attention_counterfactual(platform, root)) else {})}


FA_A2A_KEYS = ("M", "heads", "head_dim", "P", "fa_us", "a2a_nccl_us", "a2a_remote_us", "serial_us",
               "fused_us", "sdpa_nccl_us", "speedup", "hiding_ratio", "e_res_us", "fa_tflops",
               "cudnn_tflops")


def fa_a2a_entry(platform: str, root: Path) -> list[dict]:
    """The ``fa_a2a`` entry: one row per (M, heads, head_dim, P), from the latest record of each
    (heads, head_dim, P), so that a run at another head dim or P adds its rows and hides none."""
    latest = {}
    for path in list_records("fa_a2a", platform, root):  # oldest first: later records win
        table = read_record(path).table.astype({"M": int, "heads": int, "head_dim": int, "P": int})
        for shape, rows in table.groupby(["heads", "head_dim", "P"]):
            latest[shape] = rows
    return [{k: _plain(row[k]) for k in FA_A2A_KEYS}
            for shape in sorted(latest) for row in latest[shape].to_dict("records")]


def moe_entry(platform: str, root: Path) -> dict:
    """The ``moe`` entry: speedup of Interleaved over Expert-Wave across the configurations, and
    Table 2 (eq. 15 per model) where a ``moe_trace`` record exists."""
    return {**moe_trace.headline_numbers(_latest("moe", platform, root).table),
            **({"table2": t} if (t := moe_trace.summary_table2(platform, root)) else {})}


def _plain(value):
    return value.item() if hasattr(value, "item") else value


def patterns_entry(platform: str, root: Path) -> dict:
    """The ``patterns`` entry: injection patterns, from the latest record."""
    from .analysis.remote_store.patterns import summary_entry

    rec = _latest("remote_patterns", platform, root)
    return summary_entry(rec.params, rec.record_id)


def operations_entry(platform: str, root: Path) -> dict:
    """The ``operations`` entry: remote operations beyond 16-byte stores."""
    from .analysis.remote_store.operations import summary_entry

    rec = _latest("remote_ops", platform, root)
    return summary_entry(rec.params, rec.record_id)


def moe_kernel_entry(platform: str, root: Path) -> dict:
    """The ``moe_kernel`` entry: the fused kernel on one GPU against cuBLAS and torch's grouped
    GEMMs, and the one-token call."""
    from .analysis.moe.kernel_view import summary_entry

    return summary_entry(platform, root)


def moe_layer_entry(platform: str, root: Path) -> dict:
    """The ``moe_layer`` entry: the fused MoE layer per call, from the router's output to the
    layer's output, beside the unfused path and today's host-scheduled call."""
    from .analysis.moe.layer_view import summary_entry

    return summary_entry(_latest("moe_layer", platform, root).table)


def moe_forecast_entry(platform: str, root: Path) -> dict:
    """The ``moe_forecast`` entry: per model, precision and P, what the Burst–Gap model predicts
    for the Linear-2 Combine bursts from the kernel's one-GPU times."""
    from .analysis.moe.forecast import summary_entry

    return summary_entry(platform, root)


# summary key -> (the experiment whose records it reads, the function that makes it)
ENTRIES = {"calibration": ("calibration", calibration_entry),
           "counterfactual": ("calibration", counterfactual_entry),
           "host_link": ("calibration", host_link_entry),
           "moe_host_link": ("moe_host", moe_host_link_entry),
           "fa_a2a": ("fa_a2a", fa_a2a_entry),
           "moe": ("moe", moe_entry),
           "moe_kernel": ("moe_kernel", moe_kernel_entry),
           "moe_layer": ("moe_layer", moe_layer_entry),
           "moe_forecast": ("moe_forecast", moe_forecast_entry),
           "patterns": ("remote_patterns", patterns_entry),
           "operations": ("remote_ops", operations_entry)}


# Experiments whose records the entries above read (beside their sources).
READ_BY_ENTRIES = {"remote_store", "visibility", "moe_trace", "fa_trace"}


def registered_entries(root: Path) -> dict[str, dict[str, dict]]:
    """Per platform, the entry of every registered experiment that ``ENTRIES`` does not cover
    and that declares one (``Experiment.summary_entry`` of its view), keyed by its name: an
    experiment added to the registry appears here with no line of this module."""
    from .experiments import EXPERIMENTS, experiment

    covered = {source for source, _ in ENTRIES.values()} | READ_BY_ENTRIES
    out: dict[str, dict[str, dict]] = {}
    for name in EXPERIMENTS:
        if name in covered or not platforms(name, root):
            continue
        declared = experiment(name)
        for view in load(name, backend="replay", root=root):
            platform = declared.view_records(view)[0].platform
            if (value := declared.summary_entry(view)):
                out.setdefault(platform, {})[name] = value
    return out


def summary(root: Path = RECORDS_DIR) -> dict:
    out: dict[str, dict] = {}
    for key, (source, entry) in ENTRIES.items():
        for platform in platforms(source, root):
            value = entry(platform, root)
            if value:
                out.setdefault(platform, {})[key] = value
    for platform, entries in registered_entries(root).items():
        out.setdefault(platform, {}).update(entries)
    return {"platforms": out}


# Lists of rows (and dicts of records) up to this long get a table of their own.
SHORT_LIST = 12


def format_summary(s: dict) -> str:
    """``summary``'s text: per platform, a table of its quantities by dotted name (a dict of at
    most six numbers on one line), then a table of each short list of rows (each dict of records,
    one column per record); their plain fields only. Longer lists and deeper fields are counted,
    left to ``--json``."""
    parts = []
    for platform, entries in s["platforms"].items():
        rows, tables = [], []
        for key, value in entries.items():
            _flatten(key, value, 0, rows, tables)
        parts.append(f"== {platform} ==\n" + tabulate(rows, headers=("quantity", "value")))
        for name, headers, body in tables:
            parts.append(f"{platform}: {name}\n" + tabulate(body, headers=headers,
                                                              disable_numparse=True))
    return "\n\n".join(parts)


def _flatten(name: str, value, depth: int, rows: list, tables: list) -> None:
    """Append ``value``'s rows (quantity, text) to ``rows`` and its tables to ``tables``."""
    if isinstance(value, dict) and len(value) <= 6 and all(map(_is_plain, value.values())):
        rows.append((name, ", ".join(f"{k}: {_text(v)}" for k, v in value.items()) or "none"))
    elif isinstance(value, dict) and len(value) <= SHORT_LIST \
            and all(isinstance(v, dict) for v in value.values()):
        fields = [k for k in next(iter(value.values()))
                  if all(_is_plain(v.get(k)) for v in value.values())]
        rows.append((name, f"{len(value)} records, below"))
        tables.append((name, ["", *value], [[k, *(_text(v.get(k)) for v in value.values())]
                                            for k in fields]))
    elif isinstance(value, dict) and depth < 2:
        for k, v in value.items():
            _flatten(f"{name}.{k}", v, depth + 1, rows, tables)
    elif isinstance(value, dict):
        rows.append((name, f"{len(value)} fields (--json)"))
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        if len(value) > SHORT_LIST:
            rows.append((name, f"{len(value)} rows (--json)"))
            return
        columns = [k for k in value[0] if all(_is_plain(r.get(k)) for r in value)]
        rows.append((name, f"{len(value)} rows, below"))
        tables.append((name, columns, [[_text(r.get(k)) for k in columns] for r in value]))
    else:
        rows.append((name, _text(value)))


def _is_plain(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool)) or (
        isinstance(value, list) and all(isinstance(v, (int, float)) for v in value))


def _text(value) -> str:
    """A number to four significant digits, a list of numbers in brackets, None as a dash."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(map(_text, value)) + "]"
    return "–" if value is None else str(value)
