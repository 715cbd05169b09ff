"""Island communicators: the vendor collective library inside one island.

Each island gets a standalone torch c10d process group (Gloo on CPU, NCCL on NVIDIA, RCCL
through a ROCm build of torch's NCCL), never torch.distributed's default group, so the
user's own ``init_process_group`` stays free and islands never share a communicator.
"""

from __future__ import annotations

import datetime
import functools
from typing import Protocol, Sequence

import torch
import torch.distributed as dist

REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}


class IslandComm(Protocol):
    """Collectives among the ranks of one island, addressed by island-local rank.

    ``counts`` split a flat buffer into consecutive ranges, one per island rank: rank i
    owns ``counts[i]`` elements after ``sum(counts[:i])``.
    """

    rank: int
    size: int

    def allreduce(self, buf: torch.Tensor, op: str) -> None: ...
    def reduce_scatter(self, buf: torch.Tensor, counts: Sequence[int], op: str) -> None:
        """Afterwards each rank's own range holds the island reduction of that range."""
    def allgather(self, buf: torch.Tensor, counts: Sequence[int]) -> None:
        """Each rank's own range is valid before; afterwards all of ``buf`` is, everywhere."""
    def gather(self, buf: torch.Tensor, counts: Sequence[int], root: int) -> None:
        """Each rank's own range is valid before; afterwards all of ``buf`` is, at ``root``."""
    def broadcast(self, buf: torch.Tensor, root: int) -> None: ...
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


class SoloIsland:
    """An island of one rank: every collective is the identity."""

    rank, size = 0, 1

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

    def barrier(self) -> None:
        return None

    def close(self) -> None:
        return None

    def send(self, buf: torch.Tensor, peer: int) -> None:
        raise ValueError(f"an island of one rank has no peer {peer}")

    recv = send


class TorchIsland:
    """An island over a standalone torch c10d process group (Gloo or NCCL/RCCL)."""

    def __init__(self, pg: "dist.ProcessGroup", rank: int, size: int) -> None:
        self.pg, self.rank, self.size = pg, rank, size

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
        self.pg.allreduce([buf], self._opts(dist.AllreduceOptions, op)).wait()

    def reduce_scatter(self, buf: torch.Tensor, counts: Sequence[int], op: str) -> None:
        owners = [r for r, count in enumerate(counts) if count]
        if len(set(counts)) == 1:
            offset, count = ranges(counts)[self.rank]
            out = torch.empty(count, dtype=buf.dtype, device=buf.device)
            self.pg._reduce_scatter_base(out, buf, self._opts(dist.ReduceScatterOptions, op)).wait()
            buf[offset:offset + count].copy_(out)
        elif len(owners) == 1:
            self.reduce(buf, owners[0], op)
        else:
            self.allreduce(buf, op)

    def allgather(self, buf: torch.Tensor, counts: Sequence[int]) -> None:
        spans = ranges(counts)
        if len(set(counts)) == 1:
            offset, count = spans[self.rank]
            self.pg._allgather_base(buf, buf[offset:offset + count].clone()).wait()
            return
        for root, (offset, count) in enumerate(spans):
            if count:
                self.broadcast(buf[offset:offset + count], root)

    def gather(self, buf: torch.Tensor, counts: Sequence[int], root: int) -> None:
        for peer, (offset, count) in enumerate(ranges(counts)):
            if count and peer != root:
                if self.rank == peer:
                    self.send(buf[offset:offset + count], root)
                elif self.rank == root:
                    self.recv(buf[offset:offset + count], peer)

    def broadcast(self, buf: torch.Tensor, root: int) -> None:
        self.pg.broadcast([buf], self._opts(dist.BroadcastOptions, root=root)).wait()

    def reduce(self, buf: torch.Tensor, root: int, op: str) -> None:
        self.pg.reduce([buf], self._opts(dist.ReduceOptions, op, root)).wait()

    def send(self, buf: torch.Tensor, peer: int) -> None:
        self.pg.send([buf], peer, 0).wait()

    def recv(self, buf: torch.Tensor, peer: int) -> None:
        self.pg.recv([buf], peer, 0).wait()

    def barrier(self) -> None:
        self.pg.barrier().wait()

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


def make_island(device_type: str, store: "dist.Store", rank: int, size: int,
                timeout_s: float, host: str = "") -> IslandComm:
    """The island communicator for tensors on ``device_type`` ("cpu" or "cuda")."""
    if size == 1:
        return SoloIsland()
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cpu":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return TorchIsland(dist.ProcessGroupGloo(store, rank, size, opts), rank, size)
    if device_type == "cuda":
        if not nccl_available():
            raise RuntimeError("device tensors need NCCL (NVIDIA) or RCCL (AMD ROCm torch); neither is available")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return TorchIsland(dist.ProcessGroupNCCL(store, rank, size, opts), rank, size)
    raise ValueError(f"no island backend for device type {device_type!r}; supported: cpu (gloo), cuda (nccl/rccl)")
