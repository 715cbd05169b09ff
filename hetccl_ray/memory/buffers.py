"""Flat buffers, shared by the collective and transport layers: elementwise reduction and
copy (one numpy call, or serial pieces, on the CPU), spans, and the one get-or-grow scratch pool."""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import numpy as np
import torch

REDUCE_OPS = ("sum", "product", "min", "max")
# torch splits a CPU op over its thread pool above 32768 elements; with every rank of a host
# busy, waiting for a pool thread to be scheduled cost 10-100x the add itself (measured: 8 ms
# for 128 Ki floats in an actor under load, 15 us alone), so CPU reductions go in serial pieces.
_SERIAL_ELEMENTS = 32768


_NUMPY_OPS = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum}


def combine(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    """dst = dst (op) src, elementwise, in place, on the tensors' own device."""
    if op in _NUMPY_OPS and dst.dtype != torch.bfloat16 and _plain(dst, src):
        _NUMPY_OPS[op](dst.numpy(), src.numpy(), out=dst.numpy())
        return
    _serial(lambda d, s: _combine(d, s, op), dst, src)


def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst = src for flat buffers (up to ``_SERIAL_ELEMENTS`` torch's own copy: serial there,
    and a few times cheaper to call than numpy's)."""
    if dst.numel() <= _SERIAL_ELEMENTS:
        dst.copy_(src)
    elif _plain(dst, src):
        np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
    else:
        _serial(lambda d, s: d.copy_(s), dst, src)


def _plain(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether both are contiguous CPU tensors of one dtype and shape outside autograd: then
    one numpy call does the work, serially, with no pool and no call per piece (a 16 MiB copy
    1.6x faster than in serial pieces). Else torch works in serial pieces (``_SERIAL_ELEMENTS``)."""
    return (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype and dst.numel() > 1
            and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous()
            and not (dst.requires_grad or src.requires_grad))


def _serial(step, dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.numel() <= _SERIAL_ELEMENTS or dst.device.type != "cpu":
        step(dst, src)
        return
    for start in range(0, dst.numel(), _SERIAL_ELEMENTS):
        step(dst[start:start + _SERIAL_ELEMENTS], src[start:start + _SERIAL_ELEMENTS])


def _combine(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    if op == "sum":
        dst.add_(src)
    elif op == "product":
        dst.mul_(src)
    elif op == "min":
        torch.minimum(dst, src, out=dst)
    elif op == "max":
        torch.maximum(dst, src, out=dst)
    else:
        raise ValueError(f"unsupported reduce op {op!r}; supported: {', '.join(REDUCE_OPS)}")


def overlap(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether any contiguous tensor of ``a`` shares a byte with one of ``b`` (told from the
    address ranges they span where those are apart: blocks of two buffers, every call)."""
    spans = [(t.device, t.data_ptr(), t.data_ptr() + t.nbytes) for t in b if t.numel()]
    mine = [(x.device, x.data_ptr(), x.data_ptr() + x.nbytes) for x in a if x.numel()]
    if not spans or not mine or min(s for _, s, _ in mine) >= max(e for _, _, e in spans) or \
            min(s for _, s, _ in spans) >= max(e for _, _, e in mine):
        return False
    return any(dx == device and sx < end and start < ex for dx, sx, ex in mine for device, start, end in spans)


def view(buf: torch.Tensor, span: tuple[int, int]) -> torch.Tensor:
    """The ``(offset, length)`` span of a flat buffer (the buffer itself where the span is all
    of it: a slice costs a tensor, about a microsecond, on every small call)."""
    offset, length = span
    return buf if offset == 0 and length == buf.numel() else buf[offset:offset + length]


class ScratchPool:
    """Buffers kept between calls (fresh memory is slow to touch): the one get-or-grow."""

    def __init__(self) -> None:
        self._buffers: dict[Hashable, torch.Tensor] = {}

    def grown(self, key: Hashable, n: int, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """The first ``n`` elements of the buffer kept under ``key``, made (by ``make(n)``)
        when there is none or it is smaller."""
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            buf = self._buffers[key] = make(n)
        return buf[:n]

    def clear(self) -> None:
        """Let go of every buffer (pinned host memory included) at close."""
        self._buffers.clear()

    def get(self, slot: Hashable, n: int, like: torch.Tensor) -> torch.Tensor:
        """``n`` elements of ``like``'s dtype on its device."""
        return self.grown((slot, like.dtype, like.device), n,
                          lambda size: torch.empty(size, dtype=like.dtype, device=like.device))
