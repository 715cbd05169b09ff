"""Floating-point elements as two byte planes: one byte per element that holds the exponent
(values cluster in a few codes for gradients and activations: entropy-coded) and the other
bytes (sign and mantissa, close to random: sent raw).

bfloat16 and float32 have 8 exponent bits that straddle the top two bytes; they are rotated
into one byte and the sign takes the exponent's low bit's place. float16 (5 exponent bits)
and float64 (11) code their top byte (sign, exponent, a little mantissa) as it is. Written
with torch ops on uint8 views, so the same code runs on CPU and GPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Layout:
    """How one dtype's elements split into a coded plane (1 byte) and a raw plane (the rest)."""

    itemsize: int
    rotate: bool  # True: the coded byte is the 8-bit exponent (bfloat16, float32); False: the top byte

    def split(self, raw: torch.Tensor, coded: torch.Tensor, rest: torch.Tensor) -> None:
        """Write the planes of ``raw`` (flat uint8, whole elements) into ``coded`` (one byte per
        element) and ``rest`` (itemsize - 1 bytes per element), all on one device."""
        b = raw.view(-1, self.itemsize)
        r = rest.view(-1, self.itemsize - 1)
        top, second = b[:, -1], b[:, -2]
        if self.itemsize > 2:
            r[:, :-1] = b[:, :-2]
        if self.rotate:
            torch.bitwise_left_shift(top, 1, out=coded)
            coded.bitwise_or_(second >> 7)
            torch.bitwise_and(top, 0x80, out=r[:, -1])
            r[:, -1].bitwise_or_(second & 0x7F)
        else:
            coded.copy_(top)
            r[:, -1] = second

    def join(self, coded: torch.Tensor, rest: torch.Tensor, out: torch.Tensor) -> None:
        """The inverse of :meth:`split`: the elements' bytes from their planes, into ``out``."""
        b = out.view(-1, self.itemsize)
        r = rest.view(-1, self.itemsize - 1)
        if self.itemsize > 2:
            b[:, :-2] = r[:, :-1]
        if self.rotate:
            torch.bitwise_right_shift(coded, 1, out=b[:, -1])
            b[:, -1].bitwise_or_(r[:, -1] & 0x80)
            torch.bitwise_left_shift(coded, 7, out=b[:, -2])
            b[:, -2].bitwise_or_(r[:, -1] & 0x7F)
        else:
            b[:, -1] = coded
            b[:, -2] = r[:, -1]


_LAYOUTS = {torch.bfloat16: Layout(2, True), torch.float32: Layout(4, True),
            torch.float16: Layout(2, False), torch.float64: Layout(8, False)}


def layout_for(dtype: torch.dtype) -> Optional[Layout]:
    """The plane layout of a floating-point dtype; None for the others (sent raw)."""
    return _LAYOUTS.get(dtype)


def entropy_bytes(coded: torch.Tensor) -> float:
    """Bytes an ideal entropy coder needs for the plane ``coded`` (from its histogram, computed
    where the plane lies), so a plane that will not shrink is not coded at all."""
    counts = torch.bincount(coded, minlength=256).to(torch.float64)
    p = counts[counts > 0] / coded.numel()
    return float(-(p * torch.log2(p)).sum()) * coded.numel() / 8
