"""Small all-to-alls back to back over the TCP border (2x2, flat plan off, so the blocks go
straight and the check is the three-hop round, or one hop): the slowest rank's wall time per
call and each rank's CPU per call, best of three bursts of 300. A before/after check of the
messages an all-to-all sends (blocks riding in the check's messages: small_round.rides).

    python benchmarks/alltoall_b2b.py            # three hops, 1 and 32 KiB
    python benchmarks/alltoall_b2b.py one_hop
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402
import torch  # noqa: E402

import hetccl_ray  # noqa: E402
from hetccl_ray.tools.local_cluster import LocalCluster  # noqa: E402

WORLD, CALLS = 4, 300


def bursts(rank: int, nbytes: int) -> list[tuple[float, float]]:
    """(wall us, CPU us) per call of three bursts, after checking one call's values."""
    n = nbytes // 4 // WORLD
    ins, outs = [torch.full((n,), float(rank * 10 + t)) for t in range(WORLD)], [torch.zeros(n) for _ in range(WORLD)]
    hetccl_ray.alltoall(ins, outs, group_name="b2b")
    assert all(torch.equal(outs[r], torch.full((n,), float(r * 10 + rank))) for r in range(WORLD))
    for _ in range(30):
        hetccl_ray.alltoall(ins, outs, group_name="b2b")
    out = []
    for _ in range(3):
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(CALLS):
            hetccl_ray.alltoall(ins, outs, group_name="b2b")
        out.append(((time.perf_counter() - wall) / CALLS * 1e6, (time.thread_time() - cpu) / CALLS * 1e6))
    return out


def main() -> None:
    one_hop = "one_hop" in sys.argv[1:]
    with LocalCluster(["a", "b"]) as cluster:
        group = cluster.workers(["a", "a", "b", "b"])
        hetccl_ray.create_collective_group(group, WORLD, list(range(WORLD)), group_name="b2b", timeout_s=60,
                                           flat="off", small_bytes=1 << 16, one_hop=one_hop)
        for nbytes in (1024, 32768):
            got = ray.get([a.call.remote(bursts, r, nbytes) for r, a in enumerate(group)])
            wall = min(max(g[i][0] for g in got) for i in range(3))
            cpu = min(statistics.mean(g[i][1] for g in got) for i in range(3))
            print(f"alltoall {nbytes:>6} B ({'one hop' if one_hop else 'three hops'}): wall {wall:.0f} us per call, "
                  f"CPU {cpu:.0f} us per rank per call", flush=True)


if __name__ == "__main__":
    main()
