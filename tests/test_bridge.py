"""Boundary communicators (hetccl_ray/features/bridge.py): routes alone, then an encoder and a language
model on a real labelled local cluster, colocated and not, with batch and sequence lengths
that change every step, against the same model trained in one process."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest
import ray
import torch

import hetccl_ray
from hetccl_ray.features.bridge import SEQUENCE, Bridge, Layout, routes, rows_held
from hetccl_ray.errors import HetCCLInputError
from tests import cluster as test_cluster

GROUP = "bridge"
ISLANDS = ["enc", "enc", "lm", "lm"]  # ranks 0-1 on the encoder's island, 2-3 on the language model's
STEPS, LR = 3, 0.1

PLACEMENTS = {
    "equal": (Layout((0, 1)), Layout((2, 3))),
    "fan-in to replicas": (Layout((0, 1)), Layout((2, 3), dp=1)),
    "fan-out": (Layout((0,)), Layout((2, 3))),
    "sequence": (Layout((0, 1)), Layout((2, 3), dp=1, split=SEQUENCE)),
    "colocated fan-in": (Layout((0, 1, 2, 3)), Layout((0, 1, 2, 3), dp=2)),
    "colocated fan-out": (Layout((0, 1, 2, 3), dp=2), Layout((0, 1, 2, 3))),
    "colocated equal": (Layout((0, 1, 2, 3)), Layout((0, 1, 2, 3))),
}


# -- routes alone ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(PLACEMENTS))
def test_each_piece_crosses_into_each_island_once(case):
    src, dst = PLACEMENTS[case]
    found = routes(src, dst, ISLANDS)
    crossings = {}
    for hop in found.hops:
        if ISLANDS[hop.src] != ISLANDS[hop.dst]:
            key = (hop.item.source, hop.item.part, hop.item.chunk, ISLANDS[hop.dst])
            crossings[key] = crossings.get(key, 0) + 1
    assert all(n == 1 for n in crossings.values()), crossings
    if case.startswith("colocated"):
        assert not crossings  # these layouts keep every chunk on its island


def test_a_replicated_destination_takes_a_piece_once_per_island_and_hands_it_on():
    found = routes(Layout((0,)), Layout((1, 2, 3), dp=1), ["a", "b", "b", "b"])
    assert [(h.src, h.dst) for h in found.hops] == [(0, 1), (1, 2), (1, 3)]


@pytest.mark.parametrize("src,dst,want", [
    (Layout((0, 1)), Layout((2,)), {2: [0, 1, 2, 3, 4]}),                    # fan-in
    (Layout((0,)), Layout((2, 3)), {2: [0, 1, 2], 3: [3, 4]}),               # fan-out (tensor_split)
    (Layout((0, 1)), Layout((2, 3), dp=1, split=SEQUENCE), {2: [0, 1, 2, 3, 4], 3: [0, 1, 2, 3, 4]}),
])
def test_a_destination_knows_which_rows_it_holds(src, dst, want):
    counts = [5] if src.dp == 1 else [3, 2]
    found = routes(src, dst, ISLANDS)
    assert {rank: rows_held(found.items[rank], counts) for rank in want} == want


@pytest.mark.parametrize("src,dst,message", [
    (Layout((0, 1, 2)), Layout((3, 0)), "divide one another"),
    (Layout((0, 1)), Layout((1, 2)), "in both layouts but not every rank"),
    (Layout((0, 1), split=SEQUENCE), Layout((2, 3)), "sequence split is for destinations"),
    (Layout((0, 1)), Layout((2, 7)), "not in the group"),
])
def test_layouts_no_route_serves_are_refused(src, dst, message):
    with pytest.raises(HetCCLInputError, match=message):
        routes(src, dst, ISLANDS)


def test_a_layout_that_cannot_split_is_refused():
    with pytest.raises(HetCCLInputError, match="equal data-parallel groups"):
        Layout((0, 1, 2), dp=2)


# -- on a cluster, against one process ----------------------------------------------------------

def models(weights: Optional[dict] = None) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    enc = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh())
    lm = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh())
    if weights is not None:
        enc.load_state_dict(weights["enc"])
        lm.load_state_dict(weights["lm"])
    return enc, lm


def rows_of(groups: int, step: int) -> list[int]:
    """Images per encoder data-parallel group: they change every step."""
    return [1 + (step + g) % 3 for g in range(groups)]


def images(groups: int, step: int) -> list[torch.Tensor]:
    length = 3 + step % 3  # tokens per image: changes every step
    g = torch.Generator().manual_seed(step)
    return [torch.randn(n, length, 8, generator=g) for n in rows_of(groups, step)]


def loss_of(out: torch.Tensor, total: int) -> torch.Tensor:
    return (out ** 2).sum() / total


def gradients(enc: torch.nn.Module, lm: torch.nn.Module) -> dict:
    """Every parameter's gradient on this rank, by name (zeros where none reached it)."""
    return {f"{name}.{k}": p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            for name, m in (("enc", enc), ("lm", lm)) for k, p in m.named_parameters()}


def bridge_step(case: str, weights: dict, step: int) -> dict:
    """One rank's step: encoder on its chunk, the bridge, the language model on its part."""
    src, dst = PLACEMENTS[case]
    group = hetccl_ray.get_group(GROUP)
    cache = globals().setdefault("_bridges", {})
    bridge = cache.setdefault(case, Bridge(group, src, dst, name=case))
    enc, lm = models(weights)
    chunks = images(src.dp, step)
    total = sum(c.numel() for c in chunks) // 8 * 5
    here_src, here_dst = src.place(group.rank), dst.place(group.rank)
    x = enc(chunks[here_src[0]]) if here_src else None
    before = group.direct.border.bytes_sent
    loss = torch.zeros(())
    if here_src is None and here_dst is None:  # a rank of neither module (fan-out from one rank)
        pass
    elif here_dst:
        out = bridge(x)
        scale = 1 if dst.split == SEQUENCE else dst.members  # replicas each count their chunk
        loss = loss_of(lm(out), total) / scale
        loss.backward()
    else:
        bridge(x).backward()  # a source rank: its anchor waits for the gradient
    bridge.flush()
    grads = gradients(enc, lm)
    return {"loss": loss.item(), "grads": grads, "sent": group.direct.border.bytes_sent - before}


def reference(weights: dict, groups: int, step: int) -> tuple[float, dict]:
    enc, lm = models(weights)
    x = torch.cat(images(groups, step), dim=0)
    loss = loss_of(lm(enc(x)), x.numel() // 8 * 5)
    loss.backward()
    return loss.item(), {f"{name}.{k}": p.grad for name, m in (("enc", enc), ("lm", lm))
                         for k, p in m.named_parameters()}


@pytest.fixture(scope="module")
def ranks():
    cluster, actors = test_cluster.start({"enc": 2, "lm": 2})
    members = actors["enc"] + actors["lm"]
    hetccl_ray.create_collective_group(members, 4, [0, 1, 2, 3], group_name=GROUP, timeout_s=60,
                                       small_bytes=1 << 16, flat="off")
    yield members
    test_cluster.stop(cluster)


@pytest.mark.parametrize("case", list(PLACEMENTS))
def test_training_through_the_bridge_equals_one_process(ranks, case):
    src, dst = PLACEMENTS[case]
    enc, lm = models()
    weights = {"enc": enc.state_dict(), "lm": lm.state_dict()}
    for step in range(STEPS):
        results = ray.get([a.call.remote(bridge_step, case, weights, step) for a in ranks], timeout=120)
        want_loss, want_grads = reference(weights, src.dp, step)
        np.testing.assert_allclose(sum(r["loss"] for r in results), want_loss, rtol=1e-5)
        for key, want in want_grads.items():
            got = sum(r["grads"][key] for r in results)
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-7, err_msg=f"{case}: {key}")
        assert want_grads["enc.0.weight"].abs().sum() > 0  # gradients reached the encoder
        activations = sum(c.numel() for c in images(src.dp, step)) // 8 * 6 * 4  # float32 embeddings
        crossing = sum(r["sent"] for r in results)
        assert crossing == (0 if case.startswith("colocated") else 2 * activations), crossing  # there and back
        weights = {name: {k: v - LR * want_grads[f"{name}.{k}"] for k, v in weights[name].items()}
                   for name in ("enc", "lm")}


# -- backward in any order ------------------------------------------------------------------------

MICRO = 3  # microbatches per step


def _in_order(order: str, n: int, rank: int) -> list[int]:
    """The order a rank backpropagates its ``n`` microbatches in (each rank its own shuffle)."""
    if order == "reversed":
        return list(range(n))[::-1]
    if order == "by rank":  # even ranks in forward order, odd ones reversed
        return list(range(n))[::1 - 2 * (rank % 2)]
    if order == "shuffled":
        return torch.randperm(n, generator=torch.Generator().manual_seed(rank + 1)).tolist()
    return list(range(n))


def microbatch_step(case: str, weights: dict, step: int, orders: dict) -> dict:
    """One rank's step of MICRO microbatches; destination ranks backpropagate them in
    ``orders["dst"]`` ("sum": one backward of the summed losses, autograd's own order, last
    call first), source ranks their anchors in ``orders["src"]``."""
    src, dst = PLACEMENTS[case]
    group = hetccl_ray.get_group(orders.get("group", GROUP))
    cache = globals().setdefault("_bridges", {})
    bridge = cache.setdefault(("micro", case, group.group_name), Bridge(group, src, dst, name=f"micro {case}"))
    enc, lm = models(weights)
    here_src, here_dst = src.place(group.rank), dst.place(group.rank)
    before, outs = group.direct.border.bytes_sent, []
    for m in range(MICRO if here_src or here_dst else 0):  # a rank of neither module (fan-out) waits
        chunks = images(src.dp, step * MICRO + m)
        total = sum(c.numel() for c in chunks) // 8 * 5
        out = bridge(enc(chunks[here_src[0]]) if here_src else None)
        scale = 1 if dst.split == SEQUENCE else dst.members
        outs.append(loss_of(lm(out), total) / scale if here_dst else out)
    order = orders["dst" if here_dst else "src"]
    if order == "sum" and outs:
        sum(outs).backward()
    else:
        for m in _in_order(order, len(outs), group.rank):
            outs[m].backward()
    bridge.flush()
    grads = gradients(enc, lm)
    return {"loss": sum(outs).item() if here_dst else 0.0, "grads": grads,
            "sent": group.direct.border.bytes_sent - before}


@pytest.mark.parametrize("case,dst_order,src_order", [
    (case, *orders) for case in PLACEMENTS for orders in (
        # colocated ranks are both ends: one order on all of them (reversed, or autograd's own)
        [("sum", "sum"), ("reversed", "reversed")] if case.startswith("colocated")
        # each destination rank its own shuffle (a landing rank and its replica disagree), or all reversed
        else [("sum", "shuffled"), ("shuffled", "reversed")])])
def test_backward_may_run_in_any_order_on_either_side(ranks, case, dst_order, src_order):
    """``sum(losses).backward()`` on the destination (autograd runs the last call's node
    first) and anchors in any order on the source give the one-process gradients, with the
    same bytes across."""
    src, dst = PLACEMENTS[case]
    enc, lm = models()
    weights = {"enc": enc.state_dict(), "lm": lm.state_dict()}
    for step in range(2):
        results = ray.get([a.call.remote(microbatch_step, case, weights, step, {"dst": dst_order, "src": src_order})
                           for a in ranks], timeout=120)
        want_loss, want_grads = 0.0, {}
        for m in range(MICRO):
            loss, grads = reference(weights, src.dp, step * MICRO + m)
            want_loss += loss
            want_grads = {k: want_grads.get(k, 0) + g for k, g in grads.items()}
        np.testing.assert_allclose(sum(r["loss"] for r in results), want_loss, rtol=1e-5)
        for key, want in want_grads.items():
            got = sum(r["grads"][key] for r in results)
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-7, err_msg=f"{case}: {key}")
        if not case.startswith("colocated"):  # activations there and their gradients back, nothing more
            activations = sum(sum(c.numel() for c in images(src.dp, step * MICRO + m)) // 8 * 6 * 4
                              for m in range(MICRO))
            assert sum(r["sent"] for r in results) == 2 * activations
        weights = {name: {k: v - LR * want_grads[f"{name}.{k}"] for k, v in weights[name].items()}
                   for name in ("enc", "lm")}


def test_a_rank_that_is_both_ends_and_disagrees_on_the_order_is_told_the_rule(ranks):
    """Colocated ranks whose backward orders differ wait for each other (each is inside one
    call's node): the deadline's error names the rule and both orders seen."""
    hetccl_ray.create_collective_group(ranks, 4, [0, 1, 2, 3], group_name="bridge-short", timeout_s=3, flat="off")
    orders = {"dst": "by rank", "src": "by rank", "group": "bridge-short"}
    with pytest.raises(ray.exceptions.RayTaskError) as caught:
        ray.get([a.call.remote(microbatch_step, "colocated fan-in", {"enc": models()[0].state_dict(),
                                                                     "lm": models()[1].state_dict()}, 0, orders)
                 for a in ranks], timeout=120)
    message = str(caught.value)
    assert "a rank at both ends of a bridge waits inside one call's backward" in message, message
    assert "asked for gradients of calls [1]" in message or "asked for gradients of calls [3]" in message, message
