"""Ray Train: a ``TorchConfig`` that forms the hetccl group over the train workers.

    trainer = TorchTrainer(train_fn, torch_config=HetCCLTorchConfig(),
                           scaling_config=ScalingConfig(num_workers=3, label_selector=[
                               {"hetccl.io/island": "nvidia"}, {"hetccl.io/island": "nvidia"},
                               {"hetccl.io/island": "amd"}]))

Islands come from the labels of the nodes the workers land on; inside ``train_fn``,
``torch.distributed`` (DDP, FSDP) runs over hetccl unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray.train.torch.config import TorchConfig, _TorchBackend


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
