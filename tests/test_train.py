"""Ray Train: TorchTrainer with the hetccl backend config on a labelled local cluster."""

from __future__ import annotations

import numpy as np
import pytest

from examples import train_ddp_mixed, train_moe_mixed  # the examples are the tests' workloads
from hetccl_ray.local_cluster import LocalCluster

ISLANDS = ["nvidia", "nvidia", "amd"]


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(ISLANDS) as running:
        yield running


def test_torchtrainer_trains_over_both_islands(cluster):
    result = train_ddp_mixed.fit(ISLANDS, steps=12)
    losses = result.metrics["losses"]
    assert len(losses) == 12 and losses[-1] < 0.5 * losses[0], losses
    assert sorted(set(result.metrics["island_of_rank"])) == [0, 1]
    assert sorted(result.metrics["islands"]) == ["amd", "nvidia"]


def test_moe_alltoall_matches_one_process(cluster):
    result = train_moe_mixed.fit(ISLANDS)
    losses, params = result.metrics["losses"], result.metrics["params"]
    want_losses, want_params = train_moe_mixed.reference(len(ISLANDS))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-4, atol=1e-5)
    assert sorted(params) == sorted(want_params)
    for name, value in want_params.items():
        np.testing.assert_allclose(params[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    means = [np.mean(per_rank) for per_rank in losses]
    assert np.mean(means[-3:]) < 0.5 * np.mean(means[:3]), means
    assert sorted(result.metrics["islands"]) == ["amd", "nvidia"]
