"""Codecs for pipeline activations: the tensors one pipeline stage sends forward to the next,
and the activation gradients sent back.

A tensor is cut into rows: every dimension but the last (``x.reshape(-1, x.shape[-1])``; a 1-D
tensor is one row, a 0-dim tensor one row of one). The payload is a flat uint8 tensor whose
size follows from the shape and dtype alone (:meth:`ActivationCodec.nbytes`), so both stages
know what to receive without a header on the wire.

============  ==================================================  ===================================
codec         payload                                             decode error, per row
============  ==================================================  ===================================
``none``      the tensor's own bytes                              none: bit-identical
``int8``      fp32 scale per row, then one int8 code per value    <= absmax_row / 254
``int4``      fp32 scale per row, then 4-bit codes, two a byte    <= absmax_row / 14
``topk``      k indices per row, then their k values (x's dtype)  kept: exact; dropped: each <= the
                                                                  row's k-th largest |x|
``lowrank``   x @ Q, rows x r values in x's dtype                 the part of the row orthogonal to
                                                                  span(Q); exact inside it
============  ==================================================  ===================================

The bounds are in exact arithmetic on the fp32 reconstruction; the decoded tensor is then
rounded to the output dtype (half an ulp more), and lowrank adds its matmuls' rounding.
Non-finite inputs are not preserved by int8/int4 (an inf makes the row's scale inf).

Only float16/bfloat16/float32/float64 tensors are coded; any other dtype (integer masks, bools,
fp8, complex) travels raw under every codec, exactly as with ``none``. An empty tensor has an
empty payload under every codec.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ..settings import ConfigError, Settings, check_choice, check_int

if sys.byteorder != "little":  # payloads reinterpret multi-byte values as bytes
    raise ImportError("ds_lowcomm's wire format assumes a little-endian host")

ACTIVATION_CODECS = ("none", "int8", "int4", "topk", "lowrank")

# Dtypes the lossy codecs act on; anything else is sent as its raw bytes.
CODED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class ActivationSettings(Settings):
    """The ``"activations"`` mapping inside a ``"lowcomm"`` section."""

    forward: str = "none"  # codec for activations sent to the next stage
    backward: str = "none"  # codec for activation gradients sent to the previous stage
    topk_fraction: float = 0.125  # topk: fraction of each row kept (at least one value)
    rank: int = 32  # lowrank: columns of the basis (capped at the row length)
    seed: int = 0  # lowrank: seeds the basis; every stage must use the same

    def check(self, where: str) -> None:
        check_choice(where, "forward", self.forward, ACTIVATION_CODECS)
        check_choice(where, "backward", self.backward, ACTIVATION_CODECS)
        f = self.topk_fraction
        if not (isinstance(f, (int, float)) and not isinstance(f, bool) and 0.0 < f <= 1.0):
            raise ConfigError(f"{where}.topk_fraction must be a number in (0, 1]; got {f!r}")
        check_int(where, "rank", self.rank, 1)
        check_int(where, "seed", self.seed, 0)

    @classmethod
    def from_section(cls, raw: Mapping[str, Any] | None, where: str = "lowcomm.activations") -> "ActivationSettings":
        """Build from the nested ``"activations"`` mapping (None: the defaults). Unknown keys are
        refused by name, with the allowed ones listed. Validated."""
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where} must be a mapping of {', '.join(cls.flat_keys())}; got {raw!r}")
        return cls.from_flat(raw, where=where, strict=True)


# -- shapes and bytes --------------------------------------------------------------------------
def _rows_cols(shape: Sequence[int]) -> tuple[int, int]:
    shape = tuple(int(s) for s in shape)
    cols = shape[-1] if shape else 1
    return math.prod(shape[:-1]), cols


def _to_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes (possibly a slice at an unaligned offset) -> a fresh flat tensor of ``dtype``: copied
    first, since a view needs aligned storage, and so the result never aliases a receive buffer."""
    fresh = torch.empty(data.numel(), dtype=torch.uint8, device=data.device)
    return fresh.copy_(data.reshape(-1)).view(dtype)


def _index_dtype(cols: int) -> torch.dtype:
    """Smallest of uint8/int16/int32 that holds 0..cols-1."""
    if cols <= 1 << 8:
        return torch.uint8
    if cols <= 1 << 15:
        return torch.int16
    return torch.int32


@functools.lru_cache(maxsize=None)
def _basis_master(cols: int, r: int, seed: int) -> torch.Tensor:
    # float64 on the CPU, signs fixed so R's diagonal is positive: QR is then unique, so stages on
    # different hosts (different LAPACKs) get the same Q up to float64 rounding.
    g = torch.Generator(device="cpu").manual_seed(seed)
    gauss = torch.randn(cols, r, generator=g, dtype=torch.float64)
    q, rr = torch.linalg.qr(gauss)
    signs = torch.sign(torch.diagonal(rr))
    return q * torch.where(signs == 0, torch.ones_like(signs), signs)


@functools.lru_cache(maxsize=64)
def _basis_cached(cols: int, r: int, seed: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return _basis_master(cols, r, seed).to(device=device, dtype=dtype)


def lowrank_basis(cols: int, rank: int, seed: int = 0, device: torch.device | str | None = None,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The lowrank codec's fixed orthonormal basis Q, ``cols x min(rank, cols)``: QR of a Gaussian
    drawn from a CPU generator seeded with ``seed``, so it depends on (cols, rank, seed) only.
    Cached per (cols, r, seed, device, dtype); treat it as read-only."""
    r = min(int(rank), int(cols))
    return _basis_cached(int(cols), r, int(seed), torch.device(device if device is not None else "cpu"), dtype)


# -- codecs ------------------------------------------------------------------------------------
class ActivationCodec:
    """One codec with its settings. ``nbytes`` depends on (shape, dtype) only; ``encode`` gives
    exactly that many bytes; ``decode`` rebuilds a tensor of that shape and dtype on the
    payload's device. This base class is ``none``; the others code only :data:`CODED_DTYPES`."""

    name = "none"

    def __init__(self, settings: ActivationSettings):
        self.settings = settings

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.settings!r})"

    def _raw(self, dtype: torch.dtype) -> bool:
        return self.name == "none" or dtype not in CODED_DTYPES

    def nbytes(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        rows, cols = _rows_cols(shape)
        if rows * cols == 0:
            return 0
        if self._raw(dtype):
            return rows * cols * dtype.itemsize
        return self._nbytes(rows, cols, dtype)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x -> flat uint8 payload of ``nbytes(x.shape, x.dtype)`` bytes, on x's device. Sent raw,
        a contiguous x is not copied: the payload is a view of its memory."""
        if x.numel() == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        if self._raw(x.dtype):
            return _to_bytes(x)
        rows, cols = _rows_cols(x.shape)
        return self._encode(x.reshape(rows, cols), rows, cols)

    def decode(self, data: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Payload -> tensor of ``shape`` and ``dtype`` on data's device (fresh memory)."""
        expected = self.nbytes(shape, dtype)
        if data.dtype != torch.uint8 or data.numel() != expected:
            raise ValueError(f"{self.name} payload for {tuple(shape)} {dtype} must be {expected} uint8 bytes; "
                             f"got {data.numel()} {data.dtype}")
        shape = tuple(int(s) for s in shape)
        if expected == 0:
            return torch.empty(shape, dtype=dtype, device=data.device)
        if self._raw(dtype):
            return _from_bytes(data, dtype).reshape(shape)
        rows, cols = _rows_cols(shape)
        return self._decode(data.reshape(-1), rows, cols, dtype).reshape(shape)

    # overridden by the lossy codecs: x2d is (rows, cols), rows * cols > 0
    def _nbytes(self, rows: int, cols: int, dtype: torch.dtype) -> int:
        raise NotImplementedError

    def _encode(self, x2d: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        raise NotImplementedError

    def _decode(self, data: torch.Tensor, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError


class IntCodec(ActivationCodec):
    """Per-row symmetric absmax quantisation: scale = absmax_row / qmax (fp32), codes =
    round(x / scale) in [-qmax, qmax]; decode codes * scale. Error <= scale / 2 = absmax_row /
    (2 qmax): 1/254 of the row's absmax for int8 (qmax 127), 1/14 for int4 (qmax 7).
    Payload: ``[rows fp32 scales | codes]``; int4 codes (+8, so 1..15) two a byte, low nibble
    first, packed over the whole tensor (an odd count pads one nibble at the end)."""

    def __init__(self, settings: ActivationSettings, bits: int):
        super().__init__(settings)
        self.bits = bits
        self.name = f"int{bits}"
        self.qmax = (1 << (bits - 1)) - 1

    def _code_bytes(self, count: int) -> int:
        return count if self.bits == 8 else (count + 1) // 2

    def _nbytes(self, rows, cols, dtype):
        return 4 * rows + self._code_bytes(rows * cols)

    def _encode(self, x2d, rows, cols):
        xf = x2d.float()
        scale = xf.abs().amax(dim=1, keepdim=True) / self.qmax
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row codes to zeros
        codes = torch.round(xf / safe).clamp_(-self.qmax, self.qmax).to(torch.int8).reshape(-1)
        if self.bits == 8:
            packed = codes.view(torch.uint8)
        else:
            nibbles = (codes + 8).to(torch.uint8)
            if nibbles.numel() % 2:
                nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
            pairs = nibbles.reshape(-1, 2)
            packed = pairs[:, 0] | (pairs[:, 1] << 4)
        return torch.cat([_to_bytes(scale), packed])

    def _decode(self, data, rows, cols, dtype):
        scale = _from_bytes(data[: 4 * rows], torch.float32).reshape(rows, 1)
        packed = data[4 * rows:]
        if self.bits == 8:
            codes = packed.view(torch.int8).float()
        else:
            both = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(-1)[: rows * cols]
            codes = both.float() - 8.0
        return (codes.reshape(rows, cols) * scale).to(dtype)


class TopkCodec(ActivationCodec):
    """Per row the k = max(1, ceil(topk_fraction * cols)) entries of largest |x|, kept exactly;
    the rest decode to 0, so each dropped entry's error is <= the row's k-th largest |x|.
    Payload: ``[rows*k indices | rows*k values]``, indices in the smallest of uint8/int16/int32
    that holds cols, values in x's own dtype."""

    name = "topk"

    def k(self, cols: int) -> int:
        # the 1e-9 keeps e.g. 0.7 * 10 = 7.000000000000001 from rounding up to 8
        return max(1, min(cols, math.ceil(self.settings.topk_fraction * cols - 1e-9)))

    def _nbytes(self, rows, cols, dtype):
        return rows * self.k(cols) * (_index_dtype(cols).itemsize + dtype.itemsize)

    def _encode(self, x2d, rows, cols):
        k = self.k(cols)
        idx = torch.topk(x2d.abs(), k, dim=1, sorted=False).indices  # |x| is exact in any dtype
        vals = torch.gather(x2d, 1, idx)
        return torch.cat([_to_bytes(idx.to(_index_dtype(cols))), _to_bytes(vals)])

    def _decode(self, data, rows, cols, dtype):
        k = self.k(cols)
        index_bytes = rows * k * _index_dtype(cols).itemsize
        idx = _from_bytes(data[:index_bytes], _index_dtype(cols)).to(torch.int64).reshape(rows, k)
        vals = _from_bytes(data[index_bytes:], dtype).reshape(rows, k)
        return torch.zeros(rows, cols, dtype=dtype, device=data.device).scatter_(1, idx, vals)


class LowrankCodec(ActivationCodec):
    """Projection on a fixed random orthonormal basis Q (cols x r, r = min(rank, cols); see
    :func:`lowrank_basis`): send y = x @ Q (rows x r, in x's dtype), decode y @ Q^T. Exact (to
    the dtype's matmul rounding) for rows in span(Q); the error is the part of each row
    orthogonal to span(Q), which for a generic row is most of it unless activations really
    live near that subspace.

    The basis is random and fixed, not learned: stateless and identical on both stages from the
    seed alone. Learned subspaces (Pluralis-style / MAPL-style, fitted to the activations) keep
    far more of the signal at the same rank; this is the simple choice."""

    name = "lowrank"

    def basis(self, cols: int, device, dtype) -> torch.Tensor:
        return lowrank_basis(cols, self.settings.rank, self.settings.seed, device, dtype)

    def _nbytes(self, rows, cols, dtype):
        return rows * min(self.settings.rank, cols) * dtype.itemsize

    def _encode(self, x2d, rows, cols):
        return _to_bytes(x2d @ self.basis(cols, x2d.device, x2d.dtype))

    def _decode(self, data, rows, cols, dtype):
        q = self.basis(cols, data.device, dtype)
        y = _from_bytes(data, dtype).reshape(rows, q.shape[1])
        return y @ q.T


def make_activation_codec(name: str, settings: ActivationSettings | None = None) -> ActivationCodec:
    """The codec ``name`` (one of :data:`ACTIVATION_CODECS`) with ``settings`` (defaults if None)."""
    settings = settings if settings is not None else ActivationSettings()
    settings.check("lowcomm.activations")
    if name not in ACTIVATION_CODECS:
        raise ValueError(f"activation codec must be one of {', '.join(ACTIVATION_CODECS)}; got {name!r}")
    if name == "none":
        return ActivationCodec(settings)
    if name in ("int8", "int4"):
        return IntCodec(settings, int(name[3:]))
    if name == "topk":
        return TopkCodec(settings)
    return LowrankCodec(settings)
