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
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch import nn

import hetccl_ray
from hetccl_ray.collective.train import HetCCLTorchConfig
from hetccl_ray.local_cluster import LocalCluster

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
    for step in range(config["steps"]):
        x = torch.randn(32, 16, generator=g)
        loss = ((model(x).squeeze(-1) - x @ true_w) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean_loss = torch.tensor([loss.item()])
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        ray.train.report({"step": step, "loss": mean_loss.item(), "island_of_rank": [int(i.item()) for i in islands],
                          "islands": [i.name for i in group.topology.islands]})


def fit(islands: list[str] = ISLANDS, steps: int = STEPS) -> "ray.train.Result":
    """Train on workers placed on ``islands``; the cluster must have nodes with those labels."""
    trainer = TorchTrainer(
        train_loop, train_loop_config={"steps": steps},
        torch_config=HetCCLTorchConfig(timeout_s=120),
        scaling_config=ScalingConfig(num_workers=len(islands), use_gpu=False, resources_per_worker={"CPU": 0},
                                     label_selector=[{hetccl_ray.ISLAND_LABEL: name} for name in islands]),
        run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="hetccl-train-")))
    return trainer.fit()


if __name__ == "__main__":
    with LocalCluster(ISLANDS):
        result = fit()
    for row in result.metrics_dataframe.itertuples():
        print(f"step {row.step:3d}  loss {row.loss:.4f}")
    print("islands:", result.metrics["islands"], "island of each rank:", result.metrics["island_of_rank"])
