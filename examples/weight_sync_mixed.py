"""Weight sync for RL on a mixed cluster: a trainer on one island updates a small real model
(bf16) each step, rollout actors on another island receive the new weights.

Side by side in one run, the trainer's state dict each step goes to the rollouts by
- ``hetccl``: ``@ray.method(tensor_transport="hetccl")``, over the hetccl group (compressed
  across islands);
- ``gloo``: Ray's own ``tensor_transport="gloo"`` (a ``torch_gloo`` group of the same actors);
- ``object store``: a plain return value, through Ray's object store;
- ``hetccl broadcast``: one to many, ``hetccl_ray.broadcast_state_dict`` over the group (the
  bytes cross to the rollouts' island once, whatever the number of rollouts).
Every received model is checked bit for bit against the trainer's.

    python examples/weight_sync_mixed.py                       # loopback: 1 MiB and 64 MiB
    python examples/weight_sync_mixed.py --rate 1gbit          # islands in namespaces, shaped link
    python examples/weight_sync_mixed.py --receivers 3 --ways "hetccl broadcast,gloo"
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import statistics
import sys
import time
from typing import Optional, Sequence

import ray
import torch

import hetccl_ray
from hetccl_ray import ISLAND_LABEL
from hetccl_ray.tools.bench import parse_size
from hetccl_ray.tools.local_cluster import LocalCluster

GROUP, GLOO_GROUP = "weights", "weights-gloo"
WAYS = ("hetccl", "gloo", "object store", "hetccl broadcast")


def make_model(nbytes: int, seed: int) -> torch.nn.Module:
    """A stack of bf16 linear layers of about ``nbytes`` of weights (a small real model)."""
    width = 512 if nbytes < (16 << 20) else 2048
    layers = max(1, round(nbytes / 2 / (width * width + width)))
    torch.manual_seed(seed)
    blocks = [m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU())]
    return torch.nn.Sequential(*blocks).to(torch.bfloat16)


def fingerprint(model: torch.nn.Module) -> str:
    digest = hashlib.sha1()
    for name, t in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(t.contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()


def border_bytes() -> tuple[int, int]:
    """Inside an actor: bytes it sent to the other island, and their size on the wire (the
    group's border and its direct-transfer channel)."""
    group = hetccl_ray.get_group(GROUP)
    return (group.border.bytes_sent + group.direct.border.bytes_sent,
            group.border.wire_bytes_sent + group.direct.border.wire_bytes_sent)


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Trainer:
    """Updates its model each step and hands out its weights each way."""

    def __init__(self, nbytes: int) -> None:
        self.model = make_model(nbytes, seed=0)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2)

    def step(self) -> str:
        width = self.model[0].in_features
        x = torch.randn(4, width, dtype=torch.bfloat16)
        loss = (self.model(x) - x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return fingerprint(self.model)

    @ray.method(tensor_transport="hetccl")
    def weights_hetccl(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    @ray.method(tensor_transport="gloo")
    def weights_gloo(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def weights_plain(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def broadcast(self) -> None:
        hetccl_ray.broadcast_state_dict(self.model.state_dict(), 0, GROUP)

    def border(self) -> tuple[int, int]:
        return border_bytes()


@ray.remote(num_cpus=0, enable_tensor_transport=True)
class Rollout:
    """Loads whatever weights it is handed into its own copy of the model."""

    def __init__(self, nbytes: int, seed: int) -> None:
        self.model = make_model(nbytes, seed=seed)

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)

    def broadcast(self) -> None:
        hetccl_ray.broadcast_state_dict(self.model.state_dict(), 0, GROUP)

    def fingerprint(self) -> str:
        return fingerprint(self.model)

    def border(self) -> tuple[int, int]:
        return border_bytes()


def sync(way: str, trainer, rollouts: list) -> None:
    """One weight sync from the trainer to every rollout, to completion."""
    if way == "hetccl broadcast":
        ray.get([trainer.broadcast.remote()] + [r.broadcast.remote() for r in rollouts], timeout=600)
        return
    method = {"hetccl": trainer.weights_hetccl, "gloo": trainer.weights_gloo,
              "object store": trainer.weights_plain}[way]
    ref = method.remote()
    ray.get([r.load.remote(ref) for r in rollouts], timeout=600)


def run(nbytes: int, receivers: int, ways: Sequence[str], steps: int, compress: str) -> list[dict]:
    """Inside a running cluster with islands ``train`` and ``rollout``: ``steps`` trainer steps,
    each followed by one sync per way (in turn, the order rotating); a row per way."""
    trainer = Trainer.options(label_selector={ISLAND_LABEL: "train"}).remote(nbytes)
    rollouts = [Rollout.options(label_selector={ISLAND_LABEL: "rollout"}).remote(nbytes, seed=1 + i)
                for i in range(receivers)]
    actors = [trainer, *rollouts]
    # flat="off": the broadcast takes the hierarchical plan, which crosses to each island once and
    # compresses there; Gloo over every rank would send the root's bytes once per receiver, raw
    hetccl_ray.create_collective_group(actors, len(actors), list(range(len(actors))), group_name=GROUP,
                                       timeout_s=300, compress=compress, flat="off")
    if "gloo" in ways:
        from ray.experimental.collective import create_collective_group

        create_collective_group(actors, backend="torch_gloo", name=GLOO_GROUP)
    size = sum(t.numel() * t.element_size() for t in make_model(nbytes, 0).state_dict().values())
    times: dict[str, list[float]] = {way: [] for way in ways}
    sent: dict[str, list[tuple[int, int]]] = {way: [] for way in ways}
    for step in range(steps + 1):  # the first round warms up (links dialled, buffers grown)
        want = ray.get(trainer.step.remote())
        for way in ways[step % len(ways):] + ways[:step % len(ways)]:
            before = [ray.get(a.border.remote()) for a in actors]
            started = time.perf_counter()
            sync(way, trainer, rollouts)
            elapsed = time.perf_counter() - started
            after = [ray.get(a.border.remote()) for a in actors]
            got = ray.get([r.fingerprint.remote() for r in rollouts])
            if got != [want] * receivers:
                raise AssertionError(f"{way}: a rollout's weights differ from the trainer's after step {step}")
            if step:
                times[way].append(elapsed)
                sent[way].append(tuple(sum(a[i] - b[i] for a, b in zip(after, before)) for i in range(2)))
    rows = []
    for way in ways:
        best = statistics.median(times[way])
        border, wire = sent[way][-1]
        rows.append({"way": way, "receivers": receivers, "bytes": size, "ms": best * 1e3,
                     "GB/s": size * receivers / best / 1e9, "border bytes": border if way.startswith("hetccl") else "",
                     "wire bytes": wire if way.startswith("hetccl") else ""})
    gloo = next((r["ms"] for r in rows if r["way"] == "gloo"), None)
    for row in rows:
        row["vs gloo"] = f"{gloo / row['ms']:.2f}x" if gloo else ""
    return rows


def print_rows(rows: list[dict], title: str) -> None:
    print(f"\n# {title}")
    print(f"{'way':>17} {'recv':>4} {'bytes':>10} {'ms/sync':>9} {'GB/s':>6} {'border B':>10} {'wire B':>10} "
          f"{'vs gloo':>7}")
    for r in rows:
        print(f"{r['way']:>17} {r['receivers']:>4} {r['bytes']:>10} {r['ms']:>9.1f} {r['GB/s']:>6.2f} "
              f"{r['border bytes']!s:>10} {r['wire bytes']!s:>10} {r['vs gloo']:>7}", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1M,64M", help="model sizes (weights' bytes), comma list")
    parser.add_argument("--receivers", default="1,3", help="rollout counts, comma list")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma list of: {', '.join(WAYS)}")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rate", default="", help="shape the link between the islands (e.g. 1gbit); needs root")
    parser.add_argument("--compress", default="auto")
    parser.add_argument("--csv", default="")
    args = parser.parse_args(argv)
    ways = [w.strip() for w in args.ways.split(",") if w.strip()]
    unknown = set(ways) - set(WAYS)
    if unknown:
        parser.error(f"unknown ways {sorted(unknown)}")
    rows: list[dict] = []
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        for receivers in (int(n) for n in args.receivers.split(",")):
            if args.rate:
                from hetccl_ray.tools.shaped_cluster import ShapedCluster

                cluster = ShapedCluster(["train", "rollout"], args.rate)
            else:
                cluster = LocalCluster(["train", "rollout"])
            with cluster:
                found = run(nbytes, receivers, ways, args.steps, args.compress)
            where = f"shaped {args.rate}" if args.rate else "loopback"
            print_rows(found, f"{nbytes} bytes of bf16 weights to {receivers} rollout(s), {where}")
            rows += [{**r, "link": where} for r in found]
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
