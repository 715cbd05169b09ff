"""Transports move host bytes; the runner stages device memory (issue 43's design), on the
emulated stream-ordered device (devices.py's named FAKE): threads as ranks, each with a side
stream whose work completes late, over a FAKE border that refuses device memory, real TCP
borders on loopback, and RDMA borders on the FAKE NIC (device memory as it is, or staged).
Results are read only after the host waited for each rank's stream, against numpy."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from hetccl_ray.core.topology import Topology
from hetccl_ray.memory import devices
from hetccl_ray.core import planner
from hetccl_ray.runtime import collectives, runner
from tests.fakes import loopback_borders, run_ranks
from tests.test_rdma import close_all, rdma_borders

LAYOUTS = {"2x2": ["a", "a", "b", "b"], "1+2+3 interleaved": ["x", "y", "x", "z", "y", "x"]}
OPS = ["allreduce", "reduce", "broadcast", "reducescatter", "allgather"]


def _expected(op: str, topo: Topology, data: np.ndarray, root: int, chunk: int) -> list[np.ndarray]:
    """Each rank's buffer (its chunk for reducescatter) after ``op``, from numpy alone (None:
    not defined). Buffers
    of reducescatter and allgather hold one chunk per rank in island-major order."""
    world, order = topo.world_size, topo.island_major_order
    if op == "allreduce":
        return [data.sum(axis=0)] * world
    if op == "reduce":
        return [data.sum(axis=0) if r == root else None for r in range(world)]  # others: scratch
    if op == "broadcast":
        return [data[root]] * world
    if op == "reducescatter":
        total = data.sum(axis=0)
        return [total[order.index(r) * chunk:(order.index(r) + 1) * chunk] for r in range(world)]
    return [np.concatenate([data[r, :chunk] for r in order])] * world


def _run(op: str, islands: list[str], device: devices.EmulatedDevice, piece_bytes=None, borders=None,
         n: int = 96) -> tuple[list, list, list]:
    topo = Topology.from_islands(islands)
    world, root = topo.world_size, topo.world_size - 1
    chunk = n // world
    data = np.random.default_rng(len(islands)).integers(1, 9, size=(world, world * chunk)).astype(np.float32)

    def body(ctx):
        slot = topo.island_major_order.index(ctx.rank)
        row = data[ctx.rank].copy()
        if op == "allgather":
            row = np.zeros(world * chunk, dtype=np.float32)
            row[slot * chunk:(slot + 1) * chunk] = data[ctx.rank, :chunk]
        buf, out = torch.zeros(world * chunk), torch.zeros(chunk)
        ctx.launch(buf.copy_, torch.from_numpy(row))  # the input is written by late device work
        collectives.collective(ctx, op, buf, root, "sum" if op in ("allreduce", "reduce", "reducescatter") else "",
                               out if op == "reducescatter" else None)
        ctx.host_wait()
        return (out if op == "reducescatter" else buf).numpy().copy()

    results, used = run_ranks(islands, body, piece_bytes=piece_bytes, borders=borders, device=device)
    return results, _expected(op, topo, data, root, chunk), used


def _check(results: list, expected: list) -> None:
    for got, want in zip(results, expected):
        if want is not None:
            np.testing.assert_array_equal(got, want)


@pytest.fixture
def emu():
    return devices.EmulatedDevice(delay_s=0.001)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("piece_bytes", [None, 96])
def test_every_plan_stages_device_memory_for_a_border_that_moves_host_bytes(emu, layout, op, piece_bytes):
    """The FAKE border raises on emulated device memory: before the runner staged, every
    transport was handed the op's device buffers and ran its own device copies (on its thread's
    stream, unordered with the op's)."""
    results, expected, _ = _run(op, LAYOUTS[layout], emu, piece_bytes)
    _check(results, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pack_bytes", [0, 1 << 18])  # one message per block, or a peer's blocks packed
def test_an_all_to_all_of_device_memory_lands_its_packed_blocks_in_stream_order(emu, layout, pack_bytes,
                                                                                  monkeypatch):
    """Packed blocks land in device scratch on the op's stream, and are unpacked after them on
    that stream: an unpack run by the host at once read the scratch before its landing."""
    monkeypatch.setattr(runner, "_PACK_BYTES", pack_bytes)
    islands = LAYOUTS[layout]
    world = len(islands)
    topo = Topology.from_islands(islands)
    counts = np.random.default_rng(world).integers(1, 9, size=(world, world))
    data = {(r, t): np.full(counts[r, t], 100 * r + t, dtype=np.float32) for r in range(world) for t in range(world)}

    def body(ctx):
        inputs = [torch.zeros(int(counts[ctx.rank, t])) for t in range(world)]
        for t, block in enumerate(inputs):
            ctx.launch(block.copy_, torch.from_numpy(data[ctx.rank, t]))
        outputs = [torch.zeros(int(counts[r, ctx.rank])) for r in range(world)]
        how = planner.Planner(topo, rank=ctx.rank).alltoall(None, 0, host_path=False)
        collectives.alltoall(ctx, how, counts.tolist(), inputs, outputs)
        ctx.host_wait()
        return [out.numpy().copy() for out in outputs]

    results, _ = run_ranks(islands, body, piece_bytes=16, device=emu)
    for t in range(world):
        for r in range(world):
            np.testing.assert_array_equal(results[t][r], data[r, t])


@pytest.mark.parametrize("op", ["allreduce", "reducescatter", "broadcast"])
def test_device_memory_over_real_tcp_borders(emu, op):
    islands = LAYOUTS["2x2"]
    borders = loopback_borders(Topology.from_islands(islands))
    try:
        results, expected, _ = _run(op, islands, emu, piece_bytes=128, borders=borders, n=4096)
    finally:
        close_all(borders)
    _check(results, expected)


def test_a_tcp_border_refuses_device_tensors_by_name():
    from hetccl_ray.errors import HetCCLInputError
    from hetccl_ray.transport.base import Tag
    from hetccl_ray.transport.tcp import TcpBorder

    border = TcpBorder(0, "127.0.0.1")
    try:
        with pytest.raises(HetCCLInputError, match="meta memory; the border moves host memory"):
            border.isend(1, torch.empty(4, device="meta"), Tag(1, 1, 0))
    finally:
        border.close()


@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("op", ["allreduce", "reducescatter", "allgather"])
def test_rdma_moves_device_memory_as_it_is_or_the_runner_stages_it(emu, staged, op):
    """A NIC that registers the device's memory (GPUDirect, emulated) gets the op's buffers as
    they are, its writes landing late (FAKE DMA); one that cannot gets host copies."""
    islands = LAYOUTS["2x2"]
    borders = rdma_borders(4, staged=staged, delay_s=0.002, chunk_bytes=256)
    try:
        results, expected, used = _run(op, islands, emu, piece_bytes=128, borders=borders, n=1024)
        paths = {b.device_paths.get("emu") for b in used}
        registered = [r.addr for b in used for r in b.nic.registered]
    finally:
        close_all(borders)
    _check(results, expected)
    assert paths == {"staged" if staged else "host"}
    assert registered  # regions were registered (device buffers, or host staging)


def test_a_device_the_nic_cannot_register_is_tried_once_said_once_and_staged(emu, caplog):
    borders = rdma_borders(2)
    try:
        borders[0].nic.refuse_registration = True
        with caplog.at_level(logging.WARNING):
            assert [borders[0].device_memory(1, emu) for _ in range(3)] == [False] * 3
        assert borders[0].device_paths == {"emu": "staged"}
        assert sum("registering emu memory" in r.getMessage() for r in caplog.records) == 1
    finally:
        close_all(borders)


def test_host_staging_of_the_emulated_device_is_host_memory(emu):
    host, mine = emu.host_buffer(64), torch.zeros(16)
    assert not emu.owns(host[8:16].view(torch.float32)) and emu.owns(mine)
    address = host.untyped_storage().data_ptr()
    del host
    assert address not in emu._host  # a freed host buffer is forgotten (its address may be reused)
