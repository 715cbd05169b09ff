"""The library of one host: collectives over every rank through shared memory.

Where every rank of a group shares a host (and network namespace: the shaped bench's
islands do not), CPU tensors need neither Gloo's loopback sockets nor the border's round
(NCCL's SHM transport, for host memory). Each rank has a control slot in a shared control
segment (a step counter and its call rows) and a data segment in /dev/shm. A step is a
barrier: a rank stores its counter, then waits until every rank's has reached it. The call
check is one step whose rows every rank reads; then each op copies its input into its own
segment, steps, and reads its peers' (allreduce and reduce fold one slice per rank in place,
step again and copy the slices out: every rank gets the same bytes; small ones whose data went
ahead of the check are folded whole by every rank, in rank order, with no step of their own).
Where the ranks may read each other's memory (``process_vm_readv``, as MPI's CMA), a large
all-to-all moves each block once: its receiver pulls it straight from its sender's buffer; so
does a large message (the sender tells where its bytes lie and waits until its receiver counts
them read).

Rows and data are double-buffered by parity: a rank rewrites one two checks later, after
the next check proved every rank done reading it. A rank that must wait sleeps on a futex in
the control segment, which the last to arrive bumps and wakes (one system call wakes every
waiter); where the host has a core per rank it first polls, yielding its core, for half a
millisecond (on a host with more ranks than cores, as MPI's yield-when-idle, it never polls:
a polling rank takes the time of the ranks it waits for). Buffers over ``PIECE_BYTES`` go in pieces, so
segments stay bounded. Files are unlinked once every rank has mapped them: nothing is left in
/dev/shm when a process dies. Counter stores are ordered after the data stores only on x86-64
(total store order); elsewhere the group keeps Gloo and the border's round.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import secrets
import time
from typing import Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from hetccl_ray.memory.buffers import combine, copy, view
from hetccl_ray.islands.libraries import ranges
from hetccl_ray.core.opkinds import pieces
from hetccl_ray.core.plans import Span, piece_of
from hetccl_ray.errors import HetCCLError, HetCCLPeerError, HetCCLTimeoutError
from hetccl_ray.core.topology import split

_DIR = "/dev/shm"
_MIN_HALF = 64 << 10
PIECE_BYTES = 64 << 20  # the largest half of a segment: bigger buffers go in pieces
PULL_BYTES = 256 << 10  # all-to-alls above this per rank are pulled where ranks may read each other's memory
AHEAD_BYTES = 1 << 20  # data up to this goes ahead of the call check (beyond, a step costs little)
# an allreduce (reduce) whose data went ahead, up to this, is folded whole by every rank (the
# root): n folds of the buffer instead of one slice's, and one step fewer (2x2 back to back:
# 1 and 16 KiB allreduce 413 / 421 -> 256 / 325 us; at 64 KiB the folds cost more than the step)
FOLD_ALL_BYTES = 16 << 10
# all-to-all through the segments up to this per rank: each rank's blocks are copied in, then
# out, one phase after the other; larger ones are pulled from their senders (one copy), or where
# ranks cannot read each other's memory go straight over Unix sockets, whose copies overlap
# (2x2 16 MiB 0.89x, 1+2+3 0.72x of Gloo through the segments; 1-1.07x straight)
ALLTOALL_BYTES = 1 << 20
# messages from this size are pulled by their receiver: a send this large already waits for its
# receiver over a Unix socket (whose buffer holds 4 MiB), so pulling it makes no program wait
# that did not; two copies through the socket become one
MESSAGE_PULL_BYTES = 4 << 20
# how long a waiting rank polls, yielding its core between polls, before it sleeps (a time, not a
# count: a cheaper poll must not shorten it; on 2x2 0.2 and 0.5 ms alike, 2 ms slower), where the
# host has a core per rank; with more ranks than cores none (2x2 on 2 cores, 1 KiB broadcast after
# a Gloo call: 342-351 -> 285-299 us, the slowest rank's median)
_SPIN_S = 0.0005
_LIVENESS_S = 0.05  # how often a waiting step asks whether a late rank's process is gone


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1  # x86-64 Linux, shared (not private) futexes
_RECHECK = _Timespec(0, 2_000_000)  # a sleeping rank looks again this often (the deadline, a dead peer)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                                   ctypes.c_ulong, ctypes.c_ulong]


def _pull(pid: int, into: torch.Tensor, address: int) -> Optional[str]:
    """Copy ``into.nbytes`` bytes at ``address`` of process ``pid`` into ``into`` (contiguous,
    host memory): one copy, by the kernel. None, or why it failed."""
    done = 0
    while done < into.nbytes:
        local, remote = _Iovec(into.data_ptr() + done, into.nbytes - done), _Iovec(address + done, into.nbytes - done)
        got = _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got <= 0:
            return os.strerror(ctypes.get_errno()) if got < 0 else "nothing read"
        done += got
    return None


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
    """Call rows and the ops (allreduce, reduce, broadcast, allgather, gather, reduce_scatter,
    alltoall) over ``size`` ranks of one host; ``create`` makes it where every rank maps
    a common file. ``row_width``: the most ints a call row holds. The flat library of a group
    on one host, and the island library of host memory for an island on one host."""

    library = "shared memory"

    def __init__(self, prefix: str, control: np.ndarray, rank: int, size: int, row_width: int,
                 timeout_s: float, gone: Callable[[int], bool], names: Sequence[int],
                 pids: Optional[list[int]]) -> None:
        self.rank, self.size, self.timeout_s, self._gone = rank, size, timeout_s, gone
        self._spin_s = _SPIN_S if size <= len(os.sched_getaffinity(0)) else 0.0
        self._names, self._pids = list(names), pids  # pids: where ranks may read each other's memory
        self._prefix, self._width = prefix, row_width + 1  # a row: its length, then its ints
        self._slot = self._slot_words(row_width, size)
        words = control.view(np.int64)
        self._slots = words[:size * self._slot].reshape(size, self._slot)
        self._arrived = self._slots[:, 0]
        self._rows_at = 8 + 2 * self._row_words(row_width)  # a slot: counter line, two rows, block addresses
        self._where = self._slots[:, self._rows_at:self._rows_at + size]
        self._read_from = self._slots[:, -size:]  # [r, s]: how many of rank s's messages rank r has pulled
        self._offered = [0] * size  # messages this rank offered each rank to pull
        self._failed = words[size * self._slot:]  # one word: 1 + the rank that failed
        self._epoch = control.view(np.int32)[2 * (size * self._slot + 1):][:1]  # the futex: bumped by wakers
        self._epoch_at = ctypes.c_void_p(self._epoch.ctypes.data)
        self._steps, self._checks, self._ops, self._half, self._generation = 0, 0, 0, 0, 0
        self._ahead_of = -1  # the check whose op's data went ahead of it (``ahead``)
        self._pulled_ahead = -1  # the check whose all-to-all's block addresses went ahead of it
        self._segments: list[torch.Tensor] = []
        self._views: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}  # each half as a dtype, kept

    @staticmethod
    def _row_words(row_width: int) -> int:
        """A row's int64 words (its length and ``row_width`` ints), whole cache lines."""
        return -(-(row_width + 1) // 8) * 8

    @classmethod
    def _slot_words(cls, row_width: int, size: int) -> int:
        """A rank's int64 words in the control segment: its counter's cache line, two rows,
        the address of its block for each rank (an all-to-all pulled), then how many messages
        it pulled from each rank, whole cache lines."""
        return 8 + 2 * cls._row_words(row_width) + 2 * -(-size // 8) * 8

    @classmethod
    def control_bytes(cls, size: int, row_width: int) -> int:
        """Every rank's slot, then the failure word's cache line."""
        return (size * cls._slot_words(row_width, size) + 8) * 8

    @classmethod
    def create(cls, store: "dist.Store", rank: int, size: int, row_width: int, timeout_s: float,
               gone: Callable[[int], bool] = lambda rank: False,
               names: Optional[Sequence[int]] = None, pull: bool = True) -> Optional["ShmLibrary"]:
        """The library where every rank maps rank 0's control file (one /dev/shm: the same
        host and IPC namespace), else None on every rank (they agree through ``store``).
        ``names``: each rank's name in errors (its group rank; default its rank here);
        ``gone(name)``: whether that rank's process is known dead (a step then fails at once);
        ``pull``: whether large all-to-alls may be pulled where every rank reads every other's
        memory (tried here: a container's policy may forbid it)."""
        path, control, nbytes = "", None, cls.control_bytes(size, row_width)
        if rank == 0:
            path = f"{_DIR}/hetccl-{secrets.token_hex(8)}"
            control = cls._try(lambda: _mapped(path + "-control", nbytes, True))
            store.set("shm/path", path if control is not None else "")
        else:
            path = store.get("shm/path").decode()
            if path:
                control = cls._try(lambda: _mapped(path + "-control", nbytes, False))
        usable = platform.machine() in ("x86_64", "AMD64") and control is not None
        pids, probe = cls._readable(store, rank, size) if pull else (None, None)
        store.set(f"shm/ok/{rank}", "0" if not usable else "2" if pids else "1")
        oks = [store.get(f"shm/ok/{r}") for r in range(size)]
        agreed, pids = all(ok != b"0" for ok in oks), pids if all(ok == b"2" for ok in oks) else None
        store.set(f"shm/open/{rank}", "1")
        for r in range(size):
            store.get(f"shm/open/{r}")  # every rank mapped the control file and read every probe (or gave up)
        del probe
        if rank == 0 and path:
            os.unlink(path + "-control")
        if not agreed:
            return None
        return cls(path, control, rank, size, row_width, timeout_s, gone, names or range(size), pids)

    @staticmethod
    def _readable(store: "dist.Store", rank: int, size: int) -> tuple[Optional[list[int]], np.ndarray]:
        """Every rank's process id where this rank can read every peer's memory (each peer's
        random probe read back right), else None; and this rank's probe, to keep alive until
        every rank has read it."""
        token = secrets.randbits(62)
        probe = np.array([token, rank], dtype=np.int64)
        store.set(f"shm/probe/{rank}", f"{os.getpid()} {probe.ctypes.data} {token}")
        pids, readable = [], True
        for r in range(size):
            pid, address, want = map(int, store.get(f"shm/probe/{r}").split())
            got = torch.zeros(2, dtype=torch.int64)
            readable = readable and (r == rank or (_pull(pid, got, address) is None and got.tolist() == [want, r]))
            pids.append(pid)
        return (pids if readable else None), probe

    @staticmethod
    def _try(make):
        try:
            return make()
        except OSError:
            return None

    # -- steps and rows -----------------------------------------------------------------------------

    def _step(self, what: str) -> None:
        """Arrive at the next step and wait until every rank has (before the deadline; a rank
        whose process is gone fails it at once)."""
        self._steps += 1
        step = self._steps
        self._arrived[self.rank] = step
        arrived = lambda: min(self._arrived.tolist()) >= step  # noqa: E731 - a poll: 0.1 us, numpy's 1.2
        if arrived():  # the last to arrive: wake the others
            self._wake()
            return
        self._wait(arrived, what,
                   lambda: [self._names[r] for r in range(self.size) if self._arrived[r] < step])

    def _wake(self) -> None:
        """Wake every waiting rank (each looks whether what it waits for is done)."""
        self._epoch[0] += 1  # after this rank's stores: a rank about to sleep sees the change and does not
        _libc.syscall(_SYS_FUTEX, self._epoch_at, _FUTEX_WAKE, 0x7fffffff, None, None, 0)

    def _wait(self, done: Callable[[], bool], what: str, late_of: Callable[[], list[int]],
              missing: str = "did not arrive") -> None:
        """Wait until ``done()`` (before the deadline; ``late_of()``: the ranks, by name, that
        it waits for, failing at once where one's process is gone; ``missing``: what a late
        one did not do, for the timeout's message)."""
        spun = time.monotonic() + self._spin_s
        while time.monotonic() < spun:
            os.sched_yield()
            if done():
                return
        start = asked = time.monotonic()
        while True:
            seen = int(self._epoch[0])  # read before done(): a wake-up after it changes it, and the futex returns
            if done():
                return
            if self._failed[0]:
                raise HetCCLPeerError(f"shared-memory {what}: rank {self._names[int(self._failed[0]) - 1]} failed")
            now = time.monotonic()
            late = late_of()
            if now - asked > _LIVENESS_S:
                asked = now
                dead = [r for r in late if self._gone(r)]
                if dead:
                    raise HetCCLPeerError(f"shared-memory {what}: ranks {dead} are gone (their connections "
                                          f"closed)")
            if now - start > self.timeout_s:
                raise HetCCLTimeoutError(f"shared-memory {what}: ranks {late} {missing} within "
                                         f"{self.timeout_s:.1f}s", late[0])
            _libc.syscall(_SYS_FUTEX, self._epoch_at, _FUTEX_WAIT, seen, ctypes.byref(_RECHECK), None, 0)

    def rows(self, row: Sequence[int]) -> dict[int, list[int]]:
        """Every rank's row by name (this rank's is ``row``): the call check, and a step."""
        if len(row) >= self._width:
            raise HetCCLError(f"a call row of {len(row)} ints is wider than the {self._width - 1} this group holds")
        self._checks += 1
        at = 8 + (self._checks % 2) * (self._rows_at - 8) // 2
        mine = self._slots[self.rank, at:at + self._width]
        mine[0], mine[1:1 + len(row)] = len(row), row
        self._step("call check")
        return {name: self._slots[r, at + 1:at + 1 + int(self._slots[r, at])].tolist()
                for r, name in enumerate(self._names)}

    def barrier(self) -> None:
        self._step("barrier")

    def ahead(self, parts: Sequence[torch.Tensor], pull: bool = False) -> None:
        """Before the next call check: what this rank's op writes first (``parts``, one after
        another), into its next half where it fits, so that the check's step publishes it
        and the op needs no step of its own for it (every rank of a flat op calls this).
        ``pull``: the parts are an all-to-all's blocks, by destination: their addresses go
        ahead, and their data only where this rank's op may not be pulled."""
        self._ahead_of = self._checks + 1
        nbytes = sum(part.nbytes for part in parts)
        if pull and self._pids is not None:
            self._where[self.rank] = [part.data_ptr() for part in parts]
            self._pulled_ahead = self._ahead_of
            if self.pulls(nbytes):
                return
        if nbytes > min(self._half, AHEAD_BYTES):
            return
        at = ((self._ops + 1) % 2) * self._half
        for part in parts:
            copy(self._segments[self.rank][at:at + part.nbytes].view(part.dtype), part)
            at += part.nbytes

    def _fresh(self, nbytes: int, count: int) -> bool:
        """Whether this op's data went ahead of its check: ``ahead`` was called for it and
        the most any rank writes (``nbytes``, agreed) fits one piece. Every rank agrees: they
        agree on the call, the check count and the segments' size."""
        fresh = self._ahead_of == self._checks and count == 1 and nbytes <= min(self._half, AHEAD_BYTES)
        self._ahead_of = -1
        return fresh

    # -- data ---------------------------------------------------------------------------------------

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
            self._step("segment growth")  # every rank's new segment exists; the old ones are read
            self._segments = [torch.from_numpy(mine if r == self.rank else _mapped(name(r), 2 * half, False))
                              for r in range(self.size)]
            self._views = {}
            self._step("segment growth")  # every rank mapped every segment
        finally:
            os.unlink(name(self.rank))
        self._half = half

    def _regions(self, nbytes: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Each rank's next half, as ``dtype``; ``nbytes``: the most any rank writes (agreed)."""
        self._grow(nbytes)
        self._ops += 1
        key = (self._ops % 2, dtype)
        if key not in self._views:
            start = key[0] * self._half
            self._views[key] = [seg[start:start + self._half].view(dtype) for seg in self._segments]
        return self._views[key]

    @staticmethod
    def _count(nbytes: int) -> int:
        """Pieces of at most ``PIECE_BYTES`` for ``nbytes`` (one for none)."""
        return pieces(nbytes, PIECE_BYTES)

    # -- the ops ------------------------------------------------------------------------------------

    def broadcast(self, buf: torch.Tensor, root: int) -> None:
        count = self._count(buf.nbytes)
        fresh = self._fresh(buf.nbytes, count)
        for q in range(count):
            part = view(buf, piece_of((0, buf.numel()), q, count))
            regions = self._regions(part.nbytes, buf.dtype)
            if not fresh:
                if self.rank == root:
                    copy(regions[root][:part.numel()], part)
                self._step("broadcast")
            if self.rank != root:
                copy(part, regions[root][:part.numel()])

    def allreduce(self, buf: torch.Tensor, op: str) -> None:
        self._reduce(buf, op, None)

    def reduce(self, buf: torch.Tensor, root: int, op: str) -> None:
        self._reduce(buf, op, root)

    def _reduce(self, buf: torch.Tensor, op: str, root: Optional[int]) -> None:
        """Each rank reduces its slice in its own segment; after the second step every rank
        (``root`` only, for reduce) copies the slices out. Up to ``FOLD_ALL_BYTES`` whose data
        went ahead of the check, each rank (the root) folds every rank's whole buffer, in rank
        order, so every rank gets the same bytes with no second step."""
        what, count = "allreduce" if root is None else "reduce", self._count(buf.nbytes)
        fresh = self._fresh(buf.nbytes, count)
        if fresh and buf.nbytes <= FOLD_ALL_BYTES:
            regions = self._regions(buf.nbytes, buf.dtype)  # every rank: the halves' parity advances alike
            if root is None or root == self.rank:
                copy(buf, regions[0][:buf.numel()])
                for region in regions[1:]:
                    combine(buf, region[:buf.numel()], op)
            return
        for q in range(count):
            part = view(buf, piece_of((0, buf.numel()), q, count))
            regions, slices = self._regions(part.nbytes, buf.dtype), split(part.numel(), self.size)
            if not fresh:
                copy(regions[self.rank][:part.numel()], part)
                self._step(what)
            self._fold(view(regions[self.rank], slices[self.rank]), regions, slices[self.rank], op)
            self._step(what)
            if root is None or root == self.rank:
                for region, span in zip(regions, slices):
                    copy(view(part, span), view(region, span))

    def allgather(self, buf: torch.Tensor, counts: Sequence[int]) -> None:
        """Each rank's range of ``buf`` to every rank."""
        spans, itemsize = ranges(counts), buf.element_size()
        count = self._count(max(counts) * itemsize)
        fresh = self._fresh(max(counts) * itemsize, count)
        for q in range(count):
            parts = [piece_of(span, q, count) for span in spans]
            regions = self._regions(max(n for _, n in parts) * itemsize, buf.dtype)
            if not fresh:
                copy(view(regions[self.rank], (0, parts[self.rank][1])), view(buf, parts[self.rank]))
                self._step("allgather")
            for r, (region, span) in enumerate(zip(regions, parts)):
                if r != self.rank:
                    copy(view(buf, span), view(region, (0, span[1])))

    def gather(self, buf: torch.Tensor, counts: Sequence[int], root: int) -> None:
        """Each rank's range of ``buf`` to ``root`` (to every rank: a gather costs the steps of
        an allgather here; the other ranks' buffers are the plan's scratch)."""
        self.allgather(buf, counts)

    def reduce_scatter(self, buf: torch.Tensor, counts: Sequence[int], op: str) -> None:
        """This rank's range of ``buf`` (its own values already) folds in every peer's."""
        spans = ranges(counts)
        count = self._count(buf.nbytes)
        fresh = self._fresh(buf.nbytes, count)
        for q in range(count):
            parts = [piece_of(span, q, count) for span in spans]
            regions = self._regions(sum(n for _, n in parts) * buf.element_size(), buf.dtype)
            at = ranges([n for _, n in parts])
            if not fresh:
                for span, slot in zip(parts, at):
                    copy(view(regions[self.rank], slot), view(buf, span))
                self._step("reduce_scatter")
            self._fold(view(buf, parts[self.rank]), regions, at[self.rank], op)

    def alltoall(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                 counts: Sequence[Sequence[int]]) -> None:
        """``inputs[t]`` to rank t, ``outputs[r]`` from rank r; ``counts[r][t]``: what r sends t
        (agreed by every rank's rows). Outputs must not share memory with any rank's inputs
        (a pulled block would be read after its receiver overwrote it)."""
        like = inputs[self.rank]
        most = max(sum(row) for row in counts) * like.element_size()
        if self.pulls(most):
            self._pull_blocks(outputs, inputs, counts, published=self._pulled_ahead == self._checks)
            self._ahead_of = self._pulled_ahead = -1
            return
        count = self._count(most)
        fresh = self._fresh(most, count)
        for q in range(count):
            parts = [[piece_of((0, n), q, count) for n in row] for row in counts]
            slots = [ranges([n for _, n in row]) for row in parts]
            regions = self._regions(max(sum(n for _, n in row) for row in parts) * like.element_size(), like.dtype)
            for t, (span, slot) in enumerate(zip(parts[self.rank], slots[self.rank])):
                if t == self.rank or not fresh:
                    target = view(outputs[t], span) if t == self.rank else view(regions[self.rank], slot)
                    copy(target, view(inputs[t], span))
            if not fresh:
                self._step("alltoall")
            for r in range(self.size):
                if r != self.rank:
                    copy(view(outputs[r], parts[r][self.rank]), view(regions[r], slots[r][self.rank]))

    def takes_alltoall(self, nbytes: int) -> bool:
        """Whether an all-to-all whose largest rank sends ``nbytes`` goes through this library
        (else straight over sockets)."""
        return self._pids is not None or nbytes <= ALLTOALL_BYTES

    def pulls(self, nbytes: int) -> bool:
        """Whether such an all-to-all is pulled from the senders' buffers (one copy per block)."""
        return self._pids is not None and nbytes > PULL_BYTES

    def _pull_blocks(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                     counts: Sequence[Sequence[int]], published: bool) -> None:
        """Each rank reads its block from every sender's memory (each rank starting at a
        different sender), where the senders' addresses were ``published`` ahead of the check
        or are now, with a step; then a step: the senders may reuse their buffers."""
        if not published:
            self._where[self.rank] = [t.data_ptr() for t in inputs]
            self._step("alltoall")
        copy(outputs[self.rank], inputs[self.rank])
        for k in range(1, self.size):
            r = (self.rank + k) % self.size
            if counts[r][self.rank]:
                self._read(r, outputs[r], int(self._where[r, self.rank]), "alltoall")
        self._step("alltoall")

    def _read(self, r: int, into: torch.Tensor, address: int, what: str) -> None:
        """Copy rank ``r``'s bytes at ``address`` into ``into``; a failure fails every rank's
        next wait too."""
        failed = _pull(self._pids[r], into, address)
        if failed is not None:
            self._failed[0] = self.rank + 1
            raise HetCCLPeerError(f"shared-memory {what}: reading rank {self._names[r]}'s buffer on rank "
                                  f"{self._names[self.rank]} failed: {failed}")

    # -- messages: pulled by their receiver --------------------------------------------------------

    def pulls_message(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` from host memory is pulled by its receiver."""
        return self._pids is not None and nbytes >= MESSAGE_PULL_BYTES

    def wait_pulled(self, name: int) -> None:
        """After offering rank ``name`` a message (where its bytes lie): wait until it has read them."""
        r = self._names.index(name)
        self._offered[r] += 1
        offered = self._offered[r]
        self._wait(lambda: self._read_from[r, self.rank] >= offered, f"send to rank {name}", lambda: [name],
                   "did not read the message")

    def pull_message(self, name: int, into: torch.Tensor, address: int) -> None:
        """Read the message rank ``name`` offered (its bytes at ``address``) into ``into``, and
        tell it so."""
        r = self._names.index(name)
        self._read(r, into, address, f"recv from rank {name}")
        self._read_from[self.rank, r] += 1
        self._wake()

    def _fold(self, target: torch.Tensor, regions: list[torch.Tensor], span: Span, op: str) -> None:
        """``target`` (this rank's values) op= every peer's ``span``, in rank order."""
        for r, region in enumerate(regions):
            if r != self.rank:
                combine(target, view(region, span), op)

    def close(self) -> None:
        self._segments, self._views = [], {}
