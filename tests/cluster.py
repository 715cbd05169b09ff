"""A real local multi-node Ray cluster with nodes labelled by island, shared per test module."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import ray
from ray.cluster_utils import Cluster

from hetccl_ray.topology import ISLAND_LABEL

REPO = str(Path(__file__).resolve().parent.parent)


@ray.remote(num_cpus=0)
class Worker:
    """A test actor that runs whatever function the test sends it."""

    def call(self, fn: Callable, *args: Any) -> Any:
        return fn(*args)

    def node_labels(self) -> dict:
        return ray.get_runtime_context().get_node_labels()


def start(islands: dict[str, int]) -> tuple[Cluster, dict[str, list]]:
    """A head node plus one labelled node per island, with ``islands[name]`` actors each."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for name in islands:
        cluster.add_node(num_cpus=1, labels={ISLAND_LABEL: name})
    ray.init(address=cluster.address, namespace="hetccl-tests", runtime_env={
        "worker_process_setup_hook": "hetccl_ray.setup_worker",
        "env_vars": {"PYTHONPATH": REPO, "RAY_AUTH_MODE": "disabled"},
    })
    actors = {name: [Worker.options(label_selector={ISLAND_LABEL: name}).remote() for _ in range(count)]
              for name, count in islands.items()}
    ray.get([a.node_labels.remote() for group in actors.values() for a in group])
    return cluster, actors


def stop(cluster: Cluster) -> None:
    ray.shutdown()
    cluster.shutdown()
