"""Bad input raises the exception classes Ray's own backends raise (a drop-in for "gloo").

Each case runs through ``ray.util.collective`` on two islands with interleaved ranks, once
on a hetccl group and once on Ray's own gloo group over the same actors: hetccl's error
must be an instance of every class Ray's raised (its reference), keep its own message, and
stay a ``ValueError``/``TypeError`` where it was one before.
"""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from ray.util import collective as col

import hetccl_ray
from tests import cluster as test_cluster

BASES = (RuntimeError, ValueError, TypeError)


@pytest.fixture(scope="module")
def actors():
    cluster, by_island = test_cluster.start({"a": 2, "b": 2})
    ranks = [by_island["a"][0], by_island["b"][0], by_island["a"][1], by_island["b"][1]]  # interleaved
    hetccl_ray.create_collective_group(ranks, 4, list(range(4)), group_name="het", timeout_s=60)
    col.create_collective_group(ranks, 4, list(range(4)), backend="gloo", group_name="ray-gloo")
    yield ranks
    test_cluster.stop(cluster)


def _cases(name: str, world: int) -> dict:
    """Bad calls, each as Ray users write them."""
    x = torch.zeros(10)
    return {
        "allgather: outputs of 20 elements": lambda: col.allgather([torch.zeros(20) for _ in range(world)], x,
                                                                   group_name=name),
        "allgather: outputs of shape [10, 20]": lambda: col.allgather([torch.zeros(10, 20) for _ in range(world)],
                                                                      x, group_name=name),
        "allgather: output list one short": lambda: col.allgather([torch.zeros(10)] * (world - 1), x,
                                                                  group_name=name),
        "reducescatter: inputs of 20 elements": lambda: col.reducescatter(x, [torch.zeros(20)] * world,
                                                                          group_name=name),
        "reducescatter: output of 20 elements": lambda: col.reducescatter(torch.zeros(20), [x] * world,
                                                                          group_name=name),
        "allreduce: complex dtype": lambda: col.allreduce(torch.zeros(2, dtype=torch.complex64), group_name=name),
    }


def _classes(name: str, rank: int, world: int) -> dict:
    """In one actor: for each case, which of the base classes its error is, and its text."""
    out = {}
    for what, call in _cases(name, world).items():
        try:
            call()
            out[what] = None
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out[what] = ([base.__name__ for base in BASES if isinstance(exc, base)], type(exc).__name__, str(exc))
    col.barrier(group_name=name)  # refused input leaves the group usable
    x = np.full(3, rank + 1.0, dtype=np.float32)
    col.allreduce(x, group_name=name)
    out["after"] = x.tolist()
    return out


def test_bad_input_raises_what_ray_gloo_raises(actors):
    het = ray.get([a.call.remote(_classes, "het", r, 4) for r, a in enumerate(actors)], timeout=300)
    ray_gloo = ray.get([a.call.remote(_classes, "ray-gloo", r, 4) for r, a in enumerate(actors)], timeout=300)
    texts = {
        "allgather: outputs of 20 elements": "with 20 elements; expected torch.float32 on cpu with 10",
        "allgather: outputs of shape [10, 20]": "with 200 elements; expected torch.float32 on cpu with 10",
        "allgather: output list one short": "must be equal to world_size",  # Ray's own check, before the group
        "reducescatter: inputs of 20 elements": "with 20 elements; expected torch.float32 on cpu with 10",
        "reducescatter: output of 20 elements": "with 10 elements; expected torch.float32 on cpu with 20",
        "allreduce: complex dtype": "unsupported dtype torch.complex64",
    }
    for rank in range(4):
        assert het[rank]["after"] == [10.0] * 3 and ray_gloo[rank]["after"] == [10.0] * 3
        for what, text in texts.items():
            assert het[rank][what] is not None, what
            bases, cls, message = het[rank][what]
            assert text in message, (what, message)
            assert "RuntimeError" in bases, (what, cls)
            reference = ray_gloo[rank][what]
            if reference is not None:  # Ray's gloo refused it too: hetccl is every class it was
                assert set(reference[0]) <= set(bases), (what, bases, reference)
    assert "ValueError" in het[0]["allgather: outputs of 20 elements"][0]  # still what it was
    assert {"TypeError", "ValueError"} <= set(het[0]["allreduce: complex dtype"][0])


def test_group_level_refusals_are_runtime_errors(actors):
    def refusals(name, rank, world):
        from ray.util.collective.types import BroadcastOptions, SendOptions

        group = hetccl_ray.get_group(name)
        root = BroadcastOptions()
        root.root_rank = world
        to_self = SendOptions()
        to_self.dst_rank = rank
        cases = {"root out of range": lambda: group.broadcast([torch.zeros(2)], root),
                 "send to itself": lambda: group.send([torch.zeros(2)], to_self),
                 "two tensors": lambda: group.allreduce([torch.zeros(2), torch.zeros(2)]),
                 "not a tensor": lambda: group.allreduce([[1.0, 2.0]])}
        out = {}
        for what, call in cases.items():
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                out[what] = (isinstance(exc, RuntimeError), isinstance(exc, ValueError), str(exc))
        return out

    got = ray.get(actors[0].call.remote(refusals, "het", 0, 4), timeout=60)
    assert got["root out of range"][:2] == (True, True)
    assert "broadcast root 4 is not a rank" in got["root out of range"][2]
    assert got["send to itself"][:2] == (True, True) and "cannot send to itself" in got["send to itself"][2]
    assert got["two tensors"][:2] == (True, True) and "takes one tensor per rank" in got["two tensors"][2]
    assert got["not a tensor"][:2] == (True, True) and "unsupported tensor type list" in got["not a tensor"][2]
