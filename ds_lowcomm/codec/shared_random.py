"""Randomness every rank draws alike with no message: a generator seeded on the CPU (whatever the
device, so the draw is the same bits on every rank and accelerator), then moved. Used where the
ranks must agree on a choice without sending it: Dion's starting factors."""

from __future__ import annotations

import torch


def shared_generator(*seed: int) -> torch.Generator:
    """A CPU generator seeded from the integers ``seed`` (e.g. a sync's number and a tensor's
    position): the same stream on every rank that passes the same integers."""
    mixed = 0
    for part in seed:  # a fixed mix, not Python's hash (salted per process)
        mixed = (mixed * 1_000_003 + int(part)) % (2**62)
    return torch.Generator().manual_seed(mixed)


def shared_randn(rows: int, cols: int, *seed: int, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A (rows, cols) standard normal matrix drawn from ``seed``, the same on every rank."""
    return torch.randn(rows, cols, generator=shared_generator(*seed)).to(device=device, dtype=dtype)


def orthonormal_columns(p: torch.Tensor) -> torch.Tensor:
    """An orthonormal basis of ``p``'s columns (reduced QR, Householder, in fp32); a zero ``p``
    is returned as it is (nothing to span)."""
    p = p.float()
    return torch.linalg.qr(p).Q if p.any() else p
