"""Island communicators: the vendor collective library inside one island.

Each island gets a standalone torch c10d process group (Gloo on CPU, NCCL on NVIDIA, RCCL
through a ROCm build of torch's NCCL), never torch.distributed's default group, so the
user's own ``init_process_group`` stays free and islands never share a communicator.
"""

from __future__ import annotations

import datetime
import functools
import time
from typing import Optional, Protocol, Sequence

import torch
import torch.distributed as dist

from hetccl_ray.memory.buffers import REDUCE_OPS as _OP_NAMES, ScratchPool, combine
from hetccl_ray.memory.devices import Device
from hetccl_ray.errors import HetCCLError, HetCCLTimeoutError

REDUCE_OPS = dict(zip(_OP_NAMES, (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX)))


_PIECE_BYTES, _DEPTH = 512 << 10, 3  # reduce-scatter pipelining: piece size, pieces in flight
_CLOCK_SLACK = 0.01  # the library's clock starts when it takes an op, a moment before its wait
_RS_TAG, _AG_TAG = 1, 2  # Gloo P2P tags of reduce-scatter and allgather traffic; user send/recv use 0


class IslandComm(Protocol):
    """Collectives among the ranks of one island, addressed by island-local rank.

    ``counts`` split a flat buffer into consecutive ranges, one per island rank: rank i
    owns ``counts[i]`` elements after ``sum(counts[:i])``.
    """

    rank: int
    size: int
    library: str  # the library's name, for the bench header

    def allreduce(self, buf: torch.Tensor, op: str) -> None: ...
    def reduce_scatter(self, buf: torch.Tensor, counts: Sequence[int], op: str) -> None:
        """Afterwards each rank's own range holds the island reduction of that range."""
    def allgather(self, buf: torch.Tensor, counts: Sequence[int]) -> None:
        """Each rank's own range is valid before; afterwards all of ``buf`` is, everywhere."""
    def gather(self, buf: torch.Tensor, counts: Sequence[int], root: int) -> None:
        """Each rank's own range is valid before; afterwards all of ``buf`` is, at ``root``."""
    def broadcast(self, buf: torch.Tensor, root: int) -> None: ...
    def alltoall(self, out: torch.Tensor, inp: torch.Tensor, out_counts: Sequence[int],
                 in_counts: Sequence[int]) -> None:
        """``inp``'s i-th range goes to rank i; ``out``'s i-th range comes from rank i."""
    def reduce(self, buf: torch.Tensor, root: int, op: str) -> None: ...
    def send(self, buf: torch.Tensor, peer: int) -> None: ...
    def recv(self, buf: torch.Tensor, peer: int) -> None: ...
    def barrier(self) -> None: ...
    def close(self) -> None: ...


def ranges(counts: Sequence[int]) -> list[tuple[int, int]]:
    """(offset, length) of each rank's range."""
    out, offset = [], 0
    for count in counts:
        out.append((offset, count))
        offset += count
    return out


def _pieces(count: int, step: int) -> list[tuple[int, int]]:
    """(start, length) pieces of ``count`` elements, ``step`` at a time."""
    return [(start, min(step, count - start)) for start in range(0, count, step)]


class SoloIsland:
    """An island of one rank: every collective is the identity."""

    rank, size, library = 0, 1, "one rank"

    def allreduce(self, buf: torch.Tensor, op: str) -> None:
        return None

    def reduce_scatter(self, buf: torch.Tensor, counts: Sequence[int], op: str) -> None:
        return None

    def allgather(self, buf: torch.Tensor, counts: Sequence[int]) -> None:
        return None

    def gather(self, buf: torch.Tensor, counts: Sequence[int], root: int) -> None:
        return None

    def broadcast(self, buf: torch.Tensor, root: int) -> None:
        return None

    def reduce(self, buf: torch.Tensor, root: int, op: str) -> None:
        return None

    def alltoall(self, out: torch.Tensor, inp: torch.Tensor, out_counts: Sequence[int],
                 in_counts: Sequence[int]) -> None:
        out.copy_(inp)

    def barrier(self) -> None:
        return None

    def close(self) -> None:
        return None

    def send(self, buf: torch.Tensor, peer: int) -> None:
        raise ValueError(f"an island of one rank has no peer {peer}")

    recv = send


class TorchIsland:
    """An island over a standalone torch c10d process group (Gloo or NCCL/RCCL).

    ``native``: use the library's reduce-scatter and allgather. Gloo's (torch 2.13, 16 MiB,
    2 ranks in Ray actors here) take 20-30 and 40-60 ms, where its send/recv exchange of
    the halves takes 7 ms, so Gloo islands build both from send/recv.
    """

    def __init__(self, pg: "dist.ProcessGroup", rank: int, size: int, native: bool, timeout_s: float) -> None:
        self.pg, self.rank, self.size = pg, rank, size
        self.native, self.timeout_s = native, timeout_s
        self._scratch = ScratchPool()

    @property
    def library(self) -> str:
        """The vendor library's name (gloo, nccl, ...)."""
        return self.pg.name()

    def _done(self, work: "dist.Work") -> None:
        """Wait for a library op. The library says a wait timed out only in its message (Gloo
        raises a plain RuntimeError), so the type comes from the clock: a failure once the
        library's deadline (``timeout_s``, from the wait) has passed is a ``HetCCLTimeoutError``."""
        started = time.monotonic()
        try:
            work.wait()
        except RuntimeError as exc:
            if time.monotonic() - started >= self.timeout_s * (1 - _CLOCK_SLACK):
                raise HetCCLTimeoutError(f"island library: {exc}") from exc
            raise

    def _staging(self, n: int, like: torch.Tensor, slot: int = -1) -> torch.Tensor:
        return self._scratch.get(slot, n, like)

    @staticmethod
    def _opts(cls, op: str | None = None, root: int | None = None):
        opts = cls()
        if op is not None:
            opts.reduceOp = REDUCE_OPS[op]
        if root is not None:
            opts.rootRank = root
            opts.rootTensor = 0
        return opts

    def allreduce(self, buf: torch.Tensor, op: str) -> None:
        self._done(self.pg.allreduce([buf], self._opts(dist.AllreduceOptions, op)))

    def reduce_scatter(self, buf: torch.Tensor, counts: Sequence[int], op: str) -> None:
        owners = [r for r, count in enumerate(counts) if count]
        if self.native:  # one grouped library call, even for uneven ranges (never ungrouped P2P)
            offset, count = ranges(counts)[self.rank]
            out = self._staging(count, buf)
            opts = self._opts(dist.ReduceScatterOptions, op)
            if len(set(counts)) == 1:
                self._done(self.pg._reduce_scatter_base(out, buf, opts))
            else:
                self._done(self.pg.reduce_scatter([out], [[buf[o:o + n] for o, n in ranges(counts)]], opts))
            buf[offset:offset + count].copy_(out)
        elif len(owners) == 1:
            self.reduce(buf, owners[0], op)
        else:
            self._direct_reduce_scatter(buf, counts, op)

    def _direct_reduce_scatter(self, buf: torch.Tensor, counts: Sequence[int], op: str) -> None:
        """Every rank sends each owner its range; owners reduce what arrives, piece by piece,
        while the next pieces are still in flight (pieces stay in cache: this is memory-bound)."""
        spans = ranges(counts)
        step = max(_PIECE_BYTES // buf.element_size(), 1)
        sends = [self.pg.send([buf[o + start:o + start + n]], peer, _RS_TAG)
                 for peer, (o, count) in enumerate(spans) if peer != self.rank
                 for start, n in _pieces(count, step)]
        offset, count = spans[self.rank]
        mine = buf[offset:offset + count]
        pieces = _pieces(count, step)
        peers = [peer for peer in range(self.size) if peer != self.rank]
        slots = {peer: self._staging(step * _DEPTH, buf, slot=peer).view(_DEPTH, step) for peer in peers}

        def post(i: int) -> list:
            start, n = pieces[i]
            return [self.pg.recv([slots[peer][i % _DEPTH, :n]], peer, _RS_TAG) for peer in peers]

        pending = [post(i) for i in range(min(_DEPTH, len(pieces)))]
        for i, (start, n) in enumerate(pieces):
            works = pending.pop(0)
            for peer, work in zip(peers, works):
                self._done(work)
                combine(mine[start:start + n], slots[peer][i % _DEPTH, :n], op)
            if i + _DEPTH < len(pieces):
                pending.append(post(i + _DEPTH))
        for work in sends:
            self._done(work)

    def allgather(self, buf: torch.Tensor, counts: Sequence[int]) -> None:
        spans = ranges(counts)
        if self.native:  # one grouped library call, even for uneven ranges
            offset, count = spans[self.rank]
            mine = self._staging(count, buf)
            mine.copy_(buf[offset:offset + count])
            if len(set(counts)) == 1:
                self._done(self.pg._allgather_base(buf, mine))
            else:
                self._done(self.pg.allgather([[buf[o:o + n] for o, n in spans]], [mine]))
            return
        offset, count = spans[self.rank]
        works = [self.pg.send([buf[offset:offset + count]], peer, _AG_TAG)
                 for peer in range(self.size) if count and peer != self.rank]
        works += [self.pg.recv([buf[o:o + n]], peer, _AG_TAG) for peer, (o, n) in enumerate(spans)
                  if n and peer != self.rank]
        for work in works:
            self._done(work)

    def gather(self, buf: torch.Tensor, counts: Sequence[int], root: int) -> None:
        """Every range to ``root`` at once: its receives all posted before any is waited for,
        grouped as one library call where the library groups P2P (NCCL/RCCL: ``native``)."""
        spans = [(peer, span) for peer, span in enumerate(ranges(counts)) if span[1] and peer != root]
        if self.rank != root:
            spans = [(peer, span) for peer, span in spans if peer == self.rank]
        if not spans:
            return
        grouped = self.native and hasattr(self.pg, "_start_coalescing")
        if grouped:
            self.pg._start_coalescing(buf.device)
        works = [self.pg.send([buf[o:o + n]], root, 0) if self.rank != root else self.pg.recv([buf[o:o + n]], peer, 0)
                 for peer, (o, n) in spans]
        for work in [self.pg._end_coalescing(buf.device)] if grouped else works:
            self._done(work)

    def broadcast(self, buf: torch.Tensor, root: int) -> None:
        self._done(self.pg.broadcast([buf], self._opts(dist.BroadcastOptions, root=root)))

    def reduce(self, buf: torch.Tensor, root: int, op: str) -> None:
        self._done(self.pg.reduce([buf], self._opts(dist.ReduceOptions, op, root)))

    def alltoall(self, out: torch.Tensor, inp: torch.Tensor, out_counts: Sequence[int],
                 in_counts: Sequence[int]) -> None:
        self._done(self.pg.alltoall_base(out, inp, list(out_counts), list(in_counts), dist.AllToAllOptions()))

    def send(self, buf: torch.Tensor, peer: int) -> None:
        self._done(self.pg.send([buf], peer, 0))

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        self._done(self.pg.recv([buf], peer, 0))

    def barrier(self) -> None:
        self._done(self.pg.barrier())

    def close(self) -> None:
        shutdown = getattr(self.pg, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except RuntimeError:
                pass


@functools.cache
def nccl_available() -> bool:
    """True when torch can run NCCL (or RCCL on a ROCm build) on a visible device."""
    try:
        return bool(torch.cuda.is_available() and dist.is_nccl_available())
    except (RuntimeError, AssertionError):
        return False


def make_island(device: Device, store: "Optional[dist.Store]", rank: int, size: int,
                timeout_s: float, host: str = "", device_index: Optional[torch.device] = None) -> IslandComm:
    """The island communicator for tensors on ``device``: Gloo for host memory (and for the
    emulated device, standing in for NCCL), else the library torch maps the device type to
    (cuda -> NCCL/RCCL, xpu -> XCCL), bound to ``device_index`` so it connects eagerly."""
    if size == 1:
        return SoloIsland()
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = device.island_backend
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return TorchIsland(dist.ProcessGroupGloo(store, rank, size, opts), rank, size, False, timeout_s)
    if backend in ("nccl", "rccl"):
        if not nccl_available():
            raise HetCCLError(f"{device.kind} tensors need NCCL (NVIDIA) or RCCL (AMD ROCm torch); this torch "
                              f"{torch.__version__} has neither on a visible device")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
    elif backend == "xccl" and hasattr(dist, "ProcessGroupXCCL"):
        pg = dist.ProcessGroupXCCL(store, rank, size)
    else:
        raise HetCCLError(f"no island library for {device.kind} tensors: torch maps it to {backend!r}, which this "
                          f"torch {torch.__version__} does not provide")
    if device_index is not None:
        pg.bound_device_id = device_index
        connect = getattr(pg, "eager_connect_single_device", None)
        if callable(connect):
            connect(device_index)  # the first op would otherwise pay the communicator's setup
    return TorchIsland(pg, rank, size, True, timeout_s)
