"""Small calls back to back, and after a barrier: hetccl against Ray's gloo on a local 2x2.

hetccl-bench puts a barrier before every call (nccl-tests' way) and alternates the backends,
so a call's time includes how fast the ranks wake from that barrier and what the other
backend's call left behind; a training loop issues calls back to back. Per op (the bench's
own records, so the same buffers and calls) and size, this prints:

- ``b2b``: 200 calls in a row (after 20), the slowest rank's mean wall time per call and the
  mean CPU time per rank per call;
- ``after``: hetccl's call timed after its group's barrier, the slowest rank's median of 100,
  when the iteration runs only hetccl calls and when a gloo call of the same op came first.

    python benchmarks/back_to_back.py                      # 1 KiB, every op
    python benchmarks/back_to_back.py broadcast,sendrecv 1024,65536
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402
import torch  # noqa: E402
from ray.util import collective as col  # noqa: E402

import hetccl_ray  # noqa: E402
from hetccl_ray.tools.bench import COLLS, rank_data  # noqa: E402
from hetccl_ray.tools.local_cluster import LocalCluster  # noqa: E402

WORLD = 4


def _step(group: str, op: str, nbytes: int, rank: int):
    coll = COLLS[op]
    x, into = coll.make(rank_data("fill", rank, max(nbytes // 4, WORLD), torch.float32), WORLD)
    return coll.call(group, WORLD, rank, x, into)


def _b2b(group: str, op: str, nbytes: int, rank: int) -> tuple[float, float]:
    """Wall and CPU seconds per call, 200 calls in a row."""
    step = _step(group, op, nbytes, rank)
    for _ in range(20):
        step()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(200):
        step()
    return (time.perf_counter() - wall) / 200, (time.process_time() - cpu) / 200


def _after(op: str, nbytes: int, rank: int, gloo_first: bool) -> list[float]:
    """hetccl's call after its barrier, 100 times (after 10); a gloo call first if asked."""
    mine, theirs = _step("hetccl", op, nbytes, rank), _step("gloo", op, nbytes, rank)
    times = []
    for i in range(110):
        if gloo_first:
            col.barrier(group_name="gloo")
            theirs()
        col.barrier(group_name="hetccl")
        started = time.perf_counter()
        mine()
        if i >= 10:
            times.append(time.perf_counter() - started)
    return times


def main() -> None:
    ops = sys.argv[1].split(",") if len(sys.argv) > 1 else list(COLLS)
    sizes = [int(s) for s in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1024]
    with LocalCluster(["a", "b"]) as cluster:
        group = cluster.workers(["a", "a", "b", "b"])
        hetccl_ray.create_collective_group(group, WORLD, list(range(WORLD)), group_name="hetccl", timeout_s=60)
        col.create_collective_group(group, WORLD, list(range(WORLD)), backend="gloo", group_name="gloo")
        print(f"{'op':>13} {'size (B)':>9} | b2b us: {'hetccl':>7} {'cpu':>5} {'gloo':>7} {'cpu':>5} | "
              f"after barrier us: {'hetccl only':>11} {'gloo first':>10}")
        for op in ops:
            for nbytes in sizes:
                b2b = {}
                for label in ("gloo", "hetccl"):
                    got = ray.get([a.call.remote(_b2b, label, op, nbytes, r) for r, a in enumerate(group)],
                                  timeout=300)
                    b2b[label] = (max(w for w, _ in got) * 1e6, statistics.mean(c for _, c in got) * 1e6)
                after = []
                for gloo_first in (False, True):
                    got = ray.get([a.call.remote(_after, op, nbytes, r, gloo_first) for r, a in enumerate(group)],
                                  timeout=300)
                    after.append(statistics.median(max(t) for t in zip(*got)) * 1e6)
                print(f"{op:>13} {nbytes:>9} | {'':>7} {b2b['hetccl'][0]:>7.0f} {b2b['hetccl'][1]:>5.0f} "
                      f"{b2b['gloo'][0]:>7.0f} {b2b['gloo'][1]:>5.0f} | {'':>17} {after[0]:>11.0f} {after[1]:>10.0f}",
                      flush=True)


if __name__ == "__main__":
    main()
