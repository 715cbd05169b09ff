"""The GPU path on the emulated stream-ordered device (devices.py's named FAKE), on a real
local Ray cluster: a "gpu" island whose ranks' tensors are emulated device memory (work
completes late, on stream threads; Gloo stands in for NCCL) beside a CPU island.

Every input is written by late device work on the caller's stream and every result read by
late device work after the op, so an op that does not wait for the caller's stream at entry,
or does not make it wait at exit, or lets the border read before the island stage is done,
gives wrong values here. Results are checked against numpy.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
import ray
import torch
from ray.util import collective as col

import hetccl_ray
from hetccl_ray.tools import bench
from hetccl_ray.memory import devices
from tests import cluster as test_cluster
from tests.cases import values

MIXED = [("gpu", 0), ("cpu", 0), ("gpu", 1), ("cpu", 1)]  # interleaved: GPU, CPU, GPU, CPU
GPUS = [("gpu", 0), ("gpu", 1), ("gpu", 2)]  # one island of emulated devices: the vendor fast path
SPLIT = [("gpu", 2), ("cpu", 0), ("cpu", 1)]  # rank 1 forced into the gpu island: devices disagree
ONE = [("gpu", 0), ("gpu", 1), ("cpu", 0)]  # one island: rank 2 (a CPU actor) forced into the gpu island
PAIR = [("gpu", 2), ("cpu", 1)]  # one island of two: rank 1 (CPU) forced in
MISMATCH_TIMEOUT_S = 20  # those two groups' deadline: a mismatch must be named well before it
SMALL_BYTES, PIECE_BYTES = 16384, 8192
SIZES = [7, 5000]  # 28 B takes the small round (staged), 20 KB the plans in 3 pieces


def _emulate() -> str:
    return devices.emulate(delay_s=0.002).kind


@pytest.fixture(scope="module")
def actors():
    cluster, actors = test_cluster.start({"gpu": 3, "cpu": 2})
    assert ray.get([a.call.remote(_emulate) for a in actors["gpu"]]) == ["emu"] * 3
    options = dict(timeout_s=60, small_bytes=SMALL_BYTES, piece_bytes=PIECE_BYTES)
    for name, picks, extra in (("mixed", MIXED, {}), ("gpus", GPUS, {}), ("split", SPLIT, {"islands": {1: "gpu"}}),
                               ("one", ONE, {"islands": {2: "gpu"}, "timeout_s": MISMATCH_TIMEOUT_S}),
                               ("pair", PAIR, {"islands": {1: "gpu"}, "timeout_s": MISMATCH_TIMEOUT_S})):
        members = [actors[island][i] for island, i in picks]
        hetccl_ray.create_collective_group(members, len(members), list(range(len(members))), group_name=name,
                                           **{**options, **extra})
    yield actors
    test_cluster.stop(cluster)


def _on_all(actors, picks, fn, *args):
    members = [actors[island][i] for island, i in picks]
    return ray.get([a.call.remote(fn, rank, len(members), *args) for rank, a in enumerate(members)], timeout=300)


class _Rank:
    """This rank's tensors: written and read by late device work on the caller's stream
    (emulated ranks), or plainly (CPU ranks)."""

    def __init__(self, side_stream: bool) -> None:
        self.emu = devices.emulated()
        self.stream = self.emu.new_stream() if self.emu and side_stream else None
        self.reads: dict = {}

    def scope(self):
        return self.emu.using(self.stream) if self.emu else contextlib.nullcontext()

    def launch(self, fn, *args) -> None:
        if self.emu:
            self.emu.launch(None, fn, *args)
        else:
            fn(*args)

    def tensor(self, data: np.ndarray) -> torch.Tensor:
        t = torch.zeros(len(data))
        self.launch(t.copy_, torch.tensor(data, dtype=torch.float32))
        return t

    def read(self, key, t: torch.Tensor) -> None:
        self.launch(lambda: self.reads.__setitem__(key, t.clone().numpy()))

    def results(self) -> dict:
        if self.emu:
            self.emu.host_wait(self.stream, time.monotonic() + 60, "test reads")
        return self.reads


def every_op(rank: int, world: int, name: str, side_stream: bool) -> dict:
    me = _Rank(side_stream)
    group = hetccl_ray.get_group(name)
    with me.scope():
        for n in SIZES:
            x = me.tensor(values(rank, n, 1))
            col.allreduce(x, group_name=name)
            me.read(("allreduce", n), x)
            for root in (0, 1):
                b = me.tensor(values(rank, n, 2))
                col.broadcast(b, src_rank=root, group_name=name)
                me.read(("broadcast", n, root), b)
                r = me.tensor(values(rank, n, 3))
                col.reduce(r, dst_rank=root, group_name=name)
                me.read(("reduce", n, root), r)
            outs = [torch.zeros(n) for _ in range(world)]
            col.allgather(outs, me.tensor(values(rank, n, 4)), group_name=name)
            for i, out in enumerate(outs):
                me.read(("allgather", n, i), out)
            y = torch.zeros(n)
            col.reducescatter(y, [me.tensor(values(rank * world + j, n, 5)) for j in range(world)], group_name=name)
            me.read(("reducescatter", n), y)
            ins = [me.tensor(values(rank * world + t, n + t, 6)) for t in range(world)]  # sizes differ per pair
            outs = [torch.zeros(n + rank) for _ in range(world)]
            hetccl_ray.alltoall(ins, outs, group_name=name)
            for r, out in enumerate(outs):
                me.read(("alltoall", n, r), out)
            got = [torch.zeros(n) for _ in range(world)] if rank == 1 else None
            group.gather(me.tensor(values(rank, n, 7)), got, 1)
            for r, out in enumerate(got or []):
                me.read(("gather", n, r), out)
            piece = torch.zeros(n)
            group.scatter(piece, [me.tensor(values(100 + t, n, 8)) for t in range(world)] if rank == 0 else None, 0)
            me.read(("scatter", n), piece)
            into = torch.zeros(n)
            bench.COLLS["sendrecv"].call(name, world, rank, me.tensor(values(rank, n, 9)), into)()
            me.read(("recv", n), into)
            wide = torch.zeros(n, 2)  # a non-contiguous column: worked on in a copy, copied back
            me.launch(wide[:, 1].copy_, torch.tensor(values(rank, n, 10), dtype=torch.float32))
            col.allreduce(wide[:, 1], group_name=name)
            me.read(("strided", n), wide[:, 1])
    return me.results()


def _expected(rank: int, world: int) -> dict:
    out = {}
    for n in SIZES:
        out["allreduce", n] = sum(values(r, n, 1) for r in range(world))
        for root in (0, 1):
            out["broadcast", n, root] = values(root, n, 2)
            out["reduce", n, root] = sum(values(r, n, 3) for r in range(world)) if rank == root else values(rank, n, 3)
        for i in range(world):
            out["allgather", n, i] = values(i, n, 4)
            out["alltoall", n, i] = values(i * world + rank, n + rank, 6)
            if rank == 1:
                out["gather", n, i] = values(i, n, 7)
        out["reducescatter", n] = sum(values(r * world + rank, n, 5) for r in range(world))
        out["scatter", n] = values(100 + rank, n, 8)
        out["recv", n] = values((rank - 1) % world, n, 9)
        out["strided", n] = sum(values(r, n, 10) for r in range(world))
    return out


def _check(results: list[dict]) -> None:
    world = len(results)
    for rank, got in enumerate(results):
        expected = _expected(rank, world)
        assert set(got) == set(expected), f"rank {rank}: ops {set(expected) ^ set(got)}"
        wrong = [key for key in expected if not np.array_equal(got[key], expected[key])]
        assert not wrong, f"rank {rank} got wrong values for {wrong}: {[(got[k], expected[k]) for k in wrong][:2]}"


@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
def test_every_op_on_gpu_and_cpu_islands_in_stream_order(actors, side_stream):
    """Small ops (the staged round) and large ones (plans in pieces) alike: one plan on every
    rank although the islands hold different devices."""
    _check(_on_all(actors, MIXED, every_op, "mixed", side_stream))


LARGE = (4 << 20) // 4 + 3  # elements: on one host a message from 4 MiB of host memory is pulled


def _large_ring(rank: int, world: int, name: str) -> tuple[dict, str]:
    """Messages large enough to be pulled, around GPU, CPU, GPU, CPU: a device sender sends
    the bytes, a host one where they lie, which a device receiver pulls into host memory."""
    me, into = _Rank(side_stream=True), torch.zeros(LARGE)
    with me.scope():
        bench.COLLS["sendrecv"].call(name, world, rank, me.tensor(values(rank, LARGE, 11)), into)()
        me.read("recv", into)
    return me.results(), hetccl_ray.get_group(name).plan_of("send", LARGE * 4)


def test_large_messages_between_device_and_host_memory(actors):
    for rank, (got, plan) in enumerate(_on_all(actors, MIXED, _large_ring, "mixed")):
        assert plan == "pull"
        np.testing.assert_array_equal(got["recv"], values((rank - 1) % len(MIXED), LARGE, 11), err_msg=f"rank {rank}")


def _messages(rank: int, world: int, name: str) -> int:
    return hetccl_ray.border_stats(name)["messages_sent"]


def test_one_island_of_devices_is_the_vendor_op_with_no_border_message(actors):
    # the first op on a device class is checked (its rows show every rank on it), and the first
    # message between island peers on it comes after a hello each way: once per group and class
    _check(_on_all(actors, GPUS, every_op, "gpus", True))
    before = _on_all(actors, GPUS, _messages, "gpus")
    _check(_on_all(actors, GPUS, every_op, "gpus", True))
    after = _on_all(actors, GPUS, _messages, "gpus")
    # every op is the vendor op alone; only all-to-all agrees its block sizes in one rows round
    # (members send the leader one message, the leader one to each member), once per size
    rows_round = [len(GPUS) - 1] + [1] * (len(GPUS) - 1)
    assert [a - b for a, b in zip(after, before)] == [m * len(SIZES) for m in rows_round]


def _mismatched_device(rank: int, world: int) -> str:
    try:
        col.allreduce(torch.ones(4096), group_name="split")
    except hetccl_ray.HetCCLMismatchError as exc:
        return str(exc)
    return "no error"


def test_ranks_of_one_island_on_different_devices_are_named(actors):
    messages = _on_all(actors, SPLIT, _mismatched_device)
    for message in messages:
        assert "mismatched call" in message and "on emu" in message and "ranks [1]" in message, message


def _named_mismatch(rank: int, world: int, name: str, call: str) -> tuple[str, float]:
    """What ``call`` raised on this rank (an emulated-device rank or a CPU one), and how long it took."""
    n = 8192  # 32 KiB: above the small round, the vendor op alone
    calls = {"allreduce": lambda: col.allreduce(torch.ones(n), group_name=name),
             "small allreduce": lambda: col.allreduce(torch.ones(7), group_name=name),
             "alltoall": lambda: hetccl_ray.alltoall([torch.ones(n) for _ in range(world)],
                                                     [torch.zeros(n) for _ in range(world)], group_name=name),
             "sendrecv": lambda: (col.send(torch.ones(n), 1, group_name=name) if rank == 0 else
                                  col.recv(torch.zeros(n), 0, group_name=name))}
    started = time.monotonic()
    try:
        calls[call]()
    except hetccl_ray.HetCCLError as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - started
    return "no error", time.monotonic() - started


@pytest.mark.parametrize("call", ["allreduce", "small allreduce", "alltoall", "allreduce"])
def test_one_island_whose_ranks_disagree_on_the_device_is_a_named_mismatch(actors, call):
    """Two emulated-device ranks and a CPU rank in one island: every plan (the vendor op alone,
    the small round, the all-to-all) names rank 2's class on every rank before the deadline
    (it hung in two libraries that waited for each other: the fast path chose by the local
    device), and the group stays usable (the same call again)."""
    for rank, (message, took) in enumerate(_on_all(actors, ONE, _named_mismatch, "one", call)):
        assert message.startswith("HetCCLMismatchError") and "ranks [2]" in message and "on emu" in message, \
            (rank, message)
        assert took < MISMATCH_TIMEOUT_S / 2, (rank, took)


def test_island_peers_on_different_devices_name_it_at_their_first_message(actors):
    """A send from an emulated-device rank to a CPU rank of its island: both ends name both
    classes before the deadline (the sender waited in the island library, the receiver on the
    border)."""
    results = _on_all(actors, PAIR, _named_mismatch, "pair", "sendrecv")
    for rank, (message, took) in enumerate(results):
        assert message.startswith("HetCCLMismatchError") and "mismatched call" in message, (rank, message)
        assert "rank 0 calls send with emu memory" in message or "rank 1 calls recv with cpu memory" in message
        assert ("island peer rank 1 with cpu memory" if rank == 0 else "island peer rank 0 with emu memory") in message
        assert took < MISMATCH_TIMEOUT_S / 2, (rank, took)
