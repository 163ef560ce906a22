"""DeMo: decoupled momentum (Peng, Quesnelle, Kingma 2024), synchronised every step.

No gradient all-reduce: each rank keeps its own momentum, sends only its top-k DCT components
(which then leave its momentum), and every rank steps along the sign of everyone's mean
components, so replicas stay identical.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..codec import CodecSettings
from ..comm import ReplicaShard, Transport
from ..settings import check_fraction
from .adamw import AdamSettings
from .base import LowcommOptimizer, StatefulSettings


@dataclass(frozen=True)
class DeMoSettings(StatefulSettings):
    decay: float = 0.999  # the momentum's decay (DeMo's compression_decay)
    codec: CodecSettings = field(default_factory=CodecSettings)

    def check(self, where: str) -> None:
        super().check(where)
        check_fraction(where, "decay", self.decay)


class DeMo(LowcommOptimizer):
    method = "demo"
    settings_class = DeMoSettings

    def __init__(self, params, lr: float = 4e-4, *, weight_decay: float = 0.0, settings: DeMoSettings | None = None,
                 transport: Transport | None = None, shard: ReplicaShard | None = None, ledger_steps: bool = True,
                 **flat_settings):
        """``flat_settings``: decay, topk, chunk, value_dtype, transform, average, state_dtype
        (or one ``settings=DeMoSettings(...)``)."""
        settings = self.resolve_settings(settings, flat_settings)
        hyper = AdamSettings.from_flat({"lr": lr, "weight_decay": weight_decay}, where="DeMo")
        super().__init__(params, dict(lr=hyper.lr, weight_decay=hyper.weight_decay))
        self._init_comm(settings, transport, shard, ledger_steps)

    def _update(self, params):
        owned = {id(p) for p in self._owned(params)}
        synced, momenta, lrs = [], [], []
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if not p.requires_grad or not p.numel():  # frozen or empty: not decayed, not exchanged (as _current_params)
                    continue
                if id(p) not in owned:  # another rank of this replica syncs it and sends it here
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p, dtype=self.state_dtype)
                m = state["momentum"]
                if wd:
                    p.mul_(1.0 - lr * wd)
                m.mul_(self.settings.decay)
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
