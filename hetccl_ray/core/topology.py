"""Ranks -> islands -> lanes. Pure data, no Ray and no I/O, so plans can be tested alone.

An *island* is a set of ranks whose devices share one vendor collective library. A *lane*
is one cross-island path: lane ``l`` joins the ``l``-th rank of every island.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

ISLAND_LABEL = "hetccl.io/island"
ACCELERATOR_LABEL = "ray.io/accelerator-type"


def vendor_of_accelerator(accelerator_type: str) -> str:
    """Vendor island name for a Ray accelerator type ("A100" -> "nvidia", "AMD-Instinct-MI300X" -> "amd")."""
    name = accelerator_type.strip().upper()
    if not name:
        return "cpu"
    if name.startswith("AMD") or name.startswith("MI"):
        return "amd"
    if name.startswith("INTEL"):
        return "intel"
    if name.startswith(("TPU", "AWS-NEURON", "GOOGLE")):
        return name.lower()
    return "nvidia"


def island_for(
    override: Optional[str],
    node_labels: Mapping[str, str],
    local_vendor: Optional[str],
) -> str:
    """The island of one rank, by the design's order of precedence.

    ``override`` (group option or ``HETCCL_ISLAND``), then the node label
    ``hetccl.io/island``, then, for a rank that drives an accelerator (``local_vendor``),
    the node's accelerator label or else that vendor. A rank without one is never in a GPU
    island (its Gloo island must not wait for the node's NCCL ranks): on a node labelled
    with an island and an accelerator it is in that island's CPU island (``nvidia-cpu``),
    on an accelerator node without an island label in ``"cpu"``.
    """
    if override:
        return str(override)
    accelerator = node_labels.get(ACCELERATOR_LABEL)
    labelled = node_labels.get(ISLAND_LABEL)
    if labelled:
        return f"{labelled}-cpu" if accelerator and local_vendor is None else str(labelled)
    if local_vendor is None:
        return "cpu"
    return vendor_of_accelerator(accelerator) if accelerator else local_vendor


@dataclass(frozen=True)
class Island:
    """One island: its name and its group ranks in ascending order."""

    index: int
    name: str
    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``n`` elements into ``parts`` balanced (offset, length) ranges, larger ones first."""
    if parts <= 0:
        raise ValueError(f"cannot split into {parts} parts")
    base, extra = divmod(n, parts)
    ranges, offset = [], 0
    for i in range(parts):
        length = base + (1 if i < extra else 0)
        ranges.append((offset, length))
        offset += length
    return ranges


@dataclass(frozen=True)
class Topology:
    """Islands of a group, ordered by their lowest rank, and the lanes that join them."""

    islands: tuple[Island, ...]
    lanes: int

    @classmethod
    def from_islands(cls, island_of_rank: Sequence[str], max_lanes: Optional[int] = None) -> "Topology":
        """Build from the island name of each rank (index = group rank)."""
        if not island_of_rank:
            raise ValueError("a topology needs at least one rank")
        members: dict[str, list[int]] = {}
        for rank, name in enumerate(island_of_rank):
            members.setdefault(str(name), []).append(rank)
        ordered = sorted(members.items(), key=lambda item: item[1][0])
        islands = tuple(Island(i, name, tuple(ranks)) for i, (name, ranks) in enumerate(ordered))
        lanes = min(island.size for island in islands)
        if max_lanes is not None:
            if max_lanes < 1:
                raise ValueError(f"max_lanes must be >= 1, got {max_lanes}")
            lanes = min(lanes, max_lanes)
        return cls(islands, lanes)

    @functools.cached_property
    def world_size(self) -> int:
        return sum(island.size for island in self.islands)

    def island_of(self, rank: int) -> Island:
        """The island holding ``rank``."""
        for island in self.islands:
            if rank in island.ranks:
                return island
        raise ValueError(f"rank {rank} is not in this topology of {self.world_size} ranks")

    def local_rank(self, rank: int) -> int:
        """Index of ``rank`` inside its island."""
        return self.island_of(rank).ranks.index(rank)

    def lane_of(self, rank: int) -> Optional[int]:
        """The lane ``rank`` serves as border rank for, or None if it is no border rank."""
        local = self.local_rank(rank)
        return local if local < self.lanes else None

    def lane_peers(self, lane: int) -> list[int]:
        """The border rank of ``lane`` in every island, in island order."""
        return [island.ranks[lane] for island in self.islands]

    @functools.cached_property
    def island_major_order(self) -> tuple[int, ...]:
        """Group ranks listed island by island: the layout plans use for per-rank chunks."""
        return tuple(rank for island in self.islands for rank in island.ranks)

    def regions(self, chunk: int) -> list[tuple[int, int]]:
        """(offset, length) of each island's chunks in an island-major buffer of one chunk per rank."""
        spans, offset = [], 0
        for island in self.islands:
            spans.append((offset, island.size * chunk))
            offset += island.size * chunk
        return spans

    def describe(self) -> str:
        """One line a person can read: islands, their ranks and the lane count."""
        parts = [f"{island.name}{list(island.ranks)}" for island in self.islands]
        return f"{len(self.islands)} island(s) {' '.join(parts)}, {self.lanes} lane(s)"
