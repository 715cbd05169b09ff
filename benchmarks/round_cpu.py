"""CPU per small round: the round of each op, N times on four ranks that are threads of this
process over real loopback TCP borders (2x2). One process holds the GIL, so the wall time per
call is the four ranks' CPU together: a before/after check of the round's Python cost.

    .venv/bin/python benchmarks/round_cpu.py                 # 1000 calls per op, 1 KiB
    .venv/bin/python benchmarks/round_cpu.py 2000 allreduce,check
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from hetccl_ray.runtime import small_round  # noqa: E402
from hetccl_ray.core.calls import Call  # noqa: E402
from hetccl_ray.core.topology import Topology  # noqa: E402
from tests.fakes import loopback_borders, run_ranks  # noqa: E402 - the round uses no island (FAKE unused)

ISLANDS = ["a", "a", "b", "b"]
OPS = ["check", "allreduce", "broadcast", "allgather", "reducescatter"]


def main() -> None:
    calls = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    ops = sys.argv[2].split(",") if len(sys.argv) > 2 else OPS
    topo = Topology.from_islands(ISLANDS)
    borders = loopback_borders(topo)
    seq = 0
    for op in ops:
        n = 256  # 1 KiB of float32 (allgather/reducescatter: the whole buffer)

        def body(ctx, op=op, first=seq + 1):
            ctx.direct = ctx.border
            x, out = torch.zeros(n), torch.empty(n // topo.world_size)
            started = time.perf_counter()
            for i in range(calls):
                if op == "check":
                    small_round.check(ctx, Call("barrier", torch.uint8, 0, seq=first + i))
                else:
                    small_round.small(ctx, Call(op, torch.float32, n, root=0, reduce="sum", seq=first + i), x,
                               out if op == "reducescatter" else None)
            return time.perf_counter() - started

        seq += calls + 1
        seconds, _ = run_ranks(ISLANDS, body, borders=borders)
        print(f"{op:14s} {max(seconds) / calls * 1e6:7.1f} us per call, four ranks' CPU together")
    for border in borders:
        border.close()


if __name__ == "__main__":
    main()
