"""Ring probe of the fused MoE kernel: a one-token tile's weight stream against the depth of the
shared-memory ring that feeds it (issue 27; record ``moe_ring_probe``).

    python -m xstage_lab.experiments.probes.moe_ring (--out FILE | --root DIR)
        [--models M ...] [--precisions bf16 fp8] [--settings ep1 ep8_rank] [--tokens 1]
        [--stages 2 3 4] [--trials N]

``moe_layer``'s one-token traces (``layer_view.kernel_phases``) show each tile streaming its
weights at 30-80 GB/s, where its SMs together take less than HBM's bandwidth. Two limits can
cap one SM's stream: the weight bytes its ring keeps in flight over the memory's latency
(Little's law: the producer runs at most ``STAGES`` K blocks ahead of the consumers), or its
consumer warpgroup's work per K block (the wgmma, in FP8 each block's promotion waited for).
The ring's depth moves the first and not the second. On ``layer_bench``'s cells
(``layer_cells.layer_cell``), the host-scheduled launch of the call's schedule
(``host_launch``) is built with each of ``--stages`` ring depths (``TileConfig.num_stages``,
the workspace's other tile sizes kept; its default is the deepest that fits a CTA):

1. Checks first: the cell passes ``layer_bench.check_cell``; each depth's launch and its
   instrumented build, their Combine rows poisoned with NaN first, store the default launch's
   rows bit for bit, spin errors zero. Any failure aborts the run before timing; nothing is
   written.
2. Timing: every depth's launch in one rotation (``dist_timing.time_methods``, CUDA-graph
   replays of ``GRAPH_ITERS`` launches, the SM clock read per trial; the default depth timed
   too where ``--stages`` leaves it out), then each depth's instrumented launch traced
   (``kernel_phases``).

One row per (cell, stages): the launch's time (median, p25, p75) and over the default depth's
(``over_default``: the median of per-trial ratios); the weight bytes of one K block of a
Linear-1 and a Linear-2 tile (``l1_block_bytes``, ``l2_block_bytes``); the trace's ``trace_*``
columns; the latency at which ``stages`` such blocks in flight give the measured stream rate
(``l1_ring_latency_us``, ``l2_ring_latency_us``: Little's law, stages x block bytes over the
rate). Where the ring caps the stream that latency stays about the same at every depth (the
rate follows the depth); where the consumer does, the rate stays and the latency follows the
depth. ``l1_hbm_share``: the Linear-1 phase's SMs at their median rate, over the HBM bandwidth
measured at the start of the run (a device copy, ``layer_bench.hbm_bandwidth_gbps``).
"""
from __future__ import annotations

import argparse
import dataclasses

import pandas as pd
import torch

from ...analysis.moe.layer_view import kernel_phases
from ...analysis.moe.trace import tile_frame
from ...cli import list_option
from ...dist_timing import median_clock_mhz, paired_ratio, time_methods
from ...ops.moe.schedules import tile_table
from ...ops.moe.shapes import PRECISIONS
from .. import harness
from ..harness import Run
from ..moe.layer_bench import LayerCellRun, hbm_bandwidth_gbps, tile_weight_bytes
from ..moe.layer_cells import SETTINGS

STAGES = (2, 3, 4)
GRAPH_ITERS = 5  # launches a replay, as layer_bench's kernel


def block_bytes(config, weights) -> tuple[int, int]:
    """The weight bytes of one K block of a Linear-1 tile (gate and up) and of a Linear-2 tile:
    what each stage of the ring holds of B."""
    elem = weights.w1.element_size()
    return 2 * config.block_n1 * config.block_k * elem, config.block_n2 * config.block_k * elem


def ring_latency_us(stages: int, block: int, gbps: float) -> float:
    """Little's law: the latency at which ``stages`` blocks of ``block`` bytes in flight stream
    ``gbps`` GB/s (bytes over GB/s are ns)."""
    return stages * block / gbps * 1e-3


class MoERing(LayerCellRun):
    """One-token tiles' weight stream at each ring depth, on ``layer_bench``'s cells."""

    name = "moe_ring_probe"
    sweep_name = "moe_ring"
    paper = "§4.2 the fused kernel's one-token tiles; issue 27"

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--models", **list_option(default=["DiT-MoE", "Qwen3.5", "Hy3",
                                                          "DeepSeek-V4-Flash"]))
        p.add_argument("--precisions", **list_option(default=list(PRECISIONS)))
        p.add_argument("--settings", **list_option(default=list(SETTINGS)))
        p.add_argument("--tokens", **list_option(int, default=[1]))
        p.add_argument("--stages", **list_option(int, default=list(STAGES)))
        p.add_argument("--trials", type=int, default=9)
        p.add_argument("--seed", type=int, default=0)

    def check_args(self, a: argparse.Namespace) -> None:
        self.check_cell_names(a)
        if min(a.tokens) < 1 or a.trials < 1:
            raise ValueError("--tokens and --trials must be >= 1")
        if min(a.stages) < 2 or len(set(a.stages)) != len(a.stages):
            raise ValueError(f"--stages must be distinct depths >= 2, got {a.stages}")

    def start(self, run: Run) -> None:
        super().start(run)
        self.hbm_gbps = hbm_bandwidth_gbps(self.on)

    def check(self, cell, run: Run) -> list[str]:
        """``check_cell``, then each depth's launch and its instrumented build against the
        default launch's rows (kept on the cell for ``measure``: ``depths``, ``traced``)."""
        failures = super().check(cell, run)
        if failures:
            return failures
        cell.poison()
        cell.host_call()
        want = cell.combined().view(torch.int16).clone()
        cell.depths, cell.traced = {}, {}
        for s in run.args.stages:
            # check_tile_config refuses a ring that does not fit a CTA
            config = dataclasses.replace(cell.ws.config, num_stages=s)
            for instrument, kept in ((False, cell.depths), (True, cell.traced)):
                launch = cell.host_launch(instrument=instrument, config=config)
                launch()
                cell.poison()
                launch()
                what = f"{s} stages{' (instrumented)' if instrument else ''}"
                if not torch.equal(cell.combined().view(torch.int16), want):
                    failures.append(f"{what}: other Combine rows than the default launch")
                if launch.error_count():
                    failures.append(f"{what}: spin errors {launch.error_count()}")
                kept[s] = launch
        return failures

    def measure(self, cell, run: Run) -> pd.DataFrame:
        a = run.args
        default = cell.ws.config.num_stages
        methods = {f"stages_{s}": launch for s, launch in cell.depths.items()}
        if default not in cell.depths:  # the ratios' base
            methods[f"stages_{default}"] = cell.host_call
        timed = time_methods(methods, trials=a.trials, graph_iters=GRAPH_ITERS, clocks=True)
        base = timed[f"stages_{default}"]
        l1_block, l2_block = block_bytes(cell.ws.config, cell.ws.weights)
        rows = []
        for s, traced in cell.traced.items():
            traced()
            torch.cuda.synchronize()
            tiles = tile_frame(traced.trace.cpu().numpy(), *tile_table(traced.schedule))
            phases = kernel_phases(tiles, *tile_weight_bytes(cell.ws))
            t = timed[f"stages_{s}"]
            rows.append({"model": cell.shape.model, "precision": cell.precision,
                         "setting": cell.setting, "tokens": cell.tokens, "stages": s,
                         "default_stages": default, "kernel_us": t["median_us"],
                         "p25_us": t["p25_us"], "p75_us": t["p75_us"],
                         "over_default": paired_ratio(t["trials_us"], base["trials_us"]),
                         "sm_clock_mhz": median_clock_mhz(t),
                         "l1_block_bytes": l1_block, "l2_block_bytes": l2_block,
                         "l1_ring_latency_us": ring_latency_us(s, l1_block,
                                                               phases["trace_l1_tile_gbps"]),
                         "l2_ring_latency_us": ring_latency_us(s, l2_block,
                                                               phases["trace_l2_tile_gbps"]),
                         "l1_hbm_share": phases["trace_l1_sms"] * phases["trace_l1_tile_gbps"]
                         / self.hbm_gbps, "hbm_gbps": self.hbm_gbps, "trials_us": t["trials_us"],
                         **phases})
        return pd.DataFrame(rows)

    def progress_line(self, rows) -> str | None:
        first = rows.iloc[0]
        rates = {int(r.stages): (round(r.trace_l1_tile_gbps), round(r.trace_l2_tile_gbps))
                 for r in rows.itertuples()}
        return (f"{first['model']:18s} {first['precision']} {first['setting']:8s} "
                f"{first['tokens']:5d} L1/L2 GB/s per SM by stages {rates}")

    def metadata(self, run: Run) -> dict:
        a = run.args
        return {"stages": a.stages,
                "timing": f"CUDA-graph replays of {GRAPH_ITERS} launches, {a.trials} trials, "
                          "depths rotated by trial"}


EXPERIMENT = MoERing()


if __name__ == "__main__":
    harness.main(EXPERIMENT)
