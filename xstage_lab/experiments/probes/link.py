"""Link probe: does a trickle of 16-byte remote stores cost the SMs clock under the power cap?

    torchrun --standalone --nproc_per_node=P -m xstage_lab.experiments.probes.link \\
        (--out FILE.json | --root DIR) [--M 32768] [--head-dim 128] [--heads 24] \\
        [--periods-us 2 20 200 2000] [--window-s 2.5] [--settle-s 1.0] [--rounds 3] [--seed 0] \\
        [--chunk I/N]
    python -m xstage_lab import-bench FILE.json --experiment link_probe

The ``fa_power_probe`` records found both GPUs of h200-x2 at the 700 W cap while FA-only, Fused
and Serial run, and Fused 1.9-3.7% below the SM clock of its same-code build storing locally
(``fa_same_code``). This probe asks whether NVLink activity as such costs that clock, whatever
the bytes: beside the same-code control, a one-warp kernel (``kernels/link_trickle.py``) stores
one 16-byte vector every 2-2000 µs, aimed at the peer's buffer (over NVLink) or, as the control,
at a buffer on the same GPU. Fused, Serial and the NCCL All-to-All alone run in the same windows,
each without a trickle (``declared_settings``).

An ``Experiment`` run by ``experiments.harness``: its ``Sweep`` is one axis of windows, (round,
setting) in each round's seeded order (``window_sweep``).
The trickle and the checks are ``link_checks``'s; the settings and windows ``link_windows``'s.

One process per GPU; at P = 1 it is a dry run (``dry_run`` in the output): the trickle's "peer" is
then the rank's own symmetric buffer and no store crosses NVLink.

1. Checks first, before the first window; any failure on any rank stops every rank before
   timing: Fused into the receive buffer poisoned with NaN, bitwise equal to Serial's output;
   the same-code control into P local buffers poisoned with NaN, bitwise equal to FA-only's
   rows; the trickle aimed at the peer and at a local buffer, each target poisoned, run once
   until its store limit (wrapping round the slots) and once until its deadline: each target
   holds exactly the words of the stores its sender reports, in the slots they went to, and
   poison elsewhere.
2. Windows. Per round, every setting once in an order shuffled with the seed. Per setting: the
   trickle (if any) is launched first on its own stream, then the workload runs back to back for
   ``--settle-s`` untimed and for ``--window-s`` between CUDA events (µs per call = elapsed /
   calls), while a thread reads NVML every 20 ms (SM clock, power, the energy counter,
   temperature, clock-event reasons). Rank 0's clock decides over a gloo group when a window ends
   (``run_window``): every rank runs the same calls, so every rank enters the same collectives.
Rank 0 writes the output: a header (arguments, settings, the trickle's design, the checks,
provenance) and rows, one per (round, setting, rank), ``order`` counting the windows of the run.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import asdict

import torch
import torch.distributed as dist

from ...checks import poisoned
from ...cli import list_option
from ...dist_timing import all_gather_objects
from ...sweep import Sweep
from .. import harness
from ...ops import attention as att
from ..attention.cases import local_destination, random_qkv
from ..harness import Experiment, Run
from .link_checks import DEVICE, TRICKLE_SLOTS, check_trickle, check_workloads, trickle_targets
from .link_windows import (DEFAULT_PERIODS_US, MAX_WINDOW_S, MIN_PERIOD_US, MIN_STORES_PER_WINDOW,
                           SAMPLE_S, SAMPLING, STEP_S, TRICKLES, WINDOW_CONTROL, WORKLOADS, Nvml,
                           Probe, broadcaster, declared_settings, step_calls_for, time_call_s,
                           window_sweep)


TRICKLE_DESIGN = dict(
    kernel="kernels/link_trickle.py link_trickle_kernel",
    programs=1, warps=1, store_bytes=16, slots=TRICKLE_SLOTS,
    stream="its own CUDA stream, launched before the setting's settle on an idle GPU, so it is "
           "resident throughout; it occupies one warp slot of one SM in peer and local alike",
    cadence="store i+1 is due period_ns of %globaltimer after store i was issued; store i writes "
            "the int32 words (i, source rank, slot, MAGIC) into slot i % slots",
    bounds="it stops at run_ns after its entry or after max_stores stores, whichever comes first",
    run="settle_s + window_s + TRICKLE_TAIL_S + four steps of calls, max_stores = run / period + "
        "1: it covers the window (trickle_covered) and the host waits for its end",
)


class LinkProbe(Experiment):
    """Windows of the same-code control beside the trickle, and of Fused, Serial and the NCCL
    All-to-All, each with the SM clock and power sampled."""

    name = "link_probe"
    paper = "§3.1 local control; the fa_power_probe records (Fused below fa_same_code's SM clock)"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--M", type=int, default=32768, help="sequence length M")
        p.add_argument("--head-dim", type=int, default=128, choices=att.HEAD_DIMS,
                       help="head dim d")
        p.add_argument("--heads", type=int, default=24, help="total heads H (divisible by P)")
        p.add_argument("--periods-us", **list_option(
            float, default=list(DEFAULT_PERIODS_US),
            help="the trickle's periods in µs, one store of 16 bytes each"))
        p.add_argument("--window-s", type=float, default=2.5, help="timed seconds per window")
        p.add_argument("--settle-s", type=float, default=1.0,
                       help="untimed seconds of the same setting before each window (at least "
                            "one step of calls)")
        p.add_argument("--rounds", type=int, default=3, help="rounds of every setting")
        p.add_argument("--seed", type=int, default=0, help="inputs and the order of each round")

    def check_args(self, args) -> None:
        """Raise ValueError for arguments no run could use (whether P divides the shape is the
        ranks' ``validate``)."""
        if not 0 < args.window_s <= MAX_WINDOW_S:
            raise ValueError(f"--window-s must be in (0, {MAX_WINDOW_S:g}], got {args.window_s:g}")
        if not 0 <= args.settle_s <= MAX_WINDOW_S:
            raise ValueError(f"--settle-s must be in [0, {MAX_WINDOW_S:g}], got "
                             f"{args.settle_s:g}")
        if args.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
        longest = args.window_s * 1e6 / MIN_STORES_PER_WINDOW
        for period in args.periods_us:
            if not (math.isfinite(period) and MIN_PERIOD_US <= period <= longest):
                raise ValueError(f"--periods-us {period:g}: each period must be in "
                                 f"[{MIN_PERIOD_US:g}, {longest:g}] µs (at least "
                                 f"{MIN_STORES_PER_WINDOW} stores per window)")
        if len(set(args.periods_us)) != len(args.periods_us):
            raise ValueError(f"--periods-us lists a period twice: {args.periods_us}")
        if args.M < 1 or args.heads < 1:
            raise ValueError(f"--M and --heads must be >= 1, got {args.M} and {args.heads}")
        tile = max(max(c["BLOCK_M"], c["BLOCK_N"])
                   for c in (att.flash_attention_config(args.head_dim, {"kernel": k})
                             for k in att.KERNELS))
        if args.M % tile:
            raise ValueError(f"--M {args.M} must be a multiple of the {tile}-row tiles")

    def sweeps(self, args) -> list[Sweep]:
        return [window_sweep(args)]

    def start(self, run: Run) -> None:
        """The buffers (receive, local control, trickle targets), NVML and the gloo group that
        carries the host's decisions; no launch yet."""
        a, rank, world = run.args, run.rank, run.world
        self.nccl = dist.group.WORLD
        self.gloo = dist.new_group(backend="gloo")
        self.settings = {s.name: s for s in declared_settings(a.periods_us)}
        self.cfg = att.flash_attention_config(a.head_dim, device=DEVICE)
        self.buf = att.symmetric_receive_buffer(a.M // world * a.heads * a.head_dim, self.nccl)
        self.local = local_destination(a.M, a.heads, a.head_dim, world)
        self.targets, self.sym = trickle_targets(rank, world)
        self.nvml, why = Nvml.open(torch.cuda.current_device())
        self.nvml_by_rank = all_gather_objects(why, self.gloo)
        self.checks, self.probe, self.steps = [], None, {}

    def validate(self, point: dict, run: Run) -> None:
        att.check_ulysses_shape(point["M"], point["heads"], run.world)

    def prepare(self, point: dict, run: Run) -> dict:
        """The run's inputs (made at its first window, once every window is validated) and
        FA-only's output of them."""
        self.inputs = run.resource("inputs", lambda: self.make_inputs(run))
        return point

    def make_inputs(self, run: Run) -> tuple:
        a = run.args
        q, k, v = random_qkv(a.M, a.heads // run.world, a.head_dim, a.seed + run.rank)
        out_fa = att.flash_attention(q, k, v, out=poisoned(q.shape, att.DTYPE, DEVICE),
                                     config=self.cfg)
        return q, k, v, out_fa

    def check(self, point: dict, run: Run) -> list[str]:
        """The run's checks, at its first window: every window runs the same inputs, kernels and
        buffers."""
        if self.checks:
            return []
        found = self._checks(run)
        self.checks = all_gather_objects(found, self.gloo)
        return found["workloads"]["failures"] + found["trickle"]["failures"]

    def recheck(self, point: dict, run: Run) -> list[str]:
        """The run's checks again after each setting's windows (outputs poisoned first, as at the
        first window)."""
        found = self._checks(run)
        return found["workloads"]["failures"] + found["trickle"]["failures"]

    def _checks(self, run: Run) -> dict:
        q, k, v, out_fa = self.inputs
        return dict(workloads=check_workloads(q, k, v, out_fa, self.cfg, self.buf, self.local,
                                              run.rank, run.world, self.nccl),
                    trickle=check_trickle(self.targets, self.sym, run.rank, self.gloo))

    def measure(self, point: dict, run: Run) -> list[dict]:
        """One window of the point's setting: every rank's row (rank 0 writes them)."""
        if self.probe is None:
            self.probe = self.make_probe(run)
        row = dict(round=point["round"]) | self.probe.run(self.settings[point["setting"]])
        return all_gather_objects(row, self.gloo)

    def make_probe(self, run: Run) -> Probe:
        """The checked workloads and the steps of calls rank 0 chose for them (at the first
        window, after the checks)."""
        a, rank, world, nccl, local = run.args, run.rank, run.world, self.nccl, self.local
        q, k, v, out_fa = self.inputs
        cfg, buf = self.cfg, self.buf
        recv_shape = (a.M // world, a.heads, a.head_dim)
        fa_out = torch.empty_like(out_fa)
        serial_out, a2a_out = (torch.empty(recv_shape, dtype=att.DTYPE, device=DEVICE)
                               for _ in range(2))
        workloads = {
            "fa_same_code": lambda: att.fused_attention_a2a(q, k, v, local[1], rank, world,
                                                            config=cfg),
            "fused": lambda: att.fused_attention_a2a(q, k, v, buf.peer_ptrs, rank, world,
                                                     config=cfg),
            "serial": lambda: att.nccl_a2a(att.flash_attention(q, k, v, out=fa_out, config=cfg),
                                           nccl, out=serial_out),
            "a2a_nccl": lambda: att.nccl_a2a(out_fa, nccl, out=a2a_out),
        }
        decide = broadcaster(self.gloo)
        step_s = {}
        for name, fn in workloads.items():
            call_s = time_call_s(fn)
            self.steps[name] = decide(step_calls_for(call_s))  # rank 0's measure decides
            step_s[name] = self.steps[name] * call_s
        return Probe(a, rank, workloads, self.steps, step_s, self.targets, self.nvml, decide)

    def progress_line(self, rows) -> str:
        row = rows.iloc[0]
        power = row["power_w_mean"]
        return (f"[probes.link] round {row['round']} {row['setting']}: "
                f"{row['us_per_call']:.1f} us/call, SM clock {row['sm_clock_mhz_median']} MHz, "
                f"power {'unknown' if power is None or power != power else f'{power:.0f} W'}")

    def metadata(self, run: Run) -> dict:
        """What ran and how (``import-bench`` keeps it as the record's parameters)."""
        a, world = run.args, run.world
        return dict(
            params=dict(M=a.M, heads=a.heads, head_dim=a.head_dim, P=world,
                        periods_us=a.periods_us, window_s=a.window_s, settle_s=a.settle_s,
                        rounds=a.rounds, seed=a.seed, step_s=STEP_S, sample_s=SAMPLE_S),
            dry_run=world == 1,
            dry_run_note=("P = 1: the trickle's peer is the rank's own symmetric buffer, so no "
                          "store crosses NVLink and peer and local differ only by buffer; Fused's "
                          "stores and the NCCL All-to-All stay on the GPU too")
            if world == 1 else None,
            settings=[dict(asdict(s), name=s.name) for s in declared_settings(a.periods_us)],
            workloads=WORKLOADS, trickles=TRICKLES, trickle=TRICKLE_DESIGN,
            window_control=WINDOW_CONTROL, sampling=SAMPLING,
            timing="CUDA events around each window's calls on every rank; us_per_call = elapsed / "
                   "calls; rows per (round, setting, rank), ``order`` the windows' order over "
                   "the run",
            config=self.cfg, checks_by_rank=self.checks,
            step_calls=self.steps, nvml_by_rank=self.nvml_by_rank,
            versions=dict(torch=torch.__version__, cuda=torch.version.cuda))


EXPERIMENT = LinkProbe()


if __name__ == "__main__":
    harness.main(EXPERIMENT)
