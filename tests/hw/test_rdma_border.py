"""(b) The RDMA border on real NICs: every op correct, and faster than TCP at 64 MiB.

Two ways to run it, each skipping with what is missing:
- two hosts with RDMA NICs: ``HETCCL_HW_RAY_ADDRESS`` names a Ray cluster whose nodes carry
  ``hetccl.io/island`` labels for two islands (one node each);
- one host with an RDMA NIC: two islands on this host, loopback through the NIC.
"""

from __future__ import annotations

import os

import pytest
import ray

import hetccl_ray
from hetccl_ray.tools import bench
from hetccl_ray.tools.local_cluster import LocalCluster, place_workers
from hetccl_ray.transport import verbs
from tests.hw.ops import every_op

ADDRESS = os.environ.get("HETCCL_HW_RAY_ADDRESS")
FOUND = verbs.discover()
pytestmark = pytest.mark.skipif(
    not ADDRESS and not FOUND.ports,
    reason=f"needs an RDMA NIC: set HETCCL_HW_RAY_ADDRESS to a Ray cluster of two labelled hosts with RDMA NICs, "
           f"or run on a host with one (here: {FOUND.why})")


@pytest.fixture(scope="module")
def islands():
    """Two actors per island on two islands; the islands of the cluster given, else local."""
    if ADDRESS:
        ray.init(address=ADDRESS)
        names = sorted({n["Labels"].get(hetccl_ray.ISLAND_LABEL) for n in ray.nodes() if n["Alive"]} - {None})[:2]
        layout = [names[0], names[0], names[1], names[1]]
        yield layout, place_workers(layout)
        ray.shutdown()
    else:
        layout = ["a", "a", "b", "b"]
        with LocalCluster(layout) as cluster:
            yield layout, cluster.workers(layout)


def test_every_op_over_rdma(islands):
    layout, actors = islands
    hetccl_ray.create_collective_group(actors, 4, [0, 1, 2, 3], group_name="hw-rdma", timeout_s=120,
                                       transport="rdma")
    assert ray.get([a.call.remote(every_op, "hw-rdma", r, 4, "cpu") for r, a in enumerate(actors)]) == [[]] * 4


def test_rdma_beats_tcp_at_64_mib(islands):
    layout, actors = islands
    spec = bench.BenchSpec(("allreduce",), [64 << 20], "float32", 2, 5, False)
    seconds = {}
    for transport in ("rdma", "tcp"):
        frame = bench.run_sweep(actors, layout, spec, progress=False, transport=transport)
        assert frame["wrong"].sum() == 0
        assert all(transport in lane for lane in frame.attrs["lanes"]), frame.attrs["lanes"]
        seconds[transport] = float(frame["time_us"].iloc[0])
    print(f"64 MiB allreduce: rdma {seconds['rdma']:.0f} us, tcp {seconds['tcp']:.0f} us, "
          f"{seconds['tcp'] / seconds['rdma']:.2f}x")
    assert seconds["rdma"] < seconds["tcp"], seconds
