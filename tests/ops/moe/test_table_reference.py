"""The host reference of the device tables (``table_reference``): what it lays out for a routing,
and that ``table_mismatches`` names each table where a device's differs from it (the device
routing against it: ``test_device_tables``)."""
import numpy as np
import torch

from xstage_lab.ops.moe.device_tables import SCHEDULES, TableBounds, allocate_tables
from xstage_lab.ops.moe.table_reference import host_tables, table_mismatches

BOUNDS = TableBounds(capacity=6, num_experts=4, block_m=4, l1_n_blocks=2, l2_n_blocks=1,
                     num_programs=3, lead_rows=1, expert_lead=False)
# three tokens, two picks each: experts 2, 0 / 2, 3 / 2, 2
IDS = torch.tensor([2, 0, 2, 3, 2, 2])


def _host():
    x = torch.arange(3 * 8, dtype=torch.float32).reshape(3, 8).to(torch.bfloat16)
    return host_tables(BOUNDS, IDS, x.repeat_interleave(2, dim=0), top_k=2)


def _device_as(host):
    """Device tables (on the CPU) holding exactly the reference's entries."""
    t = allocate_tables(BOUNDS, 8, "bf16", "cpu")
    lay = host.layout
    rows = lay.num_rows
    t.expert_counts.copy_(torch.tensor(lay.tokens_per_expert))
    t.expert_offsets.copy_(torch.tensor(np.concatenate(([0], np.cumsum(lay.blocks_per_expert)))
                                        * lay.block_m))
    t.meta[0] = rows // lay.block_m
    t.arrival_rows[:len(lay.arrival_rows)] = lay.arrival_rows.to(torch.int32)
    t.row_src[:rows], t.row_slot[:rows] = lay.row_src, lay.row_slot
    t.row_origin[:rows] = torch.from_numpy(host.row_origin)
    for s in SCHEDULES:
        t.num_tiles[s].copy_(torch.from_numpy(host.num_tiles[s]))
        width = host.tiles[s].shape[1]
        t.tiles[s][:, :width] = torch.from_numpy(host.tiles[s])
    return t


def test_the_reference_lays_out_each_experts_rows_and_their_tokens():
    host = _host()
    lay = host.layout
    # expert 0: one row, expert 2: four (one row block of 4), expert 3: one; each padded to 4
    assert lay.tokens_per_expert == (1, 0, 4, 1) and lay.num_rows == 12
    # layout row -> token: expert 0's pick of token 0, expert 2's of tokens 0, 1, 2, 2, ...
    assert host.row_origin.tolist() == [0, -1, -1, -1, 0, 1, 2, 2, 1, -1, -1, -1]
    # every row block's Linear-1 (2) and Linear-2 (1) tiles, in either schedule
    for s in SCHEDULES:
        assert host.num_tiles[s].sum() == 3 * (2 + 1)


def test_mismatches_name_each_table_that_differs():
    host = _host()
    device = _device_as(host)
    assert table_mismatches(device, host) == []
    device.row_slot[4] += 1
    device.tiles["wave"][1, 0, 1] += 1
    assert table_mismatches(device, host) == ["row_slot", "wave.tiles[1]"]
