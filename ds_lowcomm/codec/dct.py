"""Chunked orthonormal DCT-II.

A tensor is viewed as a matrix (rows, cols): 2-D tensors as they are, higher ranks as
(shape[0], prod(shape[1:])), 1-D tensors and scalars as a single row. The matrix is cut into
blocks (h, w), h and w the largest divisors of rows and cols not above the chunk size. A vector
is cut into pieces as large as a matrix block: one piece (a 1 x n block) when it is at most
chunk*chunk long, else pieces of chunk*chunk with the tail zero-padded, each read row-major as a
chunk x chunk block, so that a long vector costs 2*chunk multiply-adds per element, as a matrix
does, not chunk*chunk (vectors include ZeRO's flat partitions, whose lengths need not have a
useful divisor). Every block gets the 2-D orthonormal DCT-II
C_h @ B @ C_w^T in one batched matmul; its coefficients are returned flattened, one row per
block, so per-block top-k is a plain ``topk(dim=-1)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch


def largest_divisor_at_most(n: int, cap: int) -> int:
    """The largest divisor of ``n`` that is not above ``cap`` (1 when n is prime and > cap)."""
    if n <= cap:
        return n
    for d in range(cap, 0, -1):
        if n % d == 0:
            return d
    return 1


@dataclass(frozen=True)
class ChunkPlan:
    """How one tensor shape is cut into DCT blocks."""

    shape: tuple[int, ...]
    rows: int
    cols: int
    h: int
    w: int
    pad: int = 0  # zeros appended to a vector to fill its last piece

    @classmethod
    def for_shape(cls, shape, chunk: int) -> "ChunkPlan":
        shape = tuple(int(s) for s in shape)
        if len(shape) >= 2:
            rows, cols = shape[0], math.prod(shape[1:])
            h, w = largest_divisor_at_most(rows, chunk), largest_divisor_at_most(cols, chunk)
        else:
            n = math.prod(shape)  # math.prod(()) == 1 for scalars
            if n > chunk * chunk:  # pieces of chunk*chunk, each a chunk x chunk block (separable 2-D DCT)
                pad = -n % (chunk * chunk)
                return cls(shape, (n + pad) // chunk, chunk, chunk, chunk, pad)
            return cls(shape, 1, n, 1, n)
        return cls(shape, rows, cols, h, w)

    @property
    def numel(self) -> int:
        return self.rows * self.cols - self.pad

    @property
    def num_blocks(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)

    @property
    def block_size(self) -> int:
        return self.h * self.w


@lru_cache(maxsize=None)
def _basis_cpu64(n: int) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    basis = torch.cos(math.pi * (2 * i + 1) * k / (2 * n))
    basis[0] *= math.sqrt(1.0 / n)
    basis[1:] *= math.sqrt(2.0 / n)
    return basis


_BASES: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def dct_basis(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Orthonormal DCT-II matrix C (n x n): y = C @ x, x = C.T @ y. Cached per (n, dtype, device)."""
    key = (n, dtype, torch.device(device))
    basis = _BASES.get(key)
    if basis is None:
        basis = _basis_cpu64(n).to(dtype=dtype, device=device)
        _BASES[key] = basis
    return basis


def to_blocks(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """(rows, cols) view of x -> (num_blocks, h, w), blocks in row-major order."""
    r, c = plan.rows // plan.h, plan.cols // plan.w
    if plan.pad:
        x = torch.nn.functional.pad(x.reshape(-1), (0, plan.pad))
    return x.reshape(r, plan.h, c, plan.w).permute(0, 2, 1, 3).reshape(r * c, plan.h, plan.w)


def from_blocks(blocks: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    r, c = plan.rows // plan.h, plan.cols // plan.w
    x = blocks.reshape(r, c, plan.h, plan.w).permute(0, 2, 1, 3)
    if plan.pad:
        return x.reshape(-1)[: plan.numel].reshape(plan.shape)
    return x.reshape(plan.shape)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision matmuls lose too much of the small coefficients that top-k ranks; fp64 stays fp64.
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def dct_encode(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """Per-block DCT coefficients of x, shape (num_blocks, h*w), in fp32 (fp64 for fp64 input)."""
    dtype = _compute_dtype(x.dtype)
    blocks = to_blocks(x.to(dtype), plan)
    ch = dct_basis(plan.h, dtype, x.device)
    cw = dct_basis(plan.w, dtype, x.device)
    return (ch @ blocks @ cw.T).reshape(plan.num_blocks, plan.block_size)


def dct_decode(coeffs: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """Inverse of :func:`dct_encode`: coefficients (num_blocks, h*w) -> tensor of plan.shape."""
    dtype = _compute_dtype(coeffs.dtype)
    blocks = coeffs.to(dtype).reshape(plan.num_blocks, plan.h, plan.w)
    ch = dct_basis(plan.h, dtype, coeffs.device)
    cw = dct_basis(plan.w, dtype, coeffs.device)
    return from_blocks(ch.T @ blocks @ cw, plan)


def identity_encode(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """The same chunking without the transform (for methods where the DCT is optional)."""
    return to_blocks(x.to(_compute_dtype(x.dtype)), plan).reshape(plan.num_blocks, plan.block_size)


def identity_decode(coeffs: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    return from_blocks(coeffs.to(_compute_dtype(coeffs.dtype)).reshape(plan.num_blocks, plan.h, plan.w), plan)
