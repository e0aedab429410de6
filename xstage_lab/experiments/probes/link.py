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
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ...checks import bitwise_equal, poisoned
from ...dist_timing import all_gather_objects
from ...kernel_sources import load_kernel_module
from ...platform import symmetric_buffer
from ...sweep import Axis, Sweep
from .. import harness
from ...ops import attention as att
from ..attention.cases import local_destination, random_qkv
from ..harness import Experiment, Run

_kernels = load_kernel_module("link_trickle")

DEVICE = "cuda"  # the current CUDA device of this rank
DEFAULT_PERIODS_US = (2, 20, 200, 2000)
MIN_PERIOD_US = 1.0    # %globaltimer advances in steps of up to 1 µs: no shorter period resolves
MIN_STORES_PER_WINDOW = 10
MAX_WINDOW_S = 60.0    # keeps a trickle's store count (run / period) inside int32
STEP_S = 0.02          # the host agrees on the next step of calls about this often
SAMPLE_S = 0.02        # NVML reading period
TRICKLE_TAIL_S = 0.25  # the trickle outlives its window by this plus four steps (``trickle_run_s``)
TRICKLE_SLOTS = 4096   # 16-byte slots the trickle cycles through (64 KiB)
SLOT_WORDS = int(_kernels.SLOT_WORDS)
RESULT_FIELDS = int(_kernels.RESULT_FIELDS)
MAGIC = int(_kernels.MAGIC)
POISON = 0x7FC00000    # float32 NaN's bits, in the int32 words of a trickle target
MAX_STORES = 2 ** 31 - 1
CHECK_PERIOD_NS = 2000
# The checks' two runs: one stopped by its store limit (wrapping round the slots; its run_ns an
# int64), one by its deadline (~1000 stores, fewer than the slots; its run_ns an int32). Together
# they build both variants of the kernel, so no window waits on a compilation.
CHECK_RUNS = {"store_limit": dict(run_ns=10 ** 10, max_stores=TRICKLE_SLOTS + TRICKLE_SLOTS // 2),
              "deadline": dict(run_ns=2_000_000, max_stores=MAX_STORES)}

WORKLOADS = {
    "fa_same_code": "FA-only through the Fused kernel's own build (REMOTE epilogue) storing every "
                    "tile into P buffers on this GPU: Fused's code without its NVLink traffic",
    "fused": "X-Stage-Fused: each output tile stored into its owning rank's receive buffer; no "
             "barrier inside a window, so each rank's time per call is its own",
    "serial": "FA-only, then the NCCL All-to-All of its output",
    "a2a_nccl": "the NCCL All-to-All of FA-only's output, alone",
}
TRICKLES = {
    "none": "no trickle kernel",
    "peer": "the trickle into rank (r + 1) mod P's symmetric buffer, over NVLink (at P = 1 the "
            "rank's own buffer: a dry run)",
    "local": "the trickle into a buffer on this GPU: the control, the same kernel and cadence "
             "with no NVLink traffic",
}
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
WINDOW_CONTROL = ("rank 0's clock decides: before each step of calls, rank 0 broadcasts over a "
                  "gloo group how many calls to run next (0: the window is over), so every rank "
                  "runs the same calls and enters the same collectives; steps of about STEP_S "
                  "seconds, one step always queued on the GPU while the host agrees on the next")
SAMPLING = ("NVML on a thread every SAMPLE_S seconds from the window's start on the host to the "
            "end event's completion: median SM clock, mean and maximum power, the enforced power "
            "limit, the maximum temperature, the share of samples with each clock-event reason "
            "set, and energy_w = the energy counter's increase over the samples' span; energy "
            "per call = energy_w x us_per_call. None where NVML does not answer")
# NVML's clock-event reason bits (nvmlClocksEventReason*), the ones the power probes report.
CLOCK_EVENT_REASONS = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20,
                       "hw_thermal": 0x40, "hw_power_brake": 0x80}


@dataclass(frozen=True)
class Setting:
    """One window's load: a workload (``WORKLOADS``) and a trickle (``TRICKLES``) at
    ``period_us`` (None without a trickle)."""

    workload: str
    trickle: str = "none"
    period_us: float | None = None

    @property
    def name(self) -> str:
        if self.trickle == "none":
            return self.workload
        return f"{self.workload}+{self.trickle}@{self.period_us:g}us"


def declared_settings(periods_us) -> list[Setting]:
    """The settings of one round: the same-code control alone and beside the trickle at every
    period, aimed at the peer and at a local buffer; then Fused, Serial and the NCCL All-to-All,
    each without a trickle. 4 + 2 x len(periods_us) windows."""
    trickled = [Setting("fa_same_code", target, float(p))
                for p in periods_us for target in ("peer", "local")]
    return [Setting("fa_same_code"), *trickled, Setting("fused"), Setting("serial"),
            Setting("a2a_nccl")]


def round_order(settings: list[Setting], round_index: int, seed: int) -> list[Setting]:
    """The settings of round ``round_index`` in an order shuffled from (seed, round): the same on
    every rank, and no setting always after the same one (a cool window favours the next)."""
    order = list(settings)
    random.Random(f"{seed}:{round_index}").shuffle(order)
    return order


def run_window(window_s: float, step_calls: int, *, leader: bool, clock: Callable[[], float],
               decide: Callable[[int], int], launch: Callable[[int], None]) -> int:
    """Run steps of calls until the leader's clock says ``window_s`` seconds have passed; returns
    the calls run, the same on every rank.

    Before each step every rank calls ``decide`` (a broadcast from the leader) with its own
    proposal; only the leader's counts: ``step_calls`` while its window lasts (always for the
    first step), then 0, which ends the window on every rank at the same step. ``launch(n)`` runs
    the step's n calls. A rank's own clock decides nothing: where it did, one rank could stop
    while the other waited in a collective the first never entered."""
    start = clock()
    calls = 0
    while True:
        more = leader and (calls == 0 or clock() - start < window_s)
        n = decide(step_calls if more else 0)
        if n == 0:
            return calls
        launch(n)
        calls += n


def step_calls_for(call_s: float, step_s: float = STEP_S) -> int:
    """Calls per step of about ``step_s`` seconds, at least one."""
    return max(1, round(step_s / call_s)) if call_s > 0 else 1


def trickle_run_s(settle_s: float, window_s: float, step_s: float) -> float:
    """How long a setting's trickle runs: its settle and window, plus the host's lag behind the
    GPU (up to two steps queued) with room to spare, so it covers the whole window."""
    return settle_s + window_s + TRICKLE_TAIL_S + 4 * step_s


def expected_slots(issued: int, slots: int, source: int) -> torch.Tensor:
    """What a poisoned trickle target of ``slots`` slots holds after ``issued`` stores from rank
    ``source``: int32 [slots, 4], slot s the words (i, source, s, MAGIC) of the last store i with
    i % slots == s, ``POISON`` in slots no store reached."""
    out = torch.full((slots, SLOT_WORDS), POISON, dtype=torch.int32)
    slot = torch.arange(min(issued, slots))
    last = slot + (issued - 1 - slot) // slots * slots
    out[:len(slot)] = torch.stack([last, torch.full_like(slot, source), slot,
                                   torch.full_like(slot, MAGIC)], dim=1).to(torch.int32)
    return out


def launch_trickle(table: torch.Tensor, target: int, result: torch.Tensor, *, slots: int,
                   period_ns: int, run_ns: int, max_stores: int, source: int) -> None:
    """Launch the trickle (``kernels/link_trickle.py``) on the current stream: one store of 16
    bytes every ``period_ns`` into entry ``target`` of ``table`` (int64 addresses of 16-byte
    aligned buffers of at least ``slots`` 16-byte slots), until ``run_ns`` after its entry or
    ``max_stores`` stores; ``result`` (int64 [RESULT_FIELDS]) receives the stores issued and
    %globaltimer at entry and at the last store. Returns at launch."""
    if table.dtype != torch.int64 or table.dim() != 1 or not 0 <= target < table.numel():
        raise ValueError(f"target {target} must index an int64 table of addresses, got "
                         f"{table.dtype} {list(table.shape)}")
    if (result.dtype != torch.int64 or result.numel() != RESULT_FIELDS
            or result.device != table.device):
        raise ValueError(f"result must be int64 [{RESULT_FIELDS}] on {table.device}")
    if slots < 1 or period_ns < 1 or run_ns < 0 or not 0 <= max_stores <= MAX_STORES:
        raise ValueError(f"need slots >= 1, period_ns >= 1, run_ns >= 0 and 0 <= max_stores < "
                         f"2**31; got {slots}, {period_ns}, {run_ns}, {max_stores}")
    if table.device.type != "cuda":
        raise ValueError(f"the trickle runs on a CUDA device, not {table.device}")
    _kernels.link_trickle_kernel[(1,)](table, target, result, slots, period_ns, run_ns,
                                       max_stores, source, num_warps=1)


@dataclass(frozen=True)
class TrickleTarget:
    """Where a setting's trickle stores: entry ``index`` of ``table``. ``received`` is the int32
    [slots, 4] view of the buffer on this GPU that rank ``source``'s trickle writes into (for the
    peer target, the previous rank's trickle lands in this rank's buffer)."""

    table: torch.Tensor
    index: int
    received: torch.Tensor
    source: int


def trickle_targets(rank: int, world: int) -> tuple[dict[str, TrickleTarget], object]:
    """The peer target (rank (r+1) mod P's symmetric buffer; the own one at P = 1) and the local
    target (a buffer on this GPU), and the symmetric buffer (for its barrier). Collective."""
    sym = symmetric_buffer(TRICKLE_SLOTS * SLOT_WORDS, torch.int32)
    local = torch.empty(TRICKLE_SLOTS * SLOT_WORDS, dtype=torch.int32, device=DEVICE)
    local_table = torch.tensor([local.data_ptr()], dtype=torch.int64, device=DEVICE)
    targets = {"peer": TrickleTarget(sym.table, (rank + 1) % world,
                                     sym.tensor.view(TRICKLE_SLOTS, SLOT_WORDS),
                                     (rank - 1) % world),
               "local": TrickleTarget(local_table, 0, local.view(TRICKLE_SLOTS, SLOT_WORDS), rank)}
    return targets, sym


def check_trickle(targets: dict[str, TrickleTarget], sym, rank: int, gloo) -> dict:
    """Each target poisoned, then one trickle stopped by its store limit (wrapping round the
    slots) and one stopped by its deadline: the buffer holds ``expected_slots`` of what its
    sender reports, the limit run issued exactly its limit, the deadline run stopped before its
    deadline and kept the period. Returns this rank's findings, its failures under "failures"
    (the harness stops every rank on any rank's). Collective."""
    result = torch.empty(RESULT_FIELDS, dtype=torch.int64, device=DEVICE)
    findings, failures = {}, []
    for name, target in targets.items():
        for run, bounds in CHECK_RUNS.items():
            target.received.fill_(POISON)
            torch.cuda.synchronize()
            sym.barrier()  # every target poisoned before any rank stores into it
            launch_trickle(target.table, target.index, result, slots=TRICKLE_SLOTS,
                           period_ns=CHECK_PERIOD_NS, source=rank, **bounds)
            torch.cuda.synchronize()
            sym.barrier()  # every rank's stores visible to their target's owner
            torch.cuda.synchronize()
            issued, start, last = result.tolist()
            reports = all_gather_objects((issued, start, last), gloo)
            from_source = reports[target.source][0]
            got = target.received.cpu()
            want = expected_slots(from_source, TRICKLE_SLOTS, target.source)
            found = dict(issued=issued, span_ns=last - start, source=target.source,
                         source_issued=from_source, pattern_exact=torch.equal(got, want))
            if not found["pattern_exact"]:
                wrong = (got != want).any(dim=1).nonzero().flatten().tolist()
                failures.append(f"{name}/{run}: slots {wrong[:8]} (of {len(wrong)}) differ from "
                                f"the {from_source} stores rank {target.source} reports")
            if run == "store_limit" and issued != bounds["max_stores"]:
                failures.append(f"{name}/{run}: {issued} stores, not its limit "
                                f"{bounds['max_stores']}")
            if run == "deadline" and not (issued >= 1 and last - start < bounds["run_ns"]
                                          and last - start >= (issued - 1) * CHECK_PERIOD_NS):
                failures.append(f"{name}/{run}: {issued} stores over {last - start} ns against a "
                                f"deadline of {bounds['run_ns']} ns at {CHECK_PERIOD_NS} ns each")
            findings[f"{name}/{run}"] = found
    findings["failures"] = failures
    return findings


def check_workloads(q, k, v, out_fa, cfg, buf, local, rank, world, nccl) -> dict:
    """FA-only's output (into poison) written everywhere; Fused into the poisoned receive buffer
    bitwise equal to Serial; the same-code control into P poisoned local buffers bitwise equal to
    FA-only's rows. Returns this rank's findings, its failures under "failures"."""
    recv_shape = (out_fa.shape[0] // world, out_fa.shape[1] * world, out_fa.shape[2])
    serial = att.nccl_a2a(out_fa, nccl, out=poisoned(recv_shape, att.DTYPE, DEVICE))
    recv = buf.view(out_fa.shape[0], recv_shape[1], recv_shape[2])
    recv.fill_(float("nan"))
    buf.barrier()  # every rank poisoned its buffer before any peer stores into it
    att.fused_attention_a2a(q, k, v, buf.peer_ptrs, rank, world, config=cfg)
    buf.barrier()
    local_recv, local_table = local
    local_recv.fill_(float("nan"))
    att.fused_attention_a2a(q, k, v, local_table, rank, world, config=cfg)
    h = out_fa.shape[1]
    # NaN left in FA-only's output would pass on to Serial and Fused alike and compare equal
    findings = dict(fa_written=bool(torch.isfinite(out_fa).all()),
                    fused_bitwise_serial=bitwise_equal(recv, serial),
                    fa_same_code_bitwise_fa=bitwise_equal(
                        local_recv[:, :, rank * h:(rank + 1) * h].reshape(out_fa.shape), out_fa))
    findings["failures"] = [f"{key} is False" for key, ok in findings.items() if ok is False]
    return findings


class StepLauncher:
    """``launch(n)``: enqueue n calls of ``fn``, then wait until the previous step has run. One
    step stays queued on the GPU while the host agrees on the next, so the GPU never idles on
    the host's broadcasts (an idle phase would give clock back under the cap)."""

    def __init__(self, fn: Callable[[], object]):
        self.fn = fn
        self.previous = None

    def launch(self, n: int) -> None:
        for _ in range(n):
            self.fn()
        done = torch.cuda.Event()
        done.record()
        if self.previous is not None:
            self.previous.synchronize()
        self.previous = done


class Nvml:
    """This rank's GPU through NVML (pynvml), found by UUID, so CUDA's and NVML's device orders
    need not agree. ``open`` returns (None, why) where NVML does not answer."""

    def __init__(self, pynvml, handle):
        self.pynvml, self.handle = pynvml, handle
        self._reasons = (getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                         or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons)

    @classmethod
    def open(cls, device) -> tuple[Nvml | None, str]:
        try:
            import pynvml
            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-")
                                                      else f"GPU-{uuid}")
            return cls(pynvml, handle), "pynvml"
        except Exception as e:  # no pynvml, or NVML refusing here: the readings are unknown
            return None, f"NVML unavailable: {type(e).__name__}: {e}"

    def _read(self, fn, *args, scale=1):
        try:
            return fn(self.handle, *args) * scale
        except self.pynvml.NVMLError:
            return None

    def sample(self) -> dict:
        p = self.pynvml
        return dict(t=time.perf_counter(),
                    sm_clock_mhz=self._read(p.nvmlDeviceGetClockInfo, p.NVML_CLOCK_SM),
                    power_w=self._read(p.nvmlDeviceGetPowerUsage, scale=1e-3),
                    energy_j=self._read(p.nvmlDeviceGetTotalEnergyConsumption, scale=1e-3),
                    temp_c=self._read(p.nvmlDeviceGetTemperature, p.NVML_TEMPERATURE_GPU),
                    power_limit_w=self._read(p.nvmlDeviceGetEnforcedPowerLimit, scale=1e-3),
                    reasons=self._read(self._reasons))


class PowerSampler:
    """NVML readings (``Nvml.sample``) every ``period_s`` on a thread, from ``__enter__`` to
    ``__exit__``, into ``samples``; none where ``nvml`` is None."""

    def __init__(self, nvml: Nvml | None, period_s: float = SAMPLE_S):
        self.nvml, self.period_s = nvml, period_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> PowerSampler:
        if self.nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            self.samples.append(self.nvml.sample())
            if self._stop.wait(self.period_s):
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def power_summary(samples: list[dict], us_per_call: float) -> dict:
    """One window's NVML samples summarized (``SAMPLING``); None for what no sample knows."""
    def known(key):
        return [s[key] for s in samples if s.get(key) is not None]

    clock, power, temp, limit, reasons = (known(k) for k in ("sm_clock_mhz", "power_w", "temp_c",
                                                             "power_limit_w", "reasons"))
    energy = [(s["t"], s["energy_j"]) for s in samples if s.get("energy_j") is not None]
    energy_w = None
    if len(energy) >= 2 and energy[-1][0] > energy[0][0]:
        energy_w = (energy[-1][1] - energy[0][1]) / (energy[-1][0] - energy[0][0])
    out = dict(samples=len(samples),
               sm_clock_mhz_median=statistics.median(clock) if clock else None,
               power_w_mean=statistics.fmean(power) if power else None,
               power_w_max=max(power) if power else None,
               power_limit_w=statistics.median(limit) if limit else None,
               temp_c_max=max(temp) if temp else None,
               energy_w=energy_w,
               energy_j_per_call=None if energy_w is None else energy_w * us_per_call * 1e-6)
    for name, bit in CLOCK_EVENT_REASONS.items():
        out[f"{name}_frac"] = (sum(bool(int(r) & bit) for r in reasons) / len(reasons)
                               if reasons else None)
    return out


def time_call_s(fn: Callable[[], object], calls: int = 3) -> float:
    """Seconds per call of ``fn``, synchronized, after one warm-up call (every rank runs it)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls


def broadcaster(group) -> Callable[[int], int]:
    """``decide`` for ``run_window``: every rank's proposal in, rank 0's out (gloo, CPU)."""
    def decide(value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, src=0, group=group)
        return int(t.item())
    return decide


@dataclass
class Probe:
    """What one rank's windows run on: the workloads, the steps the leader chose for them, the
    trickle targets, and the devices that time and sample."""

    args: argparse.Namespace
    rank: int
    workloads: dict[str, Callable[[], object]]
    steps: dict[str, int]
    step_s: dict[str, float]
    targets: dict[str, TrickleTarget]
    nvml: Nvml | None
    decide: Callable[[int], int]

    def __post_init__(self):
        self.trickle_stream = torch.cuda.Stream()
        self.result = torch.empty(RESULT_FIELDS, dtype=torch.int64, device=DEVICE)

    def run(self, setting: Setting) -> dict:
        """One window of ``setting`` on this rank: its row, less round and order."""
        a, leader = self.args, self.rank == 0
        fn, steps = self.workloads[setting.workload], self.steps[setting.workload]
        torch.cuda.synchronize()  # the GPU idle: the trickle is resident before the workload
        if setting.trickle != "none":
            target = self.targets[setting.trickle]
            period_ns = round(setting.period_us * 1e3)
            run_ns = round(trickle_run_s(a.settle_s, a.window_s, self.step_s[setting.workload])
                           * 1e9)
            with torch.cuda.stream(self.trickle_stream):
                launch_trickle(target.table, target.index, self.result, slots=TRICKLE_SLOTS,
                               period_ns=period_ns, run_ns=run_ns,
                               max_stores=run_ns // period_ns + 1, source=self.rank)
        launched = time.perf_counter()
        launcher = StepLauncher(fn)
        run_window(a.settle_s, steps, leader=leader, clock=time.perf_counter, decide=self.decide,
                   launch=launcher.launch)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()  # after the settle's calls: the window is the calls below
        with PowerSampler(self.nvml) as sampler:
            calls = run_window(a.window_s, steps, leader=leader, clock=time.perf_counter,
                               decide=self.decide, launch=launcher.launch)
            end.record()
            end.synchronize()
        host_span_s = time.perf_counter() - launched
        torch.cuda.synchronize()  # the trickle's end too
        us_per_call = start.elapsed_time(end) * 1e3 / calls
        row = dict(setting=setting.name, workload=setting.workload, trickle=setting.trickle,
                   period_us=setting.period_us, rank=self.rank, calls=calls,
                   us_per_call=us_per_call, window_s=start.elapsed_time(end) * 1e-3,
                   trickle_stores=None, trickle_span_s=None, trickle_period_us=None,
                   trickle_covered=None)
        if setting.trickle != "none":
            issued, first, last = self.result.tolist()
            span_s = (last - first) * 1e-9
            row.update(trickle_stores=issued, trickle_span_s=span_s,
                       trickle_period_us=span_s * 1e6 / (issued - 1) if issued > 1 else None,
                       # sufficient (to within the launch call's return): the trickle started
                       # after its launch, the window ended before the host saw its end event
                       trickle_covered=span_s >= host_span_s)
        return row | power_summary(sampler.samples, us_per_call)


def window_sweep(args) -> Sweep:
    """The windows as a declared sweep: one axis of (round, setting), each round's settings in
    its seeded order (``round_order``), at the fixed attention shape; each window is measured once
    (its settle is its warm-up)."""
    settings = declared_settings(args.periods_us)
    windows = [dict(round=r, setting=s.name) for r in range(args.rounds)
               for s in round_order(settings, r, args.seed)]
    return Sweep("link_probe", (Axis("window", windows),),
                 fixed=dict(M=args.M, heads=args.heads, head_dim=args.head_dim), repeats=1,
                 warmup=0)


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
        p.add_argument("--periods-us", type=float, nargs="+", default=list(DEFAULT_PERIODS_US),
                       help="the trickle's periods in µs, one store of 16 bytes each")
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
