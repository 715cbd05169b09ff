"""The stage planner (hetccl_ray/features/stages.py) alone: the split against brute force,
even splits on equal islands, speed and activation bytes steering the cuts, bad splits, and
re-planning with a margin. Pure: no Ray, no torch."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hetccl_ray.features import stages
from hetccl_ray.features.stages import Costs


def brute_force(costs: Costs) -> float:
    """The least pace over every contiguous split with a layer per stage."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, costs.layers), costs.stages - 1):
        best = min(best, stages.split_of(costs, (0, *cuts, costs.layers)).bottleneck_s)
    return best


@pytest.mark.parametrize("seed", range(8))
def test_the_split_is_the_best_of_every_contiguous_split(seed):
    rng = np.random.default_rng(seed)
    islands, layers = 2 + seed % 3, 6 + seed
    speed = rng.uniform(0.5, 2.0, size=islands)
    costs = Costs([list(rng.uniform(1e-3, 5e-3, size=layers) * s) for s in speed],
                  list(rng.integers(1_000, 200_000, size=layers)), border_bytes_per_s=1.25e8)
    split = stages.plan(costs)
    assert split.bottleneck_s == pytest.approx(brute_force(costs))
    assert sum(split.sizes()) == layers and min(split.sizes()) >= 1


@pytest.mark.parametrize("layers,islands", [(8, 2), (9, 2), (12, 3), (7, 3)])
def test_equal_islands_get_the_even_split(layers, islands):
    costs = Costs([[2e-3] * layers] * islands, [4096] * layers, border_bytes_per_s=1e9)
    split = stages.plan(costs)
    assert split.bounds == stages.even_bounds(layers, islands)


def test_a_half_speed_island_gets_half_the_layers():
    layers = 12
    costs = Costs([[1e-3] * layers, [2e-3] * layers], [1024] * layers, border_bytes_per_s=1e9)
    split = stages.plan(costs)
    assert split.sizes() == [8, 4]  # 8 ms and 8 ms, against 6 ms and 12 ms evenly
    even = stages.split_of(costs, stages.even_bounds(layers, 2))
    assert even.bottleneck_s / split.bottleneck_s == pytest.approx(1.5)


def test_the_cut_goes_where_the_activation_is_small_when_the_border_is_slow():
    layers = 6
    cut_bytes = [1 << 20] * layers
    cut_bytes[1] = 1 << 10  # a bottleneck layer: its output is small
    costs = Costs([[1e-3] * layers] * 2, cut_bytes, border_bytes_per_s=1.25e8)  # 1 Gbit/s
    split = stages.plan(costs)
    assert split.bounds == (0, 2, 6)  # 2 + 4 layers: 4 ms beats a 16.8 ms cut of 1 MiB each way
    assert split.cut_s == pytest.approx((2 * 1024 / 1.25e8,))


@pytest.mark.parametrize("bounds,match", [
    ((0, 0, 6), r"stage\(s\) \[0\] hold no layers"),
    ((0, 3, 8), "the model has 6"),
    ((0, 2, 4, 6), "2 stages need 3 bounds"),
    ((1, 3, 6), "covers layers 1..6"),
])
def test_a_bad_split_is_a_clear_error(bounds, match):
    costs = Costs([[1e-3] * 6] * 2, [64] * 6, border_bytes_per_s=1e9)
    with pytest.raises(ValueError, match=match):
        stages.split_of(costs, bounds)


@pytest.mark.parametrize("make,match", [
    (lambda: Costs([[1e-3] * 3, [1e-3] * 2], [1] * 3, 1e9), "a time for each of the 3 layers"),
    (lambda: Costs([[1e-3] * 3], [1] * 3, 0.0), "border rate"),
    (lambda: stages.plan(Costs([[1e-3] * 2] * 3, [1] * 2, 1e9)), "2 layers cannot give each of 3 stages"),
    (lambda: stages.replan((0, 1, 2), Costs([[1e-3] * 2] * 2, [1] * 2, 1e9), margin=1.0), "margin"),
])
def test_bad_costs_are_a_clear_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_replan_moves_layers_only_beyond_the_margin_and_says_which():
    layers = 12
    equal = Costs([[1e-3] * layers] * 2, [1024] * layers, border_bytes_per_s=1e9)
    current = stages.plan(equal).bounds
    assert stages.replan(current, equal) is None
    nearly = Costs([[1e-3] * layers, [1.05e-3] * layers], [1024] * layers, border_bytes_per_s=1e9)
    assert stages.replan(current, nearly, margin=0.1) is None  # 5% slower: within the margin
    halved = Costs([[1e-3] * layers, [2e-3] * layers], [1024] * layers, border_bytes_per_s=1e9)
    new = stages.replan(current, halved, margin=0.1)
    assert new is not None and new.bounds == (0, 8, 12)
    assert stages.moves(current, new.bounds) == [(6, 1, 0), (7, 1, 0)]
    with pytest.raises(ValueError, match="not of one model"):
        stages.moves(current, (0, 4, 10))
