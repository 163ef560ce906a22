"""Splitting the cross-replica sync among a replica's ranks when they all hold every parameter.

With ZeRO 1/2/3 each rank of a replica owns a partition already. At ZeRO 0 every rank holds the
whole model (and, after DeepSpeed's in-replica gradient average, the same gradients), so each
parameter is given one owner among the replica's ranks: only the owner syncs it across replicas
(with the owners of the same parameter in the other replicas), and then sends the result to the
rest of its replica (a broadcast on the fast in-replica links).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .transport import Transport


class ReplicaShard:
    def __init__(self, local_rank: int, replica_size: int, replica_transport: Transport):
        self.local_rank = local_rank
        self.replica_size = replica_size
        self.transport = replica_transport  # the replica's group; its ledger is in-replica traffic
        self._owners: dict[tuple[int, ...], list[int]] = {}

    def owners(self, params: Sequence[torch.Tensor]) -> list[int]:
        """Owner (local rank) of each parameter: largest first to the least-loaded rank, so the
        shares are balanced; deterministic, so every replica assigns the same way."""
        key = tuple(id(p) for p in params)
        if key not in self._owners:
            load = [0] * self.replica_size
            owner = [0] * len(params)
            for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
                j = min(range(self.replica_size), key=lambda r: (load[r], r))
                owner[i] = j
                load[j] += params[i].numel()
            self._owners[key] = owner
        return self._owners[key]

    def owned(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [p for p, o in zip(params, self.owners(params)) if o == self.local_rank]

    @torch.no_grad()
    def share(self, params: Sequence[torch.Tensor]) -> None:
        """Every owner sends its parameters to the rest of the replica (one flat broadcast each)."""
        owners = self.owners(params)
        for j in range(self.replica_size):
            mine = [p for p, o in zip(params, owners) if o == j]
            for dtype in sorted({p.dtype for p in mine}, key=str):
                group = [p for p in mine if p.dtype == dtype]
                flat = torch.cat([p.reshape(-1) for p in group])
                self.transport.broadcast_(flat, src=j, op="replica_broadcast")
                offset = 0
                for p in group:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
