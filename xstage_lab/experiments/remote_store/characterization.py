"""Remote-store characterization (paper §3, Fig. 3): the Burst–Gap microbenchmark on live GPUs.

    python -m xstage_lab.experiments.remote_store.characterization (--out FILE | --root DIR) \\
        [--link nvlink|host] [--repeats 11] [--src 0] [--dst 1] [--only drain_rate,gap,...]

``kernels/remote_store_burst.cu`` runs K producers (one CTA per SM) that repeatedly store B bytes
each with 16-byte stores into a destination buffer, then spin for a gap G. Its host side (a
point's contract, the CuPy launch, the checks, the rows per burst) is ``ops.remote_store.burst``;
this module declares the sweeps and the experiment. What is read of its records (the
calibration, ``Characterization``) is ``analysis.remote_store.characterization``.

Links (``--link``): ``nvlink`` stores into a peer GPU's buffer; ``host`` into pinned host memory
mapped for the device (``platform.mapped_host_buffer``, on the GPU's NUMA node), across PCIe, a
path every GPU has: its records are the platform ``<gpu>-host``, its sweeps scaled to the slower
link, and the copy engine's device-to-host rate is measured in the same run as R's baseline. What
the producers stored into host memory is checked on the device after every launch and read back
and checked on the CPU before each point is timed (``check_host_destination``).

Modes: ``periodic`` (burst, gap, burst, ...), ``isolated`` (each burst after a recovery gap long
enough to drain it) and ``fenced`` (periodic, but each producer waits for its burst to be visible
at the destination before the gap: the completion-coupled counterfactual); on the host link also
``under_load`` (``kernels/host_store_load.cu``, host side ``ops.remote_store.under_load``):
sustained host stores beside a concurrent memory-bound load in one launch, for R under load and
how much the backpressured link slows the load, and ``under_gemm`` (host side
``ops.remote_store.under_gemm``): the same stores on K SMs beside torch's bf16 matmul on the
others, for how much it slows a GEMM. Paths: ``remote`` (destination on a peer GPU) and ``local`` (the control: the
same code with the destination on the issuing GPU).

An ``Experiment`` run in process by ``experiments.harness``: its ``Sweep``s are
``characterization_sweeps`` (rows tagged with ``sweep``); the record is ``remote_store``, or
``remote_store_partial`` where ``--only`` leaves out a sweep the calibration needs.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ...analysis.remote_store.characterization import Characterization, write_calibration
from ...calibration import BenchSettings, link_settings
from ...cli import list_option
from ...ops.remote_store.burst import (ALIGNS, BURST_RESOLUTION, HOST, KIB, LINES, PATHS,
                                       RemoteStoreBench, check_gpus)
from ...ops.remote_store.under_gemm import GEMMS, GemmBesideStores, GemmSettings
from ...ops.remote_store.under_gemm import MODE as UNDER_GEMM
from ...ops.remote_store.under_gemm import validate_gemm_point
from ...ops.remote_store.under_load import MODE as UNDER_LOAD
from ...ops.remote_store.under_load import HostLoadProbe, LoadSettings, validate_load_point
from ...platform import LINKS, LinkError, inventory
from ...records import RECORDS_DIR
from ...sweep import Axis, Sweep
from .. import harness
from ..harness import Experiment

# The sweeps M_X is fitted from (calibration.calibrate).
CALIBRATION_SWEEPS = ("drain_rate", "gap", "isolated")


def KIBS(*kib: int) -> list[int]:
    return [k * KIB for k in kib]


def host_link_sweeps(sm_count: int, src: int = 0, repeats: int = 11,
                     settings: BenchSettings = link_settings("host")) -> list[Sweep]:
    """The Fig. 3 sweeps on the host link (stores into pinned host memory, ``dst = HOST``),
    scaled to a drain some ten times slower than NVLink's: smaller bursts in the gap and fenced
    sweeps with gaps out to several V/R, so that each burst size reaches its recovered plateau;
    isolated bursts at every K of the NVLink sweep (K = all SMs, 1/2, 1/4, 1/8) and B out to a
    burst volume of half the buffer, far enough to find a knee set by a capacity of tens of MiB;
    and ``row_chunks``, R and Q of the fused MoE's Combine row patterns (the host-link MoE
    forecast's M_X); ``under_load`` (``under_load_sweep``) and ``under_gemm``
    (``under_gemm_sweep``). No ``pairs`` sweep: a GPU has one host link."""
    K = sm_count
    Ks = sorted({max(1, K // 8), max(1, K // 4), max(1, K // 2), K})
    fixed = dict(src=src, dst=HOST, lines="fresh")
    gaps = [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 24.0, 32.0, 40.0, 48.0,
            64.0, 96.0, 128.0]
    largest = settings.buffer_bytes // 2
    isolated_b = KIBS(1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048,
                      3072, 4096, 6144)
    return [
        Sweep("drain_rate", (Axis("align", ALIGNS), Axis("producers", Ks),
                             Axis("burst_bytes", KIBS(8, 16, 32, 64, 128, 256))),
              fixed=dict(fixed, mode="periodic", path="remote", gap_us=0.0), repeats=repeats),
        Sweep("gap", (Axis("path", PATHS), Axis("burst_bytes", KIBS(2, 4, 8, 16)),
                      Axis("gap_us", gaps)),
              fixed=dict(fixed, mode="periodic", producers=K, align="first"), repeats=repeats),
        Sweep("isolated", (Axis("path", PATHS),
                           Axis("shape", [{"producers": k, "burst_bytes": b} for k in Ks
                                          for b in isolated_b if k * b <= largest])),
              fixed=dict(fixed, mode="isolated", gap_us=0.0, align="each"), repeats=repeats),
        Sweep("fenced", (Axis("path", PATHS), Axis("burst_bytes", KIBS(2, 4, 8, 16)),
                         Axis("gap_us", [0.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0])),
              fixed=dict(fixed, mode="fenced", producers=K, align="each"), repeats=repeats),
        Sweep("lines", (Axis("lines", LINES), Axis("burst_bytes", KIBS(32, 128))),
              fixed=dict(src=src, dst=HOST, mode="periodic", path="remote", gap_us=0.0,
                         producers=K, align="first"), repeats=repeats),
        row_chunk_sweep(K, src, HOST, repeats),
        under_load_sweep(K, src, repeats),
        under_gemm_sweep(K, src, repeats),
    ]


def combine_row_patterns() -> list[dict]:
    """The Combine epilogue's store patterns of the model shapes (``ops.moe``): per Linear-2 tile,
    ``block_m`` rows of one ``block_n2``-column chunk of bf16 each, at the row pitch of a
    ``hidden``-column Combine row; the contiguous burst first, as the reference."""
    from ...ops.moe.shapes import PRECISIONS, load_shapes
    from ...ops.moe.tiles import default_tile_config

    patterns = [(0, 0)]
    for shape in load_shapes().values():
        for precision in PRECISIONS:
            cfg = default_tile_config(precision, "gluon_ws", hidden=shape.hidden)
            if (2 * cfg.block_n2, 2 * shape.hidden) not in patterns:
                patterns.append((2 * cfg.block_n2, 2 * shape.hidden))
    return [{"chunk_bytes": c, "row_bytes": r} for c, r in patterns]


def row_chunk_sweep(sm_count: int, src: int, dst: int, repeats: int) -> Sweep:
    """``row_chunks``: R and Q at K = all SMs for each Combine row pattern
    (``combine_row_patterns``): zero-gap periodic bursts up to a Linear-2 tile's 64 KiB per
    producer (R) and isolated bursts over B past the contiguous knee (Q, eq. 7)."""
    shapes = ([{"mode": "periodic", "burst_bytes": b, "align": "first"} for b in KIBS(16, 32, 64)]
              + [{"mode": "isolated", "burst_bytes": b, "align": "each"}
                 for b in KIBS(4, 8, 16, 24, 32, 48, 64, 96, 128)])
    return Sweep("row_chunks", (Axis("pattern", combine_row_patterns()), Axis("shape", shapes)),
                 fixed=dict(src=src, dst=dst, path="remote", lines="fresh", gap_us=0.0,
                            producers=sm_count), repeats=repeats)


def under_load_sweep(sm_count: int, src: int, repeats: int) -> Sweep:
    """``under_load`` (issue 26): sustained 16-byte stores into host memory beside a concurrent
    memory-bound load, in one launch (``ops.remote_store.under_load``), with the controls: the
    stores local, no stores (the load alone) and no load (the stores alone: R of this probe).
    Split layouts at K = 1/8, 1/4, 1/2 of the SMs storing (the others load: does the
    backpressured link slow other SMs?) and the shared layout, every SM storing and loading as
    the fused MoE kernel's SMs do, whose numbers the host-link MoE forecast takes."""
    ks = sorted({max(1, sm_count // 8), max(1, sm_count // 4), max(1, sm_count // 2)})
    shapes = ([{"layout": "split", "producers": k} for k in ks]
              + [{"layout": "shared", "producers": sm_count}])
    cases = [{"stores": "host", "load": 1}, {"stores": "host", "load": 0},
             {"stores": "local", "load": 1}, {"stores": "none", "load": 1}]
    return Sweep(UNDER_LOAD, (Axis("shape", shapes), Axis("case", cases)),
                 fixed=dict(src=src, dst=HOST, mode=UNDER_LOAD, gap_us=0.0), repeats=repeats)


def under_gemm_sweep(sm_count: int, src: int, repeats: int) -> Sweep:
    """``under_gemm`` (issue 26): torch's bf16 matmul of the MoE's per-expert GEMM shapes alone
    on every SM, and on the SMs left beside sustained 16-byte stores from K = 1/8, 1/4, 1/2 of
    the SMs into host memory (the X-Stage full) or, the control, into local memory
    (``ops.remote_store.under_gemm``)."""
    ks = sorted({max(1, sm_count // 8), max(1, sm_count // 4), max(1, sm_count // 2)})
    cases = ([{"stores": "none", "producers": 0}]
             + [{"stores": s, "producers": k} for k in ks for s in ("local", "host")])
    return Sweep(UNDER_GEMM, (Axis("gemm", list(GEMMS)), Axis("case", cases)),
                 fixed=dict(src=src, dst=HOST, mode=UNDER_GEMM, gap_us=0.0), repeats=repeats)


def characterization_sweeps(sm_count: int, n_gpus: int, src: int = 0, dst: int = 1,
                            repeats: int = 11) -> list[Sweep]:
    """The sweeps behind Fig. 3, declared as axes, for a GPU with ``sm_count`` SMs.

    - ``drain_rate`` (Fig. 3d): zero-gap periodic bursts over K/B decompositions.
    - ``gap`` (Figs. 3a, 3b): the gap sweep at K = all SMs, remote and the local control.
    - ``isolated`` (Fig. 3c): isolated bursts over B for several K, remote and local.
    - ``fenced``: the gap sweep with a system-scope fence after each burst (issue 8), aligned:
      a fenced burst leaves nothing outstanding, so the barrier before the next absorbs no wait
      and every burst is the aggregate V = K·B that the completion-coupled sum law describes.
    - ``lines``: fresh destination lines against rewriting the same lines (a known bias).
    - ``pairs``: zero-gap periodic bursts on every ordered GPU pair, for R per pair.
    """
    K = sm_count
    Ks = sorted({max(1, K // 8), max(1, K // 4), max(1, K // 2), K})
    common = dict(src=src, dst=dst, lines="fresh", align="each")
    return [
        Sweep("drain_rate", (Axis("align", ALIGNS), Axis("producers", Ks),
                             Axis("burst_bytes", [8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB,
                                                  128 * KIB, 256 * KIB])),
              fixed=dict(src=src, dst=dst, lines="fresh", mode="periodic", path="remote",
                         gap_us=0.0), repeats=repeats),
        Sweep("gap", (Axis("path", PATHS),
                      Axis("burst_bytes", [8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB]),
                      Axis("gap_us", [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0,
                                      12.0, 16.0, 24.0, 32.0, 48.0, 64.0])),
              fixed=dict(src=src, dst=dst, lines="fresh", mode="periodic", producers=K,
                         align="first"), repeats=repeats),
        Sweep("isolated", (Axis("path", PATHS), Axis("producers", Ks[-3:]),
                           Axis("burst_bytes", [k * KIB for k in (1, 2, 4, 8, 12, 16, 20, 24, 28,
                                                                  32, 36, 40, 48, 56, 64, 96, 128,
                                                                  192, 256)])),
              fixed=dict(common, mode="isolated", gap_us=0.0), repeats=repeats),
        Sweep("fenced", (Axis("path", PATHS),
                         Axis("burst_bytes", [8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB]),
                         Axis("gap_us", [0.0, 1.0, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0])),
              fixed=dict(src=src, dst=dst, lines="fresh", mode="fenced", producers=K,
                         align="each"), repeats=repeats),
        Sweep("lines", (Axis("lines", LINES), Axis("burst_bytes", [32 * KIB, 128 * KIB])),
              fixed=dict(src=src, dst=dst, mode="periodic", path="remote", gap_us=0.0,
                         producers=K, align="first"), repeats=repeats),
        Sweep("pairs", (Axis("route", [{"src": a, "dst": b} for a in range(n_gpus)
                                       for b in range(n_gpus) if a != b]),
                        Axis("burst_bytes", [64 * KIB, 256 * KIB])),
              fixed=dict(mode="periodic", path="remote", gap_us=0.0, producers=K, lines="fresh",
                         align="first"),
              repeats=max(3, repeats // 2)),
    ]


SWEEP_NAMES = (*(s.name for s in characterization_sweeps(1, 2)), "row_chunks", UNDER_LOAD,
               UNDER_GEMM)


class BurstGapCharacterization(Experiment):
    """The Fig. 3 sweeps (``characterization_sweeps``) on this machine's GPUs, one record.

    Each launch checks its destination buffer (poisoned first) and its barriers itself
    (``RemoteStoreBench.measure``): a point's first launch, its warm-up, fails the run before any
    of its repeats is kept."""

    name = "remote_store"
    in_measure_all = True
    paper = "§3, Fig. 3"
    launch = "in_process"
    resolution = BURST_RESOLUTION
    links = ("nvlink", "host")

    def add_arguments(self, p) -> None:
        p.add_argument("--link", default="nvlink",
                       help=f"where the remote stores go, one of {list(LINKS)}: a peer GPU, or "
                            "pinned host memory mapped for the GPU (one GPU suffices)")
        p.add_argument("--repeats", type=int, default=11)
        p.add_argument("--src", type=int, default=0)
        p.add_argument("--dst", type=int, default=1)
        p.add_argument("--only", **list_option(choices=SWEEP_NAMES, default=None,
                                               help="the sweeps to run (default: all)"))
        p.set_defaults(settings=None)  # run_characterization may pass others

    def check_args(self, a) -> None:
        if a.link not in LINKS:
            raise ValueError(f"--link must be one of {list(LINKS)}, got {a.link!r}")
        if a.settings is None:
            a.settings = link_settings(a.link)
        if a.repeats < 1:
            raise ValueError("--repeats must be >= 1")

    def sweeps(self, args) -> list[Sweep]:
        self.inv = inventory()
        host = args.link == "host"
        if not self.inv.gpus:
            raise LinkError(f"the {args.link} link needs a GPU; none is visible ({self.inv.error})")
        check_gpus(args.src, HOST if host else args.dst, self.inv)
        sms = self.inv.gpus[args.src].sm_count
        sweeps = (host_link_sweeps(sms, args.src, args.repeats, args.settings) if host else
                  characterization_sweeps(sms, len(self.inv.gpus), args.src, args.dst,
                                          args.repeats))
        if host and args.only is not None and "pairs" in args.only:
            raise ValueError("--only pairs: the host link has one route, no pairs sweep")
        if not host and args.only is not None and "row_chunks" in args.only:
            raise ValueError("--only row_chunks: the Combine row patterns are a host-link sweep")
        for probe in (UNDER_LOAD, UNDER_GEMM):
            if not host and args.only is not None and probe in args.only:
                raise ValueError(f"--only {probe}: the probe stores into host memory, a "
                                 f"host-link sweep")
        return [s for s in sweeps if args.only is None or s.name in args.only]

    def start(self, run) -> None:
        self.bench = RemoteStoreBench(run.args.settings, self.inv)
        self.probe = None  # the under-load probe, made at its first point
        self.gemm_probe = None  # the under-GEMM probe, likewise
        self.copy_engine = (self.bench.copy_engine_rate(run.args.src)
                            if run.args.link == "host" else None)

    def validate(self, point, run) -> None:
        if point["mode"] == UNDER_LOAD:
            validate_load_point(point, self.inv)
        elif point["mode"] == UNDER_GEMM:
            validate_gemm_point(point, self.inv)
        else:
            self.bench.validate(point)

    def _probe(self) -> HostLoadProbe:
        if self.probe is None:
            self.probe = HostLoadProbe(LoadSettings(), self.inv)
        return self.probe

    def _gemm_probe(self) -> GemmBesideStores:
        if self.gemm_probe is None:
            self.gemm_probe = GemmBesideStores(GemmSettings(), self.inv)
        return self.gemm_probe

    def sm_clock_mhz(self, run):
        return self.bench.sm_clock_mhz(run.args.src)

    def check(self, point, run) -> list[str]:
        """One launch of the point, its destination poisoned first and checked after (on the
        device, and for host memory read back on the CPU too), before any launch is timed."""
        try:
            if point["mode"] == UNDER_LOAD:
                self._probe().measure(point, check_stores=True)
            elif point["mode"] == UNDER_GEMM:
                self._gemm_probe().measure(point, check_stores=True)
            else:
                self.bench.measure(point, check_on_cpu=True)
        except RuntimeError as e:
            return [str(e)]
        return []

    def measure(self, point, run) -> pd.DataFrame | dict:
        if point["mode"] == UNDER_LOAD:
            return self._probe().measure(point)
        if point["mode"] == UNDER_GEMM:
            return self._gemm_probe().measure(point)
        return self.bench.measure(point)

    def finish(self, table, run) -> pd.DataFrame:
        # the calibration picks its sweeps by this column, also where ``--only`` names one
        return table if "sweep" in table else table.assign(sweep=run.args.only[0])

    def metadata(self, run) -> dict:
        args = run.args
        host = args.link == "host"
        facts = {"link": args.link, "settings": args.settings.__dict__, "src": args.src,
                 "dst": HOST if host else args.dst, "seed": int(self.bench.seed)}
        if host:
            facts |= {"host_memory": self.bench.host.numa, "copy_engine_d2h": self.copy_engine}
        if self.probe is not None:
            facts |= {"under_load_settings": self.probe.settings.__dict__,
                      "under_load_seed": self.probe.seed}
        if self.gemm_probe is not None:
            facts |= {"under_gemm_settings": self.gemm_probe.settings.__dict__,
                      "under_gemm_seed": self.gemm_probe.seed}
        return facts

    def link_args(self, link: str) -> list[str]:
        """The host link with the repeats of its committed calibration (7: its sweeps ran for
        241 s on one H200); NVLink with the default."""
        return ["--link", link, *(["--repeats", "7"] if link == "host" else [])]

    def record_name(self, args) -> str:
        """``remote_store`` where the run holds every sweep of ``CALIBRATION_SWEEPS``, else
        ``remote_store_partial``, which replay and calibration do not pick up."""
        complete = args.only is None or set(CALIBRATION_SWEEPS) <= set(args.only)
        return self.name if complete else "remote_store_partial"

    def derived(self, path, root) -> list[Path]:
        """The calibration fitted from a complete run's record."""
        return [write_calibration(path, root)] if path.parent.parent.name == self.name else []

    @classmethod
    def analyse(cls, record, root):
        return Characterization.from_record(record)


EXPERIMENT = BurstGapCharacterization()


def run_characterization(repeats: int = 11, src: int = 0, dst: int = 1,
                         only: tuple[str, ...] | None = None,
                         settings: BenchSettings | None = None, progress: bool = True,
                         root: Path = RECORDS_DIR, link: str = "nvlink") -> Path:
    """Run the Fig. 3 sweeps on this machine and save them as one ``remote_store`` record, or,
    where ``only`` leaves out a sweep the calibration needs, a ``remote_store_partial`` one (which
    replay and calibration do not pick up). Every point of every sweep is validated before the
    first launch. Returns the record's path."""
    args = harness.parse(EXPERIMENT, ["--root", str(root), "--link", link,
                                      "--repeats", str(repeats),
                                      "--src", str(src), "--dst", str(dst),
                                      *(["--only", ",".join(only)] if only is not None else []),
                                      *([] if progress else ["--no-progress"])])
    args.settings = settings or link_settings(link)
    return harness.run(EXPERIMENT, args)


if __name__ == "__main__":
    harness.main(EXPERIMENT)
