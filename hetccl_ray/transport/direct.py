"""Direct transfers: tensors from one rank of a group to another outside the group's ops.

What Ray Direct Transport (``rdt.py``) moves: an object's tensors, sent by the rank that
made them and received by the rank whose task takes them, on Ray's system threads while the
actors' own threads may be running the group's collectives. So they have a channel of
their own, a TCP border to every rank (compressed across islands as the group's border
is), whose links are dialled at first use and dialled again after a failure: one failed or
aborted transfer ends its link, never the group. Imports no Ray.
"""

from __future__ import annotations

import struct
import time
from typing import Sequence

import torch

from hetccl_ray.memory import devices
from hetccl_ray.errors import HetCCLError, HetCCLInputError, HetCCLPeerError, HetCCLTimeoutError
from hetccl_ray.transport.base import Handle, Tag
from hetccl_ray.transport.tcp import TcpBorder

DIRECT_OP = 64  # the op code of direct transfers in border headers (collective ops use 1-11)
_MAX_DIMS = 8
_SHAPE = struct.Struct(f"!BB{_MAX_DIMS}Q")  # a shaped message's control bytes: dtype, ndim, the dims
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_NO_PAYLOAD = torch.empty(0, dtype=torch.uint8)  # a shaped message's header carries control bytes only


class DirectChannel:
    """One rank's end of a group's direct transfers. A transfer is a list of tensors under
    a number both ends were given; tensor i travels as message (DIRECT_OP, number, i)."""

    def __init__(self, border: TcpBorder, group_name: str, rank: int, timeout_s: float) -> None:
        self.border, self.group_name, self.rank, self.timeout_s = border, group_name, rank, timeout_s
        self._aborted: set[int] = set()  # transfers aborted before their side here began

    def send(self, tensors: Sequence[torch.Tensor], peer: int, transfer: int) -> None:
        """Send ``tensors`` (ready to read: their producer's work is done) to ``peer``."""
        self._run("send", _messages(_on_host(tensors, self.timeout_s)), peer, transfer)

    def recv(self, buffers: Sequence[torch.Tensor], peer: int, transfer: int) -> None:
        """Receive transfer ``transfer`` from ``peer`` into ``buffers`` (contiguous, the sender's
        shapes and dtypes, on any device); their bytes are there for any stream on return."""
        hosts = _landings(buffers)
        self._run("recv", _messages(hosts), peer, transfer)
        _land(buffers, hosts, self.timeout_s)

    def send_shaped(self, tensor: torch.Tensor, peer: int, transfer: int) -> None:
        """Send one tensor whose shape and dtype the receiver does not know: they ride as
        control bytes of a message with no payload (counted as no border bytes), the data
        follows at once, without waiting for an answer."""
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise HetCCLInputError(f"direct transfer of a {tensor.dim()}-d {tensor.dtype} tensor: shaped "
                                   f"messages take up to {_MAX_DIMS} dims of {[str(d) for d in _DTYPES]}")
        shape = _SHAPE.pack(_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape,
                            *[0] * (_MAX_DIMS - tensor.dim()))
        self._run("send", [(0, _NO_PAYLOAD, shape)] + _messages(_on_host([tensor], self.timeout_s), first=1),
                  peer, transfer)

    def recv_shaped(self, peer: int, transfer: int, device: torch.device) -> torch.Tensor:
        """Counterpart of :meth:`send_shaped`: a new tensor of the sender's shape and dtype on
        ``device``."""
        return self.recv_next_shaped(peer, transfer, 0, device)[1]

    def recv_next_shaped(self, peer: int, transfer: int, free_bits: int,
                         device: torch.device) -> tuple[int, torch.Tensor]:
        """The next shaped transfer from ``peer`` whose number is ``transfer`` but for the bits in
        ``free_bits`` (senders that number their transfers in an order of their own): its
        number and its tensor, on ``device``."""
        (header,) = self._run("recv", [(0, _NO_PAYLOAD, b"")], peer, transfer, free_bits)
        transfer = header.tag.seq
        dtype, ndim, *dims = _SHAPE.unpack(header.extra)
        out = torch.empty(dims[:ndim], dtype=_DTYPES[dtype], device=device)
        hosts = _landings([out])
        self._run("recv", _messages(hosts, first=1), peer, transfer)
        _land([out], hosts, self.timeout_s)
        return transfer, out

    def abort(self, peer: int, transfer: int, why: str) -> None:
        """Fail transfer ``transfer`` with ``peer`` now, whether its side here is waiting (the
        link ends, the wait raises ``why``) or has not begun (it raises when it does)."""
        self._aborted.add(transfer)
        self.border.drop(peer, HetCCLPeerError(f"direct transfer {transfer:#x} between ranks {self.rank} and "
                                               f"{peer} in group '{self.group_name}' aborted: {why}"))

    def close(self) -> None:
        self.border.close()

    def _run(self, kind: str, messages: Sequence[tuple[int, torch.Tensor, bytes]], peer: int,
             transfer: int, free_bits: int = 0) -> list[Handle]:
        """Post every message (index, flat tensor, control bytes) of one side of a transfer and
        wait for all; returns their handles (a receive's control bytes are in ``extra``, its
        tag in ``tag``; ``free_bits``: see :meth:`recv_next_shaped`)."""
        deadline = time.monotonic() + self.timeout_s
        nbytes = sum(t.numel() * t.element_size() for _, t, _ in messages)
        source, dest = (self.rank, peer) if kind == "send" else (peer, self.rank)
        where = (f"direct transfer {transfer:#x} ({len(messages)} messages, {nbytes} bytes) from rank {source} to "
                 f"rank {dest} in group '{self.group_name}'")
        handles: list[Handle] = []
        if transfer in self._aborted:
            self._aborted.discard(transfer)
            raise HetCCLPeerError(f"{where} was aborted before its {kind} side began (its other side failed)")
        try:
            for i, flat, extra in messages:
                tag = Tag(DIRECT_OP, transfer, i)
                handles.append(self.border.isend(peer, flat, tag, self.timeout_s, extra) if kind == "send"
                               else self.border.irecv(peer, flat, tag, timeout_s=self.timeout_s, free_bits=free_bits))
            for handle in handles:
                handle.wait(max(deadline - time.monotonic(), 0.0))
        except (HetCCLError, RuntimeError, ValueError, OSError) as exc:
            # a stream left mid-message is out of step: the next transfer dials a fresh link
            self._aborted.discard(transfer)  # an abort that came while this side waited is spent
            self.border.drop(peer, HetCCLPeerError(f"{where} failed"))
            error = HetCCLTimeoutError if isinstance(exc, HetCCLTimeoutError) else HetCCLPeerError
            raise error(f"{where} ({kind} side, deadline {self.timeout_s:.0f}s): {exc}") from exc
        return handles


def _messages(tensors: Sequence[torch.Tensor], first: int = 0) -> list[tuple[int, torch.Tensor, bytes]]:
    """Tensor i as message ``first + i`` (flat); empty ones are not sent (both ends know their size)."""
    return [(first + i, t.reshape(-1), b"") for i, t in enumerate(tensors) if t.numel()]


def _on_host(tensors: Sequence[torch.Tensor], timeout_s: float) -> list[torch.Tensor]:
    """The tensors' bytes in host memory (the border moves host bytes): device tensors copied
    down on their device's current stream, waited for once per device."""
    hosts = _landings(tensors)
    for t, host in zip(tensors, hosts):
        if host is not t:
            devices.of(t).launch(None, devices.stage_out, host, t)
    _wait_devices([t for t, host in zip(tensors, hosts) if host is not t], timeout_s)
    return hosts


def _landings(buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host memory for each device buffer's bytes (host buffers as they are)."""
    hosts = []
    for buf in buffers:
        device = devices.of(buf)
        hosts.append(buf if device.host else device.host_buffer(buf.nbytes).view(buf.dtype).view(buf.shape))
    return hosts


def _land(buffers: Sequence[torch.Tensor], hosts: Sequence[torch.Tensor], timeout_s: float) -> None:
    """Received host bytes into their device buffers, there for any stream on return."""
    for buf, host in zip(buffers, hosts):
        if host is not buf:
            devices.of(buf).launch(None, devices.land, buf, host, None)
    _wait_devices([buf for buf, host in zip(buffers, hosts) if host is not buf], timeout_s)


def _wait_devices(tensors: Sequence[torch.Tensor], timeout_s: float) -> None:
    """Wait for the current stream of each tensor's device, once per device."""
    for t in {t.device: t for t in tensors}.values():
        devices.synchronize(t, timeout_s)
