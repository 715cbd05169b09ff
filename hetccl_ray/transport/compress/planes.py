"""Floating-point elements as two byte planes: the top byte of each element (sign and the
high exponent bits: values cluster in a few codes for gradients and activations, so it is
entropy-coded) and the other bytes (low exponent bits and mantissa, close to random: sent
raw).

Measured on bf16 and fp32 gradients (benchdata.py): moving the whole 8-bit exponent into
one byte and the sign out of it codes that plane 0.003-0.006 better (of the whole message)
but splits at a quarter of the speed, so the split is by bytes. Planes are host memory
(a border moves host bytes), split with numpy's operators on integer views.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


def array(tensor: torch.Tensor) -> np.ndarray:
    """What the plane functions work on: a numpy view of a host tensor (numpy's element-wise
    ops run on the calling thread, where torch's may start a thread pool that spins against
    the other ranks on a shared host)."""
    return tensor.numpy()


_INTS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


@dataclass(frozen=True)
class Layout:
    """How one dtype's elements split into a coded plane (the top byte of each) and a raw
    plane (the other bytes). Works on whole elements as integers, one vectorised op per step
    (no strided byte access): 10-18 GB/s here where copying byte columns went at 3.5.

    The raw plane is stored planar, widest piece first: for 1 byte per element [1], for 3
    [2, 1], for 7 [4, 2, 1] bytes per element.
    """

    itemsize: int

    @property
    def _pieces(self) -> list[tuple[int, int]]:
        """(bytes, bit offset in the element) of each planar piece of the raw plane."""
        pieces, offset, left = [], 0, self.itemsize - 1
        for width in (4, 2, 1):
            if left >= width:
                pieces.append((width, offset))
                offset, left = offset + 8 * width, left - width
        return pieces

    def _rest_views(self, rest: np.ndarray, n: int) -> list[np.ndarray]:
        views, at = [], 0
        for width, _ in self._pieces:
            views.append(rest[at:at + n * width].view(_INTS[width]))
            at += n * width
        return views

    def split(self, raw: np.ndarray, coded: np.ndarray, rest: np.ndarray) -> None:
        """Write the planes of ``raw`` (flat uint8, whole elements) into ``coded`` (one byte per
        element) and ``rest`` (itemsize - 1 bytes per element)."""
        u = raw.view(_INTS[self.itemsize])
        coded[:] = u >> 8 * (self.itemsize - 1)  # assigning truncates to the low byte: the top one
        for view, (_, offset) in zip(self._rest_views(rest, len(coded)), self._pieces):
            view[:] = u >> offset if offset else u  # truncated to the piece's width

    def join(self, coded: np.ndarray, rest: np.ndarray, out: np.ndarray) -> None:
        """The inverse of :meth:`split`: the elements' bytes from their planes, into ``out``."""
        o = out.view(_INTS[self.itemsize])
        t = np.empty_like(o)
        o[:] = coded
        o <<= 8 * (self.itemsize - 1)
        for view, (width, offset) in zip(self._rest_views(rest, len(coded)), self._pieces):
            t[:] = view
            t &= (1 << (8 * width)) - 1  # undo the sign extension of the piece
            if offset:
                t <<= offset
            o |= t


_LAYOUTS = {dtype: Layout(torch.tensor([], dtype=dtype).element_size())
            for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64)}


def layout_for(dtype: torch.dtype) -> Optional[Layout]:
    """The plane layout of a floating-point dtype; None for the others (sent raw)."""
    return _LAYOUTS.get(dtype)


def entropy_bytes(coded: np.ndarray, sample_bytes: int = 16384) -> float:
    """Bytes an ideal entropy coder needs for the plane ``coded``, from the histogram of its
    first ``sample_bytes``, so a plane that will not shrink is not coded at all."""
    sample = coded[:sample_bytes]
    counts = np.bincount(sample, minlength=256)
    p = counts[counts > 0] / len(sample)
    return float(-(p * np.log2(p)).sum()) * len(coded) / 8
