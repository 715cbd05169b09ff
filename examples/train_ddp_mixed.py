"""DDP through Ray Train's TorchTrainer on two labelled islands, over the hetccl backend.

    python examples/train_ddp_mixed.py          # a local cluster of two simulated islands

Each worker lands on a node labelled ``hetccl.io/island``; the training code is plain
DDP. Prints the loss per step and which islands the workers came from.
"""

from __future__ import annotations

import tempfile

import ray.train
import torch
import torch.distributed as dist
from torch import nn

import hetccl_ray
from hetccl_ray.doors.train import labelled_trainer
from hetccl_ray.tools.local_cluster import LocalCluster

ISLANDS = ["nvidia", "nvidia", "amd"]   # one worker per entry, on a node with that label
STEPS = 30


def train_loop(config: dict) -> None:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    true_w = torch.arange(16, dtype=torch.float32) / 16
    group = hetccl_ray.get_torch_group()
    islands = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(islands, torch.tensor([float(group.island.index)]))
    losses = []
    for step in range(config["steps"]):
        x = torch.randn(32, 16, generator=g)
        loss = ((model(x).squeeze(-1) - x @ true_w) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean_loss = torch.tensor([loss.item()])
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        losses.append(mean_loss.item())
        if rank == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
        metrics = {"step": step, "loss": losses[-1], "losses": list(losses),
                   "island_of_rank": [int(i.item()) for i in islands],
                   "islands": [i.name for i in group.topology.islands]}
        last = step == config["steps"] - 1
        with tempfile.TemporaryDirectory() as folder:
            # Ray Train keeps the metrics of reports that carry a checkpoint: the last one does
            if last and rank == 0:
                torch.save(model.module.state_dict(), f"{folder}/model.pt")
            checkpoint = ray.train.Checkpoint.from_directory(folder) if last and rank == 0 else None
            ray.train.report(metrics, checkpoint=checkpoint)


def fit(islands: list[str] = ISLANDS, steps: int = STEPS) -> "ray.train.Result":
    """Train on workers placed on ``islands``; the cluster must have nodes with those labels."""
    return labelled_trainer(train_loop, islands, {"steps": steps}).fit()


if __name__ == "__main__":
    with LocalCluster(ISLANDS):
        result = fit()
    print("loss per step:", " ".join(f"{loss:.3f}" for loss in result.metrics["losses"]))
    print("islands:", result.metrics["islands"], "island of each rank:", result.metrics["island_of_rank"])
