"""Every op on tensors of one device, checked against numpy: what the hardware suites run in each rank."""

from __future__ import annotations

import numpy as np
import torch
from ray.util import collective as col
from ray.util.collective.types import ReduceOp

N = 4099  # odd, so lane and rank splits are uneven


def _rank_values(rank: int, n: int = N) -> np.ndarray:
    return (np.arange(n) % 13 + rank + 1).astype(np.float32)


def every_op(name: str, rank: int, world: int, device: str) -> list[str]:
    """Run each op once on ``device`` tensors; return what came out wrong (empty: all right)."""
    wrong: list[str] = []
    all_values = np.stack([_rank_values(r) for r in range(world)])

    def tensor(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values.copy()).to(device)

    def check(what: str, got: torch.Tensor, expected: np.ndarray) -> None:
        if got.device.type != torch.device(device).type:
            wrong.append(f"{what}: result on {got.device}, expected {device}")
        elif not np.array_equal(got.cpu().numpy(), expected):
            wrong.append(f"{what}: wrong values")

    for op, ref in ((ReduceOp.SUM, all_values.sum(0)), (ReduceOp.MAX, all_values.max(0))):
        x = tensor(all_values[rank])
        col.allreduce(x, group_name=name, op=op)
        check(f"allreduce {op}", x, ref)
    for root in range(world):
        x = tensor(all_values[rank])
        col.broadcast(x, src_rank=root, group_name=name)
        check(f"broadcast root {root}", x, all_values[root])
        x = tensor(all_values[rank])
        col.reduce(x, dst_rank=root, group_name=name)
        if rank == root:
            check(f"reduce root {root}", x, all_values.sum(0))
    outs = [torch.zeros(N, device=device) for _ in range(world)]
    col.allgather(outs, tensor(all_values[rank]), group_name=name)
    for r, out in enumerate(outs):
        check(f"allgather part {r}", out, all_values[r])
    out = torch.zeros(N, device=device)
    col.reducescatter(out, [tensor(all_values[rank] * (r + 1)) for r in range(world)], group_name=name)
    check("reducescatter", out, all_values.sum(0) * (rank + 1))
    got = torch.zeros(N, device=device)
    right, left = (rank + 1) % world, (rank - 1) % world
    if rank % 2 == 0:
        col.send(tensor(all_values[rank]), right, group_name=name)
        col.recv(got, left, group_name=name)
    else:
        col.recv(got, left, group_name=name)
        col.send(tensor(all_values[rank]), right, group_name=name)
    check(f"recv from {left}", got, all_values[left])
    return wrong
