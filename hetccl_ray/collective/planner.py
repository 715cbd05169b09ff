"""The planner: which plan each call takes, from what every rank knows alike.

Candidates per call: the small round (tree.py, 3 hops, call rows inside), the hierarchical
plan (schedule.py), and the flat plan (one library over every rank: Gloo, for CPU tensors
on every rank, after the rows check). The choice reads only the call's op and size, the
agreed rows and what formation measured and agreed (rank 0's link costs, costs.py, and the
flat plan's timed gains summed over ranks), never the local tensor, so every rank of a
group of GPU and CPU islands takes the same plan.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from hetccl_ray.collective import costs
from hetccl_ray.topology import Topology

PROBE_ROUNDS, PROBE_BYTES = 7, (256 << 10, 4 << 20)  # formation's timed rounds for the cost model
OP_PROBE_ROUNDS = 3  # timed calls per op and plan at the largest probe size
OP_PROBE_BUDGET_S = 2.0  # about what those calls may take on a slow border
ROUND, PLAN, FLAT = "round", "plan", "flat"


@dataclass
class Planner:
    """The plan choice of one group: small-round thresholds and where the flat plan starts."""

    topology: Topology
    small_bytes: dict[str, int] = field(default_factory=dict)
    flat: bool = False  # a flat library exists (the ``flat`` option, several islands)
    flat_from: dict[str, float] = field(default_factory=lambda: dict.fromkeys(costs.OPS, math.inf))
    link: Optional[costs.LinkCosts] = None
    flat_link: Optional[costs.LinkCosts] = None

    def plan_of(self, op: str, nbytes: int, every_rank_on_host: bool = True, checked: bool = True) -> str:
        """"round", "flat" or "plan" for a call of ``op`` on ``nbytes`` (nccl-tests' size).
        The flat plan needs the rows (``checked``) to show CPU tensors on every rank."""
        if nbytes <= self.small_bytes.get(op, 0):
            return ROUND
        if self.flat and every_rank_on_host and checked and nbytes >= self.flat_from.get(op, math.inf):
            return FLAT
        return PLAN

    def describe(self) -> list[str]:
        """The link costs and the plan each op takes by size, as lines for a header."""
        limits = ", ".join(f"{op} <= {size:,} B" for op, size in self.small_bytes.items())
        lines = [f"cost model: {self.link.describe() if self.link else 'small_bytes option'}",
                 f"small-message round for: {limits}"]
        if self.flat:
            sizes = ", ".join(f"{op} >= {size:,.0f} B" for op, size in self.flat_from.items() if size < math.inf)
            lines.append(f"flat Gloo over every rank ({self.flat_link.describe() if self.flat_link else 'flat=on'})"
                         f" for: {sizes or 'none'}")
        return lines


def timed(op: Callable[[], None], rounds: int) -> list[float]:
    """Seconds each of ``rounds`` calls of ``op`` took."""
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        op()
        times.append(time.perf_counter() - started)
    return times


def _probes(broadcasts: list[Callable[[torch.Tensor], None]], rounds: int) -> list[dict[int, list[float]]]:
    """Timed broadcasts of each probe size by each of ``broadcasts``, taken in turn round by
    round, so that what else loads the machine meanwhile weighs on each alike."""
    probes = {size: torch.zeros(size // 8, dtype=torch.float64) for size in PROBE_BYTES}
    times: list[dict[int, list[float]]] = [{size: [] for size in PROBE_BYTES} for _ in broadcasts]
    for _ in range(rounds):
        for size, probe in probes.items():
            for fn, out in zip(broadcasts, times):
                out[size] += timed(lambda: fn(probe), 1)
    return times


def calibrate(planner: Planner, small_bytes: Optional[int], flat_mode: str, flat_broadcast: Optional[Callable],
              barrier: Callable[[], None], broadcast: Callable[[torch.Tensor], None],
              synchronize: Callable[[torch.Tensor], None], allreduce: Callable[[torch.Tensor], None],
              probe_calls: Callable[[int], dict[str, Callable[[], None]]]) -> None:
    """Set the group's planner: thresholds from the ``small_bytes`` option, else from costs
    measured now and broadcast from rank 0, so that every rank plans alike: timed rows-only
    rounds and small-round broadcasts through the group's own ``barrier`` and ``broadcast``
    (the link), the flat library's broadcasts (``flat_broadcast``), and each op of
    ``probe_calls`` by the hierarchical and by the flat plan at the largest probe size
    (what every rank saw, summed by ``allreduce``: one rank's view of a close race is noise)."""
    topology = planner.topology
    planner.flat = flat_broadcast is not None
    planner.flat_from = dict.fromkeys(costs.OPS, 0.0 if flat_mode == "on" else math.inf)
    if small_bytes is not None or topology.world_size == 1:
        planner.small_bytes = dict.fromkeys(costs.OPS, small_bytes or 0)
        return
    planner.small_bytes = dict.fromkeys(costs.OPS, costs.MAX_SMALL_BYTES)  # the probes go by the small round
    hops = timed(barrier, PROBE_ROUNDS + 1)[1:]
    measure_flat = planner.flat and flat_mode == "auto"
    probes = _probes([broadcast, flat_broadcast] if measure_flat else [broadcast], PROBE_ROUNDS)
    measured = costs.measure(hops, probes[0], topology)
    numbers = [measured.hop_s, measured.bytes_per_s]
    if measure_flat:
        tiny = torch.zeros(1, dtype=torch.float64)
        flat_hops = timed(lambda: flat_broadcast(tiny), PROBE_ROUNDS + 1)[1:]
        flat_link = costs.measure_flat(probes[1], topology.world_size, flat_hops)
        numbers += [flat_link.hop_s, flat_link.bytes_per_s, _op_probe_bytes(min(probes[1][max(PROBE_BYTES)]))]
    agreed = torch.tensor(numbers, dtype=torch.float64)
    broadcast(agreed)
    synchronize(agreed)  # an emulated device lands it later
    values = agreed.tolist()
    planner.link = costs.LinkCosts(*values[:2])
    if len(values) > 2:
        planner.flat_link, probe_bytes = costs.LinkCosts(*values[2:4]), int(values[4])
        gains = torch.tensor(_flat_gains(planner, probe_calls(probe_bytes)), dtype=torch.float64)
        allreduce(gains)
        synchronize(gains)
        # from the size where it was timed and gained, not from the model's crossover: at
        # smaller sizes the model's line is extrapolated, and has picked it where it lost
        planner.flat_from = {op: float(probe_bytes) if gain > 0 else math.inf
                             for op, gain in zip(costs.OPS, gains.tolist())}
    taken = [op for op, size in planner.flat_from.items() if size < math.inf]
    planner.small_bytes = costs.thresholds(topology, planner.link, planner.flat_link, taken)


def _op_probe_bytes(flat_broadcast_s: float) -> int:
    """The size at which each op is timed by both plans: the largest probe size, smaller
    where the flat library is slow (a slow border) so that the timed calls take about
    ``OP_PROBE_BUDGET_S`` in all, never below the smallest probe size."""
    calls = len(costs.OPS) * (OP_PROBE_ROUNDS + 1) * 2
    scale = OP_PROBE_BUDGET_S / max(calls * flat_broadcast_s, 1e-9)
    return int(min(max(max(PROBE_BYTES) * scale, min(PROBE_BYTES)), max(PROBE_BYTES)))


def _flat_gains(planner: Planner, calls: dict[str, Callable[[], None]]) -> list[float]:
    """For each op (costs.OPS order), the seconds the flat plan's fastest of
    ``OP_PROBE_ROUNDS`` timed calls (after one untimed) saved against the hierarchical
    plan's, the two taken in turn."""
    small, planner.small_bytes = planner.small_bytes, {}
    flat_from = planner.flat_from
    try:
        out = []
        for op in costs.OPS:
            best = {math.inf: math.inf, 0.0: math.inf}
            for warm in [True] + [False] * OP_PROBE_ROUNDS:  # a first call allocates: not timed
                for plan_from in best:
                    planner.flat_from = dict.fromkeys(costs.OPS, plan_from)
                    seconds = timed(calls[op], 1)[0]
                    best[plan_from] = best[plan_from] if warm else min(best[plan_from], seconds)
            out.append(best[math.inf] - best[0.0])
        return out
    finally:
        planner.small_bytes, planner.flat_from = small, flat_from
