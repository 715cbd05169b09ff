"""Ray Train: a ``TorchConfig`` that forms the hetccl group over the train workers.

    trainer = TorchTrainer(train_fn, torch_config=HetCCLTorchConfig(),
                           scaling_config=ScalingConfig(num_workers=3, label_selector=[
                               {"hetccl.io/island": "nvidia"}, {"hetccl.io/island": "nvidia"},
                               {"hetccl.io/island": "amd"}]))

Islands come from the labels of the nodes the workers land on; inside ``train_fn``,
``torch.distributed`` (DDP, FSDP) runs over hetccl unchanged. ``balance="auto"`` makes the
``Balancer`` that ``train_fn`` creates size each rank's batch from its measured speed
(features/balanced.py); ``balance="even"`` keeps plain DDP's split with the same code.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.train.torch.config import TorchConfig, _TorchBackend

from hetccl_ray.core.topology import ISLAND_LABEL
from hetccl_ray.doors.ray_collective import register
from hetccl_ray.features import balanced


def _register_in_worker(mode: Optional[str], every: int, margin: float) -> None:
    register()
    balanced.configure(mode, every, margin)


class _HetCCLTorchBackend(_TorchBackend):
    """Registers the torch backend and the balance settings in every worker before Ray
    Train's init_process_group."""

    def on_start(self, worker_group, backend_config: "HetCCLTorchConfig") -> None:
        worker_group.execute(_register_in_worker, backend_config.balance, backend_config.rebalance_every,
                             backend_config.balance_margin)
        super().on_start(worker_group, backend_config)


@dataclass
class HetCCLTorchConfig(TorchConfig):
    """``TorchConfig`` whose process group is hetccl (``backend="hetccl"``).

    ``balance``: "auto" or "even", the default mode of ``Balancer`` in the workers;
    ``rebalance_every`` steps and ``balance_margin`` (predicted gain needed) for "auto"."""

    backend: str = "hetccl"
    balance: Optional[str] = None
    rebalance_every: int = 10
    balance_margin: float = 0.1

    def __post_init__(self) -> None:
        balanced.check_settings(self.balance, self.rebalance_every, self.balance_margin)

    @property
    def backend_cls(self):
        return _HetCCLTorchBackend


def labelled_trainer(train_loop: Callable[[dict], None], islands: Sequence[str], config: dict,
                     timeout_s: float = 120, cpus_per_worker: float = 0.4, **torch_config) -> TorchTrainer:
    """A TorchTrainer over hetccl with one worker per entry of ``islands``, each placed on a
    node labelled ``hetccl.io/island`` with that name; ``torch_config``: more
    ``HetCCLTorchConfig`` fields (``balance=...``)."""
    return TorchTrainer(
        train_loop, train_loop_config=config, torch_config=HetCCLTorchConfig(timeout_s=timeout_s, **torch_config),
        scaling_config=ScalingConfig(num_workers=len(islands), use_gpu=False,
                                     resources_per_worker={"CPU": cpus_per_worker},
                                     label_selector=[{ISLAND_LABEL: name} for name in islands]),
        run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="hetccl-train-")))
