"""Weight sync, one to many: a state dict broadcast over a hetccl group.

Where one trainer feeds several rollout actors, a broadcast sends the weights across each
island boundary once, not once per receiver as point-to-point transfers do. The tensors go
packed, one buffer per dtype, so a model of hundreds of tensors is a few ops, not hundreds;
packing and unpacking copy in serial pieces (``buffers.copy``), which on a busy host is
several times faster than ``torch.cat`` spread over torch's thread pool.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping

import torch
from ray.util import collective as col

from hetccl_ray.memory.buffers import ScratchPool, copy

_PACKED = ScratchPool()  # one packed buffer per (group, dtype, device), kept: fresh pages cost a fault each


def broadcast_state_dict(state: Mapping[str, torch.Tensor], src_rank: int = 0, group_name: str = "default") -> None:
    """Inside each actor of the group: make this rank's tensors of ``state`` equal to
    ``src_rank``'s, in place (a model's ``state_dict()`` shares its parameters' memory, so
    the model is updated). Every rank passes the same names, shapes and dtypes, on any
    device (a GPU trainer, CPU rollouts); a rank that differs is named by the group."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for name in sorted(state):  # the same order on every rank
        by_dtype[state[name].dtype].append(state[name])
    sending = col.get_rank(group_name) == src_rank
    for dtype in sorted(by_dtype, key=str):
        tensors = by_dtype[dtype]
        sizes = [t.numel() for t in tensors]
        packed = _PACKED.get(group_name, sum(sizes), tensors[0])  # kept per (group, dtype, device)
        parts = packed.split(sizes)
        if sending:
            for t, part in zip(tensors, parts):
                copy(part, t.reshape(-1))
        col.broadcast(packed, src_rank=src_rank, group_name=group_name)
        if not sending:
            for t, part in zip(tensors, parts):
                if t.is_contiguous():
                    copy(t.view(-1), part)
                else:
                    t.copy_(part.view(t.shape))
