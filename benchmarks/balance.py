"""Balanced vs even DDP through Ray Train on two islands, side by side in one run.

    .venv/bin/python benchmarks/balance.py            # about 10 minutes here; needs root for cgroups

One local cluster, islands "fast" and "slow", one worker each, each island's node on a core
of its own; an island is slowed by a cgroup CPU quota on its node (cpu_quota.py: a
simulated slow island, real CPU time). The model (examples/train_balanced_mixed.py: an MLP
of width 512, global batch 4096) makes compute most of a step, as in real training. Parts:
- slowed: "slow" at SLOW_CORES; even and balanced alternate for ROUNDS rounds;
- moved: balanced; at step MOVE_AT the quota moves from "slow" to "fast";
- equal: no quota; plain DDP and balanced DDP ("auto") trained in one run, step by step in
  alternating order (what balancing costs when nothing is slow; run-to-run noise here is
  20-30%, so separate runs cannot show a 3% cost).
Step time is the mean interval between steps after WARMUP steps (throughput, every
collective and the loss all-reduce included). Writes balance.csv and balance.png here.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from examples import train_balanced_mixed as example  # noqa: E402
from hetccl_ray.tools.local_cluster import LocalCluster  # noqa: E402

SLOW_CORES, WARMUP, MEASURED, MOVE_AT, ROUNDS = 0.5, 25, 30, 55, 3
SETTLED = 40  # Ray Train's start-up actors slow one island's rank for up to 36 steps here (RESULTS.md)


def run(cluster: LocalCluster, part: str, mode: str, round_: int, steps: int, quota: dict,
        moves: dict | None = None) -> list[dict]:
    """One training run; its rows tagged with the part, mode and round, shares by island."""
    for island, cores in quota.items():
        cluster.quotas[island].set(cores)
    result = example.fit(example.ISLANDS, balance=mode, cluster=cluster, steps=steps, quota_moves=moves or {})
    islands = result.metrics["islands"]
    rows = [{"part": part, "mode": mode, "round": round_, "step": r["step"], "step_s": r["step_s"],
             **{f"share_{name}": share for name, share in zip(islands, r["shares"])}}
            for r in result.metrics["rows"]]
    checks = result.metrics["checks"]
    if checks:  # the balancer's last measurement: each island's seconds per sample at its share
        per_sample = {name: s / b for name, s, b in zip(islands, checks[-1]["measured_s"], checks[-1]["shares"])}
        rows[-1]["slow_per_sample_ratio"] = per_sample["slow"] / per_sample["fast"]
    print(f"  {part:6s} {mode:5s} round {round_}: step {mean_step(rows) * 1e3:6.1f} ms, "
          f"shares fast/slow {rows[-1]['share_fast']}/{rows[-1]['share_slow']}"
          + (f", measured slow/fast time per sample {rows[-1]['slow_per_sample_ratio']:.2f}" if checks else ""),
          flush=True)
    return rows


def mean_step(rows: list[dict], first: int = WARMUP, last: int | None = None) -> float:
    return statistics.mean(r["step_s"] for r in rows[first:last])


def compare(cluster: LocalCluster, part: str, quota: dict) -> tuple[list[dict], dict[str, float]]:
    """Even and balanced alternating; returns the rows and each mode's median step time
    (``ratios``: each round's even / balanced, the side-by-side figure)."""
    rows, times, settled = [], {"even": [], "auto": []}, {"even": [], "auto": []}
    for round_ in range(ROUNDS):
        for mode in (("even", "auto") if round_ % 2 == 0 else ("auto", "even")):
            got = run(cluster, part, mode, round_, SETTLED + MEASURED, quota)
            rows += got
            times[mode].append(mean_step(got, WARMUP, WARMUP + MEASURED))
            settled[mode].append(mean_step(got, SETTLED))
        print(f"  round {round_}: balanced vs even {times['even'][-1] / times['auto'][-1]:.2f}x (steps {WARMUP}-"
              f"{WARMUP + MEASURED - 1}), {settled['even'][-1] / settled['auto'][-1]:.2f}x (steps {SETTLED}-"
              f"{SETTLED + MEASURED - 1})", flush=True)
    ratios = {window: sorted(e / a for e, a in zip(t["even"], t["auto"]))
              for window, t in ((f"{WARMUP}-{WARMUP + MEASURED - 1}", times),
                                (f"{SETTLED}-{SETTLED + MEASURED - 1}", settled))}
    return rows, {**{mode: statistics.median(t) for mode, t in times.items()}, "ratios": ratios}


def alternating_loop(config: dict) -> None:
    """Plain DDP and balanced DDP on the same data in one process group, their steps
    alternating (order swapped every step); each step ends with the loss all-reduce."""
    import time

    import torch
    import torch.distributed as dist
    from torch import nn

    from hetccl_ray.features import balance
    from hetccl_ray.features.balanced import Balancer

    config = {**example.DEFAULTS, **config}
    torch.set_num_threads(1)
    x, y = example.dataset(config)
    models = {mode: nn.parallel.DistributedDataParallel(example.make_model(config)) for mode in ("even", "auto")}
    bal = Balancer(config["global_batch"], balance_mode="auto", seed=config["seed"])
    bal.wrap(models["auto"])
    even = balance.even_shares(config["global_batch"], dist.get_world_size())
    opts = {mode: torch.optim.SGD(model.parameters(), lr=config["lr"]) for mode, model in models.items()}
    times: dict[str, list[float]] = {"even": [], "auto": []}
    for step in range(config["steps"]):
        for mode in (("even", "auto") if step % 2 == 0 else ("auto", "even")):
            started = time.perf_counter()
            idx = (bal.indices(step, len(x)) if mode == "auto"
                   else torch.from_numpy(balance.rank_indices(even, dist.get_rank(), step, len(x), config["seed"])))
            loss = ((models[mode](x[idx]) - y[idx]) ** 2).mean()
            opts[mode].zero_grad()
            loss.backward()
            opts[mode].step()
            if mode == "auto":
                bal.step()
            dist.all_reduce(torch.tensor([loss.item()]))
            times[mode].append(time.perf_counter() - started)
    example.report({"times": times, "shares": bal.shares}, models["auto"].module, last=True)


def equal_cost(cluster: LocalCluster) -> tuple[list[dict], dict[str, float]]:
    """The equal part: rows per step and mode, and each mode's mean step after warm-up."""
    from hetccl_ray.doors.train import labelled_trainer

    for island in cluster.quotas:
        cluster.quotas[island].set(None)
    result = labelled_trainer(alternating_loop, example.ISLANDS, {"steps": WARMUP + 2 * MEASURED},
                              balance="auto", rebalance_every=5).fit()
    times = result.metrics["times"]
    rows = [{"part": "equal", "mode": mode, "round": 0, "step": step, "step_s": t}
            for mode, steps in times.items() for step, t in enumerate(steps)]
    print(f"  equal alternating: final shares {result.metrics['shares']}", flush=True)
    return rows, {mode: statistics.mean(steps[WARMUP:]) for mode, steps in times.items()}


def main() -> None:
    global ROUNDS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--slowed-only", action="store_true", help="only the slowed part (its rounds' ratios)")
    args = parser.parse_args()
    ROUNDS = args.rounds
    with LocalCluster(example.ISLANDS, cpu_quota={"fast": None, "slow": SLOW_CORES}, pin_cores=True) as cluster:
        # unmeasured: a cluster's first fit also starts Ray Train's state actor (once per cluster)
        example.fit(example.ISLANDS, balance="even", cluster=cluster, steps=5)
        print(f"slowed: island 'slow' at {SLOW_CORES} CPU", flush=True)
        slowed, slowed_s = compare(cluster, "slowed", {"fast": None, "slow": SLOW_CORES})
        for window, ratios in slowed_s["ratios"].items():
            print(f"slowed, balanced vs even per round, steps {window}: {', '.join(f'{r:.2f}' for r in ratios)}; "
                  f"median {statistics.median(ratios):.2f}x (floor >= 1.40x), lowest {ratios[0]:.2f}x (floor >= 1.30x)")
        if args.slowed_only:
            return
        print(f"moved: at step {MOVE_AT} the quota moves to 'fast'", flush=True)
        moved = run(cluster, "moved", "auto", 0, MOVE_AT + 55, {"fast": None, "slow": SLOW_CORES},
                    {MOVE_AT: {"slow": None, "fast": SLOW_CORES}})
        followed = next((r["step"] - MOVE_AT for r in moved[MOVE_AT:] if r["share_slow"] > r["share_fast"]), None)
        after = mean_step(moved, MOVE_AT + 25)
        print("equal: no quota", flush=True)
        equal, equal_s = equal_cost(cluster)
    rows = slowed + moved + equal
    with open(HERE / "balance.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    slowdown = slowed_s["even"] / equal_s["even"]  # what the quota does to plain DDP's step
    print(f"slowed, balanced vs even: {slowed_s['even'] / slowed_s['auto']:.2f}x faster (medians); "
          f"the quota made the even step {slowdown:.2f}x slower, for which the ideal is {(1 + slowdown) / 2:.2f}x")
    print(f"moved: shares followed {followed} steps after the move (floor <= 20); step time from step "
          f"{MOVE_AT + 25}: {after * 1e3:.1f} ms = {after / slowed_s['auto']:.2f} of balanced (floor <= 1.15)")
    print(f"equal islands, balanced / even step time: {equal_s['auto'] / equal_s['even']:.3f} (floor <= 1.03)")
    plot(slowed, moved, HERE / "balance.png")


def load(path: Path = HERE / "balance.csv") -> dict[str, list[dict]]:
    """The rows a run wrote, by part, numbers as numbers."""
    parts: dict[str, list[dict]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            parsed = {k: (v if k in ("part", "mode") else float(v)) for k, v in row.items() if v != ""}
            parts.setdefault(row["part"], []).append(parsed)
    return parts


def runs_of(rows: list[dict], mode: str) -> list[list[dict]]:
    """The rows of each run of ``mode``, run by run."""
    keys = sorted({(r["part"], r["round"]) for r in rows if r["mode"] == mode})
    return [[r for r in rows if r["mode"] == mode and (r["part"], r["round"]) == key] for key in keys]


def plot(slowed: list[dict], moved: list[dict], path: Path | None = None):
    """Step time and shares over steps: even vs balanced on the slowed islands, and the
    balanced run whose slowdown moves; saved to ``path`` if given; returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 6), sharex="col")
    for mode, color in (("even", "tab:gray"), ("auto", "tab:blue")):
        run0 = runs_of(slowed, mode)[0]
        label = "even (plain DDP)" if mode == "even" else "balanced"
        axes[0, 0].plot([r["step"] for r in run0], [r["step_s"] * 1e3 for r in run0], color=color, label=label)
        axes[1, 0].plot([r["step"] for r in run0], [r["share_slow"] for r in run0], color=color, label=label)
    axes[0, 1].plot([r["step"] for r in moved], [r["step_s"] * 1e3 for r in moved], color="tab:blue")
    axes[1, 1].plot([r["step"] for r in moved], [r["share_fast"] for r in moved], label="island 'fast'")
    axes[1, 1].plot([r["step"] for r in moved], [r["share_slow"] for r in moved], label="island 'slow'")
    for ax in axes[:, 1]:
        ax.axvline(MOVE_AT, color="tab:red", linestyle=":")
    axes[0, 0].set(title=f"island 'slow' at {SLOW_CORES} CPU", ylabel="step time (ms)")
    axes[1, 0].set(ylabel="samples of island 'slow'", xlabel="step")
    axes[0, 1].set(title=f"balanced; the quota moves to 'fast' at step {MOVE_AT}")
    axes[1, 1].set(ylabel="samples per step", xlabel="step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    axes[0, 0].legend()
    axes[1, 1].legend()
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=90)
    return fig


if __name__ == "__main__":
    import matplotlib

    matplotlib.use("Agg")
    main()
