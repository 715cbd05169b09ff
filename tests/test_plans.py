"""Plans alone: threads as ranks over the in-process FAKE island and border."""

import queue
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hetccl_ray.runtime import collectives, runner
from hetccl_ray.core import planner, routes
from hetccl_ray.islands import shm
from hetccl_ray.memory.buffers import combine
from hetccl_ray.core.topology import Topology
from hetccl_ray.transport.routed import RoutedBorder
from hetccl_ray.transport.tcp import TcpBorder
from tests.fakes import FakeBorder, run_ranks

LAYOUTS = {
    "2x2": ["a", "a", "b", "b"],
    "1+2+3 interleaved": ["x", "y", "x", "z", "y", "x"],
    "2+3": ["a", "b", "a", "b", "b"],
    "one island": ["a", "a", "a"],
    "one rank": ["a"],
}
NUMPY_OPS = {"sum": np.sum, "product": np.prod, "min": np.min, "max": np.max}
SIZES = [1, 7, 1000]


def inputs(world: int, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 4, size=(world, n)).astype(np.float64)


def border_total(borders) -> int:
    return sum(b.bytes_sent for b in borders)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", NUMPY_OPS)
@pytest.mark.parametrize("n", SIZES)
def test_allreduce(layout, op, n):
    islands = LAYOUTS[layout]
    data = inputs(len(islands), n)
    results, borders = run_ranks(islands, lambda ctx: _allreduce(ctx, data[ctx.rank], op))
    expect = NUMPY_OPS[op](data, axis=0)
    for got in results:
        np.testing.assert_array_equal(got, expect)
    k = len(set(islands))
    assert border_total(borders) == 2 * (k - 1) * n * 8


def _allreduce(ctx, row, op):
    buf = torch.tensor(row)
    collectives.collective(ctx, "allreduce", buf, reduce=op)
    return buf.numpy()


def _island_major(topo: Topology, rows: np.ndarray) -> np.ndarray:
    return np.concatenate([rows[r] for r in topo.island_major_order])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("piece_bytes", [None, 24, 800])  # whole, and pipelined pieces
def test_reducescatter(layout, chunk, piece_bytes):
    islands = LAYOUTS[layout]
    world = len(islands)
    topo = Topology.from_islands(islands)
    data = inputs(world, world * chunk, seed=1).reshape(world, world, chunk)  # [rank, dest, chunk]

    def body(ctx):
        buf = torch.tensor(_island_major(topo, data[ctx.rank]))
        out = torch.zeros(chunk, dtype=buf.dtype)
        collectives.collective(ctx, "reducescatter", buf, reduce="sum", out=out)
        return out.numpy()

    results, borders = run_ranks(islands, body, piece_bytes=piece_bytes)
    for r, got in enumerate(results):
        np.testing.assert_array_equal(got, data[:, r, :].sum(axis=0))
    assert border_total(borders) == (len(topo.islands) - 1) * world * chunk * 8


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunk", [1, 5, 64])
@pytest.mark.parametrize("piece_bytes", [None, 24, 800])  # whole, and pipelined pieces
def test_allgather(layout, chunk, piece_bytes):
    islands = LAYOUTS[layout]
    world = len(islands)
    topo = Topology.from_islands(islands)
    data = inputs(world, chunk, seed=2)
    order = topo.island_major_order

    def body(ctx):
        buf = torch.zeros(world * chunk, dtype=torch.float64)
        slot = order.index(ctx.rank)
        buf[slot * chunk:(slot + 1) * chunk] = torch.tensor(data[ctx.rank])
        collectives.collective(ctx, "allgather", buf)
        return buf.numpy()

    results, borders = run_ranks(islands, body, piece_bytes=piece_bytes)
    for got in results:
        np.testing.assert_array_equal(got, _island_major(topo, data))
    assert border_total(borders) == (len(topo.islands) - 1) * world * chunk * 8


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("piece_bytes", [None, 24])  # whole, and pipelined pieces
def test_broadcast_every_root(layout, n, piece_bytes):
    islands = LAYOUTS[layout]
    k = len(set(islands))
    for root in range(len(islands)):
        data = inputs(len(islands), n, seed=root)

        def body(ctx):
            buf = torch.tensor(data[ctx.rank])
            collectives.collective(ctx, "broadcast", buf, root)
            return buf.numpy()

        results, borders = run_ranks(islands, body, piece_bytes=piece_bytes)
        for got in results:
            np.testing.assert_array_equal(got, data[root])
        assert border_total(borders) == (k - 1) * n * 8


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("piece_bytes", [None, 24])  # whole, and pipelined pieces
def test_reduce_every_root(layout, op, piece_bytes):
    islands = LAYOUTS[layout]
    k, n = len(set(islands)), 13
    data = inputs(len(islands), n, seed=3)
    for root in range(len(islands)):
        def body(ctx):
            buf = torch.tensor(data[ctx.rank])
            collectives.collective(ctx, "reduce", buf, root, op)
            return buf.numpy()

        results, borders = run_ranks(islands, body, piece_bytes=piece_bytes)
        np.testing.assert_array_equal(results[root], NUMPY_OPS[op](data, axis=0))
        assert border_total(borders) == (k - 1) * n * 8


@pytest.mark.parametrize("layout", LAYOUTS)
def test_send_recv_every_pair(layout):
    islands = LAYOUTS[layout]
    world = len(islands)
    pairs = [(a, b) for a in range(world) for b in range(world) if a != b]

    def body(ctx):
        got, plans_of = {}, planner.Planner(ctx.topo, rank=ctx.rank)
        for a, b in pairs:
            if ctx.rank == a:
                ctx.route = plans_of.route(b, 12, host=False)  # island peers through the island library
                collectives.send(ctx, torch.full((3,), float(a * 10 + b)), b)
            elif ctx.rank == b:
                buf = torch.zeros(3)
                ctx.route = plans_of.route(a, 12, host=False)
                collectives.recv(ctx, buf, a)
                got[a] = buf.numpy().copy()
        return got

    results, borders = run_ranks(islands, body)
    for b in range(world):
        for a, buf in results[b].items():
            np.testing.assert_array_equal(buf, np.full(3, a * 10 + b))
    cross = sum(1 for a, b in pairs if islands[a] != islands[b])
    assert border_total(borders) == cross * 3 * 4


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("piece_bytes", [8, 24, 800])
def test_allreduce_pipelined_pieces(layout, piece_bytes):
    islands = LAYOUTS[layout]
    data = inputs(len(islands), 1001, seed=9)
    results, borders = run_ranks(islands, lambda ctx: _allreduce(ctx, data[ctx.rank], "sum"),
                                 piece_bytes=piece_bytes)
    for got in results:
        np.testing.assert_array_equal(got, data.sum(axis=0))
    assert border_total(borders) == 2 * (len(set(islands)) - 1) * 1001 * 8


def test_lanes_capped():
    data = inputs(4, 10)
    results, borders = run_ranks(LAYOUTS["2x2"], lambda ctx: _allreduce(ctx, data[ctx.rank], "sum"), max_lanes=1)
    for got in results:
        np.testing.assert_array_equal(got, data.sum(axis=0))
    assert [b.bytes_sent for b in borders] == [80, 0, 80, 0]


def test_unknown_op():
    with pytest.raises(ValueError, match="supported: sum, product, min, max"):
        combine(torch.zeros(1), torch.zeros(1), "avg")


def _alltoall_counts(world: int, seed: int, zeros: bool) -> np.ndarray:
    """Uneven element counts per (source, destination); some zero when ``zeros``."""
    counts = np.random.default_rng(seed).integers(0 if zeros else 1, 9, size=(world, world))
    if zeros:
        counts[0, :] = 0  # one rank sends nothing at all
    return counts


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("piece_bytes", [None, 16, 800])
@pytest.mark.parametrize("max_lanes", [None, 1])
@pytest.mark.parametrize("pack_bytes", [0, 1 << 18])  # one message per block, or a peer's blocks packed
def test_alltoall_uneven(layout, zeros, piece_bytes, max_lanes, pack_bytes, monkeypatch):
    monkeypatch.setattr(runner, "_PACK_BYTES", pack_bytes)
    islands = LAYOUTS[layout]
    world = len(islands)
    topo = Topology.from_islands(islands, max_lanes)
    counts = _alltoall_counts(world, seed=world + zeros, zeros=zeros)
    rng = np.random.default_rng(5)
    data = {(r, t): rng.integers(-50, 50, size=counts[r, t]).astype(np.float32)
            for r in range(world) for t in range(world)}

    def body(ctx):
        inputs = [torch.tensor(data[ctx.rank, t]) for t in range(world)]
        outputs = [torch.full((int(counts[r, ctx.rank]),), float("nan")) for r in range(world)]
        how = planner.Planner(topo, rank=ctx.rank).alltoall(None, 0, host_path=False)  # no rows: every block routed
        collectives.alltoall(ctx, how, counts.tolist(), inputs, outputs)
        return [out.numpy() for out in outputs]

    results, borders = run_ranks(islands, body, piece_bytes=piece_bytes, max_lanes=max_lanes)
    for t in range(world):
        for r in range(world):
            np.testing.assert_array_equal(results[t][r], data[r, t])
    bound = sum(int(counts[r, t]) for r in range(world) for t in range(world) if islands[r] != islands[t]) * 4
    assert border_total(borders) == bound == routes.across_bytes(topo, counts.tolist(), 4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_alltoall_routes_cross_once(layout):
    topo = Topology.from_islands(LAYOUTS[layout])
    moves = routes.moves(topo)
    for r in range(topo.world_size):
        for t in range(topo.world_size):
            hops = [m for m in moves if m.block == (r, t)]
            if r == t:
                assert not hops  # a rank's own block is a local copy
                continue
            assert (hops[0].src, hops[-1].dst) == (r, t)
            assert sum(m.stage == routes.ACROSS for m in hops) == (topo.island_of(r) != topo.island_of(t))
            assert all(a.dst == b.src for a, b in zip(hops, hops[1:]))
            assert [m.stage for m in hops] == sorted(m.stage for m in hops)


def test_overlap_finds_a_shared_byte_between_views_of_one_buffer_only():
    from hetccl_ray.memory.buffers import overlap

    whole = torch.arange(10.0)
    assert overlap([whole[:5]], [whole[9:], whole[4:6]]) and not overlap([whole[:5]], [whole[5:], torch.arange(5.0)])
    assert not overlap([whole[:0]], [whole])  # an empty view holds no byte


@pytest.mark.parametrize("n", [256, (4 << 20) // 4])  # a message sent as it is, and one large enough to pull
def test_a_one_host_message_to_a_peer_routed_over_rdma_takes_the_route_at_both_ends(n):
    """On one host a receive over the TCP border takes whatever its sender chose; a peer with a
    border of its own (RDMA: the FAKE border stands in for it) is reached there by both ends,
    or the receiver would wait on a socket its sender never writes."""
    tcp = [TcpBorder(r, "127.0.0.1") for r in range(2)]
    for r, border in enumerate(tcp):
        border.set_peers({1 - r: tcp[1 - r].address}, b"secret")
    wires = {(a, b): queue.SimpleQueue() for a in range(2) for b in range(2)}
    rdma = [FakeBorder(wires, r) for r in range(2)]
    store, libraries = dist.HashStore(), [None, None]

    def form(rank: int) -> None:
        libraries[rank] = shm.ShmLibrary.create(store, rank, 2, row_width=8, timeout_s=10.0)

    threads = [threading.Thread(target=form, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    data = torch.arange(n, dtype=torch.float32)

    def body(ctx):
        ctx.direct, ctx.shared = tcp[ctx.rank], libraries[ctx.rank]
        ctx.route = planner.Planner(ctx.topo, rank=ctx.rank, routed=frozenset({1 - ctx.rank}),
                                    one_host=libraries[ctx.rank]).route(1 - ctx.rank, n * 4, host=True)
        assert ctx.route == planner.BORDER  # the RDMA route wins over the one-host socket at both ends
        ctx.deadline = time.monotonic() + 10
        if ctx.rank == 0:
            collectives.send(ctx, data, 1)
            return None
        buf = torch.zeros(n)
        collectives.recv(ctx, buf, 0)
        return buf.numpy()

    try:
        results, _ = run_ranks(["a", "b"], body, borders=[RoutedBorder(tcp[r], {1 - r: rdma[r]}) for r in range(2)])
    finally:
        for r in range(2):
            tcp[r].close()
            libraries[r].close()
    np.testing.assert_array_equal(results[1], np.arange(n, dtype=np.float32))
    assert rdma[0].bytes_sent == n * 4 and tcp[0].bytes_sent == 0
