"""SPMD benchmark of Ulysses attention with its post-attention All-to-All (paper §5.3, Table 3).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
    torchrun --standalone --nproc_per_node=P -m xstage_lab.experiments.attention.bench \\
        (--out FILE | --root DIR) [--seq 8192,16384,32768,49152,65536] [--heads 24]
        [--head-dim 128] [--trials 20] [--iters 10] [--chunk I/N]
    python -m xstage_lab.experiments.attention.bench --fa-only (--out FILE | --root DIR)
        # one GPU, no torchrun; the record's experiment is fa_tuning

Two ``Experiment``s run by ``experiments.harness``: ``UlyssesAttention`` (``fa_a2a``, one process
per GPU) and ``FaTuning`` (``fa_tuning``, ``--fa-only``); each declares its shapes as a ``Sweep``
over M at the fixed heads H and head dim d (``shape_sweep``).
The shapes, their inputs and checks are ``cases``'s; Table 3's timing is ``table3``'s.

One process per GPU. Per sequence length M:
1. Correctness first, on fresh random inputs with every output poisoned (NaN) before its run:
   Fused and Fused-fenced (issue 8: each tile's remote stores made visible system-wide before
   the next tile) bitwise equal to Serial (the same kernel, then NCCL ``all_to_all_single``);
   FA-only, Serial, Fused and SDPA+NCCL within bf16 tolerance of a float32 reference; the
   remote-store A2A bitwise equal to the NCCL A2A. Any failure on any rank stops every rank
   before timing, with no output.
2. Timing as §5.1 describes: each method is captured ``iters`` times back to back in one CUDA
   graph; a trial aligns all ranks (``dist_timing.time_methods``), replays the graph between CUDA
   events on every rank, and takes the maximum over ranks; rows report the median over trials
   and the IQR. Method order rotates across trials. Clocks may not be locked, so DVFS is
   measured and paired out instead: ``--settle-s`` seconds of FA-only precede each M's trials,
   each trial records every method's SM clock, and E_res is also reported as the median of
   per-trial differences (Fused and FA-only run back to back in one rotation) and over the
   clock-matched trials alone (``model.paired_difference``).
   The boundary is sender-visible: remote-store methods synchronize remote visibility once after
   the replay, outside the timed window; NCCL methods include their own completion.
Rank 0 writes the output: rows (Table 3 quantities), and a header with the per-trial raw times.

``--fa-only`` (one process, one GPU): the FA-only configurations (``fa_only_candidates``) against
torch SDPA on cuDNN, each checked first (float32 reference; REMOTE epilogue, fenced and not,
bitwise equal to LOCAL), then timed in one rotation with the SM clock per trial.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone

import torch
import torch.distributed as dist
import triton

from ...checks import poisoned, relative_error
from ...cli import list_option
from ...dist_timing import paired_ratio, require_safe_env, rotated_order, time_methods
from ...sweep import Sweep
from .. import harness
from ..harness import Experiment, Run
from ...ops import attention as att
from .cases import (DEVICE, REL_TOL, Case, add_shape_arguments, add_timing_arguments,
                    attention_flops, check_case, check_shape_args, check_timing_args,
                    local_destination, random_qkv, remote_epilogue_checks, shape_sweep)
from .table3 import METHODS, SETTLE_S, run_case, tune

TIMING = ("sender-visible steady state: per method, `iters` back-to-back calls in one CUDA graph "
          "replayed between CUDA events on every rank after a rank alignment; per trial the "
          "maximum over ranks; rows hold the median over trials and the IQR, in µs per call. "
          "Remote-store methods synchronize once after the replay, outside the timed window "
          "(§5.1); NCCL methods include their own completion. Clocks are not locked: before each "
          "M, `settle_s` seconds of FA-only; every trial records the SM clock of every method "
          "(lowest over ranks); E_res is also the median of per-trial differences (paired, same "
          "rotation) and of the clock-matched trials only.")
LAYOUT = "q, k, v [M, H/P, d] on every rank (heads rank*H/P...); receive [M/P, H, d]"


# ``--fa-only``: the kernel configurations timed against cuDNN on one GPU (no NCCL, no peers),
# besides the table's CANDIDATES. ctas_per_sm is the occupancy of the sm_90 build (Triton 3.6,
# ptxas; checked by the tests). The 4-warp d=128 tiles fit two CTAs per SM (128 x 64 at s2: 255
# registers, 96 KiB of shared memory, one program per tile: its persistent build spills; 128 x 32
# at s4: 212-249 registers, 96 KiB), so each SM holds two independent warpgroups whose softmax and
# MMAs can interleave; one 8-warp CTA synchronizes its two warpgroups with three CTA barriers per
# KV tile. The pipelined Q-loop (softmax under the PV wgmma) keeps one more score tile live, so
# its candidates give each warpgroup 64 rows (128 x 64 at 8 warps: 157 registers; 64 x 32 at 4
# warps: 119 registers, three CTAs per SM); at 128 rows per warpgroup it spills.
def _candidate(bm, bn, warps, stages, persistent, ctas_per_sm, **keys) -> dict:
    return dict(kernel="triton", BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
                persistent=persistent, ctas_per_sm=ctas_per_sm, **keys)


# gluon_ws at b_n = 64 beside its b_n = 128 candidates (``attention.WS_CANDIDATES``).
GLUON_WS_BN64 = dict(kernel="gluon_ws", BLOCK_N=64, num_stages=3)
FA_ONLY_CANDIDATES = {
    128: [_candidate(128, 128, 8, 3, True, 1), _candidate(128, 128, 8, 3, False, 1),
          _candidate(256, 64, 8, 3, False, 1), _candidate(256, 64, 8, 4, False, 1),
          _candidate(128, 64, 8, 3, True, 1), _candidate(128, 64, 8, 4, True, 1),
          _candidate(128, 64, 4, 2, False, 2), _candidate(128, 32, 4, 4, True, 2),
          _candidate(128, 32, 4, 4, False, 2), _candidate(128, 32, 4, 3, True, 2),
          _candidate(128, 64, 4, 2, False, 2, output_cache=".cs"),
          _candidate(256, 64, 8, 4, False, 1, output_cache=".cs"),
          _candidate(128, 64, 8, 2, False, 1, pipelined=True),
          _candidate(128, 64, 8, 3, False, 1, pipelined=True),
          _candidate(128, 128, 8, 2, False, 1, pipelined=True),
          _candidate(64, 64, 4, 2, False, 2, pipelined=True),
          _candidate(64, 32, 4, 3, False, 3, pipelined=True), GLUON_WS_BN64],
    64: [_candidate(128, 128, 8, 3, True, 1), _candidate(128, 128, 8, 4, True, 1),
         GLUON_WS_BN64],
}
FA_ONLY_SEQ = (16384, 32768, 65536)
FA_ONLY_HEADS = 12  # H/P local heads of the Table 3 case, H = 24 on P = 2


def fa_only_candidates(head_dim: int) -> list[dict]:
    """The configurations ``--fa-only`` times: ``FA_ONLY_CANDIDATES`` plus the table's
    ``CANDIDATES``, each once."""
    out = []
    for cfg in FA_ONLY_CANDIDATES[head_dim] + att.flash_attention_candidates(head_dim):
        cfg = att.flash_attention_config(head_dim, cfg)
        if cfg not in out:
            out.append(cfg)
    return out


def config_name(cfg: dict) -> str:
    """A short method name for a configuration, e.g. ``128x64_w8_s3_persistent1``, with ``_cs``
    for streaming output stores and ``_pipe`` for the pipelined Q-loop; ``gluon_ws_128x128_s2``
    for the warp-specialized kernel with 128-row K/V tiles in two-stage rings."""
    if cfg.get("kernel") == "gluon_ws":
        return f"gluon_ws_{cfg['BLOCK_M']}x{cfg['BLOCK_N']}_s{cfg['num_stages']}"
    return (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}_w{cfg['num_warps']}_s{cfg['num_stages']}_"
            + (f"persistent{cfg['ctas_per_sm']}" if cfg["persistent"] else "grid")
            + ("_cs" if cfg.get("output_cache") == ".cs" else "")
            + ("_pipe" if cfg.get("pipelined") else ""))


def fa_only_ratios(timing: dict, flops: int, baseline: str = "cudnn") -> dict:
    """Per method of one ``time_methods`` result: TF/s at its median, the ratio of its TF/s to
    the baseline's (median over median), and the median over trials of the per-trial ratio
    (baseline time / method time within one rotation: both ran in the same clock state)."""
    base = timing[baseline]["trials_us"]
    out = {}
    for name, t in timing.items():
        out[name] = dict(median_us=t["median_us"], p25_us=t["p25_us"], p75_us=t["p75_us"],
                         tflops=flops / t["median_us"] / 1e6,
                         over_cudnn=timing[baseline]["median_us"] / t["median_us"],
                         over_cudnn_paired=paired_ratio(base, t["trials_us"]),
                         sm_clock_mhz=t.get("sm_clock_mhz"))
    return out


class UlyssesAttention(Experiment):
    """Table 3: FA-only, Fused (decoupled and fenced), Serial and their controls per M."""

    name = "fa_a2a"
    in_measure_all = True
    paper = "§5.3, Table 3; timing §5.1"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        add_shape_arguments(p)
        add_timing_arguments(p)
        p.add_argument("--settle-s", type=float, default=SETTLE_S,
                       help="seconds of FA-only back to back before each M's trials (DVFS settles)")
        p.add_argument("--no-tune", action="store_true",
                       help="use the configuration table as is instead of timing its candidates")
        p.add_argument("--eager", **list_option(choices=METHODS, default=[], nargs="*",
                       help="methods launched back to back without a CUDA graph (for a method "
                            "that cannot be captured); recorded in the metadata"))

    def check_args(self, a: argparse.Namespace) -> None:
        check_shape_args(a)
        check_timing_args(a)
        a.tune = not a.no_tune

    def sweeps(self, args) -> list[Sweep]:
        return [shape_sweep(args, self.name)]

    def start(self, run: Run) -> None:
        a = run.args
        self.group = dist.group.WORLD
        self.buf = att.symmetric_receive_buffer(max(a.seq) // run.world * a.heads * a.head_dim,
                                                self.group)
        self.cfg, self.tuning, self.raw = None, [], []

    def validate(self, point: dict, run: Run) -> None:
        att.check_ulysses_shape(point["M"], point["heads"], run.world)

    def prepare(self, point: dict, run: Run) -> Case:
        """The run's configuration (tuned at the first point: tuning launches kernels, so every
        point is validated first) and the point's fresh q, k, v."""
        self.cfg, self.tuning = run.resource("config", lambda: self.configure(run))
        M, H, d = point["M"], point["heads"], point["head_dim"]
        q, k, v = random_qkv(M, H // run.world, d, run.args.seed + 1000 * M + run.rank)
        return Case(point, q, k, v)

    def configure(self, run: Run) -> tuple[dict, list]:
        """The kernel configuration: the fastest candidate (``tune``) or the table's."""
        a = run.args
        cfg, tuning = (tune(a, self.group) if a.tune
                       else (att.flash_attention_config(a.head_dim, device=DEVICE), []))
        if run.rank == 0:
            print(f"[{type(self).__module__.removeprefix('xstage_lab.experiments.')}] "
                  f"P={run.world} H={a.heads} d={a.head_dim} config={cfg}", file=sys.stderr,
                  flush=True)
        return cfg, tuning

    def check(self, case: Case, run: Run) -> list[str]:
        metrics, failures = check_case(case, self.cfg, self.buf, self.group)
        case.checks = run.gather(metrics)
        return failures

    def measure(self, case: Case, run: Run) -> dict:
        row, raw = run_case(case, run.args, self.cfg, self.buf, self.group)
        self.raw.append(raw)
        return row

    def progress_line(self, rows) -> str:
        row = rows.iloc[0]
        return (f"[attention.bench] M={row['M']}: "
                + ", ".join(f"{m}={row[m + '_us']:.1f}us" for m in METHODS)
                + f", speedup={row['speedup']:.3f}, H={row['hiding_ratio']:.2f}, "
                f"FA/cuDNN={row['fa_over_cudnn']:.2f}")

    def metadata(self, run: Run) -> dict:
        a = run.args
        return dict(
            params=dict(seq=a.seq, heads=a.heads, head_dim=a.head_dim, P=run.world,
                        trials=a.trials, iters=a.iters, seed=a.seed, rel_tol=REL_TOL,
                        tuned=a.tune, eager_methods=a.eager, settle_s=a.settle_s),
            config=self.cfg, tuning=self.tuning, timing=TIMING, layout=LAYOUT,
            versions=dict(torch=torch.__version__, triton=triton.__version__,
                          cuda=torch.version.cuda,
                          nccl=".".join(map(str, torch.cuda.nccl.version())),
                          cudnn=torch.backends.cudnn.version()),
            raw=self.raw)


@dataclass
class FaOnlyCase:
    """One M of ``--fa-only``: fresh q, k, v and their float32 reference; after ``check``, the
    methods it times, the output each candidate writes (``outputs``) and ``epilogue`` (the P = 2
    receive buffers on this GPU that ``+remote`` methods store into, kept as long as their table
    is used)."""

    point: dict
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ref: torch.Tensor | None
    methods: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    epilogue: tuple = ()


class FaTuning(Experiment):
    """``--fa-only`` (one process, one GPU): FA-only (LOCAL epilogue) of every
    ``fa_only_candidates`` configuration against torch SDPA on cuDNN, H = ``--heads`` local heads.

    Per M: fresh random q, k, v; each candidate's output (poisoned with NaN first) and cuDNN's
    within ``REL_TOL`` of the float32 reference, else the candidate is skipped with the reason
    (cuDNN failing aborts), as is one whose kernel does not run on this GPU
    (``ulysses.kernel_unsupported``). Then one ``time_methods`` over the candidates and cuDNN:
    CUDA graphs of ``iters`` calls, rotated order, ``trials`` trials, the SM clock read per trial.
    Rows: one per M and method."""

    name = "fa_tuning"
    paper = "issue 3: FA-only configurations against cuDNN on one GPU; timing §5.1"
    launch = "in_process"
    links = ("local",)  # one GPU, its own memory

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--fa-only", action="store_true",
                       help="this mode: one process, no torchrun: time the FA-only "
                            "configurations against cuDNN")
        add_shape_arguments(p, FA_ONLY_SEQ, FA_ONLY_HEADS, "heads on the GPU")
        p.add_argument("--configs", **list_option(default=[], nargs="*",
                       help="configuration names (``config_name``) to time instead of all"))
        p.add_argument("--epilogues", action="store_true",
                       help="also time each configuration's REMOTE epilogue, fenced and not, into "
                            "P = 2 receive buffers on the same GPU (``+remote``, "
                            "``+remote_fenced``)")
        add_timing_arguments(p)

    def check_args(self, a: argparse.Namespace) -> None:
        check_shape_args(a)
        check_timing_args(a)
        known = {config_name(c): c for c in fa_only_candidates(a.head_dim)}
        unknown = set(a.configs) - set(known)
        if unknown:
            raise ValueError(f"--configs names unknown configurations {sorted(unknown)}; "
                             f"known at d={a.head_dim}: {sorted(known)}")
        a.candidates = {name: known[name] for name in a.configs} if a.configs else known

    def sweeps(self, args) -> list[Sweep]:
        return [shape_sweep(args, self.name)]

    def start(self, run: Run) -> None:
        require_safe_env()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        self.candidates = run.args.candidates
        self.checks, self.skipped, self.raw = [], {}, []

    def prepare(self, point: dict, run: Run) -> FaOnlyCase:
        M, H, d = point["M"], point["heads"], point["head_dim"]
        q, k, v = random_qkv(M, H, d, run.args.seed + M)
        return FaOnlyCase(point, q, k, v, att.reference_attention(q, k, v))

    def check(self, case: FaOnlyCase, run: Run) -> list[str]:
        """Each candidate into a poisoned output against the float32 reference (at the first M,
        its REMOTE epilogue against LOCAL too): a failing one is skipped; cuDNN failing fails."""
        args, skipped, checks = run.args, self.skipped, self.checks
        q, k, v, ref = case.q, case.k, case.v, case.ref
        seq_len, H, d = case.point["M"], case.point["heads"], case.point["head_dim"]
        if args.epilogues:
            case.epilogue = local_destination(seq_len, 2 * H, d, 2)
            table = case.epilogue[1]
        methods = case.methods
        for name, cfg in self.candidates.items():
            if name in skipped:
                continue
            if seq_len % max(cfg["BLOCK_M"], cfg["BLOCK_N"]):
                continue
            unsupported = att.kernel_unsupported(cfg["kernel"], q.device)
            if unsupported:
                skipped[name] = unsupported
                continue
            out = poisoned(q.shape, att.DTYPE, DEVICE)
            # progress first: a launch that never returns leaves its name as the last line
            print(f"[attention.bench --fa-only] M={seq_len}: checking {name}", file=sys.stderr,
                  flush=True)
            try:
                att.flash_attention(q, k, v, out=out, config=cfg)
                err = relative_error(out, ref)
            except triton.runtime.errors.OutOfResources as e:
                skipped[name] = f"out of resources: {e}"
                continue
            check = dict(M=seq_len, method=name, rel_err=err)
            if seq_len == args.seq[0]:
                check |= remote_epilogue_checks(q, k, v, out, cfg)
            checks.append(check)
            failed = [key for key, ok in check.items() if ok is False]
            if not err < REL_TOL or failed:
                skipped[name] = (f"M={seq_len}: relative error {err:.3g} against float32, "
                                 f"failed {failed}")
                continue
            methods[name] = (lambda out=out, cfg=cfg: att.flash_attention(q, k, v, out=out,
                                                                          config=cfg))
            case.outputs[name] = out
            if args.epilogues:
                # the Fused kernel's code (REMOTE epilogue, fenced or not) storing into P = 2
                # receive buffers on this GPU: its time against LOCAL's is the codegen's share
                # of any Fused-versus-FA difference, with no peer traffic
                for fenced in (False, True):
                    methods[f"{name}+remote{'_fenced' if fenced else ''}"] = (
                        lambda cfg=cfg, fenced=fenced: att.fused_attention_a2a(
                            q, k, v, table, 0, 2, config=cfg, fenced=fenced))
        err = relative_error(att.sdpa_cudnn(q, k, v), ref)
        checks.append(dict(M=seq_len, method="cudnn", rel_err=err))
        case.ref = None  # the float32 reference is not kept through the timing
        if not err < REL_TOL:
            return [f"cuDNN SDPA misses the float32 reference at M={seq_len}: relative error "
                    f"{err:.3g}"]
        methods["cudnn"] = lambda: att.sdpa_cudnn(q, k, v)
        return []

    def recheck(self, case: FaOnlyCase, run: Run) -> list[str]:
        """After the timing: each timed candidate once more into its output, poisoned first, and
        cuDNN, against the float32 reference (made again: ``check`` does not keep it)."""
        ref = att.reference_attention(case.q, case.k, case.v)
        failures = []
        for name, out in case.outputs.items():
            out.fill_(float("nan"))
            case.methods[name]()
            err = relative_error(out, ref)
            if not err < REL_TOL:
                failures.append(f"{name}: relative error {err:.3g} against float32 after timing")
        err = relative_error(att.sdpa_cudnn(case.q, case.k, case.v), ref)
        if not err < REL_TOL:
            failures.append(f"cuDNN SDPA: relative error {err:.3g} against float32 after timing")
        return failures

    def measure(self, case: FaOnlyCase, run: Run) -> list[dict]:
        args, methods = run.args, case.methods
        seq_len, H, d = case.point["M"], case.point["heads"], case.point["head_dim"]
        timing = time_methods(methods, trials=args.trials, warmup=1, graph_iters=args.iters,
                              clocks=True)
        flops = attention_flops(seq_len, H, d, 1)
        rows = [dict(M=seq_len, method=name, **r)
                for name, r in fa_only_ratios(timing, flops).items()]
        self.raw.append(dict(M=seq_len, order=[rotated_order(list(methods), t)
                                               for t in range(args.trials)],
                             trials_us={m: timing[m]["trials_us"] for m in methods},
                             sm_clock_mhz={m: timing[m]["sm_clock_mhz"] for m in methods}))
        torch.cuda.empty_cache()
        return rows

    def progress_line(self, rows) -> str:
        ours = rows[rows["method"].isin(list(self.candidates))]
        best = ours.loc[ours["tflops"].idxmax()]
        return (f"[attention.bench --fa-only] M={best['M']}: best {best['method']} "
                f"{best['tflops']:.0f} TF/s = {best['over_cudnn']:.3f} of cuDNN "
                f"(paired {best['over_cudnn_paired']:.3f})")

    def metadata(self, run: Run) -> dict:
        a = run.args
        return dict(created_utc=datetime.now(timezone.utc).isoformat(),  # tuning_records' order
                    params=dict(seq=a.seq, heads=a.heads, head_dim=a.head_dim, trials=a.trials,
                                iters=a.iters, seed=a.seed, rel_tol=REL_TOL,
                                epilogues=a.epilogues),
                    candidates=a.candidates, skipped=self.skipped, checks=self.checks,
                    raw=self.raw,
                    versions=dict(torch=torch.__version__, triton=triton.__version__,
                                  cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version()))


EXPERIMENT = UlyssesAttention()
FA_TUNING = FaTuning()


def experiment(argv: list[str]) -> Experiment:
    """What a command line runs: ``--fa-only`` the one-GPU ``FA_TUNING``, else Table 3."""
    return FA_TUNING if "--fa-only" in argv else EXPERIMENT


if __name__ == "__main__":
    harness.main(experiment(sys.argv[1:]))
