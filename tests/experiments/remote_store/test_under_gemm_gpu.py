"""A GEMM beside a full host X-Stage (``ops.remote_store.under_gemm``) on a GPU that maps host
memory (skipped elsewhere: CI has no GPU).

Run on the device machine: ``python -m pytest -q tests/experiments/remote_store/test_under_gemm_gpu.py``.
The GEMM alone, beside local stores and beside host stores from half the SMs, each launched with
the GEMM's output poisoned and checked against the float32 reference, the stores checked as the
under-load probe's (every stored vector read back on the CPU), enough matmuls inside the store
window and the rates in range; a wrong reference and a window too short for the matmuls are each
caught.
"""
from __future__ import annotations

import pytest

pytest.importorskip("cupy")
torch = pytest.importorskip("torch")

from xstage_lab.experiments.remote_store.characterization import HOST  # noqa: E402
from xstage_lab.ops.remote_store.under_gemm import GemmBesideStores, GemmSettings  # noqa: E402
from xstage_lab.platform import inventory  # noqa: E402

INV = inventory()
pytestmark = pytest.mark.skipif(
    not INV.gpus or INV.gpus[0].compute_capability.split(".")[0] != "9",
    reason="needs an sm_90 GPU")


@pytest.fixture(scope="module")
def probe():
    # a shorter window than a sweep's (20 matmuls, 3 inside it): the checks are the same
    return GemmBesideStores(GemmSettings(window_us=100_000.0, gemms=20, min_inside=3), INV)


def point(stores: str, producers: int, gemm: str = "linear1") -> dict:
    return dict(mode="under_gemm", gemm=gemm, producers=producers, stores=stores, src=0,
                dst=HOST, gap_us=0.0)


@pytest.mark.parametrize("gemm", ["linear1", "linear2"])
def test_the_gemm_alone_and_beside_stores_passes_its_checks_and_measures_in_range(probe, gemm):
    """Both shapes: the sweep's first run on an H200 passed this test with ``linear1`` alone and
    failed the GEMM check at its first ``linear2`` point; with the GEMM's stream made to wait for
    its operands, both passed there."""
    sms = INV.gpus[0].sm_count
    k = sms // 2
    alone = probe.measure(point("none", 0, gemm), check_stores=True)
    local = probe.measure(point("local", k, gemm), check_stores=True)
    host = probe.measure(point("host", k, gemm), check_stores=True)
    assert alone["gemm_sms"] == sms and alone["gemms_inside"] == 20
    assert alone["gemm_tflops"] > 300.0                  # bf16 cuBLAS on an H200: ~600-800
    for rows in (local, host):
        assert rows["gemm_sms"] == sms - k and rows["gemms_inside"] >= 3
        assert rows["window_us"] == pytest.approx(100_000.0, rel=0.1)
    # the store CTAs hold their SMs: the GEMM on half of them is slower than on all
    assert local["gemm_tflops"] < 0.85 * alone["gemm_tflops"]
    assert host["gemm_tflops"] > 1.0                     # progress, whatever the slowdown
    assert 5.0 < host["store_rate_GBps"] < 200.0         # PCIe: tens of GB/s
    assert local["store_rate_GBps"] > 200.0              # HBM


def test_a_wrong_result_and_a_window_too_short_are_caught(probe):
    a, b, c, ref, scale = probe._gemm("linear1", 0)
    probe._operands["linear1"] = (a, b, c, ref * 1.05, scale)
    try:
        with pytest.raises(RuntimeError, match="differs from its float32 reference"):
            probe.measure(point("none", 0))
    finally:
        probe._operands["linear1"] = (a, b, c, ref, scale)
    # a 0.5 ms window holds at most three of these matmuls
    short = GemmBesideStores(GemmSettings(window_us=500.0, gemms=20, min_inside=5), INV)
    with pytest.raises(RuntimeError, match="ran inside the store window"):
        short.measure(point("host", INV.gpus[0].sm_count // 8))
