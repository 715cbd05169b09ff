"""Where each block of an all-to-all travels, as data: lanes, stages and staging offsets.

Block ``(r, t)`` is what rank r sends rank t. Inside one island it goes straight. To
another island it goes ``r -> o_A -> o_B -> t``, where ``o_X`` is island X's border rank of
lane ``local(t) % lanes``: stage 1 gathers blocks inside the source island by destination
island and lane, stage 2 crosses the border once per (source island, destination island,
lane), stage 3 scatters inside the destination island. A hop from a rank to itself is
dropped, so a destination that owns its lane gets stage 2 straight into its output.
Every cross-island byte crosses exactly once: the bound. ``plan`` makes a rank's moves a
``plans.Plan`` of the one runner: each block cut into pieces, stage 2 the border steps.
Pure: no Ray, no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from hetccl_ray.core import plans
from hetccl_ray.core.topology import Topology

Block = tuple[int, int]
GATHER, ACROSS, SCATTER = 1, 2, 3  # stages; moves inside one island go in stage GATHER


@dataclass(frozen=True, order=True)
class Move:
    """One hop of one block in one stage. Sorted, moves are the order both ends post them."""

    stage: int
    src: int
    dst: int
    block: Block


@functools.cache
def moves(topo: Topology) -> tuple[Move, ...]:
    """Every hop of every block between distinct ranks, in posting order."""
    out = []
    for r in range(topo.world_size):
        home = topo.island_of(r)
        for t in range(topo.world_size):
            there = topo.island_of(t)
            if r == t:
                continue
            if there == home:
                out.append(Move(GATHER, r, t, (r, t)))
                continue
            lane = topo.local_rank(t) % topo.lanes
            out_owner, in_owner = home.ranks[lane], there.ranks[lane]
            if r != out_owner:
                out.append(Move(GATHER, r, out_owner, (r, t)))
            out.append(Move(ACROSS, out_owner, in_owner, (r, t)))
            if in_owner != t:
                out.append(Move(SCATTER, in_owner, t, (r, t)))
    return tuple(sorted(out))


@dataclass(frozen=True)
class RankRoute:
    """One rank's part of the moves: what it sends and receives in each stage."""

    sends: dict[int, tuple[Move, ...]]
    recvs: dict[int, tuple[Move, ...]]

    def transit(self) -> list[Block]:
        """Blocks this rank receives although they are not its own: held in staging."""
        return sorted({m.block for stage in self.recvs.values() for m in stage if m.block[1] != m.dst})


@functools.cache
def route(topo: Topology, rank: int) -> RankRoute:
    """The moves of ``rank``, by stage."""
    all_moves = moves(topo)
    pick = {stage: [m for m in all_moves if m.stage == stage] for stage in (GATHER, ACROSS, SCATTER)}
    return RankRoute({s: tuple(m for m in ms if m.src == rank) for s, ms in pick.items()},
                     {s: tuple(m for m in ms if m.dst == rank) for s, ms in pick.items()})


def staging(blocks: Sequence[Block], counts: Sequence[Sequence[int]]) -> tuple[dict[Block, int], int]:
    """Offsets of transit blocks in one staging buffer, and its length (elements)."""
    offsets, total = {}, 0
    for r, t in blocks:
        offsets[r, t] = total
        total += counts[r][t]
    return offsets, total


Counts = tuple[tuple[int, ...], ...]  # counts[r][t]: elements rank r sends rank t


@functools.lru_cache(maxsize=256)
def plan(topo: Topology, rank: int, counts: Counts, pieces: int, by_island: bool) -> plans.Plan:
    """Rank ``rank``'s all-to-all along the routes, every block in ``pieces`` pieces. Named
    buffers: ``in:<t>`` (the block for rank t), ``out:<r>`` (the block from rank r), scratch
    ``staged`` (blocks in transit). Stages 1 and 3 move blocks between island ranks: as one
    vendor all-to-all each where ``by_island`` (device buffers), else over the border."""
    way = route(topo, rank)
    offsets, total = staging(way.transit(), counts)

    def holder(block: Block) -> tuple[str, int]:
        r, t = block
        if r == rank:
            return f"in:{t}", 0
        return (f"out:{r}", 0) if t == rank else ("staged", offsets[block])

    def step(stage: int, q: int) -> plans.BorderStep:
        def moved(hops: Sequence[Move], sending: bool) -> tuple[plans.Move, ...]:
            out = []
            for m in hops:
                (name, base), (r, t) = holder(m.block), m.block
                offset, length = plans.piece_of((0, counts[r][t]), q, pieces)
                out.append(plans.Move(m.dst if sending else m.src, (base + offset, length), name))
            return tuple(out)
        kind = plans.IslandMoves if by_island and stage != ACROSS else plans.BorderStep
        return kind(moved(way.sends[stage], True), moved(way.recvs[stage], False))

    steps = [plans.Piece((step(GATHER, q),), (step(ACROSS, q),), (step(SCATTER, q),)) for q in range(pieces)]
    return plans.Plan("alltoall", rank, sum(counts[rank]), tuple(steps), scratch=(("staged", total),))


def across_bytes(topo: Topology, counts: Sequence[Sequence[int]], itemsize: int) -> int:
    """The bound: bytes that must cross island boundaries, all ranks together."""
    return itemsize * sum(counts[r][t] for r in range(topo.world_size) for t in range(topo.world_size)
                          if topo.island_of(r) != topo.island_of(t))


def largest_crossing(topo: Topology, counts: Sequence[Sequence[int]]) -> int:
    """Elements of the largest stage-2 exchange between two border ranks (pieces are cut from it)."""
    per_pair: dict[tuple[int, int], int] = {}
    for m in moves(topo):
        if m.stage == ACROSS:
            per_pair[m.src, m.dst] = per_pair.get((m.src, m.dst), 0) + counts[m.block[0]][m.block[1]]
    return max(per_pair.values(), default=0)


def mismatched(counts: Sequence[Sequence[int]], expected: Sequence[Sequence[int]], limit: int = 4) -> str | None:
    """None when every rank expects from each peer what that peer sends it; else the pairs
    that disagree. ``counts[r][t]``: what r sends t; ``expected[t][r]``: what t expects from r."""
    world = len(counts)
    bad = [(r, t) for r in range(world) for t in range(world) if counts[r][t] != expected[t][r]]
    if not bad:
        return None
    text = "; ".join(f"rank {r} sends {counts[r][t]} elements to rank {t}, which expects {expected[t][r]}"
                     for r, t in bad[:limit])
    return text + (f"; and {len(bad) - limit} more pairs" if len(bad) > limit else "")
