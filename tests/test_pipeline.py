"""torch.distributed.pipelining over backend "hetccl": PyTorch's own stages and schedules
with each stage on an island of its own (one spawned process per rank, islands from
HETCCL_ISLAND), against the same model in one process."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests import pipeline_workers as pw
from tests import torch_workers as w


@pytest.mark.parametrize("bounds,emulated", [((0, 4, 6), (1,)), ((0, 2, 3, 6), ())])
def test_stages_on_islands_train_as_one_process(bounds, emulated):
    """2 islands (the second stage's rank on the emulated device: its tensors are device
    memory, ordered on streams) and 3 islands (stages of unequal layer counts); GPipe with 2
    and 1F1B with 5 microbatches of a batch of 10, one after the other in the same
    processes. Then 4
    microbatches: torch's schedules cut 3, 3, 2, 2 rows and size a stage's receive buffers
    from the first (Gloo fails too: 'The size of tensor a (3) must match the size of tensor b
    (2)'); over hetccl the receive names both sizes."""
    islands = [f"island{j}" for j in range(len(bounds) - 1)]
    cases = [("gpipe", 2), ("1f1b", 5), ("gpipe", 4)]
    results = w.run(pw.pipelined, islands, "hetccl", args=(bounds, cases), emulated=emulated)
    for k, (schedule, microbatches) in enumerate(cases[:2]):
        want_loss, want_grads = pw.reference(microbatches)
        np.testing.assert_allclose(results[-1][k]["loss"], want_loss, rtol=1e-5, err_msg=schedule)
        got = [g for r in results for g in r[k]["grads"]]
        assert len(got) == len(want_grads)
        for g, want in zip(got, want_grads):
            np.testing.assert_allclose(g.numpy(), want.numpy(), rtol=1e-5, atol=1e-7, err_msg=schedule)
    assert re.search(r"expected Tag.* with 96 bytes from rank \d, got .* with 64 bytes", results[1][2]["error"]), \
        results[1][2]


def test_moving_layers_stays_exact_and_the_split_follows_measured_speed():
    """Layers 2 and 3 move from stage 0 to stage 1 after the first step, then back and one
    more after the third: the weights after 4 SGD steps equal one process's. Then a stage
    rank more than twice as slow per layer (5x the work beside a call's fixed cost; with 3x it
    read only 1.6x slower, and a CI run planned 3/3) gets a third of the layers or fewer, when
    planned and when re-planned from the even split; a re-plan with no sample is refused."""
    steps, microbatches = 4, 2
    results = w.run(pw.moved_and_planned, ["fast", "slow"], "hetccl",
                    args=(microbatches, steps, {1: (0, 2, 6), 3: (0, 5, 6)}))
    trained = [r["trained"] for r in results]
    assert [r["layers"] for r in trained] == [[0, 1, 2, 3, 4], [5]]
    got = [p for r in trained for p in r["params"]]
    want = pw.reference_trained(microbatches, steps)
    assert len(got) == len(want)
    for g, ref in zip(got, want):
        np.testing.assert_allclose(g.numpy(), ref.numpy(), rtol=1e-5, atol=1e-7)
    planned = [r["planned"] for r in results]
    assert planned[0]["bounds"] == planned[1]["bounds"]  # every rank planned the same split
    assert planned[0]["bounds"][1] in (4, 5), planned  # 6 layers: 4-5 on the fast stage, not 3
    assert planned[0]["replanned"] and planned[0]["after"][1] in (4, 5), planned  # from the even split
    assert all("Pipeline.replan measures each layer on a sample microbatch" in p["unsampled"] for p in planned)


def test_bf16_activations_and_gradients_cross_compressed(monkeypatch):
    """With the border compressing (``compress="on"``: on one host "auto" never does, a copy
    beats a codec there), bf16 activations and their gradients cross in at most 0.85 of their
    bytes (the codec is lossless: bit-exact in test_tcp and test_group)."""
    monkeypatch.setenv("HETCCL_COMPRESS", "on")
    results = w.run(pw.compressed, ["island0", "island1"], "hetccl")
    for rank, r in enumerate(results):
        assert r["payload"] >= 3 * 4 * 128 * 256 * 2, r  # every microbatch's activation (or gradient)
        assert r["wire"] <= 0.85 * r["payload"], (rank, r)
