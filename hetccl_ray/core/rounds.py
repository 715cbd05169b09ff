"""The small-message round as data: each rank's messages and landings in three phases.

Below the group's size threshold a collective costs three message hops instead of the
hierarchical plans' island and border stages: every rank sends to its island's leader (its
lowest rank), the leaders exchange once over the border, the leaders send results back.
Every message also carries the callers' call rows, so the round is the call check too.
Each op's round is a ``plans.Plan`` built once per call pattern and run by the one runner
(small_round.py gives it the rows): one piece of three border steps (``rows``) with the sends (a
span of a named buffer, or rows only) and receives (into a slot per peer), the landings
after each (copy, or fold in a fixed order so every rank computes bit-identical results),
and the landings into the op's own buffers (``finish``) once every rank agreed.

Named buffers: ``buf`` (the op's flat buffer: for allgather/reducescatter the island-major
buffer of one chunk per rank), ``out`` (reducescatter's chunk), scratch ``partial`` and
``total``, and ``up:<peer>``, ``across:<peer>``, ``down:<peer>`` for what arrives. Pure:
no torch, no Ray.

Border bytes (all ranks together; S the buffer, k islands): allgather, reducescatter,
broadcast, reduce (k-1)S; allreduce k(k-1)S (each island's partial to every other leader).

A group whose hops inside the islands are network latency rather than a message's CPU
(islands of several nodes; the ``one_hop`` option) takes the round in one hop instead (the
border's own hop is one in both): every rank sends every other rank one message,
its rows and the data that rank needs, and folds (in rank order) or places what it gets.
Every op's and the check's messages are then that pattern, so a rank that called something
else is still named on every rank; more bytes cross islands (``plans.round_bytes``).
"""

from __future__ import annotations

import functools
from typing import Optional

from hetccl_ray.core.opkinds import ROUND_OPS, kind
from hetccl_ray.core.plans import FoldIn, Land, Move, Piece, Plan, Ref, RowsStep
from hetccl_ray.core.topology import Topology


def slot(phase: str, peer: int) -> str:
    """The buffer a phase's message from ``peer`` lands in."""
    return f"{phase}:{peer}"


def build(topo: Topology, rank: int, op: str, n: int = 0, root: int = 0, one_hop: bool = False) -> Plan:
    """Rank ``rank``'s round of ``op`` over ``n`` elements (allgather/reducescatter: the whole
    island-major buffer); ``check`` moves rows only; ``one_hop``: the round in one hop. Cached
    per call pattern."""
    if op not in ROUND_OPS and op != "check":
        raise ValueError(f"no round for {op!r}; ops: {', '.join(ROUND_OPS)}, check")
    return _build(topo, rank, op, n, root if op != "check" and kind(op).rooted else 0, one_hop)


@functools.lru_cache(maxsize=512)
def _build(topo: Topology, rank: int, op: str, n: int, root: int, one_hop: bool) -> Plan:
    return getattr((_OneHop if one_hop else _Builder)(topo, rank, n, root), op)()


def _whole(name: str, n: int) -> Ref:
    return (name, 0, n)


def _phase(name: str, sends: list[tuple[int, Optional[Ref]]], recvs: list[tuple[int, int]],
           lands: tuple[Land, ...] = ()) -> RowsStep:
    """One phase's step: a send of None carries the rows only; a receive lands in its slot."""
    return RowsStep(tuple(Move(peer, (0, 0)) if ref is None else Move(peer, ref[1:], ref[0]) for peer, ref in sends),
                    tuple(Move(peer, (0, n), slot(name, peer)) for peer, n in recvs), lands)


class _Builder:
    """This rank's island, leader, members and the other leaders; each op a method."""

    def __init__(self, topo: Topology, rank: int, n: int, root: int) -> None:
        self.topo, self.rank, self.n, self.root = topo, rank, n, root
        isl = topo.island_of(rank)
        self.leader, self.members, self.me = isl.ranks[0], isl.ranks[1:], isl.index
        self.leaders = [island.ranks[0] for island in topo.islands]
        self.others = [j for j in range(len(self.leaders)) if j != self.me]
        self.home = topo.island_of(root).index
        self.chunk = n // topo.world_size
        self.slot = {r: i for i, r in enumerate(topo.island_major_order)}

    def round(self, op: str, up: Optional[Ref], up_n: dict[int, int], across: dict[int, Optional[Ref]],
              across_n: dict[int, int], down: dict[int, Optional[Ref]], down_n: int,
              lands: tuple[tuple[Land, ...], tuple[Land, ...]] = ((), ()), finish: tuple[Land, ...] = (),
              scratch: tuple[tuple[str, int], ...] = ()) -> Plan:
        """The round's messages from what a member sends up (``up``) and gets down (``down_n``),
        and what a leader gets up (``up_n`` per member), swaps (``across``/``across_n`` per
        island index) and sends down (``down`` per member)."""
        if self.rank != self.leader:
            steps = (_phase("up", [(self.leader, up)], []), _phase("across", [], []),
                     _phase("down", [], [(self.leader, down_n)]))
        else:
            steps = (_phase("up", [], [(m, up_n.get(m, 0)) for m in self.members], lands[0]),
                     _phase("across", [(self.leaders[j], across.get(j)) for j in self.others],
                            [(self.leaders[j], across_n.get(j, 0)) for j in self.others], lands[1]),
                     _phase("down", [(m, down.get(m)) for m in self.members], []))
        return Plan(op, self.rank, self.n, (Piece(across=steps),), finish=finish, scratch=scratch)

    def _ordered(self, own: Ref) -> tuple[Ref, ...]:
        """The islands' partials in island order, this island's being ``own``."""
        return tuple(own if j == self.me else (slot("across", self.leaders[j]), 0, own[2])
                     for j in range(len(self.leaders)))

    def _island_partial(self, n: int) -> Land:
        """The leader's own buffer folded with its members' (local rank order) into ``partial``."""
        return FoldIn(_whole("partial", n), (_whole("buf", n), *(_whole(slot("up", m), n) for m in self.members)))

    def _result(self, into: Ref, held: Ref) -> Land:
        """Into ``into``: the leader's ``held``, or (a member) what came down."""
        return Land(into, (held if self.rank == self.leader else (slot("down", self.leader), 0, into[2]),))

    def check(self) -> Plan:
        return self.round("check", None, {}, {}, {}, {}, 0)

    def allreduce(self) -> Plan:
        """Members send up, leaders swap island partials, leaders send the total down."""
        n = self.n
        total = _whole("total", n)
        others = dict.fromkeys(self.others, _whole("partial", n))
        return self.round("allreduce", _whole("buf", n), dict.fromkeys(self.members, n), others,
                          dict.fromkeys(self.others, n), dict.fromkeys(self.members, total), n,
                          ((self._island_partial(n),), (FoldIn(total, self._ordered(_whole("partial", n))),)),
                          (self._result(_whole("buf", n), total),), (("partial", n), ("total", n)))

    def reduce(self) -> Plan:
        """Like allreduce, but partials go only to the root island's leader, the total to root."""
        n = self.n
        home = self.me == self.home
        total = _whole("total", n)
        finish = (self._result(_whole("buf", n), total),) if self.rank == self.root else ()
        return self.round("reduce", _whole("buf", n), dict.fromkeys(self.members, n),
                          {} if home else {self.home: _whole("partial", n)},
                          dict.fromkeys(self.others, n) if home else {},
                          {self.root: total} if self.root in self.members else {}, n if self.rank == self.root else 0,
                          ((self._island_partial(n),),
                           (FoldIn(total, self._ordered(_whole("partial", n))),) if home else ()),
                          finish, (("partial", n), ("total", n)))

    def broadcast(self) -> Plan:
        """Root to its leader, that leader to the others, each leader to its members."""
        n = self.n
        home = self.me == self.home
        held = _whole("total", n)
        first = (Land(held, (_whole(slot("up", self.root), n) if self.root in self.members else _whole("buf", n),)),)
        came = Land(held, (_whole(slot("across", self.leaders[self.home]), n),))
        finish = (self._result(_whole("buf", n), held),) if self.rank != self.root else ()
        return self.round("broadcast", _whole("buf", n) if self.rank == self.root else None,
                          {self.root: n} if self.root in self.members else {},
                          dict.fromkeys(self.others, held) if home else {}, {} if home else {self.home: n},
                          dict.fromkeys(self.members, held), n,
                          (first, ()) if home else ((), (came,)), finish, (("total", n),))

    def allgather(self) -> Plan:
        """Chunks up, island regions across, the whole buffer down (``buf``: own chunk filled)."""
        n, c = self.n, self.chunk
        regions = self.topo.regions(c)
        total = _whole("total", n)
        mine = ("buf", self.slot[self.rank] * c, c)
        gathered = (Land(total, (_whole("buf", n),)),
                    *(Land(("total", self.slot[m] * c, c), (_whole(slot("up", m), c),)) for m in self.members))
        placed = tuple(Land(("total", *regions[j]), (_whole(slot("across", self.leaders[j]), regions[j][1]),))
                       for j in self.others)
        return self.round("allgather", mine, dict.fromkeys(self.members, c),
                          dict.fromkeys(self.others, ("total", *regions[self.me])),
                          {j: regions[j][1] for j in self.others}, dict.fromkeys(self.members, total), n,
                          (gathered, placed), (self._result(_whole("buf", n), total),), (("total", n),))

    def reducescatter(self) -> Plan:
        """Whole buffers up, each island's region of the partials to that island's leader, each
        member's chunk down into ``out``."""
        n, c = self.n, self.chunk
        regions = self.topo.regions(c)
        own = regions[self.me][1]
        down = {m: ("total", (self.slot[m] - self.slot[self.rank]) * c, c) for m in self.members}
        return self.round("reducescatter", _whole("buf", n), dict.fromkeys(self.members, n),
                          {j: ("partial", *regions[j]) for j in self.others}, dict.fromkeys(self.others, own),
                          down, c,
                          ((self._island_partial(n),),
                           (FoldIn(_whole("total", own), self._ordered(("partial", *regions[self.me]))),)),
                          (self._result(_whole("out", c), ("total", 0, c)),), (("partial", n), ("total", own)))


class _OneHop:
    """The round in one hop: to every other rank one message (rows only where it needs no data)."""

    def __init__(self, topo: Topology, rank: int, n: int, root: int) -> None:
        self.rank, self.n, self.root, self.world = rank, n, root, topo.world_size
        self.peers = [p for p in range(self.world) if p != rank]
        self.chunk = n // self.world
        self.slot = {r: i for i, r in enumerate(topo.island_major_order)}

    def round(self, op: str, sends: dict[int, Ref], recv_n: dict[int, int], lands: tuple[Land, ...] = (),
              finish: tuple[Land, ...] = (), scratch: tuple[tuple[str, int], ...] = ()) -> Plan:
        step = _phase("one", [(p, sends.get(p)) for p in self.peers], [(p, recv_n.get(p, 0)) for p in self.peers],
                      lands)
        return Plan(op, self.rank, self.n, (Piece(across=(step,)),), finish=finish, scratch=scratch)

    def _folded(self, own: Ref, n: int) -> Land:
        """Every rank's ``n`` elements (this rank's ``own``) folded in rank order into ``total``."""
        return FoldIn(_whole("total", n), tuple(own if r == self.rank else _whole(slot("one", r), n)
                                                for r in range(self.world)))

    def check(self) -> Plan:
        return self.round("check", {}, {})

    def broadcast(self) -> Plan:
        n = self.n
        if self.rank == self.root:
            return self.round("broadcast", dict.fromkeys(self.peers, _whole("buf", n)), {})
        return self.round("broadcast", {}, {self.root: n}, finish=(Land(_whole("buf", n),
                                                                        (_whole(slot("one", self.root), n),)),))

    def allreduce(self) -> Plan:
        n = self.n
        return self.round("allreduce", dict.fromkeys(self.peers, _whole("buf", n)), dict.fromkeys(self.peers, n),
                          (self._folded(_whole("buf", n), n),), (Land(_whole("buf", n), (_whole("total", n),)),),
                          (("total", n),))

    def reduce(self) -> Plan:
        n = self.n
        if self.rank != self.root:
            return self.round("reduce", {self.root: _whole("buf", n)}, {})
        return self.round("reduce", {}, dict.fromkeys(self.peers, n), (self._folded(_whole("buf", n), n),),
                          (Land(_whole("buf", n), (_whole("total", n),)),), (("total", n),))

    def allgather(self) -> Plan:
        """``buf``: island-major, this rank's chunk filled; every chunk to every rank."""
        n, c = self.n, self.chunk
        placed = (Land(_whole("total", n), (_whole("buf", n),)),
                  *(Land(("total", self.slot[p] * c, c), (_whole(slot("one", p), c),)) for p in self.peers))
        return self.round("allgather", dict.fromkeys(self.peers, ("buf", self.slot[self.rank] * c, c)),
                          dict.fromkeys(self.peers, c), placed, (Land(_whole("buf", n), (_whole("total", n),)),),
                          (("total", n),))

    def reducescatter(self) -> Plan:
        """``buf``: island-major, one chunk per rank; each rank's chunk to it, folded into ``out``."""
        c = self.chunk
        return self.round("reducescatter", {p: ("buf", self.slot[p] * c, c) for p in self.peers},
                          dict.fromkeys(self.peers, c), (self._folded(("buf", self.slot[self.rank] * c, c), c),),
                          (Land(_whole("out", c), (_whole("total", c),)),), (("total", c),))
