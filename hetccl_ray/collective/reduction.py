"""Elementwise reduction of received partials, with the tensor library's own ops on the device."""

from __future__ import annotations

import torch

REDUCE_OPS = ("sum", "product", "min", "max")


def combine(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    """dst = dst (op) src, elementwise, in place, on the tensors' own device."""
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
