"""Compressed and dense collectives over a :class:`Transport`.

- :class:`SparseAllGather`: every tensor's top-k transform coefficients, all packed into one
  flat byte buffer, one all-gather per call, decoded into each tensor's mean over ranks.
- :func:`all_reduce_mean_`: the dense baseline, all tensors flattened into one buffer per dtype.

Both have a non-blocking form (``SparseAllGather.start``, :func:`start_all_reduce_mean_`) that
returns a :class:`~ds_lowcomm.comm.transport.Pending`, for syncs overlapped with compute.

Non-finite guard: before sending, a rank checks what it would send. A rank with a NaN or inf
(or whose caller says its inputs were, ``healthy=False``) sends zeros and says so (a trailing
flag byte in the sparse payload; a one-byte all-gather beside the dense all-reduce), so no
non-finite value goes on the wire; every rank then averages over the healthy ranks only (the same
rows everywhere: replicas stay identical). With every rank healthy the result is bit for bit what
it was without the guard. ``transport.nonfinite`` decides what a flagged exchange does: "skip"
(the default: the flagged ranks sit this exchange out, counted in the ledger and logged with their
ranks) or "raise" (:class:`NonFiniteError` on every rank).

A rank whose transport says it sits this exchange out (``transport.sits_out``: a torchft replica
that has just healed, optim/fault_tolerance.py, or one its caller leaves out on purpose) sends zeros with its own flag value: it is left out
of the mean as a flagged rank is, but it is neither counted nor logged as non-finite, and never
makes "raise" raise. It receives the mean like every rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from ..codec import SparseBatch, SparseSpec
from .transport import Pending, Transport

logger = logging.getLogger(__name__)

NONFINITE_POLICIES = ("skip", "raise")


class NonFiniteError(RuntimeError):
    """A rank had non-finite values to send and ``lowcomm.nonfinite`` is "raise"."""


def settled_seconds(start: float, device: torch.device) -> float:
    """Seconds since ``start`` (a ``time.perf_counter()``) once ``device``'s queued work is done: on a
    GPU the codec's kernels run after the Python that launched them returns, and the ledger's codec
    seconds are to hold them (one synchronise per encode and per decode)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite (one host sync for the lot).

    One multi-tensor sum of magnitudes (fp32 or wider) per device and dtype: NaN and inf survive a sum, and it is a
    few fused kernels on a GPU where a per-tensor isfinite is five each. A sum past fp32's range
    (3e38) counts as non-finite; no gradient or momentum gets near it."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t is not None and t.numel() and (t.is_floating_point() or t.is_complex()):  # integers are finite
            groups.setdefault((t.device, torch.promote_types(t.dtype, torch.float32)), []).append(t)
    sums = [torch.stack(torch._foreach_norm(ts, 1, dtype=dtype)).sum().float().cpu()
            for (_, dtype), ts in groups.items()]
    return bool(torch.isfinite(torch.stack(sums)).all()) if sums else True


HEALTHY, NONFINITE, SITS_OUT = 1, 0, 2  # a rank's flag byte


def health_flag(healthy: bool, transport: Transport) -> int:
    """The flag byte this rank sends: it sits out (its transport says so), is healthy, or is not."""
    return SITS_OUT if transport.sits_out else HEALTHY if healthy else NONFINITE


def settle_health(flags: torch.Tensor, transport: Transport, op: str) -> list[int]:
    """Every rank's flag byte (one per rank of ``transport``, the same on every rank) -> the
    indices of the healthy ranks. Non-finite ranks are counted in the ledger and logged by name;
    with ``transport.nonfinite == "raise"`` every rank raises instead. Ranks sitting out are left
    out quietly."""
    flags = flags.tolist()
    keep = [r for r, flag in enumerate(flags) if flag == HEALTHY]
    if NONFINITE not in flags:
        return keep
    peers = transport.peer_ranks()
    bad = [peers[r] for r, flag in enumerate(flags) if flag == NONFINITE]
    transport.ledger.record_nonfinite(op, bad)
    what = (f"{op}: non-finite values (NaN/inf) on global rank(s) {bad}; nothing of theirs was sent")
    if getattr(transport, "nonfinite", "skip") == "raise":
        raise NonFiniteError(what + " (lowcomm.nonfinite is 'raise')")
    if transport.rank == (keep[0] if keep else 0):  # one line per exchange, from one rank
        logger.warning("%s; %s", what, "this exchange averaged the healthy ranks " f"{[peers[r] for r in keep]}"
                       if keep else "no rank was healthy: this exchange changed nothing")
    return keep


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
        compile: bool = False,
    ):
        self.layouts = list(layouts)
        shapes = [s for layout in self.layouts for s in _piece_shapes(layout)]
        self.specs = [
            SparseSpec.build(s, chunk=chunk, topk=topk, value_dtype=value_dtype, transform=transform) for s in shapes
        ]
        self.codec = SparseBatch(self.specs, compile)  # every tensor in one pass per block shape
        self.transport = transport
        self.average = average
        self.op = op
        self.weights = None if weights is None else [float(w) for w in weights]  # per rank: a weighted mean

    @property
    def payload_bytes(self) -> int:
        """Bytes one rank sends per exchange: the coefficients and one health flag byte."""
        return self.codec.nbytes + 1

    def exchange(self, buffers: Sequence[torch.Tensor], healthy: bool = True) -> list[torch.Tensor]:
        return self.start(buffers, healthy).wait()

    def start(self, buffers: Sequence[torch.Tensor], healthy: bool = True) -> Pending:
        """Compress now (error feedback applied to ``buffers`` at once), gather in the background;
        ``wait()`` decodes and returns the means. A rank whose buffers hold a non-finite value, or
        told ``healthy=False``, sends zeros flagged as such and keeps its buffers as they are."""
        if len(buffers) != len(self.layouts):
            raise ValueError(f"expected {len(self.layouts)} tensors, got {len(buffers)}")
        ledger = self.transport.ledger
        start = time.perf_counter()
        pieces = [v for layout, buf in zip(self.layouts, buffers) for v in _piece_views(layout, buf)]
        device = pieces[0].device if pieces else torch.device("cpu")
        flag = health_flag(healthy and all_finite(pieces), self.transport)
        if flag == HEALTHY:
            payload, sent = self.codec.compress(pieces)
            torch._foreach_sub_(pieces, [dense.to(buf.dtype) for buf, dense in zip(pieces, sent)])  # error feedback
            flat = torch.cat([payload, torch.ones(1, dtype=torch.uint8, device=device)])
        else:
            flat = torch.zeros(self.payload_bytes, dtype=torch.uint8, device=device)
            flat[-1] = flag
        ledger.add_time("codec", settled_seconds(start, device))
        gathered = self.transport.start_all_gather_bytes(flat, op=self.op)
        return Pending(lambda: self._decode(gathered.wait(), buffers), None)

    def _decode(self, rows: torch.Tensor, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # a failed exchange (a torchft peer died in it) gathered no rows: decode nothing (it is discarded)
        keep = [] if self.transport.failed is not None else settle_health(rows[:, -1], self.transport, self.op)
        start = time.perf_counter()
        weights = self.weights
        if len(keep) < rows.shape[0] and keep:
            rows = rows[keep]
            weights = None if weights is None else [weights[r] for r in keep]
        if keep:
            means = iter(self.codec.decompress_mean(rows[:, :-1], self.average, weights))
        else:  # nothing healthy: no move
            means = iter([torch.zeros(spec.plan.shape, dtype=torch.float32, device=rows.device) for spec in self.specs])
        out = []
        for layout, buf in zip(self.layouts, buffers):
            if isinstance(layout, Pieces):  # reassemble the flat tensor; padding gets zero
                flat = torch.zeros(buf.shape, dtype=torch.promote_types(buf.dtype, torch.float32), device=buf.device)
                for view in layout.views(flat):
                    view.copy_(next(means))
                out.append(flat)
            else:
                out.append(next(means))
        self.transport.ledger.add_time("codec", settled_seconds(start, rows.device))
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
                           weights: Sequence[float] | None = None, healthy: bool = True) -> Pending:
    """Average tensors over ranks in place, in the background: one flat all-reduce per dtype,
    after a one-byte all-gather of each rank's health flag (see the module's docstring). The
    tensors hold their averages once ``wait()`` returns (which returns them). ``weights`` (one per
    rank of the transport): a weighted mean instead."""
    flag = health_flag(healthy and all_finite(tensors), transport)
    ok = flag == HEALTHY
    flags = transport.start_all_gather_bytes(torch.tensor([flag], dtype=torch.uint8), op=f"{op}_health")
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    started = []
    for group in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        if not ok:
            flat.zero_()
        elif weights is not None:
            flat *= float(weights[transport.rank]) / float(sum(weights)) * transport.world_size
        started.append((group, flat, transport.start_all_reduce_sum_(flat, op=op)))

    def finish():
        for _, _, pending in started:
            pending.wait()
        keep = settle_health(flags.wait()[:, 0], transport, op)
        for group, flat, _ in started:
            flat /= transport.world_size
            if len(keep) < transport.world_size:  # the sum holds the healthy ranks only: rescale
                if not keep:
                    flat.zero_()
                elif weights is None:
                    flat *= transport.world_size / len(keep)
                else:
                    flat *= float(sum(weights)) / float(sum(weights[r] for r in keep))
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        return list(tensors)

    return Pending(finish, None)


def all_reduce_mean_(tensors: Sequence[torch.Tensor], transport: Transport, op: str = "all_reduce") -> None:
    """Average tensors over ranks in place: one flat all-reduce per dtype."""
    start_all_reduce_mean_(tensors, transport, op).wait()
