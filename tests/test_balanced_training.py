"""Balanced data parallel training over hetccl (features/balanced.py): exact gradients with
unequal shares, in spawned torch.distributed ranks on two islands; the Ray Train door with a
simulated slow island is in test_train.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests import torch_workers as w

ISLANDS = ["a", "a", "b"]


@pytest.fixture(scope="module")
def ranks():
    """Each rank's results of every case, from one run of 3 spawned ranks."""
    return w.run(w.balanced_cases, ISLANDS, "hetccl")


@pytest.mark.parametrize("case", ["ddp", "fsdp"], ids=["ddp-hook", "fsdp-loss-weight"])
def test_unequal_shares_and_a_change_give_the_one_process_weights(ranks, case):
    want = w.balanced_reference()
    for rank, results in enumerate(ranks):
        got = results[case]
        assert got["local"] == [w.BALANCED_SHARES[rank]] * 2 + [w.BALANCED_CHANGE[rank]] * (w.STEPS - 2)
        assert got["history"] == ranks[0][case]["history"]  # every rank holds the same shares
        for p, q in zip(got["params"], want):
            np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-5, atol=1e-6)


def test_without_the_weighting_the_same_shares_are_not_exact(ranks):
    """What the test above would see if the weighting were missing: plain DDP's average."""
    got, want = ranks[0]["plain"], w.balanced_reference()
    assert any(not np.allclose(p.numpy(), q.numpy(), rtol=1e-4) for p, q in zip(got["params"], want))


def test_misuse_is_a_clear_error_on_every_rank(ranks):
    for results in ranks:
        out = results["misuse"]
        assert "cannot give each of 3 ranks a sample" in out["small batch"]
        assert "sum to 3, the global batch is 10" in out["bad sum"]
        assert "balance='fastest'" in out["bad mode"]
        assert out["never re-balance"] == "ValueError: rebalance every 0 steps: must be at least 1"  # not the default
        assert out["untimed auto step"].startswith("RuntimeError: Balancer.step(): no compute was timed")
        assert "ranks passed different shares: rank 0: [4, 4, 4]; rank 1: [5, 4, 3]; rank 2: [6, 4, 2]" in out["shares differ"]
