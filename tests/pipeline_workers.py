"""Pipeline stages over the hetccl torch backend, one spawned process per rank
(tests/torch_workers.run): torch.distributed.pipelining's own stages and schedules, the
model cut by a split of the stage planner's form (``features/stages.py``)."""

from __future__ import annotations

import torch
from torch import nn

WIDTH, LAYERS, BATCH = 8, 6, 10


def make_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(LAYERS)]


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step + 1)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def reference(microbatches: int) -> tuple[float, list[torch.Tensor]]:
    """One process: the summed per-microbatch losses and their gradients over the microbatch
    count (what the schedules backpropagate: they scale gradients by 1/microbatches),
    microbatches cut as the schedules cut them (tensor_split along dim 0)."""
    model = nn.Sequential(*make_layers())
    x, y = data(0)
    total = 0.0
    for xs, ys in zip(torch.tensor_split(x, microbatches), torch.tensor_split(y, microbatches)):
        loss = loss_fn(model(xs), ys)
        loss.backward()
        total += loss.item()
    return total, [p.grad / microbatches for p in model.parameters()]


def pipelined(rank: int, world: int, bounds: tuple[int, ...], schedule: str, microbatches: int) -> dict:
    """This rank's stage (layers ``bounds[rank]:bounds[rank + 1]``) under ``schedule``: the loss
    on the last stage, and the stage's gradients."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    layers = make_layers()[bounds[rank]:bounds[rank + 1]]
    module = nn.Sequential(*layers)
    stage = pipelining.PipelineStage(module, rank, world, torch.device("cpu"), group=dist.group.WORLD)
    cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[schedule]
    run = cls(stage, n_microbatches=microbatches, loss_fn=loss_fn)
    x, y = data(0)
    losses: list[torch.Tensor] = []
    if rank == 0:
        run.step(x)
    elif rank == world - 1:
        run.step(target=y, losses=losses)
    else:
        run.step()
    return {"loss": float(sum(loss.item() for loss in losses)), "grads": [p.grad for p in module.parameters()]}
