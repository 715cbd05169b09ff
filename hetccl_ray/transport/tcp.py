"""TCP border: one authenticated duplex connection per peer, driven by the waiting thread.

No thread sits on the data path: ``isend`` writes what the socket takes at once (a small
message leaves in one ``sendmsg`` before ``isend`` returns), and whoever waits on a handle
drives every pending send and receive of the border through non-blocking sockets and
``select`` until its handle is done. Sends and receives with one peer progress together,
so an exchange never deadlocks. Messages carry a header (op, sequence, dtype, payload
size, control size, framing) that the receiver checks, then optional control bytes (the
call rows of the small-message plans), then the payload, received straight into the
destination. To a peer in another island a float payload may go as compressed frames
(compress/): each link's policy decides per message, from the link's delivery rate and the
codec's measured speed and ratio.

A peer on the same host and in the same network namespace is dialled on an abstract Unix
socket instead (as NCCL's SHM transport for one node): no TCP/IP stack on the way, 2.5x the
bytes per second of loopback TCP on this project's machines, never compressed. Abstract
names do not leave a network namespace, so islands kept apart (a shaped link) use TCP.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time
from typing import Any, Iterator, NamedTuple, Optional

import torch

from hetccl_ray.memory.buffers import ScratchPool, combine
from hetccl_ray.transport.compress.frames import FRAME_BYTES, CodecStats, Decoder, Encoder, FrameReader
from hetccl_ray.transport.compress.planes import layout_for
from hetccl_ray.transport.compress.policy import LinkPolicy
from hetccl_ray.errors import HetCCLInputError, HetCCLMismatchError, HetCCLPeerError, HetCCLTimeoutError
from hetccl_ray.transport.base import (HEADER_SIZE, ByteCounter, Flag, Handle, Tag, header, matches,
                                       mismatch, parse_header)

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
REDUCE_CHUNK_BYTES = 256 << 10  # received partials are reduced in pieces that stay in cache
SPILL_LIMIT = 256 << 20  # the largest payload a flexible receive takes in place of the expected one
_CHALLENGE = 16
_RANK = struct.Struct("!I")
_DIGEST = hashlib.sha256().digest_size
_HANDSHAKE_TIMEOUT_S = 5.0
_MAX_HANDSHAKES = 64  # connections being authenticated at once; beyond, the oldest is dropped
_POLL_S = 0.05
_TCP_INFO = struct.Struct("=8xQ")  # struct tcp_info: tcpi_delivery_rate is the u64 at byte 160
_TCP_INFO_AT = 160 - 8
_SAMPLE_BYTES = 1 << 20  # messages after which the link's delivery rate is sampled
_LOCAL_PREFIX = b"\0hetccl-"  # abstract Unix socket names (Linux): no file, gone with the process
_LOCAL_BUFFER_BYTES = 4 << 20  # a Unix socket's default buffer (208 KiB) would wake the drive loop 20x per 4 MiB


def _host_id() -> str:
    """This host and network namespace ("" where that cannot be told: TCP only)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{boot.read().strip()}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return ""


class Address(NamedTuple):
    """Where a border listens: TCP host and port; ``local``: its host id and abstract Unix
    socket name ("host/name"), where it listens on one."""

    host: str
    port: int
    local: str = ""


def _local_listener() -> tuple[Optional[socket.socket], str]:
    """A listening abstract Unix socket and its "host/name" (None, "" where there is none)."""
    host = _host_id()
    if not host or not hasattr(socket, "AF_UNIX"):
        return None, ""
    name = secrets.token_hex(8)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(_LOCAL_PREFIX + name.encode())
        sock.listen(128)
    except OSError:
        sock.close()
        return None, ""
    return sock, f"{host}/{name}"


def delivery_rate(sock: socket.socket) -> Optional[tuple[float, bool]]:
    """The kernel's estimate of what the connection delivers (bytes/s) and whether the sender
    limited that sample (it had nothing to send); None where TCP_INFO does not say (not Linux)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 168)
    except (AttributeError, OSError):
        return None
    if len(info) < 168:
        return None
    (rate,) = _TCP_INFO.unpack_from(info, _TCP_INFO_AT)
    return float(rate), bool(info[7] & 1)


def _byte_view(buf: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if not buf.numel():
        return memoryview(bytearray())
    return memoryview((buf if buf.dim() == 1 else buf.reshape(-1)).view(torch.uint8).numpy())


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Blocking receive of exactly ``len(view)`` bytes (handshakes only)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, CHUNK_BYTES))
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k


def _closed_by_peer(link: "_Link") -> bool:
    """Whether an idle link's peer has closed it (an end of stream waits unread): a redialling
    border dials again rather than send into it."""
    if link.sends or link.recvs:
        return False
    try:
        return link.sock.recv(1, socket.MSG_PEEK) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


def _proof(secret: bytes, challenge: bytes, rank: int) -> bytes:
    return hmac.new(secret, challenge + _RANK.pack(rank), hashlib.sha256).digest()


def dial(address: Address, timeout_s: float) -> socket.socket:
    """A connection to ``address``: its Unix socket where it listens on one in this host and
    network namespace (else, or where that fails, TCP)."""
    host, _, name = address.local.partition("/")
    if name and host == _host_id():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(_LOCAL_PREFIX + name.encode())
            return sock
        except OSError:
            sock.close()
    return socket.create_connection((address.host, address.port), timeout=timeout_s)


class _Handshake:
    """One incoming connection being authenticated: the challenge sent, the reply so far."""

    def __init__(self, sock: socket.socket) -> None:
        self.challenge = os.urandom(_CHALLENGE)
        self.reply = bytearray(_RANK.size + _DIGEST)
        self.view, self.got = memoryview(self.reply), 0
        self.deadline = time.monotonic() + _HANDSHAKE_TIMEOUT_S
        try:
            peer = sock.getpeername()
            self.name = "%s:%s" % peer[:2] if isinstance(peer, tuple) else "this host (unix socket)"
        except OSError:
            self.name = "unknown"

    @property
    def complete(self) -> bool:
        return self.got == len(self.reply)


class _DrivenHandle(Handle):
    """A handle whose ``wait`` drives the border's sockets until it is done (whoever drives
    finishes it, and waiters poll it between drives: a flag, no Event)."""

    signal = Flag

    def __init__(self, border: "TcpBorder", peer: int, kind: str) -> None:
        super().__init__(peer, kind)
        self._border = border

    def wait(self, timeout_s: float) -> None:
        self._border.drive(self, timeout_s)
        super().wait(0)


def _host_only(buf: torch.Tensor, what: str, peer: int) -> None:
    if buf.device.type != "cpu":
        raise HetCCLInputError(f"TCP border: a {what} with rank {peer} of {buf.device} memory; the border moves "
                               "host memory, device buffers are staged by the runner")


class _Outgoing:
    """One message on its way out: header and control bytes, then the payload's views (its
    bytes, or its compressed frames, coded as the socket takes them)."""

    def __init__(self, tag: Tag, buf: torch.Tensor, extra: bytes, handle: Handle, link: "_Link") -> None:
        self.handle, self.moved = handle, buf.numel() * buf.element_size()
        policy = link.policy
        self.eligible = policy is not None and policy.eligible(self.moved, buf.dtype)
        self.framed = self.eligible and policy.choose()
        self.pending = [memoryview(header(tag, self.moved, len(extra), self.framed) + extra)]
        self.header_bytes = len(self.pending[0])
        self.wire = 0  # payload bytes written (frames, when framed)
        self.coding = CodecStats()
        if self.framed:
            self.later: Iterator[memoryview] = link.encoder.frames(buf, layout_for(buf.dtype), self.coding)
        else:
            self.pending.append(_byte_view(buf))
            self.later = iter(())

    def step(self, link: "_Link") -> bool:
        """Write what the socket takes; True when the whole message is out. While the socket
        is full, a framed message codes its next chunk (so coding overlaps the wire)."""
        while True:
            self.pending = [view for view in self.pending if len(view)]
            if not self.pending:
                nxt = next(self.later, None)
                if nxt is None:
                    return True
                self.pending.append(nxt)
                continue
            try:
                sent = link.sock.sendmsg(self.pending[:16])
            except BlockingIOError:
                self._code_ahead()
                raise
            self.wire += sent
            while sent:
                head = self.pending[0]
                if sent >= len(head):
                    sent -= len(head)
                    self.pending.pop(0)
                else:
                    self.pending[0] = head[sent:]
                    sent = 0

    def _code_ahead(self) -> None:
        """Code the next chunk now (at most about one frame beyond what waits to be written)."""
        while self.framed and sum(len(view) for view in self.pending) < FRAME_BYTES // 2:
            nxt = next(self.later, None)
            if nxt is None:
                return
            self.pending.append(nxt)

    def finished(self, link: "_Link") -> None:
        """Count the message; a framed one tells the link's policy what coding it cost."""
        self.wire -= self.header_bytes
        if not link.counted:
            return
        link.owner.count(sent=self.moved, wire_sent=self.wire)
        if not self.eligible:
            return
        if self.framed:
            link.policy.note_encode(self.coding.raw, self.coding.wire, self.coding.seconds)
        sample = delivery_rate(link.sock) if self.moved >= _SAMPLE_BYTES else None  # a short one's reads low
        if sample is not None:
            link.policy.note_link(*sample)


class _Incoming:
    """One posted receive: header, control bytes, then the payload into ``buf`` (or, to be
    reduced into it with ``op``, through a staging buffer)."""

    def __init__(self, tag: Tag, buf: torch.Tensor, op: Optional[str], flexible: bool, handle: Handle,
                 free_bits: int = 0) -> None:
        self.tag, self.buf, self.op, self.flexible, self.handle = tag, buf, op, flexible, handle
        self.free_bits = free_bits  # bits of the sequence number the message may set as it likes
        self.nbytes = buf.numel() * buf.element_size()
        self.moved = 0  # payload bytes the sender announced
        self.wire = 0  # payload bytes on the wire (fewer than moved when framed)
        self.framed, self.reader = False, None
        self.direct = op is None  # lands in ``buf`` as it is, unstaged
        self.header = bytearray(HEADER_SIZE)
        self.view, self.got = memoryview(self.header), 0
        self.phase = "header"
        self.extra = bytearray()
        self.piece_start = 0  # staged payloads: element offset of the piece now landing

    def step(self, link: "_Link") -> bool:
        """Read what the socket has; True when the whole message is in."""
        while True:
            if self.got == len(self.view):
                if self._advance(link):
                    return True
                continue
            k = link.sock.recv_into(self.view[self.got:], min(len(self.view) - self.got, CHUNK_BYTES))
            if k == 0:
                raise ConnectionError("connection closed by peer")
            self.got += k

    def _advance(self, link: "_Link") -> bool:
        """The current part is complete: check it and set up the next; True at the end."""
        if self.phase == "header":
            got, sent, extra, framed = parse_header(bytes(self.header))
            if not matches(got, self.tag, self.free_bits) or (sent != self.nbytes and not self.flexible):
                raise mismatch(link.owner.rank, self.tag, self.nbytes, link.peer, got, sent)
            self.framed, self.handle.tag = framed, got
            if sent != self.nbytes:
                if sent > SPILL_LIMIT:
                    raise mismatch(link.owner.rank, self.tag, self.nbytes, link.peer, got, sent)
                self.handle.spill = bytearray(sent)
            self.moved = sent
            self.phase, self.extra = "extra", bytearray(extra)
            return self._expect(memoryview(self.extra))
        if self.phase == "extra":
            self.handle.extra = bytes(self.extra)
            self.phase = "payload"
            if self.framed:
                self.reader = self._frame_reader(link)
                return self._next_frame_part()
            if self.handle.spill is not None:
                return self._expect(memoryview(self.handle.spill))
            if self.direct:
                return self._expect(_byte_view(self.buf))
            return self._expect(self._landing(link))
        if self.reader is not None:
            self.reader.filled()
            return self._next_frame_part()
        self.wire = self.moved
        if self.handle.spill is not None or self.direct:
            return True
        flat = self.buf.reshape(-1)
        n = len(self.view) // flat.element_size()
        self._land(flat[self.piece_start:self.piece_start + n], link.staging_for(len(self.view))[:len(self.view)])
        self.piece_start += n
        return self.piece_start >= flat.numel() or self._expect(self._landing(link))

    def _land(self, piece: torch.Tensor, received: torch.Tensor) -> None:
        """Staged bytes reduced with ``op`` into their place in ``buf``."""
        combine(piece, received.view(piece.dtype), self.op)

    def _frame_reader(self, link: "_Link") -> FrameReader:
        """Decodes a framed payload: straight into ``buf`` (or the spill), else through a
        staging buffer into the reduction."""
        layout = layout_for(self.buf.dtype)
        if layout is None:
            raise HetCCLPeerError(f"rank {link.peer} sent compressed frames of {self.buf.dtype}, which has no codec")
        if self.handle.spill is not None:
            whole = torch.frombuffer(self.handle.spill, dtype=torch.uint8)
        else:
            whole = self.buf.reshape(-1).view(torch.uint8) if self.direct else None
        if whole is not None:
            return FrameReader(layout, self.moved, link.decoder,
                               lambda offset, n: whole[offset:offset + n], lambda offset, n: None)
        flat, size = self.buf.reshape(-1), self.buf.element_size()
        staging = link.frame_staging()
        return FrameReader(layout, self.moved, link.decoder, lambda offset, n: staging[:n],
                           lambda offset, n: self._land(flat[offset // size:(offset + n) // size], staging[:n]))

    def _next_frame_part(self) -> bool:
        view = self.reader.want()
        if view is None:
            self.wire = self.reader.stats.wire
            return True
        return self._expect(view)

    def _landing(self, link: "_Link") -> memoryview:
        """Host bytes for the next piece of a payload reduced as it lands."""
        flat = self.buf.reshape(-1)
        step = max(REDUCE_CHUNK_BYTES // flat.element_size(), 1)
        n = min(step, flat.numel() - self.piece_start)
        return memoryview(link.staging_for(step * flat.element_size())[:n * flat.element_size()].numpy())

    def _expect(self, view: memoryview) -> bool:
        self.view, self.got = view, 0
        return False

    def finished(self, link: "_Link") -> None:
        """Count the message; a framed one tells the link's policy what decoding cost."""
        if not link.counted:
            return
        link.owner.count(received=self.moved, wire_received=self.wire)
        if self.reader is not None and link.policy is not None:
            link.policy.note_decode(self.moved, self.reader.stats.seconds)


class _Link:
    """One connection to one peer: FIFO queues of outgoing and posted incoming messages."""

    def __init__(self, owner: "TcpBorder", peer: int, sock: socket.socket) -> None:
        self.owner, self.peer, self.sock = owner, peer, sock
        self.counted = peer not in owner.local
        self.error: Optional[BaseException] = None
        self._scratch = ScratchPool()
        self.same_host = sock.family == getattr(socket, "AF_UNIX", None)
        # a codec never beats a copy between processes of one host; "on" still compresses
        compress = "off" if self.same_host and owner.compress == "auto" else owner.compress
        self.policy = LinkPolicy(compress) if self.counted else None
        self.encoder, self.decoder = Encoder(), Decoder()
        self.sends: "collections.deque[_Outgoing]" = collections.deque()
        self.recvs: "collections.deque[_Incoming]" = collections.deque()

    def frame_staging(self) -> torch.Tensor:
        """Where a decoded frame lands before it is reduced into its place."""
        return self._scratch.grown("frame", FRAME_BYTES, lambda n: torch.empty(n, dtype=torch.uint8))

    def staging_for(self, nbytes: int) -> torch.Tensor:
        """Where ``nbytes`` of a payload land before they are reduced into their place."""
        return self._scratch.grown("staging", nbytes, lambda n: torch.empty(n, dtype=torch.uint8))

    def progress(self) -> bool:
        """Move every queued message as far as the socket allows; True if one finished."""
        try:
            return self._drain(self.sends) | self._drain(self.recvs)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller
            self.end(exc)
            return True

    def end(self, exc: BaseException) -> None:
        """Fail the link with ``exc``; the stream is out of step, so the peer hears it now
        (the connection shut down) rather than at its deadline."""
        self.fail(exc)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _drain(self, queue: "collections.deque") -> bool:
        """Finish queued messages in order until the socket would block; count their bytes."""
        finished = False
        while queue:
            try:
                if not queue[0].step(self):
                    break
            except (BlockingIOError, InterruptedError):
                break
            item = queue.popleft()
            item.finished(self)
            item.handle.finish()
            finished = True
        return finished

    def fail(self, exc: BaseException) -> None:
        """The link is unusable: every queued message ends with the error, and so will later ones."""
        if not isinstance(exc, (HetCCLMismatchError, HetCCLPeerError)):
            exc = HetCCLPeerError(f"border link rank {self.owner.rank} <-> rank {self.peer} failed: {exc}")
        self.error = self.error or exc
        for queue in (self.sends, self.recvs):
            while queue:
                queue.popleft().handle.finish(self.error)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.fail(HetCCLPeerError(f"border of rank {self.owner.rank} closed"))


class TcpBorder(ByteCounter):
    """Border over TCP sockets. The lower rank of a pair connects; the higher accepts.

    Counts the payload bytes of messages to and from peers outside ``local`` (this rank's
    island): the bytes that cross island boundaries."""

    def __init__(self, rank: int, bind_host: str, compress: str = "auto", redial: bool = False,
                 same_host: bool = True) -> None:
        """``redial``: a failed link is replaced by a fresh connection at its next use (the
        direct-transfer channel, whose transfers are independent), instead of failing every
        later message (a group's border, whose failure breaks the group). ``same_host``:
        also listen on, and dial peers of this host on, an abstract Unix socket."""
        super().__init__()
        self.rank = rank
        self.compress = compress
        self.redial = redial
        self.rejected = 0
        self.local: frozenset[int] = frozenset()
        self._secret = b""
        self._ready = threading.Event()
        self._addresses: dict[int, Address] = {}
        self._links: dict[int, _Link] = {}
        self._cond = threading.Condition()
        self._drive_lock = threading.Lock()
        self._dial_lock = threading.Lock()
        self._closed = False
        self._dropped: dict[int, float] = {}  # peer -> when drop() ended its link (wakes its dialler's wait)
        self._listener = socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((bind_host, 0))
        self._listener.listen(128)
        self._local_listener, local = _local_listener() if same_host else (None, "")
        self.address = Address(bind_host, self._listener.getsockname()[1], local)
        # the listeners are registered here, not on the thread: a border closed at once would
        # close them under it (EBADF on the acceptor)
        selector = selectors.DefaultSelector()
        for listener in (self._listener, self._local_listener):
            if listener is not None:
                listener.setblocking(False)
                selector.register(listener, selectors.EVENT_READ)
        self._acceptor = threading.Thread(target=self._accept_loop, args=(selector,), daemon=True,
                                          name=f"hetccl-accept-{rank}")
        self._acceptor.start()

    def __repr__(self) -> str:
        return f"TcpBorder(rank={self.rank}, address={self.address}, links={sorted(self._links)})"

    def set_peers(self, addresses: dict[int, tuple], secret: bytes, local: frozenset[int] = frozenset()) -> None:
        """Where every other rank listens (an :class:`Address`, or host and port), the group's
        secret (from the rendezvous), and the ranks of this rank's island, whose traffic is
        not counted as crossing the border."""
        self._addresses = {peer: Address(*address) for peer, address in addresses.items()}
        self._secret = secret
        self.local = frozenset(local)
        self._ready.set()

    def compression(self) -> dict[int, dict]:
        """The compression choice and estimates of each link to another island, by peer."""
        with self._cond:
            links = list(self._links.values())
        return {link.peer: link.policy.describe() for link in links if link.policy is not None}

    def device_memory(self, peer: int, device: Any) -> bool:
        return False  # sockets read and write host memory only

    def isend(self, peer: int, buf: torch.Tensor, tag: Tag, timeout_s: float = 60.0, extra: bytes = b"") -> Handle:
        """Queue a message and write what the socket takes now; ``extra``: control bytes."""
        _host_only(buf, "send", peer)
        handle = _DrivenHandle(self, peer, "send")
        self.messages_sent += 1
        link = self._link(peer, timeout_s)
        if link.error is not None:
            handle.finish(link.error)
            return handle
        link.sends.append(_Outgoing(tag, buf, extra, handle, link))
        if self._drive_lock.acquire(blocking=False):
            try:
                link.progress()
            finally:
                self._drive_lock.release()
        return handle

    def irecv(self, peer: int, buf: torch.Tensor, tag: Tag, op: Optional[str] = None,
              timeout_s: float = 60.0, flexible: bool = False, free_bits: int = 0) -> Handle:
        """Post a receive. ``flexible``: a payload of another size than ``buf`` is not an error
        but lands in ``handle.spill`` (so calls that disagree can still be compared);
        ``free_bits``: the message's sequence number may differ from ``tag``'s in these bits
        (the tag it carried is in ``handle.tag``)."""
        _host_only(buf, "receive", peer)
        handle = _DrivenHandle(self, peer, "recv")
        link = self._link(peer, timeout_s)
        if link.error is not None:
            handle.finish(link.error)
        else:
            link.recvs.append(_Incoming(tag, buf, op, flexible, handle, free_bits))
        return handle

    def drive(self, handle: Handle, timeout_s: float) -> None:
        """Progress every link with queued work until ``handle`` is done or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while not handle.done:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HetCCLTimeoutError(f"{handle.kind} with rank {handle.peer} did not complete within "
                                         f"{timeout_s:.1f}s")
            if not self._drive_lock.acquire(timeout=min(left, _POLL_S)):
                continue
            try:
                self._drive_until(handle, deadline)
            finally:
                self._drive_lock.release()

    def _drive_until(self, handle: Handle, deadline: float) -> None:
        """With the drive lock: non-blocking progress, then ``select`` while nothing moves."""
        while not handle.done and time.monotonic() < deadline:
            with self._cond:
                busy = [link for link in self._links.values() if link.sends or link.recvs]
            if not any([link.progress() for link in busy]) and not handle.done:
                readers = [link.sock for link in busy if link.recvs]
                writers = [link.sock for link in busy if link.sends]
                if not readers and not writers:
                    return  # the handle's link is not connected yet: wait outside the lock
                try:
                    select.select(readers, writers, [], min(max(deadline - time.monotonic(), 0), _POLL_S))
                except (OSError, ValueError):  # a socket closed under us: progress() reports it
                    if self._closed:
                        for link in busy:
                            link.fail(HetCCLPeerError(f"border of rank {self.rank} closed"))

    def first_arrival(self, expected: dict[int, Tag], timeout_s: float) -> int:
        """A receive from any source: the first peer whose next unread message carries the tag
        ``expected[peer]`` (read with MSG_PEEK, so the message stays for the receive that follows).
        A peer whose next message is another one (a later op's) is looked at again each poll."""
        deadline = time.monotonic() + timeout_s
        links = {peer: self._link(peer, timeout_s) for peer in expected}
        while True:
            waiting = []
            for peer, link in links.items():
                if link.error is not None:
                    raise link.error
                if link.recvs:  # its stream belongs to a posted receive
                    continue
                try:
                    head = link.sock.recv(HEADER_SIZE, socket.MSG_PEEK)
                except (BlockingIOError, InterruptedError):
                    waiting.append(link.sock)
                    continue
                if not head:
                    link.fail(ConnectionError("connection closed by peer"))
                elif len(head) == HEADER_SIZE and parse_header(head)[0] == expected[peer]:
                    return peer
            left = deadline - time.monotonic()
            if left <= 0:
                raise HetCCLTimeoutError(f"rank {self.rank}: no message from any of ranks {sorted(expected)} "
                                         f"within {timeout_s:.1f}s")
            poll = _POLL_S if len(waiting) == len(links) else 0.001  # busy links: look again soon
            select.select(waiting, [], [], min(left, poll))

    def gone(self, peer: int) -> bool:
        """Whether the idle link to ``peer`` failed or its peer closed it (its process died)."""
        with self._cond:
            link = self._links.get(peer)
            return link is not None and (link.error is not None or _closed_by_peer(link))

    def drop(self, peer: int, error: BaseException) -> None:
        """End the link to ``peer`` now: its queued messages fail with ``error`` and the peer
        sees the connection close (an aborted or timed-out transfer leaves no stream out of step)."""
        with self._cond:
            link = self._links.get(peer)
            self._dropped[peer] = time.monotonic()
            self._cond.notify_all()
        if link is not None:
            link.end(error)

    def _usable(self, peer: int) -> Optional[_Link]:
        """The link to ``peer``, if there is one to use (a redialling border drops a dead one)."""
        with self._cond:
            link = self._links.get(peer)
            if link is not None and self.redial and (link.error is not None or _closed_by_peer(link)):
                del self._links[peer]
                link.sock.close()
                link = None
        return link

    def _link(self, peer: int, timeout_s: float) -> _Link:
        link = self._usable(peer)
        if link is not None:
            return link
        if peer == self.rank or peer not in self._addresses:
            raise ValueError(f"rank {self.rank} has no border address for rank {peer}")
        if self.rank < peer:
            with self._dial_lock:  # threads that need the same new link: one dials, the others take it
                return self._usable(peer) or self._connect(peer, timeout_s)
        started = time.monotonic()
        deadline = started + timeout_s
        with self._cond:
            while peer not in self._links:
                left = deadline - time.monotonic()
                if self._dropped.get(peer, started - 1) >= started:
                    raise HetCCLPeerError(f"rank {self.rank}: the wait for rank {peer} to connect was aborted")
                if left <= 0 or self._closed:
                    raise HetCCLTimeoutError(
                        f"rank {self.rank}: rank {peer} did not connect to the border within {timeout_s:.1f}s")
                self._cond.wait(left)
            return self._links[peer]

    def connect_all(self, timeout_s: float) -> None:
        """Open every connection now rather than on first use: this rank dials the higher ranks
        (answered by their acceptor threads), then waits for the lower ones to dial it."""
        deadline = time.monotonic() + timeout_s
        for peer in sorted(self._addresses, key=lambda p: (p < self.rank, p)):
            self._link(peer, max(deadline - time.monotonic(), 0.1))

    def _connect(self, peer: int, timeout_s: float) -> _Link:
        """Dial ``peer`` and prove the secret; a connection its listener dropped (a flood of
        strangers filling its handshake slots) is dialled again until ``timeout_s``."""
        address = self._addresses[peer]
        deadline, pause = time.monotonic() + timeout_s, 0.01
        while True:
            try:
                sock = dial(address, max(deadline - time.monotonic(), 0.1))
                try:
                    challenge = bytearray(_CHALLENGE)
                    _recv_exact(sock, memoryview(challenge))
                    sock.sendall(_RANK.pack(self.rank) + _proof(self._secret, bytes(challenge), self.rank))
                    ok = bytearray(2)
                    _recv_exact(sock, memoryview(ok))
                except BaseException:
                    sock.close()
                    raise
                if bytes(ok) != b"OK":
                    sock.close()
                    raise ConnectionError("peer refused the handshake")
                return self._register(peer, sock)
            except OSError as exc:
                dropped = isinstance(exc, ConnectionError) and not isinstance(exc, ConnectionRefusedError)
                if not dropped or time.monotonic() + pause >= deadline:  # nobody listens: say so now
                    raise HetCCLPeerError(f"rank {self.rank} could not connect to rank {peer} at "
                                          f"{address.host}:{address.port}: "
                                          f"{exc}") from exc
                time.sleep(pause)
                pause = min(2 * pause, 0.5)

    def _register(self, peer: int, sock: socket.socket) -> _Link:
        sock.setblocking(False)
        if sock.family == getattr(socket, "AF_UNIX", None):
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, option, _LOCAL_BUFFER_BYTES)  # capped by the kernel's max
        else:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._cond:
            old = self._links.get(peer)
            if old is None or self.redial:  # a peer that dials again has given up the old link
                link = self._links[peer] = _Link(self, peer, sock)
            else:
                link, old = old, None
                sock.close()
            self._cond.notify_all()
        if old is not None:
            old.close()
        return link

    def _accept_loop(self, selector: selectors.BaseSelector) -> None:
        """Accept and authenticate connections on this one thread: handshakes are driven by a
        selector, at most ``_MAX_HANDSHAKES`` at once (the oldest dropped first), each within
        ``_HANDSHAKE_TIMEOUT_S``, so a flood of idle or garbage connections costs sockets for a
        few seconds, never threads."""
        listeners = [sock for sock in (self._listener, self._local_listener) if sock is not None]
        pending: "collections.OrderedDict[socket.socket, _Handshake]" = collections.OrderedDict()
        try:
            while not self._closed:
                for key, _ in selector.select(timeout=_POLL_S * 4):
                    try:
                        if key.fileobj in listeners:
                            self._accept_some(selector, pending, key.fileobj)
                        else:
                            self._handshake_step(selector, pending, key.fileobj)
                    except Exception:  # noqa: BLE001 - one connection's fault must not stop accepting
                        logger.exception("hetccl border rank %d: handshake step failed", self.rank)
                        if key.fileobj in pending:
                            self._refuse(selector, pending, key.fileobj, "handshake step failed")
                now = time.monotonic()
                for sock, shake in list(pending.items()):
                    if shake.complete and self._ready.is_set():
                        self._handshake_step(selector, pending, sock)  # it waited for this rank's secret
                    elif now > shake.deadline:
                        self._refuse(selector, pending, sock, "handshake timed out")
        finally:
            for sock in list(pending):
                sock.close()
            selector.close()

    def _accept_some(self, selector: selectors.BaseSelector, pending: dict, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            shake = _Handshake(sock)
            try:
                sock.setblocking(False)
                sock.send(shake.challenge)  # 16 bytes into an empty socket buffer: all of it
            except OSError as exc:
                self._count_refusal(shake.name, exc)
                sock.close()
                continue
            pending[sock] = shake
            selector.register(sock, selectors.EVENT_READ)
            if len(pending) > _MAX_HANDSHAKES:
                oldest = next(iter(pending))
                self._handshake_step(selector, pending, oldest)  # a real peer's proof may be waiting unread
                if oldest in pending:
                    self._refuse(selector, pending, oldest, f"over {_MAX_HANDSHAKES} handshakes pending")

    def _handshake_step(self, selector: selectors.BaseSelector, pending: dict, sock: socket.socket) -> None:
        """Read what the connection sent; admit it once its proof holds the group's secret."""
        shake = pending.get(sock)
        if shake is None:
            return  # dropped earlier in this select round (over the cap): its event is stale
        try:
            if not shake.complete:
                k = sock.recv_into(shake.view[shake.got:])
                if k == 0:
                    raise ConnectionError("closed during the handshake")
                shake.got += k
                if not shake.complete:
                    return
            if not self._ready.is_set():
                return  # verified once set_peers gives the secret (or refused at the deadline)
            (peer,) = _RANK.unpack(bytes(shake.reply[:_RANK.size]))
            proof = bytes(shake.reply[_RANK.size:])
            if not (peer < self.rank and hmac.compare_digest(proof, _proof(self._secret, shake.challenge, peer))):
                raise PermissionError(f"bad credentials (claimed rank {peer})")
            sock.send(b"OK")
        except (OSError, PermissionError, ValueError) as exc:
            self._refuse(selector, pending, sock, exc)
            return
        selector.unregister(sock)
        del pending[sock]
        self._register(peer, sock)

    def _refuse(self, selector: selectors.BaseSelector, pending: dict, sock: socket.socket, why: object) -> None:
        shake = pending.pop(sock)
        selector.unregister(sock)
        sock.close()
        self._count_refusal(shake.name, why)

    def _count_refusal(self, peer_name: str, why: object) -> None:
        with self._cond:
            self.rejected += 1
            first = self.rejected <= 10
        log = logger.warning if first else logger.debug  # a flood logs its first refusals, not all
        log("hetccl border rank %d refused a connection from %s: %s", self.rank, peer_name, why)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            links = list(self._links.values())
            self._links.clear()
            self._cond.notify_all()
        self._listener.close()
        if self._local_listener is not None:
            self._local_listener.close()
        self._acceptor.join(timeout=5)
        for link in links:
            link.close()
