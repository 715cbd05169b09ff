"""Per-group options: set from the driver through Ray's KV, defaults from the environment."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Optional

from hetccl_ray.transport.compress.policy import MODES as COMPRESS_MODES
from hetccl_ray.transport.choice import TRANSPORTS

DEFAULT_TIMEOUT_S = 300.0
FLAT_MODES = ("auto", "on", "off")


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


@dataclass
class GroupOptions:
    """What a hetccl group can be told.

    timeout_s: deadline of every collective and connection step (``HETCCL_TIMEOUT_S``).
    islands: group rank -> island name, overriding labels (``HETCCL_ISLAND`` per process).
    max_lanes: cap on cross-island lanes (``HETCCL_MAX_LANES``).
    bind_host: address border listeners bind to (``HETCCL_BIND_HOST``; default node IP).
    piece_bytes: large allreduces go in pieces of this size, border stage of one piece
        overlapping the island stages of the next (``HETCCL_PIECE_BYTES``).
    transport: "auto" (RDMA to a peer when both ends have a usable port, else TCP), "tcp" or
        "rdma" (an error where an end has no RDMA port) (``HETCCL_TRANSPORT``).
    check_calls: before a large collective, ranks compare what they called (op, dtype,
        count, root, reduce op) in one round of rows (small_round.py) and raise on a mismatch, naming
        the ranks (``HETCCL_CHECK_CALLS=0`` saves that round; small collectives carry the rows
        in their own messages, so they are still checked, except a small broadcast, which then
        takes two hops with no rows).
    strict: also check the calls of a group of one island on device tensors, whose ops are
        otherwise the vendor op alone on the stream (a host round per op; ``HETCCL_STRICT=1``,
        as torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``).
    small_bytes: collectives up to this size (nccl-tests' size: the gathered
        output of allgather, the input of reducescatter) take the small-message round
        (``HETCCL_SMALL_BYTES``; default: from the cost model measured at formation).
    flat: the flat plan, one Gloo op over every rank for CPU tensors (after the call check):
        "auto" (where the cost model measured at formation says it is faster than the
        hierarchical plan: one host, a fast network), "on" (every call above the small
        round's size) or "off" (``HETCCL_FLAT``).
    one_hop: the small round and the call check in one hop, every rank to every rank (rounds.py),
        instead of three through the island leaders. Only the leaders' hop crosses the border,
        so it saves the two hops inside the islands: for islands whose own hops are network
        latency (islands of several nodes); more bytes cross the border (``HETCCL_ONE_HOP=1``).
    compress: lossless compression of float payloads to other islands over TCP: "auto"
        (each link compresses when its measured rate and the codec's speed and ratio say it
        saves time), "on" or "off" (``HETCCL_COMPRESS``; compress/policy.py).
    same_host: the TCP border reaches ranks of the same host and network namespace over
        Unix sockets, as NCCL's SHM transport within a node (``HETCCL_SAME_HOST=0``: TCP
        to every rank).
    reuse_costs: a group formed again on a topology whose costs rank 0's process measured at
        an earlier formation (same islands, links and options) takes them instead of racing
        again (torchft re-forms the group at every quorum change; ``HETCCL_REUSE_COSTS=1``).
    """

    timeout_s: float = field(default_factory=lambda: _env_float("HETCCL_TIMEOUT_S", DEFAULT_TIMEOUT_S))
    islands: dict[int, str] = field(default_factory=dict)
    max_lanes: Optional[int] = field(default_factory=lambda: int(os.environ["HETCCL_MAX_LANES"])
                                     if os.environ.get("HETCCL_MAX_LANES") else None)
    bind_host: Optional[str] = field(default_factory=lambda: os.environ.get("HETCCL_BIND_HOST") or None)
    piece_bytes: int = field(default_factory=lambda: int(_env_float("HETCCL_PIECE_BYTES", 4 << 20)))
    transport: str = field(default_factory=lambda: os.environ.get("HETCCL_TRANSPORT") or "auto")
    check_calls: bool = field(default_factory=lambda: os.environ.get("HETCCL_CHECK_CALLS", "1") != "0")
    strict: bool = field(default_factory=lambda: os.environ.get("HETCCL_STRICT", "0") not in ("", "0"))
    small_bytes: Optional[int] = field(default_factory=lambda: int(os.environ["HETCCL_SMALL_BYTES"])
                                       if os.environ.get("HETCCL_SMALL_BYTES") else None)
    compress: str = field(default_factory=lambda: os.environ.get("HETCCL_COMPRESS") or "auto")
    flat: str = field(default_factory=lambda: os.environ.get("HETCCL_FLAT") or "auto")
    one_hop: bool = field(default_factory=lambda: os.environ.get("HETCCL_ONE_HOP", "0") not in ("", "0"))
    same_host: bool = field(default_factory=lambda: os.environ.get("HETCCL_SAME_HOST", "1") != "0")
    reuse_costs: bool = field(default_factory=lambda: os.environ.get("HETCCL_REUSE_COSTS", "0") not in ("", "0"))

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.piece_bytes < 1:
            raise ValueError(f"piece_bytes must be >= 1, got {self.piece_bytes}")
        if self.small_bytes is not None and self.small_bytes < 0:
            raise ValueError(f"small_bytes must be >= 0, got {self.small_bytes}")
        if self.max_lanes is not None and self.max_lanes < 1:
            raise ValueError(f"max_lanes must be >= 1, got {self.max_lanes}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.compress not in COMPRESS_MODES:
            raise ValueError(f"compress must be one of {COMPRESS_MODES}, got {self.compress!r}")
        if self.flat not in FLAT_MODES:
            raise ValueError(f"flat must be one of {FLAT_MODES}, got {self.flat!r}")
        self.islands = {int(rank): str(name) for rank, name in self.islands.items()}

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, raw: Optional[bytes]) -> "GroupOptions":
        return cls(**json.loads(raw)) if raw else cls()


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


@dataclass(frozen=True)
class ProcessOptions:
    """What each rank's own process environment says (per host or per process, so read where
    the rank runs, never shipped from the driver), validated once at formation.

    island: this process's island (``HETCCL_ISLAND``), below ``GroupOptions.islands``.
    rdma_devices: only these RDMA devices (``HETCCL_RDMA_DEVICES``, comma list).
    rdma_gid_index: the GID table entry to use (``HETCCL_RDMA_GID_INDEX``).
    """

    island: Optional[str] = None
    rdma_devices: tuple[str, ...] = ()
    rdma_gid_index: Optional[int] = None

    def __post_init__(self) -> None:
        if self.island is not None and (not self.island or self.island != self.island.strip()):
            raise ValueError(f"HETCCL_ISLAND must be a name without surrounding spaces, got {self.island!r}")
        if self.rdma_gid_index is not None and self.rdma_gid_index < 0:
            raise ValueError(f"HETCCL_RDMA_GID_INDEX must be >= 0, got {self.rdma_gid_index}")

    @classmethod
    def from_env(cls) -> "ProcessOptions":
        return cls(os.environ.get("HETCCL_ISLAND") or None,
                   tuple(d.strip() for d in os.environ.get("HETCCL_RDMA_DEVICES", "").split(",") if d.strip()),
                   _env_int("HETCCL_RDMA_GID_INDEX"))
