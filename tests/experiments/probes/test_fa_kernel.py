"""The kernel-version probe's CPU side (``experiments/probes/fa_kernel.py``): arguments checked
before any CUDA work, a kernel file of another commit loaded as a module, its digest recorded."""
import pytest

from xstage_lab.experiments import harness
from xstage_lab.experiments.probes import fa_kernel as fk
from xstage_lab.experiments.probes.variants import file_digests


def parse(argv):
    return harness.parse(fk.EXPERIMENT, ["--root", "records", *argv])


def test_shapes_and_variants(tmp_path):
    old = tmp_path / "gluon_ws_99d33b2.py"
    old.write_text("MARK = 3\n")
    args = parse(["--variant", f"gluon_ws_99d33b2={old}", "--shapes", "64:12:16384"])
    assert args.shapes == [(64, 12, 16384)] and args.variant == {"gluon_ws_99d33b2": old}
    kernels = parse(["--variant", f"v={old}"])
    builds = parse(["--variant", f"v={old}", "--builds"])
    # each comparison's defaults are its record's
    assert (kernels.shapes, kernels.seed) == (fk.DEFAULT_SHAPES[False], 7)
    assert (builds.shapes, builds.seed) == ([(128, 12, 16384), (128, 12, 32768),
                                             (128, 12, 65536), (64, 12, 16384)], 5)
    assert fk.load_variant("gluon_ws_99d33b2", old).MARK == 3
    assert file_digests(args.variant)["gluon_ws_99d33b2"].startswith("gluon_ws_99d33b2.py sha256:")


def test_a_variant_imports_the_committed_kernels_siblings(tmp_path):
    """A copy of today's kernel imports its siblings relatively, as the committed one does."""
    from xstage_lab.kernel_sources import KERNELS_PACKAGE, load_kernel_module

    copy = tmp_path / "gluon_ws_copy.py"
    copy.write_text("from .flash_attention import TRACE_FIELDS\nMARK = 4\n")
    module = fk.load_variant("gluon_ws_copy", copy)
    assert module.MARK == 4 and module.__name__ == f"{KERNELS_PACKAGE}.gluon_ws_copy"
    assert module.TRACE_FIELDS is load_kernel_module("flash_attention").TRACE_FIELDS


@pytest.mark.parametrize("argv", [[], ["--variant", "gluon_ws=x.py"], ["--shapes", "96:12:1024"],
                                  ["--shapes", "128:12"], ["--trials", "0"]])
def test_bad_arguments_exit_with_code_2(argv, tmp_path):
    old = tmp_path / "v.py"
    old.write_text("")
    extra = [] if argv[:1] == ["--variant"] or not argv else ["--variant", f"v={old}"]
    with pytest.raises(SystemExit) as e:
        parse(argv + extra)
    assert e.value.code == 2


@pytest.fixture
def cpu_stand_ins(monkeypatch):
    """The launchers, the checks and the timing replaced on the CPU: what is left is the probe's
    own logic (checks before timing, the rows it makes)."""
    import torch

    from xstage_lab import dist_timing
    from xstage_lab.experiments.attention import cases
    from xstage_lab.ops import attention as ulysses

    def flash_attention(q, k, v, *, out=None, config=None):
        return q.clone() if out is None else out.copy_(q)

    monkeypatch.setattr(ulysses, "flash_attention", flash_attention)
    monkeypatch.setattr(ulysses, "reference_attention", lambda q, k, v: q.float())
    monkeypatch.setattr(ulysses, "sdpa_cudnn", lambda q, k, v: q)
    monkeypatch.setattr(ulysses, "fused_attention_a2a", lambda *a, **kw: None)
    monkeypatch.setattr(cases, "local_destination", lambda *a: (None, None))
    monkeypatch.setattr(cases, "remote_epilogue_checks",
                        lambda *a: {"remote_bitwise_fa": True, "remote_fenced_bitwise_fa": True})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def time_methods(methods, trials, **kw):
        for fn in methods.values():
            fn()
        return {n: dict(median_us=10.0 + i, p25_us=9.0, p75_us=11.0, trials_us=[10.0 + i] * trials,
                        sm_clock_mhz=[1980.0] * trials) for i, n in enumerate(methods)}

    monkeypatch.setattr(dist_timing, "time_methods", time_methods)
    q = torch.randn(256, 2, 64).to(torch.bfloat16)
    return q


def _args(builds):
    return parse(["--variant", f"old={__file__}", "--trials", "3",
                          *(["--builds"] if builds else [])])


def test_kernel_rows_check_then_time(cpu_stand_ins):
    q = cpu_stand_ins
    rows = fk.kernel_rows(_args(False), ["gluon_ws", "old"], lambda n, fn: fn(), q, q, q)
    assert [r["method"] for r in rows] == ["gluon_ws", "old", "cudnn"]
    assert rows[0]["bitwise_equal_old"] is True and rows[0]["rel_err_gluon_ws"] < 1e-2
    assert rows[2]["over_cudnn_paired"] == 1.0


def test_build_rows_pair_each_build_with_its_local(cpu_stand_ins):
    q = cpu_stand_ins
    rows = fk.build_rows(_args(True), ["gluon_ws", "old"], lambda n, fn: fn(), q, q, q)
    assert [(r["kernel"], r["build"]) for r in rows] == [
        (k, b) for k in ("gluon_ws", "old") for b in ("local", "remote", "fenced")]
    assert rows[0]["minus_local_paired_pct"] == 0.0 and rows[1]["minus_local_paired_pct"] == 10.0
    assert all(r["remote_bitwise_fa"] for r in rows)


def test_a_shape_per_point_in_the_given_order():
    [sweep] = fk.EXPERIMENT.sweeps(parse(["--variant", f"v={__file__}", "--shapes", "128:12:8192",
                                          "64:6:1024"]))
    assert [(p["head_dim"], p["heads"], p["M"]) for p in sweep.points()] == [(128, 12, 8192),
                                                                          (64, 6, 1024)]
    assert sweep.order() == [(0, 0), (0, 1)] and sweep.warmup == 0


def test_probe_through_the_harness(cpu_stand_ins, monkeypatch, tmp_path):
    """The stand-ins on the CPU, the inputs made on the CPU: a record with the rows of every
    shape, tagged with the shape, and the comparison's parameters."""
    import torch

    from tests.experiments.remote_store.test_characterization import fake_machine
    from xstage_lab.experiments.remote_store import characterization
    from xstage_lab.records import read_record

    randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *shape, device, dtype: randn(*shape).to(dtype))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    fake_machine(monkeypatch, characterization, 1)
    path = harness.main(fk.EXPERIMENT, ["--root", str(tmp_path), "--variant", f"old={__file__}",
                                        "--shapes", "64:2:256", "128:1:128", "--trials", "3",
                                        "--no-progress"])
    rec = read_record(path)
    assert path.parent == tmp_path / "fa_kernel_probe" / "h200-x1"
    assert rec.table["method"].tolist() == ["gluon_ws", "old", "cudnn"] * 2
    assert rec.table["M"].tolist() == [256] * 3 + [128] * 3 and (rec.table["point"] ==
                                                                 [0] * 3 + [1] * 3).all()
    assert rec.table["bitwise_equal_old"].all()
    assert rec.params["shapes"] == [[64, 2, 256], [128, 1, 128]]
    assert rec.params["variants"] == ["gluon_ws", "old"] and not rec.params["builds"]
