"""The per-tile analysis of the fused attention epilogue (``analysis/attention/trace.py``) on
hand-built ``fa_trace`` records."""
import json
from pathlib import Path

import numpy as np
import pytest

from xstage_lab import model
from xstage_lab.analysis.attention import trace as at
from xstage_lab.model import PlatformModel
from xstage_lab.records import Record

# M = 1024, b_m = 128, H/P = 2 local heads, P = 2: 8 m blocks per head, 16 tiles; 4 SMs x 2
# programs = 8 resident programs: tiles 0-7 are wave 0 (head 0), 8-15 wave 1 (head 1). Rank 0
# owns m blocks 0-3, so its remote tiles are m blocks 4-7 of each head.
M, BM, D, P, H = 1024, 128, 64, 2, 4
CFG = dict(BLOCK_M=BM, BLOCK_N=64, num_warps=4, num_stages=2, ctas_per_sm=2, persistent=False)
TILE_BYTES = BM * D * 2  # 16 KiB


def _row(build, launch, epilogue_ns, start_ns):
    n = len(epilogue_ns)
    return dict(M=M, heads=H, head_dim=D, P=P, rank=0, build=build, launch=launch,
                kernel_us=100.0, sm_clock_mhz=1980, entry_ns=json.dumps([0] * n),
                q_loop_ns=json.dumps([int(x) for x in start_ns]),
                epilogue_ns=json.dumps([int(x) for x in epilogue_ns]),
                smid=json.dumps([t % 4 for t in range(n)]))


def _record(rows) -> Record:
    import pandas as pd

    meta = dict(record_id="x", experiment="fa_trace", platform="test-x2",
                params=dict(config=CFG, params=dict(repeat_build=False)),
                provenance=dict(gpus=[dict(sm_count=4)]))
    return Record(path=Path("/nonexistent/fa_trace/test-x2/x.parquet"),
                  table=pd.DataFrame(rows), meta=meta)


def _epilogues(remote_first_wave_us, other_us=2.0):
    """Epilogue (ns) per tile: ``remote_first_wave_us`` on rank 0's remote tiles of wave 0."""
    out = np.full(16, other_us * 1e3)
    out[4:8] = remote_first_wave_us * 1e3
    return out.astype(int)


@pytest.fixture
def record():
    # control: every epilogue 2 µs; Fused: wave 0's remote tiles 2 µs + a tail (one tile 40 µs)
    starts = np.r_[np.full(8, 50_000), np.full(8, 150_000)].astype(int)  # Q-loops 50, 150 µs
    fused = _epilogues(2.0)
    fused[7] = 40_000
    rows = [_row("control", 0, _epilogues(2.0), starts), _row("fused", 0, fused, starts)]
    return _record(rows)


def test_tile_table_assigns_owner_and_wave(record):
    t = at.tile_table(record)
    fused = t[t["build"] == "fused"].set_index("tile")
    assert list(fused.index[fused["remote"]]) == [4, 5, 6, 7, 12, 13, 14, 15]
    assert list(fused["wave"]) == [0] * 8 + [1] * 8
    assert fused.loc[7, "epilogue_us"] == pytest.approx(40.0)
    assert fused.loc[12, "epilogue_start_us"] == pytest.approx(150.0)


def test_half_tile_traces_map_to_rows_and_waves_as_the_gluon_kernel_stamps_them(record):
    """gluon_ws (b_m = 128, one CTA per SM, two consumer warpgroups) traces 64-row half tiles:
    the 16 trace rows of ``record`` then cover 512 rows (rows 64·t of head 0 for t < 16), and
    4 SMs x 2 warpgroups = 8 resident trace rows make a wave."""
    rec = Record(record.path, record.table,
                 {**record.meta, "params": {"config": dict(CFG, BLOCK_M=128, ctas_per_sm=1,
                                                           kernel="gluon_ws"),
                                            "params": dict(repeat_build=False,
                                                           trace_block_m=64)}})
    assert at.trace_geometry(rec) == (64, 8)
    assert at.trace_geometry(record) == (BM, 8)  # a record without trace_block_m: Triton's
    t = at.tile_table(rec)
    fused = t[t["build"] == "fused"].set_index("tile")
    # M/64 = 16 half tiles per head: all 16 rows are head 0; rank 0 owns rows < 512 = t < 8
    assert list(fused.index[fused["remote"]]) == list(range(8, 16))
    assert list(fused["wave"]) == [0] * 8 + [1] * 8


def test_waves_without_remote_tiles_have_no_excess_row():
    # one program per SM (4 resident): wave 0 is m blocks 0-3 of head 0, all rank 0's own rows;
    # only the later waves (m blocks 4-7 of each head) send anything
    starts = np.full(16, 50_000).astype(int)
    rows = [_row(build, 0, _epilogues(2.0), starts) for build in ("control", "fused")]
    record = _record(rows)
    record.meta["params"]["config"] = dict(CFG, ctas_per_sm=1)
    excess = at.epilogue_excess(at.tile_table(record))
    assert excess[["wave_class", "rank", "remote_tiles"]].to_dict("records") == [
        dict(wave_class="later", rank=0, remote_tiles=8)]


def test_persistent_records_are_refused(record):
    rec = Record(record.path, record.table,
                 {**record.meta, "params": {**record.params,
                                            "config": dict(CFG, persistent=True)}})
    with pytest.raises(ValueError, match="one-program-per-tile"):
        at.tile_table(rec)


def test_excess_mean_carries_the_tail_the_median_hides(record):
    e = at.epilogue_excess(at.tile_table(record)).set_index("wave_class")
    # remote tiles of wave 0: fused 2, 2, 2, 40 against control 2, 2, 2, 2
    assert e.loc["first", "excess_median_us"] == pytest.approx(0.0)
    assert e.loc["first", "excess_us"] == pytest.approx(38.0 / 4)
    assert e.loc["first", "epilogue_fused_max_us"] == pytest.approx(40.0)
    assert e.loc["first", "local_excess_us"] == pytest.approx(0.0)
    assert e.loc["later", "excess_us"] == pytest.approx(0.0)


def _platform(capacity):
    return PlatformModel(drain_rate=10.0, t_iss0={}, capacity={4: capacity}, issue_floor={})


def test_design_verdicts_on_the_measured_wave(record):
    """Wave 0: 4 remote tiles of 16 KiB, aligned (spread 0), issue time 2 µs: V = 64 KiB,
    R·T = 10 GB/s x 2 µs = 20 000 B, q_peak = 65536 − 20000 = 45536 B (eq. 6). With Q = 30 000 B
    the capacity bound fails (reshape; eq. 7 stall (65536 − 30000)/10e3 − 2 = 1.5536 µs) and
    agrees with the measured 9.5 µs excess; with Q = 50 000 B it holds (piggyback) and does not."""
    t = at.tile_table(record)
    excess = at.epilogue_excess(t)
    tight = at.design_verdicts(t, excess, _platform(30_000), BM, 8).set_index("wave_class")
    assert tight.loc["first", "burst_volume"] == 4 * TILE_BYTES
    assert tight.loc["first", "sms"] == 4
    assert tight.loc["first", "peak_outstanding_bytes"] == pytest.approx(65536 - 20000)
    assert tight.loc["first", "action"] == "reshape"
    assert tight.loc["first", "isolated_stall_pred_us"] == pytest.approx(1.5536)
    assert tight.loc["first", "agrees"] == "yes"
    # wave 1 is the same aligned burst, but Fused stored it without excess
    assert tight.loc["later", "action"] == "reshape" and tight.loc["later", "agrees"] == "no"
    loose = at.design_verdicts(t, excess, _platform(50_000), BM, 8).set_index("wave_class")
    assert loose.loc["first", "action"] == "piggyback"
    assert loose.loc["first", "agrees"] == "no"


def test_arrival_peak_hand_worked():
    """Tiles of 10 000 B issued over 1 µs each into R = 10 GB/s (10 000 B/µs): two at once
    arrive at 20 000 B/µs for 1 µs, so 10 000 B are outstanding at the end (eq. 6, V − R·T);
    two a microsecond apart each arrive at the drain rate, so none are."""
    assert at.arrival_peak([0.0, 0.0], [1.0, 1.0], 10_000, 10.0) == pytest.approx(10_000)
    assert at.arrival_peak([0.0, 1.0], [1.0, 1.0], 10_000, 10.0) == pytest.approx(0.0)
    # three at once, a fourth 0.5 µs later: 30 000 B/µs for 0.5 µs (peak 10 000 B so far),
    # then 40 000 B/µs for 0.5 µs (+15 000 B), then the fourth alone at R
    assert at.arrival_peak([0.0, 0.0, 0.0, 0.5], [1.0] * 4, 10_000, 10.0) == pytest.approx(25_000)


def test_design_verdicts_read_the_issue_time_from_the_arrival_curve(record):
    """Wave 0's remote tiles (4 x 16 KiB, 2 µs each) with one starting 10 µs after the other
    three: the p5-p95 spread of the starts is 8.5 µs, but three tiles still arrive together, so
    the peak is 3·16384 − R·2 µs = 29 152 B (R = 10 GB/s), which the design test's issue time
    reproduces: T_iss = (V − q_peak)/R = (65536 − 29152)/10 000 B/µs = 3.6384 µs."""
    starts = np.r_[np.full(8, 50_000), np.full(8, 150_000)].astype(int)
    starts[7] += 10_000
    rec = _record([_row("control", 0, _epilogues(2.0), starts),
                   _row("fused", 0, _epilogues(2.0), starts)])
    t = at.tile_table(rec)
    v = at.design_verdicts(t, at.epilogue_excess(t), _platform(20_000), BM, 8).set_index(
        "wave_class")
    assert v.loc["first", "spread_us"] == pytest.approx(8.5)
    assert v.loc["first", "arrival_peak_bytes"] == pytest.approx(3 * TILE_BYTES - 20_000)
    assert v.loc["first", "issue_us"] == pytest.approx((4 * TILE_BYTES - 29_152) / 10_000)
    assert v.loc["first", "peak_outstanding_bytes"] == pytest.approx(29_152)
    assert v.loc["first", "action"] == "reshape"  # 29 152 B > Q = 20 000 B


def test_simulated_stalls_play_the_control_schedule(record):
    """Each aligned wave (4 x 16 KiB, 2 µs each, from an empty queue: wave 1 starts 100 µs
    after wave 0) through the fluid queue stalls as one burst of 64 KiB does (eq. 7,
    ``model.isolated_issue_time``): every tile by the same amount, since they share R."""
    sim = at.simulated_stalls(at.tile_table(record), _platform(30_000), BM, 8).set_index(
        "wave_class")
    want = float(model.isolated_issue_time(4 * TILE_BYTES, 2.0, 30_000, 10.0)) - 2.0
    assert sim.loc["first", "stall_pred_mean_us"] == pytest.approx(want, rel=1e-6)
    assert sim.loc["first", "excess_mean_us"] == pytest.approx(38.0 / 4)
    assert sim.loc["later", "stall_pred_mean_us"] == pytest.approx(want, rel=1e-6)


def test_first_wave_by_launch_order_names_what_each_trace_followed(record):
    other = at.first_wave_by_launch_order([record])
    assert list(other["traced_launch_follows"]) == ["the other build"]
    assert other.loc[0, "excess_us"] == pytest.approx(38.0 / 4)
    repeated = Record(record.path, record.table,
                      {**record.meta, "params": {**record.params,
                                                 "params": dict(repeat_build=True)}})
    assert list(at.first_wave_by_launch_order([repeated])["traced_launch_follows"]) == [
        "the same build"]


def test_bench_refuses_unstamped_or_disordered_traces():
    from xstage_lab.experiments.attention.trace_bench import POISON_STAMP, check_trace

    good = np.array([[10, 20, 30, 5], [11, 21, 22, 6]])
    assert check_trace(good, "fused") == []
    unstamped = good.copy()
    unstamped[1, 2] = POISON_STAMP
    assert check_trace(unstamped, "fused") == ["fused: 1 tiles not stamped"]
    disordered = good.copy()
    disordered[0, 1] = 40  # epilogue starts after it ends
    assert check_trace(disordered, "control") == ["control: stamps out of order"]


def test_latest_replayed_trace_skips_traces_after_the_other_build(tmp_path, record):
    from datetime import datetime, timezone

    from xstage_lab.records import write_record

    def write(repeat_build, day):
        return write_record("fa_trace", "test-x2", record.table,
                            {**record.params, "params": dict(repeat_build=repeat_build)}, {},
                            tmp_path, created=datetime(2026, 1, day, tzinfo=timezone.utc))

    with pytest.raises(FileNotFoundError, match="--repeat-build"):
        at.latest_replayed_trace("test-x2", tmp_path)
    replayed = write(True, 1)
    write(True, 2)
    write(False, 3)
    latest = at.latest_replayed_trace("test-x2", tmp_path)
    assert latest.params["params"]["repeat_build"] and latest.path != replayed
    assert latest.meta["created_utc"].startswith("2026-01-02")
