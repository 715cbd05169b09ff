"""The flat library of one host: collectives over every rank through shared memory.

Where every rank of a group shares a host (and network namespace: the shaped bench's
islands do not), the flat plan need not go through Gloo's loopback sockets: each rank
copies its input into its own segment in /dev/shm, waits at a barrier of counters in a
shared control segment, and reads its peers' segments (NCCL's SHM transport, for CPU
tensors). Allreduce and reduce reduce one slice per rank in place, then copy the slices
out after a second barrier; every rank gets the same bytes.

Segments are double-buffered by op parity: a rank rewrites a half two ops later, after the
next op's first barrier proved every rank done reading it. Files are unlinked as soon as
every rank has mapped them, so nothing is left in /dev/shm when a process dies. Counter
stores are ordered after the data stores only on x86-64 (total store order); elsewhere the
group keeps Gloo.
"""

from __future__ import annotations

import mmap
import os
import platform
import secrets
import time
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hetccl_ray.buffers import combine, copy
from hetccl_ray.collective.island import ranges
from hetccl_ray.errors import HetCCLError, HetCCLTimeoutError
from hetccl_ray.topology import split

_DIR = "/dev/shm"
_STRIDE = 8  # int64 words per rank in the control segment: one cache line each
_MIN_HALF = 64 << 10
_SPIN = 64  # polls that yield the CPU before the barrier sleeps between polls


def _mapped(path: str, nbytes: int, create: bool) -> np.ndarray:
    """The bytes of ``path`` mapped shared (made and reserved first when ``create``: a
    full tmpfs fails here, not with SIGBUS at the first touch)."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.posix_fallocate(fd, 0, nbytes)
        return np.frombuffer(mmap.mmap(fd, nbytes), dtype=np.uint8)
    finally:
        os.close(fd)


class ShmLibrary:
    """The flat plan's ops (allreduce, reduce, broadcast, allgather, reduce_scatter) over
    ``size`` ranks of one host; ``create`` makes it where every rank can map a common file."""

    def __init__(self, prefix: str, control: np.ndarray, rank: int, size: int, timeout_s: float) -> None:
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self._prefix, self._words = prefix, control.view(np.int64)
        self._arrived = self._words[:size * _STRIDE:_STRIDE]
        self._failed = self._words[size * _STRIDE:]  # one word: 1 + the rank that failed
        self._steps, self._ops, self._half, self._generation = 0, 0, 0, 0
        self._segments: list[torch.Tensor] = []

    @classmethod
    def create(cls, store: "dist.Store", rank: int, size: int, timeout_s: float) -> Optional["ShmLibrary"]:
        """The library where every rank maps rank 0's control file (one /dev/shm: the same
        host and IPC namespace), else None on every rank (they agree through ``store``)."""
        path, control = "", None
        if rank == 0:
            path = f"{_DIR}/hetccl-{secrets.token_hex(8)}"
            control = cls._try(lambda: _mapped(path + "-control", (size + 1) * _STRIDE * 8, True))
            store.set("shm/path", path if control is not None else "")
        else:
            path = store.get("shm/path").decode()
            if path:
                control = cls._try(lambda: _mapped(path + "-control", (size + 1) * _STRIDE * 8, False))
        usable = platform.machine() in ("x86_64", "AMD64") and control is not None
        store.set(f"shm/ok/{rank}", "1" if usable else "0")
        agreed = all(store.get(f"shm/ok/{r}") == b"1" for r in range(size))
        if rank == 0 and path:
            os.unlink(path + "-control")  # every rank has mapped it (or given up)
        return cls(path, control, rank, size, timeout_s) if agreed else None

    @staticmethod
    def _try(make) -> Optional[np.ndarray]:
        try:
            return make()
        except OSError:
            return None

    # -- synchronisation ----------------------------------------------------------------------------

    def _barrier(self, what: str) -> None:
        """Arrive at the next step and wait until every rank has (before the deadline)."""
        self._steps += 1
        step = self._steps
        self._arrived[self.rank] = step
        deadline, polls = time.monotonic() + self.timeout_s, 0
        while not (self._arrived >= step).all():
            if self._failed[0]:
                raise HetCCLError(f"shared-memory {what}: rank {int(self._failed[0]) - 1} failed")
            polls += 1
            if polls < _SPIN:
                os.sched_yield()
                continue
            if time.monotonic() > deadline:
                late = [r for r in range(self.size) if self._arrived[r] < step]
                raise HetCCLTimeoutError(f"shared-memory {what}: ranks {late} did not arrive within "
                                         f"{self.timeout_s:.1f}s", late[0])
            time.sleep(20e-6)

    def _grow(self, nbytes: int) -> None:
        """Every rank's segment holds two halves of at least ``nbytes`` (all ranks grow at the
        same op: their calls agree)."""
        if nbytes <= self._half:
            return
        half = max(_MIN_HALF, 1 << (nbytes - 1).bit_length())
        self._generation += 1
        name = lambda r: f"{self._prefix}-{self._generation}-{r}"  # noqa: E731
        try:
            mine = _mapped(name(self.rank), 2 * half, True)
        except OSError as exc:
            self._failed[0] = self.rank + 1
            raise HetCCLError(f"shared-memory segment of {2 * half} B on rank {self.rank}: {exc}") from exc
        try:
            self._barrier("segment growth")  # every rank's new segment exists; the old ones are read
            self._segments = [torch.from_numpy(mine if r == self.rank else _mapped(name(r), 2 * half, False))
                              for r in range(self.size)]
            self._barrier("segment growth")  # every rank mapped every segment
        finally:
            os.unlink(name(self.rank))
        self._half = half

    def _regions(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each rank's half for this op, as ``buf``'s dtype and length."""
        self._grow(buf.nbytes)
        self._ops += 1
        start = (self._ops % 2) * self._half
        return [seg[start:start + buf.nbytes].view(buf.dtype) for seg in self._segments]

    # -- the ops ------------------------------------------------------------------------------------

    def broadcast(self, buf: torch.Tensor, root: int) -> None:
        regions = self._regions(buf)
        if self.rank == root:
            copy(regions[root], buf)
        self._barrier("broadcast")
        if self.rank != root:
            copy(buf, regions[root])

    def allgather(self, buf: torch.Tensor, counts: Sequence[int]) -> None:
        regions, spans = self._regions(buf), ranges(counts)
        offset, count = spans[self.rank]
        copy(regions[self.rank][offset:offset + count], buf[offset:offset + count])
        self._barrier("allgather")
        for r, (offset, count) in enumerate(spans):
            if r != self.rank:
                copy(buf[offset:offset + count], regions[r][offset:offset + count])

    def reduce_scatter(self, buf: torch.Tensor, counts: Sequence[int], op: str) -> None:
        """This rank's range of ``buf`` (its own values already) folds in every peer's."""
        regions = self._regions(buf)
        copy(regions[self.rank], buf)
        self._barrier("reduce_scatter")
        offset, count = ranges(counts)[self.rank]
        self._fold(buf[offset:offset + count], regions, offset, count, op)

    def allreduce(self, buf: torch.Tensor, op: str) -> None:
        self._reduce(buf, op, None)

    def reduce(self, buf: torch.Tensor, root: int, op: str) -> None:
        self._reduce(buf, op, root)

    def _reduce(self, buf: torch.Tensor, op: str, root: Optional[int]) -> None:
        """Each rank reduces its slice in its own segment; after the second barrier every rank
        (``root`` only, for reduce) copies the slices out."""
        regions, slices = self._regions(buf), split(buf.numel(), self.size)
        copy(regions[self.rank], buf)
        self._barrier("allreduce" if root is None else "reduce")
        offset, count = slices[self.rank]
        self._fold(regions[self.rank][offset:offset + count], regions, offset, count, op)
        self._barrier("allreduce" if root is None else "reduce")
        if root is None or root == self.rank:
            for r, (offset, count) in enumerate(slices):
                copy(buf[offset:offset + count], regions[r][offset:offset + count])

    def _fold(self, target: torch.Tensor, regions: list[torch.Tensor], offset: int, count: int, op: str) -> None:
        """``target`` (this rank's values) op= every peer's range, in rank order."""
        for r, region in enumerate(regions):
            if r != self.rank:
                combine(target, region[offset:offset + count], op)

    def barrier(self) -> None:
        self._barrier("barrier")

    def close(self) -> None:
        self._segments = []
