"""What the per-call agreement check (``check_calls``) costs: the same allreduces on two groups
of the same actors, one checking and one not, alternated batch by batch in one run.

Both groups run the island plans at every size (``small_bytes=0``), so what differs is the
rows-only round the checked group runs first. (Below the cost model's threshold the rows
ride inside the small-message round's own messages and the check costs nothing extra.)

    .venv/bin/python benchmarks/check_cost.py [--rounds 5] [--count 300]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray.util import collective as col  # noqa: E402

import hetccl_ray  # noqa: E402
from hetccl_ray.tools.local_cluster import LocalCluster  # noqa: E402

ISLANDS = ["a", "b", "c", "c"]
SIZES = {"64 KiB": 1 << 14, "1 MiB": 1 << 18, "16 MiB": 1 << 22}


def timed(name: str, rank: int, n: int, count: int) -> float:
    x = np.ones(n, dtype=np.float32)
    col.barrier(group_name=name)
    started = time.perf_counter()
    for _ in range(count):
        col.allreduce(x, group_name=name)
    return (time.perf_counter() - started) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=300, help="allreduces per batch at 64 KiB (fewer when larger)")
    args = parser.parse_args()
    with LocalCluster(ISLANDS) as cluster:
        actors = cluster.workers(ISLANDS)
        for name, check in (("checked", True), ("unchecked", False)):
            hetccl_ray.create_collective_group(actors, 4, [0, 1, 2, 3], group_name=name, timeout_s=60,
                                               check_calls=check, small_bytes=0)
        print("| size | checked us/op | unchecked us/op | checked / unchecked |\n| --- | --- | --- | --- |")
        for label, n in SIZES.items():
            count = max(args.count * (1 << 14) // n, 5)
            times = {"checked": [], "unchecked": []}
            for _ in range(args.rounds):
                for name in times:
                    per_rank = ray.get([a.call.remote(timed, name, r, n, count) for r, a in enumerate(actors)])
                    times[name].append(max(per_rank))
            med = {name: statistics.median(t) * 1e6 for name, t in times.items()}
            print(f"| {label} | {med['checked']:.0f} | {med['unchecked']:.0f} | "
                  f"{med['checked'] / med['unchecked']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
