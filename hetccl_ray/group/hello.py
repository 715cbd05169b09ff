"""Island peers show each other their device class before their first message on it.

Ranks of one island move a point-to-point message through their vendor library where their
tensors are device memory and over the border where they are host memory, so two ends that
disagree on the device class would wait on different channels: a hang. Before the first
message between two island peers on a device class, each end sends the other a hello over
the TCP border carrying its class (ahead of the message on that link, which delivers in
order), and the two compare: a disagreement is a mismatch named on both ends. Once per
pair and class; imports no Ray.
"""

from __future__ import annotations

from typing import Optional

import torch

from hetccl_ray.core.calls import OP_CODES
from hetccl_ray.memory.devices import KINDS
from hetccl_ray.transport.base import ControlBorder, Handle, Tag

_HELLO = 1 << 62  # the hellos' sequence numbers, apart from every op's
_NOTHING = torch.empty(0, dtype=torch.uint8)


def tag(n: int) -> Tag:
    """The tag of the ``n``-th hello between two peers."""
    return Tag(OP_CODES["check"], _HELLO | n, 0)


class Hello:
    """One hello each way with ``peer``, posted at once; ``theirs`` waits for the peer's."""

    def __init__(self, border: ControlBorder, peer: int, n: int, code: int) -> None:
        self.peer, self.code = peer, code
        self._got: Handle = border.irecv(peer, _NOTHING, tag(n), flexible=True)
        self._sent: Handle = border.isend(peer, _NOTHING, tag(n), extra=bytes([code]))

    def theirs(self, timeout_s: float) -> int:
        """The peer's device class (waits for its hello)."""
        self._sent.wait(timeout_s)
        self._got.wait(timeout_s)
        return self._got.extra[0]


def disagreement(rank: int, op: str, code: int, peer: int, theirs: int) -> Optional[str]:
    """None where both ends are on one device class, else what each end is on."""
    if theirs == code:
        return None
    return (f"rank {rank} calls {op} with {KINDS[code]} memory and its island peer rank {peer} with "
            f"{KINDS[theirs]} memory: ranks of one island take one device class (its vendor library "
            f"carries their messages)")
