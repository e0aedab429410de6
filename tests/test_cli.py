"""The command line refuses bad combinations before any work."""
import subprocess
import sys


def test_calibrate_needs_the_calibration_sweeps():
    out = subprocess.run([sys.executable, "-m", "xstage_lab", "characterize", "--only", "gap",
                          "--calibrate"], capture_output=True, text=True)
    assert out.returncode != 0 and "--calibrate needs the sweeps" in out.stderr


def test_import_bench_names_only_known_experiments(tmp_path):
    out = subprocess.run([sys.executable, "-m", "xstage_lab", "import-bench", str(tmp_path / "x.json"),
                          "--experiment", "nonsense"], capture_output=True, text=True)
    assert out.returncode != 0 and "invalid choice" in out.stderr


def test_measure_all_refuses_without_two_peer_gpus():
    out = subprocess.run([sys.executable, "-m", "xstage_lab", "measure-all"], capture_output=True,
                         text=True)
    assert out.returncode != 0 and "needs two peer-capable GPUs" in out.stderr


def test_measure_all_names_only_known_measurements():
    out = subprocess.run([sys.executable, "-m", "xstage_lab", "measure-all", "--only", "nonsense"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "invalid choice" in out.stderr
