"""The static buffers of the fused MoE's calls (issue 27), apart from the weights and the launches
bound to them, so that the MoE layers of a model can share one set: a call rewrites every buffer
it reads before reading it (the routing its tables, the row counters and the argument block;
Linear-1 its ``h`` rows; Linear-2 its Combine rows; the split Linear-2 tiles leave their counters
zero), so layers called one after another (``graph_launch.StreamOrder`` keeps their calls one
at a time, whichever stream each is made on) need one set between them, not one each. A set for
8192 tokens takes 0.15-1.2 GiB over the model shapes of ``data/moe_shapes.json`` (the Combine
rows and ``h`` the most of it): as much again for each further layer that held its own."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from ..graph_launch import StreamOrder
from .device_tables import DeviceTables, TableBounds, allocate_tables
from .fused import split_k_buffers
from .shapes import FP8_SCALE_BLOCK, MoEContractError


@dataclass(frozen=True)
class BufferSizes:
    """What a set of ``MoEBuffers`` is sized for: the tables' ``bounds``, the layer's precision,
    H and I, the bf16 rows an FP8 layer quantizes at most (``source_rows``, as
    ``allocate_tables`` takes it), the device, and whether it holds a FusedMoE's Combine rows
    (``[capacity, H]`` bf16; an EP rank stores into its peers' buffers instead)."""

    bounds: TableBounds
    precision: str
    hidden: int
    intermediate: int
    source_rows: int | None
    device: torch.device
    combine_rows: bool

    def differences(self, other: BufferSizes) -> str:
        """Where ``other`` differs from these sizes, field by field (the bounds' too)."""
        mine, theirs = _flat(self), _flat(other)
        return "; ".join(f"{k} {v} where the layer needs {theirs[k]}" for k, v in mine.items()
                         if v != theirs[k])


def _flat(sizes: BufferSizes) -> dict:
    out = {f.name: getattr(sizes, f.name) for f in fields(sizes) if f.name != "bounds"}
    out.update({f.name: getattr(sizes.bounds, f.name) for f in fields(sizes.bounds)})
    return out


# eq=False: compared field by field, the tensors would compare elementwise
@dataclass(frozen=True, eq=False)
class MoEBuffers:
    """One set of the buffers a ``MoEWorkspace``'s calls write and read, sized by ``sizes``: the
    routing's tables (``device_tables.DeviceTables``: the row counters, the argument block and
    the error flag among them), ``h`` and its FP8 scales, the split Linear-2 tiles' fp32
    partials and counters (None unsplit), the trace stand-in (never instrumented), and a
    FusedMoE's Combine rows and the arrivals its launches count when they end with the weighted
    sum (``fused.InKernelSum.arrivals``; both None for an EP rank's workspace); the stream order
    of the calls over them (``graph_launch.StreamOrder``)."""

    sizes: BufferSizes
    tables: DeviceTables
    h: torch.Tensor
    h_scale: torch.Tensor | None
    l2_partial: torch.Tensor | None
    l2_ready: torch.Tensor | None
    trace: torch.Tensor
    combine: torch.Tensor | None
    sum_arrivals: torch.Tensor | None
    order: StreamOrder = field(default_factory=StreamOrder)

    @classmethod
    def allocate(cls, sizes: BufferSizes) -> MoEBuffers:
        b, dev, hidden = sizes.bounds, sizes.device, sizes.hidden
        fp8 = sizes.precision == "fp8"
        l2_partial, l2_ready = split_k_buffers(b.row_blocks, b.l2_splits, b.block_m, hidden,
                                               b.l2_n_blocks // b.l2_splits, dev)
        return cls(
            sizes,
            allocate_tables(b, hidden, sizes.precision, dev, source_rows=sizes.source_rows),
            torch.empty(b.rows, sizes.intermediate,
                        dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=dev),
            (torch.empty(b.rows, sizes.intermediate // FP8_SCALE_BLOCK, dtype=torch.float32,
                         device=dev) if fp8 else None),
            l2_partial, l2_ready,
            # one element stands in for the trace pointer
            torch.full((1,), -1, dtype=torch.int64, device=dev),
            (torch.empty(b.capacity, hidden, dtype=torch.bfloat16, device=dev)
             if sizes.combine_rows else None),
            torch.zeros(1, dtype=torch.int64, device=dev) if sizes.combine_rows else None)

    @property
    def nbytes(self) -> int:
        """The device memory these buffers take."""
        tensors = [getattr(self, f.name) for f in fields(self)]
        tensors += [getattr(self.tables, f.name) for f in fields(self.tables)]
        tensors += [t for d in (self.tables.tiles, self.tables.num_tiles) for t in d.values()]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def check_serves(self, sizes: BufferSizes) -> None:
        """Raise MoEContractError unless these buffers are sized for ``sizes``, exactly."""
        if self.sizes != sizes:
            raise MoEContractError(f"these buffers cannot serve this layer: "
                                   f"{self.sizes.differences(sizes)}")
