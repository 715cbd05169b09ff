"""One op as the doors hand it to the group: the ``Op`` record, and the builder every door uses.

A door (Ray's ``BaseGroup`` methods, the torch backend) turns a user's call into an ``Op``
once: the call row every rank agrees on, the flat buffers the plan runs over, and the
copies between them and the user's tensors. The group runs it (``HetCCLGroup.run``): one
wrapper, no callables. The builder checks the arguments (bad input raises here, before any
data moves) and speaks the core's own types (``Reduce``), so no door's types reach the core.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from hetccl_ray.memory.buffers import ScratchPool, overlap
from hetccl_ray.core.calls import Call
from hetccl_ray.core.tensors import Operand, same_kind
from hetccl_ray.errors import HetCCLInputError
from hetccl_ray.core.topology import Topology


class Reduce(str, enum.Enum):
    """The reduce ops every collective takes (their names are the call rows' and buffers.py's)."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"


Copy = tuple[torch.Tensor, torch.Tensor]  # (into, from): one device copy on the op's stream


@dataclass
class Op:
    """One call of this rank: ``call`` (what every rank must agree on), ``buf`` (the flat buffer
    a collective's plan runs over; allgather and reducescatter: the island-major buffer of one
    chunk per rank), ``out`` (reducescatter: this rank's chunk), ``blocks`` (an all-to-all,
    gather or scatter: the flat blocks to and from each rank; ``counts``: every rank's block
    sizes where the call fixes them, else agreed by its check), ``peer`` (a send or receive).
    ``copy_in`` runs before the op, ``copy_out`` and then ``written``'s write-backs after it;
    ``offered``: what this rank's host buffers give a one-host op, published with its check
    (every rank of an op that offers publishes, a broadcast's non-roots nothing but the step)."""

    call: Call
    buf: Optional[torch.Tensor] = None
    out: Optional[torch.Tensor] = None
    blocks: Optional[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]] = None
    counts: Optional[list[list[int]]] = None
    peer: Optional[int] = None
    copy_in: Sequence[Copy] = ()
    copy_out: Sequence[Copy] = ()
    written: Sequence[Operand] = ()
    offered: Optional[Sequence[torch.Tensor]] = None  # None: the op publishes nothing with its check
    agrees_counts: bool = False  # an all-to-all: block sizes agreed in its check
    tag: int = 0  # a message's tag (torch's): numbered apart, in the high bits of its sequence number
    ahead: Any = None  # an all-to-all's host blocks sent during its check (collectives.SentAhead)

    def __post_init__(self) -> None:
        self.written = [o for o in self.written if not o.in_place]  # the op wrote the rest in place

    @property
    def name(self) -> str:
        return self.call.op

    @property
    def tensor(self) -> Optional[torch.Tensor]:
        """A buffer of the op: whose device it runs on (None: no data, a barrier)."""
        if self.buf is not None:
            return self.buf
        return self.blocks[0][0] if self.blocks is not None else None

    @property
    def moves(self) -> bool:
        """Whether the op moves data (not a barrier, nor a call of no elements)."""
        return self.tensor is not None and self.call.numel > 0

    @property
    def staged(self) -> list[torch.Tensor]:
        """The buffers the small round runs over."""
        return [t for t in (self.buf, self.out) if t is not None]


class OpBuilder:
    """Builds one group's ``Op`` records from user tensors, with clear errors for bad input."""

    def __init__(self, group_name: str, topology: Topology, rank: int, scratch: ScratchPool) -> None:
        self.group_name, self.topology, self.rank, self.scratch = group_name, topology, rank, scratch
        self.world_size = topology.world_size

    # -- argument checks ---------------------------------------------------------------------------

    def one(self, tensors: Any, what: str) -> Any:
        """The tensor of a call that takes one (a door may pass a list of one)."""
        if isinstance(tensors, (list, tuple)):
            if len(tensors) != 1:
                raise HetCCLInputError(f"group '{self.group_name}': {what} takes one tensor per rank, got a list of "
                                       f"{len(tensors)} (multi-GPU lists are not supported by hetccl)")
            return tensors[0]
        return tensors

    def rank_of(self, rank: Any, what: str) -> int:
        """A rank of this group (a root, a peer)."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise HetCCLInputError(f"group '{self.group_name}': {what} {rank!r} is not a rank of this group of "
                                   f"{self.world_size} (0..{self.world_size - 1})")
        return rank

    def per_rank(self, tensor_list: Any, what: str, moving: bool = False) -> list[Operand]:
        """One operand per rank."""
        if not isinstance(tensor_list, (list, tuple)) or len(tensor_list) != self.world_size:
            got = len(tensor_list) if isinstance(tensor_list, (list, tuple)) else type(tensor_list).__name__
            raise HetCCLInputError(f"group '{self.group_name}': {what} must be a list of world_size="
                                   f"{self.world_size} tensors, got {got}")
        return [Operand(t, moving) for t in tensor_list]

    def reduce(self, op: Any) -> str:
        """A reduce op of the core's own (``Reduce``), by its name."""
        try:
            return Reduce(op).value
        except ValueError:
            raise HetCCLInputError(f"unsupported reduce op {op!r}; supported: SUM, PRODUCT, MIN, MAX") from None

    # -- the ops -----------------------------------------------------------------------------------

    def allreduce(self, tensor: Any, reduce: Reduce = Reduce.SUM) -> Op:
        x = Operand(self.one(tensor, "allreduce"))
        return Op(Call("allreduce", x.flat.dtype, x.numel, reduce=self.reduce(reduce)), x.flat, written=[x],
                  offered=[x.flat])

    def barrier(self) -> Op:
        return Op(Call("barrier", torch.uint8, 0))

    def reduce_to(self, tensor: Any, root: int, reduce: Reduce = Reduce.SUM) -> Op:
        """Reduce into ``root``'s tensor; the others keep theirs (they work in scratch)."""
        x = Operand(self.one(tensor, "reduce"))
        root = self.rank_of(root, "reduce root")
        call = Call("reduce", x.flat.dtype, x.numel, root, self.reduce(reduce))
        if self.rank == root:
            return Op(call, x.flat, written=[x], offered=[x.flat])
        work = self.scratch.get("reduce", x.numel, x.flat)
        return Op(call, work, copy_in=[(work, x.flat)], offered=[x.flat])

    def broadcast(self, tensor: Any, root: int) -> Op:
        x = Operand(self.one(tensor, "broadcast"), moving=True)
        root = self.rank_of(root, "broadcast root")
        return Op(Call("broadcast", x.flat.dtype, x.numel, root), x.flat, written=[x],
                  offered=[x.flat] if self.rank == root else [])

    def allgather(self, tensor_list: Any, tensor: Any) -> Op:
        """Every rank's ``tensor`` into ``tensor_list`` (one per rank)."""
        x = Operand(self.one(tensor, "allgather input"), moving=True)
        outputs = self.per_rank(tensor_list, "allgather output tensor_list", moving=True)
        same_kind(x.flat, [o.flat for o in outputs], "allgather output tensor_list")
        n, order = x.numel, self.topology.island_major_order
        buf = self.scratch.get("allgather", n * self.world_size, x.flat)
        mine = order.index(self.rank)
        return Op(Call("allgather", x.flat.dtype, n), buf, copy_in=[(buf[mine * n:(mine + 1) * n], x.flat)],
                  copy_out=[(outputs[rank].flat, buf[slot * n:(slot + 1) * n]) for slot, rank in enumerate(order)],
                  written=outputs, offered=[x.flat])

    def reducescatter(self, tensor: Any, tensor_list: Any, reduce: Reduce = Reduce.SUM) -> Op:
        """``tensor_list`` (one per rank) reduced over ranks; this rank's into ``tensor``."""
        out = Operand(self.one(tensor, "reducescatter output"))
        inputs = self.per_rank(tensor_list, "reducescatter input tensor_list")
        same_kind(out.flat, [i.flat for i in inputs], "reducescatter input tensor_list")
        n, order = out.numel, self.topology.island_major_order
        buf = self.scratch.get("reducescatter", n * self.world_size, out.flat)
        return Op(Call("reducescatter", out.flat.dtype, n, reduce=self.reduce(reduce)), buf, out.flat,
                  copy_in=[(buf[slot * n:(slot + 1) * n], inputs[rank].flat) for slot, rank in enumerate(order)],
                  written=[out], offered=[buf])

    def alltoall(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                 written: Sequence[Operand] = ()) -> Op:
        """Flat contiguous ``inputs[t]`` to rank t, ``outputs[r]`` from rank r (views of one buffer
        are fine); block sizes may differ per pair, agreed in the op's check."""
        same_kind(inputs[0], [*inputs, *outputs], "alltoall tensors", sizes=False)
        if overlap(inputs, outputs):  # in place: blocks leave from a copy, so none is overwritten before it is read
            inputs = list(torch.cat(inputs).split([t.numel() for t in inputs]))
        if self.world_size == 1 and inputs[0].numel() != outputs[0].numel():
            raise HetCCLInputError(f"group '{self.group_name}': alltoall sends {inputs[0].numel()} elements to "
                                   f"rank 0 but expects {outputs[0].numel()} from it")
        order = self.topology.island_major_order
        return Op(Call("alltoall", inputs[0].dtype, self.world_size), blocks=(inputs, outputs),
                  counts=[[inputs[0].numel()]], written=written, offered=[inputs[t] for t in order],
                  agrees_counts=True)

    def gather(self, tensor: Any, gather_list: Any, root: int) -> Op:
        """Every rank's ``tensor`` into ``gather_list`` at ``root``: blocks to root only."""
        return self._rooted("gather", tensor, gather_list, root)

    def scatter(self, tensor: Any, scatter_list: Any, root: int) -> Op:
        """``scatter_list[t]`` at ``root`` into rank t's ``tensor``: blocks from root only."""
        return self._rooted("scatter", tensor, scatter_list, root)

    def _rooted(self, name: str, tensor: Any, tensor_list: Any, root: int) -> Op:
        """A gather (every rank's block to ``root``'s list) or a scatter (``root``'s list, a block
        to each rank) as an all-to-all whose block sizes the call fixes."""
        x = Operand(self.one(tensor, name), moving=True)
        root = self.rank_of(root, f"{name} root")
        listed = self.per_rank(tensor_list, f"{name}_list", moving=True) if self.rank == root else []
        same_kind(x.flat, [t.flat for t in listed], f"{name}_list")
        n, empty, world = x.numel, x.flat[:0], self.world_size
        at_root = [t.flat for t in listed] or [empty] * world
        mine = [x.flat if r == root else empty for r in range(world)]  # to or from the root only
        if name == "gather":
            counts = [[n if t == root else 0 for t in range(world)] for _ in range(world)]
            return Op(Call(name, x.flat.dtype, n, root), blocks=(mine, at_root), counts=counts, written=listed)
        counts = [[n if r == root else 0 for _ in range(world)] for r in range(world)]
        return Op(Call(name, x.flat.dtype, n, root), blocks=(at_root, mine), counts=counts, written=[x])

    def p2p(self, op: str, tensor: Any, peer: Any, tag: int = 0) -> Op:
        """A send or receive (``op``) of ``tensor`` with ``peer`` under ``tag``."""
        x = Operand(self.one(tensor, op), moving=True)
        peer = self.rank_of(peer, f"{op} peer")
        if peer == self.rank:
            raise HetCCLInputError(f"group '{self.group_name}': rank {self.rank} cannot {op} to itself")
        return self.message(op, x, peer, tag)

    @staticmethod
    def message(op: str, x: Operand, peer: int, tag: int = 0) -> Op:
        """A send or receive (``op``) of the operand ``x`` with ``peer`` (checked)."""
        return Op(Call(op, x.flat.dtype, x.numel), x.flat, peer=peer, written=[x] if op == "recv" else [], tag=tag)
