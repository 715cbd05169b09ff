"""Balanced data-parallel training on unequal ranks (islands of different speed).

    bal = Balancer(global_batch=256)              # balance="auto": measure, re-balance
    model = bal.wrap(DistributedDataParallel(net))
    for step in range(steps):
        idx = bal.indices(step, len(dataset))     # this rank's share of the global batch
        loss = loss_fn(model(x[idx]), y[idx])     # a mean over the rank's own samples
        opt.zero_grad(); loss.backward(); opt.step()
        bal.step()                                # every N steps: agree on new shares

Each rank takes ``shares[rank]`` samples of every global batch (balance.py's split), from
its measured compute time per sample: forward start to the last gradient bucket ready, so
the time a fast rank waits for a slow one in the allreduce does not count. Every rank
gathers the same per-rank numbers and computes the same shares. Gradients are exact: DDP's
hook weights each rank's gradient by ``shares[rank] / global_batch`` and sums, which is the
gradient of the mean loss over the global batch in one process; for FSDP or hand-written
averaging, scale the loss by :attr:`Balancer.loss_weight` instead.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from hetccl_ray.features import balance

logger = logging.getLogger("hetccl_ray.features.balance")

MODES = ("auto", "even")
WARMUP_STEPS = 5  # the first steps of a run pay allocation and start-up work (Ray Train's too)
_configured: dict = {}  # set in Ray Train's workers by HetCCLTorchConfig(balance=...)


def check_settings(mode: Optional[str], every: int, margin: float) -> None:
    """A ValueError naming the bad setting, if any."""
    _check_mode(mode)
    balance.Policy(every, margin)


def configure(mode: Optional[str], every: int, margin: float) -> None:
    """Defaults for Balancers made in this process (Ray Train's config sets them)."""
    check_settings(mode, every, margin)
    _configured.update(mode=mode, every=every, margin=margin)


def _check_mode(mode: Optional[str]) -> None:
    if mode is not None and mode not in MODES:
        raise ValueError(f"balance={mode!r}: use one of {MODES} (or None)")


class Balancer:
    """One rank's share of each global batch, its measurement, and the agreement on shares.

    ``balance``: "auto" (measure and re-balance every ``every`` steps when the predicted step
    time improves by more than ``margin``) or "even" (plain split, still exact weighting);
    default from ``HetCCLTorchConfig(balance=...)``, else "auto". ``shares`` fixes the
    starting split (every rank must pass the same)."""

    def __init__(self, global_batch: int, *, balance_mode: Optional[str] = None,
                 shares: Optional[Sequence[int]] = None, every: Optional[int] = None,
                 margin: Optional[float] = None, seed: int = 0, group: Optional[dist.ProcessGroup] = None) -> None:
        _check_mode(balance_mode)
        self.mode = balance_mode or _configured.get("mode") or "auto"
        default = balance.Policy()
        self.policy = balance.Policy(_configured.get("every", default.every) if every is None else every,
                                     _configured.get("margin", default.margin) if margin is None else margin)
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.global_batch, self.seed = int(global_batch), seed
        self.shares = (balance.check_shares(shares, self.global_batch, self.world) if shares is not None
                       else balance.even_shares(self.global_batch, self.world))
        self.measured: list[list[tuple[int, float]]] = [[] for _ in range(self.world)]  # per rank: (share, s)
        self.speeds: Optional[list[balance.Speed]] = None  # fitted from ``measured`` at the last check
        self.history: list[dict] = [{"step": 0, "shares": list(self.shares)}]
        self.checks: list[dict] = []  # every "auto" check: each rank's measured step compute, the choice
        self.steps = 0
        self.compute_s: list[float] = []  # each step's timed compute on this rank (0: not timed)
        self._window: list[float] = []  # compute seconds of each measured step since the last change
        self._skip = WARMUP_STEPS  # steps not measured: the first few, and the first after a change
        self._started: Optional[float] = None
        self._ready: Optional[float] = None

    @property
    def local_batch(self) -> int:
        return self.shares[self.rank]

    @property
    def weight(self) -> float:
        """This rank's fraction of the global batch: its gradient's weight in the sum."""
        return self.local_batch / self.global_batch

    @property
    def loss_weight(self) -> float:
        """Scale for a local mean loss where the framework averages gradients over ranks
        (FSDP's reduce-scatter): ``world * weight``, so the average is the global mean."""
        return self.world * self.weight

    def wrap(self, ddp: torch.nn.parallel.DistributedDataParallel) -> torch.nn.parallel.DistributedDataParallel:
        """Weight DDP's gradients by share (a comm hook) and time its compute (forward start to
        the last bucket ready); returns ``ddp``."""
        def hook(state, bucket):  # no annotations: DDP checks them, and this module's are strings
            return self._weighted_allreduce(bucket)

        ddp.register_forward_pre_hook(lambda module, args: self._start())
        ddp.register_comm_hook(None, hook)
        return ddp

    def _start(self) -> None:
        if self._started is None:
            self._started = time.perf_counter()

    def _weighted_allreduce(self, bucket: dist.GradBucket) -> torch.futures.Future:
        self._ready = time.perf_counter()
        tensor = bucket.buffer().mul_(self.weight)
        return dist.all_reduce(tensor, group=self.group, async_op=True).get_future().then(lambda f: f.value()[0])

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Time compute by hand where no DDP hook sees it (FSDP): put forward and backward
        inside; collective waits inside count as compute."""
        self._start()
        yield
        self._ready = time.perf_counter()

    def indices(self, step: int, dataset_len: int) -> torch.Tensor:
        """This rank's dataset indices of step ``step``'s global batch (balance.py's order)."""
        picked = balance.rank_indices(self.shares, self.rank, step, dataset_len, self.seed)
        return torch.from_numpy(picked)

    def step(self) -> bool:
        """End a step: count its compute, and when due (mode "auto") gather every rank's
        seconds per sample and agree on shares. Returns whether the shares changed."""
        timed = self._started is not None and self._ready is not None
        if not timed and self.mode == "auto":
            raise RuntimeError("Balancer.step(): no compute was timed this step; wrap the DDP model "
                               "with Balancer.wrap() or put forward and backward inside Balancer.timed()")
        spent = self._ready - self._started if timed else 0.0
        self.compute_s.append(spent)
        self._started = self._ready = None
        self.steps += 1
        if self._skip:
            self._skip -= 1
        elif timed:
            self._window.append(spent)
        if self.mode != "auto" or not self.policy.due(len(self._window)):
            return False
        before = self.speeds or [None] * self.world
        for rank, point in enumerate(self._gather(statistics.median(self._window))):  # robust to a stalled step
            self.measured[rank] = balance.add_point(self.measured[rank], point, before[rank])
        self.speeds = [balance.fit_speed(points) for points in self.measured]
        self._window = []
        chosen = self.policy.choose(self.shares, self.speeds)
        self.checks.append({"step": self.steps, "measured_s": [points[-1][1] for points in self.measured],
                            "shares": list(self.shares), "chosen": chosen})
        if chosen == self.shares:
            return False
        self._change(chosen)
        return True

    def set_shares(self, shares: Sequence[int]) -> None:
        """Set the split from the next step on; every rank calls it with the same shares
        (checked: a rank that passed others is named on every rank)."""
        shares = balance.check_shares(shares, self.global_batch, self.world)
        rows = torch.zeros(self.world, self.world, dtype=torch.int64)
        dist.all_gather_into_tensor(rows, torch.tensor(shares, dtype=torch.int64), group=self.group)
        differ = [r for r in range(self.world) if rows[r].tolist() != rows[0].tolist()]
        if differ:
            raise ValueError("Balancer.set_shares: ranks passed different shares: "
                             + "; ".join(f"rank {r}: {rows[r].tolist()}" for r in range(self.world)))
        self._change(shares)

    def _change(self, shares: list[int]) -> None:
        before = self.shares
        self.shares, self._skip, self._window = list(shares), 1, []
        self.history.append({"step": self.steps, "shares": list(shares), "samples_per_s": self._samples_per_s()})
        if self.rank == 0:
            logger.info("hetccl balance at step %d: shares %s -> %s (samples/s %s)",
                        self.steps, before, shares, self._samples_per_s())

    def _gather(self, seconds: float) -> list[tuple[int, float]]:
        """Every rank's (share, median step compute seconds), the same numbers on every rank."""
        every = torch.zeros(self.world, 2, dtype=torch.float64)
        dist.all_gather_into_tensor(every, torch.tensor([self.local_batch, seconds], dtype=torch.float64),
                                    group=self.group)
        return [(int(share), float(s)) for share, s in every.tolist()]

    def _samples_per_s(self) -> Optional[list[float]]:
        return [1.0 / speed.per_sample for speed in self.speeds] if self.speeds else None

    def metrics(self) -> dict:
        """For ``ray.train.report``: the split now, the last measured speeds, the changes."""
        return {"shares": list(self.shares), "local_batch": self.local_batch, "samples_per_s": self._samples_per_s(),
                "fixed_s": [speed.fixed for speed in self.speeds] if self.speeds else None,
                "rebalances": len(self.history) - 1}
