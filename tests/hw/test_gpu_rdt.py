"""(d) Ray Direct Transport on a GPU: tensors made by CUDA kernels that are still running when
the method returns go to a CPU actor (landing in host memory) and to a GPU actor of another
island sharing the GPU (landing on its GPU), bit for bit. Skips, naming what is missing,
without a GPU."""

from __future__ import annotations

import numpy as np
import ray
import torch

import hetccl_ray
from hetccl_ray import ISLAND_LABEL
from hetccl_ray.tools.local_cluster import LocalCluster
from tests.hw.ops import NEEDS_GPU

pytestmark = NEEDS_GPU

N = 1 << 20


def reference(seed: int) -> dict[str, np.ndarray]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(N, generator=g).to(torch.bfloat16).view(torch.int16).numpy(),
            "b": torch.randn(4099, generator=g).numpy()}


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class GpuPeer:
    @ray.method(tensor_transport="hetccl")
    def made_late(self, seed: int) -> dict[str, torch.Tensor]:
        """Values copied to the GPU behind a long kernel on the current stream, no sync: a
        transport that does not wait for the stream sends what was there before."""
        values = {k: torch.from_numpy(v.copy()) for k, v in reference(seed).items()}
        out = {"w": torch.zeros(N, dtype=torch.int16, device="cuda"), "b": torch.zeros(4099, device="cuda")}
        busy = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            busy = busy @ busy / 64
        for k in out:
            out[k].copy_(values[k].pin_memory(), non_blocking=True)
        out["w"] = out["w"].view(torch.bfloat16)
        return out

    def take(self, obj: dict[str, torch.Tensor]) -> dict[str, tuple[str, np.ndarray]]:
        return {k: (v.device.type, (v.view(torch.int16) if v.dtype == torch.bfloat16 else v).cpu().numpy())
                for k, v in obj.items()}


def test_gpu_tensors_reach_a_cpu_actor_and_a_gpu_actor_of_another_island():
    islands = {"nv-a": 1, "nv-b": 1, "cpu": 0}
    with LocalCluster(list(islands), gpus={k: v for k, v in islands.items() if v}):
        actors = [GpuPeer.options(label_selector={ISLAND_LABEL: name}, num_gpus=gpus).remote()
                  for name, gpus in islands.items()]
        hetccl_ray.create_collective_group(actors, 3, [0, 1, 2], group_name="hw-rdt", timeout_s=120)
        for seed in range(3):
            ref = actors[0].made_late.remote(seed)
            on_gpu, on_cpu = ray.get([actors[1].take.remote(ref), actors[2].take.remote(ref)], timeout=300)
            want = reference(seed)
            for got, device in ((on_gpu, "cuda"), (on_cpu, "cpu")):
                for k, (where, values) in got.items():
                    assert where == device, (k, where)
                    np.testing.assert_array_equal(values, want[k], err_msg=f"{k} on the {device} actor")
