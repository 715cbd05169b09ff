"""What each op is, in one table: the planner, the cost model, the plan builders, the round,
the bench and the plan printer all read it here instead of naming ops in lists of their own.

Sizes are nccl-tests' ``S``: the whole buffer (allgather's output, reducescatter's input, an
all-to-all rank's input). Border bounds are the fewest bytes an op must move across island
boundaries, all ranks together, with ``k`` islands. Pure: imports no torch and no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from hetccl_ray.core.topology import Topology


def _cross_pairs(topo: Topology) -> int:
    """Ordered (source, destination) rank pairs in different islands."""
    return topo.world_size ** 2 - sum(island.size ** 2 for island in topo.islands)


@dataclass(frozen=True)
class OpKind:
    """One op: its shape (``rooted``: one rank is the root; ``chunked``: the buffer is one
    chunk per rank, in island-major order; ``reduces``: folds with a reduce op), whether the
    small round and the flat library run it (``round``), nccl-tests' bus factor, and the
    border bound with its formula as text (None: no bound, as for point-to-point)."""

    name: str
    bus: Callable[[int], float]
    crossings: Optional[Callable[[Topology, int], int]]
    bound_text: str = ""
    rooted: bool = False
    chunked: bool = False
    reduces: bool = False
    round: bool = False

    def bound(self, topo: Topology, nbytes: int) -> int:
        """Border bytes the op must move for a buffer of ``nbytes`` (nccl-tests' size)."""
        if self.crossings is None:
            raise ValueError(f"{self.name} has no border bound")
        return self.crossings(topo, nbytes)

    def whole_bytes(self, per_rank_bytes: int, world: int) -> int:
        """nccl-tests' size of a call whose rank holds ``per_rank_bytes`` (one chunk of a chunked op)."""
        return per_rank_bytes * (world if self.chunked else 1)


def _islands(factor: int) -> Callable[[Topology, int], int]:
    return lambda topo, nbytes: factor * (len(topo.islands) - 1) * nbytes


_RING, _HALF, _ONE = (lambda n: 2 * (n - 1) / n), (lambda n: (n - 1) / n), (lambda n: 1.0)
OP_KINDS: dict[str, OpKind] = {kind.name: kind for kind in (
    OpKind("allreduce", _RING, _islands(2), "2(k-1)S", reduces=True, round=True),
    OpKind("reducescatter", _HALF, _islands(1), "(k-1)S", chunked=True, reduces=True, round=True),
    OpKind("allgather", _HALF, _islands(1), "(k-1)S", chunked=True, round=True),
    OpKind("broadcast", _ONE, _islands(1), "(k-1)S", rooted=True, round=True),
    OpKind("reduce", _ONE, _islands(1), "(k-1)S", rooted=True, reduces=True, round=True),
    OpKind("alltoall", _HALF, lambda topo, nbytes: nbytes // topo.world_size * _cross_pairs(topo),
           "S/n per ordered pair of ranks in different islands (S per rank)", chunked=True),
    OpKind("gather", _HALF, None, rooted=True),
    OpKind("scatter", _HALF, None, rooted=True),
    OpKind("send", _ONE, None),
    OpKind("recv", _ONE, None),
    OpKind("barrier", _ONE, None),
)}
# the ops the small round, the hierarchical plans and the flat library run
ROUND_OPS: tuple[str, ...] = tuple(name for name, kind in OP_KINDS.items() if kind.round)


def kind(op: str) -> OpKind:
    """The table's row of ``op`` (a clear error for an op it does not know)."""
    try:
        return OP_KINDS[op]
    except KeyError:
        raise ValueError(f"unknown op {op!r}; ops: {', '.join(OP_KINDS)}") from None


def pieces(largest_bytes: int, piece_bytes: Optional[int]) -> int:
    """Pieces of at most ``piece_bytes`` for the largest region a plan pipelines (one for
    ``piece_bytes`` None or 0: no pipelining)."""
    return max(-(-largest_bytes // piece_bytes), 1) if piece_bytes else 1


def largest_region(topo: Topology, op: str, n: int) -> int:
    """Elements of the largest region a plan of ``op`` over ``n`` elements pipelines: an
    island's chunks for a chunked op, else the buffer."""
    if kind(op).chunked:
        return max(island.size for island in topo.islands) * (n // topo.world_size)
    return n
