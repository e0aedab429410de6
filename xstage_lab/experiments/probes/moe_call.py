"""Call probe of the fused MoE layer: the fused kernel's own device time after each launch that can
precede it (issue 27; record ``moe_call_probe``).

    python -m xstage_lab.experiments.probes.moe_call (--out FILE | --root DIR)
        [--models M ...] [--precisions bf16 fp8] [--settings ep1 ep8_rank] [--tokens 64]
        [--repeats N] [--calls N] [--sequences S ...]

``moe_layer``'s per-kernel profiles (``layer_profile``) show the fused kernel running longer in a
call than alone on FP8 cells from 8 to 512 tokens (``kernel_in_call_us`` over
``kernel_alone_device_us``: 2-10 µs more), where bf16 cells differ by about 1 µs either way. The
graphed call's excess over the kernel alone (issue 27's 5% bound) holds that time. This probe
separates what precedes the kernel, on ``layer_bench``'s cells (``layer_cells.layer_cell``):

  alone          the counters zeroed (torch's fill kernel, a few instructions), then the kernel:
                 ``layer_bench``'s ``kernel``;
  routed         the routing launches, then the kernel: the call less its weighted sum;
  routed_memset  the routing, the counters zeroed again, then the kernel: a launch between;
  routed_idle    the routing, the host waiting for the device, then the kernel: nothing running
                 when it starts, the routing's stores in place;
  read_all       the routing, then every buffer it wrote that the kernel reads read through once
                 (a reduction over its bytes): the tile tables and counts, the layout rows'
                 ``row_origin``/``row_slot``/``row_src``, the argument block and, where the
                 routing quantizes, ``x_quant`` and its scales; then the kernel;
  read_tiles     the same with only the tile tables and counts read;
  read_rows      the same with only the layout rows' three tables read;
  call           the whole call (``layer_bench``'s ``fused``: its graph launched);
  idle_one       a launch of one program that stores one word, then ``alone``'s: one other kernel
                 of a few instructions between two of the fused kernel's;
  idle_all       the same launch with ``IDLE_PROGRAMS_PER_SM`` programs per SM: every SM ran
                 another kernel's (tiny) code;
  code_all       a launch of one program per SM running ``CODE_STEPS`` steps of straight-line code
                 (``kernels/moe_call_predecessors.py``: about 48 bytes of SASS a step, never a
                 loop), then ``alone``'s: every SM's instruction caches filled with other code.
                 Where ``idle_all`` leaves the kernel's time as ``alone`` and ``code_all``
                 slows it, the kernel is slowed by its code falling out of the instruction
                 caches; where ``idle_all`` slows it too, by any other kernel on the SMs.

1. Checks first: ``straight_line``'s words equal the same steps on the host (``code_words``),
   then the cell passes ``layer_bench.check_cell`` (outputs poisoned, against the
   reference, bit for bit with the host-scheduled launch, the tables against the host's, the
   error flag zero). Any failure aborts the run before timing; nothing is written.
2. Timing: each sequence's fused-kernel device time per call as torch.profiler's CUDA activity
   records it (``kernel_times_us``, ``--calls`` calls), the sequences in an order rotated by one
   each of ``--repeats`` rounds, the SM clock read before each.

One row per (cell, sequence): the median, p25 and p75 over rounds; ``over_alone``, the median of
the per-round ratios of the sequence's time to ``alone``'s; ``others_us``, every other activity
of the sequence's last round (kernels, copies, fills) and its device time per call, as JSON.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import pandas as pd
import torch

from ...cli import list_option
from ...dist_timing import kernel_times_us, paired_ratio, read_sm_clock_mhz
from ...kernel_sources import load_kernel_module
from ...ops.moe.fused import KERNEL_ENTRIES
from ...ops.moe.shapes import PRECISIONS
from .. import harness
from ..harness import Run
from ..moe.layer_bench import LayerCellRun
from ..moe.layer_cells import SETTINGS

SEQUENCES = ("alone", "routed", "routed_memset", "routed_idle", "read_all", "read_tiles",
             "read_rows", "call", "idle_one", "idle_all", "code_all")
IDLE_PROGRAMS_PER_SM = 4
CODE_STEPS = 1536   # about 72 KiB of straight-line SASS a program
CODE_WIDTH = 128    # words per program: one per thread of its 4 warps
CODE_MULTIPLIER = 0x2C1B3C6D  # odd, below 2**31: a plain int32 launch argument


def code_words(programs: int, steps: int) -> np.ndarray:
    """``straight_line``'s words on the host: word ``i`` from ``i``, each step ``x ^= x >> 13;
    x *= CODE_MULTIPLIER`` (mod 2**32)."""
    x = np.arange(programs * CODE_WIDTH, dtype=np.uint64)
    for _ in range(steps):
        x = ((x ^ (x >> np.uint64(13))) * np.uint64(CODE_MULTIPLIER)) & np.uint64(0xFFFFFFFF)
    return x.astype(np.uint32)


class Predecessors:
    """The probe's own launches on ``device`` (``kernels/moe_call_predecessors.py``): ``idle(n)``
    runs ``one_store`` on ``n`` programs, ``code()`` ``straight_line`` on one program per SM;
    ``code_mismatches`` compares ``straight_line``'s words with ``code_words`` after poisoning
    them."""

    def __init__(self, device):
        self.k = load_kernel_module("moe_call_predecessors")
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.stores = torch.empty(self.sms * IDLE_PROGRAMS_PER_SM, dtype=torch.int32,
                                  device=device)
        self.words = torch.empty(self.sms * CODE_WIDTH, dtype=torch.int32, device=device)

    def idle(self, programs: int) -> None:
        self.k.one_store[(programs,)](self.stores)

    def code(self) -> None:
        self.k.straight_line[(self.sms,)](self.words, CODE_MULTIPLIER, STEPS=CODE_STEPS,
                                          WIDTH=CODE_WIDTH)

    def code_mismatches(self) -> int:
        self.words.fill_(-1)
        self.code()
        got = self.words.cpu().numpy().view(np.uint32)
        return int((got != code_words(self.sms, CODE_STEPS)).sum())


def sequences(cell, before: Predecessors) -> dict:
    """The launches before each timed kernel (module docstring), as callables; ``before``, the
    probe's own launches."""
    def routed():
        cell.route()
        cell.kernel(routed=True)

    def routed_memset():
        cell.route()
        cell.kernel()

    def routed_idle():
        cell.route()
        torch.cuda.synchronize()
        cell.kernel(routed=True)

    def read_through(buffers):
        def sequence():
            cell.route()
            for b in buffers:
                b.view(torch.uint8).max()
            cell.kernel(routed=True)
        return sequence

    t = cell.ws.tables
    tiles = [*t.tiles.values(), *t.num_tiles.values()]
    rows = [t.row_origin, t.row_slot, t.row_src]
    quantized = [b for b in (t.x_quant, t.x_quant_scale) if b is not None]
    def after(launch):
        def sequence():
            launch()
            cell.kernel()
        return sequence

    return {"alone": cell.kernel, "routed": routed, "routed_memset": routed_memset,
            "routed_idle": routed_idle, "read_all": read_through([*tiles, *rows, t.args,
                                                                  *quantized]),
            "read_tiles": read_through(tiles), "read_rows": read_through(rows),
            "call": cell.call, "idle_one": after(lambda: before.idle(1)),
            "idle_all": after(lambda: before.idle(before.sms * IDLE_PROGRAMS_PER_SM)),
            "code_all": after(before.code)}


def rotated(names: list[str], round_: int) -> list[str]:
    """``names`` started at position ``round_`` (mod their count)."""
    k = round_ % len(names)
    return names[k:] + names[:k]


class MoECall(LayerCellRun):
    """The fused kernel's device time after each predecessor, on ``layer_bench``'s cells."""

    name = "moe_call_probe"
    sweep_name = "moe_call"
    paper = "§4.2 the fused layer's call; issue 27"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--models", **list_option(default=["Hy3", "Qwen3.5", "DiT-MoE"]))
        p.add_argument("--precisions", **list_option(default=list(PRECISIONS)))
        p.add_argument("--settings", **list_option(default=list(SETTINGS)))
        p.add_argument("--tokens", **list_option(int, default=[64]))
        p.add_argument("--repeats", type=int, default=5)
        p.add_argument("--calls", type=int, default=10)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--sequences", **list_option(default=list(SEQUENCES)),
                       help="the sequences to time (alone always among them: the ratios' base)")

    def check_args(self, a: argparse.Namespace) -> None:
        self.check_cell_names(a)
        bad = [s for s in a.sequences if s not in SEQUENCES]
        if bad:
            raise ValueError(f"unknown sequence {bad}; choose from {list(SEQUENCES)}")
        a.sequences = ["alone", *(s for s in a.sequences if s != "alone")]
        if min(a.tokens) < 1 or a.repeats < 1 or a.calls < 1:
            raise ValueError("--tokens, --repeats and --calls must be >= 1")

    def start(self, run: Run) -> None:
        super().start(run)
        self.before = Predecessors(self.on)
        bad = self.before.code_mismatches()
        if bad:
            raise SystemExit(f"straight_line: {bad} words differ from the host's steps")

    def measure(self, cell, run: Run) -> pd.DataFrame:
        a = run.args
        fused = KERNEL_ENTRIES[cell.ws.config.kernel][1]
        seqs = {n: f for n, f in sequences(cell, self.before).items() if n in a.sequences}
        times = {name: [] for name in seqs}
        clocks = {name: [] for name in seqs}
        others = {}
        for r in range(a.repeats):
            for name in rotated(list(seqs), r):
                clocks[name].append(read_sm_clock_mhz(self.on))
                profile = kernel_times_us(seqs[name], a.calls)
                times[name].append(profile.pop(fused))
                others[name] = profile
        rows = []
        for name, t in times.items():
            known = [c for c in clocks[name] if c is not None]
            rows.append({"model": cell.shape.model, "precision": cell.precision,
                         "setting": cell.setting, "tokens": cell.tokens,
                         "sequence": name, "kernel_us": float(np.median(t)),
                         "p25_us": float(np.percentile(t, 25)),
                         "p75_us": float(np.percentile(t, 75)),
                         "over_alone": paired_ratio(t, times["alone"]),
                         "sm_clock_mhz": float(np.median(known)) if known else float("nan"),
                         "trials_us": t, "others_us": json.dumps(others[name])})
        return pd.DataFrame(rows)

    def progress_line(self, rows) -> str | None:
        r = rows.set_index("sequence")["over_alone"].round(3).to_dict()
        first = rows.iloc[0]
        return (f"{first['model']:18s} {first['precision']} {first['setting']:8s} "
                f"{first['tokens']:5d} alone {first['kernel_us']:.1f} us {r}")

    def metadata(self, run: Run) -> dict:
        a = run.args
        return {"sequences": a.sequences, "code_steps": CODE_STEPS,
                "idle_programs_per_sm": IDLE_PROGRAMS_PER_SM,
                "timing": f"torch.profiler CUDA activity, {a.calls} calls per round, "
                          f"{a.repeats} rounds, sequence order rotated by round"}


EXPERIMENT = MoECall()


if __name__ == "__main__":
    harness.main(EXPERIMENT)
