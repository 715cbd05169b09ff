"""RDMA border: one RC queue pair per peer, zero-copy RDMA WRITE WITH IMMEDIATE.

The protocol is receiver-driven (a rendezvous, as UCX does it): ``irecv`` registers the
destination once (:class:`MRCache`) and sends the peer a clear-to-send control message
(tag, size, address, rkey, chunk size, transfer id). The sender pairs each ``isend`` with
the next clear-to-send from that peer (both sides post in one order, as on the TCP
border), checks tag and size (a mismatch aborts both ends with the same error), and
writes the data in chunks, ``depth`` in flight, each with the transfer id as immediate.
RC delivers one QP's writes in order, so the receiver's k-th arrival is chunk k and a
reduction runs chunk by chunk as the data lands. One progress thread polls the completion
queue; :class:`CompletionRouter` hands each completion to its waiter.

The verbs live behind a small :class:`Nic` interface: ``verbs.PyverbsNic`` on real hardware,
an in-process FAKE in the tests.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Protocol

import torch

from hetccl_ray.memory import devices
from hetccl_ray.memory.buffers import combine
from hetccl_ray.errors import HetCCLMismatchError, HetCCLPeerError, HetCCLTimeoutError, RecordsMissing
from hetccl_ray.transport.base import ByteCounter, Handle, Tag, chunks, mismatch

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
DEPTH = 8  # writes in flight per queue pair
FREE_BYTES = 256 << 20  # landing buffers kept for reuse between transfers, at most
CONTROL_SLOTS = 32  # posted receives per queue pair (control messages and write arrivals)
_WAIT_S = 0.05  # how often blocked threads look at the closed flag


# -- what goes over the wire -----------------------------------------------------------------------

@dataclass(frozen=True)
class ConnInfo:
    """What a peer needs to reach a queue pair: swapped through the group's rendezvous."""

    device: str
    port: int
    qpn: int
    psn: int
    lid: int
    gid: str
    mtu: int

    def to_record(self) -> dict:
        return asdict(self)

    @classmethod
    def from_record(cls, record: dict) -> "ConnInfo":
        return cls(**record)


_CONTROL = struct.Struct("!4sBIQIQQIQI")  # magic, kind, op, seq, dtype, nbytes, addr, rkey, chunk, xfer
CONTROL_SIZE = _CONTROL.size
_MAGIC = b"HRDM"
CTS, ABORT = 1, 2


@dataclass(frozen=True)
class Control:
    """A control message: clear-to-send from a receiver, or a sender's abort of a transfer."""

    kind: int
    tag: Tag
    nbytes: int
    addr: int = 0
    rkey: int = 0
    chunk: int = 0
    xfer: int = 0

    def encode(self) -> bytes:
        return _CONTROL.pack(_MAGIC, self.kind, self.tag.op, self.tag.seq, self.tag.dtype, self.nbytes,
                             self.addr, self.rkey, self.chunk, self.xfer)

    @classmethod
    def decode(cls, raw: bytes) -> "Control":
        magic, kind, op, seq, dtype, nbytes, addr, rkey, chunk, xfer = _CONTROL.unpack(raw[:CONTROL_SIZE])
        if magic != _MAGIC or kind not in (CTS, ABORT):
            raise ValueError(f"bad RDMA control message (magic {magic!r}, kind {kind})")
        return cls(kind, Tag(op, seq, dtype), nbytes, addr, rkey, chunk, xfer)


# -- the NIC interface -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Region:
    """A registered memory region. ``iova`` is the address the NIC knows its start by (the
    virtual address for plain registrations, an offset for dmabuf ones)."""

    addr: int
    length: int
    lkey: int
    rkey: int
    handle: Any = None
    iova: Optional[int] = None

    def at(self, ptr: int) -> int:
        """The NIC's address of the byte at virtual address ``ptr`` inside the region."""
        return ptr if self.iova is None else self.iova + (ptr - self.addr)


@dataclass(frozen=True)
class Completion:
    """One work completion. ``kind``: send, write, recv (a control message) or recv_imm
    (a peer's write landed)."""

    wr_id: int
    qpn: int
    kind: str
    ok: bool = True
    status: str = "success"
    imm: int = 0
    byte_len: int = 0


class QueuePair(Protocol):
    qpn: int

    def info(self) -> ConnInfo: ...
    def connect(self, remote: ConnInfo) -> None: ...
    def post_recv(self, region: Region, addr: int, length: int, wr_id: int) -> None: ...
    def post_send(self, region: Region, addr: int, length: int, wr_id: int) -> None: ...
    def post_write_imm(self, region: Region, addr: int, length: int, remote_addr: int, rkey: int, imm: int,
                       wr_id: int) -> None: ...
    def close(self) -> None: ...


class Nic(Protocol):
    """One RDMA port of this process: a protection domain, a completion queue, queue pairs."""

    name: str

    def memory_path(self, device: torch.device) -> str:
        """How tensors on ``device`` reach the NIC: host, dmabuf, peermem or staged."""
    def register(self, addr: int, length: int, device: torch.device) -> Region: ...
    def deregister(self, region: Region) -> None: ...
    def create_qp(self, send_depth: int, recv_depth: int) -> QueuePair: ...
    def poll(self, max_entries: int) -> list[Completion]: ...
    def close(self) -> None: ...


# -- the pure helpers --------------------------------------------------------------------------------

class MRCache:
    """Memory regions registered once per tensor storage and found again by address range.

    An entry holds a reference to its storage, so the memory cannot be freed and reused
    at the same address while the NIC may still write to it. A transfer holds its regions
    (:meth:`hold` ... :meth:`release`); past ``capacity_bytes`` the least recently used
    entries that no transfer holds are deregistered.
    """

    def __init__(self, register: Callable[[int, int, torch.device], Region], deregister: Callable[[Region], None],
                 capacity_bytes: int = 1 << 30) -> None:
        self._register, self._deregister = register, deregister
        self.capacity_bytes = capacity_bytes
        self._entries: "OrderedDict[tuple[str, int], tuple[Region, Any]]" = OrderedDict()
        self._held: collections.Counter = collections.Counter()  # entry key -> transfers using it now
        self._bytes = 0  # registered, kept as entries come and go: every release checks it
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def registered_bytes(self) -> int:
        return self._bytes

    def region(self, tensor: torch.Tensor) -> Region:
        """The region that covers ``tensor``'s bytes, registering its storage if none does."""
        return self.hold(tensor, count=False)

    def hold(self, tensor: torch.Tensor, count: bool = True) -> Region:
        """:meth:`region`, held by a transfer until :meth:`release` (never deregistered meanwhile)."""
        storage = tensor.untyped_storage()
        base, size = storage.data_ptr(), storage.nbytes()
        addr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        key = (str(tensor.device), base)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0].addr <= addr and addr + nbytes <= entry[0].addr + entry[0].length:
                self._entries.move_to_end(key)
                self.hits += 1
            else:
                if entry is not None and not self._held[key]:  # the storage grew (resize_): register it anew
                    self._drop(key)
                elif entry is not None:  # grew while held: the old region stays registered, out of the count
                    self._bytes -= entry[0].length
                self.misses += 1
                region = self._register(base, size, tensor.device)
                self._entries[key] = (region, storage)
                self._bytes += region.length
                self._evict(keep=key)
            self._held[key] += count
            return self._entries[key][0]

    def release(self, tensor: torch.Tensor) -> None:
        """A transfer that held ``tensor``'s region is done with it."""
        key = (str(tensor.device), tensor.untyped_storage().data_ptr())
        with self._lock:
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]
            self._evict()

    def _evict(self, keep: Optional[tuple[str, int]] = None) -> None:
        if self._bytes <= self.capacity_bytes:  # every release asks: no walk while under the bound
            return
        for key in list(self._entries):
            if self.registered_bytes <= self.capacity_bytes:
                return
            if key != keep and not self._held[key]:
                self._drop(key)

    def _drop(self, key: tuple[str, int]) -> None:
        region = self._entries.pop(key)[0]
        self._bytes -= region.length
        self._deregister(region)

    def clear(self) -> None:
        with self._lock:
            for region, _ in self._entries.values():
                self._deregister(region)
            self._entries.clear()
            self._bytes = 0


class CompletionRouter:
    """Work request ids to the callbacks waiting for their completion."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._waiting: dict[int, Callable[[Completion], None]] = {}
        self._lock = threading.Lock()

    def expect(self, on_done: Callable[[Completion], None]) -> int:
        with self._lock:
            wr_id = next(self._ids)
            self._waiting[wr_id] = on_done
        return wr_id

    def route(self, completion: Completion) -> None:
        with self._lock:
            on_done = self._waiting.pop(completion.wr_id, None)
        if on_done is None:
            raise KeyError(f"completion for unknown work request {completion.wr_id} on QP {completion.qpn}")
        on_done(completion)

    def pending(self) -> int:
        return len(self._waiting)


# -- the border ----------------------------------------------------------------------------------------

@dataclass
class _Incoming:
    """A posted receive: where the peer's chunks land and how many have."""

    handle: Handle
    tag: Tag
    buf: torch.Tensor
    landing: torch.Tensor
    op: Optional[str]
    spans: list[tuple[int, int]]
    arrived: int = 0


class _Link:
    """One RC queue pair to one peer, its control slots and its sender thread."""

    def __init__(self, border: "RdmaBorder", peer: int, qp: QueuePair) -> None:
        self.border, self.peer, self.qp = border, peer, qp
        self.error: Optional[BaseException] = None
        self.cts: "queue.Queue[Control]" = queue.Queue()
        self.sends: "queue.Queue" = queue.Queue()
        self.incoming: dict[int, _Incoming] = {}
        self.credits = threading.Semaphore(border.depth)
        self.control = torch.zeros(2 * CONTROL_SLOTS, CONTROL_SIZE, dtype=torch.uint8)
        self.control_region = border.mrs.hold(self.control)  # held for the link's life
        self.send_slots: "queue.Queue[int]" = queue.Queue()
        for slot in range(CONTROL_SLOTS, 2 * CONTROL_SLOTS):
            self.send_slots.put(slot)
        self.xfers = itertools.count(1)
        self.thread = threading.Thread(target=self._send_loop, daemon=True,
                                       name=f"hetccl-rdma-send-{border.rank}->{peer}")

    def start(self) -> None:
        for slot in range(CONTROL_SLOTS):
            self._post_recv(slot)
        self.thread.start()

    def where(self) -> str:
        return f"RDMA {self.border.nic.name} QP {self.qp.qpn} (rank {self.border.rank} <-> rank {self.peer})"

    # -- control messages

    def _post_recv(self, slot: int) -> None:
        row = self.control[slot]
        wr_id = self.border.router.expect(lambda c, slot=slot: self._on_recv(slot, c))
        self.qp.post_recv(self.control_region, self.control_region.at(row.data_ptr()), CONTROL_SIZE, wr_id)

    def send_control(self, message: Control) -> None:
        slot = self._take(self.send_slots, "a free control slot")
        row = self.control[slot]
        row.copy_(torch.frombuffer(bytearray(message.encode()), dtype=torch.uint8))

        def sent(completion: Completion) -> None:
            self.send_slots.put(slot)
            self._check(completion)

        self.qp.post_send(self.control_region, self.control_region.at(row.data_ptr()), CONTROL_SIZE,
                          self.border.router.expect(sent))

    def _on_recv(self, slot: int, completion: Completion) -> None:
        """A control message or a write arrival: act on it, then post the slot again."""
        if not self._check(completion):
            return
        if completion.kind == "recv_imm":
            self._arrived(completion.imm)
        else:
            message = Control.decode(bytes(self.control[slot].numpy()))
            if message.kind == CTS:
                self.cts.put(message)
            else:
                self._abort_incoming(message)
        if self.error is None and not self.border.closed:
            self._post_recv(slot)

    def _check(self, completion: Completion) -> bool:
        if completion.ok:
            return True
        self.fail(HetCCLPeerError(f"{self.where()}: {completion.kind} failed with status '{completion.status}'"))
        return False

    # -- receiving

    def post_incoming(self, handle: Handle, tag: Tag, buf: torch.Tensor, op: Optional[str]) -> None:
        nbytes = buf.numel() * buf.element_size()
        landing = buf if op is None else self.border.take_host(nbytes)  # one per transfer
        with devices.of(landing).using(None):  # a device's context on this thread (dmabuf export needs one)
            region = self.border.mrs.hold(landing)
        chunk = max(self.border.chunk_bytes // buf.element_size(), 1) * buf.element_size()
        xfer = next(self.xfers)
        self.incoming[xfer] = _Incoming(handle, tag, buf, landing, op, chunks(nbytes, chunk))
        if nbytes == 0:
            self._finish_incoming(xfer)
        self.send_control(Control(CTS, tag, nbytes, region.at(landing.data_ptr()), region.rkey, chunk, xfer))

    def _arrived(self, xfer: int) -> None:
        item = self.incoming[xfer]
        offset, length = item.spans[item.arrived]
        item.arrived += 1
        if item.op is not None:  # host memory: folded here, chunk by chunk
            size = item.buf.element_size()
            landed = item.landing.view(torch.uint8)[offset:offset + length].view(item.buf.dtype)
            combine(item.buf.reshape(-1)[offset // size:(offset + length) // size], landed, item.op)
        if item.arrived == len(item.spans):
            self._finish_incoming(xfer)

    def _finish_incoming(self, xfer: int) -> None:
        item = self.incoming.pop(xfer)
        self._release(item)
        self.border.count(received=sum(length for _, length in item.spans))
        item.handle.finish()

    def _release(self, item: "_Incoming") -> None:
        self.border.mrs.release(item.landing)
        if item.landing is not item.buf:
            self.border.give_host(item.landing)

    def _abort_incoming(self, message: Control) -> None:
        item = self.incoming.pop(message.xfer, None)
        if item is not None:
            self._release(item)
            item.handle.finish(mismatch(self.border.rank, item.tag, sum(n for _, n in item.spans), self.peer,
                                        message.tag, message.nbytes))

    # -- sending

    def _send_loop(self) -> None:
        while True:
            item = self.sends.get()
            if item is None:
                return
            handle = item[-1]
            if self.error is not None:
                handle.finish(self.error)
                continue
            try:
                with devices.of(item[1]).using(None):  # the device's context on this thread
                    self._send_one(*item)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                if not isinstance(exc, (HetCCLMismatchError, HetCCLPeerError, HetCCLTimeoutError)):
                    exc = HetCCLPeerError(f"{self.where()} failed: {exc}")
                handle.finish(exc)

    def _send_one(self, tag: Tag, buf: torch.Tensor, handle: Handle) -> None:
        nbytes = buf.numel() * buf.element_size()
        cts = self._take(self.cts, f"the clear-to-send of {tag}")
        if cts.tag != tag or cts.nbytes != nbytes:
            self.send_control(Control(ABORT, tag, nbytes, xfer=cts.xfer))
            raise mismatch(self.peer, cts.tag, cts.nbytes, self.border.rank, tag, nbytes)
        spans = chunks(nbytes, cts.chunk)
        if not spans:
            handle.finish()
            return
        region = self.border.mrs.hold(buf)
        left = [len(spans)]

        def written(completion: Completion) -> None:
            self.credits.release()
            if not self._check(completion):
                handle.finish(self.error)
                return
            left[0] -= 1
            if left[0] == 0:
                self.border.mrs.release(buf)  # every write that read it has completed
                self.border.count(sent=nbytes)
                handle.finish()

        for offset, length in spans:
            self._take_credit()
            wr_id = self.border.router.expect(written)
            self.qp.post_write_imm(region, region.at(buf.data_ptr()) + offset, length, cts.addr + offset,
                                   cts.rkey, cts.xfer, wr_id)

    def _take_credit(self) -> None:
        while not self.credits.acquire(timeout=_WAIT_S):
            self._raise_if_down("a free send credit")

    def _take(self, source: "queue.Queue", what: str) -> Any:
        while True:
            try:
                return source.get(timeout=_WAIT_S)
            except queue.Empty:
                self._raise_if_down(what)

    def _raise_if_down(self, what: str) -> None:
        if self.error is not None:
            raise self.error
        if self.border.closed:
            raise HetCCLPeerError(f"{self.where()}: border closed while waiting for {what}")

    # -- failure and shutdown

    def fail(self, error: BaseException, quiet: bool = False) -> None:
        if self.error is None:
            self.error = error
            if not quiet:
                logger.warning("%s", error)
        for xfer in list(self.incoming):
            self.incoming.pop(xfer).handle.finish(error)

    def close(self) -> None:
        self.sends.put(None)
        self.thread.join(timeout=5)
        self.fail(HetCCLPeerError(f"{self.where()}: border closed"), quiet=True)
        self.qp.close()


class RdmaBorder(ByteCounter):
    """Border over RDMA RC queue pairs, one per peer, all connected by :meth:`connect` through
    ``rendezvous`` (``put(key, record)``, ``wait(keys, deadline)``)."""

    def __init__(self, rank: int, nic: Nic, rendezvous: Any, chunk_bytes: int = CHUNK_BYTES, depth: int = DEPTH,
                 timeout_s: float = 60.0) -> None:
        super().__init__()
        self.rank, self.nic, self.rendezvous = rank, nic, rendezvous
        self.chunk_bytes, self.depth, self.timeout_s = chunk_bytes, depth, timeout_s
        self.closed = False
        self.router = CompletionRouter()
        self.mrs = MRCache(nic.register, nic.deregister)
        self._links: dict[int, _Link] = {}
        self._free: list[torch.Tensor] = []  # host buffers no transfer uses now
        self.device_paths: dict[str, str] = {}  # device kind -> how its memory reaches the NIC (once tried)
        self._buffers_lock = threading.Lock()
        self._lock = threading.Lock()
        self._poller = threading.Thread(target=self._poll_loop, daemon=True, name=f"hetccl-rdma-poll-{rank}")
        self._poller.start()

    def __repr__(self) -> str:
        return f"RdmaBorder(rank={self.rank}, nic={self.nic.name}, links={sorted(self._links)})"

    def isend(self, peer: int, buf: torch.Tensor, tag: Tag) -> Handle:
        handle = Handle(peer, "send")
        self._link(peer).sends.put((tag, buf, handle))
        return handle

    def irecv(self, peer: int, buf: torch.Tensor, tag: Tag, op: Optional[str] = None) -> Handle:
        handle = Handle(peer, "recv")
        link = self._link(peer)
        if link.error is not None:
            handle.finish(link.error)
        else:
            link.post_incoming(handle, tag, buf, op)
        return handle

    def device_memory(self, peer: int, device: Any) -> bool:
        """Whether the NIC registers ``device``'s memory (dmabuf or peer memory), tried once per
        device kind on a small buffer: a registration that fails is said once and the runner
        stages that device's buffers through host memory (``device_paths`` says "staged")."""
        with self._lock:
            if device.kind not in self.device_paths:
                self.device_paths[device.kind] = self._probe(device)
            return self.device_paths[device.kind] != "staged"

    def _probe(self, device: Any) -> str:
        probe = device.buffer(4096)
        path = self.nic.memory_path(probe.device)
        if path == "staged":
            return path
        try:
            with device.using(None):  # the device's context on this thread (dmabuf export needs one)
                self.nic.deregister(self.nic.register(probe.data_ptr(), probe.numel(), probe.device))
            return path
        except Exception as exc:  # noqa: BLE001 - a verbs or driver error: staging always works
            logger.warning("RDMA %s: registering %s memory (%s) failed (%s); its buffers are staged through host "
                           "memory", self.nic.name, device.kind, path, exc)
            return "staged"

    def take_host(self, nbytes: int) -> torch.Tensor:
        """A host buffer of ``nbytes`` that no transfer in flight uses, where a partial lands
        before it is folded. Kept for reuse up to ``FREE_BYTES`` (their memory regions stay
        registered while the MR cache keeps them); :meth:`give_host` when done."""
        with self._buffers_lock:
            fits = [buf for buf in self._free if buf.numel() >= nbytes]
            if fits:
                buf = min(fits, key=torch.Tensor.numel)
                self._free.remove(buf)
            else:
                buf = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        return buf[:nbytes]

    def give_host(self, view: torch.Tensor) -> None:
        """A buffer from :meth:`take_host` is free again (its transfer completed or failed)."""
        with self._buffers_lock:
            self._free.append(view._base if view._base is not None else view)
            while sum(buf.numel() for buf in self._free) > FREE_BYTES:
                self._free.remove(min(self._free, key=torch.Tensor.numel))

    def connect(self, peers: list[int]) -> None:
        """Create a queue pair for every peer, publish them all, then connect each: all first,
        so that ranks reaching their peers in different orders never wait on each other."""
        try:
            qps = {peer: self.nic.create_qp(self.depth + CONTROL_SLOTS, CONTROL_SLOTS) for peer in peers}
        except Exception as exc:  # noqa: BLE001 - a verbs error, named with the device
            raise HetCCLPeerError(f"RDMA {self.nic.name}: rank {self.rank} could not create queue pairs: {exc}") \
                from exc
        for peer, qp in qps.items():
            self.rendezvous.put(f"rdma/{self.rank}->{peer}", qp.info().to_record())
        keys = {peer: f"rdma/{peer}->{self.rank}" for peer in peers}
        try:
            records = self.rendezvous.wait(list(keys.values()), time.monotonic() + self.timeout_s)
        except RecordsMissing as exc:
            for qp in qps.values():
                qp.close()
            missing = sorted(peer for peer, key in keys.items() if key in exc.missing)
            raise HetCCLTimeoutError(f"rank {self.rank}: ranks {missing} did not publish their RDMA queue pairs "
                                     f"within {self.timeout_s:.1f}s") from None
        for peer, qp in qps.items():
            remote = ConnInfo.from_record(records[keys[peer]])
            try:
                qp.connect(remote)
            except Exception as exc:  # noqa: BLE001 - a verbs error, named with device and QPs
                raise HetCCLPeerError(f"RDMA {self.nic.name} QP {qp.qpn}: rank {self.rank} could not connect to "
                                      f"rank {peer} ({remote.device} QP {remote.qpn}): {exc}") from exc
            link = _Link(self, peer, qp)
            with self._lock:
                self._links[peer] = link
            link.start()

    def _link(self, peer: int) -> _Link:
        link = self._links.get(peer)
        if link is None:
            state = "is closed" if self.closed else "has no queue pair to that rank"
            raise HetCCLPeerError(f"rank {self.rank}: RDMA border to rank {peer} {state}")
        return link

    def _poll_loop(self) -> None:
        idle = 0
        while not self.closed:
            try:
                done = self.nic.poll(64)
            except Exception as exc:  # noqa: BLE001 - every link learns of it
                self._fail_all(HetCCLPeerError(f"RDMA {self.nic.name}: polling the completion queue failed: {exc}"))
                return
            for completion in done:
                try:
                    self.router.route(completion)
                except Exception as exc:  # noqa: BLE001 - a broken completion fails its link, not the poller
                    self._fail_qp(completion.qpn, HetCCLPeerError(f"RDMA {self.nic.name} QP {completion.qpn}: "
                                                                  f"{exc}"))
            idle = 0 if done else idle + 1
            if idle > 100:  # idle: sleep (the GIL free), longer the longer nothing completes
                time.sleep(min(50e-6 * (idle - 100), 1e-3))

    def _fail_qp(self, qpn: int, error: BaseException) -> None:
        for link in list(self._links.values()):
            if link.qp.qpn == qpn:
                link.fail(error)

    def _fail_all(self, error: BaseException) -> None:
        for link in list(self._links.values()):
            link.fail(error)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.close()
        self._poller.join(timeout=5)
        self.mrs.clear()
        with self._buffers_lock:
            self._free.clear()
        self.nic.close()
