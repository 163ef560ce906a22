"""A compressed all-reduce in two phases, for dense payloads (every element kept, no transform).

An all-gather of compressed payloads hands every rank every other rank's payload: (n - 1) x P
received per rank, growing with the number of replicas n. Here (the scheme of 1-bit Adam's
compressed all-reduce) the flat tensor, every piece of every tensor end to end, is cut into n
equal chunks (the last one shorter), and

1. each rank quantises each chunk on its own (its own scale / lookup table; error feedback: what
   it sent leaves its buffers, as in :class:`~.collectives.SparseAllGather`) and sends chunk j to
   rank j (an all-to-all, each part with the sender's health flag byte);
2. rank j decodes the versions of chunk j it received, averages them over the healthy ranks (in
   rank order), adds its server error buffer for chunk j, quantises that again (what it loses
   stays in the server error buffer) and all-gathers it; every rank decodes every chunk.

Each rank then receives (n - 1)/n of one payload per phase, about 2 payloads whatever n is, and
every rank ends with the same bytes, so with the same mean. The server error buffer (one fp32
tensor of this rank's chunk length) belongs to the caller, who keeps it in its state; it depends
on n and this rank's place among them.

Health flags as in collectives.py: a rank with a non-finite value (or told unhealthy, or sitting
out) sends zeros flagged so and keeps its buffers; every rank receives every rank's flag in phase
1, so all agree on the ranks averaged. With no rank healthy nothing moves (no phase 2).
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import torch

from ..codec import ValueFormat
from .collectives import HEALTHY, Layout, Pieces, _piece_shapes, _piece_views, all_finite, health_flag, settle_health, settled_seconds
from .transport import Pending, Transport


class CompressedAllReduce:
    """A fixed list of tensors averaged over ranks with quantised chunks (see the module's docstring).

    ``start(buffers, server_error, healthy)`` quantises now (what is sent leaves ``buffers``, the
    client's error feedback) and returns a :class:`Pending` whose ``wait()`` runs the second phase
    (``server_error`` updated in place) and returns each buffer's mean over ranks (fp32)."""

    def __init__(self, layouts: Sequence[Layout], *, value_dtype: str, transport: Transport,
                 op: str = "compressed_all_reduce"):
        self.layouts = list(layouts)
        self.numel = sum(math.prod(shape) for layout in self.layouts for shape in _piece_shapes(layout))  # padding left out
        self.values = ValueFormat(value_dtype)
        self.transport = transport
        self.op = op
        n = transport.world_size
        if self.numel < n:
            raise ValueError(f"{op}: {self.numel} element(s) cannot be cut into {n} non-empty chunks")
        self.chunk = math.ceil(self.numel / n)  # elements per chunk; the last holds the rest
        self.chunk_bytes = self.values.nbytes(self.chunk)  # every chunk travels at this size (shorter ones padded)

    def chunk_numel(self, j: int) -> int:
        return max(0, min(self.numel, (j + 1) * self.chunk) - j * self.chunk)

    @property
    def server_error_numel(self) -> int:
        """Elements of this rank's server error buffer: its chunk's."""
        return self.chunk_numel(self.transport.rank)

    @property
    def payload_bytes(self) -> int:
        """One rank's whole quantised tensor: n chunks (what an all-gather would send per rank)."""
        return self.transport.world_size * self.chunk_bytes

    def exchange(self, buffers: Sequence[torch.Tensor], server_error: torch.Tensor,
                 healthy: bool = True) -> list[torch.Tensor]:
        return self.start(buffers, server_error, healthy).wait()

    def _pack(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk -> (its bytes padded to ``chunk_bytes``, the fp32 values they decode to)."""
        data, sent = self.values.pack(x) if x.numel() else (x.new_zeros(0, dtype=torch.uint8), x.new_zeros(0))
        if data.numel() < self.chunk_bytes:
            data = torch.cat([data, data.new_zeros(self.chunk_bytes - data.numel())])
        return data, sent.reshape(-1)

    def _unpack(self, rows: torch.Tensor, j: int) -> torch.Tensor:
        """(..., chunk_bytes) uint8 of chunk j -> (..., its elements) fp32."""
        count = self.chunk_numel(j)
        return self.values.unpack(rows[..., : self.values.nbytes(count)], count)

    def start(self, buffers: Sequence[torch.Tensor], server_error: torch.Tensor, healthy: bool = True) -> Pending:
        if len(buffers) != len(self.layouts):
            raise ValueError(f"expected {len(self.layouts)} tensors, got {len(buffers)}")
        if server_error.numel() != self.server_error_numel or server_error.dtype != torch.float32:
            raise ValueError(f"{self.op}: the server error buffer of rank {self.transport.rank} of "
                             f"{self.transport.world_size} holds {self.server_error_numel} fp32 elements; got "
                             f"{server_error.numel()} {server_error.dtype}")
        n, start = self.transport.world_size, time.perf_counter()
        pieces = [v for layout, buf in zip(self.layouts, buffers) for v in _piece_views(layout, buf)]
        device = pieces[0].device
        flag = health_flag(healthy and all_finite(pieces), self.transport)
        if flag == HEALTHY:
            flat = torch.cat([p.reshape(-1).float() for p in pieces])
            packed = [self._pack(flat[j * self.chunk : j * self.chunk + self.chunk_numel(j)]) for j in range(n)]
            sent = torch.cat([s for _, s in packed])
            offset = 0
            for p in pieces:  # error feedback: what was sent leaves the buffers
                p.sub_(sent[offset : offset + p.numel()].view_as(p).to(p.dtype))
                offset += p.numel()
            parts = [torch.cat([data, torch.full((1,), HEALTHY, dtype=torch.uint8, device=device)]) for data, _ in packed]
            send = torch.cat(parts)
        else:
            send = torch.zeros(n, self.chunk_bytes + 1, dtype=torch.uint8, device=device)
            send[:, -1] = flag
            send = send.reshape(-1)
        self.transport.ledger.add_time("codec", settled_seconds(start, device))
        splits = [self.chunk_bytes + 1] * n
        phase1 = self.transport.start_all_to_all(send, splits, splits, op=f"{self.op}_scatter")
        return Pending(lambda: self._finish(phase1.wait(), buffers, server_error), None)

    def _finish(self, received: torch.Tensor, buffers: Sequence[torch.Tensor],
                server_error: torch.Tensor) -> list[torch.Tensor]:
        n, me = self.transport.world_size, self.transport.rank
        rows = received.reshape(n, self.chunk_bytes + 1)
        # a failed exchange (a torchft peer died in it) received nothing to decode: it is discarded
        keep = [] if self.transport.failed is not None else settle_health(rows[:, -1], self.transport, self.op)
        if not keep:  # every rank saw the same flags: none runs phase 2, nothing moves
            return self._split(torch.zeros(self.numel, dtype=torch.float32, device=received.device), buffers)
        start = time.perf_counter()
        versions = self._unpack(rows[keep, :-1], me)
        total = versions[0].clone()
        for r in range(1, len(keep)):  # in rank order: the same bits on every rank and device
            total += versions[r]
        compensated = total / len(keep) + server_error.to(total.device)
        data, sent = self._pack(compensated)
        server_error.copy_(compensated - sent)
        self.transport.ledger.add_time("codec", settled_seconds(start, received.device))
        gathered = self.transport.start_all_gather_bytes(data, op=f"{self.op}_gather").wait()
        start = time.perf_counter()
        mean = torch.cat([self._unpack(gathered[j], j) for j in range(n)])
        out = self._split(mean, buffers)
        self.transport.ledger.add_time("codec", settled_seconds(start, received.device))
        return out

    def gather_server_error(self, server_error: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's server error chunk, put together: one fp32 tensor per buffer (shaped as
        ``like``'s), equal on every rank. Collective (an all-gather of one chunk each)."""
        mine = torch.zeros(self.chunk, dtype=torch.float32, device=server_error.device)
        mine[: server_error.numel()] = server_error
        gathered = self.transport.start_all_gather_bytes(mine.view(torch.uint8), op=f"{self.op}_server_error").wait()
        rows = gathered.reshape(self.transport.world_size, -1)
        whole = torch.cat([rows[j].view(torch.float32)[: self.chunk_numel(j)] for j in range(self.transport.world_size)])
        return self._split(whole, like)

    def server_error_chunk(self, whole: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's chunk of a server error given whole (one tensor per buffer, as
        :meth:`gather_server_error` returns them, at any number of ranks)."""
        flat = torch.cat([v.reshape(-1).float() for layout, t in zip(self.layouts, whole) for v in _piece_views(layout, t)])
        start = self.transport.rank * self.chunk
        return flat[start : start + self.server_error_numel].clone()

    def _split(self, mean: torch.Tensor, buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The flat mean -> one tensor per buffer (a :class:`Pieces` buffer's padding gets zero)."""
        out, offset = [], 0
        for layout, buf in zip(self.layouts, buffers):
            if isinstance(layout, Pieces):
                flat = torch.zeros(buf.shape, dtype=torch.float32, device=buf.device)
                for view in layout.views(flat):
                    view.copy_(mean[offset : offset + view.numel()].view_as(view))
                    offset += view.numel()
                out.append(flat)
            else:
                size = math.prod(layout)
                out.append(mean[offset : offset + size].view(tuple(layout)).to(buf.device))
                offset += size
        return out
