"""Balanced DDP through Ray Train on two labelled islands, one of them slowed.

    python examples/train_balanced_mixed.py                 # balanced, island "slow" at half speed
    python examples/train_balanced_mixed.py --balance even  # plain DDP's even split, same code

Each island's node owns one core, and island "slow" runs under a cgroup CPU quota
(cpu_quota.py: a simulated slow island, real CPU time taken away, needs root). ``HetCCLTorchConfig(balance=...)`` is the one switch: the
train loop is the same in both modes. Prints per-step time, shares and loss.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import ray.train
import torch
import torch.distributed as dist
from torch import nn

from hetccl_ray.features.balanced import Balancer
from hetccl_ray.doors.train import labelled_trainer
from hetccl_ray.tools.local_cluster import LocalCluster
from hetccl_ray.core.topology import ISLAND_LABEL

ISLANDS = ["fast", "slow"]  # one worker per entry, on a node with that label
DEFAULTS = {"steps": 40, "global_batch": 4096, "width": 512, "features": 256, "dataset": 4096 * 4,
            "lr": 0.05, "seed": 0, "report_every": 0, "quota_moves": {}, "params": False}
# report_every: a ray.train.report every that many steps (0: the last only); each costs
# about a second here, so the benchmark reports once, at the end, with every step's row


def make_model(config: dict) -> nn.Module:
    torch.manual_seed(config["seed"])
    width, features = config["width"], config["features"]
    return nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 1))


def dataset(config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic regression task, the same on every rank (generated from the seed)."""
    g = torch.Generator().manual_seed(config["seed"] + 1)
    x = torch.randn(config["dataset"], config["features"], generator=g)
    y = torch.sin(x[:, :8].sum(dim=1, keepdim=True))
    return x, y


def train_loop(config: dict) -> None:
    config = {**DEFAULTS, **config}
    torch.set_num_threads(1)  # one core per rank: the quota then sets the rank's speed
    x, y = dataset(config)
    model = nn.parallel.DistributedDataParallel(make_model(config))
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    bal = Balancer(config["global_batch"], seed=config["seed"])
    bal.wrap(model)
    rank = dist.get_rank()
    islands = [None] * dist.get_world_size()
    dist.all_gather_object(islands, ray.get_runtime_context().get_node_labels().get(ISLAND_LABEL))
    rows = []
    started = time.perf_counter()
    for step in range(config["steps"]):
        for island, cores in config["quota_moves"].get(step, {}).items():
            if rank == 0:  # the simulated slowdown moves (the driver made the quota groups)
                config["quotas"][island].set(cores)
        idx = bal.indices(step, len(x))
        loss = ((model(x[idx]) - y[idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        shares, weight = list(bal.shares), bal.weight
        bal.step()
        total = torch.tensor([loss.item() * weight])  # the global batch's mean loss, summed
        dist.all_reduce(total)
        now = time.perf_counter()
        rows.append({"step": step, "step_s": now - started, "shares": shares, "loss": total.item()})
        started = now
        last = step == config["steps"] - 1
        every = config["report_every"]
        if last or (every and step % every == every - 1):
            metrics = {"rows": list(rows), "balance": bal.metrics(), "history": bal.history, "checks": bal.checks,
                       "mode": bal.mode,
                       "islands": islands}
            if last and config["params"]:
                metrics["params"] = {k: v.tolist() for k, v in model.module.state_dict().items()}
            if last:
                metrics["histories"] = [None] * dist.get_world_size()  # each rank's own view of the shares
                dist.all_gather_object(metrics["histories"], bal.history)
                metrics["compute_s"] = [None] * dist.get_world_size()  # each rank's timed compute per step
                dist.all_gather_object(metrics["compute_s"], bal.compute_s)
            report(metrics, model.module, last)


def report(metrics: dict, model: nn.Module, last: bool) -> None:
    """``ray.train.report``; the last carries rank 0's weights as a checkpoint, because Ray
    Train keeps the metrics of reports that carry one."""
    with tempfile.TemporaryDirectory() as folder:
        keep = last and dist.get_rank() == 0
        if keep:
            torch.save(model.state_dict(), f"{folder}/model.pt")
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder) if keep else None)


def reference(config: dict) -> dict[str, np.ndarray]:
    """The same global batches trained in one process: what balanced DDP must reproduce."""
    from hetccl_ray.features.balance import global_batch_indices

    config = {**DEFAULTS, **config}
    x, y = dataset(config)
    model = make_model(config)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    for step in range(config["steps"]):
        idx = torch.from_numpy(global_batch_indices(step, len(x), config["global_batch"], config["seed"]))
        loss = ((model(x[idx]) - y[idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def fit(islands: list[str] = ISLANDS, balance: str = "auto", every: int = 5, margin: float = 0.1,
        cluster: "LocalCluster | None" = None, **config) -> "ray.train.Result":
    """Train one worker per entry of ``islands`` (nodes labelled with those names must exist);
    ``config`` overrides DEFAULTS; ``cluster``'s quota groups travel for ``quota_moves``."""
    config = {**config, "quotas": dict(cluster.quotas) if cluster else {}}
    return labelled_trainer(train_loop, islands, config, balance=balance, rebalance_every=every,
                            balance_margin=margin).fit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--balance", choices=["auto", "even"], default="auto")
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    parser.add_argument("--slow-cores", type=float, default=0.5, help="CPUs of time the slow island gets")
    args = parser.parse_args()
    with LocalCluster(ISLANDS, cpu_quota={"slow": args.slow_cores}, pin_cores=True) as cluster:
        result = fit(balance=args.balance, steps=args.steps, cluster=cluster)
    rows = result.metrics["rows"]
    for row in rows:
        print(f"step {row['step']:3d}  {row['step_s'] * 1e3:7.1f} ms  shares {row['shares']}  loss {row['loss']:.4f}")
    print(f"{args.balance}: median step {np.median([r['step_s'] for r in rows[5:]]) * 1e3:.1f} ms, "
          f"final shares {rows[-1]['shares']}, loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}")


if __name__ == "__main__":
    main()
