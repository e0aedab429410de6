"""Issue-time probe: what T_iss⁰ of the Burst–Gap kernels depends on (record ``issue_time_probe``;
``data/records/issue_time_probe/README.md`` says what its records found).

    python -m xstage_lab.experiments.probes.issue_time (--out FILE | --root DIR) [--repeats 11]
        [--burst-kib 4 8 16 32 64] [--variant NAME=FILE.cu ...]

One GPU, the local path: at backpressure-free points the issue time is the same on the local and
the remote path in every committed ``remote_store`` and ``remote_ops`` record, so T_iss⁰ is spent
on the issuing SM and the local path measures it. Variants, each at K = all SMs on isolated
bursts over fresh lines:
  burst_gap       ``burst_gap`` of ``kernels/remote_store_burst.cu`` as committed;
  ops_store16     ``burst_gap_ops`` with OP_STORE16 (``remote_store.ops``);
  burst_gap_NAME  ``burst_gap`` built from FILE.cu instead: a patched copy of the kernel source
                  (``params.patches`` names each file), compiled with the package's options.

An ``Experiment`` run in process by ``experiments.harness``:

1. Checks first: one point of every variant (which also compiles it and touches its buffer) and
   a fenced local point of ``burst_gap_fenced``, each through the bench's own destination check;
   every timed point is checked again by its launch.
2. Its ``Sweep``: every burst size × variant, ``--repeats`` rounds, each round's order rotated.
   One record, experiment ``issue_time_probe``, with provenance.
"""
from __future__ import annotations

import argparse
import sys

import pandas as pd

from ...cli import list_option
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment
from .variants import file_digests, parse_variants

DEFAULT_BURST_KIB = (4, 8, 16, 32, 64)
DEFAULT_REPEATS = 11


def local_point(producers: int, burst_bytes: int, mode: str = "isolated") -> dict:
    """A point of the local path on GPU 0: every burst aligned, fresh lines."""
    return dict(producers=producers, burst_bytes=burst_bytes, gap_us=0.0, mode=mode,
                path="local", src=0, dst=0, lines="fresh", align="each")


def variant_names(args: argparse.Namespace) -> list[str]:
    """The committed ``burst_gap``, each ``--variant``'s ``burst_gap_NAME``, ``ops_store16``."""
    return ["burst_gap", *(f"burst_gap_{name}" for name in args.variant), "ops_store16"]


class IssueTimeProbe(Experiment):
    """T_iss⁰ of every variant at K = all SMs of GPU 0, local isolated bursts."""

    name = "issue_time_probe"
    paper = "T_iss⁰ (§3.1): spent on the issuing SM"
    launch = "in_process"
    links = ("local",)  # one GPU, its own memory

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="rounds of every point")
        p.add_argument("--burst-kib", **list_option(int, default=list(DEFAULT_BURST_KIB),
                                                    help="burst sizes B per producer, KiB"))
        p.add_argument("--variant", **list_option(
            default=[], metavar="NAME=FILE.cu",
            help="burst_gap built from a patched copy of kernels/remote_store_burst.cu"))

    def check_args(self, args: argparse.Namespace) -> None:
        args.variant = parse_variants(args.variant, (), ".cu")
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        if any(b < 1 for b in args.burst_kib) or len(set(args.burst_kib)) != len(args.burst_kib):
            raise ValueError(f"--burst-kib must be distinct sizes >= 1, got {args.burst_kib}")

    def sweeps(self, args) -> list[Sweep]:
        """Every burst size × variant, ``--repeats`` rounds in rotated order; no warm-up launch
        (every variant's checked launch comes first, ``prepare``)."""
        return [Sweep("issue_time", (Axis("burst_bytes", [kib * 1024 for kib in args.burst_kib]),
                                     Axis("variant", variant_names(args))),
                      repeats=args.repeats, warmup=0)]

    def start(self, run) -> None:
        import cupy as cp  # the cuda backend only

        from ...kernel_sources import cuda_options
        from ...ops.remote_store.burst import RemoteStoreBench
        from ...ops.remote_store.operations import RemoteOpsBench

        self.bench = RemoteStoreBench()
        self.benches = {"burst_gap": (self.bench, {})}
        for name, path in run.args.variant.items():
            patched = RemoteStoreBench()
            with cp.cuda.Device(0):  # the variant's burst_gap in place of the committed one
                patched._modules[0] = cp.RawModule(code=path.read_text(), options=cuda_options())
            self.benches[f"burst_gap_{name}"] = (patched, {})
        self.benches["ops_store16"] = (RemoteOpsBench(), dict(routes="0>0", op="store16"))
        self.K = self.bench.inv.gpus[0].sm_count
        self.checked = False

    def launch_of(self, point: dict):
        """The bench of ``point``'s variant and the point it launches."""
        bench, extra = self.benches[point["variant"]]
        return bench, dict(local_point(self.K, point["burst_bytes"]), **extra)

    def validate(self, point, run) -> None:
        bench, p = self.launch_of(point)
        bench.validate(p)

    def prepare(self, point, run):
        """Before the first timed launch (every point validated): one launch of every variant
        (which also compiles it and touches its buffer) and a fenced local point of
        ``burst_gap_fenced``, each through the bench's own destination check."""
        if not self.checked:
            for variant in self.benches:
                bench, p = self.launch_of(dict(point, variant=variant))
                bench.measure(p)
            self.bench.measure(local_point(self.K, point["burst_bytes"], mode="fenced"))
            self.checked = True
        return point

    def measure(self, point, run) -> pd.DataFrame:
        bench, p = self.launch_of(point)
        return bench.measure(p)

    def finish(self, table, run) -> pd.DataFrame:
        """The steady bursts; their text columns but ``variant`` left out."""
        table = table[~table["warmup"]]
        summary = table.groupby(["variant", "burst_bytes"])["t_iss_us"].median().unstack()
        print(summary.round(4).to_string(), file=sys.stderr)
        return table.drop(columns=[c for c in table.columns
                                   if table[c].dtype == object and c != "variant"])

    def metadata(self, run) -> dict:
        args = run.args
        return dict(variants=variant_names(args), producers=self.K,
                    burst_bytes=[kib * 1024 for kib in args.burst_kib], repeats=args.repeats,
                    mode="isolated", path="local", patches=file_digests(args.variant),
                    kernels="as committed")


EXPERIMENT = IssueTimeProbe()


if __name__ == "__main__":
    harness.main(EXPERIMENT)
