"""The RDMA border alone: wire formats, the MR cache, chunking, completion routing, and the
whole protocol on the FAKE in-process NIC (tests/fake_nic.py; no RDMA device here)."""

from __future__ import annotations

import gc
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hetccl_ray.runtime import collectives
from hetccl_ray.group.rendezvous import StoreRendezvous
from hetccl_ray.errors import HetCCLMismatchError, HetCCLPeerError, HetCCLTimeoutError
from hetccl_ray.transport.base import Tag, chunks
from hetccl_ray.transport.rdma import (ABORT, CTS, Completion, CompletionRouter, ConnInfo, Control, MRCache,
                                       RdmaBorder, Region)
from tests.fake_nic import FakeFabric
from tests.fakes import run_ranks


def rdma_borders(n: int, staged: bool = False, delay_s: float = 0.0, **kwargs) -> list[RdmaBorder]:
    """One RDMA border per rank on FAKE NICs, connected through a real in-process c10d store
    (``delay_s``: writes done late, as by DMA)."""
    fabric, store = FakeFabric(delay_s), dist.HashStore()
    borders = [RdmaBorder(r, fabric.nic(f"fake_mlx5_{r}", staged), StoreRendezvous(store, "rdma-test"), timeout_s=10,
                          **kwargs) for r in range(n)]
    with ThreadPoolExecutor(n) as pool:  # ranks connect at once, as in separate processes
        list(pool.map(lambda b: b.connect([p for p in range(n) if p != b.rank]), borders))
    return borders


def close_all(borders) -> None:
    for border in borders:
        border.close()


# -- wire formats and pure helpers -----------------------------------------------------------------

def test_connection_data_survives_the_rendezvous_record():
    info = ConnInfo("mlx5_0", 1, qpn=0x1234, psn=0xABCDE, lid=7, gid="fe80::1", mtu=4096)
    assert ConnInfo.from_record(info.to_record()) == info


@pytest.mark.parametrize("message", [Control(CTS, Tag(1, 2**40, 3), 1 << 33, 0x7F00DEAD0000, 0xFFFFFFFF, 1 << 20, 9),
                                     Control(ABORT, Tag(7, 1, 0), 0, xfer=1)])
def test_control_messages_survive_encoding(message):
    assert Control.decode(message.encode()) == message


def test_garbage_control_message_is_refused():
    with pytest.raises(ValueError, match="bad RDMA control message"):
        Control.decode(b"\0" * 64)


@pytest.mark.parametrize("nbytes,chunk", [(0, 4), (1, 4), (8, 4), (9, 4), ((3 << 30) + 5, 1 << 20)])
def test_chunks_tile_the_transfer(nbytes, chunk):
    spans = chunks(nbytes, chunk)
    assert sum(length for _, length in spans) == nbytes
    assert all(0 < length <= chunk for _, length in spans)
    assert [offset for offset, _ in spans] == [i * chunk for i in range(len(spans))]


def _counting_cache(capacity=1 << 30):
    calls = {"register": [], "deregister": []}

    def register(addr, length, device):
        calls["register"].append((addr, length))
        return Region(addr, length, lkey=len(calls["register"]), rkey=len(calls["register"]))

    return MRCache(register, lambda region: calls["deregister"].append(region), capacity), calls


def test_mr_cache_registers_a_storage_once_and_finds_views_in_it():
    cache, calls = _counting_cache()
    base = torch.zeros(1000, dtype=torch.float64)
    whole = cache.region(base)
    for view in (base[10:20], base[500:], base[::1]):
        assert cache.region(view) == whole
    assert whole.addr == base.data_ptr() and whole.length == 8000
    assert (cache.hits, cache.misses, len(calls["register"])) == (3, 1, 1)


def test_mr_cache_keeps_registered_memory_alive_and_evicts_by_bytes():
    cache, calls = _counting_cache(capacity=3000)
    first = torch.zeros(250, dtype=torch.float64)       # 2000 bytes
    region = cache.region(first)
    address = first.data_ptr()
    del first
    gc.collect()
    reuse = torch.zeros(250, dtype=torch.float64)       # a free at that address would be reused here
    assert reuse.data_ptr() != address                  # the cache still holds the old storage
    cache.region(reuse)                                 # 4000 bytes > 3000: the oldest goes
    assert calls["deregister"] == [region] and cache.registered_bytes == 2000
    cache.clear()
    assert len(calls["deregister"]) == 2 and cache.registered_bytes == 0


def test_mr_cache_never_deregisters_a_region_a_transfer_holds():
    cache, calls = _counting_cache(capacity=3000)
    first, second, third = (torch.zeros(250, dtype=torch.float64) for _ in range(3))  # 2000 bytes each
    held = cache.hold(first)
    cache.region(second)                    # 4000 > 3000, but the oldest is held and the newest asked for
    assert calls["deregister"] == [] and cache.registered_bytes == 4000
    kept = cache.region(third)              # the one neither held nor asked for goes
    assert len(calls["deregister"]) == 1 and held not in calls["deregister"]
    cache.release(first)                    # done with it: now it may go, as the oldest
    assert calls["deregister"][-1] == held and cache.registered_bytes == 2000
    assert cache.region(third) == kept


def test_router_hands_each_completion_to_its_waiter_once():
    router, seen = CompletionRouter(), []
    ids = [router.expect(lambda c, i=i: seen.append((i, c.kind))) for i in range(3)]
    for wr_id, kind in zip(reversed(ids), ("write", "recv", "send")):
        router.route(Completion(wr_id, qpn=5, kind=kind))
    assert seen == [(2, "write"), (1, "recv"), (0, "send")] and router.pending() == 0
    with pytest.raises(KeyError, match="unknown work request"):
        router.route(Completion(ids[0], qpn=5, kind="write"))


# -- the border on the FAKE NIC --------------------------------------------------------------------

def _exchange(borders, a, b, send, recv, op=None, tag=Tag(1, 1, 0)):
    handles = [borders[b].irecv(a, recv, tag, op=op), borders[a].isend(b, send, tag)]
    for handle in handles:
        handle.wait(10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
@pytest.mark.parametrize("n", [1, 1000, (1 << 20) + 3])
def test_send_lands_in_the_receive_buffer_in_chunks(dtype, n):
    borders = rdma_borders(2, chunk_bytes=64 << 10, depth=4)
    try:
        data = torch.from_numpy(np.random.default_rng(n).integers(0, 100, n)).to(dtype)
        out = torch.zeros(n, dtype=dtype)
        misses = borders[1].mrs.misses
        _exchange(borders, 0, 1, data, out)
        np.testing.assert_array_equal(out.numpy(), data.numpy())
        assert borders[0].bytes_sent == borders[1].bytes_received == n * data.element_size()
        assert borders[1].mrs.misses == misses + 1        # the destination, registered once
        _exchange(borders, 0, 1, data, out, tag=Tag(1, 2, 0))
        assert borders[1].mrs.misses == misses + 1 and borders[1].mrs.hits >= 1
    finally:
        close_all(borders)


@pytest.mark.parametrize("op", [None, "sum"])
def test_back_to_back_transfers_to_one_peer_never_share_a_staging_buffer(op):
    """Writes read their source, and land, late (FAKE DMA): three staged messages in flight to
    one peer at once must each have their own staging and landing buffers."""
    borders = rdma_borders(2, staged=True, delay_s=0.02, chunk_bytes=4096)
    try:
        n = 3000
        sent = [torch.full((n,), float(10 * (q + 1))) for q in range(3)]
        got = [torch.ones(n) for _ in range(3)]
        recvs = [borders[1].irecv(0, got[q], Tag(1, q + 1, 0), op=op) for q in range(3)]
        sends = [borders[0].isend(1, sent[q], Tag(1, q + 1, 0)) for q in range(3)]
        for handle in sends + recvs:
            handle.wait(10)
        for q in range(3):
            np.testing.assert_array_equal(got[q].numpy(), sent[q].numpy() + (1 if op else 0))
    finally:
        close_all(borders)


@pytest.mark.parametrize("op,ref", [("sum", np.add), ("max", np.maximum), ("product", np.multiply)])
def test_reduce_on_arrival_chunk_by_chunk(op, ref):
    borders = rdma_borders(2, chunk_bytes=4096)
    try:
        rng = np.random.default_rng(1)
        mine, theirs = rng.integers(1, 5, 10_007).astype(np.float64), rng.integers(1, 5, 10_007).astype(np.float64)
        acc = torch.from_numpy(mine.copy())
        _exchange(borders, 0, 1, torch.from_numpy(theirs), acc, op=op)
        np.testing.assert_array_equal(acc.numpy(), ref(mine, theirs))
    finally:
        close_all(borders)


def test_mismatched_size_fails_both_ends_naming_both_calls():
    borders = rdma_borders(2)
    try:
        recv = borders[1].irecv(0, torch.zeros(10), Tag(1, 1, 0))
        send = borders[0].isend(1, torch.zeros(12), Tag(1, 1, 0))
        for handle in (send, recv):
            with pytest.raises(HetCCLMismatchError, match="with 40 bytes from rank 0, got .* with 48 bytes"):
                handle.wait(10)
    finally:
        close_all(borders)


def test_a_failed_write_names_the_device_and_queue_pair():
    borders = rdma_borders(2)
    try:
        borders[0].nic.corrupt_rkeys = True
        recv = borders[1].irecv(0, torch.zeros(10), Tag(1, 1, 0))
        send = borders[0].isend(1, torch.ones(10), Tag(1, 1, 0))
        with pytest.raises(HetCCLPeerError, match=r"RDMA fake_mlx5_0 QP \d+ \(rank 0 <-> rank 1\): write failed "
                                                  r"with status 'remote access error'"):
            send.wait(10)
        borders[1].close()                                   # the receiver gives up when its border closes
        with pytest.raises(HetCCLPeerError, match="border closed"):
            recv.wait(10)
    finally:
        close_all(borders)


def test_close_leaves_no_thread_and_no_registration():
    borders = rdma_borders(2)
    _exchange(borders, 0, 1, torch.ones(100), torch.zeros(100))
    close_all(borders)
    assert all(not b.nic.registered for b in borders)
    import threading
    assert not [t.name for t in threading.enumerate() if t.name.startswith("hetccl-rdma")]


# -- every plan over the RDMA border ---------------------------------------------------------------

LAYOUTS = {"2x2": ["a", "a", "b", "b"], "1+2+3": ["x", "y", "x", "z", "y", "x"]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_plan_over_the_rdma_border(layout):
    islands = LAYOUTS[layout]
    world = len(islands)
    data = np.random.default_rng(3).integers(1, 4, size=(world, 3001)).astype(np.float64)
    order = None

    def body(ctx):
        nonlocal order
        order = ctx.topo.island_major_order
        x = torch.from_numpy(data[ctx.rank].copy())
        collectives.collective(ctx, "allreduce", x, reduce="sum")
        b = torch.from_numpy(data[ctx.rank].copy())
        collectives.collective(ctx, "broadcast", b, world - 1)
        g = torch.zeros(world * 5, dtype=torch.float64)
        slot = ctx.topo.island_major_order.index(ctx.rank)
        g[slot * 5:(slot + 1) * 5] = float(ctx.rank)
        collectives.collective(ctx, "allgather", g)
        return x.numpy(), b.numpy(), g.numpy()

    borders = rdma_borders(world, chunk_bytes=8192, depth=2)
    try:
        results, _ = run_ranks(islands, body, borders=borders, piece_bytes=4096)
    finally:
        close_all(borders)
    for x, b, g in results:
        np.testing.assert_array_equal(x, data.sum(axis=0))
        np.testing.assert_array_equal(b, data[world - 1])
        np.testing.assert_array_equal(g, np.repeat(np.array(order, dtype=np.float64), 5))


def test_a_verbs_error_while_connecting_names_device_and_queue_pairs():
    fabric, store = FakeFabric(), dist.HashStore()
    nics = [fabric.nic("fake_mlx5_0"), fabric.nic("fake_mlx5_1")]
    borders = [RdmaBorder(r, nics[r], StoreRendezvous(store, "broken"), timeout_s=5) for r in range(2)]
    for nic in nics:
        nic.fail_connect = True  # as a to_rts with a bad GID or MTU fails

    def connect(border):
        try:
            border.connect([1 - border.rank])
        except HetCCLPeerError as exc:
            return str(exc)

    with ThreadPoolExecutor(2) as pool:
        messages = list(pool.map(connect, borders))
    close_all(borders)
    for rank, message in enumerate(messages):
        assert f"RDMA fake_mlx5_{rank} QP" in message and f"could not connect to rank {1 - rank}" in message, message


def test_a_peer_that_never_publishes_its_queue_pairs_is_named():
    """Connecting waits for the peer's queue-pair record until the deadline, then names the rank."""
    fabric, store = FakeFabric(), dist.HashStore()
    border = RdmaBorder(0, fabric.nic("fake_mlx5_0"), StoreRendezvous(store, "alone"), timeout_s=0.3)
    try:
        with pytest.raises(HetCCLTimeoutError, match=r"rank 0: ranks \[1\] did not publish their RDMA queue pairs"):
            border.connect([1])
    finally:
        border.close()
