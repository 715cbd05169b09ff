"""Options are validated once, where they are made: the group's (shipped from the driver)
and each rank's own process environment (island, RDMA device and GID entry)."""

import pytest

from hetccl_ray.group.options import GroupOptions, ProcessOptions


@pytest.mark.parametrize("kwargs, match", [
    ({"timeout_s": 0}, "timeout_s must be > 0"),
    ({"piece_bytes": 0}, "piece_bytes must be >= 1"),
    ({"transport": "udp"}, "transport must be one of"),
    ({"compress": "max"}, "compress must be one of"),
    ({"flat": "sometimes"}, "flat must be one of"),
])
def test_group_options_refuse_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GroupOptions(**kwargs)


def test_group_options_round_trip():
    options = GroupOptions(islands={"1": "amd"}, flat="off", max_lanes=2, one_hop=True)
    assert GroupOptions.from_json(options.to_json()) == options
    assert options.islands == {1: "amd"}


def test_process_options_from_the_environment(monkeypatch):
    monkeypatch.setenv("HETCCL_ISLAND", "mi300")
    monkeypatch.setenv("HETCCL_RDMA_DEVICES", "mlx5_0, mlx5_1")
    monkeypatch.setenv("HETCCL_RDMA_GID_INDEX", "3")
    assert ProcessOptions.from_env() == ProcessOptions("mi300", ("mlx5_0", "mlx5_1"), 3)
    monkeypatch.setenv("HETCCL_RDMA_GID_INDEX", "three")
    with pytest.raises(ValueError, match="HETCCL_RDMA_GID_INDEX must be an integer, got 'three'"):
        ProcessOptions.from_env()
    monkeypatch.setenv("HETCCL_RDMA_GID_INDEX", "-1")
    with pytest.raises(ValueError, match="must be >= 0"):
        ProcessOptions.from_env()
    monkeypatch.delenv("HETCCL_RDMA_GID_INDEX")
    monkeypatch.setenv("HETCCL_ISLAND", " mi300")
    with pytest.raises(ValueError, match="HETCCL_ISLAND must be a name"):
        ProcessOptions.from_env()
