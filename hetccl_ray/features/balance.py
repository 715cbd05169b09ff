"""Batch shares for ranks of unequal speed: how many samples of each global batch each rank
takes, and which ones. Pure arithmetic (no torch.distributed, no Ray), so every rank that
feeds it the same gathered numbers computes the same shares.

Model: a rank's compute time for a step is a fixed part plus its share times its time per
sample, both fitted from measurements at two shares; the step takes as long as the slowest
rank, so shares minimize the largest predicted time (KAITIAN's rule b_r ~ speed_r, with the
fixed part and without rounding error).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


def check_shares(shares: Sequence[int], global_batch: int, world: int) -> list[int]:
    """``shares`` as a list, or a ValueError naming what is wrong: one share per rank, each
    at least one sample, summing to the global batch."""
    shares = [int(s) for s in shares]
    if len(shares) != world:
        raise ValueError(f"shares {shares} name {len(shares)} ranks, the group has {world}")
    if min(shares) < 1:
        raise ValueError(f"shares {shares}: every rank takes at least one sample of each global batch")
    if sum(shares) != global_batch:
        raise ValueError(f"shares {shares} sum to {sum(shares)}, the global batch is {global_batch}")
    return shares


def even_shares(global_batch: int, world: int) -> list[int]:
    """The global batch split as evenly as integers allow (plain DDP's split)."""
    if global_batch < world:
        raise ValueError(f"a global batch of {global_batch} cannot give each of {world} ranks a sample")
    return [global_batch // world + (1 if r < global_batch % world else 0) for r in range(world)]


@dataclass(frozen=True)
class Speed:
    """A rank's compute time for a step of ``share`` samples: ``fixed + per_sample * share``.
    The fixed part (hooks, launches, the rank's share of communication CPU) matters on a
    slow rank: through the origin it makes a small share look slow per sample, and the
    shares would spiral toward the fast ranks."""

    fixed: float
    per_sample: float

    def time(self, share: int) -> float:
        return self.fixed + self.per_sample * share


def fit_speed(points: Sequence[tuple[int, float]]) -> Speed:
    """A rank's speed from its (share, step compute seconds) measurements, oldest first: the
    line through the last point and the last one of a share at least 10% away, when it is
    plausible (a positive slope, a fixed part at least 0), else the line through the origin
    and the last point."""
    share, seconds = points[-1]
    if share < 1 or not seconds > 0 or not np.isfinite(seconds):
        raise ValueError(f"a measurement of {seconds} s for {share} samples: need a positive time and share")
    earlier = [p for p in points[:-1] if abs(p[0] - share) >= 0.1 * share]  # close shares: noise, not a slope
    if earlier:
        (b0, t0), (b1, t1) = earlier[-1], points[-1]
        per_sample = (t1 - t0) / (b1 - b0)
        fixed = t1 - per_sample * b1
        if per_sample > 0 and fixed >= 0:
            return Speed(fixed, per_sample)
    return Speed(0.0, seconds / share)


def add_point(points: Sequence[tuple[int, float]], point: tuple[int, float], fitted: Optional[Speed],
              tolerance: float = 0.25, keep: int = 4) -> list[tuple[int, float]]:
    """A rank's measurements with ``point`` (share, seconds) added, the last ``keep``; only
    ``point`` where it is more than ``tolerance`` off what ``fitted`` (the fit before it)
    predicts: the rank's speed changed (start-up work beside it ended, a slowdown came or
    went), so its older points describe another speed and a line through them is wrong."""
    predicted = fitted.time(point[0]) if fitted is not None else None
    if predicted is not None and abs(point[1] - predicted) > tolerance * predicted:
        return [point]
    return [*points[-(keep - 1):], point]


def shares_for(speeds: Sequence[Speed], global_batch: int) -> list[int]:
    """Integer shares (each >= 1, summing to ``global_batch``) minimizing the predicted step
    time ``max(speed.time(share))``: one sample each, then each next sample to the rank that
    would finish it soonest (ties to the lower rank), which is optimal for increasing times."""
    even_shares(global_batch, len(speeds))  # the same check: a sample per rank at least
    shares = [1] * len(speeds)
    heap = [(speed.time(2), r) for r, speed in enumerate(speeds)]
    heapq.heapify(heap)
    for _ in range(global_batch - len(speeds)):
        _, r = heapq.heappop(heap)
        shares[r] += 1
        heapq.heappush(heap, (speeds[r].time(shares[r] + 1), r))
    return shares


def step_time(shares: Sequence[int], speeds: Sequence[Speed]) -> float:
    """The predicted compute time of a step: the slowest rank's."""
    return max(speed.time(share) for share, speed in zip(shares, speeds))


@dataclass(frozen=True)
class Policy:
    """When to change shares: every ``every`` measured steps, and only if the predicted best
    split's step time beats the current one's by more than ``margin`` (a fraction), so
    measurement noise does not make shares oscillate. A change goes ``damping`` of the way
    to that split (a fit from noisy steps can overshoot, and the next check corrects from
    nearer); shares stop within the margin of the best, not where one damped step would gain
    less than the margin."""

    every: int = 10
    margin: float = 0.1
    damping: float = 0.5

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"rebalance every {self.every} steps: must be at least 1")
        if not 0 <= self.margin < 1:
            raise ValueError(f"balance margin {self.margin}: must be in [0, 1)")
        if not 0 < self.damping <= 1:
            raise ValueError(f"balance damping {self.damping}: must be in (0, 1]")

    def due(self, steps_measured: int) -> bool:
        return steps_measured >= self.every

    def choose(self, current: Sequence[int], speeds: Sequence[Speed]) -> list[int]:
        """New shares, or ``current`` when the best split's gain is within the margin."""
        best = shares_for(speeds, sum(current))
        if step_time(best, speeds) >= (1 - self.margin) * step_time(current, speeds):
            return list(current)
        toward = [c + round(self.damping * (b - c)) for c, b in zip(current, best)]
        toward[-1] += sum(current) - sum(toward)  # rounding: the total stays the global batch
        return toward if min(toward) >= 1 and toward != list(current) else best


def global_batch_indices(step: int, dataset_len: int, global_batch: int, seed: int) -> np.ndarray:
    """The dataset indices of step ``step``'s global batch: epoch ``e`` walks a permutation
    seeded by ``(seed, e)`` in batches of ``global_batch`` (the last partial batch dropped)."""
    per_epoch = dataset_len // global_batch
    if per_epoch < 1:
        raise ValueError(f"a dataset of {dataset_len} samples holds no global batch of {global_batch}")
    epoch, k = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(dataset_len)
    return order[k * global_batch:(k + 1) * global_batch]


def rank_span(shares: Sequence[int], rank: int) -> tuple[int, int]:
    """Where rank ``rank``'s samples lie in a global batch split by ``shares``."""
    start = sum(shares[:rank])
    return start, start + shares[rank]


def rank_indices(shares: Sequence[int], rank: int, step: int, dataset_len: int, seed: int) -> np.ndarray:
    """Rank ``rank``'s indices of step ``step``'s global batch: the ranks' indices together
    are the global batch, each sample once."""
    start, stop = rank_span(shares, rank)
    return global_batch_indices(step, dataset_len, sum(shares), seed)[start:stop]
