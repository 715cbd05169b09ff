"""TCP border: one authenticated duplex connection per peer, zero-copy ``recv_into``.

Each connection has a sender thread and a receiver thread working through FIFO queues, so
a send and a receive with the same peer run at once and an exchange never deadlocks.
Messages carry a small header (op, sequence, dtype, size) that the receiver checks.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import socket
import struct
import threading
import time
from typing import Optional

import torch

from hetccl_ray.collective.reduction import combine
from hetccl_ray.errors import HetCCLMismatchError, HetCCLPeerError, HetCCLTimeoutError
from hetccl_ray.transport.base import HEADER_SIZE, ByteCounter, Handle, Tag, chunks, mismatch

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
REDUCE_CHUNK_BYTES = 256 << 10  # received partials are reduced in pieces that stay in cache
_CHALLENGE = 16
_RANK = struct.Struct("!I")
_DIGEST = hashlib.sha256().digest_size
_HANDSHAKE_TIMEOUT_S = 5.0


def _byte_view(buf: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(buf.reshape(-1).view(torch.uint8).numpy())


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, CHUNK_BYTES))
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k


def _proof(secret: bytes, challenge: bytes, rank: int) -> bytes:
    return hmac.new(secret, challenge + _RANK.pack(rank), hashlib.sha256).digest()


class _Link:
    """One connection to one peer: a sender thread and a receiver thread."""

    def __init__(self, owner: "TcpBorder", peer: int, sock: socket.socket) -> None:
        self.owner, self.peer, self.sock = owner, peer, sock
        self.error: Optional[BaseException] = None
        self.staging: Optional[torch.Tensor] = None
        self.send_staging: Optional[torch.Tensor] = None
        self.sends: "queue.SimpleQueue" = queue.SimpleQueue()
        self.recvs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=self._loop, args=(self.sends, self._send_one), daemon=True,
                             name=f"hetccl-send-{owner.rank}->{peer}"),
            threading.Thread(target=self._loop, args=(self.recvs, self._recv_one), daemon=True,
                             name=f"hetccl-recv-{owner.rank}<-{peer}"),
        ]
        for thread in self.threads:
            thread.start()

    def _loop(self, work: "queue.SimpleQueue", step) -> None:
        while True:
            item = work.get()
            if item is None:
                return
            handle = item[-1]
            if self.error is not None:
                handle.finish(self.error)
                continue
            try:
                step(*item[:-1])
                handle.finish()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                if not isinstance(exc, (HetCCLMismatchError, HetCCLPeerError)):
                    exc = HetCCLPeerError(f"border link rank {self.owner.rank} <-> rank {self.peer} failed: {exc}")
                self.error = exc
                handle.finish(exc)

    def _send_one(self, tag: Tag, buf: torch.Tensor) -> None:
        nbytes = buf.numel() * buf.element_size()
        self.sock.sendall(tag.header(nbytes))
        if buf.device.type == "cpu":
            view = _byte_view(buf)
            for offset, length in chunks(nbytes, CHUNK_BYTES):
                self.sock.sendall(view[offset:offset + length])
        else:
            self._send_staged(buf, nbytes)
        self.owner.count(sent=nbytes)

    def _send_staged(self, buf: torch.Tensor, nbytes: int) -> None:
        """A device tensor through two pinned host slots: the copy of chunk i+1 runs while chunk i is sent."""
        flat = buf.reshape(-1).view(torch.uint8)
        spans = chunks(nbytes, CHUNK_BYTES)
        if self.send_staging is None:
            self.send_staging = torch.empty(2, CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)

        def launch(i: int) -> tuple[torch.Tensor, "torch.cuda.Event"]:
            offset, length = spans[i]
            slot = self.send_staging[i % 2, :length]
            slot.copy_(flat[offset:offset + length], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            return slot, copied

        pending = launch(0)
        for i in range(len(spans)):
            slot, copied = pending
            copied.synchronize()
            if i + 1 < len(spans):
                pending = launch(i + 1)
            self.sock.sendall(memoryview(slot.numpy()))

    def _recv_one(self, tag: Tag, buf: torch.Tensor, op: Optional[str]) -> None:
        nbytes = buf.numel() * buf.element_size()
        raw = bytearray(HEADER_SIZE)
        _recv_exact(self.sock, memoryview(raw))
        got, sent = Tag.parse(bytes(raw))
        if got != tag or sent != nbytes:
            raise mismatch(self.owner.rank, tag, nbytes, self.peer, got, sent)
        if op is None and buf.device.type == "cpu":
            _recv_exact(self.sock, _byte_view(buf))
        else:
            self._recv_staged(buf, op)
        self.owner.count(received=nbytes)

    def _recv_staged(self, buf: torch.Tensor, op: Optional[str]) -> None:
        """Receive through a small host buffer: reduce into ``buf`` (``op``) or copy to the device."""
        flat = buf.reshape(-1)
        step = max(REDUCE_CHUNK_BYTES // flat.element_size(), 1)
        if self.staging is None or self.staging.numel() < step * flat.element_size():
            self.staging = torch.empty(step * flat.element_size(), dtype=torch.uint8,
                                       pin_memory=torch.cuda.is_available())
        for start in range(0, flat.numel(), step):
            piece = flat[start:start + step]
            landing = self.staging[:piece.numel() * piece.element_size()]
            _recv_exact(self.sock, memoryview(landing.numpy()))
            received = landing.view(piece.dtype).to(piece.device, non_blocking=False)
            if op is None:
                piece.copy_(received)
            else:
                combine(piece, received, op)

    def close(self) -> None:
        for work in (self.sends, self.recvs):
            work.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for thread in self.threads:
            thread.join(timeout=5)


class TcpBorder(ByteCounter):
    """Border over TCP sockets. The lower rank of a pair connects; the higher accepts."""

    def __init__(self, rank: int, bind_host: str) -> None:
        super().__init__()
        self.rank = rank
        self.rejected = 0
        self._secret = b""
        self._ready = threading.Event()
        self._addresses: dict[int, tuple[str, int]] = {}
        self._links: dict[int, _Link] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._listener = socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((bind_host, 0))
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self.address: tuple[str, int] = (bind_host, self._listener.getsockname()[1])
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True, name=f"hetccl-accept-{rank}")
        self._acceptor.start()

    def __repr__(self) -> str:
        return f"TcpBorder(rank={self.rank}, address={self.address}, links={sorted(self._links)})"

    def set_peers(self, addresses: dict[int, tuple[str, int]], secret: bytes) -> None:
        """Where every other rank listens, and the group's secret (from the rendezvous)."""
        self._addresses = dict(addresses)
        self._secret = secret
        self._ready.set()

    def isend(self, peer: int, buf: torch.Tensor, tag: Tag, timeout_s: float = 60.0) -> Handle:
        handle = Handle(peer, "send")
        self._link(peer, timeout_s).sends.put((tag, buf, handle))
        return handle

    def irecv(self, peer: int, buf: torch.Tensor, tag: Tag, op: Optional[str] = None,
              timeout_s: float = 60.0) -> Handle:
        handle = Handle(peer, "recv")
        self._link(peer, timeout_s).recvs.put((tag, buf, op, handle))
        return handle

    def _link(self, peer: int, timeout_s: float) -> _Link:
        with self._cond:
            link = self._links.get(peer)
        if link is not None:
            return link
        if peer == self.rank or peer not in self._addresses:
            raise ValueError(f"rank {self.rank} has no border address for rank {peer}")
        if self.rank < peer:
            return self._connect(peer, timeout_s)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while peer not in self._links:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise HetCCLTimeoutError(
                        f"rank {self.rank}: rank {peer} did not connect to the border within {timeout_s:.1f}s")
                self._cond.wait(left)
            return self._links[peer]

    def _connect(self, peer: int, timeout_s: float) -> _Link:
        host, port = self._addresses[peer]
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
            challenge = bytearray(_CHALLENGE)
            _recv_exact(sock, memoryview(challenge))
            sock.sendall(_RANK.pack(self.rank) + _proof(self._secret, bytes(challenge), self.rank))
            ok = bytearray(2)
            _recv_exact(sock, memoryview(ok))
            if bytes(ok) != b"OK":
                raise ConnectionError("peer refused the handshake")
        except OSError as exc:
            raise HetCCLPeerError(f"rank {self.rank} could not connect to rank {peer} at {host}:{port}: {exc}") from exc
        return self._register(peer, sock)

    def _register(self, peer: int, sock: socket.socket) -> _Link:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._cond:
            link = self._links.setdefault(peer, _Link(self, peer, sock))
            self._cond.notify_all()
        return link

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(sock,), daemon=True,
                             name=f"hetccl-handshake-{self.rank}").start()

    def _handshake(self, sock: socket.socket) -> None:
        """Admit a connection only if it proves it holds the group's secret."""
        peer_name = "unknown"
        try:
            peer_name = "%s:%s" % sock.getpeername()[:2]
            sock.settimeout(_HANDSHAKE_TIMEOUT_S)
            challenge = os.urandom(_CHALLENGE)
            sock.sendall(challenge)
            reply = bytearray(_RANK.size + _DIGEST)
            _recv_exact(sock, memoryview(reply))
            if not self._ready.wait(_HANDSHAKE_TIMEOUT_S):
                raise PermissionError("connection before this rank knew the group's secret")
            (peer,) = _RANK.unpack(bytes(reply[:_RANK.size]))
            proof = bytes(reply[_RANK.size:])
            if not (peer < self.rank and hmac.compare_digest(proof, _proof(self._secret, challenge, peer))):
                raise PermissionError(f"bad credentials (claimed rank {peer})")
            sock.sendall(b"OK")
        except (OSError, PermissionError, ValueError) as exc:
            with self._cond:
                self.rejected += 1
            logger.warning("hetccl border rank %d refused a connection from %s: %s", self.rank, peer_name, exc)
            sock.close()
            return
        self._register(peer, sock)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            links = list(self._links.values())
            self._links.clear()
            self._cond.notify_all()
        self._listener.close()
        self._acceptor.join(timeout=5)
        for link in links:
            link.close()
