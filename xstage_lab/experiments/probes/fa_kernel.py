"""Kernel-version probe: versions of the gluon_ws attention kernel compared in one run (record
``fa_kernel_probe``; ``data/records/fa_kernel_probe/README.md`` says what its records found).

    git show COMMIT:kernels/flash_attention_ws.py > gluon_ws_COMMIT.py
    python -m xstage_lab.experiments.probes.fa_kernel --root DIR \\
        --variant gluon_ws_COMMIT=gluon_ws_COMMIT.py [--shapes 128:12:8192 ...]
        [--check-max-seq 16384] [--trials 10] [--graph-iters 5]

One GPU. Variants, each launched through ``attention.ulysses.flash_attention`` (its checks and
grid) with ``kernel="gluon_ws"``:
  gluon_ws   ``kernels/flash_attention_ws.py`` as committed;
  NAME       the same launcher over FILE.py instead (another commit's kernel file);
and cuDNN (SDPA's cuDNN backend) beside them.

Per shape (head dim d, local heads h, sequence length M), on seeded random inputs:
1. Check first, up to ``--check-max-seq``: every variant into an output poisoned with NaN, within
   ``attention.bench.REL_TOL`` of the float32 reference and bitwise equal to the committed
   kernel's output; any failure aborts before timing.
2. ``dist_timing.time_methods``: CUDA graphs of ``--graph-iters`` calls, ``--trials`` trials,
   order rotated, SM clock per trial. One record, one row per (shape, method).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from ...records import RECORDS_DIR
from .variants import file_digests, parse_variants

EXPERIMENT = "fa_kernel_probe"
COMMITTED = ("gluon_ws",)
CONFIG = dict(kernel="gluon_ws")
# The shapes of record 20261201T050017Z-b26c3e368d: (head dim, local heads, M)
DEFAULT_SHAPES = ([(128, 12, M) for M in (8192, 16384, 32768, 49152, 65536)]
                  + [(128, 6, M) for M in (8192, 16384, 32768, 65536)]
                  + [(64, 12, M) for M in (16384, 32768)])
SEED = 7


def parse_shape(text: str) -> tuple[int, int, int]:
    """``d:h:M`` -> (d, h, M); ValueError for a head dim the kernels lack or a size below 1."""
    from ..attention.ulysses import HEAD_DIMS

    try:
        d, h, M = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"shape {text!r}: expected HEAD_DIM:HEADS:SEQ, e.g. 128:12:8192") from None
    if d not in HEAD_DIMS or h < 1 or M < 1:
        raise ValueError(f"shape {text!r}: head dim must be one of {HEAD_DIMS}, heads and M >= 1")
    return d, h, M


def load_variant(name: str, path: Path):
    """The kernel file ``path`` imported as module ``name`` (Triton's JIT resolves its globals
    through ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, checked before any CUDA work; a bad one exits with code 2 and one line."""
    p = argparse.ArgumentParser(prog="fa_kernel", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=RECORDS_DIR, help="records root to write into")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FILE.py",
                   help="another version of kernels/flash_attention_ws.py")
    p.add_argument("--shapes", nargs="+", metavar="D:H:M",
                   default=[f"{d}:{h}:{M}" for d, h, M in DEFAULT_SHAPES],
                   help="head dim, local heads and sequence length of each shape")
    p.add_argument("--check-max-seq", type=int, default=16384,
                   help="shapes up to this M are checked against float32 before timing")
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--graph-iters", type=int, default=5, help="calls per CUDA graph replay")
    args = p.parse_args(argv)
    try:
        args.variant = parse_variants(args.variant, COMMITTED, ".py")
        if not args.variant:
            raise ValueError("name at least one --variant to compare with the committed kernel")
        args.shapes = [parse_shape(s) for s in args.shapes]
        if args.trials < 1 or args.graph_iters < 1:
            raise ValueError(f"--trials and --graph-iters must be >= 1, got {args.trials} and "
                             f"{args.graph_iters}")
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import pandas as pd
    import torch

    from ...checks import bitwise_equal, relative_error
    from ...dist_timing import time_methods
    from ...platform import platform_key, provenance
    from ...records import write_record
    from ..attention import ulysses as att
    from ..attention.bench import REL_TOL, attention_flops

    kernels = {"gluon_ws": att._ws_kernels}
    kernels |= {name: load_variant(name, path) for name, path in args.variant.items()}

    def run(name, q, k, v, o):
        """One launch of kernel ``name`` through the package's launcher (its checks and grid)."""
        committed = att._ws_kernels
        att._ws_kernels = kernels[name]
        try:
            att.flash_attention(q, k, v, out=o, config=CONFIG)
        finally:
            att._ws_kernels = committed

    rows = []
    torch.manual_seed(SEED)
    for d, h, M in args.shapes:
        q, k, v = (torch.randn(M, h, d, device="cuda", dtype=att.DTYPE) for _ in range(3))
        bufs = {n: torch.full_like(q, float("nan")) for n in kernels}
        check = {}
        if M <= args.check_max_seq:
            ref = att.reference_attention(q, k, v)
            for n in kernels:
                run(n, q, k, v, bufs[n])
            torch.cuda.synchronize()
            check = {f"rel_err_{n}": relative_error(bufs[n], ref) for n in kernels}
            check |= {f"bitwise_equal_{n}": bitwise_equal(bufs[n], bufs["gluon_ws"])
                      for n in args.variant}
            bad = {key: val for key, val in check.items()
                   if val is False or (key.startswith("rel_err") and not val < REL_TOL)}
            if bad:
                raise RuntimeError(f"check failed at d={d}, h={h}, M={M}; nothing was timed "
                                   f"for it: {bad}")
            del ref
        methods = {n: (lambda n=n: run(n, q, k, v, bufs[n])) for n in kernels}
        methods["cudnn"] = lambda: att.sdpa_cudnn(q, k, v)
        t = time_methods(methods, trials=args.trials, warmup=2, graph_iters=args.graph_iters,
                         clocks=True)
        flops = attention_flops(M, h, d, 1)
        for n in t:
            rows.append(dict(head_dim=d, heads=h, M=M, method=n, median_us=t[n]["median_us"],
                             p25_us=t[n]["p25_us"], p75_us=t[n]["p75_us"],
                             tflops=flops / t[n]["median_us"] / 1e6,
                             over_cudnn_paired=float(pd.Series(t["cudnn"]["trials_us"]).div(
                                 pd.Series(t[n]["trials_us"])).median()),
                             trials_us=list(t[n]["trials_us"]),
                             sm_clock_mhz=list(t[n]["sm_clock_mhz"]), **check))
        print(d, h, M, {n: round(flops / t[n]["median_us"] / 1e6) for n in t}, file=sys.stderr,
              flush=True)
        torch.cuda.empty_cache()
    prov = provenance()
    path = write_record(EXPERIMENT, platform_key(prov["gpu_name"], prov["gpu_count"]),
                        pd.DataFrame(rows),
                        dict(variants=list(kernels), variant_files=file_digests(args.variant),
                             shapes=args.shapes, trials=args.trials,
                             graph_iters=args.graph_iters, check_max_seq=args.check_max_seq),
                        prov, root=args.root)
    print(f"[fa_kernel] wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
