"""(a) One GPU: an NVIDIA (or AMD) island of one rank beside a CPU island of two, every op
on device tensors. Skips, naming what is missing, where there is no GPU."""

from __future__ import annotations

import pytest
import ray
import torch

import hetccl_ray
from hetccl_ray.tools.local_cluster import LocalCluster
from tests.hw.ops import NEEDS_GPU, every_op

pytestmark = NEEDS_GPU


@pytest.mark.parametrize("compress", ["auto", "on"])
def test_every_op_on_a_gpu_island_beside_a_cpu_island(compress):
    islands = ["gpu", "cpu", "cpu"]
    with LocalCluster(islands, gpus={"gpu": 1}) as cluster:
        actors = cluster.workers(islands)
        hetccl_ray.create_collective_group(actors, 3, [0, 1, 2], group_name="hw-gpu", timeout_s=120,
                                           compress=compress)
        devices = ["cuda", "cpu", "cpu"]
        wrong = ray.get([a.call.remote(every_op, "hw-gpu", r, 3, d) for r, (a, d) in enumerate(zip(actors, devices))],
                        timeout=600)
    assert wrong == [[], [], []]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("sender,receiver", [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")])
def test_compressed_frames_of_gpu_tensors_are_bit_exact(dtype, sender, receiver):
    """The codec's device path: planes split and joined on the GPU (torch ops), only the planes
    staged through host memory; plain and reducing receives against the CPU reference."""
    import threading

    from hetccl_ray.tools.benchdata import gradients
    from hetccl_ray.transport.compress.frames import FRAME_BYTES
    from hetccl_ray.transport.base import Tag
    from hetccl_ray.transport.tcp import TcpBorder

    borders = [TcpBorder(r, "127.0.0.1", "on") for r in range(2)]
    for r, border in enumerate(borders):
        border.set_peers({1 - r: borders[1 - r].address}, bytes(32))
    try:
        n = 3 * FRAME_BYTES // 2 + 5
        x = gradients(n, dtype)
        out, acc = torch.zeros(n, dtype=dtype, device=receiver), torch.ones(n, dtype=dtype, device=receiver)
        sends = [borders[0].isend(1, x.to(sender), Tag(1, q, 0)) for q in (1, 2)]
        recvs = [borders[1].irecv(0, out, Tag(1, 1, 0)), borders[1].irecv(0, acc, Tag(1, 2, 0), op="sum")]
        waiter = threading.Thread(target=lambda: [h.wait(60) for h in recvs])
        waiter.start()
        for handle in sends:
            handle.wait(60)
        waiter.join()
        for handle in recvs:
            handle.wait(0)
        assert torch.equal(out.cpu().view(torch.uint8), x.view(torch.uint8))
        assert torch.equal(acc.cpu(), torch.ones(n, dtype=dtype) + x)  # one rounding: same on any device
        assert borders[0].wire_bytes_sent < borders[0].bytes_sent
    finally:
        for border in borders:
            border.close()
