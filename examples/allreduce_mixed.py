"""The plain Ray collective API on two simulated vendor islands (labelled local nodes).

    python examples/allreduce_mixed.py
"""

import numpy as np
import ray
from ray.util import collective as col

import hetccl_ray
from hetccl_ray.tools.local_cluster import LocalCluster


def step(rank: int) -> dict:
    x = np.full(8, rank + 1.0, dtype=np.float32)
    col.allreduce(x, group_name="mixed")                      # unchanged Ray code
    return {"rank": rank, "island": hetccl_ray.get_group("mixed").island.name,
            "sum": float(x[0]), "border bytes sent": hetccl_ray.border_stats("mixed")["bytes_sent"]}


if __name__ == "__main__":
    islands = ["nvidia", "nvidia", "amd", "amd"]              # node labels hetccl.io/island
    with LocalCluster(islands) as cluster:
        workers = cluster.workers(islands)
        hetccl_ray.create_collective_group(workers, 4, [0, 1, 2, 3], group_name="mixed")
        for row in ray.get([w.call.remote(step, r) for r, w in enumerate(workers)]):
            print(row)
