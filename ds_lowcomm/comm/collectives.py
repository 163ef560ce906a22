"""Compressed and dense collectives over a :class:`Transport`.

- :class:`SparseAllGather`: every tensor's top-k transform coefficients, all packed into one
  flat byte buffer, one all-gather per call, decoded into each tensor's mean over ranks.
- :func:`all_reduce_mean_`: the dense baseline, all tensors flattened into one buffer per dtype.

Both have a non-blocking form (``SparseAllGather.start``, :func:`start_all_reduce_mean_`) that
returns a :class:`~ds_lowcomm.comm.transport.Pending`, for syncs overlapped with compute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from ..codec import SparseSpec
from .transport import Pending, Transport


@dataclass(frozen=True)
class Pieces:
    """A flat tensor whose pieces are compressed each on its own: the parameters inside a ZeRO
    partition, so that no transform block mixes two parameters (a parameter with zero gradient
    then sends zeros and is not moved). ``pieces`` are (offset, shape) in the flat tensor;
    elements outside every piece (alignment padding) are neither sent nor changed."""

    numel: int
    pieces: tuple[tuple[int, tuple[int, ...]], ...]

    def __post_init__(self):
        end = 0
        for offset, shape in self.pieces:
            size = _numel(shape)
            if offset < end or offset + size > self.numel or size == 0:
                raise ValueError(f"pieces must be non-empty, in order, disjoint and inside {self.numel} elements; "
                                 f"got {self.pieces}")
            end = offset + size

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        flat = flat.view(-1)
        return [flat[offset : offset + _numel(shape)].view(shape) for offset, shape in self.pieces]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


Layout = Union[Sequence[int], Pieces]  # a tensor's shape, or the pieces of a flat tensor


class SparseAllGather:
    """A fixed list of tensors exchanged as top-k transform coefficients.

    ``exchange(buffers)`` removes from each buffer what it sends (error feedback happens in
    place) and returns, for each buffer, the mean over ranks of what the ranks sent. The layout
    of the flat payload follows from the shapes (or :class:`Pieces`) and settings, identical on
    every rank.
    """

    def __init__(
        self,
        layouts: Sequence[Layout],
        *,
        chunk: int,
        topk: int,
        value_dtype: str,
        transport: Transport,
        transform: str = "dct",
        average: str = "senders",
        op: str = "sparse_all_gather",
        weights: Sequence[float] | None = None,
    ):
        self.layouts = list(layouts)
        shapes = [s for layout in self.layouts for s in _piece_shapes(layout)]
        self.specs = [
            SparseSpec.build(s, chunk=chunk, topk=topk, value_dtype=value_dtype, transform=transform) for s in shapes
        ]
        self.offsets = [0]
        for spec in self.specs:
            self.offsets.append(self.offsets[-1] + spec.nbytes)
        self.transport = transport
        self.average = average
        self.op = op
        self.weights = None if weights is None else [float(w) for w in weights]  # per rank: a weighted mean

    @property
    def payload_bytes(self) -> int:
        """Bytes one rank sends per exchange."""
        return self.offsets[-1]

    def exchange(self, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.start(buffers).wait()

    def start(self, buffers: Sequence[torch.Tensor]) -> Pending:
        """Compress now (error feedback applied to ``buffers`` at once), gather in the background;
        ``wait()`` decodes and returns the means."""
        if len(buffers) != len(self.layouts):
            raise ValueError(f"expected {len(self.layouts)} tensors, got {len(buffers)}")
        ledger = self.transport.ledger
        start = time.perf_counter()
        pieces = [v for layout, buf in zip(self.layouts, buffers) for v in _piece_views(layout, buf)]
        parts = []
        for spec, buf in zip(self.specs, pieces):
            payload, sent = spec.compress(buf)
            buf.sub_(sent.to(buf.dtype))
            parts.append(payload)
        flat = torch.cat(parts)
        ledger.add_time("codec", time.perf_counter() - start)
        gathered = self.transport.start_all_gather_bytes(flat, op=self.op)
        return Pending(lambda: self._decode(gathered.wait(), buffers), None)

    def _decode(self, rows: torch.Tensor, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        start = time.perf_counter()
        means = iter([
            spec.decompress_mean(rows[:, lo:hi], self.average, self.weights)
            for spec, lo, hi in zip(self.specs, self.offsets[:-1], self.offsets[1:])
        ])
        out = []
        for layout, buf in zip(self.layouts, buffers):
            if isinstance(layout, Pieces):  # reassemble the flat tensor; padding gets zero
                flat = torch.zeros(buf.shape, dtype=torch.promote_types(buf.dtype, torch.float32), device=buf.device)
                for view in layout.views(flat):
                    view.copy_(next(means))
                out.append(flat)
            else:
                out.append(next(means))
        self.transport.ledger.add_time("codec", time.perf_counter() - start)
        return out


def _piece_shapes(layout: Layout) -> list[Sequence[int]]:
    return [shape for _, shape in layout.pieces] if isinstance(layout, Pieces) else [layout]


def _piece_views(layout: Layout, buf: torch.Tensor) -> list[torch.Tensor]:
    if isinstance(layout, Pieces):
        if buf.numel() != layout.numel or not buf.is_contiguous():
            raise ValueError(f"a tensor of {layout.numel} contiguous elements expected; got {tuple(buf.shape)}")
        return layout.views(buf)
    return [buf]


def start_all_reduce_mean_(tensors: Sequence[torch.Tensor], transport: Transport, op: str = "all_reduce",
                           weights: Sequence[float] | None = None) -> Pending:
    """Average tensors over ranks in place, in the background: one flat all-reduce per dtype.
    The tensors hold their averages once ``wait()`` returns (which returns them). ``weights``
    (one per rank of the transport): a weighted mean instead."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    started = []
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        if weights is not None:
            flat *= float(weights[transport.rank]) / float(sum(weights)) * transport.world_size
        started.append((group, flat, transport.start_all_reduce_sum_(flat, op=op)))

    def finish():
        for group, flat, pending in started:
            pending.wait()
            flat /= transport.world_size
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        return list(tensors)

    return Pending(finish, None)


def all_reduce_mean_(tensors: Sequence[torch.Tensor], transport: Transport, op: str = "all_reduce") -> None:
    """Average tensors over ranks in place: one flat all-reduce per dtype."""
    start_all_reduce_mean_(tensors, transport, op).wait()
