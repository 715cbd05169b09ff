"""Elementwise reduction of received partials, with the tensor library's own ops on the device."""

from __future__ import annotations

import torch

REDUCE_OPS = ("sum", "product", "min", "max")
# torch splits a CPU op over its thread pool above 32768 elements; with every rank of a host
# busy, waiting for a pool thread to be scheduled cost 10-100x the add itself (measured: 8 ms
# for 128 Ki floats in an actor under load, 15 us alone), so CPU reductions go in serial pieces.
_SERIAL_ELEMENTS = 32768


def combine(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    """dst = dst (op) src, elementwise, in place, on the tensors' own device."""
    _serial(lambda d, s: _combine(d, s, op), dst, src)


def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst = src for flat buffers, in serial pieces on the CPU (see ``_SERIAL_ELEMENTS``)."""
    _serial(lambda d, s: d.copy_(s), dst, src)


def _serial(step, dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.device.type != "cpu" or dst.numel() <= _SERIAL_ELEMENTS:
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
