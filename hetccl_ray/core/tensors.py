"""User tensors (numpy, torch, cupy) to flat torch buffers and back, with clear errors."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from hetccl_ray.memory import devices
from hetccl_ray.errors import HetCCLInputError, HetCCLTypeError

# dtypes every op takes (reductions in their own arithmetic); codes are their index (keep the order)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                    torch.int32, torch.int64, torch.uint8, torch.int8, torch.int16)
_NAMES = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)


def dtype_code(dtype: torch.dtype) -> int:
    """A small number naming the dtype in border headers."""
    return SUPPORTED_DTYPES.index(dtype)


def to_torch(tensor: Any, moving: bool = False) -> torch.Tensor:
    """A torch view of a numpy array, torch tensor or cupy array, sharing its memory.
    ``moving``: the op only moves bytes (broadcast, gathers, all-to-all, send/recv), so any
    dtype goes (bool, complex, float8, ...), as its bytes."""
    if isinstance(tensor, torch.Tensor):
        out = tensor
    elif isinstance(tensor, np.ndarray):
        if (tensor.dtype.kind not in "fiu" and not moving) or tensor.dtype.byteorder == ">":
            raise HetCCLTypeError(f"unsupported numpy dtype {tensor.dtype}; supported: {_NAMES}")
        out = torch.from_numpy(np.ascontiguousarray(tensor) if tensor.strides and min(tensor.strides) < 0
                               else tensor)
    elif hasattr(tensor, "__cuda_array_interface__") or hasattr(tensor, "__dlpack__"):
        out = torch.from_dlpack(tensor)
    else:
        raise HetCCLTypeError(f"unsupported tensor type {type(tensor).__name__}; supported: numpy.ndarray, "
                        "torch.Tensor, cupy.ndarray")
    if out.is_sparse or out.is_quantized:
        raise HetCCLTypeError("sparse and quantized tensors are not supported; pass a dense tensor")
    if out.dtype not in SUPPORTED_DTYPES and not moving:
        raise HetCCLTypeError(f"unsupported dtype {out.dtype} for a reduction; supported: {_NAMES} (and complex "
                              f"for sum, through the torch backend); ops that only move data take any dtype")
    # a collective writes memory, as c10d's do, outside autograd: copies into or from a tensor that
    # requires grad would be recorded (in place on a leaf: refused) on whichever thread runs the op
    return out.detach() if out.requires_grad else out


class Operand:
    """A user tensor as a flat contiguous buffer; ``write_back`` copies results into it.

    Contiguous tensors are used in place (no copy). Non-contiguous ones, and numpy arrays
    with negative strides, are worked on in a contiguous copy that is copied back.
    """

    def __init__(self, tensor: Any, moving: bool = False) -> None:
        self.user = tensor
        self.view = to_torch(tensor, moving)
        self.in_place = self.view.is_contiguous() and (
            not isinstance(tensor, np.ndarray) or self.view.data_ptr() == tensor.ctypes.data)
        if self.in_place:
            self.contiguous = self.view
        else:  # the copy is device work on the caller's stream, before the op's entry event
            self.contiguous = torch.empty(self.view.shape, dtype=self.view.dtype, device=self.view.device)
            devices.of(self.view).launch(None, self.contiguous.copy_, self.view)
        self.flat = self.contiguous if self.contiguous.dim() == 1 else self.contiguous.reshape(-1)
        if self.flat.dtype not in SUPPORTED_DTYPES:  # moved as bytes: every rank sees the same count
            self.flat = self.flat.view(torch.uint8)

    @property
    def numel(self) -> int:
        return self.flat.numel()

    def write_back(self) -> None:
        """Results into the user's tensor (device work: groups launch it on the op's stream)."""
        if self.in_place:
            return
        if isinstance(self.user, np.ndarray):
            self.user[...] = self.contiguous.numpy()
        else:
            self.view.copy_(self.contiguous)


def same_kind(reference: torch.Tensor, others: Sequence[torch.Tensor], what: str, sizes: bool = True) -> None:
    """Every flat buffer of one call has the reference's dtype, device and (with ``sizes``)
    element count."""
    def kind(t: torch.Tensor) -> tuple:
        return (t.dtype, t.device) + ((t.numel(),) if sizes else ())

    want = kind(reference)
    for i, other in enumerate(others):
        if kind(other) != want:
            count = f" with {reference.numel()}" if sizes else ""
            raise HetCCLInputError(
                f"{what}[{i}] is {other.dtype} on {other.device} with {other.numel()} elements; "
                f"expected {reference.dtype} on {reference.device}{count}")
