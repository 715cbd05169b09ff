"""(a) One GPU: an NVIDIA (or AMD) island of one rank beside a CPU island of two, every op
on device tensors. Skips, naming what is missing, where there is no GPU."""

from __future__ import annotations

import pytest
import ray
import torch

import hetccl_ray
from hetccl_ray.collective.island import nccl_available
from hetccl_ray.local_cluster import LocalCluster
from tests.hw.ops import every_op

pytestmark = pytest.mark.skipif(
    not nccl_available(),
    reason=f"needs one NVIDIA or AMD GPU with NCCL/RCCL (torch {torch.__version__}: cuda available="
           f"{torch.cuda.is_available()}, nccl={torch.distributed.is_nccl_available()})")


def test_every_op_on_a_gpu_island_beside_a_cpu_island():
    islands = ["gpu", "cpu", "cpu"]
    with LocalCluster(islands, gpus={"gpu": 1}) as cluster:
        actors = cluster.workers(islands)
        hetccl_ray.create_collective_group(actors, 3, [0, 1, 2], group_name="hw-gpu", timeout_s=120)
        devices = ["cuda", "cpu", "cpu"]
        wrong = ray.get([a.call.remote(every_op, "hw-gpu", r, 3, d) for r, (a, d) in enumerate(zip(actors, devices))],
                        timeout=600)
    assert wrong == [[], [], []]
