"""Ray Direct Transport over hetccl: ``@ray.method(tensor_transport="hetccl")``.

A method so marked returns tensors (one, a list, a dict such as a state dict) that stay on
its actor; a task of another actor that takes the ref receives them over the hetccl group
both actors belong to, through the group's direct channel (``transport/direct.py``), never
through the object store. An AMD actor receives what an NVIDIA actor made and the reverse
(both are ``cuda`` to torch); an actor without a GPU receives a GPU tensor in host memory.
Across islands the bytes are compressed as the group's border compresses them.

Ray 2.60's ``ray.experimental.register_tensor_transport`` takes the manager below;
``import hetccl_ray`` registers it. Ray's own collective transports find their group through
``ray.experimental.collective``, which accepts only NCCL and GLOO groups, so this one finds
the group through hetccl's record of which actor is which rank (written by
``hetccl_ray.create_collective_group``, dropped when the group is destroyed).
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import ray
import torch
from ray.experimental.rdt.tensor_transport_manager import (CommunicatorMetadata, TensorTransportManager,
                                                           TensorTransportMetadata)
from ray.util.collective import collective as _ray_collective

from hetccl_ray.memory import devices
from hetccl_ray.group.group import HetCCLGroup
from hetccl_ray.group.rendezvous import get_raw, keys, members_key, put_raw
from hetccl_ray.errors import HetCCLError

TRANSPORT = "HETCCL"
DEVICES = ["cpu", "cuda", "xpu"]


@dataclass
class DirectPair(CommunicatorMetadata):
    """Which group carries a transfer, its two ranks, and the number both ends tag it with."""

    group_name: str = ""
    src_rank: int = -1
    dst_rank: int = -1
    transfer: int = 0


# (src, dst) actor ids -> the group that carries their transfers and their ranks there
_carriers: dict[tuple[str, str], tuple[str, int, int]] = {}


def record_members(group_name: str, actors: Sequence[Any], ranks: Sequence[int]) -> None:
    """Remember which actor is which rank of ``group_name`` (on the process that creates it)."""
    for pair in [pair for pair, carrier in _carriers.items() if carrier[0] == group_name]:
        del _carriers[pair]
    put_raw(members_key(group_name), json.dumps({a._actor_id.hex(): r for a, r in zip(actors, ranks)}).encode())


def _groups() -> dict[str, dict[str, int]]:
    """Every recorded hetccl group: name -> {actor id: rank}."""
    found = {}
    for key in keys(members_key("")):
        raw = get_raw(key)
        if raw:
            found[key[len(members_key("")):]] = json.loads(raw)
    return found


def shared_group(src: str, dst: str) -> tuple[str, int, int]:
    """The group that carries transfers between actors ``src`` and ``dst`` (ids): the smallest
    one holding both (ties: by name), with their ranks there. Remembered per pair (a read of
    Ray's KV costs about a millisecond, a tenth of a 1 MiB transfer); a group created again
    in this process forgets its pairs, one destroyed fails its transfers with a clear error."""
    if (src, dst) not in _carriers:
        groups = _groups()
        both = sorted((len(m), n) for n, m in groups.items() if src in m and dst in m)
        if not both:
            raise HetCCLError(f"no hetccl group holds both actor {src} and actor {dst}: create one with "
                              "hetccl_ray.create_collective_group([...both actors...], ...) before passing "
                              'their tensor_transport="hetccl" refs')
        name = both[0][1]
        _carriers[src, dst] = (name, groups[name][src], groups[name][dst])
    return _carriers[src, dst]


def _group(name: str) -> HetCCLGroup:
    """This actor's hetccl group ``name``, without Ray's lazy creation of a missing one."""
    with _ray_collective._group_mgr_lock:
        group = (_ray_collective._group_mgr.get_group_by_name(name)
                 if _ray_collective._group_mgr.is_group_exist(name) else None)
    if not isinstance(group, HetCCLGroup):
        raise HetCCLError(f"direct transfer over group '{name}': this actor has no such hetccl group "
                          "(destroyed, or never formed here)")
    return group


def receiving_device(sender_type: Optional[str]) -> torch.device:
    """Where this actor receives a tensor made on ``sender_type``: on its own accelerator of
    that type (an AMD and an NVIDIA GPU are both ``cuda`` to torch; a GPU is this actor's
    when Ray gave it one, not merely when the host has one), else in host memory."""
    if sender_type and sender_type != "cpu":
        module = getattr(torch, sender_type, None)
        mine = bool(ray.get_gpu_ids()) if sender_type == "cuda" else True
        if mine and module is not None and module.is_available():
            return torch.device(sender_type, module.current_device())
    return torch.device("cpu")


class HetCCLTensorTransport(TensorTransportManager):
    """The ``"hetccl"`` tensor transport: two-sided (Ray runs the send on the producing actor
    and the receive on the consuming one), abortable (a failed side ends only its link)."""

    def __init__(self) -> None:
        # per object's tensors: the producer's stream positions, waited for before sending
        self._ready: dict[tuple[int, ...], list[devices.EventLike]] = {}
        self._members: set[str] = set()  # actors known to be in a hetccl group
        self._lock = threading.Lock()

    def tensor_transport_backend(self) -> str:
        return TRANSPORT

    @staticmethod
    def is_one_sided() -> bool:
        return False

    @staticmethod
    def can_abort_transport() -> bool:
        return True

    def actor_has_tensor_transport(self, actor: "ray.actor.ActorHandle") -> bool:
        """Asked by Ray at every call of a method marked ``"hetccl"``: a member once is taken as
        one after (a transfer over a destroyed group fails with its own clear error)."""
        me = actor._actor_id.hex()
        if me not in self._members:
            if not any(me in members for members in _groups().values()):
                return False
            self._members.add(me)
        return True

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: List[torch.Tensor]) -> TensorTransportMetadata:
        """Shapes and dtypes, and where the producer's streams stand (the send waits for that,
        off the actor's thread, so the task returns without waiting for its kernels)."""
        kinds = {t.device.type for t in rdt_object}
        if len(kinds) > 1:
            raise HetCCLError(f'tensor_transport="hetccl": the tensors of one object must share a device type, '
                              f"got {sorted(kinds)}")
        owners = {devices.of(t) for t in rdt_object}
        with self._lock:
            self._ready[_key(rdt_object)] = [mark for mark in map(devices.Device.mark, owners) if mark is not None]
        return TensorTransportMetadata([(t.shape, t.dtype) for t in rdt_object], kinds.pop() if kinds else None)

    def get_communicator_metadata(self, src_actor: Optional["ray.actor.ActorHandle"],
                                  dst_actor: "ray.actor.ActorHandle", backend: Optional[str] = None) -> DirectPair:
        if src_actor is None:
            raise HetCCLError('tensor_transport="hetccl" moves tensors between actors of a group; the driver '
                              "is not one (pass the ref to an actor, or ray.get(ref, _use_object_store=True))")
        name, src_rank, dst_rank = shared_group(src_actor._actor_id.hex(), dst_actor._actor_id.hex())
        return DirectPair(group_name=name, src_rank=src_rank, dst_rank=dst_rank, transfer=secrets.randbits(62))

    def send_multiple_tensors(self, tensors: List[torch.Tensor], tensor_transport_metadata: TensorTransportMetadata,
                              communicator_metadata: DirectPair) -> None:
        group = _group(communicator_metadata.group_name)
        with self._lock:
            ready = list(self._ready.get(_key(tensors), ()))
        deadline = time.monotonic() + group.options.timeout_s
        for event in ready:
            event.synchronize(deadline, f"the tensors of direct transfer {communicator_metadata.transfer:#x}")
        group.direct.send([t.contiguous() for t in tensors], communicator_metadata.dst_rank,
                          communicator_metadata.transfer)

    def recv_multiple_tensors(self, obj_id: str, tensor_transport_metadata: TensorTransportMetadata,
                              communicator_metadata: DirectPair,
                              target_buffers: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
        group = _group(communicator_metadata.group_name)
        device = receiving_device(tensor_transport_metadata.tensor_device)
        buffers = target_buffers or [torch.empty(shape, dtype=dtype, device=device)
                                     for shape, dtype in tensor_transport_metadata.tensor_meta]
        group.direct.recv(buffers, communicator_metadata.src_rank, communicator_metadata.transfer)
        return buffers

    def garbage_collect(self, obj_id: str, tensor_transport_meta: TensorTransportMetadata,
                        tensors: List[torch.Tensor]) -> None:
        with self._lock:
            self._ready.pop(_key(tensors), None)

    def abort_transport(self, obj_id: str, communicator_metadata: DirectPair) -> None:
        try:
            group = _group(communicator_metadata.group_name)
        except HetCCLError:
            return  # destroyed: its channel is closed and nothing waits on it
        pair = (communicator_metadata.src_rank, communicator_metadata.dst_rank)
        peer = pair[1] if group.rank == pair[0] else pair[0]
        group.direct.abort(peer, communicator_metadata.transfer,
                           "Ray aborted it (its other side failed or passed Ray's deadline)")

    def pending(self) -> int:
        """Objects whose producer positions are still held (0 once their refs are gone)."""
        with self._lock:
            return len(self._ready)


def _key(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    return tuple(id(t) for t in tensors)


def register() -> None:
    """Register ``"hetccl"`` with Ray's tensor transports (once per process)."""
    import importlib

    from ray.experimental.rdt import util

    importlib.import_module("ray.experimental.collective")  # Ray's abort path imports it from a thread, which fails

    if TRANSPORT not in util.transport_manager_info:
        util.register_tensor_transport(TRANSPORT, DEVICES, HetCCLTensorTransport, torch.Tensor)


def manager() -> HetCCLTensorTransport:
    """This process's instance of the transport (what Ray calls)."""
    from ray.experimental.rdt.util import get_tensor_transport_manager

    return get_tensor_transport_manager(TRANSPORT)
