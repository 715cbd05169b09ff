"""Ray Train: TorchTrainer with the hetccl backend config on a labelled local cluster."""

from __future__ import annotations

import numpy as np
import pytest

from examples import train_balanced_mixed, train_ddp_mixed, train_moe_mixed  # the tests' workloads
from hetccl_ray.tools import cpu_quota
from hetccl_ray.tools.local_cluster import LocalCluster

ISLANDS = ["nvidia", "nvidia", "amd"]


@pytest.fixture(scope="module")
def cluster():
    # each island's node in a CPU quota group of its own where cgroups allow (no limit until a test sets one)
    with LocalCluster(ISLANDS, cpu_quota=None if cpu_quota.unavailable() else {}) as running:
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


@pytest.mark.skipif(cpu_quota.unavailable() is not None,
                    reason=f"a simulated slow island needs cgroup CPU quotas: {cpu_quota.unavailable()}")
def test_balanced_trainer_is_exact_and_gives_the_slow_island_less(cluster):
    # ~10 ms of compute a step: at 1 ms (batch 128, width 256) a CPU quota's 100 ms period
    # rarely throttles the slow island and the test failed 1 run in 3
    config = dict(steps=16, global_batch=512, width=512, features=64, dataset=512 * 4, params=True)
    cluster.quotas["amd"].set(0.3)  # island "amd" at under a third of a CPU: real CPU time taken away
    try:
        result = train_balanced_mixed.fit(["nvidia", "amd"], balance="auto", every=3, cluster=cluster, **config)
    finally:
        cluster.quotas["amd"].set(None)
    histories, islands = result.metrics["histories"], result.metrics["islands"]
    assert all(history == histories[0] for history in histories)  # every rank computed the same shares
    assert len(histories[0]) > 1, result.metrics["checks"]  # re-balanced at least once: exactness across a change
    final = result.metrics["balance"]["shares"]
    assert final[islands.index("nvidia")] > final[islands.index("amd")], result.metrics["checks"]
    want = train_balanced_mixed.reference(config)
    for name, value in want.items():
        np.testing.assert_allclose(np.array(result.metrics["params"][name]), value, rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def test_balance_settings_are_checked_where_the_config_is_made():
    from hetccl_ray.doors.train import HetCCLTorchConfig

    with pytest.raises(ValueError, match="balance='sometimes'"):
        HetCCLTorchConfig(balance="sometimes")
    with pytest.raises(ValueError, match="rebalance every 0 steps"):
        HetCCLTorchConfig(balance="auto", rebalance_every=0)
