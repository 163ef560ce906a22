"""Per-block top-k of transform coefficients and its byte format.

One tensor's payload is ``[indices | values]``: indices are positions inside their block, in
the smallest unsigned width that holds the block size (1, 2 or 4 bytes, little-endian), values
in fp32/bf16/fp16, or int8 codes with a per-tensor (min, step) fp32 header. The layout of a
payload follows from the tensor shape and the settings alone, so every rank knows every other
rank's layout without a header on the wire.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

from .dct import ChunkPlan, dct_decode, dct_encode, identity_decode, identity_encode

if sys.byteorder != "little":  # the index packing reinterprets int32 bytes
    raise ImportError("ds_lowcomm's wire format assumes a little-endian host")

VALUE_DTYPES = ("fp32", "bf16", "fp16", "int8")
TRANSFORMS = ("dct", "none")
AVERAGES = ("senders", "world")

_FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def topk_count(plan: ChunkPlan, topk: int, chunk: int) -> int:
    """Coefficients kept per block: ``topk`` for a full chunk x chunk block, proportionally
    fewer (at least one) for the smaller blocks of odd-sized or 1-D tensors, so every tensor
    is sent at about the same density topk / chunk**2."""
    k = math.ceil(topk * plan.block_size / (chunk * chunk))
    return max(1, min(plan.block_size, k))


def index_width(block_size: int) -> int:
    """Bytes per index: the smallest unsigned width that holds 0..block_size-1."""
    if block_size <= 1 << 8:
        return 1
    if block_size <= 1 << 16:
        return 2
    return 4


def pack_uint(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers (< 2**31) -> ``width`` little-endian bytes each, as flat uint8."""
    as_bytes = values.reshape(-1).to(torch.int32).view(torch.uint8).reshape(-1, 4)
    return as_bytes[:, :width].reshape(-1)


def unpack_uint(data: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_uint` over the last dimension: (..., n*width) uint8 -> (..., n) int64."""
    lead = data.shape[:-1]
    grouped = data.reshape(*lead, -1, width)
    padded = torch.zeros(*grouped.shape[:-1], 4, dtype=torch.uint8, device=data.device)
    padded[..., :width] = grouped
    return padded.view(torch.int32).squeeze(-1).to(torch.int64)


class ValueFormat:
    """How kept coefficient values travel: a float dtype, or 8-bit min/max codes."""

    def __init__(self, name: str):
        if name not in VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of {', '.join(VALUE_DTYPES)}; got {name!r}")
        self.name = name

    def nbytes(self, count: int) -> int:
        if self.name == "int8":
            return count + 8
        return count * torch.finfo(_FLOAT_DTYPES[self.name]).bits // 8

    def pack(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 values -> (flat uint8 bytes, the fp32 values the receivers will decode)."""
        flat = values.reshape(-1).float()
        if self.name != "int8":
            sent = flat.to(_FLOAT_DTYPES[self.name])
            return sent.view(torch.uint8), sent.float().view_as(values)
        lo, hi = flat.min(), flat.max()
        step = (hi - lo) / 255.0
        safe_step = torch.where(step > 0, step, torch.ones_like(step))
        codes = torch.round((flat - lo) / safe_step).clamp_(0, 255).to(torch.uint8)
        header = torch.stack([lo, step]).view(torch.uint8)
        sent = lo + codes.float() * step
        return torch.cat([header, codes]), sent.view_as(values)

    def unpack(self, data: torch.Tensor) -> torch.Tensor:
        """(..., nbytes) uint8 -> (..., count) fp32, vectorised over leading dims (one row per rank)."""
        data = data.contiguous()
        if self.name != "int8":
            return data.view(_FLOAT_DTYPES[self.name]).float()
        header = data[..., :8].contiguous().view(torch.float32)
        lo, step = header[..., :1], header[..., 1:2]
        return lo + data[..., 8:].float() * step


@dataclass(frozen=True)
class SparseSpec:
    """Everything that fixes one tensor's payload: its blocks, k, and the byte formats."""

    plan: ChunkPlan
    k: int
    values: ValueFormat
    transform: str = "dct"

    @classmethod
    def build(cls, shape, *, chunk: int, topk: int, value_dtype: str, transform: str = "dct") -> "SparseSpec":
        if transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {', '.join(TRANSFORMS)}; got {transform!r}")
        plan = ChunkPlan.for_shape(shape, chunk)
        return cls(plan, topk_count(plan, topk, chunk), ValueFormat(value_dtype), transform)

    @property
    def count(self) -> int:
        return self.plan.num_blocks * self.k

    @property
    def index_bytes(self) -> int:
        return self.count * index_width(self.plan.block_size)

    @property
    def nbytes(self) -> int:
        return self.index_bytes + self.values.nbytes(self.count)

    def signature(self) -> tuple:
        p = self.plan
        return (p.shape, p.h, p.w, self.k, self.values.name, self.transform)

    def _encode(self, x):
        return (dct_encode if self.transform == "dct" else identity_encode)(x, self.plan)

    def _decode(self, c):
        return (dct_decode if self.transform == "dct" else identity_decode)(c, self.plan)

    def compress(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x -> (payload bytes, the dense tensor the payload stands for, in x's shape, fp32).

        The second result is what receivers reconstruct from this payload (after value
        rounding), which is what error feedback must subtract.
        """
        coeffs = self._encode(x)
        idx = torch.topk(coeffs.abs(), self.k, dim=-1, sorted=False).indices
        vals = torch.gather(coeffs, -1, idx)
        value_bytes, sent_vals = self.values.pack(vals)
        index_bytes = pack_uint(idx, index_width(self.plan.block_size))
        sent = torch.zeros_like(coeffs).scatter_(-1, idx, sent_vals.to(coeffs.dtype))
        return torch.cat([index_bytes, value_bytes]), self._decode(sent)

    def decompress_mean(self, rows: torch.Tensor, average: str = "senders") -> torch.Tensor:
        """Payloads of all ranks, (n, nbytes) uint8 -> their mean as a dense fp32 tensor.

        ``average="senders"``: each coefficient is averaged over the ranks that sent it (the
        published reference); ``"world"``: summed and divided by n, i.e. the mean of every
        rank's sparse tensor. Rank by rank in a fixed order with no index repeated inside one
        scatter, so the result is bit-identical on every rank and every device.
        """
        if average not in AVERAGES:
            raise ValueError(f"average must be one of {', '.join(AVERAGES)}; got {average!r}")
        n = rows.shape[0]
        nb = self.plan.num_blocks
        idx = unpack_uint(rows[:, : self.index_bytes], index_width(self.plan.block_size)).reshape(n, nb, self.k)
        vals = self.values.unpack(rows[:, self.index_bytes :]).reshape(n, nb, self.k)
        total = torch.zeros(nb, self.plan.block_size, dtype=torch.float32, device=rows.device)
        for r in range(n):
            total.scatter_add_(-1, idx[r], vals[r])
        if average == "world":
            total /= n
        else:
            senders = torch.zeros_like(total)
            ones = torch.ones_like(vals[0])
            for r in range(n):
                senders.scatter_add_(-1, idx[r], ones)
            total /= senders.clamp_(min=1.0)
        return self._decode(total)
