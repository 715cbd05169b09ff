"""torch.distributed backend "hetccl": DDP and FSDP unchanged, every op they use, bad use."""

from __future__ import annotations

import datetime
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

import hetccl_ray
from hetccl_ray.doors.torch_backend import HetCCLProcessGroup
from tests import torch_workers as w

ISLANDS = ["cpu-a", "cpu-a", "cpu-b"]  # 2 islands, 2+1 ranks
TOL = dict(rtol=0, atol=1e-6)         # float32 sums in a different order


def test_registered():
    hetccl_ray.register()
    assert "hetccl" in dist.Backend.backend_list


def test_ddp_matches_single_process_and_gloo():
    hetccl = w.run(w.ddp, ISLANDS, "hetccl")
    gloo = w.run(w.ddp, ISLANDS, "gloo")
    reference = w.single_process_reference(len(ISLANDS))
    for rank in range(len(ISLANDS)):
        for ours, theirs, ref in zip(hetccl[rank], gloo[rank], reference):
            torch.testing.assert_close(ours, ref, **TOL)
            torch.testing.assert_close(ours, theirs, **TOL)


def test_ddp_with_an_island_on_the_emulated_device_matches_single_process():
    """The first island's ranks hold emulated device memory (late, stream-ordered work)."""
    hetccl = w.run(w.ddp, ISLANDS, "hetccl", emulated=(0, 1))
    reference = w.single_process_reference(len(ISLANDS))
    for rank in range(len(ISLANDS)):
        for ours, ref in zip(hetccl[rank], reference):
            torch.testing.assert_close(ours, ref, **TOL)


def test_work_wait_orders_the_stream_and_future_means_data_is_there():
    world = len(ISLANDS)
    results = w.run(w.stream_ordered, ISLANDS, "hetccl", emulated=(0, 1))
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["wait"], torch.full((6,), float(sum(range(1, world + 1)))))
        torch.testing.assert_close(out["future"], torch.full((6,), float(sum(range(10, 10 + world))) / world))
        expect = sum(torch.arange(world * 2, dtype=torch.float32) + r for r in range(world))[2 * rank:2 * rank + 2]
        torch.testing.assert_close(out["reduce_scatter_tensor"], expect)


def test_an_op_waits_for_its_callers_stream_at_the_call_and_wait_leaves_the_host_free():
    """Issue 43's torch backend: the entry event is recorded on the calling thread at the call
    (the op started after whatever the caller queued later, 3 s here), and ``Work.wait()`` makes
    the caller's stream wait without blocking the host (it blocked until the late rank came)."""
    world = len(ISLANDS)
    results = w.run(w.caller_stream_delayed, ISLANDS, "hetccl", emulated=(0, 1))
    for out in results:
        torch.testing.assert_close(out["x"], torch.full((6,), float(sum(range(1, world + 1)))))
        torch.testing.assert_close(out["y"], torch.full((6,), float(sum(range(10, 10 + world)))))
    for out in results[:2]:
        assert out["wait_s"] < 0.5, out  # the late rank calls 1.5 s in
        assert 1.0 < out["done_s"] < 2.8, out  # done once the late rank came, not after the 3 s
        assert out["read_s"] >= 3.0, out  # the read queued after the 3 s
        assert "stream is capturing a graph" in out["captured"]


def test_fsdp_matches_gloo():
    hetccl = w.run(w.fsdp, ISLANDS, "hetccl")
    gloo = w.run(w.fsdp, ISLANDS, "gloo")
    reference = w.single_process_reference(len(ISLANDS))
    for ours, theirs, ref in zip(hetccl[0], gloo[0], reference):
        torch.testing.assert_close(ours, theirs, **TOL)
        torch.testing.assert_close(ours, ref, **TOL)


def test_every_op_ddp_and_fsdp_use():
    world = len(ISLANDS)
    results = w.run(w.collectives, ISLANDS, "hetccl")
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["all_reduce"], torch.full((5,), 6.0))
        torch.testing.assert_close(out["avg"], torch.full((3,), 2.0))
        torch.testing.assert_close(out["broadcast"], torch.full((4,), 1.0))
        torch.testing.assert_close(out["all_gather_into_tensor"], torch.tensor([0., 0., 1., 1., 2., 2.]))
        torch.testing.assert_close(out["all_gather"], torch.tensor([0., 0., 10., 10., 20., 20.]))
        expect = sum(torch.arange(world * 2, dtype=torch.float32) + r for r in range(world))[2 * rank:2 * rank + 2]
        torch.testing.assert_close(out["reduce_scatter_tensor"], expect)
        assert out["async_ok"]
    torch.testing.assert_close(results[-1]["recv"], torch.full((2,), 42.0))
    torch.testing.assert_close(results[0]["subgroup"], torch.full((2,), 4.0))
    torch.testing.assert_close(results[-1]["subgroup"], torch.full((2,), 4.0))


def test_alltoall_gather_scatter_anysource_objects_match_numpy_and_gloo():
    world = len(ISLANDS)
    sizes = w.split_sizes(world)
    hetccl = w.run(w.exchanges, ISLANDS, "hetccl")
    gloo = w.run(w.exchanges, ISLANDS, "gloo")
    for rank in range(world):
        ours = hetccl[rank]
        even = np.array([w.value(src, rank, i) for src in range(world) for i in range(2)]).reshape(-1, 1)
        np.testing.assert_array_equal(ours["even"].numpy(), even)
        uneven = np.array([w.value(src, rank, i) for src in range(world) for i in range(sizes[src][rank] * 3)])
        np.testing.assert_array_equal(ours["uneven"].numpy().reshape(-1), uneven)
        lists = np.concatenate([np.full(sizes[src][rank], src * 10 + rank) for src in range(world)])
        np.testing.assert_array_equal(ours["lists"].numpy(), lists)
        np.testing.assert_array_equal(ours["scatter"].numpy(), np.full(3, rank * 7.0))
        assert ours["objects"] == [{"rank": r, "name": f"r{r}" * (r + 1)} for r in range(world)]
        assert ours["broadcast_objects"] == [{"root": "says hi"}, 3]
        for key in ours:
            if isinstance(ours[key], torch.Tensor) and key != "lists":
                torch.testing.assert_close(ours[key], gloo[rank][key], rtol=0, atol=0)
    np.testing.assert_array_equal(hetccl[1]["gather"].numpy(), np.repeat(np.arange(world) + 5.0, 2))
    assert hetccl[0]["senders"] == list(range(1, world))
    for src in range(1, world):
        np.testing.assert_array_equal(hetccl[0][f"from {src}"].numpy(), np.full(2, src * 11.0))


def test_no_store_is_a_clear_error():
    with pytest.raises(ValueError, match="needs the c10d store"):
        HetCCLProcessGroup(None, 0, 2, datetime.timedelta(seconds=5))


def test_without_ray_or_store_is_a_clear_error():
    with pytest.raises(hetccl_ray.HetCCLError, match="forms through Ray .* or through a torch.distributed store"):
        hetccl_ray.HetCCLGroup(2, 0, "nowhere")


def test_mismatched_world_size_is_a_clear_error():
    store = dist.HashStore()
    errors = {}

    def form(rank: int, world: int) -> None:
        try:
            hetccl_ray.HetCCLGroup(world, rank, "mismatch", store=store,
                                   options=hetccl_ray.GroupOptions(timeout_s=5))
        except hetccl_ray.HetCCLError as exc:
            errors[rank] = str(exc)

    threads = [threading.Thread(target=form, args=(0, 2)), threading.Thread(target=form, args=(1, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert "world_size 2 but ranks [1] have [3]" in errors[0]
    assert "rank 1 has world_size 3" in errors[1] or "did not arrive: [2]" in errors[1]
