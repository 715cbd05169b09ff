"""torchft's reconfigurable process group over hetccl: fault tolerance across vendors.

torchft (PyTorch's per-step fault tolerance) runs a replica group's cross-replica
collectives through a ``ProcessGroupWrapper`` that its ``Manager`` reconfigures at every
quorum change, over the store it names for that quorum. :class:`ProcessGroupHetCCL` builds a
hetccl group there, so the cross-replica allreduce is hetccl's hierarchical one across
islands: DDP over every rank of every island (one replica per rank), or HSDP-like with islands
as replica groups. The quorum is torchft's Lighthouse; nothing here decides membership.

A re-formed group reuses the costs the first formation measured for a topology of the same
islands (``group.py``'s calibration cache), so a quorum change costs no calibration races.
"""

from __future__ import annotations

import datetime
import threading

import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroupWrapper

from hetccl_ray.doors.torch_backend import HetCCLProcessGroup

NAME = "torchft-hetccl"


class ProcessGroupHetCCL(ProcessGroupWrapper):
    """A reconfigurable hetccl process group for ``torchft.Manager`` (as its
    ``ProcessGroupGloo``): each configure forms a fresh group over the quorum's store; an abort
    closes the old one, so an op blocked on a lost rank fails at once."""

    def __init__(self, timeout: datetime.timedelta = datetime.timedelta(seconds=60)) -> None:
        super().__init__(timeout=timeout)

    def _create_pg(self, store: dist.Store, rank: int, world_size: int) -> dist.ProcessGroup:
        # every member of one quorum calls its group alike, whatever groups it made before
        return HetCCLProcessGroup(store, rank, world_size, self._timeout, name=f"torchft-q{self._quorum_id}",
                                  reuse_costs=True)

    def abort(self, errored: bool = True) -> None:
        pg = self._pg
        super().abort(errored)
        if isinstance(pg, HetCCLProcessGroup):
            pg.group.abort("aborted by torchft (the quorum changed)")
            # its threads and libraries go in the background: an island library op blocked on a
            # lost rank ends at its own deadline, and torchft's configure must not wait for it
            threading.Thread(target=pg.shutdown, daemon=True, name="hetccl-ft-shutdown").start()

    def getBackendName(self) -> str:
        return NAME

    def _wrap_work(self, work: dist.Work, opts: object) -> dist.Work:
        return _DataThere(work)


class _DataThere(dist.Work):
    """A Work whose ``wait()`` returns once its future is complete, with the data there:
    torchft chains its callbacks on the future right after ``wait()`` and expects them to run
    at once (a device op's wait only orders the stream, its future completes later)."""

    def __init__(self, work: dist.Work) -> None:
        super().__init__()
        self._work = work

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        self._work.wait()
        self._work.get_future().wait()
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()
