"""A FAKE in-process RDMA NIC, because this machine has no RDMA device (no HCA, no rxe/siw).

Queue pairs are Python objects of one process and an RDMA WRITE is a ``ctypes.memmove``
between registered host ranges. What a real HCA checks is checked: every local range must
lie in a registered region (lkey), every remote range in the region of the rkey it names,
a receive must be posted before a message or a write-with-immediate can land (held back
until one is, as RC's RNR retry does), and one queue pair delivers in order. With
``delay_s``, writes are done as a real HCA does them: later, by DMA that reads the source
only then (a batch every ``delay_s``), so a source or landing buffer reused before its
completion shows up as corrupt data.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import threading
import time

import torch

from hetccl_ray.transport.rdma import Completion, ConnInfo, Region


class FakeFabric:
    """What the FAKE NICs of one test share: queue pairs by number, regions by key."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.lock = threading.RLock()
        self.qps: dict[int, "FakeQueuePair"] = {}
        self.regions: dict[int, Region] = {}
        self.ids = itertools.count(1)
        self.delay_s = delay_s
        self.pending: "collections.deque" = collections.deque()  # writes posted, not yet done by "DMA"
        if delay_s:
            threading.Thread(target=self._dma, daemon=True, name="fake-dma").start()

    def nic(self, name: str, staged: bool = False) -> "FakeNic":
        return FakeNic(self, name, staged)

    def _dma(self) -> None:
        """Do the posted writes in batches, in posting order, each ``delay_s`` after the last."""
        while True:
            time.sleep(self.delay_s)
            with self.lock:
                while self.pending:
                    self.pending.popleft()()


class FakeNic:
    """FAKE NIC: registers host memory, which includes the emulated device's (GPUDirect,
    emulated); ``staged=True`` says device memory is not reachable (a GPU without dmabuf or
    peer memory), so the runner stages it."""

    def __init__(self, fabric: FakeFabric, name: str, staged: bool = False) -> None:
        self.fabric, self.name, self.staged = fabric, name, staged
        self.completions: "collections.deque[Completion]" = collections.deque()
        self.registered: list[Region] = []
        self.corrupt_rkeys = False  # faults to inject: writes name a wrong rkey;
        self.fail_connect = False   # the RESET -> RTS transition fails
        self.refuse_registration = False  # every registration fails (a driver that cannot export)

    def memory_path(self, device: torch.device) -> str:
        return "host" if device.type == "cpu" and not self.staged else "staged"

    def register(self, addr: int, length: int, device: torch.device) -> Region:
        if self.refuse_registration:
            raise OSError(f"FAKE NIC {self.name}: registration refused")
        if device.type != "cpu":
            raise ValueError(f"FAKE NIC {self.name} registers host memory only, not {device}")
        key = next(self.fabric.ids)
        region = Region(addr, length, lkey=key, rkey=key)
        with self.fabric.lock:
            self.fabric.regions[key] = region
        self.registered.append(region)
        return region

    def deregister(self, region: Region) -> None:
        with self.fabric.lock:
            self.fabric.regions.pop(region.rkey, None)
        self.registered.remove(region)

    def create_qp(self, send_depth: int, recv_depth: int) -> "FakeQueuePair":
        return FakeQueuePair(self, recv_depth)

    def poll(self, max_entries: int) -> list[Completion]:
        out = []
        while self.completions and len(out) < max_entries:
            out.append(self.completions.popleft())
        return out

    def close(self) -> None:
        return None


def _covers(region: Region | None, addr: int, length: int) -> bool:
    return region is not None and region.addr <= addr and addr + length <= region.addr + region.length


class FakeQueuePair:
    """FAKE RC queue pair."""

    def __init__(self, nic: FakeNic, recv_depth: int) -> None:
        self.nic, self.recv_depth = nic, recv_depth
        self.fabric = nic.fabric
        self.qpn = next(self.fabric.ids)
        self.remote: FakeQueuePair | None = None
        self.recvs: "collections.deque[tuple[int, int, int]]" = collections.deque()
        self.arrivals: collections.deque = collections.deque()
        with self.fabric.lock:
            self.fabric.qps[self.qpn] = self

    def info(self) -> ConnInfo:
        return ConnInfo(self.nic.name, 1, self.qpn, psn=self.qpn * 7 % (1 << 24), lid=0,
                        gid="fe80::fa4e:0:0:1", mtu=4096)

    def connect(self, remote: ConnInfo) -> None:
        if self.nic.fail_connect:
            raise RuntimeError("FAKE: failed to modify QP state to RTR")
        with self.fabric.lock:
            self.remote = self.fabric.qps[remote.qpn]

    def _local(self, region: Region, addr: int, length: int) -> None:
        if not _covers(self.fabric.regions.get(region.lkey), addr, length):
            raise ValueError(f"FAKE QP {self.qpn}: [{addr:#x}, +{length}) is outside lkey {region.lkey}")

    def post_recv(self, region: Region, addr: int, length: int, wr_id: int) -> None:
        with self.fabric.lock:
            self._local(region, addr, length)
            if len(self.recvs) >= self.recv_depth:
                raise RuntimeError(f"FAKE QP {self.qpn}: receive queue full ({self.recv_depth})")
            self.recvs.append((addr, length, wr_id))
            self._deliver()

    def post_send(self, region: Region, addr: int, length: int, wr_id: int) -> None:
        with self.fabric.lock:
            self._local(region, addr, length)
            self.remote.arrivals.append(("send", ctypes.string_at(addr, length)))
            self.nic.completions.append(Completion(wr_id, self.qpn, "send", byte_len=length))
            self.remote._deliver()

    def post_write_imm(self, region: Region, addr: int, length: int, remote_addr: int, rkey: int, imm: int,
                       wr_id: int) -> None:
        with self.fabric.lock:
            self._local(region, addr, length)
            if self.fabric.delay_s:
                self.fabric.pending.append(lambda: self._write(addr, length, remote_addr, rkey, imm, wr_id))
            else:
                self._write(addr, length, remote_addr, rkey, imm, wr_id)

    def _write(self, addr: int, length: int, remote_addr: int, rkey: int, imm: int, wr_id: int) -> None:
        with self.fabric.lock:
            target = self.fabric.regions.get(rkey + 1000 if self.nic.corrupt_rkeys else rkey)
            if not _covers(target, remote_addr, length):
                self.nic.completions.append(Completion(wr_id, self.qpn, "write", ok=False,
                                                       status="remote access error"))
                return
            ctypes.memmove(remote_addr, addr, length)
            self.remote.arrivals.append(("imm", imm, length))
            self.nic.completions.append(Completion(wr_id, self.qpn, "write", byte_len=length))
            self.remote._deliver()

    def _deliver(self) -> None:
        """Land what arrived on posted receives, in order (held back while none is posted)."""
        while self.arrivals and self.recvs:
            item = self.arrivals.popleft()
            addr, length, wr_id = self.recvs.popleft()
            if item[0] == "send":
                data = item[1]
                ctypes.memmove(addr, data, min(len(data), length))
                self.nic.completions.append(Completion(wr_id, self.qpn, "recv", byte_len=len(data)))
            else:
                self.nic.completions.append(Completion(wr_id, self.qpn, "recv_imm", imm=item[1], byte_len=item[2]))

    def close(self) -> None:
        with self.fabric.lock:
            self.fabric.qps.pop(self.qpn, None)
