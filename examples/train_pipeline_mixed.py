"""A small transformer cut into pipeline stages across two labelled islands, one slowed,
through Ray Train: torch.distributed.pipelining's own stages and 1F1B schedule over hetccl,
the split sized by measured speed (hetccl_ray.features.pipeline, stages.py).

    python examples/train_pipeline_mixed.py                 # speed-sized split
    python examples/train_pipeline_mixed.py --compare even  # and the even split, steps alternating

Each island's node owns one core, and island "slow" runs under a cgroup CPU quota
(cpu_quota.py: a simulated slow island, real CPU time taken away, needs root). Prints per
step the split, step time, the bubble (the share of the step the slowest stage waits) and
the loss; with ``--compare even`` both splits train from the same weights, their steps
alternating (order swapped every step), so their times are side by side.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
import time

import ray.train
import torch
import torch.distributed as dist
from torch import nn

import hetccl_ray
from hetccl_ray.doors.train import labelled_trainer
from hetccl_ray.features import stages
from hetccl_ray.features.pipeline import Pipeline
from hetccl_ray.tools.local_cluster import LocalCluster

ISLANDS = ["fast", "slow"]  # stage 0 on island "fast", stage 1 on "slow"
DEFAULTS = {"steps": 30, "layers": 12, "width": 64, "heads": 4, "seq": 16, "batch": 64, "microbatches": 8,
            "lr": 0.01, "compare": None, "warmup": 5, "replan_every": 5}


def make_layers(config: dict) -> list[nn.Module]:
    """The model: ``layers`` transformer encoder blocks (built in code, the same on every rank)."""
    torch.manual_seed(0)
    return [nn.TransformerEncoderLayer(config["width"], config["heads"], dim_feedforward=4 * config["width"],
                                       dropout=0.0, batch_first=True) for _ in range(config["layers"])]


def batch(config: dict, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic sequence task: predict a smooth function of each token's features."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(config["batch"], config["seq"], config["width"], generator=g)
    return x, torch.sin(x.cumsum(dim=1) / config["seq"])


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def train_loop(config: dict) -> None:
    config = {**DEFAULTS, **config}
    torch.set_num_threads(1)  # one core per island: the quota sets the stage's speed
    rank, m = dist.get_rank(), config["microbatches"]
    sample = batch(config, 0)[0][:config["batch"] // m]
    sgd = lambda params: torch.optim.SGD(params, lr=config["lr"])  # noqa: E731
    group = hetccl_ray.get_torch_group()
    rate = group.link.bytes_per_s if group.link is not None else 1.25e8  # measured at formation
    pipes = {"speed": Pipeline(make_layers(config), loss_fn, m, sample=sample, border_bytes_per_s=rate, optimizer=sgd)}
    if config["compare"] == "even":
        pipes["even"] = Pipeline(make_layers(config), loss_fn, m, optimizer=sgd,
                                 bounds=stages.even_bounds(config["layers"], dist.get_world_size()))
    rows = []
    for step in range(config["steps"]):
        if step and step % config["replan_every"] == 0:  # measured again: Ray Train's start-up actors
            pipes["speed"].replan()                      # share a core with one stage for its first seconds
        x, y = batch(config, step + 1)
        for mode in (list(pipes) if step % 2 == 0 else list(pipes)[::-1]):
            pipe = pipes[mode]
            dist.barrier()
            sent = group.border.bytes_sent
            started = time.perf_counter()
            loss = pipe.step(x if rank == 0 else None, y if rank == dist.get_world_size() - 1 else None)
            sent = group.border.bytes_sent - sent  # stage 0 sends activations, stage 1 their gradients
            pipe.optimizer.step()
            pipe.optimizer.zero_grad()
            dist.barrier()
            step_s = time.perf_counter() - started
            split = stages.split_of(pipes["speed"].costs, pipe.bounds)  # the last measured costs
            rows.append({"step": step, "mode": mode, "layers": split.sizes(), "step_s": step_s, "loss": loss,
                         "bubble": max(0.0, 1 - m * max(split.stage_s) / step_s), "sent": sent})
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    for i, row in enumerate(rows):  # the loss is the last stage's, the border bytes both ends'
        row["loss"], row["sent"] = gathered[-1][i]["loss"], sum(r[i]["sent"] for r in gathered)
    with tempfile.TemporaryDirectory() as folder:  # Ray Train keeps the metrics of reports with a checkpoint
        ray.train.report({"rows": rows, "predicted": pipes["speed"].split.describe()},
                         checkpoint=ray.train.Checkpoint.from_directory(folder) if rank == 0 else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", choices=["even"], default=None)
    parser.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    parser.add_argument("--csv", help="write every step's row here (notebooks/pipeline.ipynb plots it)")
    parser.add_argument("--slow-cores", type=float, default=0.5,
                        help="CPUs of time the slow island gets (0: no quota, equal islands)")
    args = parser.parse_args()
    config = {"steps": args.steps, "compare": args.compare}
    with LocalCluster(ISLANDS, cpu_quota={"slow": args.slow_cores or None}, pin_cores=True):
        result = labelled_trainer(train_loop, ISLANDS, config).fit()
    rows = result.metrics["rows"]
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["step", "mode", "stage0_layers", "step_s", "bubble", "loss", "sent"])
            writer.writeheader()
            writer.writerows({**{k: r[k] for k in ("step", "mode", "step_s", "bubble", "loss", "sent")},
                              "stage0_layers": r["layers"][0]} for r in rows)
    print(f"last plan: {result.metrics['predicted']}")
    for row in rows:
        print(f"step {row['step']:3d} {row['mode']:5s} layers {row['layers']}  {row['step_s'] * 1e3:7.1f} ms  "
              f"bubble {row['bubble']:.2f}  loss {row['loss']:.4f}  across {row['sent']:,} B")
    after = {mode: [r["step_s"] for r in rows if r["mode"] == mode and r["step"] >= 2 * DEFAULTS["warmup"]]
             for mode in dict.fromkeys(r["mode"] for r in rows)}
    for mode, times in after.items():
        print(f"{mode}: mean step {statistics.mean(times) * 1e3:.1f} ms over {len(times)} steps after warm-up")
    if "even" in after:
        ratios = sorted(e / s for e, s in zip(after["even"], after["speed"]))
        print(f"speed-sized vs even: {statistics.mean(after['even']) / statistics.mean(after['speed']):.2f}x faster "
              f"(per step pair p10-p90 {ratios[len(ratios) // 10]:.2f}-{ratios[len(ratios) * 9 // 10]:.2f})")


if __name__ == "__main__":
    main()
