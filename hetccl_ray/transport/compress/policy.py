"""When a border link compresses: measured per link, decided per message.

``compress`` = ``"on"`` frames every float payload to a peer in another island, ``"off"``
none, ``"auto"`` those of at least ``MIN_BYTES`` when it saves time: the link's delivery
rate R (bytes/s the network takes: the median of the kernel's TCP estimates) against the
codec's measured ratio r and speeds (encode E, decode D, bytes of input per second).
Chunks are pipelined, so a compressed message costs about max(r / R, 1 / E, 1 / D)
seconds per byte against 1 / R raw; auto compresses when that is below ``GAIN`` / R. The
first eligible message is compressed to measure the codec, and while raw, every
``REPROBE``-th one is again, so a change of data is seen.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from hetccl_ray.transport.compress.planes import layout_for

MODES = ("auto", "on", "off")
MIN_BYTES = 64 << 10
GAIN = 0.9
REPROBE = 256
_KEEP = 0.7  # weight of the old value in the running estimates
_SAMPLES = 15


def _blend(old: Optional[float], new: float) -> float:
    return new if old is None else _KEEP * old + (1 - _KEEP) * new


@dataclass
class LinkPolicy:
    """One link's estimates and choice; every figure is a running estimate over messages."""

    mode: str = "auto"
    link_Bps: Optional[float] = None
    ratio: Optional[float] = None
    encode_Bps: Optional[float] = None
    decode_Bps: Optional[float] = None
    compressing: bool = False
    compressed: int = 0  # messages sent framed
    raw: int = 0  # eligible messages sent raw
    raw_bytes: int = 0  # payload bytes of the framed messages, and their bytes on the wire
    wire_bytes: int = 0
    _since_probe: int = 0
    _samples: deque = field(default_factory=lambda: deque(maxlen=_SAMPLES))

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"compress must be one of {MODES}, got {self.mode!r}")

    def eligible(self, nbytes: int, dtype: torch.dtype) -> bool:
        """Whether a message could be framed at all: a float payload, of any size with "on",
        of at least ``MIN_BYTES`` with "auto"."""
        return (self.mode == "on" or (self.mode == "auto" and nbytes >= MIN_BYTES)) and (
            nbytes > 0 and layout_for(dtype) is not None)

    def choose(self) -> bool:
        """Whether the next eligible message goes compressed."""
        if self.mode == "on":
            framed = True
        elif self.ratio is None:
            framed = True  # the first one measures the codec
        else:
            self._since_probe += 1
            self.compressing = self._saves_time()
            framed = self.compressing or self._since_probe % REPROBE == 0
        if framed:
            self.compressed += 1
        else:
            self.raw += 1
        return framed

    def _saves_time(self) -> bool:
        if self.link_Bps is None:
            return False
        decode = self.decode_Bps or self.encode_Bps
        per_byte = max(self.ratio / self.link_Bps, 1 / self.encode_Bps, 1 / decode)
        return per_byte < GAIN / self.link_Bps

    def note_link(self, delivery_Bps: float, app_limited: bool) -> None:
        """A delivery-rate sample of the link; the estimate is the median of the last
        ``_SAMPLES``, as a burst through a shaped link's token bucket reads at line rate. One
        the sender limited (it had nothing queued) counts only while there is no other."""
        if delivery_Bps <= 0 or (app_limited and self._samples):
            return
        if self._samples and self._samples[-1][1]:  # the lone sender-limited sample makes way
            self._samples.clear()
        self._samples.append((delivery_Bps, app_limited))
        self.link_Bps = statistics.median(rate for rate, _ in self._samples)

    def note_encode(self, raw: int, wire: int, seconds: float) -> None:
        """One framed message sent: its payload bytes, bytes on the wire, seconds coding."""
        if raw and seconds > 0:
            self.raw_bytes += raw
            self.wire_bytes += wire
            self.ratio = _blend(self.ratio, wire / raw)
            self.encode_Bps = _blend(self.encode_Bps, raw / seconds)

    def note_decode(self, raw: int, seconds: float) -> None:
        """One framed message received on this link: payload bytes, seconds decoding."""
        if raw and seconds > 0:
            self.decode_Bps = _blend(self.decode_Bps, raw / seconds)

    def describe(self) -> dict[str, Any]:
        """The choice and the estimates, for ``border_stats()`` and the bench header."""
        mb = lambda v: None if v is None else round(v / 1e6, 1)  # noqa: E731
        return {"mode": self.mode, "compressing": self.mode == "on" or self.compressing,
                "ratio": round(self.wire_bytes / self.raw_bytes, 4) if self.raw_bytes else None,
                "link_MBps": mb(self.link_Bps), "encode_MBps": mb(self.encode_Bps),
                "decode_MBps": mb(self.decode_Bps), "messages_compressed": self.compressed,
                "messages_raw": self.raw}
