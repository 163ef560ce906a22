"""Per-block top-k of transform coefficients and its byte format.

One tensor's payload is ``[indices | values]``: indices are positions inside their block, in
the smallest of 8, 12, 16 or 32 bits that holds the block size (12 bits for 64x64 blocks: two
indices in three bytes), and none where k is the whole block (every position is sent, in
order: what is left is a quantiser's, e.g. one sign bit per element), values in fp32/bf16/fp16, int8 codes with a per-tensor (min, step) fp32
header, or 2-bit codes with a per-tensor lookup table of 4 fp32 bin means. The layout of a payload
follows from the tensor shape and the settings alone, so every rank knows every other rank's
layout without a header on the wire.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from .dct import ChunkPlan, _compute_dtype, dct_decode, dct_encode, identity_decode, identity_encode

if sys.byteorder != "little":  # the index packing reinterprets int32 bytes
    raise ImportError("ds_lowcomm's wire format assumes a little-endian host")

VALUE_DTYPES = ("fp32", "bf16", "fp16", "int8", "2bit", "sign")
TRANSFORMS = ("dct", "none")
AVERAGES = ("senders", "world")

# The float formats by their config names (value_dtype, state_dtype, the reference task's dtype).
FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def topk_count(plan: ChunkPlan, topk: int, chunk: int) -> int:
    """Coefficients kept per block: ``topk`` for a full chunk x chunk block, proportionally
    fewer (at least one) for the smaller blocks of odd-sized or 1-D tensors, so every tensor
    is sent at about the same density topk / chunk**2."""
    k = math.ceil(topk * plan.block_size / (chunk * chunk))
    return max(1, min(plan.block_size, k))


def index_bits(block_size: int) -> int:
    """Bits per index: the smallest of 8, 12, 16, 32 that holds 0..block_size-1."""
    for bits in (8, 12, 16):
        if block_size <= 1 << bits:
            return bits
    return 32


def packed_nbytes(count: int, bits: int) -> int:
    return (count * bits + 7) // 8


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


def pack_indices(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers in [0, 2**bits) -> flat uint8 of ``packed_nbytes(n, bits)`` bytes. 12 bits: each
    pair (a, b) becomes 3 bytes: a's low 8 bits | a's high 4 bits + b's low 4 | b's high 8."""
    if bits != 12:
        return pack_uint(values, bits // 8)
    flat = values.reshape(-1).to(torch.int32)
    n = flat.numel()
    if n % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    a, b = flat[0::2], flat[1::2]
    out = torch.stack([a & 0xFF, (a >> 8) | ((b & 0xF) << 4), b >> 4], dim=-1).to(torch.uint8)
    return out.reshape(-1)[: packed_nbytes(n, 12)]


def unpack_indices(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_indices` over the last dimension: (..., nbytes) uint8 -> (..., count) int64."""
    if bits != 12:
        return unpack_uint(data, bits // 8)
    if count % 2:
        data = torch.cat([data, data.new_zeros(*data.shape[:-1], 1)], dim=-1)
    triples = data.reshape(*data.shape[:-1], -1, 3).to(torch.int64)
    a = triples[..., 0] | ((triples[..., 1] & 0xF) << 8)
    b = (triples[..., 1] >> 4) | (triples[..., 2] << 4)
    return torch.stack([a, b], dim=-1).reshape(*data.shape[:-1], -1)[..., :count]


def pack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Codes in 0..2**width-1 (width 1 to 16) -> flat uint8: a little-endian bit stream, each code's
    lowest bit first (for a width dividing 8, 8 // width codes a byte, the first in the lowest bits)."""
    if not 1 <= width <= 16:
        raise ValueError(f"width must be 1 to 16 bits; got {width}")
    if 8 % width == 0:
        per_byte = 8 // width
        flat = codes.reshape(-1).to(torch.uint8)
        pad = (-flat.numel()) % per_byte
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        q = flat.reshape(-1, per_byte)
        out = q[:, 0].clone()
        for j in range(1, per_byte):
            out |= q[:, j] << (j * width)
        return out
    shifts = torch.arange(width, dtype=torch.int32, device=codes.device)
    bits = ((codes.reshape(-1, 1).to(torch.int32) >> shifts) & 1).to(torch.uint8).reshape(-1)
    pad = (-bits.numel()) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    byte_shifts = torch.arange(8, dtype=torch.uint8, device=codes.device)
    return (bits.reshape(-1, 8) << byte_shifts).sum(dim=1, dtype=torch.uint8)


def unpack_codes(data: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes` over the last dimension: (..., nbytes) uint8 -> (..., count) int64."""
    if 8 % width == 0:
        shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=data.device)
        codes = (data.unsqueeze(-1) >> shifts) & ((1 << width) - 1)
        return codes.reshape(*data.shape[:-1], -1)[..., :count].to(torch.int64)
    byte_shifts = torch.arange(8, dtype=torch.uint8, device=data.device)
    bits = ((data.unsqueeze(-1) >> byte_shifts) & 1).reshape(*data.shape[:-1], -1)[..., : count * width]
    shifts = torch.arange(width, dtype=torch.int64, device=data.device)
    return (bits.reshape(*data.shape[:-1], count, width).to(torch.int64) << shifts).sum(dim=-1)


# 2-bit values (SparseLoCo): 4 equal bins over mean +- 3 sigma, each decoded to the mean of the
# values that fell in it (a per-tensor lookup table sent with the codes).
TWO_BIT_BINS = 4
TWO_BIT_SIGMAS = 3.0


class ValueFormat:
    """How kept coefficient values travel: a float dtype; 8-bit min/max codes (int8); 2-bit
    codes with a per-tensor lookup (2bit); or one sign bit each with one per-tensor scale, the
    mean magnitude of the kept values (sign: what DeMo steps along, about 1 bit a value)."""

    def __init__(self, name: str):
        if name not in VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of {', '.join(VALUE_DTYPES)}; got {name!r}")
        self.name = name

    def nbytes(self, count: int) -> int:
        if self.name == "int8":
            return count + 8
        if self.name == "2bit":
            return 4 * TWO_BIT_BINS + packed_nbytes(count, 2)
        if self.name == "sign":
            return 4 + packed_nbytes(count, 1)
        return count * torch.finfo(FLOAT_DTYPES[self.name]).bits // 8

    def pack(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 values -> (flat uint8 bytes, the fp32 values the receivers will decode)."""
        flat = values.reshape(-1).float()
        if self.name == "2bit":
            return self._pack_2bit(flat, values.shape)
        if self.name == "sign":
            scale = flat.abs().mean().reshape(1)
            negative = flat < 0
            sent = torch.where(negative, -scale, scale)
            return torch.cat([scale.view(torch.uint8), pack_codes(negative, 1)]), sent.view_as(values)
        if self.name != "int8":
            sent = flat.to(FLOAT_DTYPES[self.name])
            return sent.view(torch.uint8), sent.float().view_as(values)
        lo, hi = flat.min(), flat.max()
        step = (hi - lo) / 255.0
        safe_step = torch.where(step > 0, step, torch.ones_like(step))
        codes = torch.round((flat - lo) / safe_step).clamp_(0, 255).to(torch.uint8)
        header = torch.stack([lo, step]).view(torch.uint8)
        sent = lo + codes.float() * step
        return torch.cat([header, codes]), sent.view_as(values)

    @staticmethod
    def _pack_2bit(flat: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor]:
        mean = flat.mean()
        sigma = flat.std(correction=0) if flat.numel() > 1 else torch.zeros_like(mean)
        width = 2 * TWO_BIT_SIGMAS * sigma / TWO_BIT_BINS
        safe_width = torch.where(width > 0, width, torch.ones_like(width))
        lo = mean - TWO_BIT_SIGMAS * sigma
        codes = torch.floor((flat - lo) / safe_width).clamp_(0, TWO_BIT_BINS - 1).to(torch.int64)
        # One plain reduction per bin, not a scatter_add_: on GPUs a float scatter_add_ into 4 bins
        # adds in the order atomics land, so the lookup (and the training) would change run to run.
        in_bin = [codes == b for b in range(TWO_BIT_BINS)]
        sums = torch.stack([torch.where(m, flat, 0.0).sum() for m in in_bin])
        counts = torch.stack([m.sum() for m in in_bin]).float()
        centres = lo + (torch.arange(TWO_BIT_BINS, device=flat.device, dtype=torch.float32) + 0.5) * width
        lookup = torch.where(counts > 0, sums / counts.clamp(min=1), centres)  # empty bins are never decoded
        return torch.cat([lookup.view(torch.uint8), pack_codes(codes, 2)]), lookup[codes].view(shape)

    def unpack(self, data: torch.Tensor, count: int) -> torch.Tensor:
        """(..., nbytes) uint8 -> (..., count) fp32, vectorised over leading dims (one row per rank)."""
        if self.name == "2bit":
            header = 4 * TWO_BIT_BINS
            lookup = _view(data[..., :header], torch.float32)
            codes = unpack_codes(data[..., header:], count, 2)
            return torch.gather(lookup, -1, codes)
        if self.name == "sign":
            scale = _view(data[..., :4], torch.float32)
            negative = unpack_codes(data[..., 4:], count, 1)
            return scale * (1.0 - 2.0 * negative.float())
        if self.name != "int8":
            return _view(data, FLOAT_DTYPES[self.name]).float()
        header = _view(data[..., :8], torch.float32)
        lo, step = header[..., :1], header[..., 1:2]
        return lo + data[..., 8:].float() * step


def _view(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes (a slice of a gathered buffer, at any offset and stride) reinterpreted as ``dtype``:
    copied into a fresh standard-strided buffer first, since a view needs aligned strides."""
    fresh = torch.empty(data.shape, dtype=torch.uint8, device=data.device)
    return fresh.copy_(data).view(dtype)


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
        if math.prod(shape) == 0:
            raise ValueError(f"cannot code an empty tensor (shape {tuple(shape)}): leave it out of the exchange")
        plan = ChunkPlan.for_shape(shape, chunk)
        return cls(plan, topk_count(plan, topk, chunk), ValueFormat(value_dtype), transform)

    @property
    def count(self) -> int:
        return self.plan.num_blocks * self.k

    @property
    def every_position(self) -> bool:
        """k is the whole block: every position is sent in order and no index travels."""
        return self.k == self.plan.block_size

    @property
    def index_bytes(self) -> int:
        return 0 if self.every_position else packed_nbytes(self.count, index_bits(self.plan.block_size))

    @property
    def nbytes(self) -> int:
        return self.index_bytes + self.values.nbytes(self.count)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x -> its coefficients, one row per block (the transform alone)."""
        return (dct_encode if self.transform == "dct" else identity_encode)(x, self.plan)

    def decode(self, coeffs: torch.Tensor) -> torch.Tensor:
        """Coefficient rows -> the dense tensor, fp32 (fp64 for fp64)."""
        return (dct_decode if self.transform == "dct" else identity_decode)(coeffs, self.plan)

    @cached_property
    def _alone(self) -> "SparseBatch":
        return SparseBatch([self])

    def compress(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x -> (payload bytes, the dense tensor the payload stands for, in x's shape, fp32).

        The second result is what receivers reconstruct from this payload (after value
        rounding), which is what error feedback must subtract.
        """
        payload, (sent,) = self._alone.compress([x])
        return payload, sent

    def decompress_mean(self, rows: torch.Tensor, average: str = "senders",
                        weights: "list[float] | None" = None) -> torch.Tensor:
        """Payloads of all ranks, (n, nbytes) uint8 -> their mean as a dense fp32 tensor.

        ``average="senders"``: each coefficient is averaged over the ranks that sent it (the
        published reference); ``"world"``: summed and divided by n, i.e. the mean of every
        rank's sparse tensor. Rank by rank in a fixed order with no index repeated inside one
        scatter, so the result is bit-identical on every rank and every device.

        ``weights`` (one per row): a weighted mean instead, each row's coefficients counting
        ``weights[r]`` (replicas of different sizes or step counts; see comm/routes.py).
        """
        return self._alone.decompress_mean(rows, average, weights)[0]


class SparseBatch:
    """Several tensors' payloads made and read together, with the bytes and the bits of one
    :class:`SparseSpec` at a time (the payload is the specs' payloads end to end).

    Tensors whose blocks have the same size, k and value format form a group, and each group
    goes through one top-k, one gather, one index pack, one scatter and one unpack, so the
    number of kernels per sync grows with the number of groups, not of tensors (a transformer's
    matrices at chunk 64 are one group). The transforms stay one matmul pair per tensor, over
    that tensor's rows of the group's buffer: a matmul's rounding depends on its operands'
    shapes (measured: a (B, n) @ (n, n) product's rows change in the last bit with B), and
    the same shapes as one tensor alone give the same bits. Per-tensor value headers (int8,
    2bit, sign) are computed per tensor, as alone.
    """

    def __init__(self, specs: Sequence[SparseSpec], compile: bool = False):
        self.specs = list(specs)
        self.offsets = [0]
        for spec in self.specs:
            self.offsets.append(self.offsets[-1] + spec.nbytes)
        groups: dict[tuple, list[int]] = {}
        for i, spec in enumerate(self.specs):
            bits = index_bits(spec.plan.block_size)
            alone = i if bits == 12 and spec.count % 2 else -1  # 12-bit pairs must not straddle two tensors
            key = (spec.plan.block_size, spec.k, spec.values.name, spec.transform, alone)
            groups.setdefault(key, []).append(i)
        self.groups = [_Group([self.specs[i] for i in members], members, compile) for members in groups.values()]

    @property
    def nbytes(self) -> int:
        return self.offsets[-1]

    def compress(self, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Tensors -> (the payload: every spec's bytes in order, flat uint8; for each tensor
        the dense fp32 tensor its payload stands for, which error feedback subtracts)."""
        if len(xs) != len(self.specs):
            raise ValueError(f"expected {len(self.specs)} tensors, got {len(xs)}")
        parts: list = [None] * (2 * len(self.specs))
        sent: list = [None] * len(self.specs)
        for group in self.groups:
            group.compress([xs[i] for i in group.members], parts, sent)
        if not parts:
            device = xs[0].device if xs else torch.device("cpu")
            return torch.zeros(0, dtype=torch.uint8, device=device), sent
        return torch.cat(parts), sent

    def decompress_mean(self, rows: torch.Tensor, average: str = "senders",
                        weights: "list[float] | None" = None) -> list[torch.Tensor]:
        """All ranks' payloads, (n, nbytes) uint8 -> for each spec the mean as a dense tensor
        (see :meth:`SparseSpec.decompress_mean`)."""
        if average not in AVERAGES:
            raise ValueError(f"average must be one of {', '.join(AVERAGES)}; got {average!r}")
        if weights is not None and (len(weights) != rows.shape[0] or any(w <= 0 for w in weights)):
            raise ValueError(f"weights: {rows.shape[0]} positive numbers expected (one per row); got {list(weights)}")
        out: list = [None] * len(self.specs)
        for group in self.groups:
            group.decompress_mean(rows, self.offsets, average, weights, out)
        return out


class _Group:
    """Tensors of one block size, k and value format, their blocks stacked in one buffer.

    ``compile``: the group's compress and decompress go through ``torch.compile``, with every
    op that rounds (the transforms, value headers and codes, weighted sums) kept out of the
    compiled graphs and run eagerly, as without it. What is compiled moves, selects, packs and
    adds in a fixed order (top-k, gather, index packing, scatter, unpacking, the per-rank
    scatter-adds and the division by senders), so the bits are those of the eager path.
    """

    def __init__(self, specs: list[SparseSpec], members: list[int], compile: bool = False):
        self.specs, self.members = specs, members
        first = specs[0]
        self.k, self.block_size, self.values = first.k, first.plan.block_size, first.values
        self.bits = index_bits(self.block_size)
        self.every_position = first.every_position  # no indices on the wire: positions 0..k-1 in order
        self.rows = [0]  # each member's first block row in the group's buffer
        for spec in specs:
            self.rows.append(self.rows[-1] + spec.plan.num_blocks)
        self.float_values = self.values.name in FLOAT_DTYPES  # no per-tensor header: one pack for all
        eager = _eager if compile else (lambda fn: fn)
        self.encode = [eager(spec.encode) for spec in specs]
        self.decode = [eager(spec.decode) for spec in specs]
        self.pack, self.unpack, self.weighted_mean = eager(self.values.pack), eager(self.values.unpack), eager(_weighted_mean)
        if compile:
            self.compress = _compiled(self.compress)
            self.decompress_mean = _compiled(self.decompress_mean)

    def compress(self, xs: list[torch.Tensor], parts: list, sent_out: list) -> None:
        coeffs = [encode(x) for encode, x in zip(self.encode, xs)]
        dtype = coeffs[0].dtype if len({c.dtype for c in coeffs}) == 1 else torch.float64  # exact for either
        coeffs = coeffs[0] if len(coeffs) == 1 else torch.cat([c.to(dtype) for c in coeffs])
        if self.every_position:
            idx = self._positions(coeffs.shape[0], coeffs.device)
            vals, index_bytes = coeffs, None
        else:
            idx = torch.topk(coeffs.abs(), self.k, dim=-1, sorted=False).indices
            vals = torch.gather(coeffs, -1, idx)
            index_bytes = pack_indices(idx, self.bits)
        if self.float_values:
            value_bytes, sent_vals = self.pack(vals)
        else:
            packed = [self.pack(vals[lo:hi]) for lo, hi in zip(self.rows[:-1], self.rows[1:])]
            sent_vals = torch.cat([v for _, v in packed])
        dense = torch.zeros_like(coeffs).scatter_(-1, idx, sent_vals.to(coeffs.dtype))
        value_at = 0
        for j, (spec, i, x) in enumerate(zip(self.specs, self.members, xs)):
            lo, hi = self.rows[j], self.rows[j + 1]
            if index_bytes is None:
                parts[2 * i] = vals.new_empty(0, dtype=torch.uint8)
            else:
                ib = packed_nbytes(lo * self.k, self.bits)
                parts[2 * i] = index_bytes[ib : ib + spec.index_bytes]
            if self.float_values:
                nbytes = self.values.nbytes(spec.count)
                parts[2 * i + 1] = value_bytes[value_at : value_at + nbytes]
                value_at += nbytes
            else:
                parts[2 * i + 1] = packed[j][0]
            own = dense[lo:hi]
            sent_out[i] = self.decode[j](own.to(_compute_dtype(x.dtype)))  # a no-op unless dtypes were mixed

    def decompress_mean(self, rows: torch.Tensor, offsets: list[int], average: str, weights, out: list) -> None:
        n = rows.shape[0]
        count = self.rows[-1] * self.k
        index_rows, value_rows = [], []
        for spec, i in zip(self.specs, self.members):
            start = offsets[i]
            index_rows.append(rows[:, start : start + spec.index_bytes])
            value_rows.append(rows[:, start + spec.index_bytes : offsets[i + 1]])
        if self.every_position:
            idx = self._positions(self.rows[-1], rows.device).expand(n, -1, -1)
        else:
            idx = unpack_indices(_cat_last(index_rows), self.bits, count).reshape(n, self.rows[-1], self.k)
        if self.float_values:
            vals = self.unpack(_cat_last(value_rows), count)
        else:
            vals = torch.cat([self.unpack(v, spec.count) for v, spec in zip(value_rows, self.specs)], dim=-1)
        vals = vals.reshape(n, self.rows[-1], self.k)
        total = torch.zeros(self.rows[-1], self.block_size, dtype=torch.float32, device=rows.device)
        if weights is not None:
            total = self.weighted_mean(total, idx, vals, weights, average)
        else:
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
        for j, i in enumerate(self.members):
            out[i] = self.decode[j](total[self.rows[j] : self.rows[j + 1]])

    def _positions(self, blocks: int, device) -> torch.Tensor:
        """Every block's positions 0..k-1, the indices an every-position group does not send."""
        return torch.arange(self.k, device=device).expand(blocks, -1)


def _eager(fn):
    """``fn`` run eagerly even when called from a compiled function: its rounding stays eager's."""
    return torch.compiler.disable(fn, recursive=True)


# Each group's graphs are guarded on the group (its k, block size, members), so a model's groups
# recompile the same code once each; torch's default limit of 8 would send the rest back to eager.
_GROUP_RECOMPILE_LIMIT = 256


def _compiled(fn):
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, _GROUP_RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=False)


def _cat_last(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _weighted_mean(total, idx, vals, weights, average: str) -> torch.Tensor:
    n = idx.shape[0]
    for r in range(n):
        total.scatter_add_(-1, idx[r], vals[r] * weights[r])
    if average == "world":
        return total.div_(float(sum(weights)))
    senders = torch.zeros_like(total)
    for r in range(n):
        senders.scatter_add_(-1, idx[r], torch.full_like(vals[r], float(weights[r])))
    # a coefficient nobody sent stays 0 (its total is 0; the divisor is clamped away from 0)
    return total.div_(senders.clamp_(min=min(weights)))
