"""Ray Train: TorchTrainer with the hetccl backend config on a labelled local cluster."""

from __future__ import annotations

from examples import train_ddp_mixed  # the example is the test's workload
from hetccl_ray.local_cluster import LocalCluster


def test_torchtrainer_trains_over_both_islands():
    islands = ["nvidia", "nvidia", "amd"]
    with LocalCluster(islands):
        result = train_ddp_mixed.fit(islands, steps=12)
    losses = result.metrics["losses"]
    assert len(losses) == 12 and losses[-1] < 0.5 * losses[0], losses
    assert sorted(set(result.metrics["island_of_rank"])) == [0, 1]
    assert sorted(result.metrics["islands"]) == ["amd", "nvidia"]
