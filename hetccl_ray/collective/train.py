"""Ray Train: a ``TorchConfig`` that forms the hetccl group over the train workers.

    trainer = TorchTrainer(train_fn, torch_config=HetCCLTorchConfig(),
                           scaling_config=ScalingConfig(num_workers=3, label_selector=[
                               {"hetccl.io/island": "nvidia"}, {"hetccl.io/island": "nvidia"},
                               {"hetccl.io/island": "amd"}]))

Islands come from the labels of the nodes the workers land on; inside ``train_fn``,
``torch.distributed`` (DDP, FSDP) runs over hetccl unchanged.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Callable, Sequence

from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.train.torch.config import TorchConfig, _TorchBackend

from hetccl_ray.topology import ISLAND_LABEL


def _register_in_worker() -> None:
    import hetccl_ray

    hetccl_ray.register()


class _HetCCLTorchBackend(_TorchBackend):
    """Registers the torch backend in every worker before Ray Train's init_process_group."""

    def on_start(self, worker_group, backend_config: TorchConfig) -> None:
        worker_group.execute(_register_in_worker)
        super().on_start(worker_group, backend_config)


@dataclass
class HetCCLTorchConfig(TorchConfig):
    """``TorchConfig`` whose process group is hetccl (``backend="hetccl"``)."""

    backend: str = "hetccl"

    @property
    def backend_cls(self):
        return _HetCCLTorchBackend


def labelled_trainer(train_loop: Callable[[dict], None], islands: Sequence[str], config: dict,
                     timeout_s: float = 120, cpus_per_worker: float = 0.4) -> TorchTrainer:
    """A TorchTrainer over hetccl with one worker per entry of ``islands``, each placed on a
    node labelled ``hetccl.io/island`` with that name."""
    return TorchTrainer(
        train_loop, train_loop_config=config, torch_config=HetCCLTorchConfig(timeout_s=timeout_s),
        scaling_config=ScalingConfig(num_workers=len(islands), use_gpu=False,
                                     resources_per_worker={"CPU": cpus_per_worker},
                                     label_selector=[{ISLAND_LABEL: name} for name in islands]),
        run_config=RunConfig(storage_path=tempfile.mkdtemp(prefix="hetccl-train-")))
