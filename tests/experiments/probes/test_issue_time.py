"""The issue-time probe's CPU side (``experiments/probes/issue_time.py``): arguments checked
before any CUDA work, its sweep, the local points the benches validate."""
import pytest

from tests.experiments.remote_store.test_characterization import make_inv
from xstage_lab.experiments import harness
from xstage_lab.experiments.probes import issue_time as it


def parse(argv):
    return harness.parse(it.EXPERIMENT, ["--root", "records", *argv])
from xstage_lab.ops.remote_store.burst import validate_point
from xstage_lab.ops.remote_store.operations import validate_ops_point


def test_defaults_are_the_records_points():
    args = parse([])
    assert args.burst_kib == [4, 8, 16, 32, 64] and args.repeats == 11 and args.variant == {}


def test_a_patched_kernel_is_a_named_cu_file(tmp_path):
    cu = tmp_path / "patched.cu"
    cu.write_text("// patched\n")
    assert parse(["--variant", f"asm_store={cu}"]).variant == {"asm_store": cu}
    for bad in ([f"x={tmp_path / 'missing.cu'}"], [f"1x={cu}"], [f"x={tmp_path}"],
                [f"a={cu}", f"a={cu}"]):
        with pytest.raises(SystemExit) as e:
            parse([a for v in bad for a in ("--variant", v)])
        assert e.value.code == 2
    for bad in (["--repeats", "0"], ["--burst-kib", "4", "4"], ["--burst-kib", "0"]):
        with pytest.raises(SystemExit) as e:
            parse(bad)
        assert e.value.code == 2


def test_sweep_is_every_burst_size_by_variant_rotated_per_round(tmp_path):
    cu = tmp_path / "patched.cu"
    cu.write_text("// patched\n")
    args = parse(["--burst-kib", "4", "8", "--repeats", "3", "--variant", f"asm={cu}"])
    [sweep] = it.EXPERIMENT.sweeps(args)
    assert sweep.warmup == 0 and sweep.repeats == 3
    variants = ["burst_gap", "burst_gap_asm", "ops_store16"]
    assert [(p["burst_bytes"], p["variant"]) for p in sweep.points()] == [
        (b, v) for b in (4096, 8192) for v in variants]
    order = sweep.order()
    # every point once per round, and no round starts where the one before it started
    assert sorted(order) == [(r, i) for r in range(3) for i in range(6)]
    firsts = [order[r * 6][1] for r in range(3)]
    assert len(set(firsts)) == 3


def test_local_points_pass_the_benchs_validation():
    inv = make_inv(1)
    K = inv.gpus[0].sm_count
    for mode in ("isolated", "fenced"):
        validate_point(it.local_point(K, 64 * 1024, mode), inv)
    validate_ops_point(dict(it.local_point(K, 64 * 1024), routes="0>0", op="store16"), inv)


def test_probe_through_the_harness_checks_every_variant_before_timing(monkeypatch, tmp_path):
    """Benches that log their launches: one launch of every variant and the fenced point come
    before the first timed launch; the record keeps the steady bursts, tagged by variant."""
    import sys
    import types

    import pandas as pd

    from tests.experiments.remote_store.test_characterization import fake_machine
    from xstage_lab.experiments.remote_store import characterization
    from xstage_lab.ops.remote_store import burst, operations
    from xstage_lab.records import read_record

    launches = []

    class LogBench:
        def __init__(self, *a):
            self.inv = make_inv(1)

        def validate(self, p):
            (validate_ops_point if "op" in p else validate_point)(p, self.inv)

        def measure(self, p):
            launches.append(p)
            return pd.DataFrame({"warmup": [True, False], "t_iss_us": [9.0, 1.0 + len(launches)]})

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace())
    monkeypatch.setattr(burst, "RemoteStoreBench", LogBench)
    monkeypatch.setattr(operations, "RemoteOpsBench", LogBench)
    fake_machine(monkeypatch, characterization, 1)
    path = harness.main(it.EXPERIMENT, ["--root", str(tmp_path), "--burst-kib", "4", "8",
                                        "--repeats", "2", "--no-progress"])
    assert [(p["mode"], "op" in p) for p in launches[:3]] == [("isolated", False),
                                                             ("isolated", True),
                                                             ("fenced", False)]
    assert len(launches) == 3 + 2 * 2 * 2
    rec = read_record(path)
    assert path.parent == tmp_path / "issue_time_probe" / "h200-x1"
    assert len(rec.table) == 8 and not rec.table["warmup"].any()
    assert set(rec.table["variant"]) == {"burst_gap", "ops_store16"}
    assert rec.params["variants"] == ["burst_gap", "ops_store16"] and rec.params["producers"] == 132
