"""The small-message round, run: three hops up to the island leaders, across, back down (or
one hop, every rank to every rank, in a group that takes it: rounds.py).

Each op's round is a plan (rounds.py) run by the one runner (``runner.execute``), with an
``Agreement``: the rows its messages carry and the verdict. Every message also
carries the callers' call rows (op, seq, dtype, count, root, reduce op, device class) as
control bytes, so when the round ends every rank knows what every rank called: the call
check costs no round of its own, and a mismatch is found on every rank before any user
buffer is written. Large ops run the rows-only round (``check``) as their check. Every op's
round has the same messages (one tag whatever each rank called) and receives are flexible:
a peer that called something else (another size) is reported, never a hang or a wrong
result. Plans import no Ray.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch

from hetccl_ray.core import rounds, routes
from hetccl_ray.core.calls import OP_CODES, ROW_WIDTH, Call, disagreement
from hetccl_ray.core.planner import Planner
from hetccl_ray.runtime.runner import Ahead, execute
from hetccl_ray.core.plans import BUF
from hetccl_ray.errors import HetCCLMismatchError
from hetccl_ray.transport.base import Tag

Rows = dict[int, list[int]]
RIDE_BYTES = 64 << 10  # an all-to-all block up to this rides in the check's message to a linked peer
_NO_DATA = torch.empty(0, dtype=torch.uint8)  # the op buffer of a rows-only round


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


@functools.lru_cache(maxsize=512)
def linked(topo, rank: int, one_hop: bool = False) -> frozenset[int]:
    """The peers ``rank`` sends a message of the round to: its leader, or a leader's members
    and the other leaders (every rank, in one hop). Cached: every all-to-all asks per peer."""
    return frozenset(m.peer for step in rounds.build(topo, rank, "check", one_hop=one_hop).pieces[0].across
                     for m in step.sends)


class Agreement:
    """What the round's messages carry and learn (runner.Agreement): every rank's call row
    (this rank's with extra ints after the call's, filled with every rank's as they arrive),
    whether a message had another size than the call implies, and the verdict."""

    def __init__(self, ctx, call: Call, rows: Optional[Rows] = None, ahead: Optional[Ahead] = None) -> None:
        self.tag = Tag(OP_CODES["check"], call.seq, 0)  # one tag whatever each rank called
        self.rows = rows if rows is not None else {ctx.rank: call.encode()}
        self.ahead, self.spilled, self.decided, self.problem = ahead, False, False, None

    def moving(self, ctx) -> bool:
        if len(self.rows) == ctx.topo.world_size:  # every row known: decide now, before data moves
            self.verdict(ctx)
        return not self.spilled and self.problem is None

    def packed(self) -> bytes:
        return _pack(self.rows)

    def arrived(self, handles) -> bool:
        for handle in handles:
            self.rows.update(_unpack(handle.extra))
            if handle.spill is not None and self.ahead is not None:  # a rows-only round: what rode
                self.ahead.rode[handle.peer] = handle.spill
            else:
                self.spilled |= handle.spill is not None
        return not self.spilled

    def verdict(self, ctx) -> Optional[str]:
        if not self.decided:
            self.problem, self.decided = _verdict(ctx, self.rows, self.spilled), True
        return self.problem


def _verdict(ctx, rows: Rows, spilled: bool = False) -> Optional[str]:
    """Who called what when the ranks disagree (after draining what they sent ahead over the
    border); a size that differs although the calls agree would be a bug in the plans, so it
    is an error too."""
    topo = ctx.topo
    ctx.rows = rows
    first = rows[ctx.rank]
    if not spilled and all(row == first for row in rows.values()):  # the common case, told cheaply
        return None
    problem = disagreement([Call.decode(rows[r][:ROW_WIDTH]) for r in range(topo.world_size)],
                           [island.ranks for island in topo.islands])
    if problem is None and spilled:
        raise HetCCLMismatchError("a message had another size than the agreed call implies")
    if problem is not None and ctx.shared is None:
        drain(ctx, rows)
    return problem


def rides(ctx, peer: int, nbytes: int) -> bool:
    """Whether an all-to-all block of ``nbytes`` sent ahead between this rank and ``peer``
    rides in the check's message between them (a rule both ends apply): a small one to a
    rank the check links this one with."""
    return 0 < nbytes <= RIDE_BYTES and peer in linked(ctx.topo, ctx.rank, ctx.one_hop)


def sent_ahead(call: Call, row: list[int], to: int) -> int:
    """Elements the rank that made ``call`` (its ``row``) sent ``to`` ahead of the round: an
    all-to-all's block from host memory goes straight to its destination while the round
    runs (plans.alltoall)."""
    if call.op != "alltoall" or not Planner.goes_straight(row) or len(row) <= ROW_WIDTH + to:
        return 0
    return row[ROW_WIDTH + to]


def drain(ctx, rows: Rows) -> None:
    """Receive and drop what peers sent this rank ahead of a round that found a mismatch
    (their rows say what; a block that rode came with the round), so that the next op finds
    each link at its own messages."""
    handles = []
    for peer, row in sorted(rows.items()):
        call = Call.decode(row[:ROW_WIDTH])
        count = sent_ahead(call, row, ctx.rank) if peer != ctx.rank else 0
        if count and not rides(ctx, peer, count * call.dtype.itemsize):
            into = ctx.scratch.get(("drain", peer), count, torch.empty(0, dtype=call.dtype))  # frames decode by dtype
            handles.append(ctx.direct.irecv(peer, into, call.tag()))
    for handle in handles:
        ctx.wait(handle)


def small(ctx, call: Call, buf: torch.Tensor, out: Optional[torch.Tensor] = None) -> Optional[str]:
    """``call``'s op as its round over ``buf`` (and reducescatter's ``out``). None when every
    rank made ``call`` (then the results are written), else who called what (no user buffer
    touched; what peers sent ahead drained)."""
    plan = rounds.build(ctx.topo, ctx.rank, call.op, buf.numel(), call.root, ctx.one_hop)
    return execute(ctx, plan, {BUF: buf} if out is None else {BUF: buf, "out": out}, call.reduce,
                   Agreement(ctx, call))


def check(ctx, call: Call, rows: Optional[Rows] = None, ahead: Optional[Ahead] = None) -> Optional[str]:
    """The round with no data: every rank learns every call (and it is a barrier). On one
    host it is a step of the shared-memory library. ``rows``: this rank's row with extra ints
    after the call's, filled with every rank's; ``ahead``: what rides in this rank's message
    to each peer or follows it on that link, and what rode in to this rank."""
    rows = rows if rows is not None else {ctx.rank: call.encode()}
    if ctx.shared is None:
        plan = rounds.build(ctx.topo, ctx.rank, "check", one_hop=ctx.one_hop)
        return execute(ctx, plan, {BUF: _NO_DATA}, agreement=Agreement(ctx, call, rows, ahead))
    rows.update(ctx.shared.rows(rows[ctx.rank]))
    return _verdict(ctx, rows)


def alltoall_counts(ctx, call: Call, mine: list[int],
                    ahead: Optional[Ahead] = None) -> tuple[Optional[str], list[list[int]]]:
    """The all-to-all's check: the rows-only round with every rank's block sizes after its call
    row (``mine``: what it sends each rank, then what it expects from each), so they cost no
    payload. Returns who disagrees (calls, or pairs whose sizes differ) and ``counts[r][t]``;
    ``ahead``: as :func:`check`'s."""
    world = ctx.topo.world_size
    rows = {ctx.rank: call.encode() + list(mine)}
    problem = check(ctx, call, rows, ahead)
    if problem is not None:
        return problem, []
    extra = {rank: row[ROW_WIDTH:] for rank, row in rows.items()}
    counts = [extra[r][:world] for r in range(world)]
    problem = routes.mismatched(counts, [extra[t][world:] for t in range(world)])
    if problem is not None and ctx.shared is None:
        drain(ctx, rows)
    return problem, counts
