"""The Border interface plans use to move data between ranks of different islands."""

from __future__ import annotations

import struct
import threading
from typing import Any, Optional, Protocol

import torch

from hetccl_ray.core.calls import Tag
from hetccl_ray.errors import HetCCLMismatchError, HetCCLTimeoutError

# magic, op code, sequence number, dtype code, payload bytes, control bytes after the header,
# whether the payload comes as compressed frames (compress/frames.py)
_HEADER = struct.Struct("!4sIQIQI?")
HEADER_SIZE = _HEADER.size
_MAGIC = b"HCCL"


def header(tag: Tag, nbytes: int, extra: int = 0, framed: bool = False) -> bytes:
    """The header of a message of ``tag``: payload bytes, control bytes, framing."""
    return _HEADER.pack(_MAGIC, tag.op, tag.seq, tag.dtype, nbytes, extra, framed)


def parse_header(raw: bytes) -> tuple[Tag, int, int, bool]:
    """The tag, payload bytes, control bytes and framing of a message header."""
    magic, op, seq, dtype, nbytes, extra, framed = _HEADER.unpack(raw)
    if magic != _MAGIC:
        raise ValueError(f"bad border message magic {magic!r}")
    return Tag(op, seq, dtype), nbytes, extra, framed


def matches(got: Tag, want: Tag, free_bits: int = 0) -> bool:
    """Whether a message of tag ``got`` is the one a receive of ``want`` takes: the same tag,
    but for the bits of the sequence number in ``free_bits``."""
    return got.op == want.op and got.dtype == want.dtype and not (got.seq ^ want.seq) & ~free_bits


def mismatch(receiver: int, expected: Tag, nbytes: int, sender: int, got: Tag, got_bytes: int) -> HetCCLMismatchError:
    """The error of a message that is not the one its receiver posted for."""
    return HetCCLMismatchError(f"rank {receiver} expected {expected} with {nbytes} bytes from rank {sender}, "
                               f"got {got} with {got_bytes} bytes")


class ByteCounter:
    """Payload bytes a border sent and received, and what they took on the wire (fewer where
    compressed), counted from its transfer threads."""

    def __init__(self) -> None:
        self.bytes_sent = self.bytes_received = 0
        self.wire_bytes_sent = self.wire_bytes_received = 0
        self.messages_sent = 0  # every message posted, to any peer (island peers too)
        self._count_lock = threading.Lock()

    def count(self, sent: int = 0, received: int = 0, wire_sent: Optional[int] = None,
              wire_received: Optional[int] = None) -> None:
        """Add a message's payload bytes (and its wire bytes, where they differ)."""
        with self._count_lock:
            self.bytes_sent += sent
            self.bytes_received += received
            self.wire_bytes_sent += sent if wire_sent is None else wire_sent
            self.wire_bytes_received += received if wire_received is None else wire_received


def chunks(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each chunk of a transfer of ``nbytes``."""
    return [(offset, min(chunk_bytes, nbytes - offset)) for offset in range(0, nbytes, chunk_bytes)]


class Flag:
    """A completion flag for handles whose waiters poll it rather than block on it (TCP's:
    whichever thread drives the sockets or fails a link finishes them): an Event's lock and
    condition cost more than a small message's send."""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True

    def wait(self, timeout_s: float) -> bool:
        return self._set


class Handle:
    """Completion of one posted send or receive; ``wait`` raises what the transfer raised.
    ``signal``: what a waiter blocks on (an Event: transfer threads finish it)."""

    signal: type = threading.Event

    def __init__(self, peer: int, kind: str) -> None:
        self.peer = peer
        self.kind = kind
        self.extra = b""  # control bytes that came with a received message
        self.tag: Optional[Tag] = None  # the tag a received message carried
        self.spill: Optional[bytearray] = None  # a flexible receive's payload of an unexpected size
        self._done = self.signal()
        self._error: Optional[BaseException] = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def finish(self, error: Optional[BaseException] = None) -> None:
        self._error = error
        self._done.set()

    def wait(self, timeout_s: float) -> None:
        if not self._done.wait(timeout_s):
            raise HetCCLTimeoutError(f"{self.kind} with rank {self.peer} did not complete within {timeout_s:.1f}s")
        if self._error is not None:
            raise self._error


class Border(Protocol):
    """Point-to-point transfers between group ranks, duplex and asynchronous. A border moves
    bytes and nothing else: host memory, or device memory it reads and writes as it is
    (``device_memory``); it launches no device work and waits for none (the runner stages
    device buffers and orders them on the op's stream)."""

    rank: int
    bytes_sent: int
    bytes_received: int

    def isend(self, peer: int, buf: torch.Tensor, tag: Tag) -> Handle:
        """Post a send of the contiguous tensor ``buf`` to ``peer`` (its bytes ready to read)."""

    def irecv(self, peer: int, buf: torch.Tensor, tag: Tag, op: Optional[str] = None) -> Handle:
        """Post a receive from ``peer`` straight into the contiguous tensor ``buf``; with a
        reduce ``op`` (host memory only), reduce what arrives into ``buf`` instead, piece by piece."""

    def device_memory(self, peer: int, device: Any) -> bool:
        """Whether transfers with ``peer`` move memory of ``device`` (a ``devices.Device``) as it
        is (GPUDirect RDMA); if not, only host memory."""

    def close(self) -> None:
        """Close every connection and stop every thread."""


class ControlBorder(Border, Protocol):
    """A border that also carries the small round's control (the TCP border, which reaches
    every rank): call rows beside the payload, receives of any size, receives from any source."""

    def isend(self, peer: int, buf: torch.Tensor, tag: Tag, timeout_s: float = 60.0, extra: bytes = b"") -> Handle:
        """As ``Border.isend``, with ``extra`` control bytes after the header."""

    def irecv(self, peer: int, buf: torch.Tensor, tag: Tag, op: Optional[str] = None,
              timeout_s: float = 60.0, flexible: bool = False) -> Handle:
        """As ``Border.irecv``; ``flexible``: a payload of another size lands in ``handle.spill``."""

    def first_arrival(self, expected: dict[int, "Tag"], timeout_s: float) -> int:
        """The first peer whose next message carries the tag ``expected[peer]``."""
