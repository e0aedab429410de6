"""The issue-time probe's CPU side (``experiments/probes/issue_time.py``): arguments checked
before any CUDA work, the rotated schedule, the local points the benches validate."""
import pytest

from tests.experiments.remote_store.test_characterization import make_inv
from xstage_lab.experiments.probes import issue_time as it
from xstage_lab.experiments.remote_store.characterization import validate_point
from xstage_lab.experiments.remote_store.ops import validate_ops_point


def test_defaults_are_the_records_points():
    args = it.parse_args([])
    assert args.burst_kib == [4, 8, 16, 32, 64] and args.repeats == 11 and args.variant == {}


def test_a_patched_kernel_is_a_named_cu_file(tmp_path):
    cu = tmp_path / "patched.cu"
    cu.write_text("// patched\n")
    assert it.parse_args(["--variant", f"asm_store={cu}"]).variant == {"asm_store": cu}
    for bad in ([f"x={tmp_path / 'missing.cu'}"], [f"1x={cu}"], [f"x={tmp_path}"],
                [f"a={cu}", f"a={cu}"]):
        with pytest.raises(SystemExit) as e:
            it.parse_args([a for v in bad for a in ("--variant", v)])
        assert e.value.code == 2
    for bad in (["--repeats", "0"], ["--burst-kib", "4", "4"], ["--burst-kib", "0"]):
        with pytest.raises(SystemExit):
            it.parse_args(bad)


def test_schedule_rotates_the_variants_per_repeat():
    order = list(it.schedule(["a", "b", "c"], [4096, 8192], 3))
    assert len(order) == 3 * 2 * 3
    assert [v for rep, B, i, v in order if B == 4096 and rep == 0] == ["a", "b", "c"]
    assert [v for rep, B, i, v in order if B == 4096 and rep == 1] == ["b", "c", "a"]
    # every variant at every position once over as many repeats as variants
    assert {(i, v) for rep, B, i, v in order if B == 8192} == {(i, v) for i in range(3)
                                                               for v in "abc"}


def test_local_points_pass_the_benchs_validation():
    inv = make_inv(1)
    K = inv.gpus[0].sm_count
    for mode in ("isolated", "fenced"):
        validate_point(it.local_point(K, 64 * 1024, mode), inv)
    validate_ops_point(dict(it.local_point(K, 64 * 1024), routes="0>0", op="store16"), inv)
