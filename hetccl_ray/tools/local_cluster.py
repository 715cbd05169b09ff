"""An embedded local Ray cluster with one labelled node per simulated island.

Used by the demo, the bench and the tests: a head node (no CPUs) plus one node per island
carrying ``hetccl.io/island``, and actors placed on them with label selectors. It only
ever stops the processes it started.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import ray

from hetccl_ray.core.topology import ISLAND_LABEL

if TYPE_CHECKING:
    from hetccl_ray.tools.cpu_quota import CpuQuota

REPO = str(Path(__file__).resolve().parent.parent)


def parse_layout(text: str) -> list[int]:
    """Island sizes from ``"2x2"`` (two islands of 2), ``"1,2,3"`` or ``"4"``."""
    text = text.strip()
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    sizes = [int(match[2])] * int(match[1]) if match else [int(p) for p in text.split(",") if p.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"bad layout {text!r}: use 'KxN' (K islands of N ranks) or sizes like '1,2,3'")
    return sizes


def island_names(sizes: Sequence[int], interleave: bool = False) -> list[str]:
    """The island of each rank: islands contiguous in rank order, or dealt round-robin."""
    pools = [[f"island{i}"] * size for i, size in enumerate(sizes)]
    if not interleave:
        return [name for pool in pools for name in pool]
    order = []
    while any(pools):
        for pool in pools:
            if pool:
                order.append(pool.pop())
    return order


@ray.remote(num_cpus=0)
class Worker:
    """An actor that runs the function it is sent: one rank of a demo, bench or test."""

    def call(self, fn: Callable, *args: Any) -> Any:
        return fn(*args)

    def node_labels(self) -> dict:
        return ray.get_runtime_context().get_node_labels()


def place_workers(island_of_rank: Sequence[str], gpus: Optional[dict[str, int]] = None) -> list:
    """One actor per rank, on a node labelled with its island (the ranks of an island in ``gpus``
    sharing its node's GPUs evenly: one each, or one GPU between several); returns once all are up."""
    gpus = gpus or {}
    share = {name: min(gpus[name] / island_of_rank.count(name), 1.0) for name in gpus if gpus[name]}
    actors = [Worker.options(label_selector={ISLAND_LABEL: name}, num_gpus=share.get(name, 0)).remote()
              for name in island_of_rank]
    ray.get([a.node_labels.remote() for a in actors], timeout=300)
    return actors


class LocalCluster:
    """Context manager: a local multi-node Ray cluster whose nodes are labelled islands."""

    def __init__(self, islands: Sequence[str], cpus_per_node: int = 1, env: Optional[dict] = None,
                 gpus: Optional[dict[str, int]] = None, cpu_quota: Optional[dict[str, Optional[float]]] = None,
                 pin_cores: bool = False) -> None:
        """``gpus``: island -> GPUs its node offers (the host's real GPUs; default none).
        ``cpu_quota``: island -> CPUs of time its node's processes get (None: no limit); when
        given, every island's node runs in a cgroup of its own, so :attr:`quotas` can slow
        any of them later (cpu_quota.py: a simulated slow island, real CPU time).
        ``pin_cores``: island i's node runs on core i (modulo the cores there are), so one
        island's work does not take another's CPU time."""
        self.islands = list(dict.fromkeys(islands))
        self.gpus = dict(gpus or {})
        self.cpus_per_node = cpus_per_node
        self.env = env or {}
        self.cluster = None
        self.cpu_quota = cpu_quota
        self.pin_cores = pin_cores
        self.quotas: dict[str, "CpuQuota"] = {}

    def __enter__(self) -> "LocalCluster":
        from ray.cluster_utils import Cluster

        os.environ["RAY_AUTH_MODE"] = "disabled"
        # its nodes cannot be pre-empted: Ray Train's watcher of pre-emption (its own switch) would
        # start ~1 s into each run and take a worker's core for 2-3 s (RESULTS.md, balanced training)
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
        for i, name in enumerate(self.islands):
            node = self.cluster.add_node(num_cpus=self.cpus_per_node, num_gpus=self.gpus.get(name, 0),
                                         labels={ISLAND_LABEL: name})
            raylet = node.all_processes["raylet"][0].process.pid
            if self.cpu_quota is not None:
                self._slow(name, raylet)
            if self.pin_cores:
                from hetccl_ray.tools.cpu_quota import pin

                pin(raylet, [i % os.cpu_count()])
        env_vars = {"RAY_AUTH_MODE": "disabled", "PYTHONPATH": os.pathsep.join(
            p for p in (REPO, os.environ.get("PYTHONPATH")) if p), **self.env}
        ray.init(address=self.cluster.address, namespace="hetccl", log_to_driver=False, runtime_env={
            "worker_process_setup_hook": "hetccl_ray.setup_worker", "env_vars": env_vars})
        return self

    def _slow(self, name: str, raylet_pid: int) -> None:
        """Put the island's raylet and what it started under a quota group: the workers it
        starts later are its children and inherit the group."""
        import psutil

        from hetccl_ray.tools.cpu_quota import CpuQuota

        quota = self.quotas[name] = CpuQuota(name)
        quota.set(self.cpu_quota.get(name))
        raylet = psutil.Process(raylet_pid)
        for process in [raylet, *raylet.children(recursive=True)]:
            quota.add(process.pid)

    def workers(self, island_of_rank: Sequence[str]) -> list:
        """One actor per rank, on the node of its island."""
        return place_workers(island_of_rank, self.gpus)

    def __exit__(self, *exc: object) -> None:
        ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
        for quota in self.quotas.values():
            quota.close()
