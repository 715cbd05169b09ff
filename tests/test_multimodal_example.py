"""examples/train_multimodal_mixed.py through Ray Train's TorchTrainer: the encoder on one
island (data-parallel over two workers), the language model on the other, trained a few
steps; what crosses per step is the image embeddings and their gradient, counted, no more."""

from __future__ import annotations

import math

from examples import train_multimodal_mixed as example


def test_the_multimodal_example_trains_and_sends_activations_and_gradients_only():
    micro, size = 2, 4  # the encoder data-parallel over 2 ranks, the language model on 1 (fan-in)
    metrics = example.main(["--steps", "3", "--micro", str(micro), "--size", str(size), "--enc-depth", "2",
                            "--encoders", "2", "--lms", "1"])
    for step, _, loss, _, across in metrics["rows"]:
        patches = 8 + 4 * (step % 3)  # the patch count changes every step
        assert across == 2 * micro * size * patches * example.WIDTH * 4, (step, across)  # float32, there and back
        assert math.isfinite(loss) and loss > 0
