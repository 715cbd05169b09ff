"""What one rank called, as a row of small integers that every rank compares before data moves.

A mismatched call (another op, dtype, element count, root or reduce op, or a rank one op
ahead) turns into an error naming the disagreeing ranks on every rank, instead of a hang
or silently wrong data. Pure: imports no Ray.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from hetccl_ray.collective.reduction import REDUCE_OPS
from hetccl_ray.collective.tensors import SUPPORTED_DTYPES, dtype_code

OPS = ("allreduce", "reducescatter", "allgather", "broadcast", "reduce", "barrier", "send", "check", "alltoall",
       "gather", "scatter")
OP_CODES = {name: code for code, name in enumerate(OPS, start=1)}
OP_CODES["recv"] = OP_CODES["send"]  # the two ends of one message carry the same tag
ROW_WIDTH = 6


@dataclass(frozen=True)
class Call:
    """One collective call as this rank made it: the parts every rank must agree on."""

    op: str
    dtype: torch.dtype
    numel: int
    root: int = -1
    reduce: str = ""
    seq: int = 0

    def encode(self) -> list[int]:
        reduce = REDUCE_OPS.index(self.reduce) + 1 if self.reduce else 0
        return [OP_CODES[self.op], self.seq, dtype_code(self.dtype), self.numel, self.root, reduce]

    @classmethod
    def decode(cls, row: Sequence[int]) -> "Call":
        op, seq, dtype, numel, root, reduce = (int(v) for v in row)
        return cls(OPS[op - 1], SUPPORTED_DTYPES[dtype], numel, root, REDUCE_OPS[reduce - 1] if reduce else "", seq)

    def __str__(self) -> str:
        unit = "blocks" if self.op == "alltoall" else "elements"  # its block sizes are compared apart
        parts = [str(self.dtype).replace("torch.", ""), f"{self.numel} {unit}"]
        if self.root >= 0:
            parts.append(f"root {self.root}")
        if self.reduce:
            parts.append(self.reduce)
        return f"{self.op} #{self.seq}({', '.join(parts)})"


def disagreement(calls: Sequence[Call]) -> Optional[str]:
    """None when every rank made the same call; else which ranks made which call."""
    ranks_by_call: dict[Call, list[int]] = defaultdict(list)
    for rank, call in enumerate(calls):
        ranks_by_call[call].append(rank)
    if len(ranks_by_call) == 1:
        return None
    ordered = sorted(ranks_by_call.items(), key=lambda item: (-len(item[1]), item[1]))
    return "; ".join(f"ranks {ranks} called {call}" for call, ranks in ordered)
