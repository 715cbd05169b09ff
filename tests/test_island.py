"""The island communicator's errors: a library wait that fails once its deadline has passed is
a timeout (Gloo says so only in its message), one that fails before it (a peer gone) is not.
Real Gloo process groups: two threads of this process, or this process and a spawned one."""

import datetime
import multiprocessing
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from hetccl_ray.islands.libraries import TorchIsland
from hetccl_ray.errors import HetCCLTimeoutError


def _island(store: "dist.Store", rank: int, timeout_s: float, size: int = 2) -> TorchIsland:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return TorchIsland(dist.ProcessGroupGloo(store, rank, size, opts), rank, size, False, timeout_s)


def _on_threads(size: int, fn) -> list:
    """``fn(island)`` on ``size`` threads, one rank of a real Gloo island each; their results."""
    store, results = dist.HashStore(), [None] * size

    def rank_main(rank: int) -> None:
        results[rank] = fn(_island(store, rank, 30.0, size))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    return results


@pytest.mark.parametrize("root", [0, 1, 2])
def test_gather_posts_every_range_at_once_and_fills_the_roots(root):
    counts, offsets = [3, 0, 5], [0, 3, 3]

    def gather(island: TorchIsland) -> torch.Tensor:
        buf = torch.full((8,), -1.0)
        offset, count = offsets[island.rank], counts[island.rank]
        buf[offset:offset + count] = torch.arange(count, dtype=torch.float32) + 10 * island.rank
        island.gather(buf, counts, root)
        return buf

    results = _on_threads(3, gather)
    expect = torch.tensor([0.0, 1, 2, 20, 21, 22, 23, 24])  # rank 0's three, rank 2's five
    assert torch.equal(results[root], expect)


def test_a_wait_past_the_deadline_is_a_timeout():
    store, islands = dist.HashStore(), {}
    makers = [threading.Thread(target=lambda r=r: islands.__setitem__(r, _island(store, r, 1.0))) for r in (0, 1)]
    [t.start() for t in makers]
    [t.join(30) for t in makers]
    started = time.monotonic()
    with pytest.raises(HetCCLTimeoutError, match="island library"):
        islands[0].recv(torch.zeros(4), 1)  # rank 1 never sends
    assert time.monotonic() - started >= 0.99


def _join_and_leave(port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
    _island(store, 1, 30.0)  # connected to rank 0; then the process ends


def test_a_peer_gone_before_the_deadline_is_not_a_timeout():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    peer = multiprocessing.get_context("spawn").Process(target=_join_and_leave, args=(port,))
    peer.start()
    island = _island(store, 0, 30.0)
    peer.join(60)
    got = torch.zeros(4)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as failure:
        island.recv(got, 1)
    assert not isinstance(failure.value, HetCCLTimeoutError)
    assert time.monotonic() - started < 15
    assert torch.equal(got, torch.zeros(4))
