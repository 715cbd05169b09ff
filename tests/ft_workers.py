"""What each rank process of the torchft tests runs (tests/test_ft.py): a small linear model
trained by SGD as an ``ElasticRank`` (torchft's Manager, hetccl's process group across
islands). One replica per rank, or an island as one replica group (DDP inside it over the
island's own Gloo). Batches are a function of (replica, rank in it, step), so a one-process
replay of the log of (step, participating replicas) gives the exact weights."""

from __future__ import annotations

import datetime
import os
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


def loss(model: torch.nn.Linear, replica: str, rank: int, step: int) -> torch.Tensor:
    x, y = batch(replica, rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def replay(log: dict[int, list[str]], steps: int, group_world: int = 1) -> list[torch.Tensor]:
    """The weights after ``steps`` steps, each the mean gradient over that step's participating
    replica groups' ranks (groups of ``group_world`` ranks)."""
    model = initial_model()
    for step in range(steps):
        grads = []
        for replica in sorted(set(log[step])):
            for rank in range(group_world):
                model.zero_grad()
                loss(model, replica, rank, step).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= LR * sum(g[i] for g in grads) / len(grads)
    return [p.detach().clone() for p in model.parameters()]


def rank_main(replica: str, island: str, lighthouse: str, steps: Any, events: Any, pause_s: float = 0.0,
              kill_at: int = -1, group_rank: int = 0, group_world: int = 1, store_port: int = 0,
              start: Any = None) -> None:
    """One rank of replica group ``replica`` (``group_world`` ranks, its store on
    ``store_port`` hosted by group rank 0; 0: a fresh port, one rank) on ``island``: trains
    until torchft's committed step ``steps.value`` (a shared value the test sets once every
    death is healed: a survivor that finished alone would leave a returning rank nobody to heal
    from), reporting each committed step with its participants, then its final weights. ``kill_at``: SIGKILL itself at its first step at or
    after that one, with the cross-replica allreduce posted (said first). ``start``: a barrier
    every first rank passes before its first quorum (else the first to import would train
    alone, as torchft allows with one replica required)."""
    os.environ["HETCCL_ISLAND"] = island
    import time

    import torch.distributed as dist

    from hetccl_ray.doors.ft import ElasticRank

    model = initial_model()
    rank = ElasticRank(model, torch.optim.SGD(model.parameters(), lr=LR), replica, lighthouse, group_rank=group_rank,
                       group_world=group_world, store_port=store_port)
    if group_world > 1:  # DDP inside the island over its own library; torchft across islands
        rank.inner = dist.ProcessGroupGloo(dist.PrefixStore("island", rank.store), group_rank, group_world,
                                           datetime.timedelta(seconds=30))

    def die(step: int) -> None:
        if 0 <= kill_at <= step:  # the first step at or after it (a late joiner heals past some)
            events.put(("dying", replica, step))
            events.close()
            events.join_thread()  # said before the process is gone
            os.kill(os.getpid(), 9)

    if start is not None:
        start.wait(60)
    try:
        while rank.current_step < steps.value:
            record = rank.step(lambda step: loss(model, replica, group_rank, step), die)
            if record is not None:
                events.put(("step", replica, record.step, record.participants, record.seconds))
            time.sleep(pause_s)
        events.put(("done", f"{replica}/{group_rank}", [p.detach().clone().numpy() for p in model.parameters()]))
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        events.put(("error", f"{replica}/{group_rank}", repr(exc)))
    finally:
        rank.close()
