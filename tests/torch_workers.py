"""Training runs in spawned processes, one per rank, for the torch.distributed backend tests."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

STEPS, BATCH, LR = 4, 8, 0.1


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def single_process_reference(world: int) -> list[torch.Tensor]:
    """Plain SGD on the concatenation of every rank's batch: what DDP must reproduce."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        xs, ys = zip(*(batch(r, step) for r in range(world)))
        loss = ((model(torch.cat(xs)) - torch.cat(ys)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _train(model: nn.Module, params, rank: int) -> list[float]:
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = batch(rank, step)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def ddp(rank: int, world: int) -> list[torch.Tensor]:
    model = make_model()
    wrapped = nn.parallel.DistributedDataParallel(model)
    _train(wrapped, wrapped.parameters(), rank)
    return [p.detach().clone() for p in model.parameters()]


def fsdp(rank: int, world: int) -> list[torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    _train(model, model.parameters(), rank)
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def collectives(rank: int, world: int) -> dict[str, Any]:
    """Every op DDP/FSDP use, through the public torch.distributed API, plus a subgroup."""
    out = {}
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    out["all_reduce"] = t
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["avg"] = t
    t = torch.full((4,), float(rank)) if rank == 1 else torch.zeros(4)
    dist.broadcast(t, src=1)
    out["broadcast"] = t
    gathered = torch.zeros(world * 2)
    dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank)))
    out["all_gather_into_tensor"] = gathered
    listed = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(listed, torch.full((2,), float(rank * 10)))
    out["all_gather"] = torch.cat(listed)
    shard = torch.zeros(2)
    dist.reduce_scatter_tensor(shard, torch.arange(world * 2, dtype=torch.float32) + rank)
    out["reduce_scatter_tensor"] = shard
    work = dist.all_reduce(torch.ones(3), async_op=True)
    work.wait()
    out["async_ok"] = True
    if rank == 0:
        dist.send(torch.full((2,), 42.0), dst=world - 1)
    elif rank == world - 1:
        got = torch.zeros(2)
        dist.recv(got, src=0)
        out["recv"] = got
    sub = dist.new_group([0, world - 1])
    if rank in (0, world - 1):
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t, group=sub)
        out["subgroup"] = t
    dist.barrier()
    return out


def split_sizes(world: int) -> list[list[int]]:
    """Uneven rows from each rank to each, zeros included: ``sizes[src][dst]``."""
    return [[(src * 3 + dst * 2) % 4 for dst in range(world)] for src in range(world)]


def value(src: int, dst: int, i: int) -> float:
    """The i-th element rank ``src`` sends rank ``dst``: tells every element apart."""
    return src * 1000 + dst * 100 + i


def exchanges(rank: int, world: int) -> dict[str, Any]:
    """The ops beyond DDP/FSDP: all-to-all (even, uneven, lists), gather, scatter, recv from
    any source, object collectives; each result also checked in the test against numpy."""
    out = {}
    even = torch.tensor([float(value(rank, dst, i)) for dst in range(world) for i in range(2)]).reshape(world * 2, 1)
    got = torch.zeros(world * 2, 1)
    dist.all_to_all_single(got, even)
    out["even"] = got
    sizes = split_sizes(world)
    send = torch.tensor([value(rank, dst, i) for dst in range(world) for i in range(sizes[rank][dst] * 3)],
                        dtype=torch.float64).reshape(-1, 3)
    got = torch.zeros(sum(sizes[src][rank] for src in range(world)), 3, dtype=torch.float64)
    work = dist.all_to_all_single(got, send, output_split_sizes=[sizes[src][rank] for src in range(world)],
                                  input_split_sizes=sizes[rank], async_op=True)
    work.wait()
    out["uneven"] = got
    if dist.get_backend() == "gloo":  # Gloo's list form takes one size only (NCCL's and hetccl's any)
        sizes = [[2] * world for _ in range(world)]
    ins = [torch.full((sizes[rank][dst],), rank * 10 + dst, dtype=torch.int32) for dst in range(world)]
    outs = [torch.zeros(sizes[src][rank], dtype=torch.int32) for src in range(world)]
    dist.all_to_all(outs, ins)
    out["lists"] = torch.cat(outs)
    gathered = [torch.zeros(2) for _ in range(world)] if rank == 1 else None
    dist.gather(torch.full((2,), float(rank + 5)), gathered, dst=1)
    if rank == 1:
        out["gather"] = torch.cat(gathered)
    piece = torch.zeros(3)
    dist.scatter(piece, [torch.full((3,), float(dst * 7)) for dst in range(world)] if rank == 0 else None, src=0)
    out["scatter"] = piece
    if rank == 0:
        senders = []
        for _ in range(world - 1):
            buf = torch.zeros(2)
            src = dist.recv(buf)
            senders.append(src)
            out[f"from {src}"] = buf
        out["senders"] = sorted(senders)
    else:
        dist.send(torch.full((2,), float(rank * 11)), dst=0)
    objects = [None] * world
    dist.all_gather_object(objects, {"rank": rank, "name": f"r{rank}" * (rank + 1)})
    out["objects"] = objects
    listed = [{"root": "says hi"}, 3] if rank == 2 else [None, None]
    dist.broadcast_object_list(listed, src=2)
    out["broadcast_objects"] = listed
    dist.barrier()
    return out


def stream_ordered(rank: int, world: int) -> dict[str, Any]:
    """Async ops on the emulated device under a side stream: inputs written and results read
    by late device work; ``wait()`` orders the stream, ``get_future()`` means the data is there."""
    from hetccl_ray.memory import devices

    emu = devices.emulated()
    out: dict[str, Any] = {}
    stream = emu.new_stream() if emu else None
    launch = (lambda fn, *a: emu.launch(None, fn, *a)) if emu else (lambda fn, *a: fn(*a))
    with emu.using(stream) if emu else _nothing():
        x, y = torch.zeros(6), torch.zeros(6)
        launch(x.fill_, float(rank + 1))
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        launch(lambda: out.__setitem__("wait", x.clone()))
        launch(y.fill_, float(rank + 10))
        future = dist.all_reduce(y, op=dist.ReduceOp.AVG, async_op=True).get_future()
        future.wait()
        out["future"] = y.clone()  # the host reads at once: the future said the data is there
        rows = torch.zeros(world * 2)
        launch(rows.copy_, torch.arange(world * 2, dtype=torch.float32) + rank)
        piece = torch.zeros(2)
        dist.reduce_scatter_tensor(piece, rows)
        launch(lambda: out.__setitem__("reduce_scatter_tensor", piece.clone()))
    if emu:
        emu.host_wait(stream, time.monotonic() + 60, "test reads")
    return out


def caller_stream_delayed(rank: int, world: int) -> dict[str, Any]:
    """Emulated-device ranks whose host reads go on the stream, as CUDA code's do: an op does
    not wait for work its caller queued after the call (3 s queued after two calls), and
    ``wait()`` returns while the op still waits for a late rank (the last one, 1.5 s late),
    the caller's stream, not the host, waiting for it."""
    from hetccl_ray.memory import devices

    emu = devices.emulated()
    out: dict[str, Any] = {}
    x, y = torch.zeros(6), torch.zeros(6)
    if emu is None:  # the late CPU rank
        x.fill_(rank + 1)
        y.fill_(rank + 10)
        time.sleep(1.5)
        dist.all_reduce(x)
        dist.all_reduce(y)
        return {"x": x, "y": y}
    emu.ordered_host_ops = True  # this caller reads results on the stream only
    emu.launch(None, x.fill_, float(rank + 1))
    emu.launch(None, y.fill_, float(rank + 10))
    first = dist.all_reduce(x, async_op=True)
    second = dist.all_reduce(y, async_op=True)
    emu.launch(None, time.sleep, 3.0)  # queued after both calls
    started = time.monotonic()
    first.wait()
    second.wait()
    out["wait_s"] = time.monotonic() - started  # the host did not wait for the late rank
    second.get_future().wait()
    out["done_s"] = time.monotonic() - started  # nor did the ops wait for the 3 s queued after them
    emu.launch(None, lambda: out.update(x=x.clone(), y=y.clone()))
    emu.host_wait(None, time.monotonic() + 60, "test reads")
    out["read_s"] = time.monotonic() - started
    emu.capture = True  # a FAKE graph capture: refused by name, before any message
    try:
        dist.all_reduce(x)
    except Exception as exc:  # noqa: BLE001 - what the test reads
        out["captured"] = str(exc)
    return out


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def _rank_main(fn: Callable, rank: int, world: int, port: int, backend: str, island: str, queue,
               emulated: bool = False, args: tuple = ()) -> None:
    os.environ["HETCCL_ISLAND"] = island
    if emulated:  # this rank's tensors are emulated device memory (devices.py's FAKE)
        os.environ["HETCCL_EMULATED_DEVICE"] = "0.002"
    import hetccl_ray

    hetccl_ray.register()  # the "hetccl" torch backend (importing registers it; said here, not implied)

    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        queue.put((rank, _map(fn(rank, world, *args), lambda t: t.numpy() if isinstance(t, torch.Tensor) else t)))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        queue.put((rank, RuntimeError(f"{exc!r}\n{traceback.format_exc()}")))


def run(fn: Callable, islands: list[str], backend: str, timeout_s: float = 180, emulated: tuple = (),
        args: tuple = ()) -> list:
    """``fn(rank, world, *args)`` in one spawned process per rank, on ``backend``; results by
    rank (ranks in ``emulated`` on the emulated stream-ordered device)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, len(islands), port, backend, island, queue, r in emulated, args))
             for r, island in enumerate(islands)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for rank, value in results.items():
        if isinstance(value, BaseException):
            raise RuntimeError(f"rank {rank} failed: {value!r}") from value
    return [_map(results[r], lambda a: torch.from_numpy(a) if isinstance(a, np.ndarray) else a)
            for r in range(len(islands))]


def _map(value: Any, leaf: Callable) -> Any:
    """Apply ``leaf`` through lists and dicts. Results cross the queue as numpy arrays:
    a torch tensor would be shared through the sender's memory, gone once it exits."""
    if isinstance(value, list):
        return [_map(v, leaf) for v in value]
    if isinstance(value, dict):
        return {k: _map(v, leaf) for k, v in value.items()}
    return leaf(value)


BALANCED_SHARES, BALANCED_CHANGE, BALANCED_BATCH, BALANCED_DATA = [5, 2, 9], [3, 8, 5], 16, 64


def balanced_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(BALANCED_DATA, 8, generator=g), torch.randn(BALANCED_DATA, 4, generator=g)


def balanced_reference() -> list[torch.Tensor]:
    """Plain SGD on each step's whole global batch in one process."""
    from hetccl_ray.features.balance import global_batch_indices

    x, y = balanced_data()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        idx = torch.from_numpy(global_batch_indices(step, BALANCED_DATA, BALANCED_BATCH, seed=0))
        loss = ((model(x[idx]) - y[idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def balanced(rank: int, world: int, how: str = "ddp") -> dict[str, Any]:
    """Unequal fixed shares, changed after step 2 (set_shares): DDP through the Balancer's
    weighting hook ("ddp"), FSDP with the loss scaled by ``loss_weight`` ("fsdp"), or DDP
    without either ("plain": what the weighting corrects)."""
    fsdp = how == "fsdp"
    from hetccl_ray.features.balanced import Balancer

    x, y = balanced_data()
    model = make_model()
    bal = Balancer(BALANCED_BATCH, balance_mode="even", shares=BALANCED_SHARES)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        trained = model
    else:
        trained = nn.parallel.DistributedDataParallel(model)
        if how == "ddp":
            bal.wrap(trained)
    opt = torch.optim.SGD(trained.parameters(), lr=LR)
    local = []
    for step in range(STEPS):
        if step == 2:
            bal.set_shares(BALANCED_CHANGE)
        idx = bal.indices(step, BALANCED_DATA)
        local.append(len(idx))
        loss = ((trained(x[idx]) - y[idx]) ** 2).mean()
        opt.zero_grad()
        (loss * bal.loss_weight if fsdp else loss).backward()
        opt.step()
        bal.step()
    params = [p.full_tensor() if fsdp else p for p in model.parameters()]
    return {"params": [p.detach().clone() for p in params], "local": local, "history": bal.history}


def balanced_cases(rank: int, world: int) -> dict[str, Any]:
    """Every balanced-training case in one process group (one spawn for the test module)."""
    return {"ddp": balanced(rank, world, "ddp"), "fsdp": balanced(rank, world, "fsdp"),
            "plain": balanced(rank, world, "plain"), "misuse": balanced_misuse(rank, world)}


def balanced_misuse(rank: int, world: int) -> dict[str, str]:
    """Calls a Balancer must refuse, each with its message."""
    from hetccl_ray.features.balanced import Balancer

    out = {}
    for name, call in {
        "small batch": lambda: Balancer(world - 1),
        "bad sum": lambda: Balancer(10, shares=[1] * world),
        "bad mode": lambda: Balancer(10, balance_mode="fastest"),
        "never re-balance": lambda: Balancer(10, every=0),
        "untimed auto step": lambda: Balancer(10, balance_mode="auto").step(),
        "shares differ": lambda: Balancer(12, balance_mode="even").set_shares([4 + rank, 4, 4 - rank]),
    }.items():
        try:
            call()
            out[name] = "no error"
        except (ValueError, RuntimeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out
