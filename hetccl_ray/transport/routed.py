"""One Border over several transports: each peer's messages go where its lane's choice says."""

from __future__ import annotations

from typing import Any, Optional

import torch

from hetccl_ray.transport.base import Border, Handle, Tag


class RoutedBorder:
    """Sends to peers in ``routes`` through their border, to every other peer through ``default``
    (the TCP border, whose listener address and refusal counter this border reports)."""

    def __init__(self, default: Any, routes: Optional[dict[int, Border]] = None) -> None:
        self.default = default
        self.routes = dict(routes or {})
        self.rank = default.rank
        self._every = list({id(b): b for b in [default, *self.routes.values()]}.values())  # each border once

    def __repr__(self) -> str:
        rdma = sorted(self.routes)
        return f"RoutedBorder(rank={self.rank}, tcp={self.default!r}, rdma_peers={rdma})"

    @property
    def routed_peers(self) -> list[int]:
        """The peers reached through a border of their own (RDMA), not ``default``."""
        return sorted(self.routes)

    @property
    def address(self) -> tuple[str, int]:
        return self.default.address

    @property
    def rejected(self) -> int:
        return self.default.rejected

    def _total(self, counter: str) -> int:
        return sum(getattr(b, counter) for b in self._every)

    bytes_sent = property(lambda self: self._total("bytes_sent"))
    bytes_received = property(lambda self: self._total("bytes_received"))
    wire_bytes_sent = property(lambda self: self._total("wire_bytes_sent"))  # fewer where compressed
    wire_bytes_received = property(lambda self: self._total("wire_bytes_received"))
    messages_sent = property(lambda self: self._total("messages_sent"))

    def compression(self) -> dict[int, dict]:
        """Each compressing link's choice and estimates, by peer (TCP links only)."""
        return self.default.compression()

    def gone(self, peer: int) -> bool:
        """Whether ``peer``'s TCP link says its process is gone (every rank has one)."""
        return self.default.gone(peer)

    @property
    def device_paths(self) -> dict[str, str]:
        """How each device kind's memory has reached the RDMA NICs (once tried); the TCP border
        moves host memory only, so device buffers to its peers are staged."""
        return {kind: path for border in self._every for kind, path in getattr(border, "device_paths", {}).items()}

    def device_memory(self, peer: int, device: Any) -> bool:
        return self.routes.get(peer, self.default).device_memory(peer, device)

    def isend(self, peer: int, buf: torch.Tensor, tag: Tag) -> Handle:
        return self.routes.get(peer, self.default).isend(peer, buf, tag)

    def irecv(self, peer: int, buf: torch.Tensor, tag: Tag, op: Optional[str] = None) -> Handle:
        return self.routes.get(peer, self.default).irecv(peer, buf, tag, op=op)

    def close(self) -> None:
        for border in self._every:
            border.close()
