"""A mixture-of-experts layer trained through Ray Train over two labelled islands.

    python examples/train_moe_mixed.py          # a local cluster of two simulated islands

Expert parallelism: rank e holds expert e (so experts sit in both islands); top-1 gating
sends each token to its expert with ``all_to_all_single`` and back, twice per step
(forward and backward), with uneven splits that change every step. The dense parts
(input layer, gate, head) are replicated and trained with DDP. ``reference`` trains the
same model in one process, every expert local, for the test to compare against.
"""

from __future__ import annotations

import tempfile
from typing import Callable, Optional

import ray.train
import torch
import torch.distributed as dist
from torch import nn

import hetccl_ray
from hetccl_ray.doors.train import labelled_trainer
from hetccl_ray.tools.local_cluster import LocalCluster

ISLANDS = ["nvidia", "nvidia", "amd"]   # one worker, and one expert, per entry
STEPS, BATCH, WIDTH, HIDDEN, LR = 12, 24, 8, 16, 0.1


def make_expert(index: int) -> nn.Module:
    torch.manual_seed(100 + index)
    return nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, WIDTH))


class MoE(nn.Module):
    """Dense input layer -> top-1 gate over experts -> residual -> head. ``experts`` holds
    the experts this process runs: all of them in one process, one per rank distributed."""

    def __init__(self, experts: dict[int, nn.Module], world: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # the dense parts start alike on every rank and in the reference
        self.dense_in = nn.Linear(WIDTH, WIDTH)
        self.gate = nn.Linear(WIDTH, world)
        self.head = nn.Linear(WIDTH, 1)
        self.experts = nn.ModuleDict({str(e): expert for e, expert in experts.items()})

    def forward(self, x: torch.Tensor, route: Callable) -> torch.Tensor:
        h = torch.relu(self.dense_in(x))
        probs = torch.softmax(self.gate(h), dim=-1)
        choice = probs.argmax(dim=-1)
        weight = probs.gather(1, choice[:, None])
        return self.head(h + weight * route(self, h, choice)).squeeze(-1)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd: the gradient goes back by the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
        ctx.send_rows, ctx.recv_rows = send_rows, recv_rows
        out = x.new_empty(sum(recv_rows), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_rows, input_split_sizes=send_rows)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(sum(ctx.send_rows), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send_rows,
                               input_split_sizes=ctx.recv_rows)
        return out, None, None


def route_by_alltoall(model: MoE, h: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """Tokens to their expert's rank and back: counts first, then the tokens, both all-to-all."""
    world, rank = dist.get_world_size(), dist.get_rank()
    order = torch.argsort(choice, stable=True)
    send = torch.bincount(choice, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    send_rows, recv_rows = send.tolist(), recv.tolist()
    arrived = _AllToAll.apply(h[order], send_rows, recv_rows)
    done = _AllToAll.apply(model.experts[str(rank)](arrived), recv_rows, send_rows)
    return torch.empty_like(done).index_copy(0, order, done)


def route_locally(model: MoE, h: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """The one-process reference: every token through its expert, no exchange."""
    out = torch.zeros_like(h)
    for e, expert in model.experts.items():
        picked = choice == int(e)
        out[picked] = expert(h[picked])
    return out


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, WIDTH, generator=g)
    return x, torch.sin(x).sum(dim=-1)


def train_loop(config: dict) -> None:
    """One rank: DDP for the dense parts, this rank's expert alone, tokens by all-to-all."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = MoE({rank: make_expert(rank)}, world)
    experts = [name for name, _ in model.named_parameters() if name.startswith("experts.")]
    nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(config["steps"]):
        x, y = batch(rank, step)
        loss = ((ddp(x, route_by_alltoall) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for name, param in model.named_parameters():  # DDP averages the dense grads over ranks;
            if name in experts:                       # an expert's sum over every rank's loss, so
                param.grad /= world                   # scale it alike: the mean loss's gradient
        opt.step()
        per_rank = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(per_rank, loss.detach().reshape(1))
        losses.append([p.item() for p in per_rank])
        group = hetccl_ray.get_torch_group()
        metrics = {"step": step, "losses": list(losses), "islands": [i.name for i in group.topology.islands]}
        if step == config["steps"] - 1:
            mine = {name: p.detach().tolist() for name, p in model.named_parameters()}
            everyone: list[Optional[dict]] = [None] * world
            dist.all_gather_object(everyone, mine)
            metrics["params"] = {k: v for params in everyone for k, v in params.items()}
        with tempfile.TemporaryDirectory() as folder:  # Ray Train keeps the metrics of reports
            last = step == config["steps"] - 1 and rank == 0   # that carry a checkpoint
            if last:
                torch.save(model.state_dict(), f"{folder}/model.pt")
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder) if last else None)


def reference(world: int, steps: int = STEPS) -> tuple[list[list[float]], dict[str, list]]:
    """The same model and batches in one process: per-step losses of each rank's batch, and
    the final parameters. Its loss is the mean over ranks, the gradient DDP computes."""
    model = MoE({e: make_expert(e) for e in range(world)}, world)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        per_rank = []
        for rank in range(world):
            x, y = batch(rank, step)
            per_rank.append(((model(x, route_locally) - y) ** 2).mean())
        opt.zero_grad()
        (sum(per_rank) / world).backward()
        opt.step()
        losses.append([loss.item() for loss in per_rank])
    return losses, {name: p.detach().tolist() for name, p in model.named_parameters()}


def fit(islands: list[str] = ISLANDS, steps: int = STEPS) -> "ray.train.Result":
    """Train on workers placed on ``islands``; the cluster must have nodes with those labels."""
    return labelled_trainer(train_loop, islands, {"steps": steps}).fit()


if __name__ == "__main__":
    with LocalCluster(ISLANDS):
        result = fit()
    for step, per_rank in enumerate(result.metrics["losses"]):
        print(f"step {step:2d}  mean loss {sum(per_rank) / len(per_rank):.4f}")
    print("islands:", result.metrics["islands"])
