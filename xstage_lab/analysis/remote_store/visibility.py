"""What is read of a ``visibility`` record on the CPU (issue 8 part 2): the two GPUs' clock
alignment (θ before and after the sweep, its drift and uncertainty), the issue-to-visibility
latency per point, the first burst per gap and the comparison with the fenced sweep's
T_complete(K, V) = V/R + T_lat of the platform's calibration (``Visibility``, what ``load``
gives), and the summary's entry."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ... import model
from ...calibration import kb_key
from ...records import RECORDS_DIR, Record
from ...loading import latest as latest_record, record_paths as list_records
from ...sweep import median_spread

EXPERIMENT_NAME = "visibility"


def timer_resolution(steps) -> dict:
    """%globaltimer's update step from the increments one thread saw reading it back to back:
    the smallest is the resolution (a slow loop only adds multiples of it)."""
    steps = np.asarray(steps, dtype=np.int64)
    steps = steps[steps > 0]
    if steps.size == 0:
        raise ValueError("no %globaltimer increment observed")
    return {"resolution_ns": int(steps.min()), "median_step_ns": float(np.median(steps)),
            "steps": int(steps.size)}


def offset_at(t_ns, before: dict, after: dict) -> np.ndarray:
    """θ at sender time ``t_ns``: linear between the ping-pongs before and after the sweep."""
    t = np.asarray(t_ns, dtype=np.int64)
    span = after["t_ref_ns"] - before["t_ref_ns"]
    if span <= 0:
        raise ValueError("the second clock alignment must come after the first")
    frac = (t - before["t_ref_ns"]).astype(np.float64) / span
    return before["offset_ns"] + frac * (after["offset_ns"] - before["offset_ns"])


def alignment_summary(before: dict, after: dict, before_swapped: dict, after_swapped: dict,
                      resolution_src: dict, resolution_dst: dict) -> dict:
    """The record's clock-alignment header: both ping-pongs (sender-initiated give θ; the
    receiver-initiated ones, negated, are a check), the drift between them, the timers'
    resolution and the resulting bound on any cross-GPU time difference."""
    drift = after["offset_ns"] - before["offset_ns"]
    span_s = (after["t_ref_ns"] - before["t_ref_ns"]) / 1e9
    worst = max(before["uncertainty_ns"], after["uncertainty_ns"])
    return {"before": before, "after": after,
            "before_swapped": before_swapped, "after_swapped": after_swapped,
            # θ from the receiver-initiated ping-pong is t_src − t_dst: θ + θ_swapped ≈ 0
            "swap_check_ns": [before["offset_ns"] + before_swapped["offset_ns"],
                              after["offset_ns"] + after_swapped["offset_ns"]],
            "drift_ns": drift, "drift_ns_per_s": drift / span_s if span_s > 0 else float("nan"),
            "span_s": span_s,
            "resolution_src": resolution_src, "resolution_dst": resolution_dst,
            "uncertainty_ns": worst + max(resolution_src["resolution_ns"],
                                          resolution_dst["resolution_ns"])}


def add_latency(table: pd.DataFrame, alignment: dict) -> pd.DataFrame:
    """The latency columns (µs) from the raw stamps and the clock alignment:
    t_visible_src_ns = t_visible − θ(t_iss_end) (the receiver's stamp on the sender's clock);
    latency_us = from issue end, latency_from_start_us = from issue start,
    release_to_visible_us = from the sender's release returning, issue_us, release_us (issue
    end to the release's return: the sender's own view of completion)."""
    theta = offset_at(table["t_iss_end_ns"], alignment["before"], alignment["after"])
    visible = table["t_visible_ns"].to_numpy(np.int64) - np.rint(theta).astype(np.int64)
    start, end = table["t_iss_start_ns"].to_numpy(np.int64), table["t_iss_end_ns"].to_numpy(np.int64)
    release = table["t_release_ns"].to_numpy(np.int64)
    return table.assign(t_visible_src_ns=visible,
                        latency_us=(visible - end) / 1e3,
                        latency_from_start_us=(visible - start) / 1e3,
                        release_to_visible_us=(visible - release) / 1e3,
                        issue_us=(end - start) / 1e3,
                        release_us=(release - end) / 1e3)


LAUNCH_KEYS = ["producers", "burst_bytes", "gap_us", "repeat"]


def aggregate_bursts(table: pd.DataFrame) -> pd.DataFrame:
    """Per launch and burst: the aggregate burst of V = K·B bytes, from the first producer's issue
    start (``first_start_ns``) to the last producer's flag becoming visible (``last_visible_ns``,
    sender clock; ``aggregate_visible_us`` between them), and the mean
    per-producer latency from issue start (``visible_from_start_us``, what the fenced sweep's
    T_complete averages)."""
    g = table.groupby(LAUNCH_KEYS + ["burst"], sort=True)
    out = g.agg(first_start_ns=("t_iss_start_ns", "min"),
                last_visible_ns=("t_visible_src_ns", "max"),
                visible_from_start_us=("latency_from_start_us", "mean"),
                latency_us=("latency_us", "mean")).reset_index()
    out["aggregate_visible_us"] = (out["last_visible_ns"] - out["first_start_ns"]) / 1e3
    out["burst_volume"] = out["producers"] * out["burst_bytes"]
    return out


def latency_points(table: pd.DataFrame) -> pd.DataFrame:
    """Median per-producer latency (issue end → visible) over every burst and repeat of each
    (K, B, G), with its interquartile spread; and the same from issue start."""
    keys = ["producers", "burst_bytes", "gap_us"]
    out = median_spread(table, keys, "latency_us", "latency_from_start_us", "release_us")
    return out.drop(columns=[f"{v}_{s}" for v in ("latency_from_start_us", "release_us")
                             for s in ("p25", "p75", "n")])


def _against_t_complete(out: pd.DataFrame, drain_rate_GBps: float,
                        completion_latency_us: float) -> None:
    """Add T_complete(K, V) = V/R + T_lat (eq. 17) to each row of medians, and the measured
    per-producer (``diff_us``) and aggregate (``aggregate_diff_us``) differences to it."""
    volume = (out["producers"] * out["burst_bytes"]).to_numpy(float)
    out["T_complete_model_us"] = model.drain_time(volume, drain_rate_GBps) + completion_latency_us
    out["diff_us"] = out["visible_from_start_us"] - out["T_complete_model_us"]
    out["aggregate_diff_us"] = out["aggregate_visible_us"] - out["T_complete_model_us"]


def first_burst_points(table: pd.DataFrame, drain_rate_GBps: float,
                       completion_latency_us: float) -> pd.DataFrame:
    """The aligned first burst of every launch (X-Stage is empty when it starts) per (K, B, G),
    beside the fenced sweep's T_complete(K, V) = V/R + T_lat (eq. 17 with the calibrated R and
    T_lat). ``overlapped``: the fraction of launches whose next burst began issuing before this
    burst's last flag was visible; its stores then queue ahead of this burst's flag release and
    the flag shows two bursts' drain, not one. ``isolated``: no launch of that G overlapped (a
    per-gap verdict, so no single slow launch is dropped from an isolated gap)."""
    agg = aggregate_bursts(table)
    keys = ["producers", "burst_bytes", "gap_us"]
    first = agg[agg["burst"] == 0].set_index(LAUNCH_KEYS)
    nxt = agg[agg["burst"] == 1].set_index(LAUNCH_KEYS)["first_start_ns"].reindex(first.index)
    first = first.assign(overlapped=nxt < first["last_visible_ns"]).reset_index()
    out = first.groupby(keys, sort=True).agg(
        visible_from_start_us=("visible_from_start_us", "median"),
        aggregate_visible_us=("aggregate_visible_us", "median"),
        overlapped=("overlapped", "mean"),
        launches=("aggregate_visible_us", "size")).reset_index()
    _against_t_complete(out, drain_rate_GBps, completion_latency_us)
    out["isolated"] = out["overlapped"] == 0
    return out


def completion_comparison(table: pd.DataFrame, drain_rate_GBps: float,
                          completion_latency_us: float, fenced_us: dict | None = None
                          ) -> pd.DataFrame:
    """Receiver-seen completion of the first burst against T_complete(K, V) per (K, B), over the
    launches of the isolated gaps only (``first_burst_points``). ``diff_us`` = measured median
    per-producer issue-start-to-visible − T_complete; the aggregate (last flag) beside it.
    A (K, B) without an isolated gap has no row. ``fenced_us`` (the calibration's
    ``t_complete_us``, keyed by ``kb_key``) adds the fenced sweep's own measurement where it has
    the point, and the difference to it."""
    pts = first_burst_points(table, drain_rate_GBps, completion_latency_us)
    first = aggregate_bursts(table)
    first = first[first["burst"] == 0].merge(
        pts.loc[pts["isolated"], ["producers", "burst_bytes", "gap_us"]])
    g = first.groupby(["producers", "burst_bytes"], sort=True)
    out = g.agg(visible_from_start_us=("visible_from_start_us", "median"),
                aggregate_visible_us=("aggregate_visible_us", "median"),
                launches=("aggregate_visible_us", "size"),
                gap_min_us=("gap_us", "min")).reset_index()
    _against_t_complete(out, drain_rate_GBps, completion_latency_us)
    fenced = [(fenced_us or {}).get(kb_key(k, b), np.nan)
              for k, b in zip(out["producers"], out["burst_bytes"])]
    out["T_complete_fenced_us"] = np.asarray(fenced, dtype=float)
    out["fenced_diff_us"] = out["visible_from_start_us"] - out["T_complete_fenced_us"]
    return out


def calibration_completion(platform: str, root: Path) -> tuple[float, dict] | None:
    """The drain rate R and the completion fit of ``platform``'s latest calibration (None where it
    has none, or no fenced sweep)."""
    try:
        cal = latest_record("calibration", platform, root).params["calibration"]
    except FileNotFoundError:
        return None
    if not cal.get("completion"):
        return None
    return cal["drain_rate_GBps"], cal["completion"]


@dataclass(frozen=True)
class Visibility:
    """One platform's visibility record with its analysis: per-point latencies and, where the
    platform has a calibration with a fenced sweep, the first burst per gap and the comparison
    with T_complete over the isolated gaps."""

    record: Record
    points: pd.DataFrame
    first_burst: pd.DataFrame | None
    comparison: pd.DataFrame | None
    completion_latency_us: float | None

    @property
    def alignment(self) -> dict:
        return self.record.params["clock_alignment"]

    @classmethod
    def from_record(cls, rec: Record, root: Path = RECORDS_DIR) -> "Visibility":
        cal = calibration_completion(rec.platform, root)
        first, comparison, t_lat = None, None, None
        if cal is not None:
            rate, completion = cal
            t_lat = completion["completion_latency_us"]
            first = first_burst_points(rec.table, rate, t_lat)
            comparison = completion_comparison(rec.table, rate, t_lat,
                                               completion.get("t_complete_us"))
        return cls(rec, latency_points(rec.table), first, comparison, t_lat)


def summary_entry(platform: str, root: Path = RECORDS_DIR) -> dict:
    """``counterfactual.visibility`` of ``summary --json``: the clock alignment, the median
    issue-to-visibility latency per (K, B, G), and the comparison with T_complete; {} where the
    platform has no visibility record."""
    if not list_records(EXPERIMENT_NAME, platform, root):
        return {}
    vis = Visibility.from_record(latest_record(EXPERIMENT_NAME, platform, root), root)
    a = vis.alignment
    entry = {
        "source_record": vis.record.record_id,
        "clock_offset_ns": round(a["before"]["offset_ns"], 1),
        "clock_offset_uncertainty_ns": round(a["uncertainty_ns"], 1),
        "rtt_min_ns": a["before"]["rtt_min_ns"],
        "rtt_median_ns": round(a["before"]["rtt_median_ns"], 1),
        "drift_ns": round(a["drift_ns"], 1),
        "swap_check_ns": [round(x, 1) for x in a["swap_check_ns"]],
        "timer_resolution_ns": {"src": a["resolution_src"]["resolution_ns"],
                                "dst": a["resolution_dst"]["resolution_ns"]},
        "latency": [{"K": int(r.producers), "B": int(r.burst_bytes), "G": float(r.gap_us),
                     "latency_us": round(r.latency_us, 3),
                     "latency_iqr_us": [round(r.latency_us_p25, 3), round(r.latency_us_p75, 3)],
                     "latency_from_start_us": round(r.latency_from_start_us, 3),
                     "release_us": round(r.release_us, 3)}
                    for r in vis.points.itertuples()],
    }
    if vis.comparison is not None:
        entry["T_lat_us"] = round(vis.completion_latency_us, 3)
        entry["vs_T_complete"] = [
            {"K": int(r.producers), "B": int(r.burst_bytes),
             "visible_from_start_us": round(r.visible_from_start_us, 3),
             "aggregate_visible_us": round(r.aggregate_visible_us, 3),
             "T_complete_model_us": round(r.T_complete_model_us, 3),
             "diff_us": round(r.diff_us, 3), "gap_min_us": float(r.gap_min_us),
             "launches": int(r.launches)}
            for r in vis.comparison.itertuples()]
    return entry
