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
