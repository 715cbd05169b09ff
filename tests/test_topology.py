"""Topology alone: islands from labels, ordering, lanes."""

import pytest

from hetccl_ray.core.topology import Topology, island_for, split, vendor_of_accelerator


def test_precedence():
    labels = {"hetccl.io/island": "east", "ray.io/accelerator-type": "A100"}
    assert island_for("forced", labels, "amd") == "forced"
    assert island_for(None, labels, "amd") == "east"
    assert island_for(None, {"ray.io/accelerator-type": "A100"}, "nvidia") == "nvidia"
    assert island_for(None, {"ray.io/accelerator-type": "AMD-Instinct-MI300X-OAM"}, "amd") == "amd"
    # a CPU rank on a GPU node is in the cpu island, not the node's accelerator island
    assert island_for(None, {"ray.io/accelerator-type": "A100"}, None) == "cpu"
    assert island_for(None, {}, "amd") == "amd"
    assert island_for(None, {}, None) == "cpu"
    # a CPU-only actor (a driver, a data loader) on a labelled GPU node: that island's CPU island
    assert island_for(None, labels, None) == "east-cpu"
    assert island_for(None, {"hetccl.io/island": "nvidia"}, None) == "nvidia"  # simulated islands: no accelerator


@pytest.mark.parametrize("name,vendor", [("H100", "nvidia"), ("MI250X", "amd"), ("Intel-GPU-Max-1550", "intel"),
                                         ("", "cpu")])
def test_vendor(name, vendor):
    assert vendor_of_accelerator(name) == vendor


def test_interleaved_unequal():
    topo = Topology.from_islands(["x", "y", "x", "z", "y", "x"])
    assert [(i.name, i.ranks) for i in topo.islands] == [("x", (0, 2, 5)), ("y", (1, 4)), ("z", (3,))]
    assert topo.lanes == 1
    assert topo.island_major_order == (0, 2, 5, 1, 4, 3)
    assert topo.lane_peers(0) == [0, 1, 3]
    assert [topo.lane_of(r) for r in range(6)] == [0, 0, None, 0, None, None]
    assert topo.local_rank(5) == 2


def test_lanes_and_cap():
    topo = Topology.from_islands(["b", "b", "a", "a", "a"])
    assert [i.name for i in topo.islands] == ["b", "a"]
    assert topo.lanes == 2 and topo.lane_peers(1) == [1, 3]
    assert Topology.from_islands(["b", "b", "a", "a"], max_lanes=1).lanes == 1
    with pytest.raises(ValueError):
        Topology.from_islands(["a"], max_lanes=0)
    with pytest.raises(ValueError):
        Topology.from_islands([])


def test_split():
    assert split(7, 3) == [(0, 3), (3, 2), (5, 2)]
    assert split(1, 3) == [(0, 1), (1, 0), (1, 0)]
    assert sum(n for _, n in split(1000003, 7)) == 1000003
