"""``kernels/moe_program_tables.py``: each program's own row of the tile table from the router's
ids. On the CPU, its sm_90 builds fit the fused kernel's registers; on a Hopper GPU (skipped elsewhere),
every program's row and count equal the host reference (``table_reference.program_tiles``), and
the row maps the programs write together the layout's, for random, skewed, one-token and EP-rank
routings with ids out of range, everything poisoned first and left so past what is in use. Not
yet run on a GPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import triton

from tests.experiments.triton_testing import compile_sm90, ptxas_report
from tests.ops.moe import gluon_numpy
from xstage_lab.kernel_sources import load_kernel_module
from xstage_lab.ops.moe.schedules import WAVE_FILL
from xstage_lab.ops.moe.device_tables import TableBounds
from xstage_lab.ops.moe.routed import ROUTED_ARRIVALS
from xstage_lab.ops.moe.table_reference import host_tables, program_tiles
from xstage_lab.ops.moe.weights import quantize_rows_fp8

SIGNATURE = {"ids": "*i32", "n_arrivals": "*i32", "arrival_src": "*i32", "arrival_slot": "*i32",
             "tiles": "*i32", "num_tiles": "*i32", "row_src": "*i32", "row_slot": "*i32",
             "row_origin": "*i32", "error": "*i32", "x": "*bf16", "x_quant": "*fp8e4nv",
             "x_quant_scale": "*fp32", "NUM_EXPERTS": "i32", "CAPACITY": "i32", "TOP_K": "i32",
             "MAX_TILES": "i32", "G": "i32", "P1": "i32", "P2": "i32", "LEAD": "i32",
             "WAVE_MIN_L1": "i32", "HIDDEN": "i32", "RECEIVED": "constexpr", "WAVE": "constexpr",
             "A": "constexpr", "J": "constexpr", "QUANTIZE": "constexpr"}
# the activations the quantizing cases read: five scale blocks (not a multiple of the blocks
# quantized at a time)
HIDDEN = 640
POISON = -7
MAX_TILES = 512  # a program's row at 128 routed experts over 37 programs: up to 374
# the emulated launch's programs: Interleaved's as an H200's SMs (some deals of the Linear-1
# stream only show at 132), Expert-Wave's fewer, each holding more entries (several steps of
# CHUNK), in a fraction of the CPU time
EMULATED_PROGRAMS = {False: 132, True: 37}
BLOCK_M = 128
FUSED_REGISTERS = 168
CHUNK = 16  # entries a step, as the layer's builds take them: a row here up to seven steps
hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper (sm_90) GPU")


@pytest.mark.parametrize("wave", [False, True])
@pytest.mark.parametrize("arrivals", [32, 128])
def test_the_sm90_builds_fit_the_fused_kernels_registers(wave, arrivals):
    """Standalone, at most the registers the fused kernel's default warps hold before they
    specialize (65536 over its twelve warps: 168 a thread): its routed entry runs this first
    (``test_kernel_ws``: those builds without spills)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    names = list(SIGNATURE)
    constexprs = {(names.index(k),): v for k, v in dict(RECEIVED=False, WAVE=wave, A=arrivals,
                                                        J=CHUNK, QUANTIZE=True).items()}
    kernel = compile_sm90(GluonASTSource(load_kernel_module("moe_program_tables")
                                         .program_tables_kernel, SIGNATURE, constexprs),
                          num_warps=4)
    assert ptxas_report(kernel.asm["ptx"])["registers"] <= FUSED_REGISTERS


def _routings(rng, experts: int, top_k: int, capacity: int):
    """(ids, count) pairs: random picks of up to ``capacity // top_k`` tokens, one token, every
    token the same picks (skewed), and ids out of range among them (every pick of the first
    token: a row no arrival reads)."""
    tokens = capacity // top_k
    picks = [np.stack([rng.permutation(experts)[:top_k] for _ in range(t)])
             for t in (tokens, 1)]
    picks.append(np.tile(rng.permutation(experts)[:top_k], (tokens, 1)))
    bad = picks[0].copy()
    bad.flat[rng.choice(bad.size, 3, replace=False)] = [experts, -1, experts + 5]
    bad[0] = experts
    picks.append(bad)
    return [(p.reshape(-1), p.size) for p in picks]


def _row_maps(ids: np.ndarray, experts: int, src: np.ndarray, slot: np.ndarray,
              origin: np.ndarray) -> np.ndarray:
    """``[3, rows]``: each layout row's source, slot and row of ``x`` where every routed expert
    holds one row block (in expert order, its arrivals in arrival order, then padding: 0, -1,
    -1)."""
    routed = sorted({int(e) for e in ids if 0 <= e < experts})
    maps = np.tile(np.array([[0], [-1], [-1]]), (1, BLOCK_M * len(routed)))
    for b, e in enumerate(routed):
        arrivals = np.flatnonzero(ids == e)
        at = b * BLOCK_M + np.arange(len(arrivals))
        maps[:, at] = src[arrivals], slot[arrivals], origin[arrivals]
    return maps


def test_the_expected_row_maps_are_the_host_layouts():
    """``_row_maps`` (what the GPU test expects) against ``host_tables`` on an EP rank's rows of
    one row block an expert."""
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 12, 40)
    src = np.sort(rng.integers(0, 4, 40))
    slot = rng.permutation(80)[:40]
    bounds = TableBounds(capacity=40, num_experts=12, block_m=BLOCK_M, l1_n_blocks=2,
                         l2_n_blocks=3, num_programs=5, lead_rows=1, expert_lead=False)
    host = host_tables(bounds, torch.tensor(ids), torch.zeros(40, 8, dtype=torch.bfloat16),
                       arrival_src=torch.tensor(src), arrival_slot=torch.tensor(slot))
    want = np.stack((host.layout.row_src.numpy(), host.layout.row_slot.numpy(), host.row_origin))
    np.testing.assert_array_equal(_row_maps(ids, 12, src, slot, np.arange(40)), want)


CASES = [(16, 2, 44, 66), (16, 2, 44, 11), (64, 10, 8, 64), (256, 6, 24, 84), (8, 8, 2, 3)]


def _check_programs(run, programs: int, received: bool, wave: bool, experts: int, top_k: int,
                    p1: int, p2: int) -> None:
    """Each program's row and count, the row maps the programs wrote together (every row in
    use, none past), the error count and the rows of ``x`` quantized (each row an arrival
    reads, bitwise as ``weights.quantize_rows_fp8``; no other: an EP rank's up to 128, its
    bf16 rows into an FP8 layer), against the host
    reference, for each of ``_routings``; ``run(inputs, outputs, **scalars)`` launches the
    kernel over numpy arrays (the inputs' ``x`` bf16 values in fp32, the outputs poisoned,
    ``x_quant`` as bytes, filled in place)."""
    # up to the layer's bound: at EP = 1 eight tokens' picks at most
    capacity = ROUTED_ARRIVALS if received else min(8 * top_k, ROUTED_ARRIVALS)
    rng = np.random.default_rng(experts * 100 + top_k)
    for ids, count in _routings(rng, experts, top_k, capacity):
        lead = int(rng.integers(1, 5))
        schedule = "wave" if wave else "interleaved"
        routed = sorted({int(e) for e in ids[:count] if 0 <= e < experts})
        want = [program_tiles(schedule, g, routed, programs, p1, p2, lead)
                for g in range(programs)]
        # past the count an EP rank's ids, sources and slots are whatever the buffer held
        held = np.concatenate((ids, rng.integers(-3, experts + 3, capacity - len(ids))))
        n = count if received else capacity
        if not received:
            held = held[:count]
        src = rng.integers(0, 8, len(held)) if received else np.zeros(len(held), np.int64)
        slot = rng.permutation(4 * len(held))[:len(held)] if received else np.arange(len(held))
        origin = np.arange(len(held)) if received else np.arange(len(held)) // top_k
        maps = _row_maps(held[:count], experts, src, slot, origin)
        rows = len(held) // (1 if received else top_k)
        x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(count)).to(
            torch.bfloat16)
        out = {"tiles": np.full((programs, MAX_TILES, 4), POISON, np.int32),
               "num_tiles": np.full(programs, POISON, np.int32),
               "row_maps": np.full((3, BLOCK_M * 128 + BLOCK_M), POISON, np.int32),
               "error": np.zeros(1, np.int32),
               "x_quant": np.full((rows, HIDDEN), 0x7F, np.uint8),  # e4m3 NaN
               "x_quant_scale": np.full((rows, HIDDEN // 128), np.nan, np.float32)}
        inputs = {k: np.asarray(v, np.int32) for k, v in
                  (("ids", held), ("n_arrivals", [n]), ("arrival_src", src),
                   ("arrival_slot", slot))}
        inputs["x"] = x.float().numpy()
        run(inputs, out, NUM_EXPERTS=experts, CAPACITY=len(held), TOP_K=1 if received else top_k,
            MAX_TILES=MAX_TILES, G=programs, P1=p1, P2=p2, LEAD=lead,
            WAVE_MIN_L1=WAVE_FILL * programs, HIDDEN=HIDDEN, RECEIVED=received, WAVE=wave,
            A=max(32, triton.next_power_of_2(len(held))), J=CHUNK, QUANTIZE=True)
        np.testing.assert_array_equal(out["num_tiles"], [len(w) for w in want])
        for g, w in enumerate(want):
            np.testing.assert_array_equal(out["tiles"][g, :len(w)], w, err_msg=f"program {g}")
            assert (out["tiles"][g, len(w):] == POISON).all(), f"program {g} wrote past its count"
        got_maps = out["row_maps"]
        np.testing.assert_array_equal(got_maps[:, :maps.shape[1]], maps)
        assert (got_maps[:, maps.shape[1]:] == POISON).all(), "rows written past those in use"
        live = ids[:count]
        assert int(out["error"][0]) == int(np.sum((live < 0) | (live >= experts)))
        read = np.zeros(rows, bool)
        read[origin[:count][(live >= 0) & (live < experts)]] = True
        xq, xs = quantize_rows_fp8(x[read])
        np.testing.assert_array_equal(out["x_quant"][read], xq.view(torch.uint8).numpy())
        np.testing.assert_array_equal(out["x_quant_scale"][read], xs.numpy())
        assert (out["x_quant"][~read] == 0x7F).all(), "a row no arrival reads quantized"


@pytest.mark.parametrize("received", [False, True])
@pytest.mark.parametrize("wave", [False, True])
@pytest.mark.parametrize("experts, top_k, p1, p2", CASES)
def test_every_programs_row_is_the_references_in_numpy(received, wave, experts, top_k, p1, p2):
    """The kernel's arithmetic on the CPU: its functions over ``gluon_numpy``'s ``gl``, the
    programs of a launch run one after another."""
    kernel = gluon_numpy.load_kernels("moe_program_tables").program_tables_kernel

    def run(inputs, out, **scalars):
        pointers = {k: gluon_numpy.Pointer(v.reshape(-1)) for k, v in {**inputs, **out}.items()}
        maps = out["row_maps"].reshape(-1)
        stride = out["row_maps"].shape[1]
        gluon_numpy.launch(kernel, scalars["G"], pointers["ids"], pointers["n_arrivals"],
                           pointers["arrival_src"], pointers["arrival_slot"], pointers["tiles"],
                           pointers["num_tiles"], gluon_numpy.Pointer(maps),
                           gluon_numpy.Pointer(maps, stride),
                           gluon_numpy.Pointer(maps, 2 * stride), pointers["error"],
                           pointers["x"], pointers["x_quant"], pointers["x_quant_scale"],
                           **scalars)

    _check_programs(run, EMULATED_PROGRAMS[wave], received, wave, experts, top_k, p1, p2)


@hopper
@pytest.mark.parametrize("received", [False, True])
@pytest.mark.parametrize("wave", [False, True])
@pytest.mark.parametrize("experts, top_k, p1, p2", CASES)
def test_every_programs_row_is_the_references(received, wave, experts, top_k, p1, p2):
    """The kernel on the GPU, a program per SM."""
    kernel = load_kernel_module("moe_program_tables").program_tables_kernel
    dev = torch.device("cuda")

    def run(inputs, out, **scalars):
        held = {k: torch.from_numpy(v).to(dev) for k, v in {**inputs, **out}.items()}
        maps = held["row_maps"]
        kernel[(scalars["G"],)](held["ids"], held["n_arrivals"], held["arrival_src"],
                                held["arrival_slot"], held["tiles"], held["num_tiles"],
                                maps[0], maps[1], maps[2], held["error"],
                                held["x"].to(torch.bfloat16),
                                held["x_quant"].view(torch.float8_e4m3fn),
                                held["x_quant_scale"], **scalars, num_warps=4)
        for k in out:
            out[k][...] = held[k].cpu().numpy()

    _check_programs(run, torch.cuda.get_device_properties(dev).multi_processor_count, received,
                    wave, experts, top_k, p1, p2)
