"""hetccl-bench: the pure parts alone, then short real sweeps (local, shaped) and the notebook."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import nbformat
import numpy as np
import pandas as pd
import pytest
import ray
from nbclient import NotebookClient
from ray._common.utils import get_ray_address_file

from hetccl_ray.tools import bench
from hetccl_ray.tools.local_cluster import island_names, parse_layout
from hetccl_ray.tools.shaped_cluster import ShapedCluster, ShapedClusterUnavailable, check_available
from hetccl_ray.core.topology import Topology

REPO = Path(__file__).resolve().parent.parent


def test_sizes_and_layouts():
    assert bench.sweep(8, 64, 2) == [8, 16, 32, 64]
    assert bench.parse_size("64K") == 65536 and bench.parse_size("128M") == 128 << 20
    assert parse_layout("2x2") == [2, 2] and parse_layout("1,2,3") == [1, 2, 3]
    assert island_names([2, 2]) == ["island0", "island0", "island1", "island1"]
    assert island_names([2, 2], interleave=True) == ["island0", "island1", "island0", "island1"]
    with pytest.raises(ValueError):
        parse_layout("0x2")


def test_ratio_range_tells_noise_from_a_difference():
    rng = np.random.default_rng(7)
    assert bench.ratio_range([2.0] * 9, [1.0] * 9) == (2.0, 2.0)
    twice = rng.normal(2.0, 0.1, 30), rng.normal(1.0, 0.05, 30)
    low, high = bench.ratio_range(*twice)
    assert 1.0 < low < 2.0 < high < 3.0  # a real 2x: the range holds it and not 1.0
    same = rng.lognormal(0, 0.5, 30), rng.lognormal(0, 0.5, 30)
    low, high = bench.ratio_range(*same)
    assert low < 1.0 < high  # one distribution: within the noise
    back = bench.ratio_range(*same[::-1])
    assert back == pytest.approx((1 / high, 1 / low), rel=0.05)


def test_bus_factors_follow_nccl_tests():
    assert bench.bus_factor("allreduce", 4) == 1.5
    assert bench.bus_factor("allgather", 4) == 0.75 and bench.bus_factor("broadcast", 4) == 1.0


def test_ring_model_of_gloo_border_bytes():
    contiguous = ["a", "a", "b", "b"]
    interleaved = ["a", "b", "a", "b"]
    s = 1 << 20
    assert bench.ring_border_bytes("allreduce", contiguous, s) == 2 * 1.5 * s   # 2 hops cross
    assert bench.ring_border_bytes("allreduce", interleaved, s) == 4 * 1.5 * s  # every hop crosses
    assert bench.hetccl_bound("allreduce", Topology.from_islands(contiguous), s) == 2 * s
    assert bench.ring_border_bytes("allreduce", ["a"] * 4, s) == 0


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    csv = tmp_path_factory.mktemp("bench") / "out.csv"
    frame = bench.main(["-o", "all", "-b", "1K", "-e", "64K", "-f", "8", "-n", "2", "-w", "1",
                        "--vs", "gloo", "--layout", "1,2", "--csv", str(csv), "--no-progress"])
    return frame, csv


def test_local_sweep_is_correct_and_meets_the_border_bound(local_run):
    frame, csv = local_run
    assert set(frame["op"]) == set(bench.OPS) and set(frame["backend"]) == {"hetccl", "gloo"}
    assert frame["wrong"].sum() == 0
    hetccl = frame[frame["backend"] == "hetccl"]
    flat = hetccl["plan"] == "flat"  # shared memory or Gloo over every rank: nothing crosses the border's sockets
    assert (hetccl["border_bytes"] == hetccl["border_bound"].where(~flat, 0)).all(), hetccl[["op", "size", "plan"]]
    assert (frame["hetccl_vs_gloo"] > 0).all()
    assert (0 < frame["hetccl_vs_gloo_low"]).all() and (frame["hetccl_vs_gloo_low"] <= frame["hetccl_vs_gloo_high"]).all()
    assert pd.read_csv(csv).shape == frame.shape


def test_the_device_mode_runs_every_path_on_the_emulated_device(capsys):
    """--device emu (the FAKE): buffers in emulated device memory, calls timed until the device
    is done, Ray's gloo on host copies, the staging bound measured; its numbers mean nothing."""
    frame = bench.main(["-o", "allreduce,allgather,sendrecv", "-b", "1K", "-e", "16K", "-f", "16", "-n", "2", "-w", "1",
                        "--vs", "gloo", "--layout", "1,1", "--device", "emu", "--no-progress"])
    assert frame["wrong"].sum() == 0 and set(frame["backend"]) == {"hetccl", "gloo"}
    assert (frame["staging_us"] > 0).all() and (frame["x_staging"] > 0).all()
    printed = capsys.readouterr().out
    assert "device emu" in printed and "staging" in printed and "border GPU memory staged" in printed


def test_table_has_nccl_tests_columns(local_run):
    table = bench.format_table(local_run[0])
    for column in ("size", "count", "type", "redop", "root", "algbw", "busbw", "#wrong", "gloo/hetccl", "90% range"):
        assert column in table
    cells = local_run[0].drop_duplicates(["op", "size"])
    under, beyond = (cells["hetccl_vs_gloo"] < 1).sum(), (cells["hetccl_vs_gloo_high"] < 1).sum()
    assert table.splitlines()[-1].startswith(f"# hetccl slower than gloo: {under} of {len(cells)} cells, beyond "
                                             f"the noise (90% range under 1.0) {beyond}")
    slow = local_run[0].copy()
    size = slow.loc[slow["op"] == "broadcast", "size"].min()
    slow.loc[(slow["op"] == "broadcast") & (slow["size"] == size), ["hetccl_vs_gloo", "hetccl_vs_gloo_high"]] = 0.6, 0.8
    assert f"; broadcast {size} B 0.60" in bench.format_table(slow).splitlines()[-1]  # a loss beyond the noise, named


def test_shaped_cluster_refuses_clearly_without_iproute2(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ShapedClusterUnavailable, match="iproute2"):
        check_available()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.mark.slow
def test_shaped_link_limits_the_border_and_cleans_up():
    try:
        check_available()
    except ShapedClusterUnavailable as why:
        pytest.skip(f"needs root and iproute2 network namespaces: {why}")
    islands = island_names([1, 1])
    pointer = get_ray_address_file(None)  # Ray's "current cluster" file: `ray start --head` writes it
    found = open(pointer).read() if os.path.exists(pointer) else None
    if found is not None:
        os.remove(pointer)
    cluster = ShapedCluster(islands, "200mbit")
    with cluster:
        assert open(pointer).read().strip() == cluster.address
        names = list(cluster.namespaces)
        assert all(name in _namespaces() for name in names)
        spec = bench.BenchSpec(["allreduce"], [4 << 20], iters=2, warmup=0, compress=("off",))  # the raw link
        frame = bench.run_sweep(cluster.workers(islands), islands, spec, progress=False)
    assert frame["wrong"].sum() == 0
    physical_s = (4 << 20) * 8 / 200e6   # S bytes each way over a 200 Mbit/s link
    assert frame["time_us"].iloc[0] / 1e6 >= 0.9 * physical_s
    assert not any(name in _namespaces() for name in names)
    assert not os.path.exists(pointer)  # as found: a plain ray.init() starts its own cluster
    try:
        ray.init(num_cpus=1)
        assert ray.get(ray.put(7)) == 7
    finally:
        ray.shutdown()
        if found is not None:
            with open(pointer, "w") as f:
                f.write(found)


def test_a_shaped_cluster_puts_back_the_current_cluster_it_found(tmp_path):
    """Ray's pointer is put back where the shaped cluster overwrote one, removed where there
    was none, and left alone where another cluster wrote it since."""
    from hetccl_ray.tools.shaped_cluster import restore_pointer

    pointer = tmp_path / "ray_current_cluster"
    pointer.write_text("10.213.5.1:6379")
    restore_pointer(str(pointer), "127.0.0.1:6379", "10.213.5.1:6379")
    assert pointer.read_text() == "127.0.0.1:6379"
    pointer.write_text("10.213.5.1:6379")
    restore_pointer(str(pointer), None, "10.213.5.1:6379")
    assert not pointer.exists()
    pointer.write_text("10.0.0.9:6379")  # another cluster's since
    restore_pointer(str(pointer), None, "10.213.5.1:6379")
    assert pointer.read_text() == "10.0.0.9:6379"


def test_on_a_delayed_border_both_rounds_are_right(monkeypatch):
    """2 ms each way between islands (tc netem): a small broadcast, checked, by the three-hop
    round and in one hop (HETCCL_ONE_HOP=1), every value right both ways. Which is faster is
    the bench's question, not a test's: both cross the border once (docs/design.md)."""
    try:
        check_available()
    except ShapedClusterUnavailable as why:
        pytest.skip(f"needs root and iproute2 network namespaces: {why}")
    islands = island_names([2, 2])
    cluster = ShapedCluster(islands, "1gbit", delay="2ms")
    try:
        cluster.__enter__()
    except RuntimeError as exc:
        if "qdisc kind is unknown" in str(exc):
            pytest.skip(f"needs the kernel's netem qdisc (sch_netem) to delay a link: {exc}")
        raise
    try:
        for one_hop in ("0", "1"):
            monkeypatch.setenv("HETCCL_ONE_HOP", one_hop)  # read where the group is made: here
            spec = bench.BenchSpec(["broadcast"], [1024], iters=3, warmup=1)
            frame = bench.run_sweep(cluster.workers(islands), islands, spec, progress=False)
            assert frame["wrong"].sum() == 0 and frame["plan"].iloc[0] == "round", one_hop
    finally:
        cluster.__exit__(None, None, None)


def _run_notebook(name: str, plot, monkeypatch, timeout_s: int = 120, **env: str) -> str:
    """Execute ``notebooks/<name>`` with its plot written to ``plot`` (and ``env`` set); check
    the plot was drawn; return what its second cell printed."""
    for key, value in {**env, "HETCCL_NB_PLOT": str(plot)}.items():
        monkeypatch.setenv(key, value)
    notebook = nbformat.read(REPO / "notebooks" / name, as_version=4)
    NotebookClient(notebook, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    assert plot.stat().st_size > 10_000
    return "".join(out.get("text", "") for out in notebook.cells[1].outputs)


@pytest.mark.slow
def test_notebook_runs(tmp_path, monkeypatch):
    # the unshaped run only: a shaped cluster is tested by test_shaped_link_limits_the_border_and_cleans_up
    _run_notebook("bandwidth.ipynb", tmp_path / "bw.png", monkeypatch, 600, HETCCL_NB_MAX="256K", HETCCL_NB_RATE="off")


def test_balance_notebook_plots_the_benchmark(tmp_path, monkeypatch):
    printed = _run_notebook("balanced.ipynb", tmp_path / "balance.png", monkeypatch)
    assert "slowed even" in printed and "slowed auto" in printed


def test_pipeline_notebook_plots_the_example(tmp_path, monkeypatch):
    printed = _run_notebook("pipeline.ipynb", tmp_path / "pipeline.png", monkeypatch)
    assert "speed: mean step" in printed and "even: mean step" in printed


def test_link_bounds_are_the_busiest_islands_bytes_over_the_rate():
    two, uneven = Topology.from_islands(["a", "a", "b", "b"]), Topology.from_islands(["a", "b", "b", "b"])
    s, rate = 12 << 20, 1e9
    seconds = lambda nbytes: nbytes * 8 / rate  # noqa: E731
    # 2x2: every pair moves half the buffer each way for the chunked ops, all of it for the others
    assert bench.link_seconds("allgather", two, s, rate) == seconds(s / 2)
    assert bench.link_seconds("reducescatter", two, s, rate) == seconds(s / 2)
    assert bench.link_seconds("allreduce", two, s, rate) == seconds(s)
    assert bench.link_seconds("broadcast", two, s, rate) == seconds(s)
    assert bench.link_seconds("alltoall", two, s, rate) == seconds(s)  # 4 cross blocks of s/4 each way
    # 1+3: island b's three chunks leave it in allgather; reduce brings all of it into rank 0's island
    assert bench.link_seconds("allgather", uneven, s, rate) == seconds(3 * s / 4)
    assert bench.link_seconds("reduce", uneven, s, rate, root=1) == seconds(s)
    assert bench.link_seconds("sendrecv", two, s, rate) is None
    assert bench.link_seconds("allreduce", Topology.from_islands(["a", "a"]), s, rate) is None
