"""Plans as data alone (no torch work, no Ray): every plan's border bytes equal the bound,
and the steps of every rank pair up (what one rank sends a peer, that peer receives)."""

import pytest

from hetccl_ray.core import opkinds, rounds, routes, plans
from hetccl_ray.core.opkinds import ROUND_OPS
from hetccl_ray.core.topology import Topology

OPS = ("allreduce", "reducescatter", "allgather", "broadcast", "reduce")  # written out: the table is under test
ROOTED = ("broadcast", "reduce")

LAYOUTS = {
    "2x2": ["a", "a", "b", "b"],
    "1+2+3 interleaved": ["x", "y", "x", "z", "y", "x"],
    "2+3": ["a", "b", "a", "b", "b"],
    "3x1": ["a", "b", "c"],
    "one island": ["a", "a", "a"],
}


def _count(topo: Topology, op: str, chunk: int) -> int:
    return chunk * (topo.world_size if op in ("allgather", "reducescatter") else 1)


def _bound(topo: Topology, op: str, nbytes: int) -> int:
    """The design's bound, written out: 2(k-1)S for allreduce, (k-1)S for the others."""
    return (2 if op == "allreduce" else 1) * (len(topo.islands) - 1) * nbytes


def test_the_op_kind_table():
    """Its rows against the values written out: shapes, bus factors, bounds, sizes, pieces."""
    assert ROUND_OPS == OPS
    assert [op for op, k in opkinds.OP_KINDS.items() if k.rooted] == ["broadcast", "reduce", "gather", "scatter"]
    assert [op for op, k in opkinds.OP_KINDS.items() if k.chunked] == ["reducescatter", "allgather", "alltoall"]
    assert [op for op, k in opkinds.OP_KINDS.items() if k.reduces] == ["allreduce", "reducescatter", "reduce"]
    assert [opkinds.kind(op).bus(4) for op in OPS] == [1.5, 0.75, 0.75, 1.0, 1.0]
    topo = Topology.from_islands(LAYOUTS["1+2+3 interleaved"])
    for op in OPS:
        assert opkinds.kind(op).bound(topo, 600) == _bound(topo, op, 600)
    # all-to-all: S/n per ordered pair across islands; 1+2+3 has 36 - (1 + 4 + 9) = 22 pairs
    assert opkinds.kind("alltoall").bound(topo, 600) == 100 * 22
    assert opkinds.kind("allgather").whole_bytes(8, 6) == 48 and opkinds.kind("allreduce").whole_bytes(8, 6) == 8
    assert [opkinds.pieces(b, 4) for b in (0, 1, 4, 5, 9)] == [1, 1, 1, 2, 3] and opkinds.pieces(9, None) == 1
    assert opkinds.largest_region(topo, "allgather", 60) == 30 and opkinds.largest_region(topo, "allreduce", 60) == 60
    with pytest.raises(ValueError, match="no border bound"):
        opkinds.kind("send").bound(topo, 8)
    with pytest.raises(ValueError, match="unknown op 'allsum'"):
        opkinds.kind("allsum")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("pieces", [1, 3])
@pytest.mark.parametrize("max_lanes", [None, 1])
def test_border_bytes_equal_the_bound(layout, op, chunk, pieces, max_lanes):
    topo = Topology.from_islands(LAYOUTS[layout], max_lanes)
    n = _count(topo, op, chunk)
    for root in (range(topo.world_size) if op in ROOTED else [0]):
        sent = plans.border_bytes(topo, op, n, 4, root, pieces)
        assert sent == _bound(topo, op, n * 4), (op, root)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
def test_moves_pair_up(layout, op):
    """Per piece and border step, rank a's sends to b are b's receives from a, span lengths alike."""
    topo = Topology.from_islands(LAYOUTS[layout])
    n = _count(topo, op, 10)
    built = [plans.build(topo, r, op, n, topo.world_size - 1, pieces=2) for r in range(topo.world_size)]
    assert len({len(p.pieces) for p in built}) == 1
    for q in range(len(built[0].pieces)):
        sent, received = {}, {}
        for p in built:
            for s, step in enumerate(p.pieces[q].across):
                for m in step.sends:
                    sent.setdefault((p.rank, m.peer), []).append(m.span[1])
                for m in step.recvs:
                    received.setdefault((m.peer, p.rank), []).append(m.span[1])
        assert sent == received


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pieces", [1, 3])
@pytest.mark.parametrize("by_island", [False, True])
def test_alltoall_plan_bytes_and_pairs(layout, pieces, by_island):
    """The all-to-all's plans (routes.plan): border bytes equal the bound; per piece and stage
    every rank's sends to a peer are that peer's receives; every block is moved whole."""
    topo = Topology.from_islands(LAYOUTS[layout])
    world = topo.world_size
    counts = tuple(tuple((3 * r + 5 * t) % 7 for t in range(world)) for r in range(world))
    built = [routes.plan(topo, r, counts, pieces, by_island) for r in range(world)]
    assert sum(sum(p.sent(topo).values()) for p in built) * 4 == routes.across_bytes(topo, counts, 4)
    for q in range(pieces):
        for stage in ("before", "across", "after"):
            steps = [(p.rank, getattr(p.pieces[q], stage)[0]) for p in built]
            assert all(isinstance(step, plans.IslandMoves) == (by_island and stage != "across") for _, step in steps)
            sent = sorted((r, m.peer, m.span[1]) for r, step in steps for m in step.sends)
            assert sent == sorted((m.peer, r, m.span[1]) for r, step in steps for m in step.recvs)
    for r, p in enumerate(built):
        into: dict[str, int] = {}
        for piece in p.pieces:
            for step in (*piece.before, *piece.across, *piece.after):
                for m in step.recvs:
                    into[m.buf] = into.get(m.buf, 0) + m.span[1]
        assert all(into.get(f"out:{s}", 0) == counts[s][r] for s in range(world) if s != r), r


def test_cached_and_printable():
    topo = Topology.from_islands(LAYOUTS["2x2"])
    plan = plans.build(topo, 0, "allreduce", 1 << 20, pieces=4)
    assert plan is plans.build(topo, 0, "allreduce", 1 << 20, pieces=4)
    text = "\n".join(plan.describe())
    assert "island reduce_scatter [0:262144] counts=[131072, 131072]" in text
    assert "border send [[65536:131072]->r2] recv fold [r2->[0:65536]]" in text
    assert plan.sent(topo) == {2: (1 << 20) // 2}  # its lane segment, in each of 4 pieces: half out, half back


def test_unknown_op():
    with pytest.raises(ValueError, match="no plan for 'scan'"):
        plans.build(Topology.from_islands(["a"]), 0, "scan", 4)


def test_explain_prints_the_bound_without_a_cluster(capsys):
    from hetccl_ray.tools.show_plan import main

    main(["--layout", "1,2,3", "--interleave", "--op", "reducescatter", "--size", "96", "--steps"])
    out = capsys.readouterr().out
    assert "3 island(s)" in out and "border bytes 192 = bound 192" in out
    assert "small round (3 hops, call rows inside): border bytes 192" in out
    assert out.count("rank 5: reducescatter plan of") == out.count("rank 5: reducescatter small round of") == 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_hop_broadcast_sends_the_bound_and_reaches_every_rank_once(layout):
    """Per root: border bytes (k-1)S, every rank but the root receives exactly once, a rank
    that passes the buffer on receives it in an earlier step than it sends, and every send has
    its receive."""
    topo = Topology.from_islands(LAYOUTS[layout])
    world = topo.world_size
    for root in range(world):
        built = [plans.two_hop_broadcast(topo, r, 5, root) for r in range(world)]
        assert sum(sum(p.sent(topo).values()) for p in built) == _bound(topo, "broadcast", 5)
        sends = [(p.rank, m.peer, s) for p in built for s, step in enumerate(p.pieces[0].across) for m in step.sends]
        recvs = [(m.peer, p.rank, s) for p in built for s, step in enumerate(p.pieces[0].across) for m in step.recvs]
        assert sorted(src_dst[:2] for src_dst in sends) == sorted(src_dst[:2] for src_dst in recvs)
        assert sorted(dst for _, dst, _ in recvs) == [r for r in range(world) if r != root]
        got = {dst: s for _, dst, s in recvs}
        assert all(src == root or got[src] < s for src, _, s in sends), (root, sends, recvs)


def test_explain_an_alltoall(capsys):
    from hetccl_ray.tools.show_plan import main

    main(["--layout", "2x2", "--op", "alltoall", "--size", "96", "--steps"])
    out = capsys.readouterr().out
    assert "routes plan: 1 piece(s); border bytes 192 = bound 192" in out and "small round" not in out
    assert "rank 3: alltoall plan of 24 elements" in out and "island alltoall send" in out


# -- the small round as data (rounds.py) -----------------------------------------------------------

def _rounds(topo: Topology, op: str, n: int, root: int, one_hop: bool = False) -> list:
    return [rounds.build(topo, r, op, n, root, one_hop) for r in range(topo.world_size)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("chunk", [0, 1, 7])
@pytest.mark.parametrize("one_hop", [False, True])
def test_round_bytes_and_messages(layout, op, chunk, one_hop):
    """Border bytes equal what the round promises; in each phase rank a's message to b is one b
    receives from a, of the same length; every op has the rows-only round's messages (a rank
    that called another op still meets its peers); every span lies inside its buffer."""
    topo = Topology.from_islands(LAYOUTS[layout])
    n = _count(topo, op, chunk)
    check = _rounds(topo, "check", 0, 0, one_hop)
    for root in (range(topo.world_size) if op in ROOTED else [0]):
        built = _rounds(topo, op, n, root, one_hop)
        promised = plans.round_bytes(topo, op, n * 4, root, one_hop)
        assert sum(sum(r.sent(topo).values()) for r in built) * 4 == promised, (op, root)
        for phase in range(1 if one_hop else 3):
            steps = [(r.rank, r.pieces[0].across[phase]) for r in built]
            assert all(isinstance(step, plans.RowsStep) for _, step in steps)
            sent = {(rank, m.peer): m.span[1] for rank, step in steps for m in step.sends}
            received = {(m.peer, rank): m.span[1] for rank, step in steps for m in step.recvs}
            assert sent == received, (op, root, phase)
            assert {(r.rank, m.peer) for r in check for m in r.pieces[0].across[phase].sends} == set(sent)
        for r in built:
            sizes = {"buf": n, "out": n // topo.world_size, **dict(r.scratch)}
            sizes.update({m.buf: m.span[1] for step in r.pieces[0].across for m in step.recvs})
            refs = [(m.buf, *m.span) for step in r.pieces[0].across for m in step.sends]
            refs += [ref for step in r.pieces[0].across for land in step.lands for ref in (land.out, *land.parts)]
            refs += [ref for land in r.finish for ref in (land.out, *land.parts)]
            assert all(0 <= offset and offset + length <= sizes[name] for name, offset, length in refs), r


def test_round_cached_and_printable():
    topo = Topology.from_islands(LAYOUTS["2x2"])
    built = rounds.build(topo, 2, "allreduce", 8)
    assert built is rounds.build(topo, 2, "allreduce", 8)
    assert "\n".join(built.describe()) == (
        "rank 2: allreduce small round of 8 elements, 1 piece(s)\n"
        "  piece 0 across: border rows send [] recv [r3->up:3[0:8]]\n"
        "  piece 0 across: border rows send [partial[0:8]->r0] recv [r0->across:0[0:8]]\n"
        "  piece 0 across: border rows send [total[0:8]->r3] recv []")
    with pytest.raises(ValueError, match="no round for 'gather'"):
        rounds.build(topo, 0, "gather")
