"""The command line refuses bad combinations before any work."""
import subprocess
import sys
from pathlib import Path

import pytest

from xstage_lab.__main__ import build_parser, main


def test_calibrate_needs_the_calibration_sweeps():
    out = subprocess.run([sys.executable, "-m", "xstage_lab", "characterize", "--only", "gap",
                          "--calibrate"], capture_output=True, text=True)
    assert out.returncode != 0 and "--calibrate needs the sweeps" in out.stderr


def test_import_bench_names_only_known_experiments(tmp_path):
    out = subprocess.run([sys.executable, "-m", "xstage_lab", "import-bench", str(tmp_path / "x.json"),
                          "--experiment", "nonsense"], capture_output=True, text=True)
    assert out.returncode != 0 and "invalid choice" in out.stderr


def test_measure_all_refuses_without_a_gpu():
    out = subprocess.run([sys.executable, "-m", "xstage_lab", "measure-all"], capture_output=True,
                         text=True)
    assert out.returncode != 0 and "measure-all needs a GPU" in out.stderr


def test_measure_all_names_only_known_measurements():
    out = subprocess.run([sys.executable, "-m", "xstage_lab", "measure-all", "--only", "nonsense"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "invalid choice" in out.stderr


# Issue 20: each user mistake is one line on stderr and exit code 2, never a traceback.

def _one_line(returncode: int, stderr: str) -> str:
    assert returncode == 2, stderr
    assert "Traceback" not in stderr and len(stderr.splitlines()) == 1, stderr
    return stderr


@pytest.mark.parametrize("argv,says", [
    (["reproduce", "--only", "nosuch"], "no notebook named ['nosuch']"),
    (["calibrate", "/nonexistent/record.parquet"], "no such file"),
    (["characterize", "--src", "0", "--dst", "0"], "--src and --dst must be two GPUs"),
    (["characterize", "--repeats", "-1"], "at least 1"),
    (["visibility", "--src", "1", "--dst", "1"], "--src and --dst must be two GPUs"),
    (["summary", "--root", "/nonexistent/records"], "no records folder"),
    (["characterize", "--only", "gap", "--calibrate"], "--calibrate needs the sweeps"),
    (["transcode", "20261201T092848Z-d67496daf8", "--commit", "HEAD"],
     "records are named experiment/platform/record_id"),
    (["transcode", "remote_store/h200-x2/20990101T000000Z-0123456789", "--commit", "HEAD"],
     "no record remote_store/h200-x2/20990101T000000Z-0123456789 under"),
])
def test_a_mistake_is_one_line_and_exit_code_2(argv, says):
    out = subprocess.run([sys.executable, "-m", "xstage_lab", *argv], capture_output=True,
                         text=True)
    assert says in _one_line(out.returncode, out.stderr)


def test_summary_of_an_empty_root_is_an_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "xstage_lab", "summary", "--root", str(tmp_path)],
                         capture_output=True, text=True)
    assert "no records under" in _one_line(out.returncode, out.stderr)


def _run(capsys, *argv) -> tuple[int, str]:
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.fixture
def no_gpus(monkeypatch):
    """This machine without GPUs, whatever it has."""
    from xstage_lab import platform

    monkeypatch.setattr(platform, "inventory", lambda: platform.Inventory(error="no GPU (test)"))


@pytest.fixture
def gpus_untouched(monkeypatch):
    """Fail where the command looks at the GPUs (CuPy's import included)."""
    from xstage_lab import platform

    def touched():
        raise AssertionError("the GPUs were looked at before the arguments were checked")
    monkeypatch.setattr(platform, "inventory", touched)
    monkeypatch.setitem(sys.modules, "cupy", None)  # importing it raises ImportError


@pytest.mark.parametrize("argv,says", [
    (["reproduce", "--backend", "cuda"], "--backend cuda needs a GPU"),
    (["characterize-beyond"], "needs two peer-capable GPUs"),
    (["characterize-beyond", "--only", "patterns"], "needs two peer-capable GPUs"),
    (["characterize"], "needs two peer-capable GPUs"),
    (["visibility"], "needs two peer-capable GPUs"),
    (["measure-all"], "measure-all needs a GPU"),
])
def test_without_gpus_a_gpu_command_is_one_line(capsys, no_gpus, argv, says):
    rc, err = _run(capsys, *argv)
    assert says in _one_line(rc, err)


@pytest.mark.parametrize("argv", [
    ["characterize", "--src", "0", "--dst", "0"],
    ["characterize", "--repeats", "-1"],
    ["characterize", "--repeats", "0"],
    ["characterize", "--src", "-1"],
    ["characterize", "--only", "nosuch"],
    ["characterize-beyond", "--src", "1", "--dst", "1"],
    ["characterize-beyond", "--repeats", "-1"],
    ["visibility", "--src", "0", "--dst", "0"],
    ["visibility", "--repeats", "x"],
    ["reproduce", "--backend", "cuda", "--only", "nosuch"],
])
def test_arguments_are_checked_before_the_gpus(capsys, gpus_untouched, argv):
    _one_line(*_run(capsys, *argv))


def test_calibrate_refuses_a_record_of_another_experiment(capsys, tmp_path):
    import pandas as pd

    from xstage_lab.records import write_record

    path = write_record("moe", "test-x2", pd.DataFrame({"a": [1]}), {}, {}, root=tmp_path)
    rc, err = _run(capsys, "calibrate", str(path), "--root", str(tmp_path))
    assert "not a 'remote_store' one" in _one_line(rc, err)
    plain = tmp_path / "plain.parquet"
    plain.write_text("not parquet")
    _one_line(*_run(capsys, "calibrate", str(plain), "--root", str(tmp_path)))


def test_every_option_has_help_and_no_issue_number():
    import argparse
    import re

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    texts = [c.help for c in commands._choices_actions] + [parser.description]
    for name, sub in commands.choices.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
            texts.append(action.help)
    for text in texts:
        assert not re.search(r"\bissues? \d", text), text


def test_characterize_names_every_sweep(capsys, gpus_untouched):
    from xstage_lab.experiments.remote_store.characterization import characterization_sweeps

    rc, err = _run(capsys, "characterize", "--only", "nosuch")
    assert " ".join(s.name for s in characterization_sweeps(132, 2)) in _one_line(rc, err)


def test_summary_prints_a_table_per_platform(eight_gpu_root):
    out = subprocess.run([sys.executable, "-m", "xstage_lab", "summary", "--root",
                          str(eight_gpu_root)], capture_output=True, text=True, check=True).stdout
    assert "== h200-x2 ==" in out and "== h200-x8 ==" in out
    assert "calibration.R_GBps " in out and "h200-x8: fa_a2a" in out
    assert not out.lstrip().startswith("{")


def test_transcode_rewrites_an_old_record_once_with_its_writer_s_resolution(tmp_path):
    from tests.test_records import _commit, _fat_table, _old_record, _repo
    from xstage_lab.records import read_record, transcoded

    root = _repo(tmp_path)
    path = _old_record(root, _fat_table(50))
    commit = _commit(root)
    key = f"remote_store/h200-x2/{path.stem}"
    argv = [sys.executable, "-m", "xstage_lab", "transcode", key, "--commit", "HEAD", "--root",
            str(root)]
    out = subprocess.run(argv, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == f"transcoded {path}\n", out.stderr
    assert read_record(path).meta["stored"]["dtypes"]["t_iss_us"] == "float64"  # BURST_RESOLUTION
    assert transcoded(root)[key]["commit"] == commit
    out = subprocess.run(argv, capture_output=True, text=True)
    assert "lean format already" in _one_line(out.returncode, out.stderr)


def _malformed_inputs(tmp: Path) -> dict[str, list[list[str]]]:
    """Per subcommand of ``python -m xstage_lab``, inputs a user can get wrong: a malformed value
    of each kind it takes (files included)."""
    not_json, no_metadata, no_provenance, not_parquet = (
        tmp / "not.json", tmp / "no_metadata.json", tmp / "no_provenance.json", tmp / "x.parquet")
    not_json.write_text('{"rows": [')
    no_metadata.write_text('{"rows": []}')
    no_provenance.write_text('{"metadata": {}, "rows": []}')
    not_parquet.write_text("not parquet")
    return {
        "run": [["nosuch"], [], ["remote_store", "--repeats", "0"],
                ["remote_store", "--only", "nosuch"], ["remote_store", "--root", str(tmp)],
                ["moe_layer", "--weighted-sum", "fused"], ["moe_layer", "--graph-start", "busy"],
                ["moe_layer", "--tile-rows", "512"],
                ["moe_layer", "--tile-rows", "256", "--precisions", "fp8"]],
        "characterize": [["--repeats", "x"], ["--src", "y"], ["--only", "nosuch"]],
        "characterize-beyond": [["--only", "nosuch"], ["--repeats", "0"], ["--dst", "-2"]],
        "calibrate": [[str(not_parquet)], [str(tmp / "missing.parquet")], []],
        "import-bench": [[str(f), "--experiment", "moe", "--root", str(tmp)]
                         for f in (not_json, no_metadata, no_provenance, tmp / "missing.json")]
                        + [[str(no_metadata), "--experiment", "nosuch"]],
        "visibility": [["--repeats", "-1"], ["--src", "a"]],
        "measure-all": [["--only", "nosuch"], ["--only"]],
        "reproduce": [["--backend", "nosuch"], ["--only", "nosuch"]],
        "summary": [["--root", str(not_json)], ["--root", str(tmp / "empty")]],
        "transcode": [["not-a-record", "--commit", "HEAD"], ["a/b/c"]],
        "ab": [["nosuch", "--columns", "t_us"], ["moe_layer"],
               ["moe_layer", "--columns", "t_us", "--base-tree", str(tmp)],
               ["moe_layer", "--columns", "t_us", "--base-tree", str(tmp), "--base-commit", "a"],
               ["moe_layer", "--columns", "t_us", "--base-options", "--seed 1",
                "--change-options", "--seed 1"]],
        "compare": [[str(not_parquet), str(not_parquet), "--columns", "t_us"],
                    [str(tmp / "missing.parquet"), str(not_parquet), "--columns", "t_us"],
                    [str(not_parquet), "--columns", "t_us"], [str(not_parquet), str(not_parquet)]],
    }


def test_every_subcommand_refuses_malformed_input_in_one_line(capsys, gpus_untouched, tmp_path):
    import argparse

    (tmp_path / "empty").mkdir()
    cases = _malformed_inputs(tmp_path)
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    assert set(cases) == set(commands.choices)
    for command, inputs in cases.items():
        for argv in inputs:
            rc, err = _run(capsys, command, *argv)
            assert rc == 2 and len(err.splitlines()) == 1, (command, argv, err)
    assert [p.name for p in tmp_path.rglob("*.parquet")] == ["x.parquet"]  # nothing written


def test_calibrate_prints_and_writes_only_with_root(capsys, tmp_path):
    from xstage_lab.records import RECORDS_DIR, list_records

    record = list_records("remote_store", "h200-x2")[-1]
    before = sorted(RECORDS_DIR.rglob("*"))
    assert main(["calibrate", str(record)]) == 0
    assert "not saved" in capsys.readouterr().out and sorted(RECORDS_DIR.rglob("*")) == before
    assert main(["calibrate", str(record), "--root", str(tmp_path)]) == 0
    written, = list_records("calibration", "h200-x2", tmp_path)
    assert capsys.readouterr().out == f"wrote {written}\n"


# One list syntax (cli.list_option): every list option of every experiment and command takes its
# items as words, comma-separated, both mixed, or the option repeated.

LIST_OPTIONS = [  # experiment, option, its items as words, the list they parse to
    ("moe", "--tokens", ["1", "8", "64"], [1, 8, 64]),
    ("moe", "--models", ["DiT-MoE", "Hy3"], ["DiT-MoE", "Hy3"]),
    ("moe_kernel", "--tokens", ["512", "4096"], [512, 4096]),
    ("moe_host", "--host-shares", ["1", "2", "8"], [1, 2, 8]),
    ("moe_trace", "--d-factors", ["0.5", "2"], [0.5, 2.0]),
    ("fa_a2a", "--seq", ["8192", "16384"], [8192, 16384]),
    ("link_probe", "--periods-us", ["20", "2000"], [20.0, 2000.0]),
    ("remote_store", "--only", ["gap", "isolated"], ["gap", "isolated"]),
]


@pytest.mark.parametrize("name,option,words,value", LIST_OPTIONS)
def test_a_list_option_takes_words_commas_both_and_repeats(name, option, words, value):
    from xstage_lab.experiments import experiment, harness

    def parsed(*argv):
        args = harness.parse(experiment(name), ["--out", "x.json", *argv])
        return getattr(args, option[2:].replace("-", "_"))

    assert parsed(option, *words) == value
    assert parsed(option, ",".join(words)) == value
    assert parsed(option, ",".join(words[:-1]), words[-1]) == value
    assert parsed(*(a for word in words for a in (option, word))) == value


def test_the_commands_take_the_same_list_syntax():
    parser = build_parser()
    for command, option, words in (("characterize-beyond", "--only", ["ops", "patterns"]),
                                   ("characterize", "--only", ["gap", "isolated"]),
                                   ("measure-all", "--only", ["moe", "moe_trace"]),
                                   ("reproduce", "--only", ["01", "fused_moe"])):
        for argv in ([option, *words], [option, ",".join(words)],
                     [a for word in words for a in (option, word)]):
            assert parser.parse_args([command, *argv]).only == words, (command, argv)


@pytest.mark.parametrize("argv,says", [
    (["run", "moe", "--tokens", "1,x"], "argument --tokens: 'x' is not an integer"),
    (["run", "fa_a2a", "--seq", "8192", "x"], "argument --seq: 'x' is not an integer"),
    (["run", "link_probe", "--periods-us", "20,fast"],
     "argument --periods-us: 'fast' is not a number"),
    (["run", "remote_store", "--only", "gap,nosuch"], "argument --only: invalid choice: 'nosuch'"),
    (["run", "fa_kernel_probe", "--shapes", "128:12"], "expected HEAD_DIM:HEADS:SEQ"),
    (["characterize-beyond", "--only", "patterns,nosuch"], "invalid choice: 'nosuch'"),
    (["measure-all", "--only", ","], "argument --only: expected at least one item"),
])
def test_a_bad_list_item_is_one_line(capsys, gpus_untouched, argv, says):
    rc, err = _run(capsys, *argv)
    assert says in _one_line(rc, err)
