"""Backend choice and platform naming from hand-made inventories (no GPU needed)."""
from __future__ import annotations

import pytest

from xstage_lab.platform import BACKENDS, GPU, BackendChoice, Inventory, choose_backend, platform_name


def gpu(i: int, name: str = "NVIDIA H200", sms: int = 132, maps_host: bool = True) -> GPU:
    return GPU(index=i, name=name, sm_count=sms, l2_bytes=60 * 2**20, max_smem_per_sm=233472,
               max_smem_per_block_optin=232448, compute_capability="9.0",
               maps_host_memory=maps_host)


def inv(n: int, peer=None, name: str = "NVIDIA H200", error=None, maps_host: bool = True
        ) -> Inventory:
    """n GPUs; ``peer`` a set of ordered (src, dst) pairs, or "all"/None (all / none)."""
    if peer == "all":
        peer = {(i, j) for i in range(n) for j in range(n) if i != j}
    peer = peer or set()
    return Inventory(gpus=tuple(gpu(i, name, maps_host=maps_host) for i in range(n)),
                     peer=tuple(tuple((i, j) in peer for j in range(n)) for i in range(n)),
                     error=error)


def test_no_gpus():
    empty = Inventory(error="ImportError: No module named 'cupy'")
    for link in ("nvlink", "host", "local"):
        c = choose_backend("auto", empty, link)
        assert isinstance(c, BackendChoice)
        assert (c.name, c.requested) == ("replay", "auto")
        assert "0 GPU(s)" in c.reason and "cupy" in c.reason
        with pytest.raises(RuntimeError, match="the cuda backend needs a GPU"):
            choose_backend("cuda", empty, link)
        assert choose_backend("replay", empty, link).name == "replay"


def test_two_peer_gpus_measure_live():
    two = inv(2, "all")
    for link in ("nvlink", "host", "local"):
        c = choose_backend("auto", two, link)
        assert (c.name, c.requested) == ("cuda", "auto")
        assert "2 peer-capable" in c.reason
        assert choose_backend("cuda", two, link).name == "cuda"
        # replay is honoured even where cuda is possible
        assert choose_backend("replay", two, link).name == "replay"


def test_one_gpu_measures_the_host_link_live_and_replays_nvlink():
    """``auto``: the host link live, NVLink and the one-GPU local experiments replayed; ``cuda``:
    the host link and the local experiments live, NVLink replayed with the reason."""
    one = inv(1)
    assert [choose_backend("auto", one, link).name for link in ("nvlink", "host", "local")] == [
        "replay", "cuda", "replay"]
    assert [choose_backend("cuda", one, link).name for link in ("nvlink", "host", "local")] == [
        "replay", "cuda", "cuda"]
    nvlink = choose_backend("cuda", one, "nvlink")
    assert nvlink.reason.startswith("the nvlink link needs two peer-capable GPUs; this machine "
                                    "has 1 GPU(s)")
    assert "cuda measures them here" in choose_backend("auto", one, "local").reason
    # a GPU that cannot store into mapped host memory has no host link
    bare = inv(1, maps_host=False)
    for requested in ("auto", "cuda"):
        c = choose_backend(requested, bare, "host")
        assert c.name == "replay" and "maps pinned host memory" in c.reason
    with pytest.raises(ValueError, match="link must be one of"):
        choose_backend("auto", one, "pcie")


def test_two_gpus_without_peer_access_replay_nvlink():
    for peer in (None, {(0, 1)}, {(1, 0)}):  # none, or one direction only
        two = inv(2, peer)
        assert two.peer_capable_gpus == 1
        for requested in ("auto", "cuda"):
            c = choose_backend(requested, two)
            assert c.name == "replay"
            assert "2 GPU(s), 1 peer-capable" in c.reason
        assert choose_backend("auto", two, "host").name == "cuda"


def test_invalid_backend_name():
    for bad in ("gpu", "CUDA", "", "auto "):
        with pytest.raises(ValueError, match="backend must be one of"):
            choose_backend(bad, inv(2, "all"))
    assert BACKENDS == ("auto", "cuda", "replay")


def test_banner_names_the_choice():
    assert choose_backend("auto", inv(4, "all")).banner().startswith(
        "backend: cuda (requested auto; measuring live over nvlink: 4 GPU(s), 4 peer-capable")
    banner = choose_backend("auto", inv(1)).banner()
    assert banner.startswith("backend: replay (requested auto; ")
    assert "1 GPU(s)" in banner


def test_platform_link():
    from xstage_lab.platform import platform_key, platform_link

    assert platform_link("h200-x1-host") == "host" and platform_link("h200-x2") == "nvlink"
    assert platform_key("NVIDIA H200", 1, "local") == "h200-x1"


def test_platform_name():
    assert platform_name(inv(4, "all")) == "h200-x4"
    assert platform_name(inv(2, "all")) == "h200-x2"
    assert platform_name(inv(8, "all", name="NVIDIA H100 80GB HBM3")) == "h100-80gb-hbm3-x8"
    assert platform_name(inv(1, name="  nvidia GeForce RTX 4090 ")) == "geforce-rtx-4090-x1"
    with pytest.raises(RuntimeError, match="no GPU"):
        platform_name(Inventory(error="no driver"))


def test_peer_capable_gpus_and_access():
    assert Inventory().peer_capable_gpus == 0
    assert inv(1).peer_capable_gpus == 1
    assert inv(3).peer_capable_gpus == 1
    assert inv(4, "all").peer_capable_gpus == 4
    # two separate mutual pairs: the largest all-peer group has 2 GPUs
    pairs = {(0, 1), (1, 0), (2, 3), (3, 2)}
    assert inv(4, pairs).peer_capable_gpus == 2
    # every GPU to 0..2 mutually, GPU 3 with nobody
    tri = {(i, j) for i in range(3) for j in range(3) if i != j}
    assert inv(4, tri).peer_capable_gpus == 3
    two = inv(2, {(0, 1)})
    assert two.can_access_peer(0, 1) and not two.can_access_peer(1, 0)
    # a GPU is never its own peer, whatever the matrix says
    selfish = Inventory(gpus=(gpu(0), gpu(1)), peer=((True, True), (True, True)))
    assert not selfish.can_access_peer(0, 0)
    assert selfish.can_access_peer(1, 0)


def test_peer_capable_gpus_is_a_clique_not_a_star():
    # GPU 0 is a mutual peer of 1 and 2, but 1 and 2 are not peers of each other:
    # no three GPUs are all peers; the largest all-peer group has 2 GPUs
    star = {(0, 1), (1, 0), (0, 2), (2, 0)}
    assert inv(3, star).peer_capable_gpus == 2


def test_git_commit_prefers_the_commit_the_sender_names(monkeypatch):
    from xstage_lab.platform import git_commit

    monkeypatch.setenv("XSTAGE_GIT_COMMIT", "0123abcd")
    assert git_commit() == "0123abcd"
    monkeypatch.setenv("XSTAGE_GIT_COMMIT", "3413762415df5bf0a2127e9dc6c4379b9fd968d4+dirty")
    assert git_commit().endswith("+dirty")
    monkeypatch.delenv("XSTAGE_GIT_COMMIT")
    assert git_commit() != "0123abcd"


@pytest.mark.parametrize("named", ["7444daf-UNKNOWN", "7444DAF", "abc", "HEAD", "0123abcd+dirt",
                                   "0" * 41])
def test_git_commit_refuses_a_name_that_is_no_commits_hash(monkeypatch, named):
    from xstage_lab.platform import git_commit

    monkeypatch.setenv("XSTAGE_GIT_COMMIT", named)
    with pytest.raises(ValueError, match="not a commit's hash"):
        git_commit()


# ------------------------------------------------------------------------------ peer memory

BASES = (0x7F0000000000, 0x7E0000000000, 0x7D0000000000)  # three ranks' allocations


def test_peer_base_pointers_add_the_common_offset():
    from xstage_lab.platform import peer_base_pointers

    assert peer_base_pointers(BASES[1], BASES, 1, [0, 0, 0]) == BASES
    # a pooled tensor 4 KiB into every rank's allocation
    assert peer_base_pointers(BASES[2] + 4096, BASES, 2, [4096] * 3) == \
        tuple(b + 4096 for b in BASES)


def test_peer_base_pointers_refuse_offsets_that_differ():
    from xstage_lab.platform import PeerError, peer_base_pointers

    with pytest.raises(PeerError, match=r"offsets differ across ranks: \[4096, 0, 4096\]"):
        peer_base_pointers(BASES[0] + 4096, BASES, 0, [4096, 0, 4096])
    # this rank's own offset disagrees with what was gathered
    with pytest.raises(PeerError, match="offsets differ"):
        peer_base_pointers(BASES[0] + 512, BASES, 0, [4096] * 3)


def test_peer_base_pointers_refuse_a_wrong_peer_count():
    from xstage_lab.platform import PeerError, peer_base_pointers

    with pytest.raises(PeerError, match="returned 2 peer pointers for 3 ranks"):
        peer_base_pointers(BASES[0], BASES[:2], 0, [0, 0, 0])
    with pytest.raises(PeerError, match=r"rank 3 is not in \[0, P=3\)"):
        peer_base_pointers(BASES[0], BASES, 3, [0, 0, 0])


def test_peer_base_pointers_refuse_bad_addresses():
    from xstage_lab.platform import ALIGN_BYTES, PeerError, peer_base_pointers

    with pytest.raises(PeerError, match="lies before its allocation"):
        peer_base_pointers(BASES[0] - 16, BASES, 0, [-16] * 3)
    with pytest.raises(PeerError, match=f"{ALIGN_BYTES}-byte aligned"):
        peer_base_pointers(BASES[0] + 8, BASES, 0, [8] * 3)
    with pytest.raises(PeerError, match="non-null"):
        peer_base_pointers(BASES[0], (BASES[0], 0, BASES[2]), 0, [0] * 3)


def test_check_peer_places():
    from xstage_lab.platform import PeerError, check_peer_places

    pairs = {(0, 1), (1, 0), (0, 2), (2, 0)}  # GPUs 1 and 2 are no peers of each other
    peer = lambda a, b: (a, b) in pairs
    check_peer_places([("h", 0), ("h", 1), ("h", 2)], 0, peer)
    with pytest.raises(PeerError, match=r"GPU 1 \(rank 1\) has no peer access to GPU 2 \(rank 2\)"):
        check_peer_places([("h", 0), ("h", 1), ("h", 2)], 1, peer)
    with pytest.raises(PeerError, match="rank 1 is on host g, rank 0 on h: .* one host"):
        check_peer_places([("h", 0), ("g", 1)], 0, peer)


def test_symmetric_buffer_refuses_multicast_before_any_collective(monkeypatch):
    """No process group exists here: the refusals must come before any distributed call."""
    from xstage_lab.platform import SAFE_ENV, PeerError, symmetric_buffer

    for k, v in SAFE_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST")
    with pytest.raises(PeerError, match="NVLink multicast stays off.*TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        symmetric_buffer(1024, None)
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    with pytest.raises(PeerError, match="NCCL_NVLS_ENABLE"):
        symmetric_buffer(1024, None)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    with pytest.raises(ValueError, match="at least one element, got 0"):
        symmetric_buffer(0, None)


class FakeHandle:
    """Stands in for torch's rendezvous handle: records its barriers."""

    def __init__(self):
        self.barriers = []

    def barrier(self, channel: int = 0) -> None:
        self.barriers.append(channel)


def fake_symmetric_buffer(numel: int, world: int = 2, rank: int = 0):
    """A ``SymmetricBuffer`` over an ordinary CPU tensor, for the wrappers' CPU tests."""
    import torch

    from xstage_lab.platform import SymmetricBuffer

    tensor = torch.zeros(numel, dtype=torch.bfloat16)
    ptrs = tuple(tensor.data_ptr() + 1024 * r for r in range(world))
    return SymmetricBuffer(tensor, FakeHandle(), ptrs, torch.tensor(ptrs, dtype=torch.int64),
                           rank, world)


def test_symmetric_buffer_barrier_uses_channel_zero():
    buf = fake_symmetric_buffer(64)
    buf.barrier()
    assert buf.handle.barriers == [0]
