"""Boundary communicators: one module's activations put in the next module's layout, their
gradients brought back (after Megatron-LM's MIMO bridge communicators, arXiv 2605.27678).

A :class:`Layout` says where a module's tensor lives: its ranks, split into ``dp``
data-parallel groups of consecutive ranks; group g holds batch chunk g (dim 0), on each
member whole (``replicated``) or cut along the sequence dimension (``sequence``, context
parallel; destinations only). Source and destination degrees must divide one another:
fan-in (several source chunks make one destination chunk, concatenated in order), fan-out
(a source chunk is cut into parts along dim 0) or equal. Colocated modules use the same
ranks; non-colocated ones disjoint ranks (typically on different islands).

Routes are data (:func:`routes`, pure): every hop of the forward pass as (source rank,
destination rank, what). A piece crosses into each destination island once: a replicated
destination takes it at one landing rank per island, which hands it on inside the island;
the backward pass sums those members' gradients at the landing and sends the sum back
once. Messages go over the group's direct-transfer channel (``transport/direct.py``),
shapes as control bytes ahead of the data, so shapes may change every step with no extra
round; sends leave on a thread of the bridge so a source computes its next microbatch while
its last one crosses.
"""

from __future__ import annotations

import collections
import hashlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from hetccl_ray.memory import devices
from hetccl_ray.errors import HetCCLError, HetCCLInputError

REPLICATED, SEQUENCE = "replicated", "sequence"
# a message's number: bridge key << 46 | call << 18 | hop << 1 | backward
_KEY_SHIFT, _CALL_SHIFT, _CALL_MASK = 46, 18, 0xFFFFFFF


@dataclass(frozen=True)
class Layout:
    """A module's tensor: ``ranks`` (group ranks) in data-parallel order, ``dp`` groups of
    ``len(ranks) // dp`` consecutive ranks (0: every rank its own chunk), each group's chunk
    whole on every member or cut along ``seq_dim`` among them."""

    ranks: tuple[int, ...]
    dp: int = 0
    split: str = REPLICATED
    seq_dim: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(self.ranks))
        object.__setattr__(self, "dp", self.dp or len(self.ranks))
        if not self.ranks or len(set(self.ranks)) != len(self.ranks):
            raise HetCCLInputError(f"bridge layout {self.ranks}: give each rank once, at least one")
        if len(self.ranks) % self.dp:
            raise HetCCLInputError(f"bridge layout of {len(self.ranks)} ranks cannot make {self.dp} equal "
                                   "data-parallel groups")
        if self.split not in (REPLICATED, SEQUENCE):
            raise HetCCLInputError(f"bridge layout split {self.split!r}: use 'replicated' or 'sequence'")

    @property
    def members(self) -> int:
        return len(self.ranks) // self.dp

    def group(self, g: int) -> tuple[int, ...]:
        return self.ranks[g * self.members:(g + 1) * self.members]

    def place(self, rank: int) -> Optional[tuple[int, int]]:
        """(data-parallel group, member) of ``rank``, None if it holds no part."""
        if rank not in self.ranks:
            return None
        return divmod(self.ranks.index(rank), self.members)


@dataclass(frozen=True)
class Item:
    """What one destination member takes of one piece: piece ``piece`` (source group
    ``source``, part ``part`` of ``parts`` along dim 0), whole or its sequence chunk ``chunk``
    of ``chunks``."""

    piece: int
    source: int
    part: int
    parts: int
    chunk: int
    chunks: int


@dataclass(frozen=True)
class Hop:
    """One forward message: ``item`` from ``src`` to ``dst`` (the backward pass runs it
    back, summing where it fanned out). ``index`` numbers it within a call."""

    index: int
    src: int
    dst: int
    item: Item


@dataclass(frozen=True)
class Routes:
    """Every rank's part of one bridge: the items each destination rank assembles (in order),
    the forward hops, and the source-side copies of the gradient to replicated members."""

    items: dict[int, tuple[Item, ...]]
    hops: tuple[Hop, ...]
    providers: dict[int, int]  # source group -> the member that sends its chunk


def routes(src: Layout, dst: Layout, island_of: Sequence[str]) -> Routes:
    """The hops of a bridge from ``src`` to ``dst`` for ranks in islands ``island_of`` (pure)."""
    _check(src, dst, len(island_of))
    fan_in = max(src.dp // dst.dp, 1)
    fan_out = max(dst.dp // src.dp, 1)
    providers = {g: src.group(g)[0] for g in range(src.dp)}
    items: dict[int, list[Item]] = {r: [] for r in dst.ranks}
    hops: list[Hop] = []
    for h in range(dst.dp):
        members = dst.group(h)
        sources = range(h * fan_in, (h + 1) * fan_in) if fan_in > 1 else [h // fan_out]
        for piece, g in enumerate(sources):
            part = h % fan_out if fan_out > 1 else 0
            provider = providers[g]
            if dst.split == SEQUENCE:
                for c, rank in enumerate(members):
                    item = Item(piece, g, part, fan_out, c, len(members))
                    items[rank].append(item)
                    if rank != provider:
                        hops.append(Hop(len(hops), provider, rank, item))
                continue
            item = Item(piece, g, part, fan_out, 0, 1)
            for rank in members:
                items[rank].append(item)
            for island in dict.fromkeys(island_of[r] for r in members):
                here = [r for r in members if island_of[r] == island]
                landing = provider if provider in here else here[0]
                if landing != provider:
                    hops.append(Hop(len(hops), provider, landing, item))
                hops += [Hop(len(hops) + i, landing, r, item) for i, r in enumerate(x for x in here if x != landing)]
    return Routes({r: tuple(v) for r, v in items.items()}, tuple(hops), providers)


def rows_held(items: Sequence[Item], counts: Sequence[int]) -> list[int]:
    """The rows of the global batch (source chunks concatenated in group order) that a
    destination rank holding ``items`` has, given each source group's row count: where its
    labels come from."""
    starts = [sum(counts[:g]) for g in range(len(counts))]
    held: list[int] = []
    for item in items:
        rows = torch.arange(starts[item.source], starts[item.source] + counts[item.source])
        held += torch.tensor_split(rows, item.parts)[item.part].tolist()
    return held


def _check(src: Layout, dst: Layout, world: int) -> None:
    """Refuse what no route can serve, before any data moves."""
    if src.split != REPLICATED:
        raise HetCCLInputError("bridge: the source layout holds whole chunks (a sequence split is for destinations)")
    outside = sorted(r for r in (*src.ranks, *dst.ranks) if not 0 <= r < world)
    if outside:
        raise HetCCLInputError(f"bridge: ranks {outside} are not in the group of {world}")
    if max(src.dp, dst.dp) % min(src.dp, dst.dp):
        raise HetCCLInputError(f"bridge: data-parallel degrees {src.dp} and {dst.dp} must divide one another "
                               "(fan-in, fan-out or equal)")
    both = set(src.ranks) & set(dst.ranks)
    if both and set(src.ranks) != set(dst.ranks):
        raise HetCCLInputError(f"bridge: ranks {sorted(both)} are in both layouts but not every rank is: colocated "
                               "modules use the same ranks, non-colocated ones disjoint ranks")


def _cut(chunk: torch.Tensor, item: Item, seq_dim: int) -> torch.Tensor:
    """The part of a source chunk that ``item`` names."""
    part = torch.tensor_split(chunk, item.parts, dim=0)[item.part] if item.parts > 1 else chunk
    return torch.tensor_split(part, item.chunks, dim=seq_dim)[item.chunk] if item.chunks > 1 else part


class Bridge:
    """This rank's end of a boundary communicator over a hetccl group's direct channel.

    ``bridge(x)`` in every rank of either layout, once per microbatch, in the same order:
    a source rank passes its chunk and gets back an anchor (a zero scalar: backpropagating
    it, e.g. ``(loss + anchor).backward()`` or ``anchor.backward()``, waits for the gradient
    and carries it into ``x``); a destination rank passes None and gets its part in its
    layout, whose gradient goes back when the backward pass reaches it; a colocated rank
    passes its chunk and gets its destination part. Backward may run the calls in any order
    on either side (colocated ranks: one order on all of them)."""

    def __init__(self, group: Any, src: Layout, dst: Layout, name: str = "bridge",
                 device: Any = "cpu") -> None:
        """``group``: the hetccl group (``hetccl_ray.get_group`` / ``get_torch_group``); ``name``
        tells bridges of one group apart; ``device``: where this rank's destination part lands."""
        self.device = torch.device(device)
        islands = [group.topology.island_of(r).name for r in range(group.world_size)]
        self.routes = routes(src, dst, islands)
        self.src, self.dst, self.rank, self.channel = src, dst, group.rank, group.direct
        digest = hashlib.sha256(repr((name, src, dst)).encode()).digest()
        self._key = int.from_bytes(digest[:2], "big") << _KEY_SHIFT  # ranks that disagree on layouts mismatch tags
        self.name, self._calls = name, 0
        self._arrived: dict[int, torch.Tensor] = {}  # messages that came before this rank asked for them
        self._asked: collections.deque = collections.deque(maxlen=16)  # messages asked for, and by whom sent:
        self._came: collections.deque = collections.deque(maxlen=16)  # the orders an error names
        self._sender = ThreadPoolExecutor(1, thread_name_prefix=f"hetccl-bridge-{self.rank}")
        self._sent: list[Future] = []

    def __call__(self, x: Optional[torch.Tensor]) -> torch.Tensor:
        source, dest = self.src.place(self.rank), self.dst.place(self.rank)
        if source is None and dest is None:
            raise HetCCLInputError(f"bridge: rank {self.rank} is in neither layout")
        if source is not None and x is None:
            raise HetCCLInputError(f"bridge: rank {self.rank} holds source chunk {source[0]}; pass it")
        self._calls += 1
        anchor = x if x is not None else torch.zeros((), requires_grad=True)
        return _Bridged.apply(self, self._calls, anchor)

    def rows(self, counts: Sequence[int]) -> list[int]:
        """The rows of the global batch this rank's destination part holds (see :func:`rows_held`)."""
        return rows_held(self._mine(), counts)

    def flush(self) -> None:
        """Wait until every message this rank sent has left (the end of a step)."""
        for future in self._sent:
            future.result()
        self._sent = []

    def close(self) -> None:
        self.flush()
        self._sender.shutdown(wait=True)

    # -- the two passes, run by _Bridged ----------------------------------------------------

    def forward(self, call: int, x: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], dict]:
        """Send what this rank provides, receive and hand on what it lands, assemble its part."""
        self._settle()
        have: dict[Item, torch.Tensor] = {}
        if x is not None:  # the items this rank provides (a source group's first rank provides it all)
            for item in {h.item for h in self.routes.hops if h.src == self.rank} | set(self._mine()):
                if self.routes.providers[item.source] == self.rank:
                    have[item] = _cut(x.detach(), item, self.dst.seq_dim).contiguous()
        for hop in self.routes.hops:
            if hop.src == self.rank:
                self._send(have[hop.item], hop.dst, self._transfer(call, hop.index, 0))
            elif hop.dst == self.rank:
                have[hop.item] = self._take(hop.src, self._transfer(call, hop.index, 0), self.device)
        shapes = {item: tuple(t.shape) for item, t in have.items()}
        mine = self._mine()
        if not mine:
            return None, shapes
        return torch.cat([have[item] for item in mine], dim=0), shapes

    def backward(self, call: int, grad: Optional[torch.Tensor], shapes: dict,
                 like: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Run the hops back: gradients of the items to their senders, summed where forward
        handed one item to several ranks; returns this source chunk's gradient."""
        self._settle()
        got: dict[Item, torch.Tensor] = {}
        if grad is not None:
            rows = [shapes[item][0] for item in self._mine()]
            for item, part in zip(self._mine(), torch.split(grad, rows, dim=0)):
                got[item] = part.contiguous()
        for hop in reversed(self.routes.hops):
            transfer = self._transfer(call, hop.index, 1)
            if hop.dst == self.rank:
                self._send(got.pop(hop.item), hop.src, transfer)
            elif hop.src == self.rank:
                arrived = self._take(hop.dst, transfer, like.device if like is not None else self.device)
                got[hop.item] = got[hop.item] + arrived if hop.item in got else arrived
        self._settle()
        source = self.src.place(self.rank)
        if source is None:
            return None
        chunk = like.new_zeros(like.shape)
        if self.routes.providers[source[0]] != self.rank:
            return chunk  # a replicated source member: the provider's copy carried the gradient
        for item, g in got.items():
            _cut(chunk, item, self.dst.seq_dim).add_(g)
        return chunk

    def _mine(self) -> tuple[Item, ...]:
        return self.routes.items.get(self.rank, ())

    def _transfer(self, call: int, hop: int, backward: int) -> int:
        return self._key | (call & _CALL_MASK) << _CALL_SHIFT | hop << 1 | backward

    def _take(self, peer: int, transfer: int, device: torch.device) -> torch.Tensor:
        """Message ``transfer`` from ``peer``. A peer sends in the order its own passes run
        (autograd may run backward in any order of the calls), so messages of this bridge
        that come before this rank asks for them wait here."""
        self._asked.append(transfer)
        while transfer not in self._arrived:
            try:
                got, tensor = self.channel.recv_next_shaped(peer, transfer, (1 << _KEY_SHIFT) - 1, device)
            except HetCCLError as exc:
                raise type(exc)(self._unmet(peer, transfer, exc)) from exc
            self._came.append((peer, got))
            self._arrived[got] = tensor
        return self._arrived.pop(transfer).to(device)

    def _unmet(self, peer: int, transfer: int, exc: BaseException) -> str:
        """Why a message did not come: the rule, and the orders of calls this rank asked for
        and ``peer`` sent in that pass."""
        backward = transfer & 1
        asked = [_call(t) for t in self._asked if t & 1 == backward]
        came = [_call(t) for p, t in self._came if p == peer and t & 1 == backward]
        what = "gradient" if backward else "activation"
        return (f"bridge '{self.name}': rank {self.rank} waited for the {what} of call {_call(transfer)} from rank "
                f"{peer}. The rule: every call's output is backpropagated on its destination ranks, in any order, "
                f"but a rank at both ends of a bridge waits inside one call's backward, so such ranks must run the "
                f"calls in one order (and forward calls are made in one order everywhere). This rank asked for "
                f"{what}s of calls {asked}; rank {peer} sent calls {came}. {exc}")

    def _send(self, tensor: torch.Tensor, peer: int, transfer: int) -> None:
        """Send on the bridge's thread, once the work that made ``tensor`` on this thread's
        stream is done (the thread's own copies go on another stream)."""
        made = devices.of(tensor).mark()
        timeout_s = self.channel.timeout_s

        def send() -> None:
            if made is not None:
                made.synchronize(time.monotonic() + timeout_s, f"bridge message {transfer:#x}")
            self.channel.send_shaped(tensor, peer, transfer)

        self._sent.append(self._sender.submit(send))

    def _settle(self) -> None:
        """Raise what a finished send raised; keep the ones still going."""
        pending = []
        for future in self._sent:
            if future.done():
                future.result()
            else:
                pending.append(future)
        self._sent = pending


def _call(transfer: int) -> int:
    """The call a bridge message belongs to, by its number."""
    return transfer >> _CALL_SHIFT & _CALL_MASK


class _Bridged(torch.autograd.Function):
    """The bridge as one autograd node: forward puts the activations in the destination
    layout, backward brings their gradient back to the source layout."""

    @staticmethod
    def forward(ctx: Any, bridge: Bridge, call: int, x: torch.Tensor) -> torch.Tensor:
        source = bridge.src.place(bridge.rank) is not None
        out, shapes = bridge.forward(call, x if source else None)
        ctx.bridge, ctx.call, ctx.shapes, ctx.source = bridge, call, shapes, source
        ctx.like = x.new_empty(()).expand(x.shape) if source else None  # shape, dtype, device; no memory
        return out if out is not None else x.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, Optional[torch.Tensor]]:
        bridge = ctx.bridge
        dest = bridge.dst.place(bridge.rank) is not None
        chunk = bridge.backward(ctx.call, grad.contiguous() if dest else None, ctx.shapes, ctx.like)
        return None, None, chunk if ctx.source else torch.zeros(())
