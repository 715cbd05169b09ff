"""What already holds of the reliability issue: strangers on the border port, dead peers."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest
import ray
from ray.util import collective as col

import hetccl_ray
from tests import cluster as test_cluster


@pytest.fixture(scope="module")
def actors():
    cluster, actors = test_cluster.start({"a": 2, "b": 2})
    yield actors
    test_cluster.stop(cluster)


def _address(name, rank):
    col.barrier(group_name=name)
    return hetccl_ray.get_group(name).border.address


def _allreduce_after(name, rank, pause_s):
    time.sleep(pause_s)
    x = np.full(1000, rank + 1.0)
    col.allreduce(x, group_name=name)
    return x, hetccl_ray.border_stats(name)["rejected_connections"]


def test_stranger_with_wrong_secret_is_refused_and_the_collective_completes(actors):
    group = actors["a"][:2] + actors["b"][:2]
    hetccl_ray.create_collective_group(group, 4, [0, 1, 2, 3], group_name="guarded", timeout_s=30)
    addresses = ray.get([a.call.remote(_address, "guarded", r) for r, a in enumerate(group)])
    refs = [a.call.remote(_allreduce_after, "guarded", r, 1.0) for r, a in enumerate(group)]
    host, port = addresses[3]
    with socket.create_connection((host, port), timeout=5) as stranger:
        stranger.recv(16)                                   # the challenge
        stranger.sendall(b"\x00\x00\x00\x00" + b"garbage!" * 4)
        stranger.settimeout(5)
        assert stranger.recv(2) != b"OK"                    # closed, not admitted
    results = ray.get(refs, timeout=60)
    for x, _ in results:
        np.testing.assert_array_equal(x, np.full(1000, 10.0))
    assert results[3][1] >= 1


def _allreduce_expecting_failure(name, rank):
    col.barrier(group_name=name)
    started = time.monotonic()
    try:
        col.allreduce(np.ones(1 << 16), group_name=name)
        return "no error", 0.0
    except hetccl_ray.HetCCLError as exc:
        return str(exc), time.monotonic() - started


def _block_forever(name, rank):
    col.barrier(group_name=name)
    time.sleep(3600)


def test_dead_peer_fails_the_others_within_the_deadline(actors):
    group = [actors["a"][0], actors["b"][0], actors["b"][1]]
    hetccl_ray.create_collective_group(group, 3, [0, 1, 2], group_name="mortal", timeout_s=20)
    victim = group[2]
    victim.call.remote(_block_forever, "mortal", 2)
    refs = [a.call.remote(_allreduce_expecting_failure, "mortal", r) for r, a in enumerate(group[:2])]
    time.sleep(3)
    ray.kill(victim)
    results = ray.get(refs, timeout=60)
    for message, elapsed in results:
        assert message != "no error"
        assert elapsed < 3 + 10, message  # the kill comes 3 s in; far inside the 20 s deadline
        assert "allreduce #2 in group 'mortal'" in message, message
    assert "Connection closed by peer" in results[1][0]            # rank 1 shares the dead rank's island
    assert "rank 0 <-> rank 1 failed" in results[0][0]              # rank 0 hears it from its lane peer
