"""The stage planner: where to cut a model's layers into pipeline stages across islands of
unequal speed. Pure arithmetic (no torch, no Ray), like balance.py: every rank that feeds
it the same measured numbers computes the same split.

Model (the pipeline's steady state, as in HetHub and Metis): stage j runs on island
``order[j]`` and holds layers ``bounds[j]:bounds[j+1]``; a microbatch costs it the sum of
those layers' forward+backward seconds measured on that island. Each cut is a stage of its
own: its activation goes forward and the activation's gradient comes back across the
border, ``2 * bytes / rate`` seconds per microbatch. A pipeline runs at the pace of its
slowest stage or cut, so the planner picks the contiguous split that minimises that
bottleneck (dynamic programming over cut positions, exact).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

from hetccl_ray.features.balance import even_shares


@dataclass(frozen=True)
class Costs:
    """What the planner needs, per microbatch: ``layer_s[i][l]``, island ``i``'s forward+backward
    seconds for layer ``l`` (islands in pipeline order); ``cut_bytes[l]``, the activation bytes
    leaving layer ``l`` (the gradient back has as many); ``border_bytes_per_s``, the measured
    border rate between consecutive islands."""

    layer_s: Sequence[Sequence[float]]
    cut_bytes: Sequence[int]
    border_bytes_per_s: float

    def __post_init__(self) -> None:
        layers = len(self.cut_bytes)
        if not self.layer_s or any(len(row) != layers for row in self.layer_s):
            raise ValueError(f"stage costs: every island needs a time for each of the {layers} layers, got rows of "
                             f"{[len(row) for row in self.layer_s]}")
        if any(not t >= 0 for row in self.layer_s for t in row) or min(self.cut_bytes, default=0) < 0:
            raise ValueError("stage costs: layer times and activation bytes must be >= 0")
        if not self.border_bytes_per_s > 0:
            raise ValueError(f"stage costs: border rate {self.border_bytes_per_s} must be > 0")

    @property
    def layers(self) -> int:
        return len(self.cut_bytes)

    @property
    def stages(self) -> int:
        return len(self.layer_s)

    def stage_s(self, stage: int, start: int, stop: int) -> float:
        """Stage ``stage``'s seconds per microbatch holding layers ``start:stop``."""
        return sum(self.layer_s[stage][start:stop])

    def cut_s(self, after: int) -> float:
        """Seconds per microbatch across the cut after layer ``after - 1`` (activation there,
        its gradient back)."""
        return 2 * self.cut_bytes[after - 1] / self.border_bytes_per_s


@dataclass(frozen=True)
class Split:
    """Layers ``bounds[j]:bounds[j+1]`` on stage j; the predicted seconds per microbatch of
    each stage and each cut, and the slowest of them (the pipeline's pace)."""

    bounds: tuple[int, ...]
    stage_s: tuple[float, ...]
    cut_s: tuple[float, ...]

    @property
    def bottleneck_s(self) -> float:
        return max(self.stage_s + self.cut_s)

    def layers(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])

    def sizes(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    def describe(self) -> str:
        stages = ", ".join(f"stage {j}: layers {r.start}-{r.stop - 1} ({t * 1e3:.2f} ms)"
                           for j, (r, t) in enumerate(zip(map(self.layers, range(len(self.stage_s))), self.stage_s)))
        cuts = ", ".join(f"{t * 1e3:.2f}" for t in self.cut_s)
        return f"{stages}; cuts {cuts} ms; pace {self.bottleneck_s * 1e3:.2f} ms per microbatch"


def check_bounds(bounds: Sequence[int], layers: int, stages: int) -> tuple[int, ...]:
    """``bounds`` as a tuple, or a ValueError naming what is wrong: ``stages + 1`` bounds from 0
    to ``layers``, every stage at least one layer."""
    bounds = tuple(int(b) for b in bounds)
    if len(bounds) != stages + 1:
        raise ValueError(f"split {list(bounds)}: {stages} stages need {stages + 1} bounds, got {len(bounds)}")
    if bounds[0] != 0 or bounds[-1] != layers:
        raise ValueError(f"split {list(bounds)} covers layers {bounds[0]}..{bounds[-1]}, the model has {layers} "
                         f"(bounds run from 0 to {layers})")
    empty = [j for j in range(stages) if bounds[j + 1] <= bounds[j]]
    if empty:
        raise ValueError(f"split {list(bounds)}: stage(s) {empty} hold no layers; every stage holds at least one")
    return bounds


def split_of(costs: Costs, bounds: Sequence[int]) -> Split:
    """The predicted times of a given split (checked)."""
    bounds = check_bounds(bounds, costs.layers, costs.stages)
    return Split(bounds, tuple(costs.stage_s(j, bounds[j], bounds[j + 1]) for j in range(costs.stages)),
                 tuple(costs.cut_s(b) for b in bounds[1:-1]))


def even_bounds(layers: int, stages: int) -> tuple[int, ...]:
    """Layers split as evenly as integers allow (the first stages take the extra ones)."""
    if layers < stages:
        raise ValueError(f"{layers} layers cannot give each of {stages} stages a layer")
    return (0, *itertools.accumulate(even_shares(layers, stages)))


def plan(costs: Costs) -> Split:
    """The contiguous split minimising the slowest stage or cut; among equal ones, the one
    nearest the even split (so equal islands keep an even split)."""
    layers, stages = costs.layers, costs.stages
    even = even_bounds(layers, stages)  # also the check: a layer per stage at least
    # best[j][l]: (pace, distance from even) of layers 0:l on stages 0..j-1, and its last cut
    inf = (float("inf"), 0)
    best = [[inf] * (layers + 1) for _ in range(stages + 1)]
    last = [[0] * (layers + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0)
    for j in range(1, stages + 1):
        for stop in range(j, layers - (stages - j) + 1):
            for start in range(j - 1, stop):
                if best[j - 1][start] == inf:
                    continue
                pace = max(best[j - 1][start][0], costs.stage_s(j - 1, start, stop),
                           costs.cut_s(start) if j > 1 else 0.0)
                candidate = (pace, best[j - 1][start][1] + abs(stop - even[j]))
                if candidate < best[j][stop]:
                    best[j][stop], last[j][stop] = candidate, start
    bounds = [layers]
    for j in range(stages, 0, -1):
        bounds.append(last[j][bounds[-1]])
    return split_of(costs, bounds[::-1])


def replan(current: Sequence[int], costs: Costs, margin: float = 0.1) -> Optional[Split]:
    """A new split when the costs measured now predict one whose pace beats the current
    split's by more than ``margin`` (a fraction); None to keep the current one (measurement
    noise does not move layers back and forth)."""
    if not 0 <= margin < 1:
        raise ValueError(f"replan margin {margin}: must be in [0, 1)")
    now, best = split_of(costs, current), plan(costs)
    return best if best.bounds != now.bounds and best.bottleneck_s < (1 - margin) * now.bottleneck_s else None


def moves(old: Sequence[int], new: Sequence[int]) -> list[tuple[int, int, int]]:
    """The layers a change of split moves, as (layer, from stage, to stage), in layer order:
    their weights (and optimizer state) go with them."""
    if old[-1] != new[-1] or len(old) != len(new):
        raise ValueError(f"splits {list(old)} and {list(new)} are not of one model over the same stages")

    def owner(bounds: Sequence[int], layer: int) -> int:
        return next(j for j in range(len(bounds) - 1) if bounds[j] <= layer < bounds[j + 1])

    return [(layer, owner(old, layer), owner(new, layer)) for layer in range(old[-1])
            if owner(old, layer) != owner(new, layer)]
