"""Every op on tensors of one device, checked against numpy: what the hardware suites run in each rank.

Inputs are written and results read on the caller's stream (a side stream when asked), with no
host synchronize in between, so an op that breaks stream order gives wrong values here.
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import pytest
import torch
from ray.util import collective as col
from ray.util.collective.types import ReduceOp

import hetccl_ray
from hetccl_ray.islands.libraries import nccl_available

NEEDS_GPU = pytest.mark.skipif(
    not nccl_available(),
    reason=f"needs one NVIDIA or AMD GPU with NCCL/RCCL (torch {torch.__version__}: cuda available="
           f"{torch.cuda.is_available()}, nccl={torch.distributed.is_nccl_available()})")
N = 4099  # odd, so lane and rank splits are uneven
# HW_DELAY_CYCLES (the lease script sets it): the caller's stream sleeps this many GPU cycles
# before each input is written, so an op that does not wait for that stream reads stale inputs
DELAY_CYCLES = int(os.environ.get("HW_DELAY_CYCLES", "0"))


def _rank_values(rank: int, n: int) -> np.ndarray:
    return (np.arange(n) % 13 + rank + 1).astype(np.float32)


def every_op(name: str, rank: int, world: int, device: str, n: int = N, side_stream: bool = False) -> list[str]:
    """Run each op once on ``device`` tensors; return what came out wrong (empty: all right)."""
    return timed_ops(name, rank, world, device, n, side_stream)[0]


def timed_ops(name: str, rank: int, world: int, device: str, n: int = N,
              side_stream: bool = False) -> tuple[list[str], dict[str, float]]:
    """:func:`every_op`, also returning each op's seconds (host launch to data there)."""
    wrong: list[str] = []
    times: dict[str, float] = {}
    all_values = np.stack([_rank_values(r, n) for r in range(world)])
    on_gpu = torch.device(device).type != "cpu"
    stream = torch.cuda.Stream() if on_gpu and side_stream else None
    group = hetccl_ray.get_group(name)
    checks: list[tuple[str, torch.Tensor, np.ndarray]] = []

    def tensor(values: np.ndarray) -> torch.Tensor:
        if on_gpu and DELAY_CYCLES:
            torch.cuda._sleep(DELAY_CYCLES)  # the write below lands late, on the caller's stream
        return torch.from_numpy(values.copy()).to(device, non_blocking=True)

    def check(what: str, got: torch.Tensor, expected: np.ndarray) -> None:
        checks.append((what, got, expected))

    @contextlib.contextmanager
    def timing(what: str):
        started = time.perf_counter()
        yield
        if on_gpu:
            torch.cuda.current_stream().synchronize()
        times[what] = time.perf_counter() - started

    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for op, ref in ((ReduceOp.SUM, all_values.sum(0)), (ReduceOp.MAX, all_values.max(0))):
            x = tensor(all_values[rank])
            with timing(f"allreduce {op.name}"):
                col.allreduce(x, group_name=name, op=op)
            check(f"allreduce {op}", x, ref)
        for root in range(world):
            x = tensor(all_values[rank])
            with timing(f"broadcast {root}"):
                col.broadcast(x, src_rank=root, group_name=name)
            check(f"broadcast root {root}", x, all_values[root])
            x = tensor(all_values[rank])
            with timing(f"reduce {root}"):
                col.reduce(x, dst_rank=root, group_name=name)
            if rank == root:
                check(f"reduce root {root}", x, all_values.sum(0))
        outs = [torch.zeros(n, device=device) for _ in range(world)]
        with timing("allgather"):
            col.allgather(outs, tensor(all_values[rank]), group_name=name)
        for r, out in enumerate(outs):
            check(f"allgather part {r}", out, all_values[r])
        out = torch.zeros(n, device=device)
        with timing("reducescatter"):
            col.reducescatter(out, [tensor(all_values[rank] * (r + 1)) for r in range(world)], group_name=name)
        check("reducescatter", out, all_values.sum(0) * (rank + 1))
        ins = [tensor(all_values[rank] + t) for t in range(world)]
        outs = [torch.zeros(n, device=device) for _ in range(world)]
        with timing("alltoall"):
            hetccl_ray.alltoall(ins, outs, group_name=name)
        for r, out in enumerate(outs):
            check(f"alltoall from {r}", out, all_values[r] + rank)
        gathered = [torch.zeros(n, device=device) for _ in range(world)] if rank == 0 else None
        group.gather(tensor(all_values[rank]), gathered, 0)
        for r, out in enumerate(gathered or []):
            check(f"gather part {r}", out, all_values[r])
        piece = torch.zeros(n, device=device)
        group.scatter(piece, [tensor(all_values[t] * 2) for t in range(world)] if rank == 0 else None, 0)
        check("scatter", piece, all_values[rank] * 2)
        got = torch.zeros(n, device=device)
        right, left = (rank + 1) % world, (rank - 1) % world
        if rank % 2 == 0:
            col.send(tensor(all_values[rank]), right, group_name=name)
            col.recv(got, left, group_name=name)
        else:
            col.recv(got, left, group_name=name)
            col.send(tensor(all_values[rank]), right, group_name=name)
        check(f"recv from {left}", got, all_values[left])
        host = [(what, t.to("cpu", non_blocking=False), expected) for what, t, expected in checks]  # stream-ordered
    for what, got, expected in host:
        if not np.array_equal(got.numpy(), expected):
            wrong.append(f"{what}: wrong values")
    for what, t, _ in checks:
        if t.device.type != torch.device(device).type:
            wrong.append(f"{what}: result on {t.device}, expected {device}")
    return wrong, times


def staging_bound_s(nbytes: int, device: str = "cuda") -> float:
    """Seconds to move ``nbytes`` host -> device -> host through pinned memory: the bound a
    staged border transfer of that size cannot beat."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
        host.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / 3
