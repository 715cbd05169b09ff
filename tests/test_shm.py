"""The shared-memory library alone: real processes of one host meeting in a real c10d
TCPStore, every op and the call rows against numpy, segments growing, halves reused and
buffers in pieces, all-to-alls pulled from the senders' memory (addresses ahead or not) or copied
through the segments, a late rank, a missing rank named (at once when its process is gone,
else at the deadline), and nothing left in /dev/shm."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import time

import numpy as np
import pytest

WORLD = 3
OPS = ("allreduce", "reduce", "broadcast", "allgather", "reduce_scatter", "alltoall")


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
    if op == "alltoall":  # rank r sends rank t block t of its input; blocks of r + t + 1 elements
        return np.concatenate([inputs[r][_block(r, rank, n)] for r in range(WORLD)])
    return inputs[rank]


def _block(r: int, t: int, n: int) -> slice:
    """Rank r's block for rank t of its input of ``n``: uneven, some empty."""
    sizes = [(r + u + 1) * n // (3 * WORLD) if (r + u) % 4 else 0 for u in range(WORLD)]
    return slice(sum(sizes[:t]), sum(sizes[:t + 1]))


def _exited(pid: int) -> bool:
    """Whether process ``pid`` has exited (gone, or a zombie its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _worker(port: int, rank: int, script: str, late_rank: int, results: "mp.Queue") -> None:
    import torch
    import torch.distributed as dist

    from hetccl_ray.islands import shm

    try:
        store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=datetime.timedelta(seconds=30))
        store.set(f"pid/{rank}", str(os.getpid()))
        pids = {r: int(store.get(f"pid/{r}")) for r in range(WORLD)}
        gone = (lambda r: _exited(pids[r])) if script == "dead" else (lambda r: False)
        lib = shm.ShmLibrary.create(store, rank, WORLD, row_width=8, timeout_s=3.0 if script != "dead" else 60.0,
                                    gone=gone, pull=script != "copy")
        assert lib is not None, "one host: the library must form"
        if script == "pull" and not lib.pulls(1 << 30):
            results.put((rank, "cannot pull"))
            return
        if script in ("missing", "dead") and rank == WORLD - 1:
            results.put((rank, "absent"))
            return
        shm.PIECE_BYTES = 256 << 10  # 300,000 floats go in pieces
        shm.PULL_BYTES = 64 << 10  # all-to-alls of 40,002 and 300,000 floats are pulled (unless "copy")
        wrong = []
        for i, n in enumerate([3, 96, 300, 40_002, 12, 300_000, 40_002, 3]):  # grows, shrinks, reuses halves
            rows = lib.rows([i, rank, n] + [rank] * (rank % 3))  # rows of different lengths
            if rows != {r: [i, r, n] + [r] * (r % 3) for r in range(WORLD)}:
                wrong.append(("rows", n))
            for op in OPS:
                seed, root = i * 10 + OPS.index(op), i % WORLD
                buf = torch.from_numpy(_values(rank, n, seed))
                if rank == late_rank:
                    time.sleep(0.01)  # arrive last: the others must wait at the barrier
                counts = [n // WORLD] * WORLD
                blocks = [[_block(r, t, n) for t in range(WORLD)] for r in range(WORLD)]
                if i % 2:  # the data goes ahead of a call check, as the group sends it
                    chunk = buf[rank * counts[0]:(rank + 1) * counts[0]]
                    parts = {"broadcast": [buf] if rank == root else [], "allgather": [chunk],
                             "alltoall": [buf[b] for b in blocks[rank]]}.get(op, [buf])
                    lib.ahead(parts, pull=op == "alltoall")
                    lib.rows([i])
                if op == "alltoall":
                    sizes = [[b.stop - b.start for b in row] for row in blocks]
                    outs = [torch.full((sizes[r][rank],), -1.0) for r in range(WORLD)]
                    lib.alltoall(outs, [buf[b] for b in blocks[rank]], sizes)
                    buf = torch.cat(outs)
                else:
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
@pytest.mark.parametrize("script", ["pull", "copy"])
def test_every_op_matches_numpy_and_leaves_nothing(script):
    before = _ours()
    out = _run(script, late_rank=1)
    if "cannot pull" in out.values():
        pytest.skip("needs process_vm_readv between sibling processes (this host's ptrace policy forbids it)")
    assert out == {r: [] for r in range(WORLD)}, out
    assert _ours() == before


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux shared memory)")
def test_a_missing_rank_times_out_by_name():
    out = _run("missing")
    assert out[WORLD - 1] == "absent"
    for rank in range(WORLD - 1):
        assert "HetCCLTimeoutError" in out[rank] and f"ranks [{WORLD - 1}] did not arrive" in out[rank], out


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux shared memory)")
def test_a_dead_rank_is_named_long_before_the_deadline():
    start = time.monotonic()
    out = _run("dead")
    assert time.monotonic() - start < 40  # the deadline is 60 s
    for rank in range(WORLD - 1):
        assert "HetCCLPeerError" in out[rank] and f"ranks [{WORLD - 1}] are gone" in out[rank], out
