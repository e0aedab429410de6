"""The cells of the fused MoE layer on one GPU (issue 27), as ``layer_bench`` measures them and the
probes reuse them: ``Ep1Cell`` (EP = 1, ``FusedMoE`` from ``topk_ids``) and ``Ep8RankCell`` (rank
0 of EP = 8 from its received rows), each with its call, its routing and kernel alone, the unfused
torch path, the reference and the host-scheduled launch of the same schedule; ``layer_cell``
builds the cell of a setting, its weights once per run."""
from __future__ import annotations

import torch

from ...ops.moe.combine import combine_weighted_sum, local_combine_peers
from ...ops.moe.table_reference import host_tables
from ...ops.moe.dispatch import build_layout
from ...ops.moe.fused import FusedMoECall, prepare_fused_moe
from ...ops.graph_launch import GraphCache, launching_graphs
from ...ops.moe.op import FusedMoE, MoEWorkspace, auto_schedule
from ...ops.moe.reference import expert_rows_reference, reference_moe
from ...ops.moe.routing import router_logits, router_topk
from ...ops.moe.schedules import MoEProblem, expert_wave_schedule, interleaved_schedule
from ...ops.moe.tiles import TileConfig, default_tile_config
from ...ops.moe.unfused import (GROUP_ALIGN, GroupedWeights, unfused_expert_weights,
                                unfused_layer, unfused_rows)
from ...ops.moe.weights import local_expert_weights, quantize_rows_fp8
from ..harness import Run
from .kernel_cell import EP, arrival_sources, build_workload, receive_buffers

SETTINGS = ("ep1", "ep8_rank")

def balanced_routing(shape, tokens: int, seed: int, rank: int, device):
    """``tokens`` bf16 tokens of ``rank`` and the balanced router's picks and weights for them."""
    ids, w = router_topk(router_logits(tokens, shape.routed_experts, "balanced", seed=seed,
                                       rank=rank, device=device), shape.top_k)
    g = torch.Generator(device).manual_seed(seed + rank)
    x = torch.randn(tokens, shape.hidden, generator=g, device=device).to(torch.bfloat16)
    return x, ids, w


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


class Ep1Cell:
    """EP = 1: ``FusedMoE`` over every expert, inputs static (graph-capturable) per cell, its
    weighted sum where ``weighted_sum`` says (``FusedMoE``'s)."""

    setting = "ep1"

    def __init__(self, shape, precision, tokens, weights, uweights, seed, device,
                 weighted_sum: str = "auto", tile_rows: int | None = None):
        self.shape, self.precision, self.tokens, self.seed = shape, precision, tokens, seed
        self.layer = FusedMoE(weights, max_tokens=tokens, top_k=shape.top_k, schedule="auto",
                              weighted_sum=weighted_sum,
                              config=_tiles(precision, shape, device, tile_rows,
                                            tokens * shape.top_k))
        self.uweights = uweights
        self.x, self.ids, self.w = balanced_routing(shape, tokens, seed, 0, device)
        self.unfused_capacity = tokens * shape.top_k + shape.routed_experts * (GROUP_ALIGN - 1)
        # the kernel that ends with the weighted sum, timed alone, sums into a tensor of its
        # own (the argument block names the last call's output, gone with it)
        self.alone_out = torch.empty_like(self.x)
        self.alone_sum_args = torch.tensor(
            [self.layer.combine.data_ptr(), self.w.data_ptr(), self.alone_out.data_ptr()],
            dtype=torch.int64, device=device)

    @property
    def ws(self) -> MoEWorkspace:
        """The layer's workspace (``Ep8RankCell.ws``'s counterpart)."""
        return self.layer.workspace

    def call(self):
        return self.layer(self.x, self.ids, self.w)

    def route(self):
        self.ws.route(self.ids.reshape(-1), self.x, top_k=self.shape.top_k)

    def kernel(self, routed: bool = False):
        """The fused kernel over the tables, without the weighted sum (``MoEWorkspace.launch``;
        ``routed``: right after ``route`` on this stream, which zeroed its counters)."""
        self.ws.launch(self.layer.schedule, self.layer.peers, routed=routed)

    def kernel_summed(self):
        """The fused kernel as the call launches it where it ends with the weighted sum
        (``FusedMoE.fused_kernel``), summing into the cell's own output."""
        self.layer.fused_kernel(self.tokens, self.w.dtype, self.layer.schedule,
                                sum_args=self.alone_sum_args)

    def sums_in_kernel(self) -> bool:
        """Whether the call's fused kernel ends with the weighted sum."""
        return self.layer.sums_in_kernel(self.tokens)

    def weighted_sum(self):
        combine_weighted_sum(self.combined(), self.w)

    def unfused(self):
        return unfused_layer(self.x, self.ids, self.w, self.uweights, self.unfused_capacity)

    def reference(self, x, ids, w) -> dict:
        return reference_moe(x, ids, w, self.shape, seed=self.seed, precision=self.precision)

    def output_error(self, y, x, ids, w) -> dict:
        return {k: _relative(y, r) for k, r in self.reference(x, ids, w).items()}

    def host_tables(self):
        k = self.shape.top_k
        rows = self.x.repeat_interleave(k, dim=0)
        xq, xs = quantize_rows_fp8(rows) if self.precision == "fp8" else (rows, None)
        return host_tables(self.ws.bounds, self.ids.reshape(-1), xq, xs, top_k=k)

    def host_launch(self, instrument: bool = False,
                    config: TileConfig | None = None) -> FusedMoECall:
        """Today's path up to the launch: the layout on the host (syncs), the call's schedule
        built and checked there, the launch prepared (``instrument``: the traced build;
        ``config``: other tiles than the workspace's, of the same rows)."""
        ws, k = self.ws, self.shape.top_k
        rows = self.x.repeat_interleave(k, dim=0)
        xq, xs = quantize_rows_fp8(rows) if self.precision == "fp8" else (rows, None)
        n = rows.shape[0]
        layout = build_layout(xq, xs, torch.arange(n, device=rows.device), self.ids.reshape(-1),
                              [n], self.shape.routed_experts, ws.config.block_m)
        return _host_launch(layout, ws, self.layer.schedule, self.layer.peers, instrument,
                            config)

    def host_scheduled(self):
        """Today's path: ``host_launch``, the kernel, the weighted sum."""
        self.host_launch()()
        return combine_weighted_sum(self.combined(), self.w)

    def combined(self) -> torch.Tensor:
        """The Combine rows a launch stored."""
        return self.layer.combine[:self.tokens * self.shape.top_k]

    def poison(self):
        """NaN into every Combine row a launch stores (before a launch that is checked)."""
        self.layer.combine.fill_(float("nan"))

    def host_stages(self) -> dict:
        """The host side of a call's steps, each timed alone (``host_overhead_us``): those of an
        eager call (``check``, ``output``: its output's allocation, ``capturing``: whether the
        stream is capturing, ``args``: its argument block's addresses gathered and checked,
        ``replay``: its graph launched with them, captured by the checks' calls), the replay's
        two driver calls (``set_addresses``, ``graph_launch``), the launch of graphs of the
        call's first launches alone (``graph_launch_route``: the routing kernels;
        ``graph_launch_kernel``: and the fused kernel), and the direct launches a graph
        captures (``route``, ``launch``, ``weighted_sum``)."""
        layer, y = self.layer, torch.empty_like(self.x)
        graph = layer.graphs.get(layer.graph_key(self.tokens, layer.schedule, self.ids.dtype,
                                                 self.w.dtype))

        def addresses():
            return layer.pack_addresses(self.ids, self.x, layer.combine, self.w, y)

        stream, launched = torch.cuda.current_stream().cuda_stream, addresses()

        def route():
            layer.route_launches(launched, self.tokens, self.ids.dtype)

        def route_and_kernel():
            route()
            layer.fused_kernel(self.tokens, self.w.dtype, layer.schedule, routed=True)

        parts = GraphCache(layer.device)
        route_graph = parts.capture("route", route)
        kernel_graph = parts.capture("kernel", route_and_kernel)
        return {"check": lambda: layer.check_inputs(self.x, self.ids, self.w),
                "output": lambda: torch.empty_like(self.x),
                "capturing": lambda: launching_graphs(layer.device),
                "args": addresses, "replay": lambda: graph(stream, launched),
                "set_addresses": lambda: graph.set_addresses(launched),
                "graph_launch": lambda: graph.launch(stream),
                "graph_launch_route": lambda: route_graph.launch(stream),
                "graph_launch_kernel": lambda: kernel_graph.launch(stream),
                "route": self.route, "launch": self.kernel, "weighted_sum": self.weighted_sum}

    def touched_experts(self) -> int:
        return int(torch.unique(self.ids).numel())

    def weighted_sum_bytes(self) -> int:
        return 2 * self.shape.hidden * self.tokens * (self.shape.top_k + 1)


class Ep8RankCell:
    """Rank 0 of EP = 8: issue 18's workload (``kernel_cell.build_workload``: the received rows of
    all eight sources in the order Dispatch delivers them) into eight local buffers."""

    setting = "ep8_rank"

    def __init__(self, shape, precision, tokens, weights, uweights, seed, device,
                 tile_rows: int | None = None):
        self.shape, self.precision, self.tokens, self.seed = shape, precision, tokens, seed
        wl = build_workload(shape, "balanced", tokens, seed=seed, device=device)
        self.rows, self.slot, self.expert = wl.recv_x, wl.recv_slot, wl.recv_expert
        self.src = arrival_sources(wl)
        capacity = EP * tokens * shape.top_k
        # the rows arrive as Dispatch sent them, e4m3 with their scales in FP8: nothing to
        # quantize, so no quantized copy
        # the bound is EP times the rows a rank receives on average: the tiles follow those
        self.ws = MoEWorkspace(weights, capacity, source_rows=0,
                               config=_tiles(precision, shape, device, tile_rows, capacity),
                               rows_per_expert=tokens * shape.top_k / wl.experts_per_rank)
        self.buffers = [torch.empty(tokens * shape.top_k, shape.hidden, dtype=torch.bfloat16,
                                    device=device) for _ in range(EP)]
        self.peers = local_combine_peers(self.buffers)
        xq, xsc = quantize_rows_fp8(self.rows) if precision == "fp8" else (self.rows, None)
        self.xq, self.xsc = xq, xsc
        received = receive_buffers(wl, xq, xsc, capacity)
        self.in_expert, self.in_x, self.in_scale = (received[k] for k in
                                                    ("expert_ids", "x", "x_scale"))
        self.n, self.in_src, self.in_slot = (received[k] for k in
                                             ("n_arrivals", "arrival_src", "arrival_slot"))
        self.uweights = uweights
        self.unfused_capacity = capacity + wl.experts_per_rank * (GROUP_ALIGN - 1)
        # each source's rows and slots, found once: a boolean mask in a call would sync
        self.by_source = [((self.src == r).nonzero(as_tuple=True)[0], r) for r in range(EP)]
        self.by_source = [(i, self.slot[i], r) for i, r in self.by_source]

    def route(self):
        self.ws.route(self.in_expert, self.in_x, self.in_scale, n_arrivals=self.n,
                      arrival_src=self.in_src, arrival_slot=self.in_slot)

    def kernel(self, routed: bool = False):
        """``Ep1Cell.kernel``'s counterpart."""
        self.ws.launch(auto_schedule(EP), self.peers, routed=routed)

    def call(self):
        self.ws.received_call(auto_schedule(EP), self.peers, self.in_expert, self.in_x,
                              self.in_scale, self.n, self.in_src, self.in_slot)

    def weighted_sum(self):
        """No weighted sum on an EP rank: the sources sum their Combine buffers."""

    def sums_in_kernel(self) -> bool:
        """``Ep1Cell.sums_in_kernel``'s counterpart: no weighted sum here."""
        return False

    def unfused(self):
        y = unfused_rows(self.rows, self.expert, self.uweights, self.unfused_capacity)
        for rows, slots, r in self.by_source:
            self.buffers[r][slots] = y[rows]

    def output_error(self, *_) -> dict:
        got = torch.stack(self.buffers)[self.src, self.slot]
        refs = expert_rows_reference(self.rows, self.expert, self.shape, seed=self.seed,
                                     precision=self.precision)
        return {k: _relative(got, r) for k, r in refs.items()}

    def host_tables(self):
        return host_tables(self.ws.bounds, self.expert, self.xq, self.xsc, arrival_src=self.src,
                           arrival_slot=self.slot)

    def host_launch(self, instrument: bool = False,
                    config: TileConfig | None = None) -> FusedMoECall:
        ws = self.ws
        counts = torch.bincount(self.src, minlength=EP).tolist()
        layout = build_layout(self.xq, self.xsc, self.slot, self.expert, counts,
                              self.shape.routed_experts // EP, ws.config.block_m)
        return _host_launch(layout, ws, auto_schedule(EP), self.peers, instrument, config)

    def host_scheduled(self):
        self.host_launch()()

    def combined(self) -> torch.Tensor:
        return torch.stack(self.buffers)

    def poison(self):
        for b in self.buffers:
            b.fill_(float("nan"))

    def host_stages(self) -> dict:
        return {"route": self.route, "launch": self.kernel}

    def touched_experts(self) -> int:
        return int(torch.unique(self.expert).numel())

    def weighted_sum_bytes(self) -> int:
        return 0


def _host_launch(layout, ws: MoEWorkspace, schedule: str, peers, instrument: bool = False,
                 config: TileConfig | None = None) -> FusedMoECall:
    """``schedule`` (the one the device tables give the fused call) built and checked on the
    host for ``layout``, and its launch prepared (``fused.prepare_fused_moe``) with the
    workspace's tiles, or ``config``'s."""
    problem = MoEProblem(layout.blocks_per_expert, ws.bounds.l1_n_blocks, ws.bounds.l2_n_blocks)
    g = ws.bounds.num_programs
    built = (expert_wave_schedule(problem, g) if schedule == "wave"
             else interleaved_schedule(problem, g, ws.bounds.lead_rows,
                                       expert_lead=ws.bounds.expert_lead))
    return prepare_fused_moe(layout, ws.weights, built, peers, config=config or ws.config,
                             instrument=instrument, l2_splits=ws.bounds.l2_splits)


def _tiles(precision: str, shape, device, tile_rows: int | None,
           capacity: int) -> TileConfig | None:
    """The gluon_ws tiles of ``tile_rows`` rows for a workspace of ``capacity`` rows (its bound
    on an expert's: ``MoEWorkspace``'s), or None (the workspace's default)."""
    if tile_rows is None:
        return None
    return default_tile_config(precision, "gluon_ws", hidden=shape.hidden, device=device,
                               block_m=tile_rows, expert_rows=capacity)


def layer_cell(shape, precision: str, setting: str, tokens: int, run: Run, device,
               weighted_sum: str = "launch", tile_rows: int | None = None):
    """The cell of ``setting`` (``Ep1Cell``, its weighted sum where ``weighted_sum`` says, or
    ``Ep8RankCell``), its weights built once per (model, precision, setting) in ``run``
    (``run.args.seed``), its kernel's tiles of ``tile_rows`` rows where given."""
    world = 1 if setting == "ep1" else EP
    seed = run.args.seed

    def make():
        w = local_expert_weights(shape, 0, world, precision, seed=seed, device=device)
        u = (GroupedWeights(precision, w.w1, w.w2) if precision == "bf16" else
             unfused_expert_weights(shape, 0, world, precision, seed=seed, device=device))
        return w, u

    weights, uweights = run.resource((shape.model, precision, setting), make)
    if setting == "ep1":
        return Ep1Cell(shape, precision, tokens, weights, uweights, seed, device, weighted_sum,
                       tile_rows)
    return Ep8RankCell(shape, precision, tokens, weights, uweights, seed, device, tile_rows)

