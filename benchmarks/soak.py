"""Soak: 10,000 small and 200 large allreduces on 3 islands; threads, sockets and memory flat.

    .venv/bin/python benchmarks/soak.py [--small 10000] [--large 200] [--no-check] [--csv benchmarks/soak.csv]

Every result is checked against its expected value. After each batch every rank reports
its thread count, open file descriptors, sockets and resident memory; the run fails if any
of them grows past a small allowance over the first measured batch (after a warm-up).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import ray  # noqa: E402
from ray.util import collective as col  # noqa: E402

import hetccl_ray  # noqa: E402
from hetccl_ray.tools.local_cluster import LocalCluster  # noqa: E402

ISLANDS = ["a", "b", "c", "c"]  # 3 islands: 1 + 1 + 2 ranks
SMALL, LARGE = 256, 4 << 20  # elements: 1 KiB and 16 MiB of float32
RSS_ALLOWANCE = 64 << 20


def _target(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the descriptor listdir itself used, closed since
        return ""


def resources() -> dict:
    """This process's threads, file descriptors, sockets and resident memory."""
    fds = os.listdir("/proc/self/fd")
    sockets = sum(1 for fd in fds if _target(fd).startswith("socket:"))
    with open("/proc/self/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"threads": threading.active_count(), "fds": len(fds), "sockets": sockets, "rss": rss_kib << 10}


def batch(name: str, rank: int, world: int, count: int, n: int) -> dict:
    """``count`` allreduces of ``n`` float32 elements, each checked; then this rank's resources."""
    x = np.empty(n, dtype=np.float32)
    started = time.perf_counter()
    for i in range(count):
        x.fill(rank + 1 + (i % 7))
        col.allreduce(x, group_name=name)
        expect = world * (world + 1) / 2 + world * (i % 7)
        if x[0] != expect or x[-1] != expect:
            raise AssertionError(f"rank {rank}, allreduce {i}: got {x[0]}, {x[-1]}; expected {expect}")
    return {"seconds": time.perf_counter() - started, **resources()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--large", type=int, default=200)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--no-check", action="store_true", help="turn the per-call agreement check off")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    rows = []
    with LocalCluster(ISLANDS) as cluster:
        actors = cluster.workers(ISLANDS)
        world = len(actors)
        hetccl_ray.create_collective_group(actors, world, list(range(world)), group_name="soak", timeout_s=60,
                                           check_calls=not args.no_check)
        for n in (SMALL, LARGE):  # warm up: buffers, the pipeline thread
            ray.get([a.call.remote(batch, "soak", r, world, 5, n) for r, a in enumerate(actors)])
        plan = [("small", SMALL, args.small // args.batches)] * args.batches
        plan += [("large", LARGE, args.large // args.batches)] * args.batches
        for index, (kind, n, count) in enumerate(plan):
            per_rank = ray.get([a.call.remote(batch, "soak", r, world, count, n) for r, a in enumerate(actors)])
            for rank, facts in enumerate(per_rank):
                rows.append({"batch": index, "kind": kind, "count": count, "rank": rank, **facts})
            slowest = max(f["seconds"] for f in per_rank)
            print(f"[{index + 1}/{len(plan)}] {count} x {kind} ({n * 4} B): {slowest:.2f} s, "
                  f"{1e6 * slowest / count:.0f} us/op, threads {[f['threads'] for f in per_rank]}, "
                  f"sockets {[f['sockets'] for f in per_rank]}, "
                  f"rss MiB {[f['rss'] >> 20 for f in per_rank]}", flush=True)
    table = pd.DataFrame(rows)
    if args.csv:
        table.to_csv(args.csv, index=False)
    return report(table)


def report(table: pd.DataFrame) -> int:
    """Compare every rank's last batch with its first; non-zero when anything grew."""
    problems = []
    for rank, rows in table.groupby("rank"):
        first, last = rows.iloc[0], rows.iloc[-1]
        for column in ("threads", "fds", "sockets"):
            if last[column] > first[column]:
                problems.append(f"rank {rank}: {column} grew {first[column]} -> {last[column]}")
        for kind, runs in rows.groupby("kind"):  # large ops warm bigger buffers: compare like with like
            grown = runs["rss"].iloc[-1] - runs["rss"].iloc[0]
            if grown > RSS_ALLOWANCE:
                problems.append(f"rank {rank}: rss grew {grown >> 20} MiB over the {kind} batches")
    done = table.groupby("kind")["count"].sum() // table["rank"].nunique()
    print(f"allreduces checked: {dict(done)}; " + ("; ".join(problems) if problems else
          "threads, fds and sockets flat, rss within 64 MiB over the batches of each size, on every rank"))
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
