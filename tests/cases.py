"""Inputs every rank can rebuild and the numpy reference each op must match."""

from __future__ import annotations

import numpy as np
import torch

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8"]
SIZES = [1, 7, 1031, 65539]
REDUCE_OPS = {"SUM": np.sum, "PRODUCT": np.prod, "MIN": np.min, "MAX": np.max}


def values(rank: int, n: int, seed: int, low: int = 0, high: int = 4) -> np.ndarray:
    """Small integers, exact in every dtype, so any order of reduction gives one answer."""
    return np.random.default_rng([seed, rank]).integers(low, high, size=n).astype(np.float64)


def make(data: np.ndarray, dtype: str, lib: str):
    """``data`` as a numpy array or torch tensor of ``dtype`` (bfloat16 exists in torch only)."""
    if lib == "numpy":
        return data.astype(dtype)
    return torch.tensor(data, dtype=getattr(torch, dtype))


def as_float(tensor) -> np.ndarray:
    """Any result as float64 numpy, for comparison."""
    if isinstance(tensor, torch.Tensor):
        return tensor.to(torch.float64).numpy()
    return np.asarray(tensor, dtype=np.float64)


def libs(dtype: str) -> list[str]:
    return ["torch"] if dtype == "bfloat16" else ["numpy", "torch"]


def seed_of(*parts) -> int:
    """A seed that is the same in every process (``hash`` of a str is not)."""
    import zlib

    return zlib.crc32(repr(parts).encode())


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as in DTYPES."""
    return torch.tensor([], dtype=getattr(torch, dtype)).element_size()
