"""Hierarchical collective plans: each op's plan (schedule.py) run by the one runner.

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

A group of one island calls the vendor op directly. Plans import no Ray. Buffers are flat
contiguous tensors; per-rank chunks (allgather, reducescatter) are laid out island by island
(``Topology.island_major_order``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from hetccl_ray.collective import routes, schedule
from hetccl_ray.buffers import copy, joined, overlap, view
from hetccl_ray.collective.island import IslandComm, ranges
from hetccl_ray.collective.runner import PlanContext, execute, pipelined
from hetccl_ray.transport.base import Border


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


def plan_for(ctx: PlanContext, op: str, buf: torch.Tensor, root: int = 0) -> schedule.Plan:
    """This rank's (cached) plan of ``op`` over ``buf``, in the context's pieces; the flat
    plan (one island of every rank, in island-major order) where the planner chose it."""
    if ctx.flat is not None:
        order = ctx.topo.island_major_order()
        return schedule.build(schedule.flat_topology(len(order)), order.index(ctx.rank), op, buf.numel(),
                              order.index(root))
    largest = schedule.largest_region(ctx.topo, op, buf.numel()) * buf.element_size()
    return schedule.build(ctx.topo, ctx.rank, op, buf.numel(), root, ctx.pieces(largest))


def allreduce(ctx: PlanContext, buf: torch.Tensor, op: str) -> None:
    """Reduce-scatter to lane owners, allreduce across islands per lane, allgather back."""
    execute(ctx, plan_for(ctx, "allreduce", buf), buf, op)


def reducescatter(ctx: PlanContext, buf: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce the island-major ``buf`` of one chunk per rank; returns this rank's reduced chunk."""
    return execute(ctx, plan_for(ctx, "reducescatter", buf), buf, op)


def allgather(ctx: PlanContext, buf: torch.Tensor) -> None:
    """Gather the island-major ``buf`` whose own chunk is filled in, on every rank."""
    execute(ctx, plan_for(ctx, "allgather", buf), buf)


def broadcast(ctx: PlanContext, buf: torch.Tensor, root: int) -> None:
    """Root's island broadcasts inside, its lane owners send across, the others allgather."""
    execute(ctx, plan_for(ctx, "broadcast", buf, root), buf)


def reduce(ctx: PlanContext, buf: torch.Tensor, root: int, op: str) -> None:
    """Reduce-scatter in each island, partials to the root's island, gathered at root."""
    execute(ctx, plan_for(ctx, "reduce", buf, root), buf, op)


def alltoall(ctx: PlanContext, counts: Sequence[Sequence[int]], inputs: Sequence[torch.Tensor],
             outputs: Sequence[torch.Tensor]) -> None:
    """Send ``inputs[t]`` to rank t and receive ``outputs[r]`` from rank r (``counts[r][t]``
    elements, agreed by every rank) along routes.py's routes: gathered inside the island by
    destination lane, across once per island pair and lane, scattered inside; in pieces whose
    border stage overlaps the island stages. Moves inside an island take the border's socket
    for CPU tensors, one vendor all-to-all per stage for device tensors. A CPU all-to-all
    in which no rank sends more than ``DIRECT_BYTES`` goes direct: every block straight, one hop
    (decided from the agreed rows, so every rank routes alike in a group of mixed devices)."""
    if ctx.flat is not None:
        return _flat_alltoall(ctx, counts, inputs, outputs)
    me, topo = ctx.rank, ctx.topo
    ctx.launch(copy, outputs[me], inputs[me])
    direct = ctx.direct is not None and ctx.device.host  # island moves: sockets, or the vendor's all-to-all
    one_hop = (direct and ctx.every_rank_on_host()
               and max(sum(row) for row in counts) * inputs[me].element_size() <= DIRECT_BYTES)
    way = routes.route(topo, me, one_hop)
    offsets, total = routes.staging(way.transit(), counts)
    like = inputs[me]
    staged = ctx.scratch.get("alltoall", total, like)
    count = 1 if one_hop else ctx.pieces(routes.largest_crossing(topo, counts) * like.element_size())

    def holder(block: routes.Block) -> torch.Tensor:
        r, t = block
        if r == me:
            return inputs[t]
        return outputs[r] if t == me else view(staged, (offsets[block], counts[r][t]))

    def pieces(moves: Sequence[routes.Move], q: int, sending: bool) -> list[tuple[int, torch.Tensor]]:
        return [(m.dst if sending else m.src,
                 view(holder(m.block), schedule.piece_of((0, counts[m.block[0]][m.block[1]]), q, count)))
                for m in moves]

    def inside(stage: int, q: int) -> None:
        sends, recvs = pieces(way.sends[stage], q, True), pieces(way.recvs[stage], q, False)
        if direct:
            _exchange_blocks(ctx, stage, sends, recvs, ctx.direct)
        elif ctx.my_island.size > 1:
            ctx.launch(_island_alltoall, ctx, sends, recvs, like)

    pipelined(ctx, count, lambda q: inside(routes.GATHER, q),
               lambda q: _exchange_blocks(ctx, routes.ACROSS, pieces(way.sends[routes.ACROSS], q, True),
                                          pieces(way.recvs[routes.ACROSS], q, False)),
               lambda q: inside(routes.SCATTER, q))


def _flat_alltoall(ctx: PlanContext, counts: list[list[int]], inputs: Sequence[torch.Tensor],
                   outputs: Sequence[torch.Tensor]) -> None:
    """The flat library's all-to-all (host tensors): blocks in its rank order (island-major),
    on the caller's buffers where they already are one buffer in that order, else copied."""
    order, me, like = ctx.topo.island_major_order(), ctx.rank, inputs[ctx.rank]
    sends, recvs = [counts[me][r] for r in order], [counts[r][me] for r in order]
    send, recv = joined([inputs[r] for r in order]), joined([outputs[r] for r in order])
    if send is None:
        send = ctx.scratch.get("flat-send", sum(sends), like)
        for r, span in zip(order, ranges(sends)):
            copy(view(send, span), inputs[r])
    staged = recv is None or overlap(recv, send)
    if staged:
        recv = ctx.scratch.get("flat-recv", sum(recvs), like)
    size = like.element_size()  # as bytes: Gloo's all-to-all takes fewer dtypes than ours (bool, complex)
    ctx.flat.alltoall(_bytes(recv), _bytes(send), [n * size for n in recvs], [n * size for n in sends])
    if staged:
        for r, span in zip(order, ranges(recvs)):
            copy(outputs[r], view(recv, span))


def _bytes(buf: torch.Tensor) -> torch.Tensor:
    """A flat contiguous buffer's bytes (an empty one may have any stride)."""
    return buf.view(torch.uint8) if buf.numel() else torch.empty(0, dtype=torch.uint8)


DIRECT_BYTES = 256 << 10  # 2x2 loopback, 1 KiB: the plan part 0.64-0.87 ms direct, 0.86-1.1 ms by lanes
_PACK_BYTES = 256 << 10  # below this a peer's blocks go as one message: a message costs more than a copy


def _per_peer(pairs: Sequence[tuple[int, torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
    grouped: dict[int, list[torch.Tensor]] = {}
    for peer, part in pairs:
        grouped.setdefault(peer, []).append(part)
    return grouped


def _unpack(packed: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """Copy consecutive ranges of ``packed`` into ``parts``, in order."""
    offset = 0
    for part in parts:
        copy(part, packed[offset:offset + part.numel()])
        offset += part.numel()


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
        out += [(peer, torch.cat(views))] if packs(views) else [(peer, part) for part in views]
    for peer, views in _per_peer(recvs).items():
        if packs(views):
            buf = ctx.scratch.get(("packed", stage, peer), sum(v.numel() for v in views), views[0])
            into.append((peer, buf))
            unpack.append((buf, views))
        else:
            into += [(peer, part) for part in views]
    ctx.exchange(out, into, border=border)
    for buf, views in unpack:
        _unpack(buf, views)


def _island_alltoall(ctx: PlanContext, sends: Sequence[tuple[int, torch.Tensor]],
                     recvs: Sequence[tuple[int, torch.Tensor]], like: torch.Tensor) -> None:
    """One stage's moves inside the island as one vendor all-to-all (every island rank calls
    it): each peer's views packed in posting order, unpacked likewise on arrival. Device work:
    runs as one launch on the op's stream."""
    def by_peer(pairs: Sequence[tuple[int, torch.Tensor]]) -> tuple[list[torch.Tensor], list[int]]:
        ordered = sorted(pairs, key=lambda pair: ctx.topo.local_rank(pair[0]))  # stable: keeps posting order
        counts = [0] * ctx.my_island.size
        for peer, part in ordered:
            counts[ctx.topo.local_rank(peer)] += part.numel()
        return [part for _, part in ordered], counts

    send_views, send_counts = by_peer(sends)
    recv_views, recv_counts = by_peer(recvs)
    packed = torch.cat(send_views) if send_views else like[:0]
    arrived = ctx.scratch.get("alltoall-island", sum(recv_counts), like)
    ctx.vendor.alltoall(arrived, packed, recv_counts, send_counts)
    _unpack(arrived, recv_views)


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
