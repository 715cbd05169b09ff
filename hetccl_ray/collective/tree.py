"""Latency plans for small messages: up to the island leaders, one exchange, back down.

Below the group's size threshold a collective costs three message hops instead of the
hierarchical plans' island and border stages: every rank sends to its island's leader
(its lowest rank), the leaders exchange once over the border, the leaders send results
back. Each message also carries the callers' call rows (op, seq, dtype, count, root,
reduce op) as control bytes, so when the round ends every rank knows what every rank
called: the call check costs no round of its own, and a mismatch is found on every rank
before any user buffer is written. Large ops run the same round with no data as their
check. Receives are flexible: a peer that called something else (another size) is
reported, never a hang or a wrong result.

Border bytes (across islands, all ranks together; S = the buffer, k islands):
allgather (k-1)S, reducescatter (k-1)S, broadcast (k-1)S, reduce (k-1)S, allreduce
k(k-1)S (the hierarchical bound 2(k-1)S for two islands; more for k > 2, where the
size threshold weighs the extra bytes against the saved hops). Plans import no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from hetccl_ray.collective import routes
from hetccl_ray.collective.calls import OP_CODES, ROW_WIDTH, Call, disagreement, on_host
from hetccl_ray.collective.tensors import dtype_code
from hetccl_ray.buffers import combine, copy, view
from hetccl_ray.errors import HetCCLMismatchError
from hetccl_ray.transport.base import Tag

Rows = dict[int, list[int]]


def _pack(rows: Rows) -> bytes:
    """Rows as int64s: rank, length, the row (a call's ROW_WIDTH ints, then any extra ints)."""
    return np.asarray([v for rank, row in sorted(rows.items()) for v in (rank, len(row), *row)],
                      dtype=np.int64).tobytes()


def _unpack(raw: bytes) -> Rows:
    flat, rows, at = np.frombuffer(raw, dtype=np.int64).tolist(), {}, 0
    while at < len(flat):
        rank, length = flat[at], flat[at + 1]
        rows[rank] = flat[at + 2:at + 2 + length]
        at += 2 + length
    return rows


@dataclass
class Shape:
    """What one op moves in each phase, as element counts and hooks over this rank's buffers.

    ``up(rank)``: the tensor a member sends its leader (or the count a leader expects from
    it); ``across(i, j)``: what leader of island i sends leader of island j; ``down(rank)``:
    what a leader sends member ``rank``. ``land_*`` consume what arrived, in a fixed order.
    """

    up: Callable[[int], int]
    across: Callable[[int, int], int]
    down: Callable[[int], int]
    send_up: Callable[[], torch.Tensor]
    land_up: Callable[[list[tuple[int, torch.Tensor]]], None]
    send_across: Callable[[int], torch.Tensor]
    land_across: Callable[[list[tuple[int, torch.Tensor]]], None]
    send_down: Callable[[int], torch.Tensor]
    land_down: Callable[[torch.Tensor], None]
    finish: Callable[[], None] = field(default=lambda: None)


def _none(_: object = None, __: object = None) -> int:
    return 0


def linked(topo, rank: int) -> list[int]:
    """The peers ``rank`` sends a message of the round to: its leader, or a leader's members
    and the other leaders."""
    leader = topo.island_of(rank).ranks[0]
    if rank != leader:
        return [leader]
    return list(topo.island_of(rank).ranks[1:]) + [island.ranks[0] for island in topo.islands
                                                   if island.ranks[0] != rank]


def round_trip(ctx, call: Call, like: Optional[torch.Tensor], shape: Optional[Shape],
               rows: Optional[Rows] = None, then: Optional[Callable[[int], None]] = None) -> Optional[str]:
    """Run the three phases; None when every rank made ``call`` (then ``shape.finish`` has
    written the results), else who called what (and no user buffer was touched; what peers
    sent ahead is drained). ``rows``: this rank's row with extra ints after the call's,
    filled with every rank's as they arrive. ``then(peer)`` runs right after this rank's
    message to each :func:`linked` peer is posted (what follows it on that link)."""
    topo, isl, rank = ctx.topo, ctx.my_island, ctx.rank
    leader = isl.ranks[0]
    leaders = [island.ranks[0] for island in topo.islands]
    border, tag = ctx.direct, Tag(OP_CODES["check"], call.seq, 0)  # one tag whatever each rank called
    like = torch.empty(0, dtype=torch.uint8) if like is None else like
    empty = like[:0]
    up, across, down = (shape.up, shape.across, shape.down) if shape else (_none, _none, _none)
    rows = rows if rows is not None else {rank: call.encode()}
    spilled = False

    def wait(handles) -> None:
        nonlocal spilled
        for handle in handles:
            ctx.wait(handle)
            if handle.kind == "recv":
                rows.update(_unpack(handle.extra))
                spilled |= handle.spill is not None

    def receive(peer: int, n: int, slot: str) -> tuple:
        buf = ctx.scratch.get((slot, peer), n, like) if n else empty
        return buf, border.irecv(peer, buf, tag, flexible=True)

    def send(peer: int, buf: Optional[torch.Tensor], extra: Rows):
        handle = border.isend(peer, buf if buf is not None else empty, tag, extra=_pack(extra))
        if then is not None:
            then(peer)
        return handle

    if rank != leader:
        wait([send(leader, shape.send_up() if up(rank) else None, rows)])
        buf, handle = receive(leader, down(rank), "down")
        wait([handle])
        problem = _verdict(ctx, rows, spilled)
        if problem is None and shape:
            shape.land_down(buf)
            shape.finish()
        return problem
    members = [r for r in isl.ranks if r != leader]
    ups = [receive(m, up(m), "up") for m in members]
    wait([handle for _, handle in ups])
    if shape and not spilled:
        shape.land_up(list(zip(members, [buf for buf, _ in ups])))
    me = isl.index
    others = [j for j in range(len(leaders)) if j != me]
    island_rows = dict(rows)
    acrosses = [receive(leaders[j], across(j, me), "across") for j in others]
    sends = [send(leaders[j], shape.send_across(j) if across(me, j) and not spilled else None, island_rows)
             for j in others]
    wait(sends + [handle for _, handle in acrosses])
    if shape and not spilled:
        shape.land_across(list(zip(others, [buf for buf, _ in acrosses])))
    problem = _verdict(ctx, rows, spilled)
    agreed = problem is None and shape is not None
    wait([send(m, shape.send_down(m) if agreed and down(m) else None, rows) for m in members])
    if agreed:
        shape.finish()
    return problem


def _verdict(ctx, rows: Rows, spilled: bool) -> Optional[str]:
    """Who called what when the ranks disagree (after draining what they sent ahead); a size
    that differs although the calls agree would be a bug in the plans, so it is an error too."""
    topo = ctx.topo
    ctx.rows = rows
    problem = disagreement([Call.decode(rows[r][:ROW_WIDTH]) for r in range(topo.world_size)],
                           [island.ranks for island in topo.islands])
    if problem is None and spilled:
        raise HetCCLMismatchError("a message had another size than the agreed call implies")
    if problem is not None:
        drain(ctx, rows)
    return problem


def sent_ahead(row: list[int], to: int) -> int:
    """Elements a rank with ``row`` sent ``to`` ahead of the round: an all-to-all's block from
    host memory goes straight to its destination while the round runs (plans.alltoall)."""
    if Call.decode(row[:ROW_WIDTH]).op != "alltoall" or not on_host(row) or len(row) <= ROW_WIDTH + to:
        return 0
    return row[ROW_WIDTH + to]


def drain(ctx, rows: Rows) -> None:
    """Receive and drop what peers sent this rank ahead of a round that found a mismatch
    (their rows say what), so that the next op finds each link at its own messages."""
    handles = []
    for peer, row in sorted(rows.items()):
        count = sent_ahead(row, ctx.rank) if peer != ctx.rank else 0
        if count:
            call = Call.decode(row[:ROW_WIDTH])
            into = ctx.scratch.get(("drain", peer), count, torch.empty(0, dtype=call.dtype))  # frames decode by dtype
            handles.append(ctx.direct.irecv(peer, into, Tag(OP_CODES["alltoall"], call.seq, dtype_code(call.dtype))))
    for handle in handles:
        ctx.wait(handle)


# -- the ops --------------------------------------------------------------------------------------

def _fold(out: torch.Tensor, parts: list[torch.Tensor], op: str) -> None:
    """out = parts[0] op parts[1] op ..., in the order given: every rank folds alike."""
    copy(out, parts[0])
    for part in parts[1:]:
        combine(out, part, op)


def _by_island(got: list[tuple[int, torch.Tensor]], index: int, own: torch.Tensor) -> list[torch.Tensor]:
    """What arrived from the other leaders and this island's own part, in island order."""
    parts = dict(got)
    parts[index] = own
    return [parts[j] for j in sorted(parts)]


def _island_partial(ctx, buf: torch.Tensor, op: str) -> tuple[torch.Tensor, torch.Tensor, Callable]:
    """Scratch for the island's partial and the total, and the leader's hook that folds its
    own buffer with its members' (in local rank order) into the partial."""
    partial = ctx.scratch.get("tree-partial", buf.numel(), buf)
    total = ctx.scratch.get("tree-total", buf.numel(), buf)
    return partial, total, lambda got: _fold(partial, [buf] + [part for _, part in got], op)


def allreduce(ctx, call: Call, buf: torch.Tensor, op: str) -> Optional[str]:
    """Members send to the leader, leaders swap island partials, leaders send the total down."""
    n = buf.numel()
    partial, total, land_up = _island_partial(ctx, buf, op)
    state = {}

    def land_across(got):
        _fold(total, _by_island(got, ctx.my_island.index, partial), op)

    def land_down(got):
        state["result"] = got

    def finish():
        copy(buf, state.get("result", total))

    shape = Shape(lambda r: n, lambda i, j: n, lambda r: n, lambda: buf, land_up, lambda j: partial,
                  land_across, lambda r: total, land_down, finish)
    return round_trip(ctx, call, buf, shape)


def reduce(ctx, call: Call, buf: torch.Tensor, root: int, op: str) -> Optional[str]:
    """Like allreduce, but partials go only to the root island's leader, the total only to root."""
    topo = ctx.topo
    n, home = buf.numel(), topo.island_of(root).index
    partial, total, land_up = _island_partial(ctx, buf, op)
    state = {}

    def land_across(got):
        if ctx.my_island.index == home:
            _fold(total, _by_island(got, home, partial), op)
            state["result"] = total

    def finish():
        if ctx.rank == root:
            copy(buf, state["result"])

    shape = Shape(lambda r: n, lambda i, j: n if j == home else 0, lambda r: n if r == root else 0, lambda: buf,
                  land_up, lambda j: partial, land_across, lambda r: total, lambda got: state.update(result=got),
                  finish)
    return round_trip(ctx, call, buf, shape)


def broadcast(ctx, call: Call, buf: torch.Tensor, root: int) -> Optional[str]:
    """Root to its leader, that leader to the others, each leader to its members."""
    topo = ctx.topo
    n, home = buf.numel(), topo.island_of(root).index
    held = ctx.scratch.get("tree-total", n, buf)
    state = {}

    def land_up(got):
        copy(held, dict(got).get(root, buf))

    def land_across(got):
        if ctx.my_island.index != home:
            copy(held, dict(got)[home])

    def finish():
        if ctx.rank != root:
            copy(buf, state.get("result", held))

    shape = Shape(lambda r: n if r == root else 0, lambda i, j: n if i == home else 0, lambda r: n, lambda: buf,
                  land_up, lambda j: held, land_across, lambda r: held, lambda got: state.update(result=got), finish)
    return round_trip(ctx, call, buf, shape)


def allgather(ctx, call: Call, buf: torch.Tensor) -> Optional[str]:
    """The island-major ``buf`` (own chunk filled in): chunks up, island regions across, all down."""
    topo = ctx.topo
    order = topo.island_major_order()
    chunk = buf.numel() // topo.world_size
    slot = {rank: order.index(rank) for rank in range(topo.world_size)}
    regions = topo.regions(chunk)
    out = ctx.scratch.get("tree-total", buf.numel(), buf)
    state = {}

    def region(j: int) -> torch.Tensor:
        return view(out, regions[j])

    def land_up(got):
        copy(out, buf)
        for rank, part in got:
            copy(out[slot[rank] * chunk:(slot[rank] + 1) * chunk], part)

    def land_across(got):
        for j, part in got:
            copy(region(j), part)

    shape = Shape(lambda r: chunk, lambda i, j: regions[i][1], lambda r: buf.numel(),
                  lambda: buf[slot[ctx.rank] * chunk:(slot[ctx.rank] + 1) * chunk], land_up,
                  lambda j: region(ctx.my_island.index), land_across, lambda r: out,
                  lambda got: state.update(result=got), lambda: copy(buf, state.get("result", out)))
    return round_trip(ctx, call, buf, shape)


def reducescatter(ctx, call: Call, buf: torch.Tensor, out: torch.Tensor, op: str) -> Optional[str]:
    """The island-major ``buf`` of one chunk per rank: whole buffers up, each island's region
    of the partials to that island's leader, each member's chunk down into ``out``."""
    topo = ctx.topo
    order = topo.island_major_order()
    chunk = out.numel()
    slot = {rank: order.index(rank) for rank in range(topo.world_size)}
    regions = topo.regions(chunk)
    partial = ctx.scratch.get("tree-partial", buf.numel(), buf)
    total = ctx.scratch.get("tree-total", regions[ctx.my_island.index][1], buf)
    state = {}

    def region(j: int) -> torch.Tensor:
        return view(partial, regions[j])

    def land_up(got):
        _fold(partial, [buf] + [part for _, part in got], op)

    def land_across(got):
        _fold(total, _by_island(got, ctx.my_island.index, region(ctx.my_island.index)), op)

    def down(rank: int) -> torch.Tensor:
        at = (slot[rank] - slot[ctx.rank]) * chunk
        return total[at:at + chunk]

    shape = Shape(lambda r: buf.numel(), lambda i, j: regions[j][1], lambda r: chunk, lambda: buf, land_up, region,
                  land_across, down, lambda got: state.update(result=got),
                  lambda: copy(out, state["result"] if "result" in state else down(ctx.rank)))
    return round_trip(ctx, call, buf, shape)


def check(ctx, call: Call) -> Optional[str]:
    """The round with no data: every rank learns every call (and it is a barrier)."""
    return round_trip(ctx, call, None, None)


def alltoall_counts(ctx, call: Call, mine: list[int],
                    then: Optional[Callable[[int], None]] = None) -> tuple[Optional[str], list[list[int]]]:
    """The all-to-all's check: the rows-only round with every rank's block sizes after its call
    row (``mine``: what it sends each rank, then what it expects from each), so they cost no
    payload. Returns who disagrees (calls, or pairs whose sizes differ) and ``counts[r][t]``;
    ``then``: as :func:`round_trip`'s."""
    world = ctx.topo.world_size
    rows = {ctx.rank: call.encode() + list(mine)}
    problem = round_trip(ctx, call, None, None, rows, then)
    if problem is not None:
        return problem, []
    extra = {rank: row[ROW_WIDTH:] for rank, row in rows.items()}
    counts = [extra[r][:world] for r in range(world)]
    problem = routes.mismatched(counts, [extra[t][world:] for t in range(world)])
    if problem is not None:
        drain(ctx, rows)
    return problem, counts
