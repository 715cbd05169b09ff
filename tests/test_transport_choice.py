"""Transport choice per peer and RDMA discovery on this machine (pyverbs, no RDMA device)."""

from __future__ import annotations

import importlib.util

import pytest

from hetccl_ray.errors import HetCCLError
from hetccl_ray.transport import verbs
from hetccl_ray.transport.choice import choose

HAS_PYVERBS = importlib.util.find_spec("pyverbs") is not None
IB = verbs.Port("mlx5_0", 1, "infiniband", lid=3, gid_index=0, gid="fe80::1", mtu=5)
ROCE = verbs.Port("mlx5_1", 1, "ethernet", lid=0, gid_index=3, gid="::ffff:10.0.0.2", mtu=3)
NONE = verbs.Discovery((), "no RDMA devices (Failed to get devices list)")


def found(*ports):
    return verbs.Discovery(tuple(ports), f"{len(ports)} active port(s)")


def test_auto_takes_rdma_where_both_ends_share_a_link_layer():
    choice = choose("auto", 0, found(IB), 2, found(IB, ROCE))
    assert choice.transport == "rdma" and "infiniband" in choice.why


@pytest.mark.parametrize("mine,theirs,why", [
    (NONE, found(IB), "rank 0 has no usable RDMA port: no RDMA devices (Failed to get devices list)"),
    (found(IB), NONE, "rank 2 has no usable RDMA port"),
    (found(IB), found(ROCE), "share no link layer"),
])
def test_auto_falls_back_to_tcp_and_says_why(mine, theirs, why):
    choice = choose("auto", 0, mine, 2, theirs)
    assert choice.transport == "tcp" and why in choice.why


def test_forced_rdma_without_a_port_is_a_clear_error():
    with pytest.raises(HetCCLError, match=r"transport='rdma' between rank 0 and rank 2 is impossible: rank 2 has "
                                          r"no usable RDMA port"):
        choose("rdma", 0, found(IB), 2, NONE)


def test_forced_tcp_wins_over_ports():
    assert choose("tcp", 0, found(IB), 1, found(IB)).transport == "tcp"


def test_discovery_survives_the_rendezvous_record():
    record = found(IB, ROCE).to_record()
    assert verbs.Discovery.from_record(record) == found(IB, ROCE)
    assert verbs.Discovery.from_record(None).ports == ()


@pytest.mark.skipif(not HAS_PYVERBS, reason="pyverbs is not installed (scripts/install_pyverbs.sh installs it)")
def test_pyverbs_imports_and_finds_no_device_here():
    import pyverbs.enums

    assert verbs.enum("IBV_QPT_RC") == pyverbs.enums.IBV_QPT_RC
    assert verbs.enum("IBV_WR_RDMA_WRITE_WITH_IMM") == pyverbs.enums.IBV_WR_RDMA_WRITE_WITH_IMM
    result = verbs.discover()
    assert result.ports == () and "no RDMA devices" in result.why, result


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is visible; tests/hw covers it")
def test_gpu_memory_path_on_a_machine_without_gpu_is_staged():
    assert verbs.gpu_memory_path() == "staged"


@pytest.mark.skipif(not HAS_PYVERBS, reason="pyverbs is not installed (scripts/install_pyverbs.sh installs it)")
def test_roce_v2_gids_are_told_with_the_pyverbs_debian_ships():
    """Its GID types are in pyverbs.enums (v44); reading them from libibverbs_enums (v59 only)
    failed there and fell back to the table order, which usually gives RoCE v1."""
    import pyverbs.enums

    class Context:  # what _roce_v2 asks of a device context
        def query_gid_type(self, port, index):
            return [pyverbs.enums.IBV_GID_TYPE_SYSFS_IB_ROCE_V1, pyverbs.enums.IBV_GID_TYPE_SYSFS_ROCE_V2][index]

    assert [verbs._roce_v2(Context(), 1, index) for index in (0, 1)] == [False, True]


@pytest.mark.skipif(not HAS_PYVERBS, reason="pyverbs is not installed (scripts/install_pyverbs.sh installs it)")
@pytest.mark.parametrize("at", [0, 3 << 20])  # CUDA exports the range itself; HSA the whole allocation
def test_a_dmabuf_region_is_addressed_as_pyverbs_registers_it(monkeypatch, at):
    """pyverbs registers a dmabuf MR with iova = its offset in the dmabuf (rdma-core
    pyverbs/mr.pyx, v44 and later); the region was recorded with iova 0, so a write to a tensor
    of an allocation HSA exported whole went to the wrong place. FAKE MR class and export here
    (no GPU, no NIC)."""
    import os

    import pyverbs.mr
    import torch

    registered = {}

    class FakeDmaBufMR:
        lkey, rkey = 7, 8

        def __init__(self, pd, length, access, dmabuf=None, offset=0):
            registered.update(length=length, offset=offset, fd=dmabuf)

    start, size = 0x7F0000000000, 4 << 20
    monkeypatch.setattr(pyverbs.mr, "DmaBufMR", FakeDmaBufMR)
    monkeypatch.setattr(verbs, "_dmabuf_fd", lambda addr, length, index: (os.open(os.devnull, os.O_RDONLY), start,
                                                                           size, at))
    nic = object.__new__(verbs.PyverbsNic)
    nic.pd, nic._access, nic.name = None, 0, "fake"
    monkeypatch.setattr(nic, "memory_path", lambda device: "dmabuf", raising=False)
    region = nic.register(start + 4096, 1024, torch.device("cuda", 0))
    assert registered["offset"] == at and registered["length"] == size
    assert region.at(start + 4096) == at + 4096  # the NIC's address of the tensor's first byte


class _FakeDriver:
    """FAKE CUDA driver API (cuda-python's shapes): records which context calls were made."""

    def __init__(self, current: int) -> None:
        self.current, self.calls = current, []

    def cuCtxGetCurrent(self):
        return 0, self.current

    def cuDeviceGet(self, index):
        self.calls.append(("device", index))
        return 0, 100 + index

    def cuDevicePrimaryCtxRetain(self, device):
        self.calls.append(("retain", device))
        return 0, 555

    def cuCtxSetCurrent(self, context):
        self.calls.append(("set", context))
        self.current = context
        return (0,)


def test_the_dmabuf_export_makes_the_devices_primary_context_current_where_none_is():
    bare = _FakeDriver(current=0)  # a thread that never ran CUDA work
    verbs._make_context_current(bare, 1)
    assert bare.calls == [("device", 1), ("retain", 101), ("set", 555)] and bare.current == 555
    busy = _FakeDriver(current=42)
    verbs._make_context_current(busy, 0)
    assert busy.calls == []
