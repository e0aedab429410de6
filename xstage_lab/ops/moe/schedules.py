"""Tile schedules of the fused MoE kernel (paper §4.2, Algorithm 1) and their checker.

A schedule is data: one ordered tile list per persistent program. The kernel
(``kernels/moe_fused.py``) executes whatever lists it is given, so a new schedule needs no kernel
change. Terms follow the paper:

* a *scheduler row* (row block) is ``block_m`` dispatched tokens of one local expert; rows are
  numbered expert by expert, ``O_e`` is the first row of expert ``e`` and ``e(p)`` the expert of
  row ``p``;
* ``P_1`` (``l1_n_blocks``) and ``P_2`` (``l2_n_blocks``) are the Linear-1 and Linear-2 tiles of one
  row; every Linear-2 tile of row ``p`` depends on all ``P_1`` Linear-1 tiles of row ``p``;
* ``G`` programs walk the tile streams with stride ``G`` (program ``g`` starts at ``g``);
* ``D`` (``lead_rows``) is the minimum row lead of the Linear-1 stream over the Linear-2 stream.

Expert-Wave (the baseline, §2.2): consecutive local experts grouped into waves; the merged stream is
each wave's Linear-1 tiles followed by its Linear-2 tiles, dealt round-robin to the programs.

Interleaved (Algorithm 1): each program merges its Linear-1 and Linear-2 streams, emitting
Linear-2 only when ``p_2 + D <= p_1`` (``p_1 = inf`` once its Linear-1 stream is done); the
derived ``D`` is ``derived_lead`` (eq. 16's ``D_knee`` and, where P_2 < P_1, the Linear-2 stream's
span, counted from the end of the tile's expert: ``leads_from_expert``). The Linear-2 stream is
dealt with stride G, the Linear-1 stream by work (``l1_deal``). Triton has no two-CTA clusters, so
one program is one instance (``r = 0``, N-tile ``k mod P_i``), where the paper pairs CTAs with
``n = 2(k mod P_i) + r``.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np

L1 = 0
L2 = 1
TILE_FIELDS = 4  # (kind, expert, row_block, n_block): one int32 table entry


class Tile(NamedTuple):
    kind: int        # L1 or L2
    expert: int      # local expert index
    row_block: int   # global scheduler row (row blocks of all local experts, expert by expert)
    n_block: int     # N-tile index in the tile's output (intermediate for L1, hidden for L2)


@dataclass(frozen=True)
class Schedule:
    """Per-program tile lists plus how they were built."""

    name: str
    programs: tuple[tuple[Tile, ...], ...]
    lead_rows: int | None = None   # D for an interleaved schedule; None where no lead is promised
    wave_starts: tuple[int, ...] | None = None  # Expert-Wave: the first local expert of each wave

    @property
    def num_programs(self) -> int:
        return len(self.programs)

    @property
    def num_tiles(self) -> int:
        return sum(len(p) for p in self.programs)


@dataclass(frozen=True)
class MoEProblem:
    """The tile grid of one rank's fused MoE call."""

    blocks_per_expert: tuple[int, ...]  # row blocks of each local expert (0 for an idle expert)
    l1_n_blocks: int                    # P_1 = intermediate / block_n1
    l2_n_blocks: int                    # P_2 = hidden / block_n2

    def __post_init__(self):
        if any(b < 0 for b in self.blocks_per_expert):
            raise ValueError(f"blocks_per_expert must be >= 0, got {self.blocks_per_expert}")
        if self.l1_n_blocks < 1 or self.l2_n_blocks < 1:
            raise ValueError("l1_n_blocks and l2_n_blocks must be >= 1")

    @property
    def num_rows(self) -> int:
        return sum(self.blocks_per_expert)

    @cached_property
    def first_row(self) -> tuple[int, ...]:
        """O_e: the first scheduler row of each local expert."""
        return tuple(int(v) for v in np.concatenate(([0], np.cumsum(self.blocks_per_expert)[:-1])))

    @cached_property
    def row_expert(self) -> tuple[int, ...]:
        """e(p): the local expert of each scheduler row."""
        return tuple(e for e, b in enumerate(self.blocks_per_expert) for _ in range(b))

    def l1_tile(self, k: int) -> Tile:
        """The k-th tile of the row-major Linear-1 stream."""
        row = k // self.l1_n_blocks
        return Tile(L1, self.row_expert[row], row, k % self.l1_n_blocks)

    def l2_tile(self, k: int) -> Tile:
        row = k // self.l2_n_blocks
        return Tile(L2, self.row_expert[row], row, k % self.l2_n_blocks)

    def all_tiles(self) -> set[Tile]:
        rows = self.num_rows
        return ({self.l1_tile(k) for k in range(rows * self.l1_n_blocks)}
                | {self.l2_tile(k) for k in range(rows * self.l2_n_blocks)})


def d_knee(b_n: int, k_sm: int, h_inter: int) -> int:
    """Eq. 16: D_knee = ceil(b_n * K_SM / (2 h_inter)), the anti-starvation lead in scheduler rows.

    ``b_n`` is the Linear-1 N-tile width in the concatenated gate|up output (2 * intermediate
    columns), so ``2 h_inter / b_n`` Linear-1 tiles make a row and K_SM programs in flight span
    ``b_n K_SM / (2 h_inter)`` rows. In this kernel an L1 tile computes ``block_n1`` gate and
    ``block_n1`` up columns, i.e. ``b_n = 2 * block_n1``."""
    if b_n < 1 or k_sm < 1 or h_inter < 1:
        raise ValueError(f"b_n, k_sm and h_inter must be >= 1, got {b_n}, {k_sm}, {h_inter}")
    return math.ceil(b_n * k_sm / (2 * h_inter))


def derived_lead(knee: int, num_programs: int, l1_n_blocks: int, l2_n_blocks: int) -> int:
    """The Interleaved lead D (issue 26 item 3): eq. 16's D_knee, and the rows the Linear-2
    stream spans across the G = ``num_programs`` programs where that stream is the sparser one:

        D = D_knee + [P_2 < P_1] * ceil(G / P_2)

    Eq. 16 sizes the lead by the rows the G programs' in-flight Linear-1 tiles span,
    ceil(G / P_1), which holds while the programs go through Linear-1 in step. They do where
    P_2 >= P_1: every program takes P_2 / P_1 >= 1 Linear-2 tiles per Linear-1 tile. Where
    P_2 < P_1 (DiT-MoE: P_2 = 11, P_1 = 44), a program takes a Linear-2 tile only once in
    P_1 / P_2 Linear-1 tiles, and those that just took one trail the rest by it. Program g's
    Linear-2 stream starts at tile g, so the programs' current Linear-2 tiles span
    ceil(G / P_2) rows; the lead adds them so that the Linear-2 tile a program takes at its
    lead finds its rows complete.

    No row more: a longer lead puts the Linear-2 tiles further behind the Linear-1 tiles running
    beside them, and the L2 cache keeps less of what both read. Measured with every store local
    (moe_schedule_probe/h200-x1/20261203T141554Z-81fabb90a5 and …141612Z-82d98bebfb): GLM-5.x
    bf16 at the knee (9) ran at 1.00 of Expert-Wave's speed, at 9 + ceil(G / P_2) = 15 at 0.96
    (as in both local sweeps before); DeepSeek-V4-Pro bf16 at 6 against 11: 1.03 against 0.99,
    and under Nsight Compute at 11 it read 4% more bytes from DRAM (moe_ncu/h200-x1)."""
    if knee < 1 or num_programs < 1 or l1_n_blocks < 1 or l2_n_blocks < 1:
        raise ValueError(f"knee, num_programs, l1_n_blocks and l2_n_blocks must be >= 1, got "
                         f"{knee}, {num_programs}, {l1_n_blocks}, {l2_n_blocks}")
    if l2_n_blocks >= l1_n_blocks:
        return knee
    return knee + math.ceil(num_programs / l2_n_blocks)


def leads_from_expert(l1_n_blocks: int, l2_n_blocks: int) -> bool:
    """Whether the derived Interleaved lead counts from the last row of each Linear-2 tile's
    expert (``interleaved_schedule(expert_lead=True)``), not from the tile's own row: where
    P_2 < P_1, the same condition as ``derived_lead``'s added term.

    There a row holds few Linear-2 tiles, and the row lead deals an expert's Linear-2 tiles, all
    reading its W2, one row at a time as Linear-1 completes its rows, far apart in time: DiT-MoE
    bf16 at the derived lead read 68% more bytes from DRAM than Expert-Wave (``moe_ncu/h200-x1``)
    and ran at 0.96 of its speed. Counted from the expert's last row, an expert's Linear-2 tiles
    come due together and share its W2 in the L2 cache (15% more DRAM reads than Expert-Wave,
    ``moe_ncu/h200-x1/20261203T1618Z-dit-expert-lead.csv``): with every store local, it ran
    at 1.006 of Expert-Wave's speed against 0.960 with the row lead (bf16 balanced), 1.002
    against 0.973 (bf16 skewed), 1.026 against 1.024 (fp8 balanced) (``moe_schedule_probe/
    h200-x1`` 20261203T160135Z-7b6325593b, …160145Z-80d0c6c71d, …160200Z-f6e41bbbe5). Where
    P_2 >= P_1 the lead stays counted from the row: the programs take Linear-2 tiles at least
    as often as Linear-1 tiles, so a row's Linear-2 tiles already come due together."""
    if l1_n_blocks < 1 or l2_n_blocks < 1:
        raise ValueError(f"l1_n_blocks and l2_n_blocks must be >= 1, got {l1_n_blocks}, "
                         f"{l2_n_blocks}")
    return l2_n_blocks < l1_n_blocks


LEAD_MULTIPLES = (1, 2, 4)


def lead_sweep(knee: int, lead: int, multiples=LEAD_MULTIPLES) -> list[int]:
    """The Interleaved leads the host-link matrix times and its ``auto`` chooses among: D_knee
    (eq. 16) and the derived lead (``derived_lead``) times each of ``multiples``."""
    if any(m < 1 for m in multiples):
        raise ValueError(f"lead multiples must be >= 1, got {list(multiples)}")
    return sorted({knee, *(m * lead for m in multiples)})


WAVE_FILL = 2  # Linear-1 tiles per program that a default Expert-Wave wave holds at least


def wave_starts(problem: MoEProblem, num_programs: int,
                experts_per_wave: int | None = None) -> tuple[int, ...]:
    """The first local expert of each Expert-Wave wave: every ``experts_per_wave`` experts where
    given, else the fewest consecutive experts whose Linear-1 tiles fill every program
    ``WAVE_FILL`` times (the last wave takes what is left, idle experts included).

    MegaMoE sizes a wave by the expected tokens per expert. Counting the routed rows instead keeps
    a wave of cold experts (skewed routing) from holding fewer Linear-1 tiles than there are
    programs: then the wave's Linear-2 tiles are dealt at once and wait on its Linear-1 tiles for
    a whole Linear-1 mainloop. Two rounds of Linear-1 per program keep that wait short."""
    n_exp = len(problem.blocks_per_expert)
    if experts_per_wave is not None:
        if experts_per_wave < 1:
            raise ValueError(f"experts_per_wave must be >= 1, got {experts_per_wave}")
        return tuple(range(0, n_exp, experts_per_wave))
    blocks = problem.blocks_per_expert
    starts, filled = [0], 0
    for e in range(n_exp - 1):
        filled += blocks[e] * problem.l1_n_blocks
        if filled >= WAVE_FILL * num_programs and any(blocks[e + 1:]):
            starts.append(e + 1)
            filled = 0
    return tuple(starts)


def _deal(stream: Sequence[Tile], num_programs: int) -> tuple[tuple[Tile, ...], ...]:
    """Program g takes stream items g, g + G, g + 2G, ... (the persistent stride-G walk)."""
    return tuple(tuple(stream[g::num_programs]) for g in range(num_programs))


def expert_wave_schedule(problem: MoEProblem, num_programs: int,
                         experts_per_wave: int | None = None) -> Schedule:
    """Expert-Wave: per wave (``wave_starts``), its Linear-1 tiles then its Linear-2 tiles
    (row-major each), the concatenated stream dealt with stride G. Linear-2 bursts of a wave run
    back to back."""
    if num_programs < 1:
        raise ValueError(f"num_programs must be >= 1, got {num_programs}")
    starts = wave_starts(problem, num_programs, experts_per_wave)
    stream: list[Tile] = []
    first = problem.first_row
    for e0, e1 in zip(starts, starts[1:] + (len(problem.blocks_per_expert),)):
        rows = range(first[e0], first[e1 - 1] + problem.blocks_per_expert[e1 - 1])
        stream += [problem.l1_tile(p * problem.l1_n_blocks + n)
                   for p in rows for n in range(problem.l1_n_blocks)]
        stream += [problem.l2_tile(p * problem.l2_n_blocks + n)
                   for p in rows for n in range(problem.l2_n_blocks)]
    return Schedule("expert_wave", _deal(stream, num_programs), wave_starts=starts)


def tile_work(problem: MoEProblem) -> tuple[int, int]:
    """``(w_1, w_2)``: the multiply-adds of a Linear-1 and of a Linear-2 tile in units of
    ``H I / (P_1 P_2)`` per row. A Linear-1 tile computes gate and up, ``2 I / P_1`` columns over
    K = H; a Linear-2 tile ``H / P_2`` columns over K = I: ``w_1 = 2 P_2``, ``w_2 = P_1``
    (DiT-MoE: 22 and 44, a Linear-2 tile is two Linear-1 tiles' work; Qwen3.5: 32 and 8)."""
    return 2 * problem.l2_n_blocks, problem.l1_n_blocks


def l1_deal(problem: MoEProblem, num_programs: int, by_work: bool = True) -> list[list[int]]:
    """Interleaved's Linear-1 stream dealt by work (``by_work=False``: with stride G, as
    Algorithm 1 deals it): each program's Linear-1 stream indices.

    The Linear-2 stream is dealt with stride G, so its first ``r_2 = n_2 mod G`` programs hold one
    Linear-2 tile more. Dealt with stride G too, the Linear-1 stream's extra tiles would go to the
    first programs as well, and a program holding both extras sets the makespan where a Linear-2
    tile is worth several Linear-1 tiles (measured: ``moe_schedule_probe``). Instead each Linear-1
    tile, in stream order, goes to the program with the least work so far (``tile_work``; its
    Linear-2 tiles counted from the start, ties to the lower program): once the Linear-1 tiles
    level the extra Linear-2 tiles (more than ``u n_B`` of them, below), the programs' work
    differs by at most one Linear-1 tile. Where ``r_2 = 0`` this is the stride-G deal.

    In closed form (what ``kernels/moe_routing.py`` computes per tile), with ``n_B = G - r_2``,
    ``u = w_2 // w_1`` and ``f = w_2 mod w_1``: the first ``u n_B`` tiles go round-robin to
    programs ``r_2 .. G-1``, then round-robin to every program, in program order where ``f = 0``
    and programs ``r_2 .. G-1`` before ``0 .. r_2-1`` otherwise."""
    n1 = problem.num_rows * problem.l1_n_blocks
    n2 = problem.num_rows * problem.l2_n_blocks
    if not by_work:
        return [list(range(g, n1, num_programs)) for g in range(num_programs)]
    w1, w2 = tile_work(problem)
    heap = [(len(range(g, n2, num_programs)) * w2, g) for g in range(num_programs)]
    heapq.heapify(heap)
    dealt: list[list[int]] = [[] for _ in range(num_programs)]
    for k in range(n1):
        work, g = heapq.heappop(heap)
        dealt[g].append(k)
        heapq.heappush(heap, (work + w1, g))
    return dealt


def interleaved_schedule(problem: MoEProblem, num_programs: int, lead_rows: int,
                         by_work: bool = True, expert_lead: bool = False) -> Schedule:
    """Algorithm 1 with instance stride G = ``num_programs`` for the Linear-2 stream, the
    Linear-1 stream dealt by work (``l1_deal``; ``by_work=False``: with stride G, Algorithm 1 as
    the paper states it), and lead D = ``lead_rows`` (>= 1; D = 0 would let a program wait on its
    own next Linear-1 tile). ``expert_lead``: D counted from the last row of the Linear-2 tile's
    expert, not from its own row, so that an expert's Linear-2 tiles, the ones that read its W2,
    come due together (where ``leads_from_expert``, the derived schedule's).

    Same tiles, dependencies and Combine volume as Expert-Wave; only the order changes, so the gap
    between Linear-2 bursts grows from T_L2 to T_L2 + (n_1/n_2) T_L1 (eq. 12). D sets the phase of
    the two streams, not their ratio: D >= D_knee (eq. 16) keeps Linear-2 from catching up with
    Linear-1 and spinning. Deadlock-free with every program resident for any D >= 1: a Linear-1
    tile of row p is preceded in its program only by Linear-1 tiles (never waiting) and Linear-2
    tiles of rows <= p - D, so by induction over rows every awaited tile completes."""
    if num_programs < 1:
        raise ValueError(f"num_programs must be >= 1, got {num_programs}")
    if lead_rows < 1:
        raise ValueError(f"lead_rows D must be >= 1 (D = 0 can self-deadlock), got {lead_rows}")
    n2 = problem.num_rows * problem.l2_n_blocks
    # the row each Linear-2 row's lead counts from: its expert's last, or its own
    due = ([problem.first_row[e] + problem.blocks_per_expert[e] - 1 for e in problem.row_expert]
           if expert_lead else range(problem.num_rows))
    programs = []
    for g, l1 in enumerate(l1_deal(problem, num_programs, by_work)):
        l2 = range(g, n2, num_programs)
        i = j = 0
        tiles: list[Tile] = []
        while i < len(l1) or j < len(l2):
            p1 = l1[i] // problem.l1_n_blocks if i < len(l1) else math.inf
            if j < len(l2) and due[l2[j] // problem.l2_n_blocks] + lead_rows <= p1:
                tiles.append(problem.l2_tile(l2[j]))
                j += 1
            else:
                tiles.append(problem.l1_tile(l1[i]))
                i += 1
        programs.append(tuple(tiles))
    return Schedule("interleaved", tuple(programs), lead_rows=lead_rows)


def derived_interleaved_schedule(problem: MoEProblem, num_programs: int,
                                 lead_rows: int) -> Schedule:
    """Interleaved at lead D = ``lead_rows``, counted from the row or from the end of the
    Linear-2 tile's expert as ``leads_from_expert`` says for the problem's P_1 and P_2: the
    schedule ``FusedMoE``'s device tables build at that lead."""
    return interleaved_schedule(problem, num_programs, lead_rows,
                                expert_lead=leads_from_expert(problem.l1_n_blocks,
                                                              problem.l2_n_blocks))


class ScheduleError(ValueError):
    """A schedule that must not be launched; the message says which rule failed and where."""


def execution_order(problem: MoEProblem, schedule: Schedule) -> list[tuple[int, Tile]]:
    """Simulate every program resident at once and return the tiles in completion order.

    Each round, every program whose next tile is ready completes it (Linear-1 is always ready;
    Linear-2 of row ``p`` is ready once all ``P_1`` Linear-1 tiles of row ``p`` are done). Readiness
    only ever turns on, so the set of tiles finished at the fixpoint does not depend on the
    interleaving: this is Kahn's algorithm on the wait-for graph (list-order edges plus Linear-1 ->
    Linear-2 edges). All tiles finish iff that graph is acyclic, i.e. iff no interleaving of the
    resident programs can deadlock. Raises ScheduleError naming the stuck programs otherwise."""
    l1_done = [0] * problem.num_rows
    heads = [0] * schedule.num_programs
    order: list[tuple[int, Tile]] = []
    progressed = True
    while progressed:
        progressed = False
        for g, tiles in enumerate(schedule.programs):
            if heads[g] == len(tiles):
                continue
            t = tiles[heads[g]]
            if t.kind == L2 and l1_done[t.row_block] < problem.l1_n_blocks:
                continue
            if t.kind == L1:
                l1_done[t.row_block] += 1
            heads[g] += 1
            order.append((g, t))
            progressed = True
    stuck = [(g, heads[g], tiles[heads[g]]) for g, tiles in enumerate(schedule.programs)
             if heads[g] < len(tiles)]
    if stuck:
        detail = "; ".join(f"program {g} at position {i} waits with {t}" for g, i, t in stuck[:4])
        raise ScheduleError(f"{schedule.name}: deadlock with all programs resident "
                            f"({len(stuck)} programs stuck): {detail}")
    return order


def check_schedule(problem: MoEProblem, schedule: Schedule) -> None:
    """Raise ScheduleError unless the schedule is launchable:

    1. every tile of the problem appears exactly once, and nothing else does;
    2. dependencies are respected inside each program: no Linear-2 tile precedes a Linear-1 tile of
       its own row in the same list (the program would wait on itself);
    3. the lead D (``schedule.lead_rows``, where set) is honoured: whenever a program emits Linear-2
       of row p_2, its next Linear-1 tile is in a row p_1 >= p_2 + D (or it has none left);
    4. no deadlock with all programs resident (``execution_order``)."""
    seen: dict[Tile, int] = {}
    for g, tiles in enumerate(schedule.programs):
        for t in tiles:
            if t in seen:
                raise ScheduleError(f"{schedule.name}: {t} appears twice (programs {seen[t]} and {g})")
            seen[t] = g
    expected = problem.all_tiles()
    missing, extra = expected - seen.keys(), seen.keys() - expected
    if missing or extra:
        raise ScheduleError(f"{schedule.name}: {len(missing)} tiles missing (e.g. "
                            f"{sorted(missing)[:3]}), {len(extra)} unknown (e.g. {sorted(extra)[:3]})")
    for g, tiles in enumerate(schedule.programs):
        next_l1_row = math.inf  # row of the next Linear-1 tile after the current position
        l1_rows_after: set[int] = set()
        for i in range(len(tiles) - 1, -1, -1):
            t = tiles[i]
            if t.kind == L1:
                next_l1_row = t.row_block
                l1_rows_after.add(t.row_block)
                continue
            if t.row_block in l1_rows_after:
                raise ScheduleError(f"{schedule.name}: program {g} position {i}: {t} precedes a "
                                    f"Linear-1 tile of its own row in the same program")
            if schedule.lead_rows is not None and next_l1_row < t.row_block + schedule.lead_rows:
                raise ScheduleError(f"{schedule.name}: program {g} position {i}: {t} emitted with "
                                    f"Linear-1 at row {next_l1_row}, lead below D = {schedule.lead_rows}")
    execution_order(problem, schedule)


def tile_table(schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's int32 table ``[programs, max_tiles, 4]`` (unused entries zero) and the int32
    tile count of each program."""
    counts = np.array([len(p) for p in schedule.programs], dtype=np.int32)
    table = np.zeros((schedule.num_programs, max(1, int(counts.max(initial=0))), TILE_FIELDS),
                     dtype=np.int32)
    for g, tiles in enumerate(schedule.programs):
        if tiles:
            table[g, :len(tiles)] = np.asarray(tiles, dtype=np.int32)
    return table, counts
