"""What benchmarks and tests send: a constant fill, real gradients, or random bits.

Compression makes the content matter: a constant compresses to nothing, random bits not at
all, and real training data in between. ``gradients`` trains a small MLP for a few steps
(no downloads) and returns its gradients, step after step, as one flat tensor; rank r sends
them rotated by r blocks, so ranks differ while every rank can compute what all sent.
"""

from __future__ import annotations

import functools

import torch

DATA = ("fill", "grads", "random")
_WIDTH, _BATCH = 512, 64
_SHIFT = 7919  # elements each rank's data is rotated by, times its rank


@functools.lru_cache(maxsize=4)
def gradients(count: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """``count`` gradient values of a 4-layer MLP (2.1 M parameters) learning a smooth target
    with Adam, in ``dtype``: the gradients of successive steps, concatenated."""
    gen = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(_WIDTH, 4 * _WIDTH), torch.nn.GELU(),
                                torch.nn.Linear(4 * _WIDTH, _WIDTH), torch.nn.LayerNorm(_WIDTH),
                                torch.nn.Linear(_WIDTH, _WIDTH))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.02))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    target = torch.randn(_WIDTH, _WIDTH, generator=gen) / _WIDTH ** 0.5
    grads, have = [], 0
    while have < count:
        x = torch.randn(_BATCH, _WIDTH, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), torch.sin(x @ target))
        optim.zero_grad()
        loss.backward()
        optim.step()
        step = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        grads.append(step)
        have += step.numel()
    return torch.cat(grads)[:count].to(dtype)


def random_bits(count: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Incompressible data: uniformly random bits, except exponents of all ones (inf, NaN),
    which become zero, so reductions stay finite-or-inf and comparable."""
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    raw = torch.randint(0, 256, (count * itemsize,), dtype=torch.uint8, generator=gen)
    x = raw.view(dtype)
    if dtype.is_floating_point:
        x[~torch.isfinite(x)] = 0
    return x


def rank_data(kind: str, rank: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """What rank ``rank`` sends: ``rank + 1`` everywhere (fill), or the shared gradients or
    random bits rotated by ``rank`` blocks. A fresh tensor the caller may overwrite."""
    if kind == "fill":
        return torch.full((count,), rank + 1.0, dtype=dtype)
    if kind not in DATA:
        raise ValueError(f"unknown data {kind!r}; choose from {DATA}")
    base = gradients(count, dtype) if kind == "grads" else random_bits(count, dtype)
    return torch.roll(base, rank * _SHIFT).clone()
