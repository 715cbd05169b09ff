"""Rendezvous through Ray's internal KV, scoped by group name, every wait with a deadline."""

from __future__ import annotations

import json
import time
import uuid
from typing import Iterable, Optional

import ray.experimental.internal_kv as kv

from hetccl_ray.errors import RecordsMissing

NAMESPACE = "hetccl"


def options_key(group_name: str) -> str:
    return f"{group_name}/options"


def members_key(group_name: str) -> str:
    """Where the driver records which actor is which rank (direct transfers find groups there)."""
    return f"members/{group_name}"


def generation_key(group_name: str) -> str:
    """Where a group created by the door holds its name: its incarnation's generation."""
    return f"generation/{group_name}"


def claim(group_name: str) -> bool:
    """Record a fresh generation for ``group_name`` unless one is there (atomic in Ray's KV):
    whether the name was free."""
    return not kv._internal_kv_put(generation_key(group_name), uuid.uuid4().hex.encode(), overwrite=False,
                                   namespace=NAMESPACE)


def release(group_name: str, generation: Optional[str] = None) -> None:
    """Free ``group_name``: its generation and its members (direct transfers stop finding it);
    with ``generation``, only while the name is still that incarnation's."""
    if generation is not None and get_raw(generation_key(group_name)) not in (None, generation.encode()):
        return  # created again since: the name is the new incarnation's
    delete(generation_key(group_name))
    delete(members_key(group_name))


def keys(prefix: str) -> list[str]:
    """The keys under ``prefix``."""
    return [key.decode() for key in kv._internal_kv_list(prefix, namespace=NAMESPACE)]


def put_raw(key: str, value: bytes) -> None:
    kv._internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE)


def get_raw(key: str) -> Optional[bytes]:
    return kv._internal_kv_get(key, namespace=NAMESPACE)


def delete(key: str) -> None:
    kv._internal_kv_del(key, namespace=NAMESPACE)


class Rendezvous:
    """Records of one group incarnation: ``{group}/{generation}/...`` keys holding JSON.

    Kept in Ray's internal KV; :class:`StoreRendezvous` keeps them in a torch c10d store.
    """

    def __init__(self, group_name: str, generation: str) -> None:
        self.group_name, self.generation = group_name, generation
        self.prefix = f"{group_name}/{generation}/"

    def _put(self, key: str, raw: bytes) -> None:
        put_raw(key, raw)

    def _get(self, key: str) -> Optional[bytes]:
        return get_raw(key)

    def delete(self, key: str) -> None:
        delete(self.prefix + key)

    def put(self, key: str, value: dict) -> None:
        self._put(self.prefix + key, json.dumps(value).encode())

    def get(self, key: str) -> Optional[dict]:
        raw = self._get(self.prefix + key)
        return json.loads(raw) if raw else None

    def wait(self, keys: Iterable[str], deadline: float) -> dict[str, dict]:
        """All ``keys``' records, or an error naming the ones missing at ``deadline``."""
        pending, found, pause = list(keys), {}, 0.002
        while True:
            for key in list(pending):
                value = self.get(key)
                if value is not None:
                    found[key] = value
                    pending.remove(key)
            if not pending:
                return found
            if time.monotonic() >= deadline:
                raise RecordsMissing(f"group '{self.group_name}': records did not arrive before the deadline: "
                                     f"{sorted(pending)}", sorted(pending))
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


class StoreRendezvous(Rendezvous):
    """The same records in the c10d store torch.distributed hands a backend."""

    def __init__(self, store, group_name: str) -> None:
        super().__init__(group_name, "store")
        self.store = store

    def _put(self, key: str, raw: bytes) -> None:
        self.store.set(key, raw)

    def _get(self, key: str) -> Optional[bytes]:
        return self.store.get(key) if self.store.check([key]) else None

    def delete(self, key: str) -> None:
        try:
            self.store.delete_key(self.prefix + key)
        except RuntimeError:
            pass  # the store's host may be gone already at shutdown
