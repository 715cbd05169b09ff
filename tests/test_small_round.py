"""The small-message round (small_round.py) alone: ranks are threads of this process, the border is
the real TCP border over loopback sockets (the island is not used by the round). Every op
against numpy, on every layout, in three hops and in one; mismatched calls named on every
rank with no buffer touched; the counters against the bytes the round promises."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from hetccl_ray.core import plans
from hetccl_ray.runtime import small_round
from hetccl_ray.core.calls import Call
from hetccl_ray.errors import HetCCLTimeoutError
from hetccl_ray.core.topology import Topology
from hetccl_ray.transport.tcp import TcpBorder
from tests.fakes import loopback_borders, run_ranks

LAYOUTS = {"2+2": ["a", "a", "b", "b"], "1+2+3 interleaved": ["a", "b", "a", "c", "b", "a"],
           "one island": ["a", "a", "a"], "1+1": ["a", "b"]}
SEQ = iter(range(1, 1 << 30))


@pytest.fixture(scope="module", params=[(name, one_hop) for name in LAYOUTS for one_hop in (False, True)],
                ids=lambda p: f"{p[0]}{', one hop' if p[1] else ''}")
def layout(request):
    """A layout, one real TCP border per rank, all connected, and whether rounds go in one hop."""
    name, one_hop = request.param
    islands = LAYOUTS[name]
    topo = Topology.from_islands(islands)
    borders = loopback_borders(topo)
    yield islands, topo, borders, one_hop
    for border in borders:
        border.close()


def _promised(layout, op: str, nbytes: int, root: int = 0) -> int:
    """The border bytes the round promises (nbytes: the whole buffer)."""
    _, topo, _, one_hop = layout
    return plans.round_bytes(topo, op, nbytes, root, one_hop)


def _run(layout, body):
    islands, topo, borders, one_hop = layout
    seq = next(SEQ)
    before = [b.bytes_sent for b in borders]

    def each(ctx):
        ctx.direct, ctx.one_hop = ctx.border, one_hop
        return body(ctx, seq)

    results, _ = run_ranks(islands, each, borders=borders)
    return results, sum(b.bytes_sent for b in borders) - sum(before), topo


def _inputs(world, n, dtype):
    rng = np.random.default_rng(n + world)
    return [rng.integers(1, 4, n).astype(np.float64) for _ in range(world)], dtype


@pytest.mark.parametrize("n", [0, 1, 1031])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_allreduce(layout, n, dtype, op):
    world = len(layout[0])
    inputs, _ = _inputs(world, n, dtype)

    def body(ctx, seq):
        x = torch.tensor(inputs[ctx.rank], dtype=dtype)
        problem = small_round.small(ctx, Call("allreduce", dtype, n, reduce=op, seq=seq), x)
        return problem, x.to(torch.float64).numpy()

    results, sent, topo = _run(layout, body)
    expect = np.sum(inputs, axis=0) if op == "sum" else np.max(inputs, axis=0)
    for problem, got in results:
        assert problem is None
        np.testing.assert_array_equal(got, expect)
    assert sent == _promised(layout, "allreduce", n * torch.tensor([], dtype=dtype).element_size())


@pytest.mark.parametrize("n", [0, 5, 1031])
def test_broadcast_and_reduce_from_every_root(layout, n):
    world = len(layout[0])
    inputs, _ = _inputs(world, n, torch.float64)
    for root in range(world):
        def body(ctx, seq):
            b = torch.tensor(inputs[ctx.rank])
            r = torch.tensor(inputs[ctx.rank])
            p1 = small_round.small(ctx, Call("broadcast", torch.float64, n, root=root, seq=seq), b)
            p2 = small_round.small(ctx, Call("reduce", torch.float64, n, root=root, reduce="sum", seq=seq + 10 ** 6), r)
            return p1, p2, b.numpy(), r.numpy()

        results, sent, topo = _run(layout, body)
        for rank, (p1, p2, b, r) in enumerate(results):
            assert p1 is None and p2 is None
            np.testing.assert_array_equal(b, inputs[root])
            np.testing.assert_array_equal(r, np.sum(inputs, axis=0) if rank == root else inputs[rank])
        assert sent == _promised(layout, "broadcast", n * 8, root) + _promised(layout, "reduce", n * 8, root)


@pytest.mark.parametrize("n", [0, 3, 257])
def test_allgather_and_reducescatter(layout, n):
    world = len(layout[0])
    rng = np.random.default_rng(n)
    chunks = [rng.integers(0, 9, (world, n)).astype(np.float32) for _ in range(world)]  # rank r's inputs

    def body(ctx, seq):
        order = ctx.topo.island_major_order
        gathered = torch.zeros(world * n)
        slot = order.index(ctx.rank)
        gathered[slot * n:(slot + 1) * n] = torch.tensor(chunks[ctx.rank][0])
        p1 = small_round.small(ctx, Call("allgather", torch.float32, n, seq=seq), gathered)
        scatter_in = torch.cat([torch.tensor(chunks[ctx.rank][rank]) for rank in order])
        out = torch.zeros(n)
        p2 = small_round.small(ctx, Call("reducescatter", torch.float32, n, reduce="sum", seq=seq + 10 ** 6),
                        scatter_in, out)
        by_rank = gathered.view(world, n)[[order.index(r) for r in range(world)]] if n else gathered.view(world, 0)
        return p1, p2, by_rank.numpy(), out.numpy()

    results, sent, topo = _run(layout, body)
    for rank, (p1, p2, gathered, out) in enumerate(results):
        assert p1 is None and p2 is None
        np.testing.assert_array_equal(gathered, np.stack([chunks[r][0] for r in range(world)]))
        np.testing.assert_array_equal(out, np.sum([chunks[r][rank] for r in range(world)], axis=0))
    assert sent == _promised(layout, "allgather", world * n * 4) + _promised(layout, "reducescatter", world * n * 4)


def test_a_mismatch_is_named_on_every_rank_and_touches_no_buffer(layout):
    world = len(layout[0])
    odd = world - 1

    def body(ctx, seq):
        n = 12 if ctx.rank == odd else 10  # the odd rank calls with another count
        x = torch.full((n,), float(ctx.rank))
        problem = small_round.small(ctx, Call("allreduce", torch.float32, n, reduce="sum", seq=seq), x)
        untouched = bool((x == ctx.rank).all())
        y = torch.ones(4)  # the next call on the same sockets still works
        after = small_round.small(ctx, Call("allreduce", torch.float32, 4, reduce="sum", seq=seq + 10 ** 6), y)
        return problem, untouched, after, y.tolist()

    results, _, _ = _run(layout, body)
    for problem, untouched, after, y in results:
        assert problem is not None and f"ranks [{odd}] called allreduce" in problem and "12 elements" in problem
        assert untouched and after is None and y == [float(world)] * 4


def test_check_is_a_barrier_that_names_other_ops(layout):
    world = len(layout[0])

    def body(ctx, seq):
        call = Call("barrier" if ctx.rank else "broadcast", torch.uint8, 0, root=-1 if ctx.rank else 0, seq=seq)
        return small_round.check(ctx, call)

    results, sent, _ = _run(layout, body)
    if world > 1:
        assert all(p is not None and "ranks [0] called broadcast" in p for p in results)
    assert sent == 0


def test_a_missing_rank_times_out_naming_whom_it_waited_for():
    islands = ["a", "b"]
    topo = Topology.from_islands(islands)
    borders = [TcpBorder(r, "127.0.0.1") for r in range(2)]
    borders[0].set_peers({1: borders[1].address}, bytes(32))
    borders[1].set_peers({0: borders[0].address}, bytes(32))
    try:
        def body(ctx):
            ctx.direct, ctx.deadline = ctx.border, ctx.deadline - 59  # a 1 s deadline
            if ctx.rank == 1:
                return None
            try:
                small_round.check(ctx, Call("barrier", torch.uint8, 0, seq=1))
            except HetCCLTimeoutError as exc:
                return exc.waiting_for
        results, _ = run_ranks(islands, body, borders=borders)
        assert results[0] == 1 and topo.world_size == 2
    finally:
        for border in borders:
            border.close()
