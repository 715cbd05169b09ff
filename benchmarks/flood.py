"""Flood: 2,000 stranger connections at every rank's border listener while 1 KiB allreduces run.

    .venv/bin/python benchmarks/flood.py [--connections 2000] [--ops 1500]

2x2 islands on the local cluster. Phase 1 times ``--ops`` checked 1 KiB allreduces alone;
phase 2 the same while FAKE attackers (real sockets from this process) open
``--connections`` connections to each rank's listener, a third sending nothing (held open),
a third random bytes, a third a wrong proof. Each rank reports its thread count during the
flood; every result is checked. Prints the medians, their ratio, and the threads.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray.util import collective as col  # noqa: E402

import hetccl_ray  # noqa: E402
from hetccl_ray.tools.local_cluster import LocalCluster  # noqa: E402

ISLANDS = ["a", "a", "b", "b"]


def _address(name: str) -> tuple[str, int]:
    return tuple(hetccl_ray.get_group(name).border.address)


def _allreduces(name: str, rank: int, world: int, ops: int) -> tuple[list[float], int, bool]:
    """Times of ``ops`` 1 KiB allreduces, the most threads seen, and whether all were right."""
    times, most, right = [], threading.active_count(), True
    for _ in range(ops):
        x = np.full(256, rank + 1.0, dtype=np.float32)
        started = time.perf_counter()
        col.allreduce(x, group_name=name)
        times.append(time.perf_counter() - started)
        right &= bool((x == world * (world + 1) / 2).all())
        most = max(most, threading.active_count())
    return times, most, right


def _flood(address: tuple[str, int], count: int, held: list, until: float) -> None:
    for k in range(count):
        if time.monotonic() > until:
            return
        try:
            sock = socket.create_connection(address, timeout=0.5)
        except OSError:
            continue
        try:
            if k % 3 == 1:
                sock.sendall(os.urandom(36))
            elif k % 3 == 2:
                sock.sendall(b"\x00\x00\x00\x00" + bytes(32))
        except OSError:
            pass
        held.append(sock)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--ops", type=int, default=1500)
    args = parser.parse_args()
    with LocalCluster(ISLANDS) as cluster:
        actors = cluster.workers(ISLANDS)
        world = len(actors)
        hetccl_ray.create_collective_group(actors, world, list(range(world)), group_name="flood", timeout_s=120)
        addresses = ray.get([a.call.remote(_address, "flood") for a in actors])

        def run() -> list:
            return ray.get([a.call.remote(_allreduces, "flood", r, world, args.ops) for r, a in enumerate(actors)],
                           timeout=300)

        quiet = run()
        print(f"# quiet phase done ({args.ops} allreduces)", flush=True)
        held: list = []
        until = time.monotonic() + 60  # the flood stops by itself
        flooders = [threading.Thread(target=_flood, args=(address, args.connections, held, until))
                    for address in addresses]
        for flooder in flooders:
            flooder.start()
        loud = run()
        for flooder in flooders:
            flooder.join()
        rejected = ray.get([a.call.remote(lambda: hetccl_ray.border_stats("flood")["rejected_connections"])
                            for a in actors], timeout=60)
        print(f"# flooded phase done; {len(held)} connections opened", flush=True)
        for sock in held:
            sock.close()

    def median_ms(results) -> float:
        return statistics.median(max(t) for t in zip(*[times for times, _, _ in results])) * 1e3

    q, f = median_ms(quiet), median_ms(loud)
    print(f"# flood: {args.connections} connections at each of {world} ranks, {args.ops} 1 KiB allreduces per phase")
    print(f"quiet: median {q:.2f} ms; flooded: median {f:.2f} ms; ratio {f / q:.2f}")
    print(f"threads per rank, most seen while flooded: {[most for _, most, _ in loud]}")
    print(f"refused per rank: {rejected}; results right: {all(ok for _, _, ok in quiet + loud)}")


if __name__ == "__main__":
    main()
