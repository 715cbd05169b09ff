"""Back-to-back calls, no barrier between them: hetccl against Ray's gloo on a local 2x2.

hetccl-bench puts a barrier before every call (nccl-tests' way), so a call's time includes
how fast the ranks wake from that barrier; a training loop issues calls back to back. This
times 50 calls in a row (after 10) per rank, the slowest rank's mean per call:

    python benchmarks/back_to_back.py
"""

from __future__ import annotations

import time

import ray
import torch
from ray.util import collective as col

import hetccl_ray
from hetccl_ray.local_cluster import LocalCluster

WORLD = 4


def _time(name: str, rank: int, op: str, nbytes: int, gloo: bool) -> float:
    n = max(nbytes // 4 // WORLD, 1)
    ins, outs = [torch.full((n,), float(rank)) for _ in range(WORLD)], [torch.zeros(n) for _ in range(WORLD)]
    whole = torch.ones(n * WORLD)
    if op == "broadcast":
        call = lambda: col.broadcast(whole, src_rank=0, group_name=name)  # noqa: E731
    elif gloo:  # Ray's gloo group has no all-to-all: its torch Gloo group's
        pg, out = col.get_group_handle(name)._pg, torch.zeros(n * WORLD)
        call = lambda: pg.alltoall_base(out, whole, [], [], torch.distributed.AllToAllOptions()).wait()  # noqa: E731
    else:
        call = lambda: hetccl_ray.alltoall(ins, outs, group_name=name)  # noqa: E731
    for _ in range(10):
        call()
    started = time.perf_counter()
    for _ in range(50):
        call()
    return (time.perf_counter() - started) / 50


def main() -> None:
    with LocalCluster(["a", "b"]) as cluster:
        group = cluster.workers(["a", "a", "b", "b"])
        hetccl_ray.create_collective_group(group, WORLD, list(range(WORLD)), group_name="hetccl", timeout_s=60)
        col.create_collective_group(group, WORLD, list(range(WORLD)), backend="gloo", group_name="gloo")
        print(f"{'op':>10} {'size (B)':>10} {'hetccl us':>10} {'gloo us':>10} {'gloo/hetccl':>12}")
        for op in ("broadcast", "alltoall"):
            for nbytes in (1 << 10, 64 << 10, 256 << 10, 1 << 20):
                us = {}
                for label in ("gloo", "hetccl"):
                    times = ray.get([a.call.remote(_time, label, r, op, nbytes, label == "gloo")
                                     for r, a in enumerate(group)], timeout=300)
                    us[label] = max(times) * 1e6
                print(f"{op:>10} {nbytes:>10} {us['hetccl']:>10.0f} {us['gloo']:>10.0f} {us['gloo'] / us['hetccl']:>12.2f}")


if __name__ == "__main__":
    main()
