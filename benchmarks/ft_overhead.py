"""What torchft's loop costs over plain DDP on hetccl, side by side in one run: 4 ranks on 2
islands (spawned processes, one host), each rank alternating step by step between a model
trained with a plain hetccl process group (gradients allreduced, averaged) and an identical
model trained as an ``ElasticRank`` (torchft's quorum, the allreduce through its Manager, the
commit vote). A step's time is its slowest rank's.

    .venv/bin/python benchmarks/ft_overhead.py [--steps 40] [--width 1024] [--batch 256]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing
import os
import socket
import statistics
import time

ISLANDS = ["island-x", "island-x", "island-y", "island-y"]


def _model(width: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 1))


def rank_main(rank: int, port: int, lighthouse: str, steps: int, width: int, batch: int, async_quorum: bool,
              out) -> None:
    os.environ["HETCCL_ISLAND"] = ISLANDS[rank]
    import torch
    import torch.distributed as dist

    import hetccl_ray
    from hetccl_ray.doors.ft import ElasticRank

    hetccl_ray.register()  # the "hetccl" torch backend

    torch.set_num_threads(1)
    dist.init_process_group("hetccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(ISLANDS),
                            timeout=datetime.timedelta(seconds=60))
    plain, elastic_model = _model(width), _model(width)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    elastic = ElasticRank(elastic_model, torch.optim.SGD(elastic_model.parameters(), lr=0.01), f"r{rank}", lighthouse,
                          async_quorum=async_quorum)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, 1, generator=g)
    loss = lambda model: torch.nn.functional.mse_loss(model(x), y)  # noqa: E731
    times = {"plain": [], "torchft": []}
    dist.barrier()
    for step in range(steps):
        order = ("plain", "torchft") if step % 2 == 0 else ("torchft", "plain")  # who goes first alternates
        for kind in order:
            dist.barrier()
            started = time.perf_counter()
            if kind == "plain":
                plain_opt.zero_grad()
                loss(plain).backward()
                grads = [p.grad for p in plain.parameters()]
                flat = torch.cat([grad.reshape(-1) for grad in grads])  # one bucket, as ElasticRank's
                dist.all_reduce(flat)
                flat /= len(ISLANDS)
                offset = 0
                for grad in grads:
                    grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                    offset += grad.numel()
                plain_opt.step()
            else:
                while elastic.step(lambda n: loss(elastic_model)) is None:
                    pass
            times[kind].append(time.perf_counter() - started)
    elastic.close()
    out.put((rank, times))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--async-quorum", action="store_true", help="torchft's quorum overlapping the compute")
    args = parser.parse_args()
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=len(ISLANDS), join_timeout_ms=2000)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, lighthouse.address(), args.steps, args.width, args.batch,
                                                 args.async_quorum, out)) for r in range(len(ISLANDS))]
    for proc in procs:
        proc.start()
    per_rank = dict(out.get(timeout=900) for _ in procs)
    for proc in procs:
        proc.join(30)
    lighthouse.shutdown()
    steps = {kind: [max(times) for times in zip(*(per_rank[r][kind] for r in per_rank))][args.warmup:]
             for kind in ("plain", "torchft")}
    plain, ft = statistics.median(steps["plain"]), statistics.median(steps["torchft"])
    ratios = sorted(b / a for a, b in zip(steps["plain"], steps["torchft"]))
    print(f"# ft_overhead: 4 ranks on 2 islands, MLP width {args.width}, batch {args.batch}, "
          f"{len(steps['plain'])} steps each after {args.warmup} warm-up, alternating, "
          f"{'async' if args.async_quorum else 'sync'} quorum")
    print("| loop | step, median (ms) | p10-p90 (ms) |")
    print("|---|---:|---:|")
    for kind, med in (("plain DDP over hetccl", plain), ("torchft over hetccl", ft)):
        calls = sorted(steps["plain" if kind.startswith("plain") else "torchft"])
        print(f"| {kind} | {med * 1e3:.1f} | {calls[len(calls) // 10] * 1e3:.1f}-{calls[-1 - len(calls) // 10] * 1e3:.1f} |")
    print(f"# torchft / plain: {ft / plain:.3f} (per-step ratio p10-p90 {ratios[len(ratios) // 10]:.2f}-"
          f"{ratios[-1 - len(ratios) // 10]:.2f}); floor: at most 1.10")


if __name__ == "__main__":
    main()
