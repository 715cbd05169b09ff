"""Where the time of one op goes: wall time per stage (wrapped in each rank), and the CPU time
of the rank's process per op, for the first and last rank.

    .venv/bin/python benchmarks/stages.py 2x2 allreduce,broadcast 1024,65536,1048576,16777216
    .venv/bin/python benchmarks/stages.py 1,2,3 allreduce 1024 --interleave

Stages nest and overlap (pipelined pieces), so the rows do not add up.
"""
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ray  # noqa: E402
import torch  # noqa: E402
from ray.util import collective as col  # noqa: E402

import hetccl_ray  # noqa: E402
from hetccl_ray.tools.local_cluster import LocalCluster, island_names, parse_layout  # noqa: E402


def staged(op: str, n: int, iters: int, rank: int, world: int) -> dict:
    """In one actor: time ``iters`` calls of ``op`` on ``n`` floats with each stage wrapped."""
    from hetccl_ray.group import group as G
    from hetccl_ray.islands import libraries
    from hetccl_ray.runtime import collectives, small_round
    from hetccl_ray.transport import tcp
    acc = collections.defaultdict(float)
    saved = []

    def wrap(owner, name, label):
        f = getattr(owner, name)

        def w(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                acc[label] += time.perf_counter() - t
        setattr(owner, name, w)
        saved.append((owner, name, f))

    wrap(G.HetCCLGroup, "run", "hetccl run")
    wrap(small_round, "small", "  small round of small_round.py")
    wrap(small_round, "check", "  rows-only check round")
    wrap(collectives.PlanContext, "exchange", "  island plans: border stages")
    for m in ("reduce_scatter", "allgather", "broadcast", "reduce", "gather"):
        wrap(libraries.TorchIsland, m, "  island plans: Gloo " + m)
    wrap(tcp.TcpBorder, "drive", "    waiting in the border (drive)")
    wrap(tcp.TcpBorder, "isend", "    eager sends (isend)")
    x, y = torch.ones(n), torch.ones(n // world)
    chunks = [torch.ones(n // world) for _ in range(world)]
    f = {"allreduce": lambda: col.allreduce(x, group_name="h"),
         "allgather": lambda: col.allgather(chunks, y, group_name="h"),
         "broadcast": lambda: col.broadcast(x, 0, group_name="h"),
         "reduce": lambda: col.reduce(x, 0, group_name="h"),
         "reducescatter": lambda: col.reducescatter(y, chunks, group_name="h")}[op]
    for _ in range(5):
        f()
    acc.clear()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(iters):
        f()
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    for owner, name, orig in saved:
        setattr(owner, name, orig)
    out = {"total (col.* call)": total, "CPU of this process": cpu}
    out.update(acc)
    return {k: round(v / iters * 1e6) for k, v in out.items()}


def main() -> None:
    layout, ops, sizes = sys.argv[1], sys.argv[2].split(","), [int(v) for v in sys.argv[3].split(",")]
    islands = island_names(parse_layout(layout), "--interleave" in sys.argv)
    with LocalCluster(islands) as c:
        a = c.workers(islands)
        w = len(a)
        hetccl_ray.create_collective_group(a, w, list(range(w)), group_name="h", timeout_s=60)
        print("#", ray.get([x.call.remote(lambda: hetccl_ray.get_group("h").cost_model()) for x in a])[0])
        for op in ops:
            for nbytes in sizes:
                n = nbytes // 4
                iters = max(10, min(200, (64 << 20) // max(nbytes, 1) // 8))
                r = ray.get([x.call.remote(staged, op, n, iters, i, w) for i, x in enumerate(a)])
                print(f"## {op} {nbytes} B, us per op: rank 0 | rank {w-1}")
                for k in r[0]:
                    print(f"   {k:36s} {r[0][k]:>8} | {r[-1].get(k, 0):>8}")


if __name__ == "__main__":
    main()
