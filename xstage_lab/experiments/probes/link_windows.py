"""The link probe's windows (step 2 of ``link``): the declared settings and their seeded order
(``window_sweep``), the steps of calls that rank 0's clock ends (``run_window``), NVML sampling
and its summary, and ``Probe``, one rank's window of a setting."""
from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...sweep import Axis, Sweep
from .link_checks import DEVICE, RESULT_FIELDS, TRICKLE_SLOTS, TrickleTarget, launch_trickle


DEFAULT_PERIODS_US = (2, 20, 200, 2000)
MIN_PERIOD_US = 1.0    # %globaltimer advances in steps of up to 1 µs: no shorter period resolves
MIN_STORES_PER_WINDOW = 10
MAX_WINDOW_S = 60.0    # keeps a trickle's store count (run / period) inside int32
STEP_S = 0.02          # the host agrees on the next step of calls about this often
SAMPLE_S = 0.02        # NVML reading period
TRICKLE_TAIL_S = 0.25  # the trickle outlives its window by this plus four steps (``trickle_run_s``)

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


