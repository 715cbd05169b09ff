"""Direct transfers: tensors from one rank of a group to another outside the group's ops.

What Ray Direct Transport (``rdt.py``) moves: an object's tensors, sent by the rank that
made them and received by the rank whose task takes them, on Ray's system threads while the
actors' own threads may be running the group's collectives. So they have a channel of
their own, a TCP border to every rank (compressed across islands as the group's border
is), whose links are dialled at first use and dialled again after a failure: one failed or
aborted transfer ends its link, never the group. Imports no Ray.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from hetccl_ray import devices
from hetccl_ray.errors import HetCCLError, HetCCLPeerError, HetCCLTimeoutError
from hetccl_ray.transport.base import Handle, Tag
from hetccl_ray.transport.tcp import TcpBorder

DIRECT_OP = 64  # the op code of direct transfers in border headers (collective ops use 1-11)


class DirectChannel:
    """One rank's end of a group's direct transfers. A transfer is a list of tensors under
    a number both ends were given; tensor i travels as message (DIRECT_OP, number, i)."""

    def __init__(self, border: TcpBorder, group_name: str, rank: int, timeout_s: float) -> None:
        self.border, self.group_name, self.rank, self.timeout_s = border, group_name, rank, timeout_s
        self._aborted: set[int] = set()  # transfers aborted before their side here began

    def send(self, tensors: Sequence[torch.Tensor], peer: int, transfer: int) -> None:
        """Send ``tensors`` (ready to read: their producer's work is done) to ``peer``."""
        self._run("send", tensors, peer, transfer)

    def recv(self, buffers: Sequence[torch.Tensor], peer: int, transfer: int) -> None:
        """Receive transfer ``transfer`` from ``peer`` into ``buffers`` (contiguous, the sender's
        shapes and dtypes, on any device); their bytes are there for any stream on return."""
        self._run("recv", buffers, peer, transfer)
        for buf in buffers:
            if not devices.of(buf).host:
                devices.synchronize(buf, self.timeout_s)

    def abort(self, peer: int, transfer: int, why: str) -> None:
        """Fail transfer ``transfer`` with ``peer`` now, whether its side here is waiting (the
        link ends, the wait raises ``why``) or has not begun (it raises when it does)."""
        self._aborted.add(transfer)
        self.border.drop(peer, HetCCLPeerError(f"direct transfer {transfer:#x} between ranks {self.rank} and "
                                               f"{peer} in group '{self.group_name}' aborted: {why}"))

    def close(self) -> None:
        self.border.close()

    def _run(self, kind: str, tensors: Sequence[torch.Tensor], peer: int, transfer: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        source, dest = (self.rank, peer) if kind == "send" else (peer, self.rank)
        where = (f"direct transfer {transfer:#x} ({len(tensors)} tensors, {nbytes} bytes) from rank {source} to "
                 f"rank {dest} in group '{self.group_name}'")
        handles: list[Handle] = []
        if transfer in self._aborted:
            self._aborted.discard(transfer)
            raise HetCCLPeerError(f"{where} was aborted before its {kind} side began (its other side failed)")
        try:
            for i, t in enumerate(tensors):
                if not t.numel():
                    continue
                flat = t.reshape(-1)
                tag = Tag(DIRECT_OP, transfer, i)
                handles.append(self.border.isend(peer, flat, tag, self.timeout_s) if kind == "send"
                               else self.border.irecv(peer, flat, tag, timeout_s=self.timeout_s))
            for handle in handles:
                handle.wait(max(deadline - time.monotonic(), 0.0))
        except (HetCCLError, RuntimeError, ValueError, OSError) as exc:
            # a stream left mid-message is out of step: the next transfer dials a fresh link
            self.border.drop(peer, HetCCLPeerError(f"{where} failed"))
            error = HetCCLTimeoutError if isinstance(exc, HetCCLTimeoutError) else HetCCLPeerError
            raise error(f"{where} ({kind} side, deadline {self.timeout_s:.0f}s): {exc}") from exc
