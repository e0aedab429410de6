"""Kernel-version probe: versions of the gluon_ws attention kernel compared in one run (record
``fa_kernel_probe``; ``data/records/fa_kernel_probe/README.md`` says what its records found).

    git show COMMIT:kernels/flash_attention_ws.py > gluon_ws_COMMIT.py
    python -m xstage_lab.experiments.probes.fa_kernel (--out FILE | --root DIR) \\
        --variant gluon_ws_COMMIT=gluon_ws_COMMIT.py [--builds] [--shapes 128:12:8192 ...]
        [--seed N] [--check-max-seq 16384] [--trials 10] [--graph-iters 5]

One GPU. Variants, each launched through the package's launchers (``attention.ulysses``: their
checks and grid) with ``kernel="gluon_ws"``:
  gluon_ws   ``kernels/flash_attention_ws.py`` as committed;
  NAME       the same launchers over FILE.py instead (another commit's kernel file).

Per shape (head dim d, local heads h, sequence length M), on seeded random inputs, checks first
(any failure aborts before timing), then ``dist_timing.time_methods`` (CUDA graphs of
``--graph-iters`` calls, ``--trials`` trials, order rotated, SM clock per trial) over one rotation:
- the kernels (``kernel_rows``): up to ``--check-max-seq``, every variant's LOCAL output
  (poisoned with NaN first) within ``attention.cases.REL_TOL`` of the float32 reference and
  bitwise equal to the committed kernel's; timed beside cuDNN (SDPA's cuDNN backend);
- ``--builds`` (``build_rows``): each variant's REMOTE builds, unfenced and fenced, into P = 2
  receive buffers on this GPU, bitwise equal to LOCAL where they land; every variant's LOCAL,
  REMOTE and FENCED builds timed, each against its own LOCAL.
One record, a row per (shape, method or build). An ``Experiment`` run in process by
``experiments.harness``: its ``Sweep`` is a point per shape.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from ...cli import list_option
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment
from .variants import file_digests, parse_variants

COMMITTED = ("gluon_ws",)
CONFIG = dict(kernel="gluon_ws")
# (head dim, local heads, M) and seed of each comparison's record: the kernels'
# (20261201T050017Z-b26c3e368d) and the builds' (--builds, 20261201T054236Z-1c869b8634)
DEFAULT_SHAPES = {False: ([(128, 12, M) for M in (8192, 16384, 32768, 49152, 65536)]
                          + [(128, 6, M) for M in (8192, 16384, 32768, 65536)]
                          + [(64, 12, M) for M in (16384, 32768)]),
                  True: [(128, 12, 16384), (128, 12, 32768), (128, 12, 65536), (64, 12, 16384)]}
DEFAULT_SEED = {False: 7, True: 5}


def parse_shape(text: str) -> tuple[int, int, int]:
    """``d:h:M`` -> (d, h, M); ValueError for a head dim the kernels lack or a size below 1."""
    from ...ops.attention import HEAD_DIMS

    try:
        d, h, M = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"shape {text!r}: expected HEAD_DIM:HEADS:SEQ, e.g. 128:12:8192") from None
    if d not in HEAD_DIMS or h < 1 or M < 1:
        raise ValueError(f"shape {text!r}: head dim must be one of {HEAD_DIMS}, heads and M >= 1")
    return d, h, M


def load_variant(name: str, path: Path):
    """The kernel file ``path`` imported as ``kernel_sources.KERNELS_PACKAGE.<name>`` (Triton's
    JIT resolves its globals through ``sys.modules``), so that its relative imports of the
    committed kernels' siblings resolve as the committed kernel's do."""
    from ...kernel_sources import KERNELS_PACKAGE, kernels_package

    kernels_package()
    qualified = f"{KERNELS_PACKAGE}.{name}"
    spec = importlib.util.spec_from_file_location(qualified, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    spec.loader.exec_module(module)
    return module


def kernel_rows(args, names: list[str], with_kernel, q, k, v) -> list[dict]:
    """One shape of the kernel comparison: each variant's LOCAL output checked (up to
    ``--check-max-seq``), then every variant and cuDNN timed in one rotation; a row per method."""
    import torch

    from ...checks import bitwise_equal, relative_error
    from ...dist_timing import paired_ratio, time_methods
    from ...ops import attention as att
    from ..attention.cases import REL_TOL, attention_flops

    M, h, d = q.shape
    bufs = {n: torch.full_like(q, float("nan")) for n in names}

    def run(n):
        return with_kernel(n, lambda: att.flash_attention(q, k, v, out=bufs[n], config=CONFIG))

    check = {}
    if M <= args.check_max_seq:
        ref = att.reference_attention(q, k, v)
        for n in names:
            run(n)
        torch.cuda.synchronize()
        check = {f"rel_err_{n}": relative_error(bufs[n], ref) for n in names}
        check |= {f"bitwise_equal_{n}": bitwise_equal(bufs[n], bufs[names[0]]) for n in names[1:]}
        bad = {key: val for key, val in check.items()
               if val is False or (key.startswith("rel_err") and not val < REL_TOL)}
        if bad:
            raise RuntimeError(f"check failed at d={d}, h={h}, M={M}; nothing was timed: {bad}")
    methods = {n: (lambda n=n: run(n)) for n in names}
    methods["cudnn"] = lambda: att.sdpa_cudnn(q, k, v)
    t = time_methods(methods, trials=args.trials, warmup=2, graph_iters=args.graph_iters,
                     clocks=True)
    flops = attention_flops(M, h, d, 1)
    print(d, h, M, {n: round(flops / t[n]["median_us"] / 1e6) for n in t}, file=sys.stderr,
          flush=True)
    return [dict(head_dim=d, heads=h, M=M, method=n, median_us=t[n]["median_us"],
                 p25_us=t[n]["p25_us"], p75_us=t[n]["p75_us"],
                 tflops=flops / t[n]["median_us"] / 1e6,
                 over_cudnn_paired=paired_ratio(t["cudnn"]["trials_us"], t[n]["trials_us"]),
                 trials_us=list(t[n]["trials_us"]), sm_clock_mhz=list(t[n]["sm_clock_mhz"]),
                 **check) for n in t]


def build_rows(args, names: list[str], with_kernel, q, k, v) -> list[dict]:
    """One shape of the build comparison (``--builds``): per variant, its REMOTE builds (unfenced
    and fenced, into P = 2 receive buffers on this GPU: no peer traffic) checked bitwise against
    LOCAL (``attention.cases.remote_epilogue_checks``), then every variant's LOCAL, REMOTE and
    FENCED builds timed in one rotation; a row per build with its paired excess over its LOCAL."""
    import pandas as pd
    import torch

    from ...dist_timing import time_methods
    from ...ops import attention as att
    from ..attention.cases import local_destination, remote_epilogue_checks

    M, h, d = q.shape
    recv, table = local_destination(M, 2 * h, d, 2)
    fa = att.flash_attention(q, k, v, config=CONFIG)
    methods, checks = {}, {}
    for n in names:
        checks[n] = with_kernel(n, lambda: remote_epilogue_checks(
            q, k, v, fa, att.flash_attention_config(d, CONFIG)))
        if not all(ok is True for ok in checks[n].values()):
            raise RuntimeError(f"check failed at d={d}, h={h}, M={M}; nothing was timed: {checks}")
        out = torch.empty_like(q)
        methods[f"{n}:local"] = lambda n=n, out=out: with_kernel(
            n, lambda: att.flash_attention(q, k, v, out=out, config=CONFIG))
        for fenced in (False, True):
            methods[f"{n}:{'fenced' if fenced else 'remote'}"] = (
                lambda n=n, fenced=fenced: with_kernel(n, lambda: att.fused_attention_a2a(
                    q, k, v, table, 0, 2, config=CONFIG, fenced=fenced)))
    t = time_methods(methods, trials=args.trials, warmup=2, graph_iters=args.graph_iters,
                     clocks=True)
    rows = []
    for method in t:
        n, build = method.split(":")
        local = pd.Series(t[f"{n}:local"]["trials_us"])
        rows.append(dict(head_dim=d, heads=h, M=M, kernel=n, build=build,
                         median_us=t[method]["median_us"], p25_us=t[method]["p25_us"],
                         p75_us=t[method]["p75_us"],
                         minus_local_paired_pct=float(((pd.Series(t[method]["trials_us"]) - local)
                                                       / local).median() * 100),
                         trials_us=list(t[method]["trials_us"]),
                         sm_clock_mhz=list(t[method]["sm_clock_mhz"]), **checks[n]))
    print(d, M, {r["kernel"] + ":" + r["build"]: round(r["minus_local_paired_pct"], 2)
                 for r in rows}, file=sys.stderr, flush=True)
    return rows


class KernelVersions(Experiment):
    """Versions of the gluon_ws attention kernel against the committed one, per shape."""

    name = "fa_kernel_probe"
    paper = "§5.2 attention kernel (versions compared in one run)"
    launch = "in_process"
    links = ("local",)  # one GPU, its own memory

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--variant", **list_option(
            default=[], metavar="NAME=FILE.py",
            help="other versions of kernels/flash_attention_ws.py"))
        p.add_argument("--builds", action="store_true",
                       help="compare each variant's LOCAL, REMOTE and FENCED builds, not the "
                            "kernels")
        p.add_argument("--shapes", **list_option(
            parse_shape, metavar="D:H:M", help="head dim, local heads and sequence length of "
                                               "each shape (default: the comparison's record's)"))
        p.add_argument("--seed", type=int, default=None, help="inputs (default: the record's)")
        p.add_argument("--check-max-seq", type=int, default=16384,
                       help="shapes up to this M are checked against float32 before timing")
        p.add_argument("--trials", type=int, default=10)
        p.add_argument("--graph-iters", type=int, default=5, help="calls per CUDA graph replay")

    def check_args(self, args: argparse.Namespace) -> None:
        args.variant = parse_variants(args.variant, COMMITTED, ".py")
        if not args.variant:
            raise ValueError("name at least one --variant to compare with the committed kernel")
        args.shapes = DEFAULT_SHAPES[args.builds] if args.shapes is None else args.shapes
        args.seed = DEFAULT_SEED[args.builds] if args.seed is None else args.seed
        if args.trials < 1 or args.graph_iters < 1:
            raise ValueError(f"--trials and --graph-iters must be >= 1, got {args.trials} and "
                             f"{args.graph_iters}")

    def sweeps(self, args) -> list[Sweep]:
        """A point per shape, in the given order (each shape's inputs follow the previous
        shape's from the one seed)."""
        return [Sweep("shapes", (Axis("shape", [dict(head_dim=d, heads=h, M=M)
                                                for d, h, M in args.shapes]),),
                      repeats=1, warmup=0)]

    def start(self, run) -> None:
        import torch

        from ...ops import attention as att

        self.kernels = {"gluon_ws": att._ws_kernels}
        self.kernels |= {name: load_variant(name, path) for name, path in run.args.variant.items()}
        torch.manual_seed(run.args.seed)

    def with_kernel(self, name, fn):
        """``fn()`` with kernel ``name`` in the package's launcher (its checks and grid)."""
        from ...ops import attention as att

        committed = att._ws_kernels
        att._ws_kernels = self.kernels[name]
        try:
            return fn()
        finally:
            att._ws_kernels = committed

    def prepare(self, point, run):
        """The shape's q, k, v (the previous shape's freed first)."""
        import torch

        from ...ops import attention as att

        torch.cuda.empty_cache()
        return tuple(torch.randn(point["M"], point["heads"], point["head_dim"], device="cuda",
                                 dtype=att.DTYPE) for _ in range(3))

    def measure(self, qkv, run) -> list[dict]:
        """The shape's rows: checks first (any failure raises before timing), then timing."""
        shape_rows = build_rows if run.args.builds else kernel_rows
        return shape_rows(run.args, list(self.kernels), self.with_kernel, *qkv)

    def metadata(self, run) -> dict:
        args = run.args
        return dict(variants=list(self.kernels), variant_files=file_digests(args.variant),
                    builds=args.builds, shapes=args.shapes, seed=args.seed, trials=args.trials,
                    graph_iters=args.graph_iters, check_max_seq=args.check_max_seq)


EXPERIMENT = KernelVersions()


if __name__ == "__main__":
    harness.main(EXPERIMENT)
