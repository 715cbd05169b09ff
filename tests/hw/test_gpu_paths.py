"""(c) The GPU path at size and in stream order, on one GPU: ops of 16 MiB (several pieces) on a
side stream with compression off and on, timed against the staging bound; two one-rank
islands sharing the GPU (so the cross-vendor device-to-device border runs); DDP through the
torch backend with the GPU rank beside CPU ranks. Skips, naming what is missing, without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch

import hetccl_ray
from hetccl_ray.tools.local_cluster import LocalCluster
from tests import torch_workers
from tests.hw.ops import NEEDS_GPU, staging_bound_s, timed_ops

pytestmark = NEEDS_GPU

BIG = 4 << 20  # float32 elements: 16 MiB, four 4 MiB pieces


def _bound(nbytes: int) -> float:
    return staging_bound_s(nbytes)


def _report(times: dict[str, float], bound_s: float) -> str:
    worst = max(times, key=times.get)
    return (f"allreduce {times['allreduce SUM'] * 1e3:.1f} ms = {times['allreduce SUM'] / bound_s:.1f}x staging bound "
            f"({bound_s * 1e3:.1f} ms); slowest {worst} {times[worst] * 1e3:.1f} ms")


@pytest.mark.parametrize("compress", ["off", "on"])
def test_16mib_ops_on_a_side_stream_beside_cpu_ranks(compress):
    islands = ["gpu", "cpu", "cpu"]
    with LocalCluster(islands, gpus={"gpu": 1}) as cluster:
        actors = cluster.workers(islands)
        hetccl_ray.create_collective_group(actors, 3, [0, 1, 2], group_name="hw-big", timeout_s=300,
                                           compress=compress)
        devices = ["cuda", "cpu", "cpu"]
        results = ray.get([a.call.remote(timed_ops, "hw-big", r, 3, d, BIG, True)
                           for r, (a, d) in enumerate(zip(actors, devices))], timeout=480)
        bound = ray.get(actors[0].call.remote(_bound, BIG * 4))
    assert [wrong for wrong, _ in results] == [[], [], []]
    print(_report(results[0][1], bound))


def test_two_one_rank_islands_share_one_gpu():
    """Two processes on one GPU in two islands: every op crosses the border device to device."""
    islands = ["nv-a", "nv-b"]
    with LocalCluster(islands, gpus={"nv-a": 1, "nv-b": 1}) as cluster:
        actors = cluster.workers(islands)
        hetccl_ray.create_collective_group(actors, 2, [0, 1], group_name="hw-pair", timeout_s=300)
        results = ray.get([a.call.remote(timed_ops, "hw-pair", r, 2, "cuda", BIG, True)
                           for r, a in enumerate(actors)], timeout=480)
        bound = ray.get(actors[0].call.remote(_bound, BIG * 4))
        border = ray.get(actors[0].call.remote(lambda: hetccl_ray.border_stats("hw-pair")["bytes_sent"]))
    assert [wrong for wrong, _ in results] == [[], []]
    assert border > 0  # the islands really were joined by the border
    print(_report(results[0][1], bound))


def ddp_with_a_gpu_rank(rank: int, world: int) -> list[torch.Tensor]:
    """DDP where rank 0 trains on the GPU and the others on CPUs, all through "hetccl"."""
    device = "cuda" if rank == 0 else "cpu"
    model = torch_workers.make_model().to(device)
    wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if device == "cuda" else None)
    opt = torch.optim.SGD(wrapped.parameters(), lr=torch_workers.LR)
    for step in range(torch_workers.STEPS):
        x, y = (t.to(device) for t in torch_workers.batch(rank, step))
        loss = ((wrapped(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().cpu().clone() for p in model.parameters()]


def test_ddp_through_the_torch_backend_with_a_gpu_rank():
    islands = ["gpu", "cpu", "cpu"]
    results = torch_workers.run(ddp_with_a_gpu_rank, islands, "hetccl")
    reference = torch_workers.single_process_reference(len(islands))
    for params in results:
        for ours, ref in zip(params, reference):
            np.testing.assert_allclose(ours.numpy(), ref.numpy(), rtol=0, atol=1e-5)
