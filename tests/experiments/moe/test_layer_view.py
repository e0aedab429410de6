"""The ``moe_layer`` view (``layer_view``): a platform's records joined per cell, each cell against
issue 27's acceptance, the ``summary`` entry; and ``summary`` without any ``moe_layer`` record."""
import json
from datetime import datetime, timezone

import pandas as pd
import pytest

from xstage_lab.analysis.moe import layer_view as lv
from xstage_lab.analysis.moe.layer_view import SUMMARY_KEYS, summary_entry
from xstage_lab.analysis.moe import VARIANT
from xstage_lab.records import write_record

PLATFORM = {VARIANT: lv.PLATFORM_VARIANT}  # a record's params: a run of the layer as it ships


def _row(tokens, setting="ep1", **over):
    row = dict(model="M", precision="bf16", setting=setting, tokens=tokens, fused_eager_us=100.0,
               fused_graph_us=90.0, schedule_us=10.0, host_overhead_us=20.0, kernel_us=80.0,
               weighted_sum_floor_us=5.0, unfused_eager_us=150.0, unfused_graph_us=120.0,
               host_scheduled_us=900.0, weight_floor_us=50.0, host_scheduled_kernel_us=80.0)
    return {**row, **over}


def test_summary_rows_keep_the_issue_fields_in_plain_values():
    row = {k: 1.5 for k in SUMMARY_KEYS}
    row.update(model="DeepSeek-V4-Flash", precision="fp8", setting="ep1", tokens=64, extra=3)
    table = pd.DataFrame([row, {**row, "setting": "ep8_rank"}])
    entry = summary_entry(table)
    assert [r["setting"] for r in entry["rows"]] == ["ep1", "ep8_rank"]
    assert set(entry["rows"][0]) == set(SUMMARY_KEYS)
    assert type(entry["rows"][0]["tokens"]) is int and type(entry["rows"][0]["kernel_us"]) is float


def test_a_platforms_records_join_per_cell_the_newest_winning(tmp_path):
    at = [datetime(2026, 12, 2, 3, m, tzinfo=timezone.utc) for m in range(2)]
    write_record("moe_layer", "x", pd.DataFrame([_row(1), _row(64)]), PLATFORM, {}, tmp_path,
                 created=at[0])
    write_record("moe_layer", "x", pd.DataFrame([_row(64, kernel_us=70.0), _row(64, "ep8_rank")]),
                 PLATFORM, {}, tmp_path, created=at[1])
    view = lv.layer_view("x", tmp_path)
    t = view.table
    assert len(view.records) == 2 and len(t) == 3
    assert list(t.loc[(t.setting == "ep1") & (t.tokens == 64), "kernel_us"]) == [70.0]
    with pytest.raises(FileNotFoundError):
        lv.layer_view("y", tmp_path)


def test_a_platforms_matrix_takes_only_records_of_its_variant(tmp_path):
    """A newer record naming options other than ``PLATFORM_VARIANT``'s (an A/B's side: held
    starts, tiles given, the sum in the kernel) holds no cell of the matrix; one naming its
    options holds every cell; one of the default's other options but a sum "auto" picks
    between (the launch, the adds), or naming none (records from before variants: the
    launch), holds the cells where "auto" picks that sum: the adds at EP = 1 up to
    ``AUTO_ATOMIC_TOKENS``."""
    few, many = lv.AUTO_ATOMIC_TOKENS, lv.AUTO_ATOMIC_TOKENS + 1
    cells = [(1, "ep1"), (few, "ep1"), (many, "ep1"), (1, "ep8_rank")]
    at = [datetime(2026, 12, 2, 3, m, tzinfo=timezone.utc) for m in range(7)]
    variants = [None, {"weighted_sum": "launch"}, {"weighted_sum": "atomic", "graph_start": "idle"},
                {"weighted_sum": "launch", "graph_start": "held"},
                {**lv.PLATFORM_VARIANT, "tile_rows": 256}, {"weighted_sum": "kernel"}]
    for i, (variant, when) in enumerate(zip(variants, at)):
        write_record("moe_layer", "x",
                     pd.DataFrame([_row(n, s, kernel_us=60.0 + i) for n, s in cells]),
                     {} if variant is None else {VARIANT: variant}, {}, tmp_path, created=when)
    view = lv.layer_view("x", tmp_path)
    assert len(view.records) == 3 and list(view.table["kernel_us"]) == [62.0, 62.0, 61.0, 61.0]
    write_record("moe_layer", "x", pd.DataFrame([_row(n, s, kernel_us=70.0) for n, s in cells]),
                 {VARIANT: lv.PLATFORM_VARIANT}, {}, tmp_path, created=at[6])
    assert list(lv.layer_view("x", tmp_path).table["kernel_us"]) == [70.0] * 4
    write_record("moe_layer", "y", pd.DataFrame([_row(many)]),
                 {VARIANT: {"weighted_sum": "atomic"}}, {}, tmp_path)
    with pytest.raises(FileNotFoundError, match="no 'moe_layer' record of"):
        lv.layer_view("y", tmp_path)


def test_the_views_auto_bound_is_the_ops():
    from xstage_lab.ops.moe import op

    assert lv.AUTO_ATOMIC_TOKENS == op.AUTO_ATOMIC_TOKENS


def test_the_platform_variant_is_what_the_op_and_the_bench_default_to():
    import argparse
    import inspect

    from xstage_lab.experiments.moe.layer_bench import EXPERIMENT
    from xstage_lab.ops.moe.op import FusedMoE

    op_default = inspect.signature(FusedMoE).parameters["weighted_sum"].default
    assert op_default == lv.PLATFORM_VARIANT["weighted_sum"]
    parser = argparse.ArgumentParser()
    EXPERIMENT.add_arguments(parser)
    args = parser.parse_args([])
    assert {"weighted_sum": args.weighted_sum, "graph_start": args.graph_start} == \
        lv.PLATFORM_VARIANT and args.tile_rows is None


def test_the_prose_names_the_records_the_cells_come_from(tmp_path):
    from xstage_lab.prose.moe.fused_layer import layer

    at = [datetime(2026, 12, 2, 3, m, tzinfo=timezone.utc) for m in range(3)]
    for rows, when in (([_row(1), _row(64)], at[0]), ([_row(64, kernel_us=70.0)], at[1]),
                       ([_row(1, kernel_us=60.0)], at[2])):
        write_record("moe_layer", "x", pd.DataFrame(rows), PLATFORM, {}, tmp_path, created=when)
    view = lv.layer_view("x", tmp_path)
    assert [r.record_id for r in view.sources] == [r.record_id for r in view.records[1:]]
    text = str(layer([view]))
    ids = [f"`{r.record_id}`" for r in view.records]
    assert "from 2 records, " + ", ".join(ids[1:]) + "; 1 earlier record holds only cells " \
           "measured again since)" in text and ids[0] not in text


def test_acceptance_applies_each_measure_where_the_issue_does():
    table = pd.DataFrame([
        # one token: 9% slower than unfused is allowed; the graphed call 96 > 1.5 * 50 + 10 = 85
        _row(1, fused_eager_us=109.0, unfused_eager_us=100.0, fused_graph_us=96.0),
        # 64 tokens: no slower at all; graphed 90 over kernel + floor 85: 1.0588 > 1.05
        _row(64, fused_eager_us=101.0, unfused_eager_us=100.0),
        # 8192 tokens: the schedule over 30 us; the host overhead over 30 us; the kernel 80 over
        # the host-scheduled kernel's 78: 1.0256 > 1.02
        _row(8192, schedule_us=31.0, host_overhead_us=31.0, fused_graph_us=89.0,
             host_scheduled_kernel_us=78.0),
    ])
    a = lv.acceptance(table)
    assert list(a["eager_speedup_ok"]) == [True, False, True]
    assert list(a["graph_over_kernel_ok"]) == [False, False, True]
    # the graphed call less 1.05 x (kernel 80 + floor 5)
    assert list(a["graph_over_kernel_excess_us"]) == pytest.approx([6.75, 0.75, -0.25])
    assert list(a["schedule_ok"]) == [True, True, False]
    assert list(a["host_overhead_ok"]) == [True, True, False]
    assert list(a["t1_ok"]) == [False, True, True]
    assert list(a["kernel_parity_ok"]) == [True, True, False]
    counts = lv.acceptance_counts(table)
    assert counts["schedule_ok"] == (0, 1) and counts["t1_ok"] == (0, 1)
    assert counts["kernel_parity_ok"] == (0, 1)
    assert counts["eager_speedup_ok"] == (2, 3)


def test_the_schedule_bound_holds_the_table_passes_where_a_record_profiled_them():
    """Profiled cells: the table passes against the bound, the activations' move apart (here
    the whole routing, 300 us, is over it, the tables' 25 us not); unprofiled ones: the whole."""
    profiled = pd.DataFrame([_row(8192, schedule_us=300.0, route_tables_us=25.0,
                                  route_gather_us=270.0),
                             _row(8192, schedule_us=300.0, route_tables_us=31.0,
                                  route_gather_us=260.0)])
    a = lv.acceptance(profiled)
    assert list(a["schedule_tables_us"]) == [25.0, 31.0]
    assert list(a["schedule_ok"]) == [True, False]
    assert list(lv.acceptance(pd.DataFrame([_row(8192, schedule_us=29.0)]))["schedule_ok"]) == \
        [True]
    mixed = pd.concat([profiled, pd.DataFrame([_row(8192, schedule_us=40.0)])],
                      ignore_index=True)
    assert list(lv.schedule_tables_us(mixed)) == [25.0, 31.0, 40.0]


def test_layer_prose_names_the_schedule_misses_with_their_clocks(tmp_path):
    """At the schedule's token count, the cells whose table passes exceed 30 µs, named with
    their time and, where the record read it, the SM clock as the routing's profile ended,
    beside every such cell's clocks; nothing named where every cell meets the bound."""
    from xstage_lab.prose.moe.fused_layer import layer

    rows = [_row(8192, model=m, route_tables_us=us, route_sm_clock_mhz=mhz, sm_clock_mhz=k)
            for m, us, mhz, k in (("M0", 25.0, 1500.0, 1800.0), ("M1", 38.0, 960.0, 1500.0))]
    write_record("moe_layer", "x", pd.DataFrame(rows), PLATFORM, {}, tmp_path)
    text = str(layer([lv.layer_view("x", tmp_path)]))
    assert ("of schedule kernels: 1 of 2 cells; above it M1 bf16 at EP = 1: 38 µs, its SM clock "
            "960 MHz as the routing's profile ended (the cells' routing profiles ended at "
            "960–1500 MHz, their fused kernels' timed trials ran at 1500–1800 MHz))") in text
    unclocked = [{k: v for k, v in r.items() if k != "route_sm_clock_mhz"} for r in rows]
    write_record("moe_layer", "y", pd.DataFrame(unclocked), PLATFORM, {}, tmp_path)
    text = str(layer([lv.layer_view("y", tmp_path)]))
    assert "1 of 2 cells; above it M1 bf16 at EP = 1: 38 µs)" in text
    write_record("moe_layer", "z", pd.DataFrame(rows[:1]), PLATFORM, {}, tmp_path)
    assert "above it" not in str(layer([lv.layer_view("z", tmp_path)]))


def test_layer_prose_names_the_host_misses_the_first_few_only(tmp_path):
    """The cells whose eager call's host time exceeds 30 µs, named with it and, where the record
    kept single calls, their median and slowest call; past three named, the rest counted."""
    from xstage_lab.prose.moe.fused_layer import layer

    rows = [_row(8192, model="M0", host_overhead_us=20.0, host_call_median_us=19.0,
                 host_call_max_us=25.0),
            _row(1, model="M1", host_overhead_us=69.0, host_call_median_us=68.0,
                 host_call_max_us=132.0)]
    write_record("moe_layer", "x", pd.DataFrame(rows), PLATFORM, {}, tmp_path)
    text = str(layer([lv.layer_view("x", tmp_path)]))
    assert ("(at most 30 asked: 1 of 2 cells; above it M1 bf16 at EP = 1 at 1 token: 69 µs, its "
            "median call 68 µs and its slowest 132 µs)") in text
    many = [_row(64, model=f"M{i}", host_overhead_us=40.0 + i) for i in range(5)]
    write_record("moe_layer", "y", pd.DataFrame(many), PLATFORM, {}, tmp_path)
    text = str(layer([lv.layer_view("y", tmp_path)]))
    assert ("0 of 5 cells; above it M0 bf16 at EP = 1 at 64 tokens: 40 µs; M1 bf16 at EP = 1 at "
            "64 tokens: 41 µs; M2 bf16 at EP = 1 at 64 tokens: 42 µs; and 2 more cells)") in text


def test_layer_prose_names_the_cells_where_the_fused_layer_is_slower(tmp_path):
    """A cell short of the speed asked (from 64 tokens: slower than the unfused path, eagerly or
    graphed; below: more than 10% slower) named with both ratios; the span from 64 tokens reads
    as the unfused path's time over the fused layer's, which holds below 1 too."""
    from xstage_lab.prose.moe.fused_layer import layer

    rows = [_row(8192, model="M0", unfused_eager_us=89.0, unfused_graph_us=99.0),
            _row(1, model="M1", unfused_eager_us=95.0, unfused_graph_us=81.0),
            _row(64, model="M2")]
    write_record("moe_layer", "x", pd.DataFrame(rows), PLATFORM, {}, tmp_path)
    text = str(layer([lv.layer_view("x", tmp_path)]))
    assert ("eagerly in 2 of 3 cells and graphed in 2 of 3; it is slower in M0 bf16 at EP = 1 "
            "at 8192 tokens: the unfused path takes 0.89× the fused layer's time eagerly and "
            "1.10× graphed; M1 bf16 at EP = 1 at 1 token: the unfused path takes 0.95× the fused "
            "layer's time eagerly and 0.90× graphed; from 64 tokens the graphed unfused path "
            "takes 1.10–1.33× the graphed fused layer's time.") in text
    write_record("moe_layer", "y", pd.DataFrame(rows[2:]), PLATFORM, {}, tmp_path)
    assert "slower in" not in str(layer([lv.layer_view("y", tmp_path)]))


def test_layer_prose_gives_the_kernels_weight_passes_from_4096_tokens(tmp_path):
    """At 4096 tokens and more, the kernel alone over the time its weights take to read once, and
    apart in the cells where the graphed fused layer is slower; no sentence below 4096."""
    from xstage_lab.prose.moe.fused_layer import layer

    rows = [_row(4096, model="M0", kernel_us=80.0, weight_floor_us=50.0),
            _row(8192, model="M1", kernel_us=90.0, weight_floor_us=40.0, unfused_graph_us=80.0),
            _row(64, model="M2", kernel_us=80.0, weight_floor_us=10.0)]
    write_record("moe_layer", "x", pd.DataFrame(rows), PLATFORM, {}, tmp_path)
    text = str(layer([lv.layer_view("x", tmp_path)]))
    assert ("At 4096 tokens and more the kernel alone takes 1.6–2.2× the time its experts' "
            "weights take to read once at the HBM bandwidth measured in the run, 2.2× in the 1 "
            "cell where the graphed fused layer is slower than the unfused path.") in text
    write_record("moe_layer", "y", pd.DataFrame(rows[2:]), PLATFORM, {}, tmp_path)
    assert "read once at the HBM" not in str(layer([lv.layer_view("y", tmp_path)]))


def test_layer_prose_says_which_cells_ran_256_row_tiles(tmp_path):
    """The cells whose record names 256-row tiles, counted and placed by setting and token
    count; none where every cell ran 128 or the record has no ``tile_rows`` (128 then)."""
    from xstage_lab.prose.moe.fused_layer import layer

    rows = [_row(4096, model="M0", tile_rows=256), _row(8192, model="M1", tile_rows=256),
            _row(512, model="M2", setting="ep8_rank", tile_rows=256),
            _row(64, model="M3", tile_rows=128)]
    write_record("moe_layer", "x", pd.DataFrame(rows), PLATFORM, {}, tmp_path)
    assert ("The kernel's tiles are 256 rows in 3 bf16 cells (at EP = 1 at 4096 and 8192 tokens "
            "and on the EP = 8 rank at 512 tokens), 128 in the others, as the layer's rule chose "
            "them when the record ran (by the routed rows an expert holds on average and the "
            "hidden size: `tiles.ws_tile_rows`).") in \
        str(layer([lv.layer_view("x", tmp_path)]))
    write_record("moe_layer", "y", pd.DataFrame(rows[3:]), PLATFORM, {}, tmp_path)
    write_record("moe_layer", "z", pd.DataFrame([_row(64, model="M4")]), PLATFORM, {}, tmp_path)
    for platform in ("y", "z"):
        assert "256 rows" not in str(layer([lv.layer_view(platform, tmp_path)]))


def test_summary_leaves_moe_layer_out_without_records(tmp_path):
    from xstage_lab.summary import ENTRIES, summary

    assert "moe_layer" in ENTRIES
    assert summary(tmp_path) == {"platforms": {}}


@pytest.mark.parametrize("era", ["graph_launch", "writer", "direct"])
def test_layer_prose_says_how_an_eager_call_launches(tmp_path, era):
    """Records whose eager calls launched their graph with the writer inside say so (two driver
    calls, the EP rank's graph of its receive buffers); records of the argument block's writer
    launched first (its writer in the per-kernel profile) that an eager call at EP = 1 replays
    one graph; older records that a call launches each kernel."""
    import json

    from xstage_lab.prose.moe.fused_layer import layer

    kernels = {name: 1.0 for name in ("route_histogram", "route_offsets", "route_scatter",
                                      "route_gather", "route_tiles")}
    if era != "direct":
        kernels[lv.ARGS_WRITER] = 0.5
    path = {"eager_path": "graph_launch"} if era == "graph_launch" else {}
    rows = [_row(t, s, host_launch_floor_us=7.0, route_kernels_us=json.dumps(kernels),
                 host_overhead_us=40.0 if s == "ep1" else 90.0, **path)
            for s in ("ep1", "ep8_rank") for t in (1, 8192)]
    write_record("moe_layer", "x", pd.DataFrame(rows), PLATFORM, {}, tmp_path)
    text = str(layer([lv.layer_view("x", tmp_path)]))
    # one token: the kernel 80 µs over the 50 µs floor, the profiled routing kernels summed
    assert (f"the kernel takes 1.6× the weight-read floor (80 µs against 50 µs), the routing "
            f"kernels {5.0 if era == 'direct' else 5.5:.0f} µs (profiled)") in text
    if era == "graph_launch":
        assert ("launches one CUDA graph of the writer of its argument block, its 5 routing "
                "kernels, the fused kernel and, at EP = 1, the weighted sum, in two driver "
                "calls: the writer's node given the call's addresses, then the graph's launch "
                "(EP = 1: 40 µs; the EP = 8 rank workload, the graph of its receive buffers: "
                "90 µs)") in text
        assert "one by one" not in text
    elif era == "writer":
        assert "replays one CUDA graph of its 5 routing kernels, the fused kernel and the " \
               "weighted sum (40 µs)" in text
        assert "launches the writer, the routing kernels and the fused kernel one by one " \
               "(90 µs)" in text
    else:
        assert "a call launches 5 routing kernels" in text and "CUDA graph" not in text


def test_layer_prose_reads_a_platform_of_one_token_cells_and_one_routing_kernel(tmp_path):
    """A platform measured at one token only (no cell from ``SMALL_T`` tokens), each call
    routed by one kernel that also writes the argument block: said so, in the singular."""
    import json

    from xstage_lab.prose.moe.fused_layer import layer

    rows = [_row(1, s, host_launch_floor_us=7.0, eager_path="graph_launch",
                 route_kernels_us=json.dumps({"route_histogram": 2.0}), host_check_us=2.0,
                 host_args_us=1.0, host_replay_us=6.0, host_set_addresses_us=1.5,
                 host_graph_launch_us=4.0) for s in ("ep1", "ep8_rank")]
    write_record("moe_layer", "x", pd.DataFrame(rows), PLATFORM, {}, tmp_path)
    text = str(layer([lv.layer_view("x", tmp_path)]))
    assert "graphed in 2 of 2 (no cell of 64 tokens or more). The graphed call" in text
    assert ("one CUDA graph of its routing kernel (which writes its argument block), the fused "
            "kernel and, at EP = 1, the weighted sum, in two driver calls: the routing kernel's "
            "node given the call's addresses") in text
    assert "of the launch, the routing kernel's node given the addresses takes 2 µs" in text


def test_layer_prose_gives_the_eager_calls_steps_where_a_record_timed_them(tmp_path):
    """The steps of an EP = 1 eager call from the cells that timed them; an older record's cells
    (no step columns) are left out of the count."""
    from xstage_lab.prose.moe.fused_layer import layer

    at = [datetime(2026, 12, 2, 3, m, tzinfo=timezone.utc) for m in range(2)]
    write_record("moe_layer", "x", pd.DataFrame([_row(1), _row(64)]), PLATFORM, {}, tmp_path,
                 created=at[0])
    steps = dict(host_check_us=4.0, host_args_us=15.0, host_replay_us=8.0)
    write_record("moe_layer", "x", pd.DataFrame([_row(64, **steps), _row(64, "ep8_rank")]),
                 PLATFORM, {}, tmp_path, created=at[1])
    text = str(layer([lv.layer_view("x", tmp_path)]))
    assert ("the inputs' check 4 µs, the argument block's write 15 µs, the graph's replay 8 µs "
            "(1 cell") in text
    # a later record's cells launched their graph with the writer inside: its steps' names
    write_record("moe_layer", "x", pd.DataFrame([_row(64, eager_path="graph_launch",
                                                      host_output_us=3.0,
                                                      host_capturing_us=1.0, **steps)]),
                 PLATFORM, {}, tmp_path, created=at[1].replace(minute=5))
    text = str(layer([lv.layer_view("x", tmp_path)]))
    assert ("the inputs' check 4 µs, the output's allocation 3 µs, the stream's capture state "
            "1 µs, the addresses gathered 15 µs, the graph launched with them 8 µs (1 cell") in text


def test_layer_prose_gives_a_runs_first_call_where_a_record_kept_single_calls(tmp_path):
    """The first call after the wait for the device and the median call, from the cells that
    kept single calls only; none said without them."""
    from xstage_lab.prose.moe.fused_layer import layer

    at = [datetime(2026, 12, 2, 3, m, tzinfo=timezone.utc) for m in range(2)]
    write_record("moe_layer", "x", pd.DataFrame([_row(1), _row(64)]), PLATFORM, {}, tmp_path,
                 created=at[0])
    assert "first call" not in str(layer([lv.layer_view("x", tmp_path)]))
    calls = [dict(host_first_call_us=f, host_call_median_us=m) for f, m in ((240.0, 12.0),
                                                                            (30.0, 9.0))]
    write_record("moe_layer", "x", pd.DataFrame([_row(64, **calls[0]),
                                                 _row(64, "ep8_rank", **calls[1])]), PLATFORM, {},
                 tmp_path, created=at[1])
    text = str(layer([lv.layer_view("x", tmp_path)]))
    assert ("in the 2 cells that keep single calls, a run's first call, the host back from "
            "waiting for the device, takes 30–240 µs and the median call 9–12 µs") in text


def test_kernel_phases_read_a_one_token_trace():
    """Two Linear-1 tiles on two SMs (programs 0 and 1, the second entering 0.3 µs later), then
    program 0's Linear-2 tile that waited for their rows."""
    tiles = pd.DataFrame({
        "program": [0, 1, 0], "kind": [0, 0, 1], "smid": [3, 7, 3],
        "mainloop_us": [10.0, 12.0, 4.0], "wait_us": [0.5, 0.1, 9.0], "t0_us": [0.0, 0.3, 11.0],
        "t1_us": [0.5, 0.4, 13.0], "t2_us": [10.5, 12.4, 17.0], "t3_us": [11.0, 13.0, 17.5]})
    p = lv.kernel_phases(tiles, l1_tile_bytes=2_200_000, l2_tile_bytes=1_000_000)
    assert (p["trace_l1_tiles"], p["trace_l1_sms"], p["trace_l2_tiles"], p["trace_l2_sms"]) == \
        (2, 2, 1, 1)
    assert p["trace_l1_mainloop_us"] == 11.0 and p["trace_l1_tile_gbps"] == pytest.approx(200.0)
    assert p["trace_l2_tile_gbps"] == pytest.approx(250.0)
    assert (p["trace_l1_end_us"], p["trace_l2_start_us"], p["trace_l2_wait_us"],
            p["trace_makespan_us"]) == (13.0, 13.0, 9.0, 17.5)
    assert p["trace_entry_us"] == 0.3 and p["trace_l1_wait_us"] == pytest.approx(0.3)
    assert p["trace_l1_epilogue_us"] == pytest.approx(0.55)  # 0.5 and 0.6
    assert p["trace_l2_tail_us"] == pytest.approx(0.5)


def test_kernel_parity_reads_the_paired_ratio_where_a_record_kept_it():
    """A cell whose medians differ by 4% across a clock step but whose per-trial ratio is 1.005
    meets the 2%; a record without the paired column falls back to the medians."""
    paired = _row(8192, kernel_us=81.0, host_scheduled_kernel_us=78.0,
                  kernel_over_host_kernel_paired=1.005)
    older = _row(4096, kernel_us=81.0, host_scheduled_kernel_us=78.0)
    a = lv.acceptance(pd.DataFrame([paired, {**older, "kernel_over_host_kernel_paired": None}]))
    assert list(a["kernel_over_host_kernel"]) == pytest.approx([1.005, 81 / 78])
    assert list(a["kernel_parity_ok"]) == [True, False]
    assert list(lv.acceptance(pd.DataFrame([older]))["kernel_parity_ok"]) == [False]


def test_layer_prose_names_a_parity_miss_with_its_trials_own_spread(tmp_path):
    """From 4096 tokens, the per-trial ratios' span over every cell and, for a cell above the 2%,
    its ratio and the least and greatest of its own trials' ratios; a record without the trials
    names the miss with its ratio alone."""
    from xstage_lab.prose.moe.fused_layer import layer

    def trials(kernel, host):
        return dict(kernel_trials_us=json.dumps(kernel),
                    host_scheduled_kernel_trials_us=json.dumps(host))
    rows = [_row(4096, model="M0", kernel_over_host_kernel_paired=1.0,
                 **trials([100.0, 99.0, 101.0], [100.0, 100.0, 100.0])),
            _row(8192, model="M1", kernel_over_host_kernel_paired=1.03,
                 **trials([103.0, 92.0, 105.0], [100.0, 100.0, 100.0])),
            _row(64, model="M2", kernel_over_host_kernel_paired=1.5,
                 **trials([150.0], [100.0]))]
    ratios = lv.kernel_trial_ratios(pd.DataFrame(rows))
    assert list(ratios["trials"]) == [3, 3, 1]
    assert list(ratios["trial_ratio_max"]) == pytest.approx([1.01, 1.05, 1.5])
    write_record("moe_layer", "x", pd.DataFrame(rows), PLATFORM, {}, tmp_path)
    text = str(layer([lv.layer_view("x", tmp_path)]))
    assert ("(the median of their per-trial ratios, which themselves span 0.920–1.050×, where a "
            "record kept the trials; within 2% in 1 of 2 cells; above it M1 bf16 at EP = 1 at "
            "8192 tokens: 1.030×, its 3 trials' own ratios 0.920–1.050×)") in text
    bare = [{k: v for k, v in r.items() if "trials" not in k} for r in rows]
    write_record("moe_layer", "y", pd.DataFrame(bare), PLATFORM, {}, tmp_path)
    text = str(layer([lv.layer_view("y", tmp_path)]))
    assert ("(the median of their per-trial ratios, where a record kept the trials; within 2% in "
            "1 of 2 cells; above it M1 bf16 at EP = 1 at 8192 tokens: 1.030×)") in text


def test_call_profile_reads_the_gaps_and_the_kernels_time_in_a_call():
    import json

    kernels = json.dumps({"route_tiny": 2.0, "moe_fused_ws_kernel": 82.0, "weighted_sum": 1.0})
    table = pd.DataFrame([_row(1, call_kernels_us=kernels, kernel_in_call_us=82.0,
                               kernel_alone_device_us=80.0), _row(8, call_kernels_us=None)])
    # as a record reads back: JSON in an arrow string column
    table["call_kernels_us"] = table["call_kernels_us"].astype("string[pyarrow]")
    p = lv.call_profile(table)
    assert list(p["tokens"]) == [1]  # the cell its record profiled
    assert p["call_gaps_us"].tolist() == [90.0 - 85.0]
    assert p["kernel_in_call_over_alone"].tolist() == [82.0 / 80.0]
    assert lv.call_profile(pd.DataFrame([_row(1)])).empty  # a record from before the profile


def test_layer_prose_reads_the_call_profile_where_a_record_kept_it(tmp_path):
    """The fused kernel's time in a call over alone and the call's time beyond its kernels, at
    one token, from the cells whose record profiled a call; none said without them."""
    import json

    from xstage_lab.prose.moe.fused_layer import layer

    route = json.dumps({"route_tiny": 2.0})
    rows = [_row(1, route_kernels_us=route), _row(1, "ep8_rank", route_kernels_us=route),
            _row(64, route_kernels_us=route)]
    write_record("moe_layer", "x", pd.DataFrame(rows), PLATFORM, {}, tmp_path)
    assert "Profiled in a whole call" not in str(layer([lv.layer_view("x", tmp_path)]))
    call = dict(call_kernels_us=json.dumps({"route_tiny": 2.0, "moe_fused_ws_kernel": 84.0,
                                            "weighted_sum": 2.0}),
                kernel_in_call_us=84.0, kernel_alone_device_us=80.0)
    rows = [_row(1, route_kernels_us=route, **call),
            _row(1, "ep8_rank", route_kernels_us=route,
                 **{**call, "kernel_in_call_us": 80.0,
                    "call_kernels_us": json.dumps({"route_tiny": 2.0,
                                                   "moe_fused_ws_kernel": 80.0})}),
            _row(64, route_kernels_us=route)]
    write_record("moe_layer", "y", pd.DataFrame(rows), PLATFORM, {}, tmp_path)
    text = str(layer([lv.layer_view("y", tmp_path)]))
    # graphed 90 µs less 88 (EP = 1) and 82 µs (rank) of kernels; 84 and 80 over 80
    assert ("Profiled in a whole call (2 cells), the fused kernel takes 1.00–1.05× its device "
            "time alone, the weighted sum's kernel 2.0 µs at EP = 1, and the graphed call's "
            "time less its kernels' device times (the launches and the boundaries between "
            "them) is 2–8 µs.") in text


def test_a_one_token_calls_weighted_sum_is_its_kernel_in_the_call_not_graphed_alone(tmp_path):
    """Where a one-token call's time goes: the routing kernels as profiled, then the weighted
    sum's kernel in the profiled call; the sum graphed alone (``weighted_sum_us``, for a kernel
    of a few µs a multiple of its device time) is not quoted as the call's."""
    import json

    from xstage_lab.prose.moe.fused_layer import layer

    route = json.dumps({"route_tiny": 2.0})
    call = dict(call_kernels_us=json.dumps({"route_tiny": 2.0, "moe_fused_ws_kernel": 84.0,
                                            "weighted_sum": 2.0}),
                kernel_in_call_us=84.0, kernel_alone_device_us=80.0)
    rows = [_row(1, route_kernels_us=route, weighted_sum_us=13.0, **call), _row(64)]
    write_record("moe_layer", "x", pd.DataFrame(rows), PLATFORM, {}, tmp_path)
    text = str(layer([lv.layer_view("x", tmp_path)]))
    assert ("the routing kernels 2 µs (profiled). Profiled in a whole call (1 cell), the fused "
            "kernel takes 1.05× its device time alone, the weighted sum's kernel 2.0 µs at "
            "EP = 1,") in text
    assert "13 µs" not in text


def test_layer_prose_says_by_how_much_the_misses_exceed_the_bound(tmp_path):
    """The cells whose graphed call exceeds 1.05 x (kernel + weighted-sum floor): by how many µs,
    and their routing kernels' profiled time; nothing said where every cell meets it."""
    import json

    from xstage_lab.prose.moe.fused_layer import layer

    rows = [_row(64, fused_graph_us=g, route_kernels_us=json.dumps({"route_tiny": r}))
            for g, r in ((96.0, 3.0), (90.0, 2.0), (89.0, 1.0))]
    for i, row in enumerate(rows):
        row["model"] = f"M{i}"
    write_record("moe_layer", "x", pd.DataFrame(rows), PLATFORM, {}, tmp_path)
    text = str(layer([lv.layer_view("x", tmp_path)]))
    assert ("in 1 of 3 cells (1.05–1.13×; in 3 cells, from records made before that fill was "
            "profiled, with it), the other 2 above that bound by 0.8–6.8 µs, where their routing "
            "kernels take 2.0–3.0 µs (profiled);") in text
    write_record("moe_layer", "y", pd.DataFrame(rows[2:]), PLATFORM, {}, tmp_path)
    assert "above that bound" not in str(layer([lv.layer_view("y", tmp_path)]))


def test_layer_prose_says_where_a_one_token_miss_spends_its_time(tmp_path):
    """The one-token cells above 1.5x the weight-read floor + 10 µs, named, with their traced
    phases: the Linear-1 tiles and SMs and each phase's weight rate over the HBM bandwidth."""
    from xstage_lab.prose.moe.fused_layer import layer

    trace = dict(trace_l1_tiles=44, trace_l1_sms=44, trace_l1_tile_gbps=50.0,
                 trace_l1_mainloop_us=10.0, trace_l1_end_us=20.0, trace_l2_tiles=66,
                 trace_l2_sms=66, trace_l2_tile_gbps=40.0, trace_l2_mainloop_us=10.0,
                 trace_l2_start_us=20.0, trace_l2_wait_us=5.0, trace_makespan_us=40.0,
                 hbm_gbps=4400.0)
    # 90 µs graphed: over 1.5 x 50 + 10, within 1.5 x 60 + 10
    rows = [_row(1, **trace), _row(1, "ep8_rank", weight_floor_us=60.0, **trace), _row(64)]
    write_record("moe_layer", "x", pd.DataFrame(rows), PLATFORM, {}, tmp_path)
    text = str(layer([lv.layer_view("x", tmp_path)]))
    # Linear-1: 44 tiles x 50 GB/s x 10 µs over 20 µs; Linear-2: 66 x 40 x 10 over 40 - 20
    assert ("The 1 one-token cell above the bound (M bf16 ep1) takes 1.6× the floor: its "
            "Linear-1 phase runs 44 tiles on 44 SMs and moves its weights at 0.25 of the HBM "
            "bandwidth, the Linear-2 phase at 0.30.") in text
    assert "Around their mainloops" not in text  # a record from before those columns
    around = dict(trace_entry_us=1.3, trace_l1_wait_us=2.0, trace_l1_epilogue_us=0.7,
                  trace_l2_tail_us=6.0)
    rows_around = [{**rows[0], **around}, {**rows[1], **around}, rows[2]]
    write_record("moe_layer", "z", pd.DataFrame(rows_around), PLATFORM, {}, tmp_path)
    assert ("the Linear-2 phase at 0.30. Around their mainloops: the last program enters 1.3 µs "
            "after the first, a Linear-1 tile waits 2.0 µs from its entry for its first weights "
            "and ends 0.7 µs after its mainloop (medians), and the last tile ends 6.0 µs after "
            "the last Linear-2 mainloop (the epilogues, the split sums).") \
        in str(layer([lv.layer_view("z", tmp_path)]))
    rows[0]["weight_floor_us"] = 60.0
    write_record("moe_layer", "y", pd.DataFrame(rows), PLATFORM, {}, tmp_path)
    assert "above the bound (" not in str(layer([lv.layer_view("y", tmp_path)]))


def test_layer_prose_splits_the_profiled_misses_excess_per_setting(tmp_path):
    """Where the missed cells' calls were profiled: their time beyond the bound's unit, its
    parts' medians per setting (the weighted sum at EP = 1 only)."""
    import json

    from xstage_lab.prose.moe.fused_layer import layer

    ep1 = _row(1, fused_graph_us=97.0, kernel_in_call_us=81.0, kernel_alone_device_us=77.0,
               route_kernels_us=json.dumps({"route_tiny": 3.0}),
               call_kernels_us=json.dumps({"route_tiny": 3.0, "moe_fused_ws_kernel": 81.0,
                                           "weighted_sum": 6.5}))
    rank = _row(1, "ep8_rank", fused_graph_us=90.0, kernel_in_call_us=80.0,
                kernel_alone_device_us=77.0, weighted_sum_floor_us=0.0,
                route_kernels_us=json.dumps({"route_tiny": 4.0}),
                call_kernels_us=json.dumps({"route_tiny": 4.0, "moe_fused_ws_kernel": 80.0}))
    write_record("moe_layer", "x", pd.DataFrame([ep1, rank, _row(64)]), PLATFORM, {}, tmp_path)
    text = str(layer([lv.layer_view("x", tmp_path)]))
    # EP = 1: 97 µs, 90.5 of kernels, 6.5 between against the kernel alone's 80 - 77
    assert ("; of their time beyond the kernel plus the weighted sum's memory time (2 profiled "
            "calls, medians), the routing kernels take 3.0 µs at EP = 1 and 4.0 µs on the "
            "EP = 8 rank, the weighted sum beyond its memory time 1.5 µs at EP = 1, and the "
            "time between kernels beyond the kernel alone's 3.5 µs at EP = 1 and 3.0 µs on the "
            "EP = 8 rank;") in text
    assert "measured in graphed calls" not in text  # a record from before the boundaries
    write_record("moe_layer", "y", pd.DataFrame([_row(1, fused_graph_us=97.0), _row(64)]),
                 PLATFORM, {}, tmp_path)
    assert "profiled calls" not in str(layer([lv.layer_view("y", tmp_path)]))
    fill = "void at::native::vectorized_elementwise_kernel<4, FillFunctor<int>>"
    boundaries = dict(call_boundaries_us=json.dumps({"route_tiny -> moe_fused_ws_kernel": 1.5,
                                                     "moe_fused_ws_kernel -> route_tiny": 2.5}),
                      alone_boundaries_us=json.dumps({f"{fill} -> moe_fused_ws_kernel": 0.5,
                                                      f"moe_fused_ws_kernel -> {fill}": 1.0}))
    write_record("moe_layer", "z", pd.DataFrame([ep1, {**rank, **boundaries}, _row(64)]),
                 PLATFORM, {}, tmp_path)
    # the rank's 3 µs beyond the kernel alone's: 4.0 - 1.5 between kernels as the device
    # measured them, the rest the timed window's; the EP = 1 cell's unsplit
    assert ("1.5 µs at EP = 1, the time between kernels beyond the kernel alone's 3.5 µs at "
            "EP = 1 and 2.5 µs on the EP = 8 rank (measured in graphed calls, the device's time "
            "between a call's kernels 4.0 µs a call against the kernel alone's 1.5 µs on the "
            "EP = 8 rank, medians over 1 cell), and the rest of the call's timed span beyond the "
            "kernel alone's (where a trial starts from an idle GPU, a share of its replay's "
            "launch; the events; the timed and profiled runs' difference) 0.5 µs on the EP = 8 "
            "rank;") \
        in str(layer([lv.layer_view("z", tmp_path)]))


def test_call_excess_adds_up_to_the_graphed_call_beyond_the_bounds_unit(tmp_path):
    """Each profiled cell's graphed call beyond the kernel alone plus the weighted sum's memory
    time, in units of it, split into the fused kernel in the call beyond alone, the routing, the
    weighted sum beyond its memory time and the time between kernels beyond the kernel alone's;
    the figure draws the cells over the bound only, none without them."""
    import json

    from xstage_lab.plots import moe_layer_call_excess

    def profiled(tokens, graph, setting="ep1"):
        kernels = {"route_histogram": 3.0, "route_rows": 2.0, "moe_fused_ws_kernel": 81.0}
        if setting == "ep1":
            kernels["weighted_sum"] = 6.5
        # timed alone 80 µs, 77 of them the kernel's device time
        return _row(tokens, setting, fused_graph_us=graph, call_kernels_us=json.dumps(kernels),
                    kernel_in_call_us=81.0, kernel_alone_device_us=77.0,
                    weighted_sum_floor_us=5.0 if setting == "ep1" else 0.0)

    rows = [profiled(1, 97.0), profiled(8, 85.0 * 1.04), profiled(64, 90.0, "ep8_rank"),
            _row(512)]
    e = lv.call_excess(pd.DataFrame(rows))
    assert list(e["tokens"]) == [1, 8, 64]  # the profiled cells
    parts = e[list(lv.CALL_EXCESS)]
    assert (parts.sum(axis=1) + 1).round(12).tolist() == e["graph_over_kernel"].round(12).tolist()
    unit = 85.0  # kernel 80 + weighted-sum floor 5
    # the call's 97 µs: 92.5 of kernels, 4.5 between them against the kernel alone's 3
    assert e.iloc[0][["graph_over_kernel", *lv.CALL_EXCESS]].tolist() == pytest.approx(
        [97.0 / unit, 4.0 / unit, 5.0 / unit, 1.5 / unit, 1.5 / unit, float("nan")], nan_ok=True)
    rank = e.iloc[2]  # an EP rank sums nothing; 90 µs: 86 of kernels, 4 between against 3
    assert rank[["weighted_sum_excess", "boundary_excess"]].tolist() == pytest.approx(
        [0.0, 1.0 / 80.0])
    write_record("moe_layer", "x", pd.DataFrame(rows), PLATFORM, {}, tmp_path)
    fig = moe_layer_call_excess(lv.layer_view("x", tmp_path))
    drawn = {(tr.xaxis, tuple(tr.x)) for tr in fig.data}
    assert drawn == {("x", ("M bf16 T=1",)), ("x2", ("M bf16 T=64",))}  # 8 tokens: 1.04x
    assert fig.layout.yaxis.title.text and fig.layout.xaxis.title.text
    write_record("moe_layer", "y", pd.DataFrame(rows[1:2]), PLATFORM, {}, tmp_path)
    assert moe_layer_call_excess(lv.layer_view("y", tmp_path)) is None


def test_call_excess_splits_the_time_between_kernels_where_the_boundaries_were_profiled():
    """Where a record measured the device's time between kernels, the call's time between its
    kernels beyond the kernel alone's splits into that device time beyond the kernel alone's
    (``boundary_excess``) and the rest of the timed window (``window_excess``); the parts still
    add up; without the boundaries the window is not split off (NaN)."""
    import json

    fill = "void at::native::vectorized_elementwise_kernel<4, FillFunctor<int>>"
    kernels = json.dumps({"route_tiny": 3.0, "moe_fused_ws_kernel": 80.0})
    # timed 90 µs: 83 of kernels, 7 between them; the kernel alone's 80 - 1.5 - 77 = 1.5
    row = _row(1, "ep8_rank", fused_graph_us=90.0, weighted_sum_floor_us=0.0,
               call_kernels_us=kernels, kernel_in_call_us=80.0, kernel_alone_device_us=77.0,
               alone_fill_us=1.0, alone_fill_boundary_us=0.5)
    measured = dict(call_boundaries_us=json.dumps({"route_tiny -> moe": 0.5,
                                                   "moe -> route_tiny": 1.5}),
                    alone_boundaries_us=json.dumps({f"{fill} -> moe": 0.5,
                                                    f"moe -> {fill}": 0.75}))
    e = lv.call_excess(pd.DataFrame([{**row, **measured}, row]))
    unit = 78.5
    # the device between kernels: 2.0 a call against the alone's 0.75; the rest 5.5 - 1.25
    assert e[["boundary_excess", "window_excess"]].iloc[0].tolist() == pytest.approx(
        [1.25 / unit, 4.25 / unit])
    assert e["boundary_excess"].iloc[1] == pytest.approx(5.5 / unit)
    assert pd.isna(e["window_excess"].iloc[1])
    sums = e[list(lv.CALL_EXCESS)].sum(axis=1) + 1
    assert sums.tolist() == pytest.approx([90.0 / unit] * 2)


def test_a_kernel_that_ends_with_the_weighted_sum_is_held_against_the_kernel_without_it():
    """Where the call's kernel summed (``weighted_sum_in_kernel``), the bound's unit is still the
    kernel alone without the sum plus the sum's memory time; the call's excess shows the sum
    in the fused kernel's time in the call, and no launch of its own."""
    import json

    kernels = json.dumps({"route_tiny": 3.0, "moe_fused_ws_kernel": 80.0})
    rows = [_row(1, fused_graph_us=89.0, weighted_sum_in_kernel=True, call_kernels_us=kernels,
                 kernel_in_call_us=80.0, kernel_alone_device_us=77.0),
            _row(1, fused_graph_us=89.0, weighted_sum_in_kernel=False)]
    table = pd.DataFrame(rows)
    assert list(lv.kernel_and_sum_us(table)) == [85.0, 85.0]
    e = lv.call_excess(table.iloc[:1])
    # 89 µs: 83 of kernels (3 routing), 6 between against the kernel alone's 3
    assert e.iloc[0][["kernel_excess", "routing_excess", "weighted_sum_excess",
                      "boundary_excess"]].tolist() == pytest.approx([3 / 85, 3 / 85, -5 / 85,
                                                                     3 / 85])


def test_the_bounds_kernel_alone_leaves_out_its_counters_fill_where_profiled(tmp_path):
    """The kernel alone is timed after its row counters' fill, which a call's routing does: where
    the record profiled the fill (its device time and its boundary into the kernel), the unit
    leaves both out, the call's excess still adds up, and the prose gives the fill; in a record
    from before, the unit keeps it and the prose counts those cells."""
    import json

    from xstage_lab.prose.moe.fused_layer import layer

    kernels = json.dumps({"route_tiny": 3.0, "moe_fused_ws_kernel": 80.0, "weighted_sum": 6.0})
    profiled = _row(1, fused_graph_us=89.0, call_kernels_us=kernels, kernel_in_call_us=80.0,
                    kernel_alone_device_us=77.0, alone_fill_us=1.25, alone_fill_boundary_us=0.5)
    table = pd.DataFrame([profiled, _row(8)])
    assert lv.counters_fill_us(table).iloc[0] == 1.75 and pd.isna(lv.counters_fill_us(table)[1])
    assert list(lv.kernel_and_sum_us(table)) == [83.25, 85.0]  # 80 - 1.75 + 5; 80 + 5
    assert list(lv.acceptance(table)["graph_over_kernel_fill_out"]) == [True, False]
    assert list(lv.kernel_and_sum_us(pd.DataFrame([_row(1)]))) == [85.0]  # no profile columns
    e = lv.call_excess(table.iloc[:1])
    assert e["graph_over_kernel"].iloc[0] == pytest.approx(89.0 / 83.25)
    assert e[list(lv.CALL_EXCESS)].sum(axis=1).iloc[0] + 1 == pytest.approx(89.0 / 83.25)
    # between kernels: the call's 0 against the kernel alone's 80 - 1.75 - 77
    assert e["boundary_excess"].iloc[0] == pytest.approx(-1.25 / 83.25)
    write_record("moe_layer", "x", table, PLATFORM, {}, tmp_path)
    text = str(layer([lv.layer_view("x", tmp_path)]))
    assert ("(1.06–1.07×; the kernel's time without its row counters' fill, 1.8 µs a call as "
            "profiled; in 1 cell, from records made before that fill was profiled, with it)") \
        in text
    write_record("moe_layer", "y", table.iloc[:1], PLATFORM, {}, tmp_path)
    assert "made before that fill" not in str(layer([lv.layer_view("y", tmp_path)]))
    fill = "void at::native::vectorized_elementwise_kernel<4, FillFunctor<int>>"
    measured = table.assign(alone_boundaries_us=json.dumps({f"{fill} -> moe": 0.5,
                                                            f"moe -> {fill}": 0.25}),
                            call_boundaries_us=json.dumps({"route_tiny -> moe": 1.0}))
    between = lv.boundaries_per_call_us(measured)["alone_between_us"]
    assert between.tolist() == [0.25, 0.75]  # the fill's 0.5 into the kernel out where profiled


