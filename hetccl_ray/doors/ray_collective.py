"""The ray.util.collective door: registering the backend "hetccl" (with torch.distributed and
Ray Direct Transport too), creating groups from the driver, and reaching a rank's group
inside an actor."""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import ray
from ray.util.collective import backend_registry
from ray.util.collective import collective as _ray_collective

from hetccl_ray.doors import rdt, torch_backend
from hetccl_ray.errors import HetCCLError, HetCCLTimeoutError
from hetccl_ray.group.group import BACKEND, HetCCLGroup
from hetccl_ray.group.options import GroupOptions
from hetccl_ray.group.rendezvous import claim, options_key, put_raw, release

_NAME_GRACE_S = 10.0


def register() -> None:
    """Register ``"hetccl"`` with Ray's collective backend registry, with torch.distributed and
    as a Ray Direct Transport tensor transport; calling it again is harmless."""
    if not backend_registry._global_registry.is_registered(BACKEND):
        backend_registry.register_collective_backend(BACKEND, HetCCLGroup)
    torch_backend.register()
    rdt.register()


def setup_worker() -> None:
    """A ``worker_process_setup_hook``: ``ray.init(runtime_env={"worker_process_setup_hook":
    "hetccl_ray.setup_worker"})`` registers the backend in every worker, no import needed."""
    register()


def set_group_options(group_name: str, options: Optional[GroupOptions] = None, **fields: Any) -> GroupOptions:
    """Store options for ``group_name`` where its ranks read them when the group forms."""
    options = options or GroupOptions(**fields)
    put_raw(options_key(group_name), options.to_json())
    return options


def _register_in_actor(_instance: Any) -> str:
    register()
    return ray.get_runtime_context().get_node_id()


def _form_in_actor(_instance: Any, group_name: str, world_size: int, rank: int) -> None:
    _ray_collective.init_collective_group(world_size, rank, backend=BACKEND, group_name=group_name)


def _answers(refs: Sequence[Any], ranks: Sequence[int], group_name: str, what: str, timeout_s: float) -> None:
    """Wait for one task per actor; an actor that did not answer or failed is named with its rank
    (a hetccl error keeps its type)."""
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    for i, ref in enumerate(refs):
        if ref not in ready:
            raise HetCCLTimeoutError(f"group '{group_name}': actor {i} (rank {ranks[i]}) did not answer "
                                     f"within {timeout_s:.0f}s while {what}")
        try:
            ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - reported with the actor it came from
            cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
            kind = type(cause) if isinstance(cause, HetCCLError) else HetCCLError
            raise kind(f"group '{group_name}': actor {i} (rank {ranks[i]}) failed while {what}: {cause}") from exc


def _claim(group_name: str) -> None:
    """Take ``group_name`` for a new incarnation (a generation record, rendezvous.py), waiting
    ``_NAME_GRACE_S`` for one destroyed a moment ago to let go of it (its ranks drop the record
    as they destroy it; Ray kills the info actor of one declared through Ray)."""
    deadline = time.monotonic() + _NAME_GRACE_S
    while True:
        try:
            ray.get_actor("info_" + group_name)
        except ValueError:
            if claim(group_name):
                return
        if time.monotonic() > deadline:
            raise HetCCLError(f"group '{group_name}' still exists; call destroy_collective_group('{group_name}') "
                              "in its ranks before creating it again")
        time.sleep(0.1)


def create_collective_group(actors: Sequence[Any], world_size: int, ranks: Sequence[int],
                            group_name: str = "default", options: Optional[GroupOptions] = None,
                            **fields: Any) -> None:
    """``ray.util.collective.create_collective_group(..., backend="hetccl")`` with options, that also
    makes sure every actor has the backend registered (so an actor that never imported
    hetccl_ray gets it, instead of Ray's "group not initialized" error) and forms the group
    on every actor before it returns (as ``ray.experimental.collective`` does; Ray Direct
    Transport's transfers need it formed), so a rank that cannot join fails here. Each actor
    forms its rank with Ray's ``init_collective_group``: no info actor to start (Ray's
    declarative path starts one, about 3 s here), the name is held by a record in Ray's KV
    until the group is destroyed. ``fields`` are :class:`GroupOptions` fields, e.g.
    ``timeout_s=30``."""
    options = options or GroupOptions(**fields)
    ranks = list(ranks)
    if len(ranks) != len(actors) or len(set(ranks)) != len(ranks) or not all(0 <= r < world_size for r in ranks):
        raise ValueError(f"group '{group_name}': ranks must give each of the {len(actors)} actors its own one "
                         f"of 0..{world_size - 1}, got {ranks}")
    _answers([actor.__ray_call__.remote(_register_in_actor) for actor in actors], ranks, group_name,
             "loading hetccl_ray", options.timeout_s)
    _claim(group_name)
    try:
        set_group_options(group_name, options)
        rdt.record_members(group_name, actors, ranks)
        _answers([actor.__ray_call__.remote(_form_in_actor, group_name, world_size, rank)
                  for actor, rank in zip(actors, ranks)], ranks, group_name,
                 "forming the group", 2 * options.timeout_s + 60)  # the formation's deadline, then calibration
    except BaseException:
        release(group_name)  # nothing formed holds the name: it can be created again at once
        raise


def get_group(group_name: str = "default") -> HetCCLGroup:
    """Inside an actor: the hetccl group object of ``group_name`` (topology, counters)."""
    group = _ray_collective.get_group_handle(group_name)
    if not isinstance(group, HetCCLGroup):
        raise HetCCLError(f"group '{group_name}' is a {type(group).__name__}, not a hetccl group")
    return group


def get_torch_group(group: Any = None) -> HetCCLGroup:
    """The hetccl group behind a torch.distributed process group (default: the world)."""
    import torch
    import torch.distributed as dist

    pg = group or dist.group.WORLD
    candidates = [pg]
    try:
        candidates.append(pg._get_backend(torch.device("cpu")))
    except (RuntimeError, AttributeError):
        pass
    for candidate in candidates:
        if isinstance(candidate, torch_backend.HetCCLProcessGroup):
            return candidate.group
    raise HetCCLError(f"process group {pg} does not run on the hetccl backend")


def alltoall(tensor_list_in: Sequence[Any], tensor_list_out: Sequence[Any], group_name: str = "default") -> None:
    """Inside an actor: all-to-all over a hetccl group (``ray.util.collective`` has none).

    ``tensor_list_in[t]`` goes to rank t and ``tensor_list_out[r]`` is filled from rank r:
    torch tensors or numpy arrays, one dtype and device, sizes free per pair as long as what
    r sends t is what t expects from r (else a mismatch error on every rank, no data moved).
    """
    get_group(group_name).alltoall(tensor_list_in, tensor_list_out)


def border_stats(group_name: str = "default") -> dict[str, Any]:
    """Inside an actor: bytes this rank sent over the border, in all and per op."""
    return get_group(group_name).border_stats()
