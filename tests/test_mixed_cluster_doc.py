"""docs/kuberay-mixed.yaml parses and says what docs/mixed-cluster.md says it says."""

from __future__ import annotations

from pathlib import Path

import yaml

from hetccl_ray.core.topology import ACCELERATOR_LABEL, ISLAND_LABEL, island_for

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_kuberay_yaml_has_an_island_per_vendor():
    spec = yaml.safe_load((DOCS / "kuberay-mixed.yaml").read_text())
    assert spec["kind"] == "RayCluster" and spec["apiVersion"] == "ray.io/v1"
    ray_version = spec["spec"]["rayVersion"]
    assert spec["spec"]["headGroupSpec"]["resources"]["cpu"] == "0"
    groups = {g["groupName"]: g for g in spec["spec"]["workerGroupSpecs"]}
    plugin = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}
    assert set(groups) == set(plugin)
    for vendor, group in groups.items():
        labels = group["labels"]
        assert labels[ISLAND_LABEL] == vendor
        # without the island label, the accelerator label alone gives the same island to GPU ranks
        assert island_for(None, {ACCELERATOR_LABEL: labels[ACCELERATOR_LABEL]}, vendor) == vendor
        container = group["template"]["spec"]["containers"][0]
        assert f"ray{ray_version}" in container["image"] and "torch2.13" in container["image"]
        limits = container["resources"]["limits"]
        assert int(limits[plugin[vendor]]) >= 1
        assert any(key.startswith("rdma/") for key in limits)
    images = [g["template"]["spec"]["containers"][0]["image"] for g in groups.values()]
    assert "cu" in images[0].rsplit("-", 1)[-1] and "rocm" in images[1].rsplit("-", 1)[-1]


def test_guide_points_at_the_yaml_and_the_hardware_suite():
    guide = (DOCS / "mixed-cluster.md").read_text()
    assert "kuberay-mixed.yaml" in guide and "tests/hw/run.py" in guide
    assert "--labels=hetccl.io/island=amd" in guide
