"""Ulysses attention fused with its All-to-All (issue 3), on the CPU.

The kernels themselves run in Triton's interpreter in a process of their own
(``attention_interpreted.py``); here: the layout, bad input rejected before any launch,
``nccl_a2a``'s permutes over gloo, the Table 3 arithmetic, and compilation for sm_90 (no GPU
needed), which catches GPU-only compile errors, shared-memory overflow and unvectorized stores.
"""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from triton.compiler import ASTSource
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from tests.experiments.triton_testing import (HOPPER_SMEM_PER_BLOCK, REPO, compile_sm90,
                                              ptxas_report)
from xstage_lab.checks import bitwise_equal
from xstage_lab.experiments import harness
from xstage_lab.experiments.attention import bench as attention_bench, table3
from xstage_lab.ops import attention
from xstage_lab.experiments.attention import trace_bench
from xstage_lab.experiments.harness import Run
from xstage_lab.kernel_sources import kernel_path, kernels_package

BF16 = torch.bfloat16
TINY = dict(kernel="triton", BLOCK_M=16, BLOCK_N=16)


@pytest.mark.early  # a child pytest of every interpreted case
def test_kernels_in_the_interpreter():
    """FA-only vs the float32 reference and the REMOTE epilogue / remote-store copy for P = 2, 4, 8,
    under TRITON_INTERPRET=1 (which must be set before triton is imported)."""
    cases = Path(__file__).with_name("attention_interpreted.py")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(cases)], cwd=REPO, capture_output=True, text=True,
                         env=dict(os.environ, TRITON_INTERPRET="1"), timeout=900)
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-6000:] + run.stderr[-2000:]


def _kernel_copy(module_name: str, source: str = "flash_attention.py"):
    """A private copy of kernels/``source``, compiled (this process has no interpreter), in the
    kernels' package, where its relative imports of sibling sources resolve."""
    module_name = f"{kernels_package().__name__}.{module_name}"
    spec = importlib.util.spec_from_file_location(module_name, kernel_path(source))
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _qkv(M, h_local, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(M, h_local, d, generator=g).to(BF16) for _ in range(3)]


def test_ulysses_gather_states_the_layout():
    world, M, h_local, d = 4, 8, 2, 1
    local = [torch.arange(M * h_local, dtype=torch.float32).view(M, h_local, d) + 100 * r
             for r in range(world)]
    recv = attention.ulysses_gather(local)
    for j in range(world):
        for i in range(M // world):
            for r in range(world):
                for h in range(h_local):
                    assert recv[j][i, r * h_local + h, 0] == local[r][j * M // world + i, h, 0]


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("kernel launched despite a failed precondition")


@pytest.fixture
def no_launch(monkeypatch):
    monkeypatch.setattr(attention._kernels, "flash_attention_kernel", _NoLaunch())
    monkeypatch.setattr(attention._kernels, "remote_store_a2a_kernel", _NoLaunch())
    monkeypatch.setattr(attention._ws_kernels, "flash_attention_ws_kernel", _NoLaunch())


def _bad_calls():
    q, k, v = _qkv(64, 2, 64, seed=0)
    table = torch.zeros(2, dtype=torch.int64)
    fa, fused, copy = (attention.flash_attention, attention.fused_attention_a2a,
                       attention.remote_store_a2a)
    return {
        "dtype": (lambda: fa(q.half(), k.half(), v.half(), config=TINY), "bfloat16"),
        "head dim": (lambda: fa(*_qkv(64, 2, 32, seed=0), config=TINY), "head dim"),
        "M vs tiles": (lambda: fa(q, k, v), "multiple of the tile"),
        "k shape": (lambda: fa(q, k[:32], v, config=TINY), "shape"),
        "contiguity": (lambda: fa(q.transpose(0, 1).contiguous().transpose(0, 1), k, v,
                                  config=TINY), "contiguous"),
        "tile size": (lambda: fa(q, k, v, config=dict(BLOCK_M=24)), "power of two"),
        "persistent": (lambda: fa(q, k, v, config=dict(TINY, persistent=1)), "True or False"),
        "pipelined": (lambda: fa(q, k, v, config=dict(TINY, pipelined="yes")), "True or False"),
        "config key": (lambda: fa(q, k, v, config=dict(TINY, warp_specialize=True)),
                       "unknown configuration keys"),
        "kernel": (lambda: fa(q, k, v, config=dict(TINY, kernel="cuda")), "must be one of"),
        "gluon_ws tiles": (lambda: fa(q, k, v, config=dict(TINY, kernel="gluon_ws")),
                           r"gluon_ws kernel fixes \['BLOCK_M'\]"),
        "gluon_ws b_n": (lambda: fa(*_qkv(256, 2, 64, seed=0),
                                    config=dict(kernel="gluon_ws", BLOCK_N=256)), "exceeds"),
        "gluon_ws on CPU": (lambda: fa(*_qkv(128, 2, 64, seed=0), config=dict(kernel="gluon_ws")),
                            "sm_90"),
        "gluon_ws grid": (lambda: fa(*_qkv(128, 2, 64, seed=0), config=dict(kernel="gluon_ws"),
                                     num_programs=4), "no persistent grid"),
        "fenced table": (lambda: fused(q, k, v, table[:1], 0, 2, config=TINY, fenced=True),
                         "one pointer per rank"),
        "table length": (lambda: fused(q, k, v, torch.zeros(3, dtype=torch.int64), 0, 2,
                                       config=TINY), "one pointer per rank"),
        "table dtype": (lambda: fused(q, k, v, table.int(), 0, 2, config=TINY), "int64"),
        "rank": (lambda: fused(q, k, v, table, 2, 2, config=TINY), "rank 2"),
        "P divides M": (lambda: copy(torch.zeros(63, 2, 64, dtype=BF16),
                                     torch.zeros(2, dtype=torch.int64), 0, 2), "divisible"),
        "copy head dim": (lambda: copy(torch.zeros(64, 2, 96, dtype=BF16), table, 0, 2),
                          "head dim"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_is_rejected_before_launch(no_launch, case):
    call, message = _bad_calls()[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_default_kernel_is_the_one_that_runs_on_the_device(monkeypatch):
    """gluon_ws (``DEFAULT_KERNEL``) where its sm_90 instructions run; elsewhere the default
    falls back to the Triton kernel, while asking for gluon_ws by name stays an error."""
    assert attention.kernel_unsupported("triton", "cpu") is None
    assert "sm_90" in attention.kernel_unsupported("gluon_ws", "cpu")
    for d in attention.HEAD_DIMS:
        assert attention.flash_attention_config(d)["kernel"] == "gluon_ws"
        on_cpu = attention.flash_attention_config(d, device="cpu")
        assert on_cpu == attention.flash_attention_config(d, dict(kernel="triton"))
        assert attention.flash_attention_config(d, dict(kernel="gluon_ws"),
                                                device="cpu")["kernel"] == "gluon_ws"
    for major, want in ((9, "gluon_ws"), (8, "triton"), (10, "triton")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, m=major: (m, 0))
        assert attention.flash_attention_config(128, device="cuda")["kernel"] == want


def test_heads_not_divisible_by_P_are_rejected():
    with pytest.raises(ValueError, match="heads H=6 are not divisible by P=4"):
        attention.check_ulysses_shape(1024, 6, 4)
    bench = attention_bench.EXPERIMENT
    with pytest.raises(ValueError, match="not divisible by P=4"):
        bench.validate(dict(M=1026, heads=24, head_dim=128), Run(None, world=4))
    for world in (2, 4, 8):  # the default sweep on every node size
        args = harness.parse(bench, ["--out", "x"])
        for point in bench.sweeps(args)[0].points():
            bench.validate(point, Run(args, world=world))
    args = harness.parse(bench, ["--out", "x", "--heads", "12"])
    with pytest.raises(ValueError, match="heads H=12 are not divisible by P=8"):
        bench.validate(bench.sweeps(args)[0].points()[0], Run(args, world=8))


@pytest.mark.parametrize("experiment", ["EXPERIMENT", "FA_TUNING"])
@pytest.mark.parametrize("extra,says", [
    (["--seq", "1000"], "multiple of the 256-row tiles"),
    (["--seq", "8192,x"], "argument --seq: 'x' is not an integer"),
    (["--seq", "0"], "--seq must list positive lengths"),
    (["--heads", "0"], "--heads must be >= 1"),
    (["--trials", "0"], "--trials and --iters must be >= 1"),
    (["--iters", "0"], "--trials and --iters must be >= 1"),
])
def test_bad_shapes_and_timing_exit_at_parse(capsys, experiment, extra, says):
    with pytest.raises(SystemExit) as e:
        harness.parse(getattr(attention_bench, experiment), ["--out", "x", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and "Traceback" not in err, err


def test_unknown_eager_methods_exit_at_parse(capsys):
    with pytest.raises(SystemExit) as e:
        harness.parse(attention_bench.EXPERIMENT, ["--out", "x", "--eager", "fa,nonsense"])
    assert e.value.code == 2 and "invalid choice: 'nonsense'" in capsys.readouterr().err
    args = harness.parse(attention_bench.EXPERIMENT, ["--out", "x", "--eager", "fa", "--no-tune"])
    assert args.eager == ["fa"] and args.tune is False


def test_the_trace_takes_the_shapes_and_its_own_launches(capsys):
    args = harness.parse(trace_bench.EXPERIMENT, ["--out", "x", "--seq", "8192"])
    assert args.seq == [8192] and args.launches == 3 and args.tune is False
    assert args.iters == 1 and args.eager == []  # what tune times, with --tune
    with pytest.raises(SystemExit) as e:
        harness.parse(trace_bench.EXPERIMENT, ["--out", "x", "--launches", "0"])
    assert e.value.code == 2 and "--launches must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        harness.parse(trace_bench.EXPERIMENT, ["--out", "x", "--seq", "1000"])
    assert "multiple of the 256-row tiles" in capsys.readouterr().err


def test_fa_only_selects_the_one_gpu_experiment():
    assert attention_bench.experiment(["--out", "x", "--fa-only"]) is attention_bench.FA_TUNING
    assert attention_bench.experiment(["--out", "x"]) is attention_bench.EXPERIMENT
    assert attention_bench.FA_TUNING.name == "fa_tuning"
    assert attention_bench.FA_TUNING.launch == "in_process"
    table3 = attention_bench.EXPERIMENT
    assert table3.name == "fa_a2a" and table3.launch == "per_gpu"


def test_cpu_tensors_need_the_interpreter():
    with pytest.raises(ValueError, match="CUDA"):
        attention.flash_attention(*_qkv(64, 2, 64, seed=0), config=TINY)


def _gloo_a2a_worker(rank, world, init_file, M, h_local, d):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        local = [torch.randn(M, h_local, d, generator=torch.Generator().manual_seed(r)).to(BF16)
                 for r in range(world)]
        out = torch.full((M // world, h_local * world, d), float("nan"), dtype=BF16)
        attention.nccl_a2a(local[rank], out=out)
        assert bitwise_equal(out, attention.ulysses_gather(local)[rank])
        assert bitwise_equal(attention.nccl_a2a(local[rank]), out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [4, 8])
def test_all_to_all_single_permutes_into_the_ulysses_layout(tmp_path, world):
    """``nccl_a2a``'s chunking and permute, over gloo on CPU with 4 and 8 processes. Forked, not
    spawned: a spawned process imports torch, Triton and this module again before it starts
    (8 of them took 45 s of the 2-core CI machine), and the ranks run the same code either way."""
    mp.start_processes(_gloo_a2a_worker, args=(world, str(tmp_path / "init"), 2 * world, 3, 4),
                       nprocs=world, start_method="fork")


def test_table3_row_follows_eq_21():
    med = dict(fa=100.0, fa_same_code=104.0, fa_same_code_fenced=125.0, sdpa=80.0, a2a_nccl=30.0, a2a_remote=20.0,
               serial=140.0, fused=110.0, fused_fenced=130.0, sdpa_nccl=120.0)
    iqr = {m: 1.0 for m in med}
    row = table3.table3_row(8192, 24, 128, 4, med, iqr)
    assert row["speedup"] == pytest.approx(140 / 110)
    assert row["hiding_ratio"] == pytest.approx(1 - 10 / 40)
    assert row["e_res_us"] == pytest.approx(10.0)
    assert row["e_res_same_code_us"] == pytest.approx(6.0)
    assert row["e_res_fenced_us"] == pytest.approx(30.0)
    assert row["e_res_fenced_same_code_us"] == pytest.approx(5.0)
    assert row["hiding_ratio_fenced"] == pytest.approx(1 - 30 / 40)
    assert row["speedup_fenced"] == pytest.approx(140 / 130)
    flops = 4 * 8192 ** 2 * 128 * 24 / 4
    assert row["fa_tflops"] == pytest.approx(flops / 100e-6 / 1e12)
    assert row["cudnn_tflops"] == pytest.approx(flops / 80e-6 / 1e12)
    for key in ("M", "heads", "head_dim", "P", "fa_us", "a2a_nccl_us", "a2a_remote_us",
                "serial_us", "fused_us", "sdpa_nccl_us", "fa_iqr_us", "fused_iqr_us"):
        assert key in row


# sm_90 compilation of the compiled copy: argument types as the launcher passes them (TMA
# descriptors, 16-byte aligned pointers and sizes).
def _compile_flash_attention(kernels, d, cfg, remote, h_local=6, fenced=False, instrument=False):
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    signature = {"q_desc": f"tensordesc<bf16[{bm}, {d}]>", "k_desc": f"tensordesc<bf16[{bn}, {d}]>",
                 "v_desc": f"tensordesc<bf16[{bn}, {d}]>", "dst": "*i64" if remote else "*bf16",
                 "fence_flag": "*i32", "trace": "*i64" if instrument else "*i32", "M": "i32",
                 "rows_per_rank": "i32", "rank": "i32", "world": "i32", "qk_scale": "fp32",
                 "H_LOCAL": "constexpr", "HEAD_DIM": "constexpr", "BLOCK_M": "constexpr",
                 "BLOCK_N": "constexpr", "REMOTE": "constexpr", "FENCED": "constexpr",
                 "PERSISTENT": "constexpr", "OUTPUT_CACHE": "constexpr",
                 "PIPELINED": "constexpr", "INSTRUMENT": "constexpr"}
    constexprs = dict(H_LOCAL=h_local, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, REMOTE=remote,
                      FENCED=fenced, PERSISTENT=cfg["persistent"],
                      OUTPUT_CACHE=cfg.get("output_cache", ""),
                      PIPELINED=cfg.get("pipelined", False), INSTRUMENT=instrument)
    aligned = {(i,): [["tt.divisibility", 16]] for i in (3, 4, 5, 6, 7)}
    return compile_sm90(ASTSource(kernels.flash_attention_kernel, signature, constexprs, aligned),
                        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


@pytest.fixture(scope="module")
def compiled_kernels():
    return _kernel_copy("_test_flash_attention_sm90")


@pytest.mark.parametrize("d", attention.HEAD_DIMS)
@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_flash_attention_compiles_for_hopper(compiled_kernels, d, remote):
    k = _compile_flash_attention(compiled_kernels, d, attention.TRITON_CONFIGS[d], remote)
    ptx = k.asm["ptx"]
    assert k.metadata.shared <= HOPPER_SMEM_PER_BLOCK
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    stores = re.findall(r"st\.global\S*", ptx)
    assert stores and all(".v4." in s for s in stores), f"output stores not 16-byte: {stores}"


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
def test_streaming_output_stores_only_where_configured(compiled_kernels, remote):
    """output_cache=".cs" makes every output store st.global.cs (evict-first); the default
    leaves them write-back; anything else is refused before a launch."""
    for cache, want in (("", "st.global.v4"), (".cs", "st.global.cs.v4")):
        cfg = attention.flash_attention_config(128, dict(kernel="triton", output_cache=cache))
        ptx = _compile_flash_attention(compiled_kernels, 128, cfg, remote).asm["ptx"]
        stores = set(re.findall(r"st\.global\S*", ptx))
        assert stores and all(st.startswith(want) for st in stores), (cache, stores)
    with pytest.raises(ValueError, match="output_cache='.wt' must be one of"):
        attention.flash_attention_config(128, dict(kernel="triton", output_cache=".wt"))


@pytest.mark.parametrize("d", attention.HEAD_DIMS)
def test_candidate_configs_fit_hopper_at_their_occupancy(compiled_kernels, d):
    """Every candidate (the table's and ``--fa-only``'s) builds for sm_90 without spills, and
    ctas_per_sm is the occupancy its registers and shared memory allow (H100/H200: 64K registers,
    228 KB shared memory per SM, 1 KB of it reserved per CTA, 2048 threads)."""
    for cfg in attention_bench.fa_only_candidates(d):
        if cfg["kernel"] == "gluon_ws":
            continue  # test_warp_specialized_kernel_compiles_for_hopper
        threads = 32 * cfg["num_warps"]
        fits = []
        for remote in (False, True):
            k = _compile_flash_attention(compiled_kernels, d, cfg, remote)
            ptxas = ptxas_report(k.asm["ptx"])
            regs = ptxas["registers"]
            spills = ptxas["spill_store_bytes"] + ptxas["spill_load_bytes"]
            assert spills == 0 and k.metadata.shared <= HOPPER_SMEM_PER_BLOCK, (cfg, remote)
            regs_per_warp = -(-regs * 32 // 256) * 256
            fits.append(min(65536 // (regs_per_warp * cfg["num_warps"]),
                            228 * 1024 // (k.metadata.shared + 1024), 2048 // threads))
        assert cfg["ctas_per_sm"] == min(fits), (cfg, fits)


@pytest.mark.parametrize("d", attention.HEAD_DIMS)
def test_instrumented_build_stamps_each_tile_and_keeps_its_occupancy(compiled_kernels, d):
    """The traced build (``attention_trace``) reads %globaltimer three times and %smid once per
    output tile; it builds without spills and keeps the traced
    configuration's occupancy, so the traced launches run the schedule the untraced ones do.
    The untraced build reads no timer."""
    cfg = attention.TRITON_CONFIGS[d]
    plain = _compile_flash_attention(compiled_kernels, d, cfg, True).asm["ptx"]
    assert "%globaltimer" not in plain and "%smid" not in plain
    k = _compile_flash_attention(compiled_kernels, d, cfg, True, instrument=True)
    ptx = k.asm["ptx"]
    assert len(re.findall(r"mov\.u64\s+%rd\d+,\s*%globaltimer", ptx)) == 3
    assert len(re.findall(r"%smid", ptx)) == 1
    ptxas = ptxas_report(ptx)
    assert ptxas["spill_store_bytes"] + ptxas["spill_load_bytes"] == 0
    regs_per_warp = -(-ptxas["registers"] * 32 // 256) * 256
    ctas = min(65536 // (regs_per_warp * cfg["num_warps"]),
               228 * 1024 // (k.metadata.shared + 1024))
    assert ctas >= cfg["ctas_per_sm"]


def test_remote_store_copy_compiles_for_hopper(compiled_kernels):
    signature = {"src": "*bf16", "peer_ptrs": "*i64", "M": "i32", "rows_per_rank": "i32",
                 "rank": "i32", "world": "i32", "H_LOCAL": "constexpr", "HEAD_DIM": "constexpr",
                 "BLOCK_ROWS": "constexpr"}
    constexprs = dict(H_LOCAL=6, HEAD_DIM=128, BLOCK_ROWS=attention.COPY_CONFIG["BLOCK_ROWS"])
    aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3)}
    k = compile_sm90(ASTSource(compiled_kernels.remote_store_a2a_kernel, signature, constexprs,
                               aligned), num_warps=attention.COPY_CONFIG["num_warps"])
    stores = re.findall(r"st\.global\S*", k.asm["ptx"])
    assert stores and all(".v4." in s for s in stores), f"remote stores not 16-byte: {stores}"


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per_tile"])
def test_fenced_epilogue_releases_at_system_scope(compiled_kernels, persistent):
    """Issue 8: the fenced build waits on a system-scope release after a CTA barrier, once per
    tile; the unfenced REMOTE and LOCAL builds have neither."""
    cfg = dict(attention.TRITON_CONFIGS[128], persistent=persistent)
    fenced = _compile_flash_attention(compiled_kernels, 128, cfg, True, fenced=True).asm["ptx"]
    plain = _compile_flash_attention(compiled_kernels, 128, cfg, True).asm["ptx"]
    release = re.findall(r"atom\.global\.sys\.release\.\S+", fenced)
    assert len(release) == 1, release
    body = fenced[:fenced.index(release[0])]
    assert "bar.sync" in body[body.rindex("st.global"):], "no CTA barrier between stores and release"
    assert "atom." not in plain and ".sys" not in plain


def test_fa_only_mode_names_and_ratios():
    cands = attention_bench.fa_only_candidates(128)
    names = [attention_bench.config_name(c) for c in cands]
    assert len(set(names)) == len(names) and "256x64_w8_s4_grid" in names
    assert attention.flash_attention_config(128) in cands
    timing = {"cudnn": dict(median_us=80.0, p25_us=79.0, p75_us=81.0, trials_us=[80.0, 40.0]),
              "x": dict(median_us=100.0, p25_us=99.0, p75_us=101.0, trials_us=[100.0, 40.0])}
    r = attention_bench.fa_only_ratios(timing, flops=10 ** 9)
    assert r["x"]["tflops"] == pytest.approx(10.0)  # 1e9 FLOP in 100 µs
    assert r["x"]["over_cudnn"] == pytest.approx(0.8)
    assert r["x"]["over_cudnn_paired"] == pytest.approx(0.9)  # median of 0.8 and 1.0


def test_fa_only_rejects_unknown_configs_at_parse(capsys, no_launch):
    args = harness.parse(attention_bench.FA_TUNING, ["--out", "x", "--fa-only"])
    assert args.seq == list(attention_bench.FA_ONLY_SEQ) and args.heads == 12
    assert list(args.candidates) == [attention_bench.config_name(c)
                                     for c in attention_bench.fa_only_candidates(128)]
    with pytest.raises(SystemExit) as e:
        harness.parse(attention_bench.FA_TUNING, ["--out", "x", "--fa-only", "--configs",
                                                  "nonsense"])
    assert e.value.code == 2 and "unknown configurations" in capsys.readouterr().err
    chosen = harness.parse(attention_bench.FA_TUNING,
                           ["--out", "x", "--fa-only", "--configs", "256x64_w8_s4_grid"])
    assert list(chosen.candidates) == ["256x64_w8_s4_grid"]


def test_paired_row_pairs_fused_and_fenced_with_both_baselines():
    trials = dict(fa=[100.0, 200.0, 101.0], fa_same_code=[98.0, 196.0, 99.0],
                  fused=[103.0, 206.0, 104.0], fused_fenced=[110.0, 220.0, 111.0],
                  fa_same_code_fenced=[108.0, 217.0, 110.0])
    clocks = dict(fa=[1980.0, 990.0, 1980.0], fa_same_code=[1980.0, 990.0, 1965.0],
                  fused=[1980.0, 1500.0, 1980.0], fused_fenced=[1980.0, 990.0, None],
                  fa_same_code_fenced=[1980.0, 990.0, 1980.0])
    row = table3.paired_row(trials, clocks)
    assert row["e_res_paired_fa_us"] == 3.0                   # 3, 6, 3
    assert row["e_res_paired_fa_matched_us"] == 3.0           # trial 2's clocks differ
    assert row["e_res_paired_fa_matched_trials"] == 2
    assert row["e_res_fenced_paired_fa_same_code_us"] == 12.0  # 12, 24, 12
    assert row["e_res_fenced_paired_fa_matched_trials"] == 2   # trial 3's clock unknown
    assert row["e_res_fenced_paired_fa_same_code_fenced_us"] == 2.0  # 2, 3, 1
    assert row["sm_clock_min_mhz"] == 990.0 and row["sm_clock_max_mhz"] == 1980.0


def test_receive_buffer_views_and_barrier():
    from tests.test_platform import fake_symmetric_buffer

    sym = fake_symmetric_buffer(4 * 8 * 64, world=2)
    buf = attention.ReceiveBuffer(sym)
    recv = buf.view(8, 8, 64)  # [M/P, H, d] prefix of the flat buffer
    assert recv.shape == (4, 8, 64) and recv.data_ptr() == sym.tensor.data_ptr()
    assert buf.peer_ptrs is sym.table
    buf.barrier()
    assert sym.handle.barriers == [0]
    with pytest.raises(ValueError, match="exceeds the receive buffer of 2048 elements"):
        buf.view(16, 8, 64)
    with pytest.raises(ValueError):
        buf.view(7, 8, 64)  # M not divisible by P


def _compile_flash_attention_ws(kernels, d, remote, fenced=False, cfg=None, h_local=6,
                                instrument=False):
    """The gluon_ws kernel for sm_90 with the argument types its launcher passes, at ``cfg``
    (default: the gluon_ws configuration for ``d``)."""
    cfg = attention.flash_attention_config(d, cfg or dict(kernel="gluon_ws"))
    half, bn = int(kernels.HALF_ROWS), cfg["BLOCK_N"]
    q_layout = gl.NVMMASharedLayout.get_default_for([half, d], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([bn, d], gl.bfloat16)
    signature = {"q_desc": f"tensordesc<bf16[{half}, {d}],{q_layout!r}>",
                 "k_desc": f"tensordesc<bf16[{bn}, {d}],{kv_layout!r}>",
                 "v_desc": f"tensordesc<bf16[{bn}, {d}],{kv_layout!r}>",
                 "dst": "*i64" if remote else "*bf16", "fence_flag": "*i32",
                 "trace": "*i64" if instrument else "*i32", "M": "i32", "rows_per_rank": "i32",
                 "rank": "i32", "world": "i32", "qk_scale": "fp32", "H_LOCAL": "constexpr",
                 "HEAD_DIM": "constexpr", "BLOCK_N": "constexpr", "REMOTE": "constexpr",
                 "FENCED": "constexpr", "STAGES": "constexpr", "INSTRUMENT": "constexpr"}
    names = list(signature)
    constexprs = {(names.index(k),): v for k, v in dict(
        H_LOCAL=h_local, HEAD_DIM=d, BLOCK_N=bn, REMOTE=remote, FENCED=fenced,
        STAGES=cfg["num_stages"], INSTRUMENT=instrument).items()}
    aligned = {(names.index(k),): [["tt.divisibility", 16]] for k in ("dst", "fence_flag", "trace")}
    return compile_sm90(GluonASTSource(kernels.flash_attention_ws_kernel, signature, constexprs,
                                       aligned), num_warps=4)


@pytest.fixture(scope="module")
def compiled_ws_kernels():
    return _kernel_copy("_test_flash_attention_ws_sm90", "flash_attention_ws.py")


@pytest.mark.parametrize("d", attention.HEAD_DIMS)
@pytest.mark.parametrize("remote,fenced", [(False, False), (True, False), (True, True)],
                         ids=["local", "remote", "remote_fenced"])
def test_warp_specialized_kernel_compiles_for_hopper(compiled_ws_kernels, d, remote, fenced):
    """Every gluon_ws configuration that is timed (``attention_bench.fa_only_candidates``) builds
    for sm_90: within a CTA's shared memory, no spills, no serialized wgmma (ptxas's advisory),
    registers reallocated between its partitions, TMA loads, 16-byte output stores, the FENCED
    epilogue's system-scope release only where it is asked for, and the Q-loop's two wgmma groups
    in flight together (S_j with PV_{j-1}: a wait down to one group, once in each consumer
    partition)."""
    configs = [c for c in attention_bench.fa_only_candidates(d) if c["kernel"] == "gluon_ws"]
    assert attention.flash_attention_config(d, dict(kernel="gluon_ws")) in configs
    for cfg in configs:
        k = _compile_flash_attention_ws(compiled_ws_kernels, d, remote, fenced, cfg)
        ptx = k.asm["ptx"]
        ptxas = ptxas_report(ptx)
        assert k.metadata.shared <= HOPPER_SMEM_PER_BLOCK, cfg
        assert ptxas["spill_store_bytes"] + ptxas["spill_load_bytes"] == 0, cfg
        assert not ptxas["wgmma_serialized"], cfg
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
        stores = re.findall(r"st\.global\S*", ptx)
        assert stores and all(".v4." in st for st in stores), stores
        assert ("atom.global.sys.release" in ptx) == fenced
        assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)) == 2, cfg
        if fenced:
            _assert_release_is_a_call_after_the_warpgroup_barrier(ptx)


def _assert_release_is_a_call_after_the_warpgroup_barrier(ptx):
    """The FENCED epilogue's release atomic lives in ``_release_system``, called once per
    consumer partition right after that warpgroup's own barrier (``bar.sync id, 128``)."""
    funcs = dict(re.findall(r"\.func\s+(\S+?)\((.*?)\n\}", ptx, re.S))
    releasing = {name for name, body in funcs.items() if "atom.global.sys.release" in body}
    assert releasing and all("_release_system" in name for name in releasing), sorted(funcs)
    lines = [ln.strip() for ln in ptx.splitlines()
             if ln.strip() and not ln.strip().startswith((".loc", "//", "$L"))]
    calls = [i for i, ln in enumerate(lines) if ln.startswith("call.uni")
             and ln.split()[1].rstrip(",") in releasing]
    assert len(calls) == 2, calls
    for i in calls:
        before = lines[i - 5:i]
        assert any(re.match(r"bar\.sync\s+\d+,\s*128;", ln) for ln in before), before


def test_warp_specialized_row_statistics_move_no_data(compiled_ws_kernels):
    """With b_n != d the softmax's row statistics change layout (S's wgmma layout to O's); the
    rows sit in the same threads, so the kernel has no more shared-memory stores than with
    b_n = d, where the two layouts are one."""
    def shared_stores(block_n):
        cfg = dict(kernel="gluon_ws", BLOCK_N=block_n, num_stages=3)
        ptx = _compile_flash_attention_ws(compiled_ws_kernels, 64, False, cfg=cfg).asm["ptx"]
        return len(re.findall(r"st\.shared", ptx))

    assert shared_stores(128) == shared_stores(64) > 0


@pytest.mark.parametrize("d", attention.HEAD_DIMS)
def test_warp_specialized_instrumented_build_stamps_each_half_tile(compiled_ws_kernels, d):
    """The traced gluon_ws build (``attention_trace``) reads %globaltimer three times and %smid
    once per consumer warpgroup's half tile, builds without spills or serialized wgmma; the
    untraced build reads no timer."""
    plain = _compile_flash_attention_ws(compiled_ws_kernels, d, True).asm["ptx"]
    assert "%globaltimer" not in plain and "%smid" not in plain
    ptx = _compile_flash_attention_ws(compiled_ws_kernels, d, True, instrument=True).asm["ptx"]
    # each consumer partition is a function of its own in the PTX: two copies of the stamps
    assert len(re.findall(r"mov\.u64\s+%rd\d+,\s*%globaltimer", ptx)) == 2 * 3
    assert len(re.findall(r"%smid", ptx)) == 2
    ptxas = ptxas_report(ptx)
    assert ptxas["spill_store_bytes"] + ptxas["spill_load_bytes"] == 0
    assert not ptxas["wgmma_serialized"]


def test_shapes_are_a_declared_sweep_over_m():
    for experiment in (attention_bench.EXPERIMENT, attention_bench.FA_TUNING,
                       trace_bench.EXPERIMENT):
        args = harness.parse(experiment, ["--out", "x", "--seq", "8192,16384", "--heads", "24",
                                          "--head-dim", "64"])
        (sweep,) = experiment.sweeps(args)
        assert sweep.name == experiment.name
        assert sweep.describe()["axes"] == {"M": [8192, 16384]} and sweep.repeats == 1
        assert sweep.describe()["fixed"] == dict(heads=24, head_dim=64)
        assert sweep.points() == [dict(heads=24, head_dim=64, M=8192),
                                  dict(heads=24, head_dim=64, M=16384)]
