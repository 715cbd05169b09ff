"""Which op each rank is in, published where peers can read it: a timed-out rank names the
ranks that did not arrive, and the ranks that arrived with another call."""

from __future__ import annotations

import threading
import time
from typing import Optional

from hetccl_ray.core.calls import Call
from hetccl_ray.group.rendezvous import Rendezvous

_PROGRESS_PERIOD_S = 0.1
_PUBLISH_AFTER_S = 0.3  # an op running this long is published: quick ops cost no KV write


class Progress:
    """Publishes this rank's op (its number and call row) once it has run ``_PUBLISH_AFTER_S``
    (a rank waiting for a missing peer, or for one that took another path, is such a rank),
    so a timed-out peer can name who is missing and who called something else. Quick ops
    publish nothing: a KV write per op cost one-island 16 MiB allreduces 3-6% on 2 cores."""

    def __init__(self, rendezvous: Rendezvous, rank: int) -> None:
        self.seq, self._published, self._started = 0, -1, time.monotonic()
        self._call: Optional[Call] = None
        self._rendezvous, self._rank = rendezvous, rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"hetccl-progress-{rank}")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(_PROGRESS_PERIOD_S):
            if time.monotonic() - self._started >= _PUBLISH_AFTER_S:
                self.publish()

    def start(self, seq: int, call: Optional[Call] = None) -> None:
        """This rank starts op ``seq``, the ``call`` it made."""
        self.seq, self._call, self._started = seq, call, time.monotonic()

    def publish(self) -> None:
        seq, call = self.seq, self._call
        if seq != self._published:
            self._rendezvous.put(f"progress/{self._rank}",
                                 {"seq": seq, "call": call.encode() if call is not None and call.seq == seq else []})
            self._published = seq

    def seen(self, world_size: int) -> dict[int, tuple[int, list[int]]]:
        """Every rank's last published op: its number and call row (empty: not known)."""
        time.sleep(_PUBLISH_AFTER_S + 3 * _PROGRESS_PERIOD_S)  # every rank waiting has published by then
        out = {}
        for r in range(world_size):
            record = self._rendezvous.get(f"progress/{r}") or {"seq": 0}
            out[r] = (record["seq"], list(record.get("call") or []))
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
