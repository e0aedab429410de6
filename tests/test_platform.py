"""Backend choice and platform naming from hand-made inventories (no GPU needed)."""
from __future__ import annotations

import pytest

from xstage_lab.platform import BACKENDS, GPU, BackendChoice, Inventory, choose_backend, platform_name


def gpu(i: int, name: str = "NVIDIA H200", sms: int = 132) -> GPU:
    return GPU(index=i, name=name, sm_count=sms, l2_bytes=60 * 2**20, max_smem_per_sm=233472,
               max_smem_per_block_optin=232448, compute_capability="9.0")


def inv(n: int, peer=None, name: str = "NVIDIA H200", error=None) -> Inventory:
    """n GPUs; ``peer`` a set of ordered (src, dst) pairs, or "all"/None (all / none)."""
    if peer == "all":
        peer = {(i, j) for i in range(n) for j in range(n) if i != j}
    peer = peer or set()
    return Inventory(gpus=tuple(gpu(i, name) for i in range(n)),
                     peer=tuple(tuple((i, j) in peer for j in range(n)) for i in range(n)),
                     error=error)


def test_no_gpus():
    empty = Inventory(error="ImportError: No module named 'cupy'")
    c = choose_backend("auto", empty)
    assert isinstance(c, BackendChoice)
    assert (c.name, c.requested) == ("replay", "auto")
    assert "0 GPU(s)" in c.reason and "cupy" in c.reason
    with pytest.raises(RuntimeError, match="two peer-capable"):
        choose_backend("cuda", empty)
    assert choose_backend("replay", empty).name == "replay"


def test_two_peer_gpus_measure_live():
    two = inv(2, "all")
    c = choose_backend("auto", two)
    assert (c.name, c.requested) == ("cuda", "auto")
    assert "2 peer-capable" in c.reason
    assert choose_backend("cuda", two).name == "cuda"
    # replay is honoured even where cuda is possible
    assert choose_backend("replay", two).name == "replay"


def test_two_gpus_without_peer_access_replay():
    for peer in (None, {(0, 1)}, {(1, 0)}):  # none, or one direction only
        two = inv(2, peer)
        assert two.peer_capable_gpus == 1
        c = choose_backend("auto", two)
        assert c.name == "replay"
        assert "2 GPU(s), 1 peer-capable" in c.reason
        with pytest.raises(RuntimeError):
            choose_backend("cuda", two)


def test_invalid_backend_name():
    for bad in ("gpu", "CUDA", "", "auto "):
        with pytest.raises(ValueError, match="backend must be one of"):
            choose_backend(bad, inv(2, "all"))
    assert BACKENDS == ("auto", "cuda", "replay")


def test_banner_names_the_choice():
    assert choose_backend("auto", inv(4, "all")).banner().startswith(
        "backend: cuda (requested auto; measuring live on 4 GPU(s), 4 peer-capable")
    banner = choose_backend("auto", inv(1)).banner()
    assert banner.startswith("backend: replay (requested auto; ")
    assert "1 GPU(s)" in banner


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
    monkeypatch.delenv("XSTAGE_GIT_COMMIT")
    assert git_commit() != "0123abcd"
