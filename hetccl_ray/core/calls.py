"""What one rank called, as a row of small integers that every rank compares before data moves.

A mismatched call (another op, dtype, element count, root or reduce op, or a rank one op
ahead; or ranks of one island on different device classes, whose vendor libraries would
wait for each other) turns into an error naming the disagreeing ranks on every rank, instead of a hang
or silently wrong data. Pure: imports no Ray.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch

from hetccl_ray.memory.devices import KINDS
from hetccl_ray.memory.buffers import REDUCE_OPS
from hetccl_ray.core.tensors import SUPPORTED_DTYPES, dtype_code

OPS = ("allreduce", "reducescatter", "allgather", "broadcast", "reduce", "barrier", "send", "check", "alltoall",
       "gather", "scatter")
OP_CODES = {name: code for code, name in enumerate(OPS, start=1)}
OP_CODES["recv"] = OP_CODES["send"]  # the two ends of one message carry the same tag
ROW_WIDTH = 7
_DEVICE = 6  # the device class column (devices.KINDS): islands may differ, ranks of one island not


@dataclass(frozen=True)
class Tag:
    """What a border message belongs to: checked on receipt so mismatched calls fail loudly."""

    op: int
    seq: int
    dtype: int


@dataclass(frozen=True)
class Call:
    """One collective call as this rank made it: the parts every rank must agree on."""

    op: str
    dtype: torch.dtype
    numel: int
    root: int = -1
    reduce: str = ""
    seq: int = 0
    device: int = 0  # devices.KINDS index of the buffers' device class

    def encode(self) -> list[int]:
        reduce = REDUCE_OPS.index(self.reduce) + 1 if self.reduce else 0
        return [OP_CODES[self.op], self.seq, dtype_code(self.dtype), self.numel, self.root, reduce, self.device]

    def numbered(self, seq: int, device: int) -> "Call":
        """This call as the group runs it: its sequence number and device class filled in."""
        return Call(self.op, self.dtype, self.numel, self.root, self.reduce, seq, device)

    def tag(self) -> Tag:
        """The tag of this call's border messages (checked on receipt)."""
        return Tag(OP_CODES[self.op], self.seq, dtype_code(self.dtype))

    @classmethod
    def decode(cls, row: Sequence[int]) -> "Call":
        op, seq, dtype, numel, root, reduce, device = (int(v) for v in row)
        return cls(OPS[op - 1], SUPPORTED_DTYPES[dtype], numel, root, REDUCE_OPS[reduce - 1] if reduce else "", seq,
                   device)

    def __str__(self) -> str:
        unit = "blocks" if self.op == "alltoall" else "elements"  # its block sizes are compared apart
        parts = [str(self.dtype).replace("torch.", ""), f"{self.numel} {unit}"]
        if self.root >= 0:
            parts.append(f"root {self.root}")
        if self.reduce:
            parts.append(self.reduce)
        if self.device:
            parts.append(f"on {KINDS[self.device]}")
        return f"{self.op} #{self.seq}({', '.join(parts)})"


def disagreement(calls: Union[Sequence[Call], Mapping[int, Call]],
                 islands: Iterable[Sequence[int]] = ()) -> Optional[str]:
    """None when every rank of ``calls`` (every rank's, or some ranks' by rank) made the same
    call (up to the device class, which must agree only inside each island of ``islands``,
    rank lists); else which ranks made which call."""
    by_rank = calls if isinstance(calls, Mapping) else dict(enumerate(calls))
    for ranks in islands:
        if len({by_rank[r].device for r in ranks if r in by_rank}) > 1:
            return _named({r: by_rank[r] for r in ranks if r in by_rank})
    if len({replace(call, device=0) for call in by_rank.values()}) == 1:
        return None
    return _named(by_rank)


def _named(calls: dict[int, Call]) -> str:
    ranks_by_call: dict[Call, list[int]] = defaultdict(list)
    for rank, call in calls.items():
        ranks_by_call[call].append(rank)
    ordered = sorted(ranks_by_call.items(), key=lambda item: (-len(item[1]), item[1]))
    return "; ".join(f"ranks {ranks} called {call}" for call, ranks in ordered)


def on_host(row: Sequence[int]) -> bool:
    """Whether a row's buffers are host memory (device class cpu)."""
    return row[_DEVICE] == 0
