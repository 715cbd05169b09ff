"""Elastic training on two labelled islands: torchft over hetccl, Ray bringing back what dies.

    python examples/train_elastic_mixed.py                      # 2 islands x 2 ranks, 100 steps, island b killed at 20
    python examples/train_elastic_mixed.py --steps 200 --kills 5 --csv elastic.csv   # 5 random kills

One Ray actor per rank on its island's node, each its own torchft replica (fault-tolerant DDP
over every rank of every island; hetccl's hierarchical allreduce across islands), restarted
by Ray (``max_restarts``); torchft's Lighthouse runs as a Ray actor on the head. At the kill
step the driver SIGKILLs the processes of one island's actors; the survivors go on, Ray
restarts the dead, torchft heals them from a healthy replica and they rejoin. Prints per
step: members, step time, loss, and events (lost, healed, rejoined); then the floors of
issue 44 (time to the survivors' next step, steps to heal, weights bit-equal, every step
committed).

Why a driver loop and not Ray Train: Ray Train 2.60 restarts the whole worker group when a
worker dies (its FailureConfig), so it cannot keep the survivors stepping; torchft's own
Ray Train integration (``TorchftConfig``) is built on that v2 controller and keeps it.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import time

import ray
import torch
from torch import nn

from hetccl_ray.core.topology import ISLAND_LABEL
from hetccl_ray.tools.local_cluster import LocalCluster

ISLANDS = ["a", "b"]


@ray.remote(num_cpus=0)
class Lighthouse:
    """torchft's Lighthouse (the quorum), on the head node: the one shipped in its wheel."""

    def __init__(self, min_replicas: int) -> None:
        from torchft.coordination import LighthouseServer

        # a replica whose heartbeats stop for 1.5 s is out of the next quorum (torchft: 5 s)
        self.server = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=2000,
                                       heartbeat_timeout_ms=1500)

    def address(self) -> str:
        return self.server.address()


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=2)
class Rank:
    """One rank: an MLP trained as its own torchft replica; ``train`` runs in one thread while
    the driver reads ``progress`` in the other."""

    def __init__(self, replica: str, lighthouse: str) -> None:
        from hetccl_ray.doors.ft import ElasticRank

        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.replica = replica
        self.model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.rank = ElasticRank(self.model, optimizer, replica, lighthouse)
        self.records: list = []

    def pid(self) -> int:
        return os.getpid()

    def train(self, steps: int, pause_s: float) -> None:
        seed = sum(map(ord, self.replica))
        while self.rank.current_step < steps:
            record = self.rank.step(lambda step: self._loss(step, seed))
            if record is not None:
                self.records.append(record)
            time.sleep(pause_s)  # the rest of a real step's work

    def _loss(self, step: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + seed)
        x = torch.randn(64, 32, generator=g)
        return ((self.model(x).squeeze(-1) - torch.sin(x[:, :4].sum(-1))) ** 2).mean()

    def progress(self) -> list:
        taken, self.records = self.records, []
        return [(r.step, r.participants, r.seconds, r.loss, r.healed) for r in taken]

    def weights(self) -> list:
        return [p.detach().clone() for p in self.model.parameters()]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--pause", type=float, default=0.1, help="seconds of other work per step")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per island")
    parser.add_argument("--kill-at", type=int, default=20, help="kill island b's actors at this step")
    parser.add_argument("--kills", type=int, default=0, help="instead: this many kills of random ranks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", default=None, help="write one row per step here")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    kill_steps = (sorted(rng.sample(range(5, args.steps - 10), args.kills)) if args.kills else [args.kill_at])
    with LocalCluster(ISLANDS, cpus_per_node=args.ranks):
        return run(args, kill_steps, rng)


def run(args: argparse.Namespace, kill_steps: list[int], rng: random.Random) -> dict:
    """The run; returns its rows and floors (what the tests read)."""
    quorum = Lighthouse.remote(1)  # held: the actor lives while its handle does
    lighthouse = ray.get(quorum.address.remote())
    names = [f"{island}{i}" for island in ISLANDS for i in range(args.ranks)]
    ranks = {name: Rank.options(label_selector={ISLAND_LABEL: name[0]}).remote(name, lighthouse) for name in names}
    pids = dict(zip(names, ray.get([ranks[n].pid.remote() for n in names], timeout=300)))
    runs = {name: ranks[name].train.remote(args.steps, args.pause) for name in names}  # every rank up first, then all start
    steps: dict[int, dict] = {}
    events: dict[int, list[str]] = {}
    killed: dict[str, float] = {}  # rank -> when it was killed (until it is up again)
    back: dict[str, int] = {}  # rank -> the step under way when it was up again
    healed: dict[str, int] = {}  # rank -> the step it was healed in
    recovery: list[float] = []  # per kill: seconds until a survivor committed a later step
    kill_time: tuple[int, float] | None = None
    waiting: dict[str, str] = {}
    printed, started, rows = 0, time.monotonic(), []
    print(f"# {len(names)} ranks on islands {ISLANDS} ({args.ranks} each), {args.steps} steps, kills at {kill_steps}")
    print(f"{'step':>5} {'members':>8} {'time s':>7} {'loss':>8}  events")
    while printed < args.steps:
        if time.monotonic() - started > 60 + 3 * args.steps:
            raise SystemExit(f"no progress: steps {sorted(steps)[-3:]} of {args.steps}")
        for name in names:
            if name in killed:
                try:  # Ray restarted it: its process is new, its train() starts again
                    pid = ray.get(ranks[name].pid.remote(), timeout=0.5)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                    waiting[name] = type(exc).__name__ + ": " + str(exc)[:200]
                    continue
                if pid != pids[name]:
                    pids[name] = pid
                    back[name] = max(steps, default=0)
                    events.setdefault(back[name], []).append(f"{name} up again after {time.monotonic() - killed.pop(name):.1f}s")
                    runs[name] = ranks[name].train.remote(args.steps, args.pause)
                continue
            try:
                got = ray.get(ranks[name].progress.remote(), timeout=5)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                continue
            for step, participants, seconds, loss, was_healed in got:
                cell = steps.setdefault(step, {"members": set(), "seconds": 0.0, "loss": []})
                cell["members"].add(name)
                cell["seconds"] = max(cell["seconds"], seconds)
                cell["loss"].append(loss)
                if was_healed:
                    healed[name] = step
                    events.setdefault(step, []).append(f"{name} healed")
                if kill_time is not None and step > kill_time[0]:
                    recovery.append(time.monotonic() - kill_time[1])
                    kill_time = None
        under_way = max(steps, default=-1)
        if kill_steps and under_way >= kill_steps[0]:
            kill_steps.pop(0)
            doomed = [n for n in names if n.startswith("b")] if not args.kills else [rng.choice(names)]
            doomed = [name for name in doomed if name not in killed]  # one still down is not killed again
            for name in doomed:
                os.kill(pids[name], signal.SIGKILL)
                killed[name] = time.monotonic()
            events.setdefault(under_way, []).append(f"{', '.join(doomed) or 'nobody (already down)'} killed")
            kill_time = (under_way, time.monotonic())
        while printed in steps and (printed + 1 in steps or printed == args.steps - 1):
            cell = steps[printed]
            members = sorted(cell["members"])
            if printed and len(members) < len(steps[printed - 1]["members"]):
                events.setdefault(printed, []).append("lost")
            elif printed and len(members) > len(steps[printed - 1]["members"]):
                events.setdefault(printed, []).append("rejoined")
            loss = sum(cell["loss"]) / len(cell["loss"])
            print(f"{printed:>5} {len(members):>8} {cell['seconds']:>7.3f} {loss:>8.4f}  {'; '.join(events.get(printed, []))}",
                  flush=True)
            rows.append({"step": printed, "members": len(members), "seconds": cell["seconds"], "loss": loss,
                         "events": "; ".join(events.get(printed, []))})
            printed += 1
        time.sleep(0.1)
    if killed:
        raise SystemExit(f"ranks {sorted(killed)} did not come back: {waiting}")
    ray.get(list(runs.values()), timeout=120)
    weights = ray.get([ranks[n].weights.remote() for n in names], timeout=60)
    same = all(torch.equal(a, b) for w in weights[1:] for a, b in zip(weights[0], w))
    if back:  # the island is back when its last actor is up; healed when its last rank is
        island_up, island_healed = max(back.values()), max(healed.get(name, -1) for name in back)
    print(f"# every step committed: {sorted(steps) == list(range(args.steps))}; final weights bit-equal on every "
          f"rank: {same}")
    print(f"# after each kill, a survivor's next step committed within {[round(s, 2) for s in recovery]} s")
    if back:
        print(f"# restarted ranks {sorted(back)}: all up by step {island_up}, all healed by step {island_healed} "
              f"({island_healed - island_up} steps later)")
    if args.csv:
        import pandas as pd

        pd.DataFrame(rows).to_csv(args.csv, index=False)
        print(f"# wrote {args.csv}")
    return {"rows": rows, "every_step": sorted(steps) == list(range(args.steps)), "bit_equal": same,
            "recovery_s": recovery, "heal_steps": island_healed - island_up if back else None}


if __name__ == "__main__":
    main()
