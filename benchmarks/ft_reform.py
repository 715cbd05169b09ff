"""How long a quorum change costs hetccl under torchft: the first formation of a hetccl group
of 4 ranks on 2 islands (rendezvous, border, island libraries, calibration races) against
re-forming it, as torchft's Manager does at every quorum change (``ProcessGroupHetCCL.configure``
over a fresh store prefix), with the costs agreed the first time reused, and without.

    .venv/bin/python benchmarks/ft_reform.py [--reforms 10] [--flat off]

``--flat off`` (the default) keeps the flat shared-memory plan out, so the group calibrates
its cross-island plans as it would across hosts (one host hides the border otherwise).
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


def rank_main(rank: int, port: int, reforms: int, reuse: bool, flat: str, out) -> None:
    os.environ.update(HETCCL_ISLAND=ISLANDS[rank], HETCCL_FLAT=flat)
    import torch
    import torch.distributed as dist

    from hetccl_ray.doors import ft
    from hetccl_ray.doors.torch_backend import HetCCLProcessGroup

    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, len(ISLANDS), rank == 0, timeout=timeout)
    pg = ft.ProcessGroupHetCCL(timeout)
    if not reuse:  # the same door, forming as a plain torch group would (races every time)
        pg._create_pg = lambda s, r, n: HetCCLProcessGroup(s, r, n, timeout, name=f"torchft-q{pg._quorum_id}")
    seconds = []
    for quorum in range(reforms + 1):
        store.set(f"ready/{quorum}/{rank}", "1")
        store.wait([f"ready/{quorum}/{r}" for r in range(len(ISLANDS))])  # every rank starts together
        started = time.perf_counter()
        pg.configure(f"127.0.0.1:{port}/torchft/{quorum}/0", f"r{rank}", rank, len(ISLANDS), quorum_id=quorum)
        x = torch.ones(1024)
        pg.allreduce([x], dist.AllreduceOptions()).wait()  # formed and usable: one op through it
        seconds.append(time.perf_counter() - started)
        assert x[0].item() == len(ISLANDS)
    pg.abort(errored=False)
    out.put((rank, seconds))


def measure(reforms: int, reuse: bool, flat: str) -> list[float]:
    """Per formation, its slowest rank's seconds (the first is the full formation)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, reforms, reuse, flat, out)) for r in range(len(ISLANDS))]
    for proc in procs:
        proc.start()
    per_rank = dict(out.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join(30)
    return [max(times) for times in zip(*per_rank.values())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reforms", type=int, default=10)
    parser.add_argument("--flat", default="off", choices=["off", "auto"])
    args = parser.parse_args()
    print(f"# ft_reform: 4 ranks on 2 islands ({ISLANDS}), flat {args.flat}, {args.reforms} re-formations each")
    print("| costs | first formation (s) | re-forming, median (s) | re-forming, range (s) |")
    print("|---|---:|---:|---:|")
    for reuse in (True, False):
        times = measure(args.reforms, reuse, args.flat)
        again = times[1:]
        print(f"| {'reused' if reuse else 'raced every time'} | {times[0]:.2f} | {statistics.median(again):.2f} | "
              f"{min(again):.2f}-{max(again):.2f} |", flush=True)


if __name__ == "__main__":
    main()
