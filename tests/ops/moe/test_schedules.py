"""Schedules of the fused MoE kernel (paper §4.2, Algorithm 1): coverage, dependencies, lead D,
deadlock freedom with all programs resident, and that bad schedules are caught."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from xstage_lab.ops.moe.schedules import (
    L1, L2, MoEProblem, Schedule, ScheduleError, Tile, check_schedule, d_knee,
    WAVE_FILL, derived_interleaved_schedule, execution_order, expert_wave_schedule,
    interleaved_schedule, l1_deal, leads_from_expert, tile_table, tile_work, wave_starts)

PROBLEMS = {
    "one_expert": MoEProblem((5,), 3, 2),
    "l1_wider": MoEProblem((2, 3, 1, 4), 4, 2),     # P_1 > P_2
    "l2_wider": MoEProblem((3, 1, 2), 2, 5),        # P_2 > P_1 (DeepSeek-like hidden > intermediate)
    "idle_experts": MoEProblem((0, 4, 0, 2, 0), 3, 3),
    "many_experts": MoEProblem(tuple(range(1, 13)), 2, 3),
    "skewed": MoEProblem((20, 1, 1, 1, 0, 1), 3, 4),
}
PROGRAMS = (2, 4, 8)


def _schedules(problem: MoEProblem, programs: int):
    yield expert_wave_schedule(problem, programs)
    yield expert_wave_schedule(problem, programs, experts_per_wave=1)
    for lead in sorted({1, 3, d_knee(2 * 32, programs, 32 * problem.l1_n_blocks)}):
        yield interleaved_schedule(problem, programs, lead)
        yield interleaved_schedule(problem, programs, lead, by_work=False)
        yield interleaved_schedule(problem, programs, lead, expert_lead=True)


@pytest.mark.parametrize("programs", PROGRAMS)
@pytest.mark.parametrize("name", PROBLEMS)
def test_schedules_pass_every_rule(name, programs):
    problem = PROBLEMS[name]
    for schedule in _schedules(problem, programs):
        check_schedule(problem, schedule)
        assert schedule.num_programs == programs
        assert schedule.num_tiles == problem.num_rows * (problem.l1_n_blocks + problem.l2_n_blocks)
        assert len(execution_order(problem, schedule)) == schedule.num_tiles


def test_an_expert_lead_holds_each_linear2_tile_until_its_experts_last_row_is_d_behind():
    problem = PROBLEMS["idle_experts"]  # expert 1: rows 0-3, expert 3: rows 4-5
    for programs in PROGRAMS:
        s = interleaved_schedule(problem, programs, 1, expert_lead=True)
        check_schedule(problem, s)
        held = [(t, nxt) for prog in s.programs for t, nxt in zip(prog, prog[1:])
                if t.kind == L2 and nxt.kind == L1]
        assert held and all(nxt.row_block >= (3 if t.expert == 1 else 5) + 1 for t, nxt in held)
        assert s.programs != interleaved_schedule(problem, programs, 1).programs


def test_the_derived_schedule_counts_the_lead_from_the_expert_only_where_p2_is_below_p1():
    """DiT-MoE's P_1 = 44, P_2 = 11 count from the expert; where P_2 >= P_1, from the row."""
    assert leads_from_expert(44, 11) and not leads_from_expert(16, 16)
    assert not leads_from_expert(2, 5)
    with pytest.raises(ValueError):
        leads_from_expert(0, 1)
    for name, expert in (("l1_wider", True), ("l2_wider", False)):
        problem = PROBLEMS[name]
        built = derived_interleaved_schedule(problem, 4, 1)
        assert built.programs == interleaved_schedule(problem, 4, 1,
                                                      expert_lead=expert).programs
    # in "l1_wider" the two counts differ, so the comparison above tells which one was built
    problem = PROBLEMS["l1_wider"]
    assert (interleaved_schedule(problem, 4, 1, expert_lead=True).programs
            != interleaved_schedule(problem, 4, 1).programs)


def _random_interleaving_completes(problem: MoEProblem, schedule: Schedule, rng) -> bool:
    """Advance one ready program at a time, chosen at random, until done or stuck."""
    heads = [0] * schedule.num_programs
    l1_done = [0] * problem.num_rows
    while True:
        ready = [g for g, tiles in enumerate(schedule.programs) if heads[g] < len(tiles) and (
            tiles[heads[g]].kind == L1 or l1_done[tiles[heads[g]].row_block] == problem.l1_n_blocks)]
        if not ready:
            return all(heads[g] == len(t) for g, t in enumerate(schedule.programs))
        g = rng.choice(ready)
        t = schedule.programs[g][heads[g]]
        if t.kind == L1:
            l1_done[t.row_block] += 1
        heads[g] += 1


@pytest.mark.parametrize("programs", PROGRAMS)
def test_any_interleaving_terminates(programs):
    """The fixpoint argument of execution_order, checked against random resident interleavings."""
    rng = random.Random(programs)
    for problem in PROBLEMS.values():
        for schedule in _schedules(problem, programs):
            assert all(_random_interleaving_completes(problem, schedule, rng) for _ in range(5))


def test_fuzzed_problems():
    rng = np.random.default_rng(7)
    for _ in range(40):
        problem = MoEProblem(tuple(int(b) for b in rng.integers(0, 6, rng.integers(1, 9))),
                             int(rng.integers(1, 6)), int(rng.integers(1, 6)))
        programs = int(rng.choice(PROGRAMS))
        check_schedule(problem, expert_wave_schedule(problem, programs))
        check_schedule(problem, interleaved_schedule(problem, programs, int(rng.integers(1, 6))))


def test_d_knee_is_eq16():
    # D_knee = ceil(b_n K_SM / (2 h_inter)); an L1 tile of 128 gate + 128 up columns has b_n = 256.
    assert d_knee(256, 132, 2048) == math.ceil(256 * 132 / 4096) == 9
    assert d_knee(256, 132, 5632) == 3
    assert d_knee(256, 8, 4096) == 1
    with pytest.raises(ValueError):
        d_knee(0, 132, 2048)


def test_interleaved_follows_algorithm_1():
    """Program g walks the Linear-2 stream from k = g with stride G and its Linear-1 tiles as
    ``l1_deal`` deals them; Linear-2 only when p_2 + D <= p_1. Dealt by stride (the paper's
    statement), the Linear-1 stream too walks from k = g with stride G."""
    problem, programs, lead = PROBLEMS["l1_wider"], 2, 2
    for by_work in (True, False):
        schedule = interleaved_schedule(problem, programs, lead, by_work=by_work)
        deal = l1_deal(problem, programs, by_work)
        for g, tiles in enumerate(schedule.programs):
            l1 = [t for t in tiles if t.kind == L1]
            l2 = [t for t in tiles if t.kind == L2]
            assert l1 == [problem.l1_tile(k) for k in deal[g]]
            assert l2 == [problem.l2_tile(k) for k in range(
                g, problem.num_rows * problem.l2_n_blocks, programs)]
        assert schedule.lead_rows == lead
    assert l1_deal(problem, programs, False) == [
        list(range(g, problem.num_rows * problem.l1_n_blocks, programs)) for g in range(programs)]


def test_the_linear1_deal_evens_the_work_the_stride_deal_leaves_uneven():
    """DiT-MoE's grid at 4096 tokens (65 row blocks, P_1 = 44, P_2 = 11, 132 programs): a Linear-2
    tile is two Linear-1 tiles' work (w = 22, 44). With stride G, programs 0..54 hold both a 22nd
    Linear-1 and a 6th Linear-2 tile; by work, no program exceeds the mean by a Linear-1 tile."""
    problem, G = MoEProblem((33, 32), 44, 11), 132
    assert tile_work(problem) == (22, 44)

    def work(schedule):
        return [sum(22 if t.kind == L1 else 44 for t in p) for p in schedule.programs]
    strided = interleaved_schedule(problem, G, 15, by_work=False)
    dealt = interleaved_schedule(problem, G, 15)
    check_schedule(problem, dealt)
    mean = (65 * 44 * 22 + 65 * 11 * 44) / G
    assert max(work(strided)) == 22 * 22 + 6 * 44 > mean + 22
    assert max(work(dealt)) - min(work(dealt)) <= 22 and max(work(dealt)) < mean + 22


@pytest.mark.parametrize("seed", range(40))
def test_the_linear1_deal_is_the_closed_form_the_device_computes(seed):
    """``l1_deal`` (least work first) equals its docstring's closed form: the first u n_B tiles
    round-robin over programs r_2 .. G-1, then round-robin over all, in program order where
    f = 0, else r_2 .. G-1 first; and with r_2 = 0 it is the stride-G deal."""
    rng = np.random.default_rng(seed)
    problem = MoEProblem(tuple(int(b) for b in rng.integers(0, 9, rng.integers(1, 6))),
                         int(rng.integers(1, 50)), int(rng.integers(1, 30)))
    G = int(rng.integers(1, 140))
    n1, n2 = problem.num_rows * problem.l1_n_blocks, problem.num_rows * problem.l2_n_blocks
    w1, w2 = tile_work(problem)
    r2, u, f = n2 % G, w2 // w1, w2 % w1
    nb = G - r2
    want = [[] for _ in range(G)]
    for i in range(n1):
        if i < u * nb:
            want[r2 + i % nb].append(i)
        else:
            pos = (i - u * nb) % G
            want[pos if f == 0 else (r2 + pos if pos < nb else pos - nb)].append(i)
    assert l1_deal(problem, G) == want
    if r2 == 0:
        assert want == l1_deal(problem, G, by_work=False)


@pytest.mark.parametrize("lead, order", [
    (1, ["L1 0", "L2 0", "L1 1", "L2 1", "L1 2", "L2 2", "L1 3", "L2 3"]),
    (2, ["L1 0", "L1 1", "L2 0", "L1 2", "L2 1", "L1 3", "L2 2", "L2 3"]),
    (4, ["L1 0", "L1 1", "L1 2", "L1 3", "L2 0", "L2 1", "L2 2", "L2 3"])])
def test_interleaved_order_on_one_program(lead, order):
    """Four rows, P_1 = P_2 = 1, G = 1, worked by hand from Algorithm 1: Linear-2 of row p_2 goes
    as soon as p_2 + D <= p_1 (p_1 the row of the next Linear-1 tile), so with D = 1 it follows
    the Linear-1 tile of the next row, with D = 2 the one two rows on; p_1 = inf once Linear-1
    is done flushes the rest."""
    problem = MoEProblem((4,), 1, 1)
    schedule = interleaved_schedule(problem, 1, lead)
    assert [f"L{t.kind + 1} {t.row_block}" for t in schedule.programs[0]] == order


def test_interleaved_order_on_strided_programs():
    """Three rows, P_1 = 2, P_2 = 1, G = 2, D = 1, by hand. The Linear-2 stream, strided: program
    0 holds tiles 0, 2 (rows 0, 2), program 1 tile 1 (row 1). The Linear-1 stream by work
    (w_1 = 2, w_2 = 2; program 0 starts at work 4, program 1 at 2): tile 0 to program 1, then
    alternately, ties to program 0: program 0 holds tiles 1, 3, 5 (rows 0, 1, 2, N tile 1),
    program 1 tiles 0, 2, 4 (N tile 0). Program 0 emits row 0's Linear-2 once its next Linear-1
    tile is in row 1 (0 + 1 <= 1); program 1 holds row 1's until its next Linear-1 tile is in
    row 2."""
    problem = MoEProblem((3,), 2, 1)
    schedule = interleaved_schedule(problem, 2, 1)
    assert schedule.programs == (
        (Tile(L1, 0, 0, 1), Tile(L2, 0, 0, 0), Tile(L1, 0, 1, 1), Tile(L1, 0, 2, 1),
         Tile(L2, 0, 2, 0)),
        (Tile(L1, 0, 0, 0), Tile(L1, 0, 1, 0), Tile(L2, 0, 1, 0), Tile(L1, 0, 2, 0)))
    check_schedule(problem, schedule)


def test_expert_wave_runs_a_wave_l1_then_l2():
    problem, programs = PROBLEMS["many_experts"], 4
    per_wave = 3
    schedule = expert_wave_schedule(problem, programs, experts_per_wave=per_wave)
    for tiles in schedule.programs:
        keys = [(t.expert // per_wave, t.kind) for t in tiles]
        assert keys == sorted(keys), "waves in order, each wave's L1 before its L2"


def test_expert_wave_deals_its_stream_with_stride_g():
    """Rows r0 (expert 0), r1 r2 (expert 1), r3 (expert 2), P_1 = P_2 = 2, two experts per wave.
    The stream: wave {0, 1}'s Linear-1 tiles row-major (stream 0-5), its Linear-2 tiles (6-11),
    then wave {2}'s (12-13, 14-15); program g takes stream items g, g + 3, g + 6, ..."""
    problem = MoEProblem((1, 2, 1), 2, 2)
    schedule = expert_wave_schedule(problem, 3, experts_per_wave=2)
    assert schedule.programs == (
        (Tile(L1, 0, 0, 0), Tile(L1, 1, 1, 1), Tile(L2, 0, 0, 0), Tile(L2, 1, 1, 1),
         Tile(L1, 2, 3, 0), Tile(L2, 2, 3, 1)),
        (Tile(L1, 0, 0, 1), Tile(L1, 1, 2, 0), Tile(L2, 0, 0, 1), Tile(L2, 1, 2, 0),
         Tile(L1, 2, 3, 1)),
        (Tile(L1, 1, 1, 0), Tile(L1, 1, 2, 1), Tile(L2, 1, 1, 0), Tile(L2, 1, 2, 1),
         Tile(L2, 2, 3, 0)))
    check_schedule(problem, schedule)


def _longest_l2_run(schedule: Schedule) -> int:
    best = 0
    for tiles in schedule.programs:
        run = 0
        for t in tiles:
            run = run + 1 if t.kind == L2 else 0
            best = max(best, run)
    return best


def test_interleaving_shortens_linear2_runs():
    """The point of Algorithm 1: fewer back-to-back Linear-2 epilogues (remote-store bursts)."""
    problem = MoEProblem((6,) * 8, 4, 8)
    wave = expert_wave_schedule(problem, 4, experts_per_wave=2)
    inter = interleaved_schedule(problem, 4, 1)
    assert _longest_l2_run(inter) < _longest_l2_run(wave)


def test_default_waves_fill_every_program_twice_by_counted_rows():
    """8 L1 tiles per expert of 2 rows, 4 per expert of 1 row: a wave closes at the first expert
    that brings its Linear-1 tiles to WAVE_FILL x programs; the last wave takes the rest, trailing
    idle experts too."""
    assert WAVE_FILL == 2
    problem = MoEProblem((2, 2, 1, 1, 1, 1, 2, 0), 4, 4)
    assert wave_starts(problem, 4) == (0, 1, 2, 4, 6)  # 8 | 8 | 4+4 | 4+4 | 8+0
    assert wave_starts(problem, 6) == (0, 2, 5)        # 8+8 | 4+4+4 | 4+8+0
    assert wave_starts(problem, 1000) == (0,)
    assert wave_starts(problem, 4, experts_per_wave=3) == (0, 3, 6)
    with pytest.raises(ValueError, match="experts_per_wave"):
        wave_starts(problem, 4, experts_per_wave=0)


def test_skewed_default_waves_hold_enough_linear1_tiles():
    """Under skew every wave of cold experts but the last holds WAVE_FILL rounds of Linear-1
    tiles, where one expert per wave (what the mean rows per active expert suggests here) gives
    waves of fewer Linear-1 tiles than programs."""
    problem, programs = PROBLEMS["skewed"], 4

    def l1_tiles(schedule):
        starts = schedule.wave_starts + (len(problem.blocks_per_expert),)
        return [sum(problem.blocks_per_expert[e0:e1]) * problem.l1_n_blocks
                for e0, e1 in zip(starts, starts[1:])]

    assert l1_tiles(expert_wave_schedule(problem, programs)) == [60, 9, 3]
    assert min(l1_tiles(expert_wave_schedule(problem, programs, experts_per_wave=1))) < programs


def test_tile_table_round_trip():
    problem = PROBLEMS["skewed"]
    schedule = interleaved_schedule(problem, 4, 2)
    table, counts = tile_table(schedule)
    assert table.dtype == np.int32 and counts.dtype == np.int32
    assert table.shape == (4, counts.max(), 4)
    for g, tiles in enumerate(schedule.programs):
        assert [Tile(*map(int, row)) for row in table[g, :counts[g]]] == list(tiles)


# ------------------------------------------------------------------------- bad schedules are caught

def _edit(schedule: Schedule, programs) -> Schedule:
    return Schedule(schedule.name + "_edited", tuple(tuple(p) for p in programs), schedule.lead_rows)


def test_duplicate_tile_caught():
    problem = PROBLEMS["l1_wider"]
    s = expert_wave_schedule(problem, 2)
    progs = [list(p) for p in s.programs]
    progs[1].append(progs[0][0])
    with pytest.raises(ScheduleError, match="twice"):
        check_schedule(problem, _edit(s, progs))


def test_missing_and_unknown_tiles_caught():
    problem = PROBLEMS["l1_wider"]
    s = expert_wave_schedule(problem, 2)
    progs = [list(p) for p in s.programs]
    progs[0].pop()
    with pytest.raises(ScheduleError, match="missing"):
        check_schedule(problem, _edit(s, progs))
    progs = [list(p) for p in s.programs] + [[Tile(L1, 0, problem.num_rows, 0)]]
    with pytest.raises(ScheduleError, match="unknown"):
        check_schedule(problem, _edit(s, progs))


def test_linear2_before_its_own_linear1_caught():
    problem = MoEProblem((1,), 2, 1)
    bad = Schedule("self_wait", ((Tile(L1, 0, 0, 0), Tile(L2, 0, 0, 0), Tile(L1, 0, 0, 1)),))
    with pytest.raises(ScheduleError, match="own row"):
        check_schedule(problem, bad)


def test_cross_program_deadlock_caught():
    """Each program waits on a Linear-1 tile the other holds later in its list: a wait-for cycle
    that no per-program rule sees."""
    problem = MoEProblem((2,), 1, 1)
    bad = Schedule("cycle", ((Tile(L2, 0, 0, 0), Tile(L1, 0, 1, 0)),
                             (Tile(L2, 0, 1, 0), Tile(L1, 0, 0, 0))))
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedule(problem, bad)
    rng = random.Random(0)
    assert not any(_random_interleaving_completes(problem, bad, rng) for _ in range(10))


def test_deadlock_waiting_on_the_second_linear1_slice_caught():
    """P_1 = 2: program 1 waits on row 0's Linear-2 tile, whose first Linear-1 slice program 0
    has done and whose second program 0 holds behind its own wait on row 1's Linear-2 tile, whose
    second slice program 1 holds. A check that took one finished slice for the whole row (all a
    P_1 = 1 problem can tell apart) would let both run."""
    problem = MoEProblem((2,), 2, 1)
    bad = Schedule("cycle_p1", ((Tile(L1, 0, 0, 0), Tile(L1, 0, 1, 0), Tile(L2, 0, 1, 0),
                                 Tile(L1, 0, 0, 1)),
                                (Tile(L2, 0, 0, 0), Tile(L1, 0, 1, 1))))
    with pytest.raises(ScheduleError, match="deadlock"):
        check_schedule(problem, bad)
    with pytest.raises(ScheduleError, match="2 programs stuck"):
        execution_order(problem, bad)
    rng = random.Random(0)
    assert not any(_random_interleaving_completes(problem, bad, rng) for _ in range(10))
    # the same tiles with program 0's last two swapped: row 0's slices both come first
    good = Schedule("fixed", ((Tile(L1, 0, 0, 0), Tile(L1, 0, 1, 0), Tile(L1, 0, 0, 1),
                               Tile(L2, 0, 1, 0)), bad.programs[1]))
    assert len(execution_order(problem, good)) == 6


def test_lead_violation_caught():
    problem = MoEProblem((8,), 1, 1)
    built = interleaved_schedule(problem, 2, 1)
    claimed = Schedule(built.name, built.programs, lead_rows=4)  # promises more lead than it has
    with pytest.raises(ScheduleError, match="lead below D"):
        check_schedule(problem, claimed)


def test_zero_lead_rejected():
    with pytest.raises(ValueError, match="self-deadlock"):
        interleaved_schedule(PROBLEMS["one_expert"], 2, 0)
