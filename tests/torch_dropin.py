"""Calls code written for backend="gloo" makes, run in spawned ranks on either backend:
tests/test_torch_dropin.py compares what "hetccl" gives with what Gloo gives."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

MOVED = [torch.int8, torch.int16, torch.bool, torch.complex64, torch.float8_e4m3fn, torch.uint16, torch.float64]
REDUCED = [torch.int8, torch.int16, torch.uint8, torch.int32, torch.float32, torch.bfloat16]


def _data(rank: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    raw = torch.randint(0, 5, (n,), generator=g)
    if dtype.is_complex:
        return torch.complex(raw.float(), -raw.float()).to(dtype)
    return raw.to(torch.float32).to(dtype) if dtype.is_floating_point else raw.to(dtype)


def portable(t: torch.Tensor) -> torch.Tensor:
    """As numpy can carry it back: float8 and complex as bytes, bfloat16 as float32 (its sums
    are compared within rounding), uint16 as int32."""
    if t.dtype in (torch.float8_e4m3fn, torch.complex64):
        return t.view(torch.uint8).clone()
    if t.dtype in (torch.bfloat16, torch.uint16):
        return t.to(torch.float32 if t.dtype == torch.bfloat16 else torch.int32)
    return t.clone()


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_FOLD = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}


def reference(rank: int, world: int) -> dict[str, torch.Tensor]:
    """What the calls of :func:`calls` with dtypes Gloo may refuse must give, from the inputs
    alone (reductions in float64, exact for these small integers)."""
    out = {}
    for dtype in REDUCED:
        every = torch.stack([_data(r, 9, dtype, 4).double() for r in range(world)])
        for name, fold in _FOLD.items():
            out[f"all_reduce {name} {dtype}"] = portable(fold(every, dim=0).to(dtype))
        rows = sum(_data(r, 4 * world, dtype, 5).double() for r in range(world))
        out[f"reduce_scatter_tensor {dtype}"] = portable(rows[4 * rank:4 * rank + 4].to(dtype))
    for dtype in MOVED:
        out[f"broadcast {dtype}"] = portable(_data(world - 1, 7, dtype))
        out[f"all_gather {dtype}"] = portable(torch.cat([_data(r, 7, dtype, 1) for r in range(world)]))
        out[f"all_gather_into_tensor {dtype}"] = portable(torch.cat([_data(r, 7, dtype, 2) for r in range(world)]))
        out[f"all_to_all_single {dtype}"] = portable(torch.cat([_data(r, 3 * world, dtype, 3)[3 * rank:3 * rank + 3]
                                                                for r in range(world)]))
    return out


def calls(rank: int, world: int) -> dict[str, Any]:
    """One of each call, results as tensors (:func:`portable`); a call the backend refuses
    (Gloo takes fewer dtypes) as the string "refused"."""
    out: dict[str, Any] = {}

    def keep(key: str, t: torch.Tensor) -> None:
        out[key] = portable(t)

    for dtype in MOVED:
        def moved() -> None:
            t = _data(rank, 7, dtype)
            dist.broadcast(t, src=world - 1)
            keep(f"broadcast {dtype}", t)
            parts = [torch.zeros(7, dtype=dtype) for _ in range(world)]
            dist.all_gather(parts, _data(rank, 7, dtype, 1))
            keep(f"all_gather {dtype}", torch.cat(parts))
            whole = torch.zeros(7 * world, dtype=dtype)
            dist.all_gather_into_tensor(whole, _data(rank, 7, dtype, 2))
            keep(f"all_gather_into_tensor {dtype}", whole)
            got = torch.zeros(3 * world, dtype=dtype)
            dist.all_to_all_single(got, _data(rank, 3 * world, dtype, 3))
            keep(f"all_to_all_single {dtype}", got)
        try:
            moved()
        except RuntimeError:  # every rank refuses the same dtype alike, before any data moves
            for key in reference(rank, world):
                if key.endswith(str(dtype)):
                    out.setdefault(key, "refused")
    for dtype in REDUCED:
        for name, op in _OPS.items():
            t = _data(rank, 9, dtype, 4)
            try:
                dist.all_reduce(t, op=op)
                keep(f"all_reduce {name} {dtype}", t)
            except RuntimeError:  # Gloo refuses some dtypes, every rank alike, before data moves
                out[f"all_reduce {name} {dtype}"] = "refused"
        rows = _data(rank, 4 * world, dtype, 5)
        piece = torch.zeros(4, dtype=dtype)
        try:
            dist.reduce_scatter_tensor(piece, rows)
            keep(f"reduce_scatter_tensor {dtype}", piece)
        except RuntimeError:
            out[f"reduce_scatter_tensor {dtype}"] = "refused"
    z = _data(rank, 6, torch.complex64, 6)
    dist.all_reduce(z)
    keep("all_reduce complex sum", z)
    ins = [torch.full((2,), float(rank)), torch.full((3,), float(10 * rank))]
    outs = [[torch.zeros(2), torch.zeros(3)] for _ in range(world)]
    dist.all_gather_coalesced(outs, ins)
    keep("all_gather_coalesced", torch.cat([t for per_rank in outs for t in per_rank]))
    outs = [torch.zeros(4 * world), torch.zeros(2 * world)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], torch.full((4,), float(rank)))
        dist.all_gather_into_tensor(outs[1], torch.full((2,), float(rank + 5)))
    cm.wait()
    keep("coalesced all_gather_into_tensor", torch.cat(outs))
    pieces = [torch.zeros(3), torch.zeros(2)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(pieces[0], torch.arange(3.0 * world) + rank)
        dist.reduce_scatter_tensor(pieces[1], torch.arange(2.0 * world) * (rank + 1))
    cm.wait()
    keep("coalesced reduce_scatter_tensor", torch.cat(pieces))
    sums = [torch.full((4,), float(rank)), torch.full((2,), float(rank * 3))]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in sums:
            dist.all_reduce(t)
    cm.wait()
    keep("coalesced all_reduce", torch.cat(sums))
    subgroup, _ = dist.new_subgroups(group_size=2 if world % 2 == 0 else world)
    mine = torch.full((2,), float(rank + 1))
    dist.all_reduce(mine, group=subgroup)
    keep("new_subgroups all_reduce", mine)
    sparse = torch.sparse_coo_tensor(torch.tensor([[rank, 5]]), torch.tensor([1.0 + rank, 2.0]), (8,))
    dist.all_reduce(sparse)
    keep("sparse all_reduce", sparse.to_dense())
    n = 1 << 20  # 4 MiB each way: more than the sockets buffer, so blocking sends would deadlock
    bufs = {p: torch.zeros(n) for p in range(world) if p != rank}
    ops = [op for p in bufs for op in (dist.P2POp(dist.isend, torch.full((n,), float(10 * rank + p)), p, tag=7),
                                       dist.P2POp(dist.irecv, bufs[p], p, tag=7))]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    keep("batch_isend_irecv", torch.stack([bufs[p][[0, -1]] for p in sorted(bufs)]))
    objects = [None] * world
    dist.gather_object({"rank": rank}, objects if rank == 0 else None, dst=0)
    out["gather_object"] = torch.tensor([o["rank"] for o in objects] if rank == 0 else [])
    scattered = [None]
    dist.scatter_object_list(scattered, [f"to {r}" for r in range(world)] if rank == 0 else None, src=0)
    out["scatter_object_list"] = torch.tensor([int(scattered[0].split()[1])])
    return out
