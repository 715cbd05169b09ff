"""The cost model that picks the plan of each call: the small round, the hierarchical plans,
or the flat vendor op over every rank.

Two numbers describe the group's links: the time of one message hop (``hop_s``, latency
plus the per-message software cost) and the bytes per second one rank moves
(``bytes_per_s``). They are measured once at formation (timed rounds of small_round.py) or given
as options. A plan costs ``hops * hop_s + c * S / bytes_per_s``, where ``c`` is the number
of buffers of S bytes its busiest rank moves one after another; the small round has
3 hops and a leader that carries every island's bytes (in one hop, the ``one_hop`` option:
every rank's data to every rank that needs it), the island plans have more hops (their own
call check included) but spread bytes over lanes. The threshold is the size where the two
cost the same.

Where one library spans every rank (Gloo, for CPU tensors) its flat op is a third candidate:
the rows-only check (3 hops) and then Gloo's own algorithm, whose hop and bandwidth are
measured the same way (timed flat broadcasts). It wins where the border is as fast as the
islands (one host, a fast network); the hierarchical plans win where the border is slow.
Pure: imports no Ray.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from hetccl_ray.core.opkinds import ROUND_OPS as OPS, kind
from hetccl_ray.core.topology import Topology
TREE_HOPS = 3
MAX_SMALL_BYTES = 4 << 20  # a leader holds whole buffers: above this the island plans run regardless
_RATE_RANGE = (10e6, 10e9)  # bytes/s a noisy probe may report; outside it the slope was noise
# The island plans copy and reduce in more stages than their wire bytes show: fitted on this
# project's 2-core loopback runs (2x2, 1-16 MiB), their time per byte is 1.8x what the
# buffers moved by their busiest rank alone predict (RESULTS.md, "Where the time goes").
PLAN_SOFTWARE = 1.8


@dataclass(frozen=True)
class LinkCosts:
    """One message hop's time and one rank's bandwidth."""

    hop_s: float
    bytes_per_s: float

    def describe(self) -> str:
        return f"hop {self.hop_s * 1e6:.0f} us, {self.bytes_per_s / 1e9:.2f} GB/s per rank"


def _shape(op: str, topo: Topology) -> tuple[int, float, float]:
    """(hops of the island plans, buffers the tree's busiest rank moves, the plans' busiest rank's)."""
    m = max(island.size for island in topo.islands)
    k, lanes = len(topo.islands), max(topo.lanes, 1)
    inside = (m - 1) / m
    if op == "allreduce":
        return 7, 2 * (m - 1) + (k - 1), 2 * inside + 2 * (k - 1) / (k * lanes)
    if op == "reduce":
        return 6, (m - 1) + (k - 1) + 1, inside + (k - 1) / lanes + inside
    if op == "broadcast":
        return 6, 1 + (k - 1) + (m - 1), 1 + (k - 1) / lanes + inside
    if op == "allgather":
        return 6, (m - 1) + 1, 1.0
    if op == "reducescatter":
        return 6, float(m), 1.0
    raise ValueError(f"no cost model for {op!r}; ops: {', '.join(OPS)}")


def round_hops(one_hop: bool = False) -> int:
    """Message hops of the small round and of the call check (rounds.py)."""
    return 1 if one_hop else TREE_HOPS


def tree_busiest(op: str, topo: Topology, one_hop: bool = False) -> float:
    """Buffers of S bytes the small round's busiest rank moves in turn (for measuring
    bandwidth). In one hop: a root sends or folds every other rank's buffer, allreduce
    folds them all, allgather and reduce-scatter pass an S/n block to each other rank."""
    if op not in OPS:
        raise ValueError(f"no cost model for {op!r} by the small round; ops: {', '.join(OPS)}")
    n = topo.world_size
    if one_hop:
        return (n - 1) / n if kind(op).chunked else float(n - 1)
    return _shape(op, topo)[1]


def round_seconds(topo: Topology, costs: LinkCosts, nbytes: int, one_hop: bool = False) -> float:
    """The model's time of the slowest op's small round on ``nbytes``."""
    busiest = max(tree_busiest(op, topo, one_hop) for op in OPS)
    return round_hops(one_hop) * costs.hop_s + busiest * nbytes / costs.bytes_per_s


def thresholds(topo: Topology, costs: LinkCosts, flat: Optional[LinkCosts] = None,
               flat_ops: Sequence[str] = (), one_hop: bool = False) -> dict[str, int]:
    """For each op, the largest buffer (nccl-tests' size) that goes by the small round (in
    one hop where ``one_hop``): where its line crosses the hierarchical plan's, or for
    ``flat_ops`` (those the flat plan may take) the flat op's (``flat``) where that is sooner."""
    out = {}
    for op in OPS:
        hops, _, plan_c = _shape(op, topo)
        tree_c, plan_c = tree_busiest(op, topo, one_hop), plan_c * PLAN_SOFTWARE
        saved_s = (hops - round_hops(one_hop)) * costs.hop_s
        extra_s_per_byte = max(tree_c - plan_c, 0.25) / costs.bytes_per_s
        limit = saved_s / extra_s_per_byte
        if flat is not None and op in flat_ops:
            flat_hops, flat_c = _flat_shape(op, topo.world_size)
            flat_extra_s_per_byte = max(tree_c / costs.bytes_per_s - flat_c / flat.bytes_per_s, 1e-15)
            limit = min(limit, flat_hops * flat.hop_s / flat_extra_s_per_byte)
        out[op] = int(min(limit, MAX_SMALL_BYTES))
    return out


def _line(broadcasts_s: dict[int, list[float]], busiest: float) -> tuple[float, float]:
    """(seconds at size 0, bytes per second) of the line through the fastest of timed
    broadcasts of two sizes (on a shared machine the rest is other work's noise), whose
    busiest rank moves ``busiest`` buffers."""
    fastest = {size: min(times) for size, times in broadcasts_s.items()}
    small, large = min(fastest), max(fastest)
    slope = max(fastest[large] - fastest[small], 1e-9) / (large - small)
    rate = min(max(busiest / slope, _RATE_RANGE[0]), _RATE_RANGE[1])
    return max(fastest[small] - busiest * small / rate, 0.0), rate


def measure(hop_rounds_s: list[float], broadcasts_s: dict[int, list[float]], topo: Topology,
            one_hop: bool = False) -> LinkCosts:
    """Costs from timed rounds: rows-only rounds (3 hops each, or one) give the hop;
    small-round broadcasts of two sizes give the bandwidth from the slope between them (the
    fastest of each)."""
    _, rate = _line(broadcasts_s, tree_busiest("broadcast", topo, one_hop))
    return LinkCosts(min(hop_rounds_s) / round_hops(one_hop), rate)


def _flat_shape(op: str, n: int) -> tuple[int, float]:
    """(hops, buffers the busiest rank moves) of the flat op over ``n`` ranks: Gloo's ring
    allreduce, its broadcast and reduce from and to the root, allgather and reduce-scatter
    as one direct exchange (libraries.py builds them from send/recv)."""
    if op == "allreduce":
        return 2 * (n - 1), 2 * (n - 1) / n
    if kind(op).rooted:
        return 1, float(n - 1)
    if kind(op).chunked:
        return 1, (n - 1) / n
    raise ValueError(f"no cost model for {op!r}; ops: {', '.join(OPS)}")


def measure_flat(broadcasts_s: dict[int, list[float]], n: int, hops_s: Optional[list[float]] = None) -> LinkCosts:
    """The flat library's hop and bandwidth from timed flat broadcasts of two sizes; the
    hop from timed broadcasts of a few bytes (``hops_s``) where given: the line's intercept
    at size 0, extrapolated from 256 KiB, is noise (0 us was measured)."""
    hop, rate = _line(broadcasts_s, _flat_shape("broadcast", n)[1])
    return LinkCosts(min(hops_s) if hops_s else hop, rate)
