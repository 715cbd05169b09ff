"""Faults: rounds of kill-one-rank / re-create-the-group, each detected within the deadline.

    .venv/bin/python benchmarks/faults.py [--rounds 20] [--timeout 20] [--csv benchmarks/faults.csv]

Two survivors (islands a and b) stay; each round a new victim joins (in b, sharing an
island with a survivor, or alone in c, alternately; at a rotating rank), the group is
formed and checked with one allreduce, the survivors start a large allreduce, the
victim is killed with ``ray.kill``, and the survivors time how long their call took to
fail. They then destroy the group (no hetccl thread may be left) and the next round
re-creates it under the same name.
"""

from __future__ import annotations

import argparse
import statistics
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

NAME = "faults"


def checked_allreduce(rank: int, world: int) -> bool:
    x = np.full(1000, rank + 1.0)
    col.allreduce(x, group_name=NAME)
    return bool(np.all(x == world * (world + 1) / 2))


def fail_and_time() -> tuple[float, str]:
    """A large allreduce the victim never joins: seconds until it failed, and the error."""
    started = time.monotonic()
    try:
        col.allreduce(np.ones(1 << 20), group_name=NAME)
        return float("nan"), "no error"
    except hetccl_ray.HetCCLError as exc:
        return time.monotonic() - started, str(exc)


def block() -> None:
    time.sleep(3600)


def destroy() -> int:
    """Destroy the group; the hetccl threads left after up to 10 s."""
    col.destroy_collective_group(NAME)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [t for t in threading.enumerate() if t.name.startswith("hetccl")]
        if not left:
            return 0
        time.sleep(0.1)
    return len(left)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    rows = []
    with LocalCluster(["a", "b", "c"]) as cluster:
        survivors = cluster.workers(["a", "b"])
        for index in range(args.rounds):
            island = "bc"[index % 2]
            victim = cluster.workers([island])[0]
            slot = index % 3
            group = survivors[:slot] + [victim] + survivors[slot:]
            started = time.monotonic()
            hetccl_ray.create_collective_group(group, 3, [0, 1, 2], group_name=NAME, timeout_s=args.timeout)
            correct = all(ray.get([a.call.remote(checked_allreduce, r, 3) for r, a in enumerate(group)]))
            formed = time.monotonic() - started
            victim.call.remote(block)
            refs = [a.call.remote(fail_and_time) for a in survivors]
            time.sleep(1.0)
            ray.kill(victim)
            failures = ray.get(refs, timeout=args.timeout + 30)
            leftover = ray.get([a.call.remote(destroy) for a in survivors])
            detect = [seconds - 1.0 for seconds, _ in failures]
            named = all(f"did not arrive: [{slot}]" in message for _, message in failures)
            rows.append({"round": index, "victim_island": island, "victim_rank": slot, "formed_s": formed,
                         "correct": correct, "detect_s": max(detect), "dead_rank_named": named,
                         "threads_left": sum(leftover)})
            print(f"[{index + 1}/{args.rounds}] victim rank {slot} in {island}: formed+checked {formed:.1f} s, "
                  f"correct {correct}, detected after {max(detect):.2f} s, named {named}, "
                  f"threads left {sum(leftover)}", flush=True)
    table = pd.DataFrame(rows)
    if args.csv:
        table.to_csv(args.csv, index=False)
    ok = table["correct"].all() and table["dead_rank_named"].all() and (table["threads_left"] == 0).all() \
        and (table["detect_s"] < args.timeout).all()
    print(f"{len(table)} rounds: detection median {statistics.median(table['detect_s']):.2f} s, "
          f"max {table['detect_s'].max():.2f} s (deadline {args.timeout:.0f} s); every group correct: "
          f"{table['correct'].all()}; dead rank named every time: {table['dead_rank_named'].all()}; "
          f"threads left: {int(table['threads_left'].sum())}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
