"""A small multimodal model split across two islands with a boundary communicator, trained
through Ray Train's TorchTrainer over the hetccl backend.

    python examples/train_multimodal_mixed.py                  # 2 workers: vision island, language island
    python examples/train_multimodal_mixed.py --compare        # also time the same steps without overlap
    python examples/train_multimodal_mixed.py --encoders 2 --lms 1   # each module its own data-parallel degree

A patch encoder (over synthetic images whose patch count changes every step) runs on the
``vision`` island, a small transformer over synthetic tokens (whose length changes too), the
image embeddings prepended, on the ``language`` island. ``hetccl_ray.features.bridge.Bridge`` moves
the embeddings across and their gradient back, microbatch by microbatch: the encoder
computes microbatch i+1 while the language model computes microbatch i. Prints the loss,
the step time and the bytes that crossed; ``--compare`` alternates steps with a schedule
without overlap (encoder, then language model, then encoder backward) and prints the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

import ray.train
import torch
import torch.distributed as dist
from torch import nn

import hetccl_ray
from hetccl_ray.features.bridge import Bridge, Layout
from hetccl_ray.doors.train import labelled_trainer
from hetccl_ray.tools.local_cluster import LocalCluster

ISLANDS = ["vision", "language"]  # the encoder's ranks first, then the language model's
WIDTH, PATCH, VOCAB = 192, 48, 64


def encoder(depth: int) -> nn.Module:
    layers = [nn.Linear(PATCH, WIDTH)]
    for _ in range(depth):
        layers += [nn.GELU(), nn.Linear(WIDTH, WIDTH)]
    return nn.Sequential(*layers)


class LanguageModel(nn.Module):
    """Token embeddings after the image embeddings, a small transformer, next-token loss on text."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=2 * WIDTH, batch_first=True)
        self.body = nn.TransformerEncoder(layer, depth)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.cat([images, self.embed(tokens[:, :-1])], dim=1)
        logits = self.head(self.body(x))[:, images.shape[1]:]
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def batch(step: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (patches change with the step) and tokens (length changes too) that depend on them."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    patches, length = 8 + 4 * (step % 3), 12 + 2 * (step % 4)
    images = torch.randn(size, patches, PATCH, generator=g)
    start = (images.mean(dim=(1, 2)) * 40).long() % VOCAB
    tokens = (start[:, None] + torch.arange(length)[None, :] * (1 + start[:, None] % 3)) % VOCAB
    return images, tokens


def train_loop(config: dict) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(config["threads"])  # islands stand for devices that compute side by side
    rank, encoders, world = dist.get_rank(), config["encoders"], dist.get_world_size()
    vision = rank < encoders
    model = encoder(config["enc_depth"]) if vision else LanguageModel(config["lm_depth"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    group = hetccl_ray.get_torch_group()
    # each module data-parallel over its own ranks: its own degree, its own gradient average
    module_groups = [dist.new_group(list(range(encoders))), dist.new_group(list(range(encoders, world)))]
    bridge = Bridge(group, Layout(tuple(range(encoders))), Layout(tuple(range(encoders, world))),
                    name="vision->language")
    schedules = ["overlap", "sequential"] if config["compare"] else ["overlap"]
    times: dict[str, list[float]] = {s: [] for s in schedules}
    rows = []
    for step in range(config["steps"]):
        schedule = schedules[step % len(schedules)]
        dist.barrier()
        started = time.perf_counter()
        before = group.direct.border.bytes_sent
        shapes_of = step // len(schedules)  # compared steps share their shapes and data
        loss = run_step(model, bridge, shapes_of, config, vision, schedule == "sequential")
        sum_gradients(model, module_groups[0 if vision else 1])
        opt.step()
        opt.zero_grad()
        bridge.flush()
        elapsed = time.perf_counter() - started
        stats = torch.tensor([loss, float(group.direct.border.bytes_sent - before)])
        dist.all_reduce(stats)  # the language model's mean loss, the bytes every rank sent across
        if step >= len(schedules):  # the first round warms up
            times[schedule].append(elapsed)
        rows.append((step, schedule, stats[0].item(), elapsed * 1e3, int(stats[1].item())))
    bridge.close()
    medians = {s: statistics.median(t) if t else 0.0 for s, t in times.items()}
    metrics = {"rows": rows, "ms": {s: m * 1e3 for s, m in medians.items()},
               "overlap/sequential": medians["overlap"] / medians["sequential"] if config["compare"] else None}
    with tempfile.TemporaryDirectory() as folder:  # Ray Train keeps the metrics of a report with a checkpoint
        if rank == 0:
            torch.save(model.state_dict(), f"{folder}/encoder.pt")
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder) if rank == 0 else None)


def sum_gradients(model: nn.Module, module_group: Any) -> None:
    """Data parallelism inside a module: each rank's loss is its share of the global mean, so
    the module's gradient is the sum of its ranks' (one flat all-reduce)."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=module_group)
    torch.nn.utils.vector_to_parameters(flat, grads)


def run_step(model: nn.Module, bridge: Bridge, step: int, config: dict, vision: bool, sequential: bool) -> float:
    """One step of ``config["micro"]`` microbatches; returns this rank's share of the language
    model's mean loss (0 on encoders). Encoder rank i takes chunk i of each microbatch; a
    language-model rank takes the tokens of the rows the bridge hands it."""
    total, encoders = 0.0, config["encoders"]
    counts = [len(c) for c in torch.arange(config["size"]).tensor_split(encoders)]
    if vision:
        mine = torch.arange(config["size"]).tensor_split(encoders)[dist.get_rank()]
        anchors = [bridge(model(batch(step, m, config["size"])[0][mine])) for m in range(config["micro"])]
        if sequential:
            dist.barrier()  # the language model runs all of its microbatches now
            dist.barrier()
        for anchor in anchors:
            anchor.backward()
        return total
    if sequential:
        dist.barrier()  # after the encoder's forward passes
    rows = bridge.rows(counts)
    for m in range(config["micro"]):
        images = bridge(None)
        loss = model(images, batch(step, m, config["size"])[1][rows]) / config["micro"] * len(rows) / config["size"]
        loss.backward()
        total += loss.item()
    if sequential:
        bridge.flush()
        dist.barrier()
    return total


def main(argv: Optional[Sequence[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--micro", type=int, default=4, help="microbatches per step")
    parser.add_argument("--size", type=int, default=32, help="samples per microbatch")
    parser.add_argument("--enc-depth", type=int, default=24)
    parser.add_argument("--lm-depth", type=int, default=1)
    parser.add_argument("--compare", action="store_true", help="alternate with steps without overlap")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker (this VM: 2 cores)")
    parser.add_argument("--encoders", type=int, default=1, help="data-parallel degree of the encoder (vision island)")
    parser.add_argument("--lms", type=int, default=1, help="data-parallel degree of the language model")
    args = parser.parse_args(argv)
    config = {"steps": args.steps, "micro": args.micro, "size": args.size, "enc_depth": args.enc_depth,
              "lm_depth": args.lm_depth, "compare": args.compare, "threads": args.threads, "encoders": args.encoders}
    islands = ["vision"] * args.encoders + ["language"] * args.lms
    with LocalCluster(ISLANDS):
        result = labelled_trainer(train_loop, islands, config).fit()
    metrics = result.metrics
    for step, schedule, loss, ms, across in metrics["rows"]:
        print(f"step {step:3d} {schedule:>10}  loss {loss:.4f}  {ms:7.1f} ms  {across} bytes across")
    print("median step ms:", {k: round(v, 1) for k, v in metrics["ms"].items()})
    if args.compare:
        print(f"overlap / sequential step time: {metrics['overlap/sequential']:.2f}")
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
