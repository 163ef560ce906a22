"""A compressed all-reduce of one-bit (sign) payloads whose bytes per rank stay nearly flat in the
number of ranks, with no second rounding: its mean is exact for the signs sent.

An all-gather of compressed payloads hands every rank every other rank's payload: (n - 1) x P
received per rank, growing with the number of replicas n. Here the flat tensor (every piece of
every tensor end to end) is cut into n equal chunks (the last one shorter), and

1. each rank codes each element as its sign and each tensor piece by its scale, the mean
   magnitude of its elements (the sign format of codec/sparse.py, piece by piece), and sends
   chunk j to rank j: the chunk's sign bits, its own scale of every piece the chunk touches, and
   its health flag byte (an all-to-all);
2. rank j, for each piece of its chunk, takes the healthy ranks with a non-zero scale there (the
   piece's m contributors), their scales' mean s (one scale shared by all of them), and for each
   element the count c of contributors whose sign is positive, an integer in [0, m]; it
   all-gathers c mod n in ceil(log2 n) bits an element, with s and m per piece.

Each element's mean over the h healthy ranks is then s (2c - m) / h, the same bits on every rank.
A receiver decodes c from c mod n alone, since c = n only where every rank contributed (m = n),
itself included, and then its own sign tells c = n (positive) from c = 0 (negative). What a rank's
signs stand for in the mean is s times its sign, so that is what error feedback takes out of its
buffers, once phase 2 has landed (a rank that did not contribute to a piece keeps that piece as it
was). A piece whose value is zero on every rank has no contributor: it is not moved, as in the
all-gather (a tensor with no gradient, an unused expert).

Per rank, phase 1 receives (n - 1)/n of one bit an element and phase 2 (n - 1)/n of ceil(log2 n)
bits: 2 bits an element at 4 replicas and 3.5 at 8, where the all-gather receives n - 1 (3 and 7).
Phase 2 needs phase 1's result, so :class:`Pending`'s ``advance()`` runs it (the decode of phase
1 and the start of phase 2) when the caller is ready, e.g. one inner step after the send;
``wait()`` runs whatever is left.

Health flags as in collectives.py: a rank with a non-finite value (or told unhealthy, or sitting
out) sends zeros flagged so and keeps its buffers; every rank receives every rank's flag in phase
1, so all agree on the ranks averaged. With no rank healthy nothing moves (no phase 2).
"""

from __future__ import annotations

import bisect
import math
import time
from typing import Sequence

import torch

from ..codec import pack_codes, packed_nbytes, unpack_codes
from .collectives import HEALTHY, Layout, Pieces, _piece_shapes, _piece_views, all_finite, health_flag, settle_health, settled_seconds
from .transport import Pending, Transport

SCALE_BYTES = 4  # a piece's scale, fp32


def count_bits(world_size: int) -> int:
    """Bits of one element's count mod n in phase 2: ceil(log2 n), at least one."""
    return max(1, math.ceil(math.log2(world_size)))


class CompressedAllReduce:
    """A fixed list of tensors averaged over ranks as signs with shared per-piece scales (see the
    module's docstring).

    ``start(buffers, healthy)`` codes and sends phase 1 now and returns a :class:`Pending`;
    ``advance()`` on it starts phase 2, ``wait()`` finishes it: error feedback is applied to
    ``buffers`` and each buffer's mean over ranks (fp32) returned. Keeps no state between calls."""

    def __init__(self, layouts: Sequence[Layout], *, transport: Transport, op: str = "compressed_all_reduce"):
        self.layouts = list(layouts)
        self.transport = transport
        self.op = op
        sizes = [math.prod(shape) for layout in self.layouts for shape in _piece_shapes(layout)]  # padding left out
        self.numel = sum(sizes)
        n = transport.world_size
        if self.numel < n:
            raise ValueError(f"{op}: {self.numel} element(s) cannot be cut into {n} non-empty chunks, one per "
                             f"replica: set lowcomm.exchange all_gather for so few elements")
        if n >= 1 << 16:
            raise ValueError(f"{op}: at most {(1 << 16) - 1} ranks; got {n}")
        self.width = count_bits(n)
        self.count_bytes = 1 if n < 256 else 2  # a piece's contributor count m, up to n
        # The flat tensor holds the pieces in the order :func:`_dealt` gives: small tensors spread
        # over the chunks, not all in one, so every chunk carries about as many scales; and the bytes
        # are the same whatever order the pieces come in (Muon's groups reorder them)
        self.piece_sizes, self.order = sizes, _dealt(sizes, n)
        starts = [0]
        for k in self.order:
            starts.append(starts[-1] + sizes[k])
        self.piece_starts = [0] * len(sizes)  # each piece's first element in the flat tensor
        for q, k in enumerate(self.order):
            self.piece_starts[k] = starts[q]
        # chunk j is elements bounds[j]:bounds[j + 1], cut so that every chunk's phase 2 part (its
        # counts and its pieces' headers) is as large as the others': every rank then sends and
        # receives about the same bytes (an all-gather's parts are equal: the largest sets them all)
        self.bounds = _balanced_bounds(starts, n, lambda lo, hi: self._part_bytes(starts, lo, hi))
        # per chunk: the pieces it touches, as (piece index, elements of the piece inside the chunk)
        self.segments = [[(self.order[q], count) for q, count in _segments(starts, lo, hi)]
                         for lo, hi in zip(self.bounds, self.bounds[1:])]
        # every part of phase 1 travels at the largest one's size too (each rank sends and receives alike)
        self.phase1_bytes = max(packed_nbytes(self.chunk_numel(j), 1) + SCALE_BYTES * len(self.segments[j]) + 1
                                for j in range(n))
        self.phase2_bytes = max(self._part_bytes(starts, lo, hi) for lo, hi in zip(self.bounds, self.bounds[1:]))

    def chunk_numel(self, j: int) -> int:
        return self.bounds[j + 1] - self.bounds[j]

    def _part_bytes(self, starts: list[int], lo: int, hi: int) -> int:
        """Phase 2's bytes for the chunk of elements lo:hi: its counts, and each touched piece's
        shared scale and contributor count."""
        return packed_nbytes(hi - lo, self.width) + (SCALE_BYTES + self.count_bytes) * len(_segments(starts, lo, hi))

    def ledger_bytes(self) -> dict[str, tuple[int, int]]:
        """What one exchange records in the ledger, per op: (sent, received), the same on every rank."""
        n = self.transport.world_size
        return {f"{self.op}_scatter": ((n - 1) * self.phase1_bytes, (n - 1) * self.phase1_bytes),
                f"{self.op}_gather": (self.phase2_bytes, (n - 1) * self.phase2_bytes)}

    def exchange(self, buffers: Sequence[torch.Tensor], healthy: bool = True) -> list[torch.Tensor]:
        return self.start(buffers, healthy).wait()

    def _per_element(self, values: torch.Tensor, j: int) -> torch.Tensor:
        """(..., pieces of chunk j) -> (..., elements of chunk j): each piece's value over its elements."""
        lengths = torch.tensor([count for _, count in self.segments[j]], dtype=torch.int64, device=values.device)
        return torch.repeat_interleave(values, lengths, dim=-1)

    def start(self, buffers: Sequence[torch.Tensor], healthy: bool = True) -> Pending:
        if len(buffers) != len(self.layouts):
            raise ValueError(f"expected {len(self.layouts)} tensors, got {len(buffers)}")
        n, start = self.transport.world_size, time.perf_counter()
        pieces = [v for layout, buf in zip(self.layouts, buffers) for v in _piece_views(layout, buf)]
        device = pieces[0].device
        flag = health_flag(healthy and all_finite(pieces), self.transport)
        parts = []
        if flag == HEALTHY:
            flat = torch.cat([pieces[k].reshape(-1).float() for k in self.order])
            scales = torch.stack(torch._foreach_norm(pieces, 1, dtype=torch.float32)) / torch.tensor(
                self.piece_sizes, dtype=torch.float32, device=device)
            negative = flat < 0
            for j in range(n):
                at = self.bounds[j]
                bits = pack_codes(negative[at : at + self.chunk_numel(j)], 1)
                mine = scales[[k for k, _ in self.segments[j]]].view(torch.uint8)
                parts += [bits, mine, torch.zeros(self.phase1_bytes - bits.numel() - mine.numel() - 1, dtype=torch.uint8,
                                                  device=device), torch.full((1,), HEALTHY, dtype=torch.uint8, device=device)]
        else:
            scales = None
            for j in range(n):
                parts += [torch.zeros(self.phase1_bytes - 1, dtype=torch.uint8, device=device),
                          torch.full((1,), flag, dtype=torch.uint8, device=device)]
        send = torch.cat(parts)
        self.transport.ledger.add_time("codec", settled_seconds(start, device))
        phase1 = self.transport.start_all_to_all(send, [self.phase1_bytes] * n, [self.phase1_bytes] * n,
                                                 op=f"{self.op}_scatter")
        state: dict = {}

        def advance():
            if "phase2" not in state:
                state["phase2"] = self._phase2(phase1.wait())

        def finish():
            advance()
            keep, pending = state["phase2"]
            return self._finish(keep, pending, send, scales, pieces, buffers)

        return Pending(finish, None, advance=advance)

    def _phase2(self, received: torch.Tensor) -> tuple[list[int], Pending | None]:
        """Phase 1 landed: the healthy ranks, and (if any) phase 2 started with this rank's chunk."""
        n, me = self.transport.world_size, self.transport.rank
        rows = received.reshape(n, self.phase1_bytes)
        # a failed exchange (a torchft peer died in it) received nothing to decode: it is discarded
        keep = [] if self.transport.failed is not None else settle_health(rows[:, -1], self.transport, self.op)
        if not keep:  # every rank saw the same flags: none runs phase 2, nothing moves
            return keep, None
        start = time.perf_counter()
        count, pieces = self.chunk_numel(me), len(self.segments[me])
        bits = packed_nbytes(count, 1)
        rows = rows[keep]
        positive = 1 - unpack_codes(rows[:, :bits], count, 1)  # (healthy ranks, elements)
        scales = _as_float32(rows[:, bits : bits + SCALE_BYTES * pieces]).reshape(len(keep), pieces)
        contributes = scales > 0  # a rank whose piece is all zero sends no sign there
        m = contributes.sum(dim=0)
        total = torch.zeros(pieces, dtype=torch.float32, device=rows.device)
        for r in range(len(keep)):  # in rank order: the same bits on every device
            total += torch.where(contributes[r], scales[r], 0.0)
        shared = total / m.clamp(min=1)
        c = (positive * self._per_element(contributes, me)).sum(dim=0)
        data = torch.cat([pack_codes(c % n, self.width), shared.view(torch.uint8),
                          m.to(torch.int32).view(torch.uint8).reshape(pieces, 4)[:, : self.count_bytes].reshape(-1)])
        if data.numel() < self.phase2_bytes:
            data = torch.cat([data, data.new_zeros(self.phase2_bytes - data.numel())])
        self.transport.ledger.add_time("codec", settled_seconds(start, rows.device))
        return keep, self.transport.start_all_gather_bytes(data, op=f"{self.op}_gather")

    def _finish(self, keep, phase2, send, scales, pieces, buffers) -> list[torch.Tensor]:
        n, me = self.transport.world_size, self.transport.rank
        device = send.device
        if phase2 is None:
            return self._split(torch.zeros(self.numel, dtype=torch.float32, device=device), buffers)
        gathered = phase2.wait()
        start = time.perf_counter()
        mine = scales is not None and me in keep  # this rank's signs were counted (where its scale is non-zero)
        means, offset = [], 0
        for j in range(n):
            count, k = self.chunk_numel(j), len(self.segments[j])
            head = packed_nbytes(count, self.width)
            c = unpack_codes(gathered[j, :head], count, self.width)
            shared = _as_float32(gathered[j, head : head + SCALE_BYTES * k])
            m = _as_uint(gathered[j, head + SCALE_BYTES * k : head + (SCALE_BYTES + self.count_bytes) * k],
                         self.count_bytes)
            if mine:  # c = n where every rank counted (this one too) and this one's sign is positive
                own = 1 - unpack_codes(send[offset : offset + packed_nbytes(count, 1)], count, 1)
                everyone = self._per_element(m == n, j)
                c = torch.where(everyone & (c == 0) & (own == 1), torch.full_like(c, n), c)
            means.append(self._per_element(shared, j) * (2 * c - self._per_element(m, j)).float() / len(keep))
            if mine:  # error feedback: what this rank's signs stood for leaves its buffers
                own_scale = scales[[piece for piece, _ in self.segments[j]]]
                counted = self._per_element(own_scale > 0, j)
                sent = torch.where(counted, self._per_element(shared, j) * (2.0 * own.float() - 1.0), 0.0)
                self._subtract(pieces, j, sent)
            offset += self.phase1_bytes
        flat = torch.cat(means)  # the pieces in their flat order, back in theirs
        mean = torch.cat([flat[self.piece_starts[k] : self.piece_starts[k] + size] for k, size in enumerate(self.piece_sizes)])
        out = self._split(mean, buffers)
        self.transport.ledger.add_time("codec", settled_seconds(start, device))
        return out

    def _subtract(self, pieces: list[torch.Tensor], j: int, sent: torch.Tensor) -> None:
        """Take chunk j's ``sent`` (fp32, its elements in order) out of the pieces it covers."""
        at = self.bounds[j]
        for piece, count in self.segments[j]:
            inside = at - self.piece_starts[piece]
            view = pieces[piece].reshape(-1)[inside : inside + count]
            view.sub_(sent[at - self.bounds[j] : at - self.bounds[j] + count].to(view.dtype))
            at += count

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


class _Place:
    """A rank among ``world_size``: all :class:`CompressedAllReduce` needs to lay out its chunks and
    count its bytes (the planner prices an exchange without running one)."""

    def __init__(self, world_size: int, rank: int):
        self.world_size, self.rank = world_size, rank


def phase_bytes(layouts: Sequence[Layout], world_size: int) -> dict[str, tuple[int, int]]:
    """Per phase (op suffix ``scatter``, ``gather``), what each of ``world_size`` ranks sends and
    receives in one exchange of ``layouts``: what the planner prices."""
    ledger = CompressedAllReduce(layouts, transport=_Place(world_size, 0)).ledger_bytes()
    return {op.rsplit("_", 1)[1]: sizes for op, sizes in ledger.items()}


def _as_float32(data: torch.Tensor) -> torch.Tensor:
    """Bytes (rows of a received buffer, at any offset) -> fp32 values, flat, copied to aligned storage."""
    return data.reshape(-1).clone().view(torch.float32)


def _as_uint(data: torch.Tensor, width: int) -> torch.Tensor:
    """Little-endian unsigned integers of ``width`` bytes (1 or 2) -> int64 values."""
    grouped = data.reshape(-1, width).to(torch.int64)
    return grouped[:, 0] if width == 1 else grouped[:, 0] | (grouped[:, 1] << 8)


def _dealt(sizes: list[int], n: int) -> list[int]:
    """The pieces of ``sizes`` in the order the flat tensor holds them: dealt to n heaps as a draft
    goes, largest first, the order of the heaps reversed every round (large and small pieces mixed
    in each, as many pieces in each), heap after heap. It depends on the sizes alone."""
    heaps: list[list[int]] = [[] for _ in range(n)]
    for i, k in enumerate(sorted(range(len(sizes)), key=lambda k: (-sizes[k], k))):
        round_, place = divmod(i, n)
        heaps[place if round_ % 2 == 0 else n - 1 - place].append(k)
    return [k for heap in heaps for k in heap]


def _segments(starts: list[int], lo: int, hi: int) -> list[tuple[int, int]]:
    """The pieces (``starts``: each piece's first element, then the end) elements lo:hi touch, as
    (piece index, its elements inside lo:hi)."""
    out = []
    for k in range(bisect.bisect_right(starts, lo) - 1, len(starts) - 1):
        if starts[k] >= hi:
            break
        out.append((k, min(hi, starts[k + 1]) - max(lo, starts[k])))
    return out


def _balanced_bounds(starts: list[int], n: int, cost) -> list[int]:
    """Elements 0:starts[-1] cut into n non-empty chunks, in order, with the largest
    ``cost(lo, hi)`` (non-decreasing in hi) least: the smallest budget at which greedy chunks (each
    as long as the budget allows) cover every element, found by bisection."""
    numel = starts[-1]

    def cut(budget: int) -> list[int] | None:
        bounds = [0]
        for j in range(n - 1):
            lo, hi_max = bounds[-1], numel - (n - 1 - j)  # an element left for each chunk after this one
            if lo >= hi_max or cost(lo, lo + 1) > budget:
                return None
            a, b = lo + 1, hi_max  # the largest hi in a:b+1 with cost(lo, hi) <= budget
            while a < b:
                mid = (a + b + 1) // 2
                a, b = (mid, b) if cost(lo, mid) <= budget else (a, mid - 1)
            bounds.append(a)
        return bounds + [numel] if cost(bounds[-1], numel) <= budget else None

    low, high = 1, cost(0, numel)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if cut(mid) is not None else (mid + 1, high)
    return cut(low)
