"""Compressed and dense collectives over a :class:`Transport`.

- :class:`SparseAllGather`: every tensor's top-k transform coefficients, all packed into one
  flat byte buffer, one all-gather per call, decoded into each tensor's mean over ranks.
- :func:`all_reduce_mean_`: the dense baseline, all tensors flattened into one buffer per dtype.

Both have a non-blocking form (``SparseAllGather.start``, :func:`start_all_reduce_mean_`) that
returns a :class:`~ds_lowcomm.comm.transport.Pending`, for syncs overlapped with compute.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from ..codec import SparseSpec
from .transport import Pending, Transport


class SparseAllGather:
    """A fixed list of tensor shapes exchanged as top-k transform coefficients.

    ``exchange(buffers)`` removes from each buffer what it sends (error feedback happens in
    place) and returns, for each buffer, the mean over ranks of what the ranks sent. The layout
    of the flat payload follows from the shapes and settings, identical on every rank.
    """

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        *,
        chunk: int,
        topk: int,
        value_dtype: str,
        transport: Transport,
        transform: str = "dct",
        average: str = "senders",
        op: str = "sparse_all_gather",
    ):
        self.specs = [
            SparseSpec.build(s, chunk=chunk, topk=topk, value_dtype=value_dtype, transform=transform) for s in shapes
        ]
        self.offsets = [0]
        for spec in self.specs:
            self.offsets.append(self.offsets[-1] + spec.nbytes)
        self.transport = transport
        self.average = average
        self.op = op

    @property
    def payload_bytes(self) -> int:
        """Bytes one rank sends per exchange."""
        return self.offsets[-1]

    def exchange(self, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return self.start(buffers).wait()

    def start(self, buffers: Sequence[torch.Tensor]) -> Pending:
        """Compress now (error feedback applied to ``buffers`` at once), gather in the background;
        ``wait()`` decodes and returns the means."""
        if len(buffers) != len(self.specs):
            raise ValueError(f"expected {len(self.specs)} tensors, got {len(buffers)}")
        ledger = self.transport.ledger
        start = time.perf_counter()
        parts = []
        for spec, buf in zip(self.specs, buffers):
            payload, sent = spec.compress(buf)
            buf.sub_(sent.to(buf.dtype))
            parts.append(payload)
        flat = torch.cat(parts)
        ledger.add_time("codec", time.perf_counter() - start)
        gathered = self.transport.start_all_gather_bytes(flat, op=self.op)
        return Pending(lambda: self._decode(gathered.wait()), None)

    def _decode(self, rows: torch.Tensor) -> list[torch.Tensor]:
        start = time.perf_counter()
        means = [
            spec.decompress_mean(rows[:, lo:hi], self.average)
            for spec, lo, hi in zip(self.specs, self.offsets[:-1], self.offsets[1:])
        ]
        self.transport.ledger.add_time("codec", time.perf_counter() - start)
        return means


def start_all_reduce_mean_(tensors: Sequence[torch.Tensor], transport: Transport, op: str = "all_reduce") -> Pending:
    """Average tensors over ranks in place, in the background: one flat all-reduce per dtype.
    The tensors hold their averages once ``wait()`` returns (which returns them)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    started = []
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
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
