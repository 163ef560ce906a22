"""Whole matrices from the pieces a replica's ranks hold, for a step that needs the whole matrix.

Muon's step orthogonalises each weight matrix (Newton-Schulz on the matrix), which a ZeRO
partition does not hold: ZeRO 1/2 cut a group's parameters, laid end to end, into equal
partitions (a matrix at a partition's edge is split between ranks); ZeRO 3 cuts every parameter
over every rank. :class:`MatrixAssembly` gives each matrix one owning rank among the ranks that
hold a piece of it, moves the pieces to their owner with one all-to-all over the replica's
group, lets the owner compute ``fn(matrix)`` once, and moves each piece of the result back to the
rank that holds it with a second all-to-all (as DeepSpeed's ZeRO 3 Muon and torchtitan's
distributed Muon give each matrix one rank). A matrix held whole by one rank stays there and
moves nothing; when no matrix is cut, nothing is exchanged.

The layout (which rank holds which elements of which matrix, at what offset of which of its
flat tensors) is the same list on every rank of the replica, so every rank derives the same
owners and the same exchange plan and the collectives match. Bytes are booked in the
transport's ledger under ``op`` (the replica's fast links: apart from the cross-replica bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .transport import Transport


@dataclass(frozen=True)
class MatrixPiece:
    """Elements [start, start + length) of a matrix read row-major, held by replica rank ``rank``
    at offset ``at`` of its flat tensor number ``flat``."""

    rank: int
    start: int
    length: int
    flat: int
    at: int


@dataclass(frozen=True)
class Matrix:
    """A matrix (``rows`` x ``cols``: a parameter viewed as its first dimension by the rest), its
    pieces over the replica's ranks, and ``group``: the optimizer param group it steps in (the
    caller's ``fn`` reads its settings)."""

    rows: int
    cols: int
    pieces: tuple[MatrixPiece, ...]
    group: int = 0

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def _owners(matrices: Sequence[Matrix], world: int) -> list[int]:
    """One owner per matrix among its holders: the holder of the largest piece (fewest bytes to
    move); among equal pieces (ZeRO 3), the least loaded by Newton-Schulz work so far, then the
    lowest rank. Largest matrices first, so the work is balanced. Deterministic on every rank."""
    load = [0] * world
    owner = [0] * len(matrices)
    for j in sorted(range(len(matrices)), key=lambda j: (-matrices[j].numel, j)):
        m = matrices[j]
        held: dict[int, int] = {}
        for piece in m.pieces:
            held[piece.rank] = held.get(piece.rank, 0) + piece.length
        most = max(held.values())
        o = min((r for r, n in held.items() if n == most), key=lambda r: (load[r], r))
        owner[j] = o
        load[o] += m.numel * min(m.rows, m.cols)
    return owner


class MatrixAssembly:
    """Apply a whole-matrix function to matrices held in pieces by a replica's ranks (see the
    module's docstring). ``matrices``: every matrix of the replica, the same list on every rank;
    ``transport``: the replica's group, ``rank`` this rank's place in it."""

    def __init__(self, matrices: Sequence[Matrix], transport: Transport | None, rank: int, world: int,
                 op: str = "matrix_assembly"):
        for j, m in enumerate(matrices):
            if sum(p.length for p in m.pieces) != m.numel:
                raise ValueError(f"matrix {j} ({m.rows}x{m.cols}): its pieces cover "
                                 f"{sum(p.length for p in m.pieces)} elements")
        self.matrices = tuple(matrices)
        self.transport, self.rank, self.world, self.op = transport, rank, world, op
        self.owners = _owners(self.matrices, world)
        # per peer, in (matrix, start) order: my pieces of matrices it owns (sent to it, and its
        # results received back), and its pieces of matrices I own (received, results sent back)
        self._to = [[] for _ in range(world)]
        self._from = [[] for _ in range(world)]
        for j, m in enumerate(self.matrices):
            for piece in sorted(m.pieces, key=lambda p: p.start):
                o = self.owners[j]
                if piece.rank == rank and o != rank:
                    self._to[o].append((j, piece))
                elif o == rank and piece.rank != rank:
                    self._from[piece.rank].append((j, piece))
        # whether any piece lives away from its matrix's owner (the same answer on every rank)
        self.exchanges = any(p.rank != self.owners[j] for j, m in enumerate(self.matrices) for p in m.pieces)
        if self.exchanges and (transport is None or transport.world_size != world):
            raise ValueError("MatrixAssembly: matrices cut between ranks need the replica's transport")

    @property
    def owned(self) -> list[int]:
        return [j for j, o in enumerate(self.owners) if o == self.rank]

    def holds_any(self) -> bool:
        return any(p.rank == self.rank for m in self.matrices for p in m.pieces)

    @torch.no_grad()
    def apply_(self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
               fn: Callable[[Matrix, torch.Tensor], torch.Tensor]) -> None:
        """For every matrix piece this rank holds, write that piece of ``fn(matrix, whole)`` into
        ``outputs[piece.flat]`` at ``piece.at``; ``whole`` is the matrix (fp32, rows x cols)
        assembled from every holder's ``inputs[piece.flat]``. Other elements of ``outputs`` are
        left as they are. Collective over the replica (the same call on every rank)."""
        def cut(piece: MatrixPiece) -> torch.Tensor:
            return inputs[piece.flat][piece.at : piece.at + piece.length]

        received = self._exchange([[cut(p) for _, p in self._to[r]] for r in range(self.world)],
                                  [sum(p.length for _, p in self._from[r]) for r in range(self.world)])
        results: dict[int, torch.Tensor] = {}
        wholes = {j: torch.empty(self.matrices[j].numel, dtype=torch.float32, device=self._device(inputs))
                  for j in self.owned}
        for j in self.owned:
            for piece in self.matrices[j].pieces:
                if piece.rank == self.rank:
                    wholes[j][piece.start : piece.start + piece.length] = cut(piece)
        for r in range(self.world):
            offset = 0
            for j, piece in self._from[r]:
                wholes[j][piece.start : piece.start + piece.length] = received[r][offset : offset + piece.length]
                offset += piece.length
        for j, whole in wholes.items():
            m = self.matrices[j]
            results[j] = fn(m, whole.view(m.rows, m.cols)).reshape(-1).float()
            for piece in m.pieces:
                if piece.rank == self.rank:
                    out = outputs[piece.flat]
                    out[piece.at : piece.at + piece.length] = results[j][piece.start : piece.start + piece.length]
        back = self._exchange([[results[j][p.start : p.start + p.length] for j, p in self._from[r]]
                               for r in range(self.world)],
                              [sum(p.length for _, p in self._to[r]) for r in range(self.world)])
        for r in range(self.world):
            offset = 0
            for _, piece in self._to[r]:
                out = outputs[piece.flat]
                out[piece.at : piece.at + piece.length] = back[r][offset : offset + piece.length]
                offset += piece.length

    def _device(self, inputs: Sequence[torch.Tensor]) -> torch.device:
        return inputs[0].device if len(inputs) else torch.device("cpu")

    def _exchange(self, sends: list[list[torch.Tensor]], recv_sizes: list[int]) -> list[torch.Tensor]:
        """One all-to-all: ``sends[r]`` (pieces, concatenated) to rank r; per rank, what it sent here."""
        if not self.exchanges:
            return [torch.empty(0) for _ in range(self.world)]
        parts = [torch.cat([t.float().reshape(-1) for t in s]) if s else torch.empty(0) for s in sends]
        device = next((p.device for p in parts if p.numel()), self.transport.device)
        # a non-finite value never goes on the wire: the rank's own step skips it (its guard)
        send = torch.cat([p.to(device) for p in parts]).nan_to_num_(0.0, 0.0, 0.0) if any(
            p.numel() for p in parts) else torch.empty(0, device=device)
        out = self.transport.start_all_to_all(send, [p.numel() for p in parts], recv_sizes, op=self.op).wait()
        return list(torch.split(out, recv_sizes))
