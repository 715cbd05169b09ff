"""What each rank process of the torchft tests runs (tests/test_ft.py): a small linear model
trained by SGD under ``torchft.Manager`` with hetccl's process group across islands. One
replica per rank, or an island as one replica group (DDP inside it over the island's own
Gloo, torchft's allreduce across islands over hetccl). Batches are a function of (replica,
rank in it, step), so a one-process replay of the log of (step, participating replicas)
gives the exact weights."""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import torch

LR = 0.05
SHAPE = (6, 3)  # the model: Linear(6, 3)


def batch(replica: str, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of rank ``rank`` of replica group ``replica`` at ``step``: the same on every run."""
    g = torch.Generator().manual_seed(1000 * step + 100 * rank + sum(map(ord, replica)))
    return torch.randn(8, SHAPE[0], generator=g), torch.randn(8, SHAPE[1], generator=g)


def initial_model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(*SHAPE)


def gradients(model: torch.nn.Linear, replica: str, rank: int, step: int) -> list[torch.Tensor]:
    x, y = batch(replica, rank, step)
    model.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def replay(log: dict[int, list[str]], steps: int, group_world: int = 1) -> list[torch.Tensor]:
    """The weights after ``steps`` steps, each the mean gradient over that step's participating
    replica groups' ranks (groups of ``group_world`` ranks)."""
    model = initial_model()
    for step in range(steps):
        grads = [[g.clone() for g in gradients(model, replica, rank, step)]
                 for replica in sorted(set(log[step])) for rank in range(group_world)]
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= LR * sum(g[i] for g in grads) / len(grads)
    return [p.detach().clone() for p in model.parameters()]


def rank_main(replica: str, island: str, lighthouse: str, steps: int, events: Any, pause_s: float = 0.0,
              kill_at: int = -1, group_rank: int = 0, group_world: int = 1, store_port: int = 0,
              start: Any = None) -> None:
    """One rank of replica group ``replica`` (``group_world`` ranks, its store on
    ``store_port`` hosted by group rank 0; 0: a fresh port, one rank) on ``island``: trains
    until torchft's committed step ``steps``, reporting each committed step with its
    participants and time, then its final weights. ``kill_at``: SIGKILL itself at its first
    step at or after that one, with the cross-replica allreduce posted (said first).
    ``start``: a barrier every first rank passes before its first quorum (else the first to
    import would train alone, as torchft allows with one replica required)."""
    os.environ["HETCCL_ISLAND"] = island
    import torch.distributed as dist
    from torchft import Manager

    from hetccl_ray.doors.ft import ProcessGroupHetCCL

    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", store_port, group_world, group_rank == 0, timeout=timeout)
    inner = None
    if group_world > 1:  # DDP inside the island over its own library; torchft across islands
        inner = dist.ProcessGroupGloo(dist.PrefixStore("island", store), group_rank, group_world, timeout)
    model = initial_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    manager = Manager(pg=ProcessGroupHetCCL(datetime.timedelta(seconds=10)),
                      load_state_dict=lambda state: model.load_state_dict(state["model"]),
                      state_dict=lambda: {"model": model.state_dict()}, min_replica_size=1, use_async_quorum=False,
                      replica_id=replica, lighthouse_addr=lighthouse, store_addr="127.0.0.1", store_port=store.port,
                      rank=group_rank, world_size=group_world, timeout=datetime.timedelta(seconds=10),
                      quorum_timeout=timeout, connect_timeout=datetime.timedelta(seconds=10))
    if start is not None:
        start.wait(60)
    try:
        while manager.current_step() < steps:
            started = time.monotonic()
            manager.start_quorum()
            step = manager.current_step()
            grads = gradients(model, replica, group_rank, step)
            if inner is not None:
                for g in grads:
                    inner.allreduce([g]).wait()
                    g /= group_world
            works = [manager.allreduce(g) for g in grads]
            if 0 <= kill_at <= step:  # the first step at or after it (a late joiner heals past some)
                events.put(("dying", replica, step))
                events.close()
                events.join_thread()  # said before the process is gone
                os.kill(os.getpid(), 9)
            for work in works:
                work.wait()
            if manager.should_commit():
                optimizer.step()
                events.put(("step", replica, step, manager.num_participants(), time.monotonic() - started))
            if pause_s:
                time.sleep(pause_s)
        events.put(("done", f"{replica}/{group_rank}", [p.detach().clone().numpy() for p in model.parameters()]))
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        events.put(("error", f"{replica}/{group_rank}", repr(exc)))
    finally:
        manager.shutdown(wait=False)
