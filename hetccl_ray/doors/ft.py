"""torchft over hetccl: fault tolerance across vendors (its process group, and one rank's loop).

torchft (PyTorch's per-step fault tolerance) runs a replica group's cross-replica
collectives through a ``ProcessGroupWrapper`` that its ``Manager`` reconfigures at every
quorum change, over the store it names for that quorum. :class:`ProcessGroupHetCCL` builds a
hetccl group there, so the cross-replica allreduce is hetccl's hierarchical one across
islands: DDP over every rank of every island (one replica per rank), or HSDP-like with islands
as replica groups. The quorum is torchft's Lighthouse; nothing here decides membership.

A re-formed group reuses the costs the first formation measured for a topology of the same
islands (``group.py``'s calibration cache), so a quorum change costs no calibration races.

:class:`ElasticRank` wires one rank: torchft decides membership and heals a returning
replica, hetccl runs the cross-replica allreduce, Ray (``max_restarts``) brings a killed rank
back. A replica group of its own (one replica per rank), or rank ``group_rank`` of a replica
group of ``group_world`` ranks (an island as one replica group, its gradients averaged inside
first over ``inner``, the island's own library).
"""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

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


@dataclass(frozen=True)
class StepRecord:
    """One committed step of one rank: torchft's step number, how many replica groups took
    part, the wall time from quorum to commit, the loss, and whether this rank was healed
    (loaded a healthy replica's weights) in it."""

    step: int
    participants: int
    seconds: float
    loss: float
    healed: bool


class ElasticRank:
    """One rank under ``torchft.Manager``, its model and optimizer healed from a healthy replica
    when it comes back. ``step(loss_of)`` runs one attempt of torchft's step: quorum, the
    loss of step ``n`` (``loss_of(n)``) backward, gradients averaged inside the replica group
    (``inner``) and across replica groups (hetccl), and the optimizer step where torchft
    commits it; None where the step did not commit (a member was lost: it is tried again).
    ``async_quorum``: torchft's quorum overlaps the step's compute (a returning replica then
    heals but adds no gradient in that step); off, a returning replica heals and takes part in
    the same step, as the replay tests assume."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, replica_id: str, lighthouse: str,
                 *, group_rank: int = 0, group_world: int = 1, store_port: int = 0,
                 inner: Optional[dist.ProcessGroup] = None, min_replicas: int = 1, timeout_s: float = 10.0,
                 async_quorum: bool = False) -> None:
        from torchft import Manager

        self.model, self.optimizer, self.inner, self.group_world = model, optimizer, inner, group_world
        timeout = datetime.timedelta(seconds=timeout_s)
        # the replica group's store, hosted by its rank 0 (torchft names each quorum's keys in it)
        self.store = dist.TCPStore("127.0.0.1", store_port, group_world, group_rank == 0,
                                   timeout=datetime.timedelta(seconds=max(timeout_s, 30)))
        self._healed = False
        self.manager = Manager(pg=ProcessGroupHetCCL(timeout), load_state_dict=self._load, state_dict=self._state,
                               min_replica_size=min_replicas, use_async_quorum=async_quorum, replica_id=replica_id,
                               lighthouse_addr=lighthouse, store_addr="127.0.0.1", store_port=self.store.port,
                               rank=group_rank, world_size=group_world, timeout=timeout,
                               quorum_timeout=datetime.timedelta(seconds=max(timeout_s, 30)), connect_timeout=timeout)

    def _state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def _load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._healed = True

    @property
    def current_step(self) -> int:
        return self.manager.current_step()

    def step(self, loss_of: Callable[[int], torch.Tensor], before_commit: Callable[[int], None] = lambda n: None
             ) -> Optional[StepRecord]:
        """One attempt at the next step (``before_commit(n)``: called with the allreduce posted,
        where a test kills the rank)."""
        started = time.monotonic()
        self._healed = False
        self.manager.start_quorum()
        step = self.manager.current_step()
        self.optimizer.zero_grad()
        loss = loss_of(step)
        loss.backward()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([grad.reshape(-1) for grad in grads])  # one bucket: one op, one torchft future
        if self.inner is not None:
            self.inner.allreduce([flat]).wait()
            flat /= self.group_world
        work = self.manager.allreduce(flat)
        before_commit(step)
        work.wait()
        if not self.manager.should_commit():
            return None
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        self.optimizer.step()
        return StepRecord(step, self.manager.num_participants(), time.monotonic() - started, float(loss),
                          self._healed)

    def close(self) -> None:
        self.manager.shutdown(wait=False)
