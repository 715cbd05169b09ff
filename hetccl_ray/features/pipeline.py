"""Pipeline stages across islands, sized by measured speed: torch.distributed.pipelining's own
stages and schedules over a process group (backend "hetccl"), cut where the stage planner
(``stages.py``) says.

    layers = [block() for _ in range(12)]               # the whole model, built on every rank
    pipe = Pipeline(layers, loss_fn, microbatches=8)    # measures, plans, builds this rank's stage
    for step in range(steps):
        loss = pipe.step(x, y)                          # the schedule's step (loss on the last stage)
        pipe.optimizer.step(); pipe.optimizer.zero_grad()
        if step % 20 == 19:
            pipe.replan()                               # measure again; move layers if it pays

Stage j is rank j of the group: one rank per island, in rank order. Every rank builds every
layer (small models built in code), so each can time every layer on its own device; only the
stage's layers train, and a re-plan sends a moved layer's weights from its old stage to its
new one before the new stages are built (exact). Imports no Ray.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining

from hetccl_ray.features import stages

SCHEDULES = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}


def measure(layers: Sequence[nn.Module], sample: torch.Tensor, repeats: int = 5) -> tuple[list[float], list[int]]:
    """Each layer's forward+backward seconds for one microbatch ``sample`` on this rank (the
    median of ``repeats``, after one untimed pass), and the bytes of each layer's output."""
    seconds: list[list[float]] = [[] for _ in layers]
    out_bytes: list[int] = []
    for rep in range(repeats + 1):
        x = sample
        for i, layer in enumerate(layers):
            x = x.detach().requires_grad_(True)
            started = time.perf_counter()
            out = layer(x)
            out.backward(torch.ones_like(out))
            if rep:
                seconds[i].append(time.perf_counter() - started)
            elif len(out_bytes) < len(layers):
                out_bytes.append(out.numel() * out.element_size())
            x = out
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    return [statistics.median(s) for s in seconds], out_bytes


class Pipeline:
    """This rank's stage of ``layers`` under a schedule of torch's ("gpipe", "1f1b"), over
    ``group`` (default: the world; stage j = rank j). ``bounds``: the split to start from
    (default: planned from ``measure`` on ``sample``, every rank's times gathered, at
    ``border_bytes_per_s``); ``optimizer``: made for the stage's parameters, again after a
    re-plan."""

    def __init__(self, layers: Sequence[nn.Module], loss_fn: Callable, microbatches: int, *,
                 sample: Optional[torch.Tensor] = None, bounds: Optional[Sequence[int]] = None,
                 schedule: str = "1f1b", border_bytes_per_s: float = 1.25e8,
                 optimizer: Callable = lambda params: torch.optim.SGD(params, lr=0.01),
                 group: Optional[dist.ProcessGroup] = None, device: torch.device = torch.device("cpu")) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule {schedule!r}: use one of {sorted(SCHEDULES)}")
        self.layers, self.loss_fn, self.microbatches = list(layers), loss_fn, microbatches
        self.schedule_name, self.border_bytes_per_s = schedule, border_bytes_per_s
        self.make_optimizer, self.group, self.device = optimizer, group, device
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.sample = sample
        self.split: Optional[stages.Split] = None
        self.costs: Optional[stages.Costs] = None  # what the last plan measured
        if bounds is None:
            if sample is None:
                raise ValueError("Pipeline: give a sample microbatch to plan from, or the bounds")
            self.split = self.plan()
            bounds = self.split.bounds
        self.bounds = stages.check_bounds(bounds, len(self.layers), self.world)
        self._build()

    def plan(self) -> stages.Split:
        """Measure every layer on this rank, gather every stage's times, plan the split."""
        self.costs = self._measured()
        return stages.plan(self.costs)

    def replan(self, margin: float = 0.1) -> bool:
        """Measure again; when a split beats the current one by more than ``margin``, move
        the layers whose stage changes (their weights, exactly) and rebuild. Whether it did."""
        if self.sample is None:
            raise ValueError("Pipeline.replan measures each layer on a sample microbatch: give one "
                             "(Pipeline(..., sample=x)) or set pipe.sample")
        self.costs = self._measured()
        better = stages.replan(self.bounds, self.costs, margin)
        if better is None:
            self.split = stages.split_of(self.costs, self.bounds)
            return False
        self.move_to(better.bounds)
        self.split = better
        return True

    def move_to(self, bounds: Sequence[int]) -> None:
        """Take the split ``bounds`` (every rank the same): moved layers' weights go from
        their old stage's rank to their new one, then the stage and schedule are rebuilt."""
        bounds = stages.check_bounds(bounds, len(self.layers), self.world)
        for layer, src, dst in stages.moves(self.bounds, bounds):
            for tensor in self.layers[layer].state_dict().values():
                if self.rank == src:
                    dist.send(tensor.contiguous(), self._global(dst), group=self.group)
                elif self.rank == dst:
                    arrived = torch.empty_like(tensor)
                    dist.recv(arrived, self._global(src), group=self.group)
                    tensor.copy_(arrived)
        self.bounds = bounds
        self._build()

    def step(self, x: Optional[torch.Tensor] = None, target: Optional[torch.Tensor] = None) -> Optional[float]:
        """One schedule step: the first stage passes the batch, the last the target; returns
        the summed microbatch losses on the last stage (None elsewhere)."""
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(x)
        elif self.rank == self.world - 1:
            self.schedule.step(target=target, losses=losses)
        else:
            self.schedule.step()
        return float(sum(loss.item() for loss in losses)) if self.rank == self.world - 1 else None

    def _measured(self) -> stages.Costs:
        """Every stage rank's layer times (gathered) and this rank's activation bytes."""
        seconds, out_bytes = measure(self.layers, self.sample)
        rows: list = [None] * self.world
        dist.all_gather_object(rows, seconds, group=self.group)
        return stages.Costs(rows, out_bytes, self.border_bytes_per_s)

    def _build(self) -> None:
        mine = self.layers[self.bounds[self.rank]:self.bounds[self.rank + 1]]
        self.module = nn.Sequential(*mine)
        stage = pipelining.PipelineStage(self.module, self.rank, self.world, self.device, group=self.group)
        self.schedule = SCHEDULES[self.schedule_name](stage, n_microbatches=self.microbatches, loss_fn=self.loss_fn)
        self.optimizer = self.make_optimizer(self.module.parameters())

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank
