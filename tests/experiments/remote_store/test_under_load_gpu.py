"""The under-load probe (``kernels/host_store_load.cu``) on a GPU that maps host memory (skipped
elsewhere: CI has no GPU).

Run on the device machine: ``python -m pytest -q tests/experiments/remote_store/test_under_load_gpu.py``.
Every case of one split and the shared layout launches with its store destination poisoned,
passes the checks against the CPU's references (stamps of exactly the working warps, every load
lane's sum, every stored vector read back on the CPU) and measures rates in range; a vector
changed after the launch, a wrong iteration count and a wrong load sum are each caught.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from xstage_lab.experiments.remote_store.characterization import HOST  # noqa: E402
from xstage_lab.ops.remote_store.under_load import HostLoadProbe, LoadSettings  # noqa: E402
from xstage_lab.platform import inventory  # noqa: E402

INV = inventory()
pytestmark = pytest.mark.skipif(
    not INV.gpus or INV.gpus[0].compute_capability.split(".")[0] != "9",
    reason="needs an sm_90 GPU")

CASES = [("host", 1), ("host", 0), ("local", 1), ("none", 1)]


@pytest.fixture(scope="module")
def probe():
    # a shorter window than a sweep's: the checks are the same
    return HostLoadProbe(LoadSettings(warm_us=300.0, window_us=1000.0), INV)


def point(layout: str, stores: str, load: int) -> dict:
    sms = INV.gpus[0].sm_count
    return dict(mode="under_load", layout=layout, producers=sms // 8 if layout == "split" else sms,
                stores=stores, load=load, src=0, dst=HOST, gap_us=0.0)


@pytest.mark.parametrize("layout", ["split", "shared"])
@pytest.mark.parametrize("stores,load", CASES)
def test_every_case_passes_its_checks_and_measures_in_range(probe, layout, stores, load):
    rows = probe.measure(point(layout, stores, load), check_stores=True)
    # a window ends at the first iteration past it: under backpressure a store warp's iteration
    # takes tens of µs
    assert rows["window_us"] == pytest.approx(1000.0, rel=0.1)
    if stores == "host":
        assert 5.0 < rows["store_rate_GBps"] < 200.0      # PCIe: tens of GB/s
    if stores == "local":
        assert rows["store_rate_GBps"] > 200.0             # HBM
    if load and stores == "host":
        # backpressured host stores slow the loads by up to 36x where they share the SMs (one
        # H200, 2026-12-02: 21 GB/s beside host stores, 766 beside local ones): progress only
        assert rows["load_rate_GBps"] > 1.0
    elif load:
        assert rows["load_rate_GBps"] > 300.0
    else:
        assert np.isnan(rows["load_rate_GBps"]) and rows["load_warps"] == 0


def test_a_wrong_store_count_or_sum_is_caught(probe):
    run = probe.launch(point("split", "host", 1))
    probe.check(run, check_stores=True)
    words = probe._host.words()
    keep = int(words[5])
    words[5] ^= 1  # one word of the first store warp's region, changed after the launch
    with pytest.raises(RuntimeError, match="read back on the CPU: 1 16-byte"):
        probe.check(run, check_stores=True)
    words[5] = keep
    stamps = run.stamps.copy()
    first_store = np.flatnonzero(run.store_warps)[0]
    stamps[first_store, 3] += 1  # the warp claims one iteration more than it stored
    with pytest.raises(RuntimeError, match="read back on the CPU"):
        probe.check(dataclasses.replace(run, stamps=stamps), check_stores=True)
    sums = run.sums.copy()
    sums[np.flatnonzero(run.load_warps)[0], 3] += 1
    with pytest.raises(RuntimeError, match="load sums"):
        probe.check(dataclasses.replace(run, sums=sums), check_stores=False)
    idle = run.stamps.copy()
    idle[np.flatnonzero(run.load_warps)[-1]] = np.uint64(2**64 - 1)  # a load warp left nothing
    with pytest.raises(RuntimeError, match="stamps"):
        probe.check(dataclasses.replace(run, stamps=idle), check_stores=False)
