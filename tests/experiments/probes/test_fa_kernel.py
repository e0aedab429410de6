"""The kernel-version probe's CPU side (``experiments/probes/fa_kernel.py``): arguments checked
before any CUDA work, a kernel file of another commit loaded as a module, its digest recorded."""
import pytest

from xstage_lab.experiments.probes import fa_kernel as fk
from xstage_lab.experiments.probes.variants import file_digests


def test_shapes_and_variants(tmp_path):
    old = tmp_path / "gluon_ws_99d33b2.py"
    old.write_text("MARK = 3\n")
    args = fk.parse_args(["--variant", f"gluon_ws_99d33b2={old}", "--shapes", "64:12:16384"])
    assert args.shapes == [(64, 12, 16384)] and args.variant == {"gluon_ws_99d33b2": old}
    assert fk.parse_args(["--variant", f"v={old}"]).shapes == fk.DEFAULT_SHAPES
    assert fk.load_variant("gluon_ws_99d33b2", old).MARK == 3
    assert file_digests(args.variant)["gluon_ws_99d33b2"].startswith("gluon_ws_99d33b2.py sha256:")


@pytest.mark.parametrize("argv", [[], ["--variant", "gluon_ws=x.py"], ["--shapes", "96:12:1024"],
                                  ["--shapes", "128:12"], ["--trials", "0"]])
def test_bad_arguments_exit_with_code_2(argv, tmp_path):
    old = tmp_path / "v.py"
    old.write_text("")
    extra = [] if argv[:1] == ["--variant"] or not argv else ["--variant", f"v={old}"]
    with pytest.raises(SystemExit) as e:
        fk.parse_args(argv + extra)
    assert e.value.code == 2
