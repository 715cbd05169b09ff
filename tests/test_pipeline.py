"""torch.distributed.pipelining over backend "hetccl": PyTorch's own stages and schedules
with each stage on an island of its own (one spawned process per rank, islands from
HETCCL_ISLAND), against the same model in one process."""

from __future__ import annotations

import numpy as np
import pytest

from tests import pipeline_workers as pw
from tests import torch_workers as w


@pytest.mark.parametrize("schedule,bounds,microbatches", [
    ("gpipe", (0, 4, 6), 2), ("1f1b", (0, 4, 6), 5), ("gpipe", (0, 2, 3, 6), 2), ("1f1b", (0, 2, 3, 6), 5)])
def test_stages_on_islands_train_as_one_process(schedule, bounds, microbatches):
    """2 and 3 islands (stages of unequal layer counts), 2 and 5 microbatches of a batch of 10."""
    islands = [f"island{j}" for j in range(len(bounds) - 1)]
    results = w.run(pw.pipelined, islands, "hetccl", args=(bounds, schedule, microbatches))
    want_loss, want_grads = pw.reference(microbatches)
    np.testing.assert_allclose(results[-1]["loss"], want_loss, rtol=1e-5)
    got = [g for r in results for g in r["grads"]]
    assert len(got) == len(want_grads)
    for g, want in zip(got, want_grads):
        np.testing.assert_allclose(g.numpy(), want.numpy(), rtol=1e-5, atol=1e-7)


def test_microbatches_of_unequal_size_are_a_named_mismatch():
    """torch's schedules cut a batch of 10 into 4 microbatches of 3, 3, 2, 2 rows and size a
    stage's receive buffers from the first (Gloo fails too: 'The size of tensor a (3) must
    match the size of tensor b (2)'); over hetccl the receive names both sizes."""
    with pytest.raises(RuntimeError, match=r"expected Tag.* with 96 bytes from rank 0, got .* with 64 bytes"):
        w.run(pw.pipelined, ["island0", "island1"], "hetccl", args=((0, 4, 6), "gpipe", 4), timeout_s=120)


def test_moving_layers_between_steps_stays_exact():
    """Layers 2 and 3 move from stage 0 to stage 1 after the first step, then back and one
    more after the third: the weights after 4 SGD steps equal one process's."""
    steps, microbatches = 4, 2
    results = w.run(pw.trained, ["island0", "island1"], "hetccl",
                    args=((0, 4, 6), microbatches, steps, {1: (0, 2, 6), 3: (0, 5, 6)}))
    assert [r["layers"] for r in results] == [[0, 1, 2, 3, 4], [5]]
    got = [p for r in results for p in r["params"]]
    want = pw.reference_trained(microbatches, steps)
    assert len(got) == len(want)
    for g, ref in zip(got, want):
        np.testing.assert_allclose(g.numpy(), ref.numpy(), rtol=1e-5, atol=1e-7)


def test_the_split_is_planned_from_measured_speed():
    """A stage rank about twice as slow per layer gets a third of the layers or fewer, when
    planned and when re-planned from the even split."""
    results = w.run(pw.planned, ["fast", "slow"], "hetccl")
    assert results[0]["bounds"] == results[1]["bounds"]  # every rank planned the same split
    assert results[0]["bounds"][1] in (4, 5), results  # 6 layers: 4-5 on the fast stage, not 3
    assert results[0]["replanned"] and results[0]["after"][1] in (4, 5), results  # from the even split
