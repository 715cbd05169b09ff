"""The shared-memory flat library alone: real processes of one host meeting in a real c10d
TCPStore, every op against numpy, segments growing and halves reused, a late rank, a
missing rank timing out by name, and nothing left in /dev/shm."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import time

import numpy as np
import pytest

WORLD = 3
OPS = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _values(rank: int, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, rank]).integers(-8, 9, n).astype(np.float32)


def _expected(op: str, rank: int, n: int, seed: int, root: int) -> np.ndarray:
    """What ``op`` leaves in ``rank``'s buffer of ``n`` (numpy, from every rank's inputs)."""
    inputs = [_values(r, n, seed) for r in range(WORLD)]
    total = np.sum(inputs, axis=0)
    chunk = n // WORLD
    mine = slice(rank * chunk, (rank + 1) * chunk)
    if op == "allreduce" or (op == "reduce" and rank == root):
        return total
    if op == "broadcast":
        return inputs[root]
    if op == "allgather":
        return np.concatenate([inputs[r][r * chunk:(r + 1) * chunk] for r in range(WORLD)])
    if op == "reduce_scatter":
        out = inputs[rank].copy()
        out[mine] = total[mine]
        return out
    return inputs[rank]


def _worker(port: int, rank: int, script: str, late_rank: int, results: "mp.Queue") -> None:
    import torch
    import torch.distributed as dist

    from hetccl_ray.collective.shm import ShmLibrary

    try:
        store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=datetime.timedelta(seconds=30))
        lib = ShmLibrary.create(store, rank, WORLD, timeout_s=3.0)
        assert lib is not None, "one host: the library must form"
        if script == "missing" and rank == WORLD - 1:
            results.put((rank, "absent"))
            return
        wrong = []
        for i, n in enumerate([3, 96, 300, 40_002, 12, 300_000, 96, 3]):  # grows, shrinks, reuses halves
            for op in OPS:
                seed, root = i * 10 + OPS.index(op), i % WORLD
                buf = torch.from_numpy(_values(rank, n, seed))
                if rank == late_rank:
                    time.sleep(0.01)  # arrive last: the others must wait at the barrier
                counts = [n // WORLD] * WORLD
                {"allreduce": lambda: lib.allreduce(buf, "sum"), "reduce": lambda: lib.reduce(buf, root, "sum"),
                 "broadcast": lambda: lib.broadcast(buf, root), "allgather": lambda: lib.allgather(buf, counts),
                 "reduce_scatter": lambda: lib.reduce_scatter(buf, counts, "sum")}[op]()
                if not np.array_equal(buf.numpy(), _expected(op, rank, n, seed, root)):
                    wrong.append((op, n))
        lib.close()
        results.put((rank, wrong))
    except Exception as exc:  # reported to the test, which names the rank
        results.put((rank, f"{type(exc).__name__}: {exc}"))


def _run(script: str, late_rank: int = -1) -> dict:
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_worker, args=(port, r, script, late_rank, results)) for r in range(WORLD)]
    for proc in procs:
        proc.start()
    out = dict(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    return out


def _ours() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("hetccl-")}


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux shared memory)")
def test_every_op_matches_numpy_and_leaves_nothing():
    before = _ours()
    out = _run("ops", late_rank=1)
    assert out == {r: [] for r in range(WORLD)}, out
    assert _ours() == before


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux shared memory)")
def test_a_missing_rank_times_out_by_name():
    out = _run("missing")
    assert out[WORLD - 1] == "absent"
    for rank in range(WORLD - 1):
        assert "HetCCLTimeoutError" in out[rank] and f"ranks [{WORLD - 1}] did not arrive" in out[rank], out
