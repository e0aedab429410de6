"""The link probe's trickle kernel (``kernels/link_trickle.py``): its launch, its targets (the
peer's symmetric buffer and a local one), and the checks before the first window (step 1 of
``link``: the trickle's stores and the workloads' outputs)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checks import bitwise_equal, poisoned
from ...dist_timing import all_gather_objects
from ...kernel_sources import load_kernel_module
from ...platform import symmetric_buffer
from ...ops import attention as att

_kernels = load_kernel_module("link_trickle")

DEVICE = "cuda"  # the current CUDA device of this rank
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


