"""DeMo: decoupled momentum (Peng, Quesnelle, Kingma 2024), synchronised every step.

No gradient all-reduce: each rank keeps its own momentum, sends only its top-k DCT components
(which then leave its momentum), and every rank steps along the sign of everyone's mean
components, so replicas stay identical.
"""

from __future__ import annotations

import torch

from ..comm import Transport
from .base import LowcommOptimizer


class DeMo(LowcommOptimizer):
    method = "demo"

    def __init__(
        self,
        params,
        lr: float = 4e-4,
        *,
        decay: float = 0.999,
        topk: int = 32,
        chunk: int = 64,
        weight_decay: float = 0.0,
        value_dtype: str = "fp32",
        transform: str = "dct",
        average: str = "senders",
        state_dtype: torch.dtype = torch.float32,
        transport: Transport | None = None,
    ):
        if not lr > 0:
            raise ValueError(f"lr must be > 0; got {lr!r}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1); got {decay!r}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0; got {weight_decay!r}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.decay = decay
        self.state_dtype = state_dtype
        self._init_comm(
            transport,
            dict(decay=decay, state_dtype=str(state_dtype)),
            codec=dict(topk=topk, chunk=chunk, value_dtype=value_dtype, transform=transform, average=average),
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._evaluate_closure(closure)
        params = self._current_params()
        if self._is_placeholder_step(params):
            return loss
        owned = {id(p) for p in self._owned(params)}
        synced, momenta, lrs = [], [], []
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if id(p) not in owned:  # another rank of this replica syncs it and sends it here
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p, dtype=self.state_dtype)
                m = state["momentum"]
                if wd:
                    p.mul_(1.0 - lr * wd)
                m.mul_(self.decay)
                if p.grad is not None:  # a parameter without a gradient still takes part in the exchange
                    m.add_(p.grad.to(m.dtype), alpha=lr)
                synced.append(p)
                momenta.append(m)
                lrs.append(lr)
        if synced:
            # Sends each momentum's top-k DCT components and removes them from it (error feedback).
            means = self._sync_for(synced, "sparse_all_gather").exchange(momenta)
            for p, lr, q in zip(synced, lrs, means):
                p.add_(q.sign().to(p.dtype), alpha=-lr)
        self._share(params)
        self._finish_step()
        return loss
