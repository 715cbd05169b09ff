"""balance.py alone: shares against brute force, the speed fit, the policy's hysteresis, the
sampler's coverage. Pure: no Ray, no torch.distributed."""

from __future__ import annotations

import itertools
from typing import Optional

import numpy as np
import pytest

from hetccl_ray.features import balance
from hetccl_ray.features.balance import Policy, Speed


def brute_force_best(speeds: list[Speed], global_batch: int) -> float:
    """The least possible step time over every split with a sample per rank."""
    best = float("inf")
    for cut in itertools.combinations(range(1, global_batch), len(speeds) - 1):
        shares = np.diff([0, *cut, global_batch])
        best = min(best, balance.step_time(shares, speeds))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_shares_minimize_the_step_time(seed):
    rng = np.random.default_rng(seed)
    speeds = [Speed(float(rng.uniform(0, 0.05)), float(rng.uniform(0.001, 0.01))) for _ in range(3)]
    shares = balance.shares_for(speeds, 17)
    assert sum(shares) == 17 and min(shares) >= 1
    assert balance.step_time(shares, speeds) == pytest.approx(brute_force_best(speeds, 17))


def test_shares_follow_speed_and_keep_a_sample_each():
    assert balance.shares_for([Speed(0, 2.0), Speed(0, 1.0)], 300) == [100, 200]
    assert balance.shares_for([Speed(0, 1.0), Speed(0, 1.0), Speed(0, 1.0)], 10) == [4, 3, 3]
    assert balance.shares_for([Speed(0, 1000.0), Speed(0, 0.001)], 50) == [1, 49]


@pytest.mark.parametrize("call, match", [
    (lambda: balance.check_shares([3, 3], 7, 2), "sum to 6, the global batch is 7"),
    (lambda: balance.check_shares([7, 0], 7, 2), "at least one sample"),
    (lambda: balance.check_shares([7], 7, 2), "name 1 ranks, the group has 2"),
    (lambda: balance.even_shares(3, 4), "global batch of 3 cannot give each of 4 ranks"),
    (lambda: balance.shares_for([Speed(0, 1.0)] * 4, 3), "global batch of 3 cannot"),
    (lambda: balance.fit_speed([(4, 0.0)]), "positive time"),
    (lambda: Policy(every=0), "at least 1"),
    (lambda: Policy(margin=1.5), r"in \[0, 1\)"),
    (lambda: Policy(damping=0.0), r"in \(0, 1\]"),
    (lambda: balance.global_batch_indices(0, 10, 16, 0), "dataset of 10 samples holds no global batch of 16"),
])
def test_bad_input_is_a_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_the_fit_recovers_a_fixed_part_and_falls_back_to_the_origin():
    truth = Speed(0.02, 0.003)
    fitted = balance.fit_speed([(100, truth.time(100)), (40, truth.time(40))])
    assert fitted.fixed == pytest.approx(0.02) and fitted.per_sample == pytest.approx(0.003)
    assert balance.fit_speed([(50, 0.1)]) == Speed(0.0, 0.1 / 50)  # one share seen: through the origin
    drifted = balance.fit_speed([(50, 0.1), (80, 0.05)])  # faster with more samples: the speed changed
    assert drifted == Speed(0.0, 0.05 / 80)
    paired = balance.fit_speed([(60, 0.35), (50, 0.1), (50, 0.3)])  # the last point, and the last of another share
    assert paired.per_sample == pytest.approx(0.005) and paired.fixed == pytest.approx(0.05)


def simulate(truths: list[Speed], global_batch: int, checks: int, noise: float = 0.0, seed: int = 0,
             policy: Policy = Policy(every=1, margin=0.05), slowed: Optional[dict] = None) -> list[list[int]]:
    """The Balancer's loop without processes: measure each rank's time at its share (with
    relative noise; ``slowed``: rank -> (factor, checks), a rank that many times slower for
    the first checks), fit, choose; the shares after each check."""
    rng = np.random.default_rng(seed)
    shares = balance.even_shares(global_batch, len(truths))
    measured: list[list] = [[] for _ in truths]
    speeds, seen = [None] * len(truths), []
    for check in range(checks):
        for r, truth in enumerate(truths):
            factor, until = (slowed or {}).get(r, (1.0, 0))
            seconds = truth.time(shares[r]) * (factor if check < until else 1.0) * (1 + noise * rng.standard_normal())
            measured[r] = balance.add_point(measured[r], (shares[r], seconds), speeds[r])
        speeds = [balance.fit_speed(m) for m in measured]
        shares = policy.choose(shares, speeds)
        seen.append(list(shares))
    return seen


@pytest.mark.parametrize("rank", [0, 1])
def test_a_slow_start_on_either_rank_does_not_leave_shares_off(rank):
    """Ray Train starts actors of its own beside the workers as a run begins (measured here:
    one rank's time per sample twice its steady value for the first ~25 steps): the
    measurements of those checks describe another speed; once it ends, shares settle within
    the margin of the steady best, not wherever a damped step's gain fell under the margin."""
    truths = [Speed(0.001, 0.00002), Speed(0.002, 0.00004)]  # rank 1 at half speed (the quota)
    policy = Policy(every=1, margin=0.1)
    best = balance.shares_for(truths, 4096)
    seen = simulate(truths, 4096, checks=14, policy=policy, slowed={rank: (2.0, 4)}, noise=0.02, seed=rank)
    assert seen[-1] == seen[-2], seen  # settled
    assert balance.step_time(seen[-1], truths) <= balance.step_time(best, truths) / (1 - policy.margin), (seen, best)


def test_a_fixed_cost_on_the_slow_rank_does_not_spiral_its_share_away():
    truths = [Speed(0.005, 0.0003), Speed(0.015, 0.0006)]  # half speed, and three times the fixed cost
    best = balance.shares_for(truths, 512)
    seen = simulate(truths, 512, checks=12)
    assert seen[-1] == seen[-2]  # settled
    # within the margin of the best (the hysteresis stops there), and not spiralled toward rank 0
    assert balance.step_time(seen[-1], truths) <= balance.step_time(best, truths) / (1 - Policy().margin)
    assert seen[-1][1] >= 0.9 * best[1]


def test_noise_within_the_margin_does_not_make_shares_oscillate():
    truths = [Speed(0.0, 0.001), Speed(0.0, 0.002)]
    seen = simulate(truths, 300, checks=20, noise=0.01, seed=3)
    assert len({tuple(s) for s in seen[2:]}) <= 2, seen


def test_policy_keeps_shares_when_the_gain_is_within_the_margin():
    speeds = [Speed(0.0, 0.001), Speed(0.0, 0.00104)]
    assert Policy(margin=0.05).choose([50, 50], speeds) == [50, 50]
    assert Policy(margin=0.0, damping=1.0).choose([50, 50], speeds) == balance.shares_for(speeds, 100)
    twice_as_fast = [Speed(0.0, 0.001), Speed(0.0, 0.002)]
    assert Policy(margin=0.05, damping=1.0).choose([50, 50], twice_as_fast) == [67, 33]
    halfway = Policy(margin=0.05).choose([50, 50], twice_as_fast)  # damping 0.5: half of the way
    assert sum(halfway) == 100 and abs(halfway[0] - 58.5) <= 1


def test_each_global_batch_is_covered_exactly_once_and_deterministic():
    n, batch = 100, 16
    per_epoch = n // batch
    epoch0 = np.concatenate([balance.global_batch_indices(s, n, batch, seed=7) for s in range(per_epoch)])
    assert len(set(epoch0.tolist())) == per_epoch * batch  # no sample twice in an epoch
    np.testing.assert_array_equal(balance.global_batch_indices(3, n, batch, 7), balance.global_batch_indices(3, n, batch, 7))
    assert not np.array_equal(balance.global_batch_indices(per_epoch, n, batch, 7), balance.global_batch_indices(0, n, batch, 7))
    assert not np.array_equal(balance.global_batch_indices(0, n, batch, 8), balance.global_batch_indices(0, n, batch, 7))
    for shares in ([5, 11], [1, 1, 14], [4, 4, 4, 4]):
        parts = [balance.rank_indices(shares, r, 2, n, 7) for r in range(len(shares))]
        assert [len(p) for p in parts] == shares
        np.testing.assert_array_equal(np.concatenate(parts), balance.global_batch_indices(2, n, batch, 7))
