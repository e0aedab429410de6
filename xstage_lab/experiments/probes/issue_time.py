"""Issue-time probe: what T_iss⁰ of the Burst–Gap kernels depends on (record ``issue_time_probe``;
``data/records/issue_time_probe/README.md`` says what its records found).

    python -m xstage_lab.experiments.probes.issue_time --root DIR [--repeats 11]
        [--burst-kib 4 8 16 32 64] [--variant NAME=FILE.cu ...]

One GPU, the local path: at backpressure-free points the issue time is the same on the local and
the remote path in every committed ``remote_store`` and ``remote_ops`` record, so T_iss⁰ is spent
on the issuing SM and the local path measures it. Variants, each at K = all SMs on isolated
bursts over fresh lines:
  burst_gap       ``burst_gap`` of ``kernels/remote_store_burst.cu`` as committed;
  ops_store16     ``burst_gap_ops`` with OP_STORE16 (``remote_store.ops``);
  burst_gap_NAME  ``burst_gap`` built from FILE.cu instead: a patched copy of the kernel source
                  (``params.patches`` names each file), compiled with the package's options.

1. Checks first: one point of every variant (which also compiles it and touches its buffer) and
   a fenced local point of ``burst_gap_fenced``, each through the bench's own destination check;
   every timed point is checked again by its launch.
2. ``--repeats`` rounds; per round every burst size, the variants in an order rotated by the
   round (``schedule``). One record, experiment ``issue_time_probe``, with provenance.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from ...platform import platform_key, provenance
from ...records import RECORDS_DIR, write_record
from .variants import file_digests, parse_variants

EXPERIMENT = "issue_time_probe"
DEFAULT_BURST_KIB = (4, 8, 16, 32, 64)
DEFAULT_REPEATS = 11


def local_point(producers: int, burst_bytes: int, mode: str = "isolated") -> dict:
    """A point of the local path on GPU 0: every burst aligned, fresh lines."""
    return dict(producers=producers, burst_bytes=burst_bytes, gap_us=0.0, mode=mode,
                path="local", src=0, dst=0, lines="fresh", align="each")


def schedule(variants: list[str], burst_bytes: list[int], repeats: int):
    """(repeat, B, position, variant) in run order: per repeat every B, the variants rotated by
    the repeat so that none always runs after the same one."""
    for rep in range(repeats):
        for B in burst_bytes:
            for i in range(len(variants)):
                yield rep, B, i, variants[(i + rep) % len(variants)]


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, checked before any CUDA work; a bad one exits with code 2 and one line."""
    p = argparse.ArgumentParser(prog="issue_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=RECORDS_DIR, help="records root to write into")
    p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="rounds of every point")
    p.add_argument("--burst-kib", type=int, nargs="+", default=list(DEFAULT_BURST_KIB),
                   help="burst sizes B per producer, KiB")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FILE.cu",
                   help="burst_gap built from a patched copy of kernels/remote_store_burst.cu")
    args = p.parse_args(argv)
    try:
        args.variant = parse_variants(args.variant, (), ".cu")
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        if any(b < 1 for b in args.burst_kib) or len(set(args.burst_kib)) != len(args.burst_kib):
            raise ValueError(f"--burst-kib must be distinct sizes >= 1, got {args.burst_kib}")
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import cupy as cp  # the cuda backend only

    from ...kernel_sources import cuda_options
    from ..remote_store.characterization import RemoteStoreBench
    from ..remote_store.ops import RemoteOpsBench

    bench = RemoteStoreBench()
    benches = {"burst_gap": bench}
    for name, path in args.variant.items():
        patched = benches[f"burst_gap_{name}"] = RemoteStoreBench()
        with cp.cuda.Device(0):  # the variant's burst_gap in place of the committed one
            patched._modules[0] = cp.RawModule(code=path.read_text(), options=cuda_options())
    ops = RemoteOpsBench()
    K = bench.inv.gpus[0].sm_count
    burst_bytes = [kib * 1024 for kib in args.burst_kib]
    variants = {name: (lambda B, b=b: b.measure(local_point(K, B)))
                for name, b in benches.items()}
    variants["ops_store16"] = lambda B: ops.measure(dict(local_point(K, B), routes="0>0",
                                                         op="store16"))
    for measure in variants.values():  # checked, compiled and first touched before any timing
        measure(burst_bytes[0])
    bench.measure(local_point(K, burst_bytes[0], mode="fenced"))

    frames = []
    for rep, B, i, name in schedule(list(variants), burst_bytes, args.repeats):
        rows = variants[name](B)
        frames.append(rows.assign(variant=name, burst_bytes=B, repeat=rep, position=i))
    table = pd.concat(frames, ignore_index=True)
    table = table[~table["warmup"]]
    summary = table.groupby(["variant", "burst_bytes"])["t_iss_us"].median().unstack()
    print(summary.round(4).to_string(), file=sys.stderr)
    inv = bench.inv
    params = dict(variants=list(variants), producers=K, burst_bytes=burst_bytes,
                  repeats=args.repeats, mode="isolated", path="local",
                  patches=file_digests(args.variant), kernels="as committed")
    path = write_record(EXPERIMENT, platform_key(inv.gpus[0].name, len(inv.gpus)),
                        table.drop(columns=[c for c in table.columns
                                            if table[c].dtype == object and c != "variant"]),
                        params, provenance(inv), root=args.root)
    print(f"[issue_time] wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
