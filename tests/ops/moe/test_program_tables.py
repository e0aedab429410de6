"""``kernels/moe_program_tables.py``: each program's own row of the tile table from the router's
ids. On the CPU, its sm_90 builds compile without spills; on a Hopper GPU (skipped elsewhere),
every program's row and count equal the host reference (``table_reference.program_tiles``) for
random, skewed, one-token and EP-rank routings with ids out of range, the rows poisoned first and
left so past each count. Not yet run on a GPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import triton

from tests.experiments.triton_testing import compile_sm90, ptxas_report
from xstage_lab.kernel_sources import load_kernel_module
from xstage_lab.ops.moe.schedules import WAVE_FILL
from xstage_lab.ops.moe.table_reference import program_tiles

SIGNATURE = {"ids": "*i32", "n_arrivals": "*i32", "tiles": "*i32", "num_tiles": "*i32",
             "error": "*i32", "NUM_EXPERTS": "i32", "CAPACITY": "i32", "MAX_TILES": "i32",
             "G": "i32", "P1": "i32", "P2": "i32", "LEAD": "i32", "WAVE_MIN_L1": "i32",
             "RECEIVED": "constexpr", "WAVE": "constexpr", "A": "constexpr", "J": "constexpr"}
POISON = -7
MAX_TILES = 256
CHUNK = 16  # entries a step: a program's rows here take up to seven steps
hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a Hopper (sm_90) GPU")


@pytest.mark.parametrize("wave", [False, True])
@pytest.mark.parametrize("arrivals", [16, 128])
def test_the_sm90_builds_compile_without_spills(wave, arrivals):
    from triton.experimental.gluon._runtime import GluonASTSource

    names = list(SIGNATURE)
    constexprs = {(names.index(k),): v for k, v in dict(RECEIVED=True, WAVE=wave, A=arrivals,
                                                        J=32).items()}
    kernel = compile_sm90(GluonASTSource(load_kernel_module("moe_program_tables")
                                         .program_tables_kernel, SIGNATURE, constexprs),
                          num_warps=4)
    report = ptxas_report(kernel.asm["ptx"])
    assert report["spill_store_bytes"] == 0 and report["spill_load_bytes"] == 0, report


def _routings(rng, experts: int, top_k: int, capacity: int):
    """(ids, count) pairs: random picks of up to ``capacity // top_k`` tokens, one token, every
    token the same picks (skewed), and ids out of range among them."""
    tokens = capacity // top_k
    picks = [np.stack([rng.permutation(experts)[:top_k] for _ in range(t)])
             for t in (tokens, 1)]
    picks.append(np.tile(rng.permutation(experts)[:top_k], (tokens, 1)))
    bad = picks[0].copy()
    bad.flat[rng.choice(bad.size, 3, replace=False)] = [experts, -1, experts + 5]
    picks.append(bad)
    return [(p.reshape(-1), p.size) for p in picks]


@hopper
@pytest.mark.parametrize("received", [False, True])
@pytest.mark.parametrize("wave", [False, True])
@pytest.mark.parametrize("experts, top_k, p1, p2", [(16, 2, 44, 66), (64, 10, 8, 64),
                                                    (256, 6, 24, 84), (8, 8, 2, 3)])
def test_every_programs_row_is_the_references(received, wave, experts, top_k, p1, p2):
    kernel = load_kernel_module("moe_program_tables").program_tables_kernel
    dev = torch.device("cuda")
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    capacity = 128 if received else 8 * top_k  # an EP rank's bound: eight ranks' rows
    rng = np.random.default_rng(experts * 100 + top_k)
    for ids, count in _routings(rng, experts, top_k, min(capacity, 128)):
        lead = int(rng.integers(1, 5))
        schedule = "wave" if wave else "interleaved"
        routed = sorted({int(e) for e in ids[:count] if 0 <= e < experts})
        want = [program_tiles(schedule, g, routed, programs, p1, p2, lead)
                for g in range(programs)]
        # past the count an EP rank's ids are whatever the buffer held
        held = np.concatenate((ids, rng.integers(-3, experts + 3, capacity - len(ids))))
        n = count if received else capacity
        if not received:
            held = held[:count]
        tiles = torch.full((programs, MAX_TILES, 4), POISON, dtype=torch.int32, device=dev)
        num_tiles = torch.full((programs,), POISON, dtype=torch.int32, device=dev)
        error = torch.zeros(1, dtype=torch.int32, device=dev)
        kernel[(programs,)](torch.tensor(held, dtype=torch.int32, device=dev),
                            torch.tensor([n], dtype=torch.int32, device=dev), tiles, num_tiles,
                            error, experts, len(held), MAX_TILES, programs, p1, p2, lead,
                            WAVE_FILL * programs, RECEIVED=received, WAVE=wave,
                            A=triton.next_power_of_2(len(held)),
                            J=CHUNK, num_warps=4)
        got_tiles, got_counts = tiles.cpu().numpy(), num_tiles.cpu().numpy()
        np.testing.assert_array_equal(got_counts, [len(w) for w in want])
        for g, w in enumerate(want):
            np.testing.assert_array_equal(got_tiles[g, :len(w)], w, err_msg=f"program {g}")
            assert (got_tiles[g, len(w):] == POISON).all(), f"program {g} wrote past its count"
        live = ids[:count]
        assert int(error.item()) == int(np.sum((live < 0) | (live >= experts)))
