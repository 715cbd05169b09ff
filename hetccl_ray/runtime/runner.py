"""The one runner of plans: what an op runs with, and the mechanics every plan shares.

``PlanContext`` holds one op's rank, island communicator, border, deadline, stream and
scratch; ``execute`` runs a ``plans.Plan`` over a flat buffer; ``pipelined`` overlaps
each piece's border stage (on the group's pipeline thread) with the island stages of the
pieces before and after it, for every plan (the all-to-all's too). Imports no Ray.

Device tensors (devices.py): island ops and reductions are device work launched on the op's
stream (``ctx.launch``); a border step first waits for that stream (``ctx.host_wait``), and
until the plan launches again the host may read and write the buffers itself.
"""

from __future__ import annotations

import time
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import torch

from hetccl_ray.memory import buffers, devices
from hetccl_ray.memory.buffers import combine, copy, view
from hetccl_ray.core import opkinds
from hetccl_ray.core.planner import BORDER
from hetccl_ray.islands.libraries import IslandComm
from hetccl_ray.core.plans import (BUF, BorderStep, FoldIn, FoldStep, IslandMoves, IslandStep, Land, Move, Plan,
                                            Ref, RowsStep, Span, Step)
from hetccl_ray.memory.devices import HOST, Device, StreamLike
from hetccl_ray.errors import HetCCLTimeoutError
from hetccl_ray.core.topology import Topology
from hetccl_ray.transport.base import Border, ControlBorder, Handle, Tag


class ScratchPool(buffers.ScratchPool):
    """The scratch pool of plans, with host copies of device buffers for staging."""

    def host(self, slot: object, like: torch.Tensor, device: Device) -> torch.Tensor:
        """Host memory for a copy of ``like`` (pinned where ``device`` copies from it faster)."""
        return self.grown(("host", slot, like.dtype, device.kind), like.numel(),
                          lambda size: device.host_buffer(max(size, 1) * like.element_size()).view(like.dtype))


Recv = tuple  # (peer, buffer) or (peer, buffer, reduce op): received as a copy, or reduced as it lands


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
    direct: Optional[ControlBorder] = None  # the TCP border to every rank: small-message rounds (small_round.py)
    device: Device = HOST  # whose memory the op's buffers are, and how work on it is ordered
    stream: Optional[StreamLike] = None  # the op's side stream on that device
    rows: Optional[dict[int, list[int]]] = None  # every rank's call row, once a round agreed them
    flat: Optional[IslandComm] = None  # the library over every rank, when the planner chose the flat plan
    shared: Any = None  # every rank on one host: the shared-memory library (shm.py) checks calls and moves CPU data
    one_hop: bool = False  # the group's small rounds and checks go in one hop (rounds.py), not three
    # the planner's path for the op's buffers: the host path (messages over the border's socket,
    # host blocks sent ahead, pulled on one host) or the device path (island peers through the
    # island library, pulled bytes staged through host memory)
    host_path: bool = False
    route: str = BORDER  # a message's route, the planner's (planner.route)

    def __post_init__(self) -> None:
        self.vendor = self.island  # the island library itself; ``island`` launches on the stream
        self.island = _Launched(self.island, self)

    def launch(self, fn: Callable, *args) -> None:
        """Device work on the op's stream (runs now for host memory)."""
        self.device.launch(self.stream, fn, *args)

    def host_wait(self) -> None:
        """Wait until the op's stream has done its launched work: the host may touch the buffers."""
        self.device.host_wait(self.stream, self.deadline, f"op {self.tag.op} #{self.tag.seq} on rank {self.rank}")

    def on_stream(self, fn: Callable, *args) -> None:
        """Run host code that may start kernels (border copies) with the op's stream current."""
        with self.device.using(self.stream):
            fn(*args)

    @property
    def my_island(self):
        return self.topo.island_of(self.rank)

    def pieces(self, largest_bytes: int) -> int:
        """Pieces of ``piece_bytes`` for the largest region (one without a pipeline thread)."""
        return opkinds.pieces(largest_bytes, self.piece_bytes if self.pipeline is not None else None)

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[Recv],
                 border: Optional[Border] = None) -> None:
        """Post all receives and sends at once, then wait for all before the deadline. A
        receive ``(peer, buf, op)`` reduces into ``buf`` as the data lands (one such receive
        per buffer: receptions run concurrently). Over ``border`` (default: the op's), in
        order per peer. Transports move host memory (and device memory a border takes as it
        is): device buffers are staged here, by device work on the op's stream."""
        border = border or self.border
        lands: list[tuple[torch.Tensor, torch.Tensor, Optional[str]]] = []
        if not self.device.host:
            sends, recvs, lands = self._through_host(sends, recvs, border)
        self.host_wait()  # the producing work is done, and no pending kernel still reads a buffer we fill
        handles = [border.irecv(peer, buf, self.tag, *op) for peer, buf, *op in recvs if buf.numel()]
        handles += [border.isend(peer, buf, self.tag) for peer, buf in sends if buf.numel()]
        for handle in handles:
            self.wait(handle)
        for out, landed, op in lands:
            self.launch(devices.land, out, landed, op)

    def _through_host(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[Recv], border: Border
                      ) -> tuple[list[tuple[int, torch.Tensor]], list[Recv], list[tuple]]:
        """Device buffers of an exchange as the border moves them: copied down to host memory
        on the op's stream before they are sent, received into host memory (or device scratch,
        where the border moves device memory but a receive folds) and landed on the op's stream
        after; the host memory of one exchange is free again once the next one's host wait returns."""
        staged_sends = []
        for i, (peer, buf) in enumerate(sends):
            if buf.numel() and not border.device_memory(peer, self.device):
                host = self.scratch.host(("out", i), buf, self.device)
                self.launch(devices.stage_out, host, buf)
                buf = host
            staged_sends.append((peer, buf))
        staged_recvs, lands = [], []
        for i, (peer, buf, *op) in enumerate(recvs):
            as_is = not buf.numel() or border.device_memory(peer, self.device)
            if as_is and not op:
                staged_recvs.append((peer, buf))
                continue
            landing = self.scratch.get(("in", i), buf.numel(), buf) if as_is else \
                self.scratch.host(("in", i), buf, self.device)
            staged_recvs.append((peer, landing))
            lands.append((buf, landing, op[0] if op else None))
        return staged_sends, staged_recvs, lands

    def wait(self, handle: Handle) -> None:
        """Wait for one transfer before the op's deadline; a timeout names the peer waited for."""
        try:
            handle.wait(max(self.deadline - time.monotonic(), 0.0))
        except HetCCLTimeoutError as exc:
            raise HetCCLTimeoutError(str(exc), waiting_for=handle.peer) from exc


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


def pipelined(ctx: PlanContext, count: int, before: Callable[[int], None], across: Callable[[int], None],
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
    except FutureTimeout:
        raise HetCCLTimeoutError("the border stage of a pipelined piece passed the deadline") from None
    after(q)


_ISLAND_CALLS: dict[str, Callable] = {
    "allreduce": lambda island, buf, step, op: island.allreduce(buf, op),
    "reduce": lambda island, buf, step, op: island.reduce(buf, step.root, op),
    "broadcast": lambda island, buf, step, op: island.broadcast(buf, step.root),
    "reduce_scatter": lambda island, buf, step, op: island.reduce_scatter(buf, step.counts, op),
    "allgather": lambda island, buf, step, op: island.allgather(buf, step.counts),
    "gather": lambda island, buf, step, op: island.gather(buf, step.counts, step.root),
}


class _Buffers:
    """A plan's named buffers: the op's (``buf``, ``out``; an all-to-all's blocks), its scratch,
    a slot per message a rows step receives."""

    def __init__(self, ctx: PlanContext, plan: Plan, buffers: Mapping[str, torch.Tensor],
                 like: Optional[torch.Tensor]) -> None:
        self.ctx, self.like = ctx, next(iter(buffers.values())) if like is None else like
        self.held = dict(buffers)
        for name, n in plan.scratch:
            self.held[name] = ctx.scratch.get(("plan", name), n, self.like)

    def of(self, name: str, span: Span) -> torch.Tensor:
        return view(self.held[name], span)

    def ref(self, ref: Ref) -> torch.Tensor:
        return self.of(ref[0], ref[1:])

    def moved(self, moves: Sequence[Move]) -> list[tuple[int, torch.Tensor]]:
        """Each move's peer and view."""
        return [(move.peer, self.of(move.buf, move.span)) for move in moves]

    def slot(self, move: Move) -> torch.Tensor:
        """Where ``move`` lands: its slot, made now (empty: rows only)."""
        n = move.span[1]
        into = self.held[move.buf] = self.ctx.scratch.get(("plan", move.buf), n, self.like) if n else self.like[:0]
        return into


class _Run:
    """How each kind of step runs (``plans.Runs``) for one stage of one plan: the op's
    context, buffers, reduce op and agreement; ``where``: the stage, whose scratch is its own
    (stages overlap)."""

    def __init__(self, ctx: PlanContext, held: _Buffers, op: Optional[str], agreement: Optional[Agreement],
                 where: str) -> None:
        self.ctx, self.held, self.op, self.agreement, self.where = ctx, held, op, agreement, where

    def steps(self, steps: Sequence[Step | Land]) -> None:
        for step in steps:
            step.run(self)

    def island(self, step: IslandStep) -> None:
        """The island library's op (the flat library's where the planner chose it)."""
        library = self.ctx.flat if self.ctx.flat is not None else self.ctx.island
        _ISLAND_CALLS[step.op](library, self.held.of(BUF, step.span), step, self.op)

    def land(self, land: Land) -> None:
        self.ctx.launch(copy, self.held.ref(land.out), self.held.ref(land.parts[0]))

    def fold_in(self, land: FoldIn) -> None:
        out = self.held.ref(land.out)
        self.land(land)
        for part in land.parts[1:]:
            self.ctx.launch(combine, out, self.held.ref(part), self.op)

    def exchange(self, step: BorderStep) -> None:
        """Copies land in place, a peer's several small ones packed in one message each way
        (both ends see the same moves, so both decide alike)."""
        ctx, unpack, recvs = self.ctx, [], []
        for peer, views in _per_peer(step.recvs, self.held).items():
            if _packs(views):
                into = ctx.scratch.get(("packed", self.where, peer), sum(v.numel() for v in views), views[0])
                recvs.append((peer, into))
                unpack.append((into, views))
            else:
                recvs += [(peer, view) for view in views]
        ctx.exchange(self._sends(step), recvs)
        for packed, views in unpack:
            ctx.launch(_unpack, packed, views)  # after the landings, on the op's stream
        self.steps(step.lands)

    def fold(self, step: FoldStep) -> None:
        """Of the folds into one span, the first reduces as it lands and the rest land in
        scratch and are folded in after, in the step's order."""
        ctx, recvs, staged, folding = self.ctx, [], [], set()
        for move in step.recvs:
            target = self.held.of(move.buf, move.span)
            if (move.buf, move.span) not in folding:
                folding.add((move.buf, move.span))
                recvs.append((move.peer, target, self.op))
            else:
                partial = ctx.scratch.get(("fold", len(staged)), move.span[1], self.held.like)
                staged.append((target, partial))
                recvs.append((move.peer, partial))
        ctx.exchange(self._sends(step), recvs)
        for target, partial in staged:
            ctx.launch(combine, target, partial, self.op)
        self.steps(step.lands)

    def _sends(self, step: BorderStep) -> list[tuple[int, torch.Tensor]]:
        outgoing = _per_peer(step.sends, self.held)
        if any(map(_packs, outgoing.values())):
            self.ctx.host_wait()  # packing reads the buffers on the host: their producing work first
        sends: list[tuple[int, torch.Tensor]] = []
        for peer, views in outgoing.items():
            sends += [(peer, torch.cat(views))] if _packs(views) else [(peer, part) for part in views]
        return sends

    def rows(self, step: RowsStep) -> None:
        """A step of the small round: every message carries the rows over the TCP border, its
        data only while the calls may still agree (or what rides with a rows-only round);
        receives are flexible; lands while sizes agree."""
        ctx, held, agreement = self.ctx, self.held, self.agreement
        moving = agreement.moving(ctx)
        border, tag, ahead = ctx.direct, agreement.tag, agreement.ahead
        receives = [border.irecv(m.peer, held.slot(m), tag, flexible=True) for m in step.recvs]
        sends, extra = [], agreement.packed()
        for m in step.sends:
            rides = ahead.carry(m.peer) if ahead is not None else None
            data = rides if rides is not None else held.of(m.buf, m.span) if moving else held.like[:0]
            sends.append(border.isend(m.peer, data, tag, extra=extra))
            if ahead is not None:
                ahead.send(m.peer)
        for handle in sends + receives:
            ctx.wait(handle)
        if agreement.arrived(receives):
            self.steps(step.lands)

    def island_moves(self, step: IslandMoves) -> None:
        if self.ctx.my_island.size > 1:
            self.ctx.launch(_island_alltoall, self.ctx, self.held.moved(step.sends), self.held.moved(step.recvs),
                            self.held.like)


def execute(ctx: PlanContext, plan: Plan, buffers: Mapping[str, torch.Tensor], op: Optional[str] = None,
            agreement: Optional[Agreement] = None, like: Optional[torch.Tensor] = None) -> Optional[str]:
    """Run ``plan`` over its named ``buffers`` (scratch takes the dtype and device of ``like``,
    else of the first; ``op``: the reduce op of folds and island reductions). Its rows steps
    carry ``agreement``'s rows; then who disagrees is returned (None: every rank made the
    call, and the finish is written)."""
    held = _Buffers(ctx, plan, buffers, like)
    inside, across = (_Run(ctx, held, op, agreement, where) for where in ("inside", "across"))
    pieces = plan.pieces
    pipelined(ctx, len(pieces), lambda q: inside.steps(pieces[q].before),
              lambda q: across.steps(pieces[q].across), lambda q: inside.steps(pieces[q].after))
    problem = agreement.verdict(ctx) if agreement is not None else None
    if problem is None:
        inside.steps(plan.finish)
    return problem


class Agreement(Protocol):
    """What a plan's rows steps carry and learn (small_round.py's): every rank's call row."""

    tag: Tag  # the messages' tag (one whatever each rank called)
    ahead: Optional["Ahead"]  # data that rides in the messages or follows them (an all-to-all's blocks)

    def moving(self, ctx: PlanContext) -> bool:
        """Whether messages still carry data (not once a mismatch or an odd size was seen)."""

    def packed(self) -> bytes:
        """The rows known so far, as a message's control bytes."""

    def arrived(self, handles: Sequence[Handle]) -> bool:
        """Learn the rows ``handles`` brought; whether every message so far had its size."""

    def verdict(self, ctx: PlanContext) -> Optional[str]:
        """Who called what, once every row is known (None: every rank agreed)."""


class Ahead(Protocol):
    """What goes with a rows-only round's messages (collectives.SentAhead: an all-to-all's blocks)."""

    rode: dict[int, bytearray]  # by peer: the bytes that rode in its message to this rank

    def carry(self, peer: int) -> Optional[torch.Tensor]:
        """The block that rides in this rank's message to ``peer`` (None: rows only)."""

    def send(self, peer: int) -> None:
        """Right after the message to ``peer`` is posted: what follows it on that link."""


_PACK_BYTES = 256 << 10  # below this a peer's moves in a step go as one message: a message costs more than a copy


def _packs(views: Sequence[torch.Tensor]) -> bool:
    return len(views) > 1 and sum(v.numel() for v in views) * views[0].element_size() <= _PACK_BYTES


def _per_peer(moves: Sequence[Move], held: _Buffers) -> dict[int, list[torch.Tensor]]:
    """The views of ``moves`` by peer, in order."""
    grouped: dict[int, list[torch.Tensor]] = {}
    for move in moves:
        grouped.setdefault(move.peer, []).append(held.of(move.buf, move.span))
    return grouped


def _unpack(packed: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """Copy consecutive ranges of ``packed`` into ``parts``, in order."""
    offset = 0
    for part in parts:
        copy(part, packed[offset:offset + part.numel()])
        offset += part.numel()


def _island_alltoall(ctx: PlanContext, sends: Sequence[tuple[int, torch.Tensor]],
                     recvs: Sequence[tuple[int, torch.Tensor]], like: torch.Tensor) -> None:
    """A step's moves inside the island as one vendor all-to-all (every island rank calls it):
    each peer's views packed in posting order, unpacked likewise on arrival. Device work:
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
