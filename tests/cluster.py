"""The shared labelled local cluster of a test module."""

from __future__ import annotations

from hetccl_ray.tools.local_cluster import LocalCluster


def start(islands: dict[str, int]) -> tuple[LocalCluster, dict[str, list]]:
    """A head node plus one labelled node per island, with ``islands[name]`` actors each."""
    cluster = LocalCluster(list(islands)).__enter__()
    names = [name for name, count in islands.items() for _ in range(count)]
    workers = iter(cluster.workers(names))
    return cluster, {name: [next(workers) for _ in range(count)] for name, count in islands.items()}


def stop(cluster: LocalCluster) -> None:
    cluster.__exit__(None, None, None)
