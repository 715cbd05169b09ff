"""Floating-point elements as two byte planes: one byte per element that holds the exponent
(values cluster in a few codes for gradients and activations: entropy-coded) and the other
bytes (sign and mantissa, close to random: sent raw).

bfloat16 and float32 have 8 exponent bits that straddle the top two bytes; they are rotated
into one byte and the sign takes the exponent's low bit's place. float16 (5 exponent bits)
and float64 (11) code their top byte (sign, exponent, a little mantissa) as it is. Written
with operators only, so one code runs on numpy views of CPU tensors and on GPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch


Array = Union[np.ndarray, torch.Tensor]


def array(tensor: torch.Tensor) -> Array:
    """What the plane functions work on: a numpy view of a CPU tensor (numpy's element-wise
    ops run on the calling thread, where torch's may start a thread pool that spins against
    the other ranks on a shared host), the tensor itself on a device."""
    return tensor.numpy() if tensor.device.type == "cpu" else tensor


@dataclass(frozen=True)
class Layout:
    """How one dtype's elements split into a coded plane (1 byte) and a raw plane (the rest).
    Its functions take uint8 numpy arrays or torch tensors alike (operators only)."""

    itemsize: int
    rotate: bool  # True: the coded byte is the 8-bit exponent (bfloat16, float32); False: the top byte

    def split(self, raw: Array, coded: Array, rest: Array) -> None:
        """Write the planes of ``raw`` (flat uint8, whole elements) into ``coded`` (one byte per
        element) and ``rest`` (itemsize - 1 bytes per element), all on one device."""
        b = raw.reshape(-1, self.itemsize)
        r = rest.reshape(-1, self.itemsize - 1)
        top, second = b[:, -1], b[:, -2]
        if self.itemsize > 2:
            r[:, :-1] = b[:, :-2]
        if self.rotate:
            coded[:] = (top << 1) | (second >> 7)
            r[:, -1] = (top & 0x80) | (second & 0x7F)
        else:
            coded[:] = top
            r[:, -1] = second

    def join(self, coded: Array, rest: Array, out: Array) -> None:
        """The inverse of :meth:`split`: the elements' bytes from their planes, into ``out``."""
        b = out.reshape(-1, self.itemsize)
        r = rest.reshape(-1, self.itemsize - 1)
        if self.itemsize > 2:
            b[:, :-2] = r[:, :-1]
        if self.rotate:
            b[:, -1] = (coded >> 1) | (r[:, -1] & 0x80)
            b[:, -2] = (coded << 7) | (r[:, -1] & 0x7F)
        else:
            b[:, -1] = coded
            b[:, -2] = r[:, -1]


_LAYOUTS = {torch.bfloat16: Layout(2, True), torch.float32: Layout(4, True),
            torch.float16: Layout(2, False), torch.float64: Layout(8, False)}


def layout_for(dtype: torch.dtype) -> Optional[Layout]:
    """The plane layout of a floating-point dtype; None for the others (sent raw)."""
    return _LAYOUTS.get(dtype)


def entropy_bytes(coded: Array) -> float:
    """Bytes an ideal entropy coder needs for the plane ``coded`` (from its histogram, computed
    where the plane lies), so a plane that will not shrink is not coded at all."""
    if isinstance(coded, np.ndarray):
        counts = np.bincount(coded, minlength=256)
    else:
        counts = torch.bincount(coded, minlength=256).cpu().numpy()
    p = counts[counts > 0] / len(coded)
    return float(-(p * np.log2(p)).sum()) * len(coded) / 8
