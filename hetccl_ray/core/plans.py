"""Plans as data: each rank's steps of one collective, built once per call pattern.

A plan is a list of pieces; a piece is island steps (the vendor collective over a span of
the op's flat buffer), border steps (moves of spans to and from peers, landing as a copy
or folded into the span with the reduce op), then island steps again. One runner
(``runner.execute``) runs every plan, overlapping piece q's border steps with the island
steps of pieces q+1 and q-1 (after FlagCX's cluster-to-cluster planner: pre-homo, hetero,
post-homo steps, built once and cached per call pattern). The small round (rounds.py) is a
plan of one piece of three border steps (one, in one hop) whose messages carry the call rows
(``rows``), over named scratch buffers, with landings after each step and a ``finish`` made
once the rows agree.

Builders are pure (no torch, no Ray): ``build(topo, rank, op, n, root, pieces)`` for every
rank, so a plan can be printed and its border bytes checked without a cluster
(``python -m hetccl_ray.tools.show_plan``). Per-rank chunks (allgather, reducescatter) are laid out
island by island (``Topology.regions``).

Border bytes, all ranks together, S the buffer (nccl-tests' size), k islands:
allreduce 2(k-1)S; reducescatter, allgather, broadcast, reduce (k-1)S (``opkinds``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Protocol, Union

from hetccl_ray.core.opkinds import ROUND_OPS, kind
from hetccl_ray.core.topology import Topology, split

Span = tuple[int, int]  # (offset, length) in elements of a buffer: the op's ``buf`` unless named
Ref = tuple[str, int, int]  # (buffer name, offset, length): a span of a named buffer
BUF = "buf"


class Runs(Protocol):
    """What steps run on (the runner's): one method per step kind."""

    def island(self, step: "IslandStep") -> None: ...
    def exchange(self, step: "BorderStep") -> None: ...
    def fold(self, step: "FoldStep") -> None: ...
    def rows(self, step: "RowsStep") -> None: ...
    def island_moves(self, step: "IslandMoves") -> None: ...
    def land(self, land: "Land") -> None: ...
    def fold_in(self, land: "FoldIn") -> None: ...


@dataclass(frozen=True)
class IslandStep:
    """The island library's ``op`` over ``span``: ``counts`` are the island ranks' ranges of it
    (reduce_scatter, allgather, gather), ``root`` an island-local rank (broadcast, gather, reduce)."""

    op: str
    span: Span
    counts: tuple[int, ...] = ()
    root: int = 0

    def run(self, runs: Runs) -> None:
        runs.island(self)

    def describe(self) -> str:
        extra = f" counts={list(self.counts)}" if self.counts else ""
        extra += f" root={self.root}" if self.op in ("broadcast", "gather", "reduce") else ""
        return f"island {self.op} {_span(self.span)}{extra}"


@dataclass(frozen=True)
class Move:
    """A span of buffer ``buf`` sent to or received from ``peer``."""

    peer: int
    span: Span
    buf: str = BUF

    def describe(self) -> str:
        return f"{'' if self.buf == BUF else self.buf}{_span(self.span)}"


@dataclass(frozen=True)
class Land:
    """``out`` = a copy of ``parts[0]``."""

    out: Ref
    parts: tuple[Ref, ...]

    def run(self, runs: Runs) -> None:
        runs.land(self)


class FoldIn(Land):
    """``out`` = ``parts`` folded with the reduce op in the order given."""

    def run(self, runs: Runs) -> None:
        runs.fold_in(self)


@dataclass(frozen=True)
class BorderStep:
    """Post every receive and send, then wait for all, then ``lands``; received spans land as
    copies (a peer's several small ones packed in one message each way)."""

    sends: tuple[Move, ...]
    recvs: tuple[Move, ...]
    lands: tuple[Land, ...] = ()
    label, receiving = "border", ""

    def run(self, runs: Runs) -> None:
        runs.exchange(self)

    def describe(self) -> str:
        out = ", ".join(f"{m.describe()}->r{m.peer}" for m in self.sends)
        into = ", ".join(f"r{m.peer}->{m.describe()}" for m in self.recvs)
        return f"{self.label} send [{out}] recv{self.receiving} [{into}]"


class FoldStep(BorderStep):
    """Received spans are reduced into place with the op: the first per span as it lands, the
    rest in the order given."""

    receiving = " fold"

    def run(self, runs: Runs) -> None:
        runs.fold(self)


class RowsStep(BorderStep):
    """A step of the small round: over the TCP border to every rank, every message carries the
    call rows known so far (an empty span: rows only), receives take whatever a peer sent (one
    that called something else is named, never waited for), and ``lands`` are made only while
    every message had its size."""

    label = "border rows"

    def run(self, runs: Runs) -> None:
        runs.rows(self)


class IslandMoves(BorderStep):
    """Moves inside the island as one vendor all-to-all (every island rank takes the step)."""

    label = "island alltoall"

    def run(self, runs: Runs) -> None:
        runs.island_moves(self)


Step = Union[IslandStep, BorderStep]


@dataclass(frozen=True)
class Piece:
    """Steps inside the islands, border steps, steps inside again: the border part may overlap
    other pieces' (the steps inside are the island library's, or moves between island ranks)."""

    before: tuple[Step, ...] = ()
    across: tuple[BorderStep, ...] = ()
    after: tuple[Step, ...] = ()


@dataclass(frozen=True)
class Plan:
    """One rank's steps of one op over a buffer of ``n`` elements; ``result`` is the span that
    holds this rank's result where it is not the whole buffer (reducescatter). ``finish``:
    landings after every piece (the small round's only writes into ``buf`` and ``out``, made
    once the rows agree); ``scratch``: elements of each named scratch buffer."""

    op: str
    rank: int
    n: int
    pieces: tuple[Piece, ...]
    result: Optional[Span] = None
    finish: tuple[Land, ...] = ()
    scratch: tuple[tuple[str, int], ...] = ()

    def sent(self, topo: Topology, *, across: bool = True) -> dict[int, int]:
        """Elements this rank sends each peer (only peers on other islands when ``across``)."""
        mine = topo.island_of(self.rank)
        out: dict[int, int] = {}
        for piece in self.pieces:
            for step in (*piece.before, *piece.across, *piece.after):
                for move in step.sends if isinstance(step, BorderStep) else ():
                    if move.span[1] and (not across or topo.island_of(move.peer) != mine):
                        out[move.peer] = out.get(move.peer, 0) + move.span[1]
        return out

    def describe(self) -> list[str]:
        kind = "small round" if any(isinstance(step, RowsStep) for piece in self.pieces for step in piece.across) else "plan"
        lines = [f"rank {self.rank}: {self.op} {kind} of {self.n} elements, {len(self.pieces)} piece(s)"]
        for q, piece in enumerate(self.pieces):
            for stage, steps in (("before", piece.before), ("across", piece.across), ("after", piece.after)):
                lines += [f"  piece {q} {stage}: {step.describe()}" for step in steps
                          if not isinstance(step, BorderStep) or step.sends or step.recvs]
        return lines


def _span(span: Span) -> str:
    return f"[{span[0]}:{span[0] + span[1]}]"


def piece_of(span: Span, q: int, count: int) -> Span:
    """Piece ``q`` of ``count`` of ``span``."""
    if count == 1:
        return span
    offset, length = span
    part_offset, part_length = split(length, count)[q]
    return offset + part_offset, part_length


def lane_part(span: Span, lanes: int, lane: int) -> Span:
    """Lane ``lane``'s part of ``span``: what that lane's owners carry across islands."""
    return piece_of(span, lane, lanes)


def build(topo: Topology, rank: int, op: str, n: int, root: int = 0, pieces: int = 1) -> Plan:
    """Rank ``rank``'s plan of ``op`` over ``n`` elements (allgather/reducescatter: the whole
    island-major buffer of world chunks), in ``pieces`` pieces. Cached per call pattern."""
    if op not in ROUND_OPS:
        raise ValueError(f"no plan for {op!r}; ops: {', '.join(ROUND_OPS)}")
    return _build(topo, rank, op, n, root if kind(op).rooted else 0, pieces if len(topo.islands) > 1 else 1)


@functools.lru_cache(maxsize=512)
def _build(topo: Topology, rank: int, op: str, n: int, root: int, pieces: int) -> Plan:
    return _Builder(topo, rank, n, root, pieces).plan(op)


class _Builder:
    """What every op's builder needs: this rank's island, lane, peers and the pieces."""

    def __init__(self, topo: Topology, rank: int, n: int, root: int, count: int) -> None:
        self.topo, self.rank, self.n, self.count = topo, rank, n, count
        self.isl = topo.island_of(rank)
        self.local = topo.local_rank(rank)
        self.lane = topo.lane_of(rank)
        self.peers = topo.lane_peers(self.lane) if self.lane is not None else []
        self.others = [j for j in range(len(topo.islands)) if j != self.isl.index]
        self.root, self.home = root, topo.island_of(root).index

    def plan(self, op: str) -> Plan:
        if len(self.topo.islands) == 1:
            return self._one_island(op)
        built = getattr(self, op)()
        result, pieces = built if op == "reducescatter" else (None, built)
        return Plan(op, self.rank, self.n, tuple(pieces), result)

    def _one_island(self, op: str) -> Plan:
        """The vendor op alone."""
        whole, size, result = (0, self.n), self.isl.size, None
        chunk = self.n // self.topo.world_size
        step = {"allreduce": IslandStep("allreduce", whole),
                "reduce": IslandStep("reduce", whole, root=self.local_root()),
                "broadcast": IslandStep("broadcast", whole, root=self.local_root()),
                "allgather": IslandStep("allgather", whole, (chunk,) * size),
                "reducescatter": IslandStep("reduce_scatter", whole, (chunk,) * size)}[op]
        if op == "reducescatter":
            result = (self.local * chunk, chunk)
        return Plan(op, self.rank, self.n, (Piece(before=(step,)),), result)

    def local_root(self) -> int:
        return self.topo.local_rank(self.root)

    def lane_counts(self, length: int) -> tuple[int, ...]:
        """An island-local split of ``length``: lane owner l gets lane part l, others none."""
        counts = [part for _, part in split(length, self.topo.lanes)]
        return tuple(counts + [0] * (self.isl.size - self.topo.lanes))

    def whole_pieces(self) -> list[Span]:
        return [piece_of((0, self.n), q, self.count) for q in range(self.count)]

    def mine(self, span: Span) -> Span:
        return lane_part(span, self.topo.lanes, self.lane)

    # -- the ops: per piece (before, across, after) ------------------------------------------------

    def allreduce(self) -> list[Piece]:
        """Reduce-scatter to lane owners, allreduce each lane segment among the lane's owners
        (direct reduce-scatter, then allgather), allgather back."""
        out = []
        for piece in self.whole_pieces():
            counts = self.lane_counts(piece[1])
            across: tuple[BorderStep, ...] = ()
            if self.lane is not None:
                me = self.peers.index(self.rank)
                seg = self.mine(piece)
                subs = [piece_of(seg, i, len(self.peers)) for i in range(len(self.peers))]
                others = [i for i in range(len(self.peers)) if i != me]
                across = (_step([(self.peers[i], subs[i]) for i in others],
                                [(self.peers[i], subs[me]) for i in others], fold=True),
                          _step([(self.peers[i], subs[me]) for i in others],
                                [(self.peers[i], subs[i]) for i in others]))
            out.append(Piece((IslandStep("reduce_scatter", piece, counts),), across,
                             (IslandStep("allgather", piece, counts),)))
        return out

    def reducescatter(self) -> tuple[Span, list[Piece]]:
        """Reduce-scatter each island region inside, lane owners swap their parts of the other
        islands' regions and fold what they get, allgather the island's own region."""
        chunk = self.n // self.topo.world_size
        regions = self.topo.regions(chunk)
        out = []
        for q in range(self.count):
            before = tuple(IslandStep("reduce_scatter", p, self.lane_counts(p[1]))
                           for p in (piece_of(span, q, self.count) for span in regions))
            own = piece_of(regions[self.isl.index], q, self.count)
            across: tuple[BorderStep, ...] = ()
            if self.lane is not None:
                mine = self.mine(own)
                across = (_step([(self.peers[j], self.mine(piece_of(regions[j], q, self.count))) for j in self.others],
                                [(self.peers[j], mine) for j in self.others], fold=True),)
            counts = self.lane_counts(own[1])
            # whole, the lane split may already be the chunk split
            after = ((IslandStep("allgather", own, counts),)
                     if self.count > 1 or counts != (chunk,) * self.isl.size else ())
            out.append(Piece(before, across, after))
        return (regions[self.isl.index][0] + self.local * chunk, chunk), out

    def allgather(self) -> list[Piece]:
        """The island's own region inside, its lane parts across, the other regions inside."""
        chunk = self.n // self.topo.world_size
        regions = self.topo.regions(chunk)
        size, start = self.isl.size, regions[self.isl.index][0]
        out = []
        for q in range(self.count):
            offset, length = piece_of((0, size * chunk), q, self.count)
            # each island rank's share of the piece: the part of its chunk inside it
            shares = tuple(max(min(offset + length, (i + 1) * chunk) - max(offset, i * chunk), 0) for i in range(size))
            across: tuple[BorderStep, ...] = ()
            if self.lane is not None:
                across = (_step([(self.peers[j], self.mine(piece_of(regions[self.isl.index], q, self.count)))
                                 for j in self.others],
                                [(self.peers[j], self.mine(piece_of(regions[j], q, self.count))) for j in self.others]),)
            after = tuple(IslandStep("allgather", p, self.lane_counts(p[1]))
                          for p in (piece_of(regions[j], q, self.count) for j in self.others))
            out.append(Piece((IslandStep("allgather", (start + offset, length), shares),), across, after))
        return out

    def broadcast(self) -> list[Piece]:
        """The root's island broadcasts inside, its lane owners send each lane's part across,
        the other islands allgather the parts."""
        home = self.isl.index == self.home
        out = []
        for piece in self.whole_pieces():
            across: tuple[BorderStep, ...] = ()
            if self.lane is not None:
                part = self.mine(piece)
                across = ((_step([(self.peers[j], part) for j in self.others], []),) if home
                          else (_step([], [(self.peers[self.home], part)]),))
            out.append(Piece((IslandStep("broadcast", piece, root=self.local_root()),) if home else (), across,
                             () if home else (IslandStep("allgather", piece, self.lane_counts(piece[1])),)))
        return out

    def reduce(self) -> list[Piece]:
        """Reduce-scatter in each island, lane owners send their partials to the root's island,
        which folds them and gathers the piece at the root."""
        home = self.isl.index == self.home
        out = []
        for piece in self.whole_pieces():
            counts = self.lane_counts(piece[1])
            across: tuple[BorderStep, ...] = ()
            if self.lane is not None:
                part = self.mine(piece)
                across = ((_step([], [(self.peers[j], part) for j in self.others], fold=True),) if home
                          else (_step([(self.peers[self.home], part)], []),))
            out.append(Piece((IslandStep("reduce_scatter", piece, counts),), across,
                             (IslandStep("gather", piece, counts, self.local_root()),) if home else ()))
        return out


def _step(sends: list[tuple[int, Span]], recvs: list[tuple[int, Span]], fold: bool = False) -> BorderStep:
    """A border step without empty moves."""
    return (FoldStep if fold else BorderStep)(tuple(Move(p, s) for p, s in sends if s[1]),
                                              tuple(Move(p, s) for p, s in recvs if s[1]))


@functools.lru_cache(maxsize=256)
def two_hop_broadcast(topo: Topology, rank: int, n: int, root: int) -> Plan:
    """A small broadcast for calls every rank already knows (calls not checked): the root sends
    the buffer to the other ranks of its island and to every other island's leader, each of
    those leaders to the rest of its island. Two hops and one message per receiver, against
    the round's three with rows; border bytes (k-1)S, the bound."""
    home, mine, whole = topo.island_of(root), topo.island_of(rank), (0, n)
    first = [r for r in home.ranks if r != root] + [island.ranks[0] for island in topo.islands if island != home]
    if rank == root:
        steps = (_step([(peer, whole) for peer in first], []),)
    elif rank in first:
        rest = mine.ranks[1:] if mine != home else ()
        steps = (_step([], [(root, whole)]), _step([(peer, whole) for peer in rest], []))
    else:
        steps = (_step([], [(mine.ranks[0], whole)]),)
    return Plan("broadcast", rank, n, (Piece(across=steps),))


@functools.lru_cache(maxsize=256)
def flat(topo: Topology, rank: int, op: str, n: int, root: int = 0) -> Plan:
    """Rank ``rank``'s flat plan of ``op``: a library over every rank, one island of them in
    ``topo``'s island-major order."""
    order = topo.island_major_order
    return build(Topology.from_islands(["flat"] * len(order)), order.index(rank), op, n, order.index(root))


def round_bytes(topo: Topology, op: str, nbytes: int, root: int = 0, one_hop: bool = False) -> int:
    """Border bytes of the small round (rounds.py): the bound, except allreduce, whose island
    partials go to every other island's leader: k(k-1)S. In one hop, every rank's data to
    every rank of another island that needs it (broadcast, reduce: the root's to or from the
    ranks outside its island)."""
    k, n = len(topo.islands), topo.world_size
    if not one_hop:
        return k * (k - 1) * nbytes if op == "allreduce" else kind(op).bound(topo, nbytes)
    if kind(op).rooted:
        return (n - topo.island_of(root).size) * nbytes
    crossing = n * n - sum(island.size ** 2 for island in topo.islands)  # ordered pairs across islands
    return crossing * nbytes // (1 if op == "allreduce" else n)


def border_bytes(topo: Topology, op: str, n: int, itemsize: int, root: int = 0, pieces: int = 1) -> int:
    """Bytes every rank's plan sends across island boundaries, all ranks together."""
    return itemsize * sum(sum(build(topo, r, op, n, root, pieces).sent(topo).values())
                          for r in range(topo.world_size))
