"""DDP step time on hetccl vs Gloo, one island of 2 ranks, side by side in one run.

    .venv/bin/python benchmarks/ddp_overhead.py

Each backend trains the same MLP (about 4M parameters, so DDP's buckets dominate) for
warm-up plus timed steps; the runs alternate backends ROUNDS times and report the medians (this VM is noisy:
single runs of either backend vary by 2x).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from tests import torch_workers  # noqa: E402

WARMUP, STEPS, ROUNDS = 3, 10, 6


def timed_ddp(rank: int, world: int) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(), nn.Linear(1024, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x, y = torch.randn(32, 1024), torch.randn(32, 10)
    for step in range(WARMUP + STEPS):
        if step == WARMUP:
            torch.distributed.barrier()
            started = time.perf_counter()
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (time.perf_counter() - started) / STEPS


def main() -> None:
    times = {"hetccl": [], "gloo": []}
    for _ in range(ROUNDS):
        for backend in times:
            per_rank = torch_workers.run(timed_ddp, ["cpu", "cpu"], backend)
            times[backend].append(max(per_rank))
    median = {b: statistics.median(t) for b, t in times.items()}
    for backend, samples in times.items():
        print(f"{backend:>6}: median {median[backend] * 1e3:7.1f} ms/step  samples "
              + " ".join(f"{s * 1e3:.1f}" for s in samples))
    print(f"hetccl / gloo step time: {median['hetccl'] / median['gloo']:.3f}  (floor: <= 1.15)")


if __name__ == "__main__":
    main()
