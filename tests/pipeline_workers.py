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


def pipelined(rank: int, world: int, bounds: tuple[int, ...], cases: list[tuple[str, int]]) -> list[dict]:
    """This rank's stage (layers ``bounds[rank]:bounds[rank + 1]``) under each (schedule,
    microbatches) of ``cases`` in turn, from the same weights: the loss on the last stage,
    and the stage's gradients; a case that raises gives its error and ends the run (its group
    is broken)."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    results = []
    for schedule, microbatches in cases:
        module = nn.Sequential(*make_layers()[bounds[rank]:bounds[rank + 1]])
        stage = pipelining.PipelineStage(module, rank, world, torch.device("cpu"), group=dist.group.WORLD)
        cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[schedule]
        run = cls(stage, n_microbatches=microbatches, loss_fn=loss_fn)
        x, y = data(0)
        losses: list[torch.Tensor] = []
        try:
            if rank == 0:
                run.step(x)
            elif rank == world - 1:
                run.step(target=y, losses=losses)
            else:
                run.step()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            results.append({"error": f"{type(exc).__name__}: {exc}"})
            break
        results.append({"loss": float(sum(loss.item() for loss in losses)),
                        "grads": [p.grad for p in module.parameters()]})
    return results

LR = 0.1


def reference_trained(microbatches: int, steps: int) -> list[torch.Tensor]:
    """One process, SGD over the schedules' gradients (summed microbatch losses over the count)."""
    model = nn.Sequential(*make_layers())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = data(step)
        for xs, ys in zip(torch.tensor_split(x, microbatches), torch.tensor_split(y, microbatches)):
            (loss_fn(model(xs), ys) / microbatches).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def trained(rank: int, world: int, bounds: tuple[int, ...], microbatches: int, steps: int, moves: dict) -> dict:
    """hetccl_ray.features.pipeline.Pipeline from ``bounds``, SGD; before step s it moves to
    ``moves[s]`` (weights go with their layers). This rank's stage's parameters, and its layers."""
    from hetccl_ray.features.pipeline import Pipeline

    pipe = Pipeline(make_layers(), loss_fn, microbatches, bounds=bounds,
                    optimizer=lambda params: torch.optim.SGD(params, lr=LR))
    for step in range(steps):
        if step in moves:
            pipe.move_to(moves[step])
        x, y = data(step)
        pipe.step(x if rank == 0 else None, y if rank == world - 1 else None)
        pipe.optimizer.step()
        pipe.optimizer.zero_grad()
    return {"params": [p.detach() for p in pipe.module.parameters()], "layers": list(range(*pipe.bounds[rank:rank + 2]))}


def planned(rank: int, world: int) -> dict:
    """The split a Pipeline plans from measured layer times (rank 1 slowed by extra work per
    layer), and a re-plan from the even split."""
    from hetccl_ray.features.pipeline import Pipeline

    torch.set_num_threads(1)  # two ranks on two cores: torch's default threads would contend
    layers = make_layers()
    if rank == 1:  # a slower island: each layer does its work five times (the same result)
        layers = [_Slowed(layer, 5) for layer in layers]
    sample = data(0)[0][:5].repeat(200, 1)
    pipe = Pipeline(layers, loss_fn, 2, sample=sample, border_bytes_per_s=1e12)  # compute only
    even = Pipeline(layers, loss_fn, 2, sample=sample, bounds=(0, 3, 6), border_bytes_per_s=1e12)
    unsampled = Pipeline(layers, loss_fn, 2, bounds=(0, 3, 6))
    try:
        unsampled.replan()
        unsampled_error = "no error"
    except ValueError as exc:
        unsampled_error = str(exc)
    return {"bounds": list(pipe.bounds), "replanned": even.replan(), "after": list(even.bounds),
            "unsampled": unsampled_error}


def moved_and_planned(rank: int, world: int, microbatches: int, steps: int, moves: dict) -> dict:
    """``trained`` and then ``planned``, in one process per rank (one start-up for both)."""
    return {"trained": trained(rank, world, (0, 4, 6), microbatches, steps, moves), "planned": planned(rank, world)}


class _Slowed(nn.Module):
    """A layer that computes ``times`` times and keeps the last (a simulated slow device)."""

    def __init__(self, layer: nn.Module, times: int) -> None:
        super().__init__()
        self.layer, self.times = layer, times

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.times - 1):
            self.layer(x)
        return self.layer(x)


def compressed(rank: int, world: int) -> dict:
    """bf16 stages (two blocks each) for 3 steps of 4 microbatches: the payload and wire
    bytes this rank's border sent (activations from stage 0, their gradients from stage 1)."""
    import hetccl_ray
    from hetccl_ray.features.pipeline import Pipeline

    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(256, 256), nn.GELU()).to(torch.bfloat16) for _ in range(4)]
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(512, 256, generator=g).to(torch.bfloat16) for _ in range(2))
    pipe = Pipeline(layers, lambda out, target: ((out.float() - target.float()) ** 2).mean(), 4, bounds=(0, 2, 4))
    border = hetccl_ray.get_torch_group().border
    payload, wire = border.bytes_sent, border.wire_bytes_sent
    for _ in range(3):
        pipe.step(x if rank == 0 else None, y if rank == 1 else None)
        pipe.optimizer.step()
        pipe.optimizer.zero_grad()
    return {"payload": border.bytes_sent - payload, "wire": border.wire_bytes_sent - wire}
