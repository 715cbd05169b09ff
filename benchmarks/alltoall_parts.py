"""Where a small all-to-all's time goes: the rows round that agrees block sizes vs the exchange.

    .venv/bin/python benchmarks/alltoall_parts.py        # 2x2, 1 KiB per rank, 200 ops

Wraps ``small_round.alltoall_counts`` and ``collectives.alltoall`` with timers inside each actor and
prints, per rank, microseconds per op: whole, rows round, exchange.
"""

from __future__ import annotations

import time

import ray
import torch

import hetccl_ray
from hetccl_ray.tools.local_cluster import LocalCluster

ISLANDS, ELEMENTS, WARMUP, OPS = ["a", "a", "b", "b"], 256, 20, 200


def timed_parts(name: str, rank: int, world: int) -> tuple[float, float, float]:
    from hetccl_ray.runtime import collectives, small_round

    spent = {"counts": 0.0, "plan": 0.0}
    originals = small_round.alltoall_counts, collectives.alltoall

    def timer(key, fn):
        def wrapped(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - started
        return wrapped

    small_round.alltoall_counts, collectives.alltoall = timer("counts", originals[0]), timer("plan", originals[1])
    try:
        ins = list(torch.ones(ELEMENTS).chunk(world))
        outs = list(torch.zeros(ELEMENTS).chunk(world))
        for _ in range(WARMUP):
            hetccl_ray.alltoall(ins, outs, group_name=name)
        spent.update(counts=0.0, plan=0.0)
        started = time.perf_counter()
        for _ in range(OPS):
            hetccl_ray.alltoall(ins, outs, group_name=name)
        whole = (time.perf_counter() - started) / OPS
    finally:
        small_round.alltoall_counts, collectives.alltoall = originals
    return whole * 1e6, spent["counts"] / OPS * 1e6, spent["plan"] / OPS * 1e6


if __name__ == "__main__":
    with LocalCluster(ISLANDS) as cluster:
        actors = cluster.workers(ISLANDS)
        hetccl_ray.create_collective_group(actors, len(actors), list(range(len(actors))), group_name="parts",
                                           timeout_s=60)
        rows = ray.get([a.call.remote(timed_parts, "parts", r, len(actors)) for r, a in enumerate(actors)])
    print("rank  whole us  rows round us  exchange us")
    for rank, (whole, counts, plan) in enumerate(rows):
        print(f"{rank:>4}  {whole:>8.0f}  {counts:>13.0f}  {plan:>11.0f}")
