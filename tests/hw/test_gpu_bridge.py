"""(e) Boundary communicators with a GPU module: the encoder on a GPU island and the language
model on a CPU island, and the reverse, trained a few steps against one process. Skips,
naming what is missing, without a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch

import hetccl_ray
from hetccl_ray.features.bridge import Bridge, Layout
from hetccl_ray.tools.local_cluster import LocalCluster
from tests.hw.ops import NEEDS_GPU
from tests.test_bridge import images, loss_of, models, reference

pytestmark = NEEDS_GPU

STEPS, LR = 3, 0.1


def gpu_step(encoder_rank: int, weights: dict, step: int) -> dict:
    """Rank ``encoder_rank`` runs the encoder, the other the language model; rank 0 on the GPU."""
    group = hetccl_ray.get_group("hw-bridge")
    rank = group.rank
    device = "cuda" if rank == 0 else "cpu"
    lm_rank = 1 - encoder_rank
    cache = globals().setdefault("_bridges", {})
    bridge = cache.setdefault(encoder_rank, Bridge(group, Layout((encoder_rank,)), Layout((lm_rank,)),
                                                   name=f"enc{encoder_rank}", device=device))
    enc, lm = (m.to(device) for m in models(weights))
    (chunk,) = images(1, step)
    total = chunk.numel() // 8 * 5
    loss = torch.zeros(())
    if rank == encoder_rank:
        bridge(enc(chunk.to(device))).backward()
    else:
        loss = loss_of(lm(bridge(None)), total)
        loss.backward()
    bridge.flush()
    grads = {f"{name}.{k}": (p.grad if p.grad is not None else torch.zeros_like(p)).cpu()
             for name, m in (("enc", enc), ("lm", lm)) for k, p in m.named_parameters()}
    return {"loss": loss.item(), "grads": grads}


@pytest.mark.parametrize("encoder_rank", [0, 1], ids=["encoder-on-gpu", "language-model-on-gpu"])
def test_a_gpu_module_trains_through_the_bridge_as_one_process(encoder_rank):
    with LocalCluster(["gpu", "cpu"], gpus={"gpu": 1}) as cluster:
        actors = cluster.workers(["gpu", "cpu"])
        hetccl_ray.create_collective_group(actors, 2, [0, 1], group_name="hw-bridge", timeout_s=120)
        enc, lm = models()
        weights = {"enc": enc.state_dict(), "lm": lm.state_dict()}
        for step in range(STEPS):
            results = ray.get([a.call.remote(gpu_step, encoder_rank, weights, step) for a in actors], timeout=300)
            want_loss, want_grads = reference(weights, 1, step)
            np.testing.assert_allclose(sum(r["loss"] for r in results), want_loss, rtol=1e-4)
            for key, want in want_grads.items():
                got = sum(r["grads"][key] for r in results)
                np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-6, err_msg=key)
            weights = {name: {k: v - LR * want_grads[f"{name}.{k}"] for k, v in weights[name].items()}
                       for name in ("enc", "lm")}
