"""Reliability and security on a real local Ray cluster: strangers on the border port, dead
peers and re-created groups, mismatched calls, concurrent groups, bind address, secrets."""

from __future__ import annotations

import glob
import os
import threading
import time

import numpy as np
import pytest
import ray
import torch
from ray.util import collective as col

import hetccl_ray
from hetccl_ray.transport.tcp import dial
from tests import cluster as test_cluster


@pytest.fixture(scope="module")
def env():
    cluster, actors = test_cluster.start({"a": 4, "b": 4})
    yield cluster, actors
    test_cluster.stop(cluster)


@pytest.fixture
def actors(env):
    return env[1]


def _hetccl_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("hetccl"))


def _allreduce_value(name, rank, n=1000):
    x = np.full(n, rank + 1.0)
    col.allreduce(x, group_name=name)
    return x


def _check_sum(results, world, n=1000):
    for x in results:
        np.testing.assert_array_equal(x, np.full(n, world * (world + 1) / 2))


# -- strangers on the border port ----------------------------------------------------------------

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
    with dial(addresses[3], timeout_s=5) as stranger:  # rank 3's Unix socket: the same host
        stranger.recv(16)                                   # the challenge
        stranger.sendall(b"\x00\x00\x00\x00" + b"garbage!" * 4)
        stranger.settimeout(5)
        assert stranger.recv(2) != b"OK"                    # closed, not admitted
    results = ray.get(refs, timeout=60)
    for x, _ in results:
        np.testing.assert_array_equal(x, np.full(1000, 10.0))
    assert results[3][1] >= 1


# -- bind address and secrets --------------------------------------------------------------------

def _border_facts(name, rank):
    col.barrier(group_name=name)
    group = hetccl_ray.get_group(name)
    secret = group._rendezvous.get("rank/0")["secret"]
    shown = " ".join([repr(group), repr(group.border), repr(group.options), str(group.border_stats())])
    return group.border.address[0], ray.util.get_node_ip_address(), secret, secret in shown


def test_listeners_bind_to_the_node_address_or_the_option_and_secrets_stay_hidden(env):
    cluster, actors = env
    group = [actors["a"][2], actors["b"][2]]
    hetccl_ray.create_collective_group(group, 2, [0, 1], group_name="node-bound", timeout_s=30)
    hetccl_ray.create_collective_group(group, 2, [0, 1], group_name="loop-bound", timeout_s=30,
                                       bind_host="127.0.0.1")
    by_node = ray.get([a.call.remote(_border_facts, "node-bound", r) for r, a in enumerate(group)])
    by_option = ray.get([a.call.remote(_border_facts, "loop-bound", r) for r, a in enumerate(group)])
    for bound, node_ip, _, shown in by_node:
        assert bound == node_ip and bound not in ("0.0.0.0", "::")
        assert not shown
    for bound, _, _, shown in by_option:
        assert bound == "127.0.0.1" and not shown
    _check_sum(ray.get([a.call.remote(_allreduce_value, "loop-bound", r) for r, a in enumerate(group)]), 2)
    logs = ray._private.worker._global_node.get_logs_dir_path()
    secrets = {facts[2] for facts in by_node + by_option}
    for path in glob.glob(os.path.join(logs, "*")):
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                text = f.read()
            assert not any(secret in text for secret in secrets), path


# -- transport choice ----------------------------------------------------------------------------

def _transports(name):
    group = hetccl_ray.get_group(name)
    return {peer: (c.transport, c.why) for peer, c in group.lane_transports().items()}, \
        hetccl_ray.border_stats(name)["transports"]


def test_auto_picks_tcp_and_says_why_and_forced_rdma_is_a_clear_error(actors):
    group = [actors["a"][2], actors["b"][2]]
    hetccl_ray.create_collective_group(group, 2, [0, 1], group_name="auto-lanes", timeout_s=30)
    for rank, (lanes, stats) in enumerate(ray.get([a.call.remote(_transports, "auto-lanes")
                                                   for a in group])):
        transport, why = lanes[1 - rank]
        assert transport == "tcp" and "no usable RDMA port" in why, why
        assert stats == {1 - rank: "tcp"}
    with pytest.raises(hetccl_ray.HetCCLError) as failed:  # formed before create returns: it fails there
        hetccl_ray.create_collective_group(group, 2, [0, 1], group_name="rdma-only", timeout_s=30, transport="rdma")
    message = str(failed.value)
    assert "transport='rdma' between rank" in message and "is impossible" in message, message
    assert "no usable RDMA port" in message, message


# -- mismatched calls ----------------------------------------------------------------------------

MISMATCHES = {
    # case -> (what each rank calls, the ranks named as the odd ones, what they called)
    "dtype": (lambda rank: ("allreduce", 100, np.float32 if rank == 3 else np.float64, 0), [3], "float32"),
    "count": (lambda rank: ("allreduce", 101 if rank == 1 else 100, np.float64, 0), [1], "101 elements"),
    "root": (lambda rank: ("broadcast", 100, np.float64, 1 if rank == 2 else 0), [2], "root 1"),
    "op": (lambda rank: ("reduce" if rank == 0 else "allreduce", 100, np.float64, 0), [0], "reduce"),
    # the others' all-to-all blocks (800 KB each, more than a socket holds) went ahead of the
    # round: every rank drains what it was sent, and the next op finds the links clean
    "ahead": (lambda rank: ("allreduce", 100, np.float64, 0) if rank == 2 else ("alltoall", 100_000, np.float64, 0),
              [2], "allreduce"),
}


def _mismatched_then_fine(name, rank, case):
    op, n, dtype, root = MISMATCHES[case][0](rank)
    x = np.ones(n, dtype=dtype)
    try:
        if op == "allreduce":
            col.allreduce(x, group_name=name)
        elif op == "broadcast":
            col.broadcast(x, src_rank=root, group_name=name)
        elif op == "alltoall":
            hetccl_ray.alltoall([torch.from_numpy(x) for _ in range(4)], [torch.zeros(n, dtype=torch.float64)
                                                                        for _ in range(4)], group_name=name)
        else:
            col.reduce(x, dst_rank=root, group_name=name)
        message = "no error"
    except hetccl_ray.HetCCLMismatchError as exc:
        message = str(exc)
    return message, _allreduce_value(name, rank)


@pytest.fixture(scope="module")
def mixed(env):
    actors = env[1]
    group = actors["a"][:2] + actors["b"][:2]
    hetccl_ray.create_collective_group(group, 4, [0, 1, 2, 3], group_name="mixed", timeout_s=30)
    return group


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatched_calls_raise_on_every_rank_naming_the_odd_ranks(mixed, case):
    _, odd, what = MISMATCHES[case]
    results = ray.get([a.call.remote(_mismatched_then_fine, "mixed", r, case) for r, a in enumerate(mixed)],
                      timeout=60)
    for rank, (message, after) in enumerate(results):
        assert "mismatched call" in message and "in group 'mixed'" in message, message
        assert f"ranks {odd} called " in message, message
        odd_part = message.split(f"ranks {odd} called ")[1].split(";")[0]
        assert what in odd_part, message
        np.testing.assert_array_equal(after, np.full(1000, 10.0))  # the group is still usable


# -- two groups at once on shared actors ---------------------------------------------------------

def _concurrent_ops(rank_in, rounds):
    """Run ``rounds`` allreduces on each group this actor belongs to, one thread per group."""
    results, errors = {}, []

    def work(name, rank):
        try:
            out = []
            for i in range(rounds):
                x = np.full(257 + 31 * i, (rank + 1.0) * (i + 1))
                col.allreduce(x, group_name=name)
                out.append(x)
            results[name] = out
        except Exception as exc:  # noqa: BLE001 - returned to the test
            errors.append(f"{name}: {exc!r}")

    threads = [threading.Thread(target=work, args=item) for item in rank_in.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results, errors


def test_two_groups_share_actors_without_cross_talk(actors):
    left = [actors["a"][0], actors["a"][1], actors["b"][0], actors["b"][1]]      # 2+2 by labels
    right = [actors["b"][1], actors["a"][2], actors["a"][0], actors["b"][2]]     # 1+2+1 by override
    hetccl_ray.create_collective_group(left, 4, [0, 1, 2, 3], group_name="left", timeout_s=30)
    hetccl_ray.create_collective_group(right, 4, [0, 1, 2, 3], group_name="right", timeout_s=30,
                                       islands={0: "x", 1: "y", 2: "y", 3: "z"})
    for name, group in (("left", left), ("right", right)):   # Ray forms groups under one lock per
        ray.get([a.call.remote(_address, name, r) for r, a in enumerate(group)])  # process: form them in turn
    everyone = list(dict.fromkeys(left + right))
    ranks = [{name: group.index(a) for name, group in (("left", left), ("right", right)) if a in group}
             for a in everyone]
    rounds = 20
    outcomes = ray.get([a.call.remote(_concurrent_ops, r, rounds) for a, r in zip(everyone, ranks)], timeout=300)
    for (results, errors), rank_in in zip(outcomes, ranks):
        assert not errors, errors
        assert set(results) == set(rank_in)
        for out in results.values():
            for i, x in enumerate(out):
                np.testing.assert_array_equal(x, np.full(257 + 31 * i, 10.0 * (i + 1)))
    ray.get([a.call.remote(lambda: col.destroy_collective_group("left")) for a in left])
    _check_sum(ray.get([a.call.remote(_allreduce_value, "right", r) for r, a in enumerate(right)]), 4)


# -- a dead peer, then the group re-created ------------------------------------------------------

def _allreduce_expecting_failure(name, rank):
    col.barrier(group_name=name)
    started = time.monotonic()
    try:
        col.allreduce(np.ones(1 << 16), group_name=name)
        return "no error", 0.0, ""
    except hetccl_ray.HetCCLError as exc:
        failure, elapsed = str(exc), time.monotonic() - started
    try:
        col.allreduce(np.ones(4), group_name=name)
        later = "no error"
    except hetccl_ray.HetCCLBrokenError as exc:
        later = str(exc)
    return failure, elapsed, later


def _block_forever(name, rank):
    col.barrier(group_name=name)
    time.sleep(3600)


def _destroy(name):
    col.destroy_collective_group(name)
    deadline = time.monotonic() + 10
    while _hetccl_threads() and time.monotonic() < deadline:
        time.sleep(0.1)
    return _hetccl_threads()


# the border's sockets (the check in three hops, or in one), or one host's shared memory
@pytest.mark.parametrize("flat, one_hop", [("off", False), ("off", True), ("auto", False)])
def test_dead_peer_fails_the_others_and_the_group_is_recreated(env, flat, one_hop):
    cluster, actors = env
    survivors = [actors["a"][3], actors["b"][3]]
    victim = cluster.workers(["b"])[0]
    group, name = survivors + [victim], f"mortal-{flat}-{one_hop}"
    hetccl_ray.create_collective_group(group, 3, [0, 1, 2], group_name=name, timeout_s=20, flat=flat,
                                       one_hop=one_hop)
    victim.call.remote(_block_forever, name, 2)
    refs = [a.call.remote(_allreduce_expecting_failure, name, r) for r, a in enumerate(survivors)]
    time.sleep(3)
    ray.kill(victim)
    results = ray.get(refs, timeout=60)
    for message, elapsed, later in results:
        assert message != "no error"
        assert elapsed < 3 + 10, message  # the kill comes 3 s in; far inside the 20 s deadline
        assert f"allreduce #2 in group '{name}'" in message, message
        assert "ranks that did not arrive: [2]" in message, message
        assert "is broken by an earlier failure" in later and "allreduce #2" in later, later
    if one_hop:  # each survivor waits for the dead rank's own message
        assert all(f"rank {r} <-> rank 2 failed" in message for r, (message, _, _) in enumerate(results)), results
    elif flat == "off":
        assert "connection closed by peer" in results[1][0].lower()    # rank 1 shares the dead rank's island
        assert "rank 0 <-> rank 1 failed" in results[0][0]              # rank 0 hears it from its lane peer
    else:  # every rank waits for the dead one in shared memory, and sees its link closed
        assert all("ranks [2] are gone (their connections closed)" in message for message, _, _ in results), results

    leftover = ray.get([a.call.remote(_destroy, name) for a in survivors], timeout=60)
    assert leftover == [[], []]                                     # no thread left behind
    newcomer = cluster.workers(["b"])[0]
    group = [survivors[1], newcomer, survivors[0]]                  # new ranks, too
    hetccl_ray.create_collective_group(group, 3, [0, 1, 2], group_name=name, timeout_s=20)
    _check_sum(ray.get([a.call.remote(_allreduce_value, name, r) for r, a in enumerate(group)]), 3)
    assert ray.get([a.call.remote(_destroy, name) for a in group], timeout=60) == [[], [], []]


def _destroy_group(name):
    col.destroy_collective_group(name)


def test_a_group_holds_its_name_until_a_rank_destroys_it_and_starts_no_actor(actors, monkeypatch):
    """The door forms each rank with Ray's init_collective_group: no info actor is started, the
    name is held in Ray's KV; a second group of that name is refused while the first lives,
    any one rank's destroy frees it (its rank 0 may be the one that died), and a late destroy
    from an earlier incarnation leaves the new one's name alone."""
    from hetccl_ray.doors import ray_collective

    monkeypatch.setattr(ray_collective, "_NAME_GRACE_S", 0.5)
    first, second = [actors["a"][0], actors["b"][0]], [actors["a"][1], actors["b"][1]]

    def create(group, ranks):
        hetccl_ray.create_collective_group(group, 2, ranks, group_name="held", timeout_s=20)

    def still_held(group):
        with pytest.raises(hetccl_ray.HetCCLError, match="group 'held' still exists"):
            create(group, [0, 1])

    create(first, [0, 1])
    with pytest.raises(ValueError):
        ray.get_actor("info_held")
    _check_sum(ray.get([a.call.remote(_allreduce_value, "held", r) for r, a in enumerate(first)]), 2)
    still_held(second)
    with pytest.raises(ValueError, match=r"ranks must give each of the 2 actors its own one of 0..1, got \[1, 1\]"):
        hetccl_ray.create_collective_group(second, 2, [1, 1], group_name="held-too", timeout_s=20)
    ray.get(first[1].call.remote(_destroy_group, "held"), timeout=60)  # rank 1 only
    create(second, [1, 0])
    _check_sum(ray.get([a.call.remote(_allreduce_value, "held", r) for r, a in zip([1, 0], second)]), 2)
    ray.get(first[0].call.remote(_destroy_group, "held"), timeout=60)  # the first incarnation's rank 0, late
    still_held(first)
    ray.get([a.call.remote(_destroy_group, "held") for a in second], timeout=60)
    create(first, [0, 1])
    ray.get([a.call.remote(_destroy_group, "held") for a in first], timeout=60)


# -- a tensor over 2 GiB across the border -------------------------------------------------------

def _big_allreduce(name, rank, n):
    x = np.resize(np.arange(256, dtype=np.uint8), n)
    x += np.uint8(rank)  # uint8 wraps like the reduction
    col.allreduce(x, group_name=name)
    row, whole = ((np.arange(256) * 2 + 1) % 256).astype(np.uint8), n // 256 * 256  # x[i]: (i % 256) * 2 + 1
    rows = x[:whole].view(np.uint64).reshape(-1, 32)  # compared 8 bytes at a time
    wrong = np.flatnonzero((rows != row.view(np.uint64)).any(axis=1))
    if wrong.size or not np.array_equal(x[whole:], row[:n - whole]):
        return f"wrong from element {wrong[0] * 256 if wrong.size else whole}"
    return hetccl_ray.border_stats(name)["last_op_bytes_sent"]


@pytest.mark.slow
def test_tensor_over_2_gib_crosses_the_border(actors):
    group = [actors["a"][2], actors["b"][2]]
    hetccl_ray.create_collective_group(group, 2, [0, 1], group_name="big", timeout_s=300, flat="off")  # the border path
    n = (2 << 30) + 4099
    sent = ray.get([a.call.remote(_big_allreduce, "big", r, n) for r, a in enumerate(group)], timeout=600)
    assert sent == [n, n]                                           # each sends its whole partial once
    ray.get([a.call.remote(lambda: col.destroy_collective_group("big")) for a in group])


# -- the hardware suite's op checks, on the CPU ----------------------------------------------------

def test_the_hardware_suites_op_checks_pass_on_cpu(actors):
    from tests.hw.ops import every_op

    group = [actors["a"][2], actors["b"][2], actors["b"][3]]
    hetccl_ray.create_collective_group(group, 3, [0, 1, 2], group_name="hw-ops-on-cpu", timeout_s=60)
    assert ray.get([a.call.remote(every_op, "hw-ops-on-cpu", r, 3, "cpu") for r, a in enumerate(group)]) == [[]] * 3


def _barrier_then_allreduce(name, rank):
    col.barrier(group_name=name)
    return _allreduce_value(name, rank), hetccl_ray.border_stats(name)["per_op"]


def test_without_call_checks_ops_still_run_and_no_check_is_sent(actors):
    group = [actors["a"][2], actors["b"][2], actors["b"][3]]
    hetccl_ray.create_collective_group(group, 3, [0, 1, 2], group_name="unchecked", timeout_s=30, check_calls=False)
    results = ray.get([a.call.remote(_barrier_then_allreduce, "unchecked", r) for r, a in enumerate(group)])
    _check_sum([x for x, _ in results], 3)
    assert all("check" not in per_op and per_op.get("allreduce") for _, per_op in results[:2]), results


def _broadcasts_then_stats(name, rank, world, n):
    group, got = hetccl_ray.get_group(name), []
    col.barrier(group_name=name)
    before = group.border_stats()["messages_sent"]
    for root in range(world):
        x = torch.full((n,), float(rank * 10 + 1)) if rank == root else torch.zeros(n)
        col.broadcast(x, root, group_name=name)
        got.append(x.numpy())
    stats = group.border_stats()
    return got, stats["per_op"].get("broadcast", 0), stats["messages_sent"] - before, group.plan_of("broadcast", n * 4)


def test_without_call_checks_a_small_broadcast_takes_two_hops_and_sends_the_bound(actors):
    """Calls not checked: a small broadcast is the two-hop plan (no rows): every root's values
    on every rank, one message per receiver (the round would send four: up, across both ways,
    down), and the border bytes of all of them the bound (k-1)S each."""
    group = [actors["a"][1], actors["b"][0], actors["b"][1]]
    name, world, n = "unchecked-broadcast", 3, 256
    hetccl_ray.create_collective_group(group, world, list(range(world)), group_name=name, timeout_s=30,
                                       check_calls=False, flat="off", small_bytes=1 << 16)
    results = ray.get([a.call.remote(_broadcasts_then_stats, name, r, world, n) for r, a in enumerate(group)])
    for got, _, _, plan in results:
        assert plan == "2hop"  # the size the small plans take, calls not checked
        for root in range(world):
            np.testing.assert_array_equal(got[root], np.full(n, root * 10 + 1.0))
    assert sum(messages for _, _, messages, _ in results) == world * (world - 1)
    assert sum(sent for _, sent, _, _ in results) == world * (2 - 1) * n * 4  # two islands: S per broadcast
    ray.get([a.call.remote(lambda: col.destroy_collective_group(name)) for a in group])


def _agreed_then_different_ops(name, rank):
    col.barrier(group_name=name)  # its check shows every rank on host memory: the vendor op runs alone after it
    x = torch.ones(8192)  # 32 KiB: above the group's small round
    started = time.monotonic()
    try:
        if rank == 0:
            col.broadcast(x, 0, group_name=name)
        else:
            col.allreduce(x, group_name=name)
    except hetccl_ray.HetCCLError as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - started
    return "no error", time.monotonic() - started


def test_unchecked_calls_that_differ_are_named_when_they_time_out(actors):
    """Calls not checked, one island: rank 0 broadcasts where rank 1 allreduces, each in the
    island library, which waits for the other until the deadline. The timeout reads what each
    rank published (its op number and call row) and names the calls, not "ranks that did not
    arrive: []" (both arrived, at different calls)."""
    group = [actors["a"][0], actors["a"][1]]
    name = "unchecked-different"
    hetccl_ray.create_collective_group(group, 2, [0, 1], group_name=name, timeout_s=3, check_calls=False,
                                       small_bytes=1024)
    results = ray.get([a.call.remote(_agreed_then_different_ops, name, r) for r, a in enumerate(group)],
                      timeout=60)
    for rank, (message, took) in enumerate(results):
        assert message.startswith("HetCCLMismatchError") and "found when it timed out" in message, (rank, message)
        assert "ranks [0] called broadcast #2" in message and "ranks [1] called allreduce #2" in message, message
        assert took < 3 + 3, (rank, took)
