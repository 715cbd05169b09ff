"""In-process FAKES of an island communicator and a border, for testing plans alone.

Named as fakes: they stand in for Gloo/NCCL and TCP only in plan unit tests, where ranks
are threads of one process. Group tests use the real parts on a real Ray cluster;
``loopback_borders`` gives ``run_ranks`` the real TCP border instead of the FAKE one.
"""

from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor
import threading
import time
from typing import Callable, Sequence

import torch

from hetccl_ray.islands.libraries import ranges
from hetccl_ray.runtime.runner import PlanContext
from hetccl_ray.memory import devices
from hetccl_ray.memory.buffers import combine
from hetccl_ray.errors import HetCCLInputError, HetCCLMismatchError, HetCCLTimeoutError
from hetccl_ray.core.topology import Topology
from hetccl_ray.transport.base import Handle, Tag
from hetccl_ray.transport.tcp import TcpBorder


def _poison(buf: torch.Tensor) -> None:
    """Overwrite what a real library leaves undefined, so a plan relying on it fails."""
    buf.fill_(float("nan") if buf.is_floating_point() else 77)


class FakeIsland:
    """FAKE island communicator: ranks are threads that swap copies through a shared hub."""

    def __init__(self, hub: "FakeIslandHub", rank: int) -> None:
        self.hub, self.rank, self.size = hub, rank, hub.size

    def _all(self, buf: torch.Tensor) -> list[torch.Tensor]:
        self.hub.slots[self.rank] = buf.clone()
        self.hub.barrier.wait(timeout=10)
        copies = list(self.hub.slots)
        self.hub.barrier.wait(timeout=10)
        return copies

    def _reduced(self, buf: torch.Tensor, op: str) -> torch.Tensor:
        copies = self._all(buf)
        out = copies[0].clone()
        for other in copies[1:]:
            combine(out, other, op)
        return out

    def allreduce(self, buf, op):
        buf.copy_(self._reduced(buf, op))

    def reduce_scatter(self, buf, counts: Sequence[int], op):
        assert sum(counts) == buf.numel()
        out = self._reduced(buf, op)
        offset, count = ranges(counts)[self.rank]
        _poison(buf)
        buf[offset:offset + count].copy_(out[offset:offset + count])

    def allgather(self, buf, counts):
        assert sum(counts) == buf.numel()
        copies = self._all(buf)
        for owner, (offset, count) in enumerate(ranges(counts)):
            buf[offset:offset + count].copy_(copies[owner][offset:offset + count])

    def gather(self, buf, counts, root):
        copies = self._all(buf)
        if self.rank == root:
            for owner, (offset, count) in enumerate(ranges(counts)):
                buf[offset:offset + count].copy_(copies[owner][offset:offset + count])

    def broadcast(self, buf, root):
        buf.copy_(self._all(buf)[root])

    def reduce(self, buf, root, op):
        out = self._reduced(buf, op)
        if self.rank == root:
            buf.copy_(out)
        else:
            _poison(buf)

    def alltoall(self, out, inp, out_counts, in_counts):
        assert sum(in_counts) == inp.numel() and sum(out_counts) == out.numel()
        self.hub.slots[self.rank] = (inp.clone(), list(in_counts))
        self.hub.barrier.wait(timeout=10)
        sent = list(self.hub.slots)
        self.hub.barrier.wait(timeout=10)
        for src, ((offset, count), (data, counts)) in enumerate(zip(ranges(out_counts), sent)):
            theirs_offset, theirs = ranges(counts)[self.rank]
            assert theirs == count, f"rank {src} sends {theirs} elements, rank {self.rank} expects {count}"
            out[offset:offset + count].copy_(data[theirs_offset:theirs_offset + theirs])

    def send(self, buf, peer):
        self.hub.p2p[(self.rank, peer)].put(buf.clone())

    def recv(self, buf, peer):
        buf.copy_(self.hub.p2p[(peer, self.rank)].get(timeout=10))

    def barrier(self):
        self.hub.barrier.wait(timeout=10)

    def close(self):
        pass


class FakeIslandHub:
    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list = [None] * size
        self.barrier = threading.Barrier(size)
        self.p2p = {(a, b): queue.SimpleQueue() for a in range(size) for b in range(size)}


class _FakeRecv(Handle):
    def __init__(self, border: "FakeBorder", peer: int, buf: torch.Tensor, tag: Tag, op) -> None:
        super().__init__(peer, "recv")
        self.border, self.buf, self.tag, self.op = border, buf, tag, op

    def wait(self, timeout_s: float) -> None:
        try:
            tag, data = self.border.wires[(self.peer, self.border.rank)].get(timeout=timeout_s)
        except queue.Empty:
            raise HetCCLTimeoutError(f"recv from rank {self.peer} timed out") from None
        if tag != self.tag or data.numel() != self.buf.numel():
            raise HetCCLMismatchError(f"expected {self.tag} x{self.buf.numel()}, got {tag} x{data.numel()}")
        if self.op is None:
            self.buf.copy_(data)
        else:
            combine(self.buf, data, self.op)
        self.border.bytes_received += data.numel() * data.element_size()


class FakeBorder:
    """FAKE border: per-pair queues in one process; counts bytes like the real one. A border
    moves host memory: given the emulated device memory of ``refuse``, it raises."""

    def __init__(self, wires: dict, rank: int, refuse: devices.EmulatedDevice | None = None) -> None:
        self.wires, self.rank, self.refuse = wires, rank, refuse
        self.bytes_sent = self.bytes_received = 0

    def device_memory(self, peer, device):
        return False

    def _host_only(self, buf, what):
        if self.refuse is not None and self.refuse.owns(buf):
            raise HetCCLInputError(f"FAKE border of rank {self.rank}: a {what} of emulated device memory")

    def isend(self, peer, buf, tag):
        self._host_only(buf, "send")
        self.wires[(self.rank, peer)].put((tag, buf.clone()))
        self.bytes_sent += buf.numel() * buf.element_size()
        handle = Handle(peer, "send")
        handle.finish()
        return handle

    def irecv(self, peer, buf, tag, op=None):
        self._host_only(buf, "receive")
        return _FakeRecv(self, peer, buf, tag, op)

    def close(self):
        pass


def loopback_borders(topo: Topology) -> list[TcpBorder]:
    """One real TCP border per rank of ``topo`` on loopback, all connected (close them after)."""
    borders = [TcpBorder(r, "127.0.0.1") for r in range(topo.world_size)]
    addresses = {r: b.address for r, b in enumerate(borders)}
    for r, border in enumerate(borders):
        border.set_peers({p: a for p, a in addresses.items() if p != r}, bytes(32),
                         frozenset(topo.island_of(r).ranks) - {r})
    threads = [threading.Thread(target=b.connect_all, args=(10,)) for b in borders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return borders


def run_ranks(island_of_rank: Sequence[str], body: Callable[[PlanContext], object],
              max_lanes: int | None = None, piece_bytes: int | None = None,
              borders: Sequence | None = None, device: devices.EmulatedDevice | None = None) -> tuple[list, list]:
    """Run ``body(ctx)`` on one thread per rank; return each rank's result and border.
    With ``piece_bytes``, plans that pipeline do so in pieces of that size; ``borders``
    (one per rank) replaces the FAKE border, e.g. with an RDMA border on a FAKE NIC; with an
    emulated ``device``, buffers are its memory, each rank's op on a side stream of its own."""
    topo = Topology.from_islands(island_of_rank, max_lanes)
    n = topo.world_size
    hubs = {island.index: FakeIslandHub(island.size) for island in topo.islands}
    wires = {(a, b): queue.SimpleQueue() for a in range(n) for b in range(n)}
    borders = list(borders) if borders is not None else [FakeBorder(wires, r, device) for r in range(n)]
    results: list = [None] * n
    errors: list = []

    def run(rank: int) -> None:
        island = topo.island_of(rank)
        ctx = PlanContext(topo, rank, FakeIsland(hubs[island.index], topo.local_rank(rank)),
                          borders[rank], Tag(1, 0, 0), deadline=time.monotonic() + 60)
        if piece_bytes is not None:
            ctx.pipeline, ctx.piece_bytes = ThreadPoolExecutor(1), piece_bytes
        if device is not None:
            ctx.device, ctx.stream = device, device.new_stream()
        try:
            results[rank] = body(ctx)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            errors.append(exc)
            for hub in hubs.values():
                hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return results, borders
