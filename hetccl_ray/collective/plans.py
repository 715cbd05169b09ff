"""Hierarchical collective plans over an island communicator and a border.

Every plan has the same three stages (after HetCCL and FlagCX's cluster-to-cluster
planner): the vendor op inside each island, an exchange between the lane owners of the
islands over the border, the vendor op inside each island again. Bytes cross island
boundaries the minimum number of times:

================  ==============================================
op                bytes sent over the border, all ranks together
================  ==============================================
allreduce         2 (k - 1) S
reducescatter     (k - 1) S        (S: the whole input, all chunks)
allgather         (k - 1) S        (S: the whole output)
broadcast/reduce  (k - 1) S
alltoall          what the ranks of one island send the others
================  ==============================================

A group of one island calls the vendor op directly. Plans import no Ray.
Buffers are flat contiguous tensors; per-rank chunks (allgather, reducescatter) are laid
out island by island (``Topology.island_major_order``).

Device tensors (devices.py): island ops and reductions are device work launched on the op's
stream (``ctx.launch``); a border step first waits for that stream (``ctx.host_wait``), and
until the plan launches again the host may read and write the buffers itself.
"""

from __future__ import annotations

import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from hetccl_ray.collective import routes
from hetccl_ray.collective.island import IslandComm
from hetccl_ray.collective.calls import all_host
from hetccl_ray.collective.reduction import combine, copy
from hetccl_ray.devices import HOST, Device, StreamLike
from hetccl_ray.errors import HetCCLTimeoutError
from hetccl_ray.topology import Topology, split
from hetccl_ray.transport.base import Border, Handle, Tag

Span = tuple[int, int]


class ScratchPool:
    """Receive buffers kept between calls: fresh memory is slow to touch, so reuse it."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def _grown(self, key: tuple, n: int, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = self._buffers[key] = make(n)
        return buf[:n]

    def get(self, slot: object, n: int, like: torch.Tensor) -> torch.Tensor:
        """``n`` elements of ``like``'s dtype on its device."""
        return self._grown((slot, like.dtype, like.device), n,
                           lambda size: torch.empty(size, dtype=like.dtype, device=like.device))

    def host(self, slot: object, like: torch.Tensor, device: Device) -> torch.Tensor:
        """Host memory for a copy of ``like`` (pinned where ``device`` copies from it faster)."""
        return self._grown(("host", slot, like.dtype), like.numel(),
                           lambda size: device.host_buffer(max(size, 1) * like.element_size()).view(like.dtype))


@dataclass
class PlanContext:
    """What one op's plan runs with: who this rank is, its island, the border, the deadline."""

    topo: Topology
    rank: int
    island: IslandComm
    border: Border
    tag: Tag
    deadline: float
    scratch: ScratchPool = field(default_factory=ScratchPool)
    pipeline: Optional[Executor] = None  # one thread: border stages overlap island stages
    piece_bytes: int = 4 << 20
    direct: Optional[Border] = None  # the TCP border to every rank: small-message rounds (tree.py)
    device: Device = HOST  # whose memory the op's buffers are, and how work on it is ordered
    stream: Optional[StreamLike] = None  # the op's side stream on that device
    rows: Optional[dict[int, list[int]]] = None  # every rank's call row, once a round agreed them

    def __post_init__(self) -> None:
        self.vendor = self.island  # the island library itself; ``island`` launches on the stream
        if not self.device.host:
            self.island = _Launched(self.island, self)

    def launch(self, fn: Callable, *args) -> None:
        """Device work on the op's stream (runs now for host memory)."""
        self.device.launch(self.stream, fn, *args)

    def host_wait(self) -> None:
        """Wait until the op's stream has done its launched work: the host may touch the buffers."""
        if not self.device.host:
            self.device.host_wait(self.stream, self.deadline, f"op {self.tag.op} #{self.tag.seq} on rank {self.rank}")

    def on_stream(self, fn: Callable, *args) -> None:
        """Run host code that may start kernels (border copies) with the op's stream current."""
        with self.device.using(self.stream):
            fn(*args)

    def every_rank_on_host(self) -> bool:
        """Whether every rank's buffers are host memory, from the agreed rows (False without them)."""
        return self.rows is not None and all_host(self.rows.values())

    @property
    def my_island(self):
        return self.topo.island_of(self.rank)

    @property
    def lane(self):
        return self.topo.lane_of(self.rank)

    def lane_counts(self, n: int) -> list[int]:
        """Island-local ranges of ``n`` elements: lane owner l gets lane segment l, others none."""
        counts = [length for _, length in split(n, self.topo.lanes)]
        return counts + [0] * (self.my_island.size - self.topo.lanes)

    def lane_segment(self, buf: torch.Tensor) -> torch.Tensor:
        """The part of a whole buffer that this rank carries across islands (it owns a lane)."""
        return _view(buf, _lane_part((0, buf.numel()), self.topo.lanes, self.lane))

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                 reduce_from: Optional[tuple[int, torch.Tensor, str]] = None, border: Optional[Border] = None) -> None:
        """Post all receives and sends at once, then wait for all before the deadline.

        ``reduce_from=(peer, buf, op)`` receives from one more peer, reducing into ``buf``
        as the data arrives (one such peer per buffer: receptions run concurrently).
        Messages go over ``border`` (default: the op's border), in order per peer.
        """
        border = border or self.border
        self.host_wait()  # the producing work is done, and no pending kernel still reads a buffer we fill
        handles = [border.irecv(peer, buf, self.tag) for peer, buf in recvs if buf.numel()]
        if reduce_from is not None and reduce_from[1].numel():
            handles.append(border.irecv(*reduce_from[:2], self.tag, op=reduce_from[2]))
        handles += [border.isend(peer, buf, self.tag) for peer, buf in sends if buf.numel()]
        for handle in handles:
            self.wait(handle)

    def wait(self, handle: Handle) -> None:
        """Wait for one transfer before the op's deadline; a timeout names the peer waited for."""
        try:
            handle.wait(max(self.deadline - time.monotonic(), 0.0))
        except HetCCLTimeoutError as exc:
            exc.waiting_for = handle.peer
            raise


class _Launched:
    """An island communicator whose every call is device work launched on the op's stream."""

    def __init__(self, island: IslandComm, ctx: PlanContext) -> None:
        self._island, self._ctx = island, ctx

    @property
    def rank(self) -> int:
        return self._island.rank

    @property
    def size(self) -> int:
        return self._island.size

    def __getattr__(self, name: str) -> Callable:
        op = getattr(self._island, name)
        return lambda *args: self._ctx.launch(op, *args)


class LazyIsland:
    """An island communicator made on first use: after the call check, so ranks of one island
    that disagree on the device are named rather than left waiting for each other's library."""

    def __init__(self, make: Callable[[], IslandComm]) -> None:
        self._make = make
        self._island: Optional[IslandComm] = None

    def __getattr__(self, name: str):
        if self._island is None:
            self._island = self._make()
        return getattr(self._island, name)


def _view(buf: torch.Tensor, span: Span) -> torch.Tensor:
    offset, length = span
    return buf[offset:offset + length]


def _lane_part(span: Span, lanes: int, lane: int) -> Span:
    """Lane ``lane``'s part of the region ``span``."""
    offset, length = span
    part_offset, part_length = split(length, lanes)[lane]
    return offset + part_offset, part_length


def region_spans(topo: Topology, chunk: int) -> list[Span]:
    """Where each island's per-rank chunks lie in an island-major buffer."""
    spans, offset = [], 0
    for island in topo.islands:
        spans.append((offset, island.size * chunk))
        offset += island.size * chunk
    return spans


def _cross_allreduce(ctx: PlanContext, seg: torch.Tensor, op: str, peers: list[int]) -> None:
    """Allreduce ``seg`` among one lane's owners: direct reduce-scatter, then allgather."""
    me = peers.index(ctx.rank)
    subs = split(seg.numel(), len(peers))
    mine = _view(seg, subs[me])
    others = [i for i in range(len(peers)) if i != me]
    partials = [ctx.scratch.get(i, mine.numel(), seg) for i in others[1:]]
    ctx.exchange(sends=[(peers[i], _view(seg, subs[i])) for i in others],
                 recvs=[(peers[i], partial) for i, partial in zip(others[1:], partials)],
                 reduce_from=(peers[others[0]], mine, op))
    for partial in partials:
        ctx.launch(combine, mine, partial, op)
    ctx.exchange(sends=[(peers[i], mine) for i in others],
                 recvs=[(peers[i], _view(seg, subs[i])) for i in others])


def _piece(span: Span, q: int, count: int) -> Span:
    """Piece ``q`` of ``count`` of the region ``span``."""
    offset, length = span
    part_offset, part_length = split(length, count)[q]
    return offset + part_offset, part_length


def _piece_count(ctx: PlanContext, spans: Sequence[Span], itemsize: int) -> int:
    """Pieces of ``ctx.piece_bytes`` for the largest region (one without a pipeline thread)."""
    largest = max(length for _, length in spans) * itemsize
    return max(-(-largest // ctx.piece_bytes), 1) if ctx.pipeline is not None else 1


def _pipelined(ctx: PlanContext, count: int, before: Callable[[int], None], across: Callable[[int], None],
               after: Callable[[int], None]) -> None:
    """Run each piece's island stage ``before``, border stage ``across`` and island stage
    ``after`` in order; with several pieces, piece q's border stage runs on the pipeline
    thread while this thread works on the island stages of pieces q+1 and q-1."""
    if count == 1:
        before(0)
        across(0)
        after(0)
        return
    crossing: list[tuple[int, Future]] = []
    for q in range(count):
        before(q)
        crossing.append((q, ctx.pipeline.submit(ctx.on_stream, across, q)))
        if len(crossing) > 1:
            _after_crossing(ctx, *crossing.pop(0), after)
    for done in crossing:
        _after_crossing(ctx, *done, after)


def _after_crossing(ctx: PlanContext, q: int, crossed: Future, after: Callable[[int], None]) -> None:
    try:
        crossed.result(timeout=max(ctx.deadline - time.monotonic(), 0.0))
    except TimeoutError:
        raise HetCCLTimeoutError("the border stage of a pipelined piece passed the deadline") from None
    after(q)


def allreduce(ctx: PlanContext, buf: torch.Tensor, op: str) -> None:
    """Reduce-scatter to lane owners, allreduce across islands per lane, allgather back,
    in pieces of ``ctx.piece_bytes`` whose border stages overlap the island stages."""
    if len(ctx.topo.islands) == 1:
        ctx.island.allreduce(buf, op)
        return
    pieces = _whole_pieces(ctx, buf)
    _pipelined(ctx, len(pieces),
               lambda q: ctx.island.reduce_scatter(pieces[q], ctx.lane_counts(pieces[q].numel()), op),
               lambda q: _lane_allreduce(ctx, pieces[q], op),
               lambda q: ctx.island.allgather(pieces[q], ctx.lane_counts(pieces[q].numel())))


def _lane_allreduce(ctx: PlanContext, piece: torch.Tensor, op: str) -> None:
    """Stage 2 for one piece: this rank's lane segment, allreduced across islands."""
    if ctx.lane is not None:
        segment = ctx.lane_segment(piece)
        _cross_allreduce(ctx, segment, op, ctx.topo.lane_peers(ctx.lane))


def reducescatter(ctx: PlanContext, buf: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce the island-major ``buf`` of one chunk per rank; returns this rank's reduced chunk.

    Piece by piece: reduce-scatter each island region inside, lane owners swap their parts
    of the other islands' regions and reduce what they get, allgather the island's region."""
    topo, isl = ctx.topo, ctx.my_island
    chunk = buf.numel() // topo.world_size
    local = topo.local_rank(ctx.rank)
    if len(topo.islands) == 1:
        ctx.island.reduce_scatter(buf, [chunk] * isl.size, op)
        return _view(buf, (local * chunk, chunk))
    regions = region_spans(topo, chunk)
    count = _piece_count(ctx, regions, buf.element_size())
    others = [j for j in range(len(topo.islands)) if j != isl.index]

    def part(j: int, q: int) -> torch.Tensor:
        return _view(buf, _lane_part(_piece(regions[j], q, count), topo.lanes, ctx.lane))

    def inside(q: int) -> None:
        for span in regions:
            piece = _piece(span, q, count)
            ctx.island.reduce_scatter(_view(buf, piece), ctx.lane_counts(piece[1]), op)

    def across(q: int) -> None:
        if ctx.lane is None:
            return
        peers, mine = topo.lane_peers(ctx.lane), part(isl.index, q)
        partials = [ctx.scratch.get(j, mine.numel(), buf) for j in others]
        ctx.exchange(sends=[(peers[j], part(j, q)) for j in others],
                     recvs=[(peers[j], partial) for j, partial in zip(others, partials)])
        for partial in partials:
            ctx.launch(combine, mine, partial, op)

    def gather(q: int) -> None:
        piece = _piece(regions[isl.index], q, count)
        counts = ctx.lane_counts(piece[1])
        if count > 1 or counts != [chunk] * isl.size:  # whole, the lane split may be the chunk split
            ctx.island.allgather(_view(buf, piece), counts)

    _pipelined(ctx, count, inside, across, gather)
    return _view(buf, (regions[isl.index][0] + local * chunk, chunk))


def allgather(ctx: PlanContext, buf: torch.Tensor) -> None:
    """Gather the island-major ``buf`` whose own chunk is filled in, on every rank, piece by
    piece: the island's region inside, its lane parts across, the other regions inside."""
    topo, isl = ctx.topo, ctx.my_island
    chunk = buf.numel() // topo.world_size
    if len(topo.islands) == 1:
        ctx.island.allgather(buf, [chunk] * isl.size)
        return
    regions = region_spans(topo, chunk)
    count = _piece_count(ctx, regions, buf.element_size())
    others = [j for j in range(len(topo.islands)) if j != isl.index]

    def gather_own(q: int) -> None:  # each rank's share of the piece is the part of its chunk in it
        offset, length = _piece((0, isl.size * chunk), q, count)
        ctx.island.allgather(_view(buf, (regions[isl.index][0] + offset, length)),
                             [max(min(offset + length, (i + 1) * chunk) - max(offset, i * chunk), 0)
                              for i in range(isl.size)])

    def part(j: int, q: int) -> torch.Tensor:
        return _view(buf, _lane_part(_piece(regions[j], q, count), topo.lanes, ctx.lane))

    def across(q: int) -> None:
        if ctx.lane is not None:
            peers = topo.lane_peers(ctx.lane)
            ctx.exchange(sends=[(peers[j], part(isl.index, q)) for j in others],
                         recvs=[(peers[j], part(j, q)) for j in others])

    def spread(q: int) -> None:
        for j in others:
            piece = _view(buf, _piece(regions[j], q, count))
            ctx.island.allgather(piece, ctx.lane_counts(piece.numel()))

    _pipelined(ctx, count, gather_own, across, spread)


def _whole_pieces(ctx: PlanContext, buf: torch.Tensor) -> list[torch.Tensor]:
    """``buf`` in the pipeline's pieces (one piece in a group of one island)."""
    whole = (0, buf.numel())
    count = _piece_count(ctx, [whole], buf.element_size()) if len(ctx.topo.islands) > 1 else 1
    return [_view(buf, _piece(whole, q, count)) for q in range(count)]


def broadcast(ctx: PlanContext, buf: torch.Tensor, root: int) -> None:
    """Piece by piece: root's island broadcasts inside, its lane owners send each lane's part
    across, the other islands allgather the parts."""
    topo, isl = ctx.topo, ctx.my_island
    home = topo.island_of(root).index
    pieces = _whole_pieces(ctx, buf)

    def inside(q: int) -> None:
        if isl.index == home:
            ctx.island.broadcast(pieces[q], topo.local_rank(root))

    def across(q: int) -> None:
        if ctx.lane is None:
            return
        peers, part = topo.lane_peers(ctx.lane), ctx.lane_segment(pieces[q])
        if isl.index == home:
            ctx.exchange(sends=[(peers[j], part) for j in range(len(peers)) if j != home], recvs=[])
        else:
            ctx.exchange(sends=[], recvs=[(peers[home], part)])

    def spread(q: int) -> None:
        if isl.index != home:
            ctx.island.allgather(pieces[q], ctx.lane_counts(pieces[q].numel()))

    _pipelined(ctx, len(pieces), inside, across, spread)


def reduce(ctx: PlanContext, buf: torch.Tensor, root: int, op: str) -> None:
    """Piece by piece: reduce-scatter in each island, lane owners send partials to the root's
    island, which reduces them and gathers the piece at root."""
    topo, isl = ctx.topo, ctx.my_island
    home = topo.island_of(root).index
    if len(topo.islands) == 1:
        ctx.island.reduce(buf, topo.local_rank(root), op)
        return
    pieces = _whole_pieces(ctx, buf)

    def across(q: int) -> None:
        if ctx.lane is None:
            return
        peers, part = topo.lane_peers(ctx.lane), ctx.lane_segment(pieces[q])
        if isl.index != home:
            ctx.exchange(sends=[(peers[home], part)], recvs=[])
            return
        others = [j for j in range(len(peers)) if j != home]
        partials = [ctx.scratch.get(j, part.numel(), buf) for j in others]
        ctx.exchange(sends=[], recvs=[(peers[j], partial) for j, partial in zip(others, partials)])
        for partial in partials:
            ctx.launch(combine, part, partial, op)

    def gather(q: int) -> None:
        if isl.index == home:
            ctx.island.gather(pieces[q], ctx.lane_counts(pieces[q].numel()), topo.local_rank(root))

    _pipelined(ctx, len(pieces),
               lambda q: ctx.island.reduce_scatter(pieces[q], ctx.lane_counts(pieces[q].numel()), op),
               across, gather)


def alltoall(ctx: PlanContext, counts: Sequence[Sequence[int]], inputs: Sequence[torch.Tensor],
             outputs: Sequence[torch.Tensor]) -> None:
    """Send ``inputs[t]`` to rank t and receive ``outputs[r]`` from rank r (``counts[r][t]``
    elements, agreed by every rank) along routes.py's routes: gathered inside the island by
    destination lane, across once per island pair and lane, scattered inside; in pieces whose
    border stage overlaps the island stages. Moves inside an island take the border's socket
    for CPU tensors, one vendor all-to-all per stage for device tensors. A CPU all-to-all
    in which no rank sends more than ``FLAT_BYTES`` goes flat: every block straight, one hop
    (decided from the agreed rows, so every rank routes alike in a group of mixed devices)."""
    me, topo = ctx.rank, ctx.topo
    ctx.launch(copy, outputs[me], inputs[me])
    direct = ctx.direct is not None and ctx.device.host  # island moves: sockets, or the vendor's all-to-all
    flat = (direct and ctx.every_rank_on_host()
            and max(sum(row) for row in counts) * inputs[me].element_size() <= FLAT_BYTES)
    way = routes.route(topo, me, flat)
    offsets, total = routes.staging(way.transit(), counts)
    like = inputs[me]
    staged = ctx.scratch.get("alltoall", total, like)
    count = 1 if flat else _piece_count(ctx, [(0, routes.largest_crossing(topo, counts))], like.element_size())

    def holder(block: routes.Block) -> torch.Tensor:
        r, t = block
        if r == me:
            return inputs[t]
        return outputs[r] if t == me else _view(staged, (offsets[block], counts[r][t]))

    def pieces(moves: Sequence[routes.Move], q: int, sending: bool) -> list[tuple[int, torch.Tensor]]:
        return [(m.dst if sending else m.src, _view(holder(m.block), _piece((0, counts[m.block[0]][m.block[1]]),
                                                                            q, count))) for m in moves]

    def inside(stage: int, q: int) -> None:
        sends, recvs = pieces(way.sends[stage], q, True), pieces(way.recvs[stage], q, False)
        if direct:
            _exchange_blocks(ctx, stage, sends, recvs, ctx.direct)
        elif ctx.my_island.size > 1:
            ctx.launch(_island_alltoall, ctx, sends, recvs, like)

    _pipelined(ctx, count, lambda q: inside(routes.GATHER, q),
               lambda q: _exchange_blocks(ctx, routes.ACROSS, pieces(way.sends[routes.ACROSS], q, True),
                                          pieces(way.recvs[routes.ACROSS], q, False)),
               lambda q: inside(routes.SCATTER, q))


FLAT_BYTES = 256 << 10  # 2x2 loopback, 1 KiB: the plan part 0.64-0.87 ms flat, 0.86-1.1 ms by lanes
_PACK_BYTES = 256 << 10  # below this a peer's blocks go as one message: a message costs more than a copy


def _per_peer(pairs: Sequence[tuple[int, torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
    grouped: dict[int, list[torch.Tensor]] = {}
    for peer, view in pairs:
        grouped.setdefault(peer, []).append(view)
    return grouped


def _exchange_blocks(ctx: PlanContext, stage: int, sends: Sequence[tuple[int, torch.Tensor]],
                     recvs: Sequence[tuple[int, torch.Tensor]], border: Optional[Border] = None) -> None:
    """Exchange block views, one message per block, except that a peer's several blocks of at
    most ``_PACK_BYTES`` in all travel packed in one (both ends see the same blocks, so
    both decide alike)."""
    ctx.host_wait()

    def packs(views: list[torch.Tensor]) -> bool:
        return len(views) > 1 and sum(v.numel() for v in views) * views[0].element_size() <= _PACK_BYTES

    out, into, unpack = [], [], []
    for peer, views in _per_peer(sends).items():
        out += [(peer, torch.cat(views))] if packs(views) else [(peer, view) for view in views]
    for peer, views in _per_peer(recvs).items():
        if packs(views):
            buf = ctx.scratch.get(("packed", stage, peer), sum(v.numel() for v in views), views[0])
            into.append((peer, buf))
            unpack.append((buf, views))
        else:
            into += [(peer, view) for view in views]
    ctx.exchange(out, into, border=border)
    for buf, views in unpack:
        offset = 0
        for view in views:
            copy(view, buf[offset:offset + view.numel()])
            offset += view.numel()


def _island_alltoall(ctx: PlanContext, sends: Sequence[tuple[int, torch.Tensor]],
                     recvs: Sequence[tuple[int, torch.Tensor]], like: torch.Tensor) -> None:
    """One stage's moves inside the island as one vendor all-to-all (every island rank calls
    it): each peer's views packed in posting order, unpacked likewise on arrival. Device work:
    runs as one launch on the op's stream."""
    def by_peer(pairs: Sequence[tuple[int, torch.Tensor]]) -> tuple[list[torch.Tensor], list[int]]:
        ordered = sorted(pairs, key=lambda pair: ctx.topo.local_rank(pair[0]))  # stable: keeps posting order
        counts = [0] * ctx.my_island.size
        for peer, view in ordered:
            counts[ctx.topo.local_rank(peer)] += view.numel()
        return [view for _, view in ordered], counts

    send_views, send_counts = by_peer(sends)
    recv_views, recv_counts = by_peer(recvs)
    packed = torch.cat(send_views) if send_views else like[:0]
    arrived = ctx.scratch.get("alltoall-island", sum(recv_counts), like)
    ctx.vendor.alltoall(arrived, packed, recv_counts, send_counts)
    offset = 0
    for view in recv_views:
        copy(view, arrived[offset:offset + view.numel()])
        offset += view.numel()


def _by_island(ctx: PlanContext, peer: int) -> bool:
    """Whether a message to ``peer`` goes through the island library: device tensors to an
    island peer do; CPU tensors take the border's socket (one hop, cheaper than Gloo's P2P)."""
    same = ctx.topo.island_of(peer) == ctx.my_island
    return same and (ctx.direct is None or not ctx.device.host)


def send(ctx: PlanContext, buf: torch.Tensor, peer: int) -> None:
    """Vendor P2P inside an island, the border otherwise."""
    if _by_island(ctx, peer):
        ctx.island.send(buf, ctx.topo.local_rank(peer))
    else:
        ctx.exchange(sends=[(peer, buf)], recvs=[])


def recv(ctx: PlanContext, buf: torch.Tensor, peer: int) -> None:
    """Counterpart of :func:`send`."""
    if _by_island(ctx, peer):
        ctx.island.recv(buf, ctx.topo.local_rank(peer))
    else:
        ctx.exchange(sends=[], recvs=[(peer, buf)])
