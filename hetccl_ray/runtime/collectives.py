"""Hierarchical collective plans: each op's plan (plans.py) run by the one runner.

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

from hetccl_ray.core import opkinds, routes, plans
from hetccl_ray.runtime import small_round
from hetccl_ray.memory import devices
from hetccl_ray.memory.buffers import copy, view
from hetccl_ray.core.planner import ISLAND, PULL, SOCKET, AllToAll
from hetccl_ray.islands.libraries import IslandComm
from hetccl_ray.runtime.runner import PlanContext, execute
from hetccl_ray.core.plans import BUF
from hetccl_ray.transport.base import Handle, mismatch


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


def plan_for(ctx: PlanContext, op: str, buf: torch.Tensor, root: int = 0) -> plans.Plan:
    """This rank's (cached) plan of ``op`` over ``buf``, in the context's pieces; the flat
    plan (one island of every rank, in island-major order) where the planner chose it."""
    if ctx.flat is not None:
        return plans.flat(ctx.topo, ctx.rank, op, buf.numel(), root)
    largest = opkinds.largest_region(ctx.topo, op, buf.numel()) * buf.element_size()
    return plans.build(ctx.topo, ctx.rank, op, buf.numel(), root, ctx.pieces(largest))


def collective(ctx: PlanContext, op: str, buf: torch.Tensor, root: int = 0, reduce: str = "",
               out: Optional[torch.Tensor] = None) -> None:
    """``op``'s plan over ``buf`` (allgather, reducescatter: the island-major buffer of one chunk
    per rank, this rank's filled in for allgather), folding with ``reduce``; a reducescatter
    copies this rank's reduced chunk into ``out``."""
    plan = plan_for(ctx, op, buf, root)
    execute(ctx, plan, {BUF: buf}, reduce or None)
    if out is not None and plan.result is not None:
        ctx.launch(copy, out, view(buf, plan.result))


def two_hop_broadcast(ctx: PlanContext, buf: torch.Tensor, root: int) -> None:
    """A small broadcast whose call every rank knows (calls not checked): root to its island and
    the other leaders, leaders to their islands."""
    execute(ctx, plans.two_hop_broadcast(ctx.topo, ctx.rank, buf.numel(), root), {BUF: buf})


class SentAhead:
    """An all-to-all's blocks from host memory, sent straight to their destinations while the
    check round runs (small_round.py): to a peer the round links this rank with in the round's own
    message where the block is small (one message, not two), else right after it (each link
    delivers in order); to the others before the round. Every receiver knows from the rows
    what came ahead: it lands after the verdict, or is drained; what rode came in ``rode``."""

    def __init__(self, ctx: PlanContext, inputs: Sequence[torch.Tensor]) -> None:
        self.ctx, self.inputs, self.handles = ctx, inputs, []
        self.rode: dict[int, bytearray] = {}
        linked = small_round.linked(ctx.topo, ctx.rank, ctx.one_hop)
        for peer in range(ctx.topo.world_size):
            if peer not in linked:
                self.send(peer)

    def _block(self, peer: int) -> Optional[torch.Tensor]:
        """The block for ``peer`` that goes ahead (none from device memory, to itself, or empty)."""
        block = self.inputs[peer]
        return block if self.ctx.host_path and peer != self.ctx.rank and block.numel() else None

    def carry(self, peer: int) -> Optional[torch.Tensor]:
        """The block for ``peer`` where it rides in the round's message to it (small_round.rides)."""
        block = self._block(peer)
        if block is None or not small_round.rides(self.ctx, peer, block.nbytes):
            return None
        return block.view(torch.uint8)  # as bytes: the check's receive is bytes, never decoded

    def send(self, peer: int) -> None:
        """Post the block for ``peer``, unless it rode in the round's message."""
        block = self._block(peer)
        if block is not None and not small_round.rides(self.ctx, peer, block.nbytes):
            self.handles.append(self.ctx.direct.isend(peer, block, self.ctx.tag))

    def wait(self) -> None:
        for handle in self.handles:
            self.ctx.wait(handle)


def alltoall(ctx: PlanContext, how: AllToAll, counts: Sequence[Sequence[int]], inputs: Sequence[torch.Tensor],
             outputs: Sequence[torch.Tensor], ahead: Optional[SentAhead] = None) -> None:
    """Send ``inputs[t]`` to rank t and receive ``outputs[r]`` from rank r (``counts[r][t]``
    elements, agreed by every rank). Blocks from host memory go straight, one hop (``ahead``:
    already sent during the check; else sent now), each cross-island byte once; the rows say
    which ranks' are (``how``, the planner's). Blocks from device memory go along routes.py's
    routes: gathered inside the island by destination lane (one vendor all-to-all per stage),
    across once per island pair and lane, scattered inside; in pieces whose border stage
    overlaps the island stages."""
    me = ctx.rank
    if how.shared:
        order = ctx.topo.island_major_order
        ctx.shared.alltoall([outputs[r] for r in order], [inputs[t] for t in order],
                            [[counts[r][t] for t in order] for r in order])
        return
    ctx.launch(copy, outputs[me], inputs[me])
    host = how.straight
    straight = [(t, inputs[t]) for t in range(ctx.topo.world_size) if t != me] if me in host and ahead is None else []
    rode = {r for r in host - {me} if small_round.rides(ctx, r, outputs[r].nbytes)} if ahead is not None else set()
    for peer in rode:  # it came in the check's message
        raw = ahead.rode.get(peer, bytearray())
        if len(raw) != outputs[peer].nbytes:
            raise mismatch(me, ctx.tag, outputs[peer].nbytes, peer, ctx.tag, len(raw))
        copy(outputs[peer], torch.frombuffer(raw, dtype=outputs[peer].dtype))
    ctx.exchange(straight, [(r, outputs[r]) for r in sorted(host - {me} - rode)], border=ctx.direct)
    if ahead is not None:
        ahead.wait()
    rest = [[0] * len(row) if r in host else list(row) for r, row in enumerate(counts)]
    if any(map(any, rest)):
        _routed(ctx, rest, inputs, outputs, how.by_island)


def _routed(ctx: PlanContext, counts: Sequence[Sequence[int]], inputs: Sequence[torch.Tensor],
            outputs: Sequence[torch.Tensor], by_island: bool) -> None:
    """The blocks of ``counts`` along routes.py's routes, as its plan. Moves inside an island
    go as one vendor all-to-all per stage (``by_island``) or over the border's socket."""
    me, world = ctx.rank, ctx.topo.world_size
    count = ctx.pieces(routes.largest_crossing(ctx.topo, counts) * inputs[me].element_size())
    plan = routes.plan(ctx.topo, me, tuple(map(tuple, counts)), count, by_island)
    named = {**{f"in:{t}": inputs[t] for t in range(world)}, **{f"out:{r}": outputs[r] for r in range(world)}}
    execute(ctx, plan, named, like=inputs[me])


_PULL = b"pull"  # a message's control bytes: its payload is where the sender's bytes lie, to be pulled


def spilled(handle: Handle, buf: torch.Tensor) -> Optional[tuple[Optional[int], int]]:
    """What a flexible receive into ``buf`` got: None for the bytes themselves; else where a
    message offered to pull lies (its 16 B in the spill, or in ``buf`` had it that size) and
    its size, or None and the size of bytes of another size (in the spill)."""
    if handle.extra == _PULL:
        raw = handle.spill if handle.spill is not None else bytearray(buf.view(torch.uint8).numpy().tobytes())
        address, nbytes = torch.frombuffer(raw, dtype=torch.int64).tolist()
        return address, nbytes
    return None if handle.spill is None else (None, len(handle.spill))


def send(ctx: PlanContext, buf: torch.Tensor, peer: int) -> None:
    """Along the planner's route (``ctx.route``): vendor P2P inside an island; on one host a
    large CPU message pulled by its receiver (the sender sends where its bytes lie, then waits
    until they are read: one copy, not two through a socket); the border otherwise."""
    if ctx.route == ISLAND:
        ctx.island.send(buf, ctx.topo.local_rank(peer))
    elif ctx.route == PULL:
        where = torch.tensor([buf.data_ptr(), buf.nbytes], dtype=torch.int64)
        ctx.wait(ctx.direct.isend(peer, where, ctx.tag, extra=_PULL))
        ctx.shared.wait_pulled(peer)
    else:
        ctx.exchange(sends=[(peer, buf)], recvs=[])


def recv(ctx: PlanContext, buf: torch.Tensor, peer: int) -> None:
    """Counterpart of :func:`send`: on one host the sender decides (its buffer may be on a
    device), so a receive over the socket takes the bytes or where they lie, and names a size
    mismatch."""
    if ctx.route == ISLAND:
        ctx.island.recv(buf, ctx.topo.local_rank(peer))
    elif ctx.route in (PULL, SOCKET):
        ctx.host_wait()
        into = buf if ctx.device.host else ctx.scratch.host("message", buf, ctx.device)  # the socket's: host memory
        handle = ctx.direct.irecv(peer, into, ctx.tag, flexible=True)
        ctx.wait(handle)
        landed = spilled(handle, into)
        if landed is not None:
            address, nbytes = landed
            if address is None or nbytes != buf.nbytes:
                raise mismatch(ctx.rank, ctx.tag, buf.nbytes, peer, ctx.tag, nbytes)
            ctx.shared.pull_message(peer, into, address)
        if into is not buf:
            ctx.launch(devices.land, buf, into, None)
    else:
        ctx.exchange(sends=[], recvs=[(peer, buf)])
