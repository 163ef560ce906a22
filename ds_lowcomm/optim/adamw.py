"""The baseline: AdamW after a dense all-reduce of the gradients every step (what DDP does)."""

from __future__ import annotations

import torch

from ..comm import Transport, all_reduce_mean_
from .base import LowcommOptimizer


class AllReduceAdamW(LowcommOptimizer, torch.optim.AdamW):
    method = "adamw"

    def __init__(self, params, lr: float = 1e-3, *, transport: Transport | None = None, **adamw_kwargs):
        torch.optim.AdamW.__init__(self, params, lr=lr, **adamw_kwargs)
        self._init_comm(transport, {})

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._evaluate_closure(closure)
        params = self._current_params()
        if self._is_placeholder_step(params):
            return loss
        owned = self._owned(params)
        for p in params:
            if p.grad is None:  # keep the flat buffer's layout the same on every rank
                p.grad = torch.zeros_like(p)
        all_reduce_mean_([p.grad for p in owned], self.transport)
        if self.shard is not None:  # AdamW skips parameters without a gradient
            keep = {id(p) for p in owned}
            for p in params:
                if id(p) not in keep:
                    p.grad = None
        torch.optim.AdamW.step(self)
        self._share(params)
        self._finish_step()
        return loss
