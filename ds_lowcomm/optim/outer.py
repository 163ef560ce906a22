"""DiLoCo-style outer loops around any inner optimizer.

Every replica runs ``sync_every`` (H) inner steps on its own data; then the pseudo-gradient
Delta_r = anchor - theta_r is combined across replicas, the anchor (the global parameters, kept
in ``state_dtype``, fp32 by default) takes one SGD step with (Nesterov) momentum along the
combined Delta, and every replica restarts from the new anchor. Inner optimizer state stays
local, as in the paper.

- :class:`DiLoCo`: Delta is averaged with a dense all-reduce.
- :class:`DCTDiLoCo` (Nedelkoski et al. 2025): Delta accumulates into a decayed local buffer
  e_r <- decay * e_r + Delta_r treated as a signal; only its top-k DCT components travel
  (sparse all-gather) and leave it; the mean of everyone's components drives the outer step.
  Every replica applies the same decoded update, so replicas stay identical, as with DiLoCo.
"""

from __future__ import annotations

import torch

from ..comm import SparseAllGather, Transport, all_reduce_mean_
from .base import LowcommOptimizer, ordered_params


class OuterLoop(LowcommOptimizer):
    """Base of the DiLoCo family: wraps ``inner``, whose param_groups it shares (LR schedulers
    and DeepSpeed see the inner learning rate)."""

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        *,
        sync_every: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        state_dtype: torch.dtype = torch.float32,
        transport: Transport | None = None,
        settings: dict | None = None,
    ):
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1; got {sync_every!r}")
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0; got {outer_lr!r}")
        if not 0.0 <= outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1); got {outer_momentum!r}")
        self.inner = inner
        super().__init__(ordered_params(inner.param_groups), {})
        self.param_groups = inner.param_groups
        self.sync_every = sync_every
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.nesterov = nesterov
        self.local_step = 0
        self.outer_steps = 0
        self._init_comm(
            transport,
            dict(sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
                 inner=type(inner).__name__, state_dtype=str(state_dtype), **(settings or {})),
        )
        with torch.no_grad():
            for p in self._params():
                self.state[p]["anchor"] = p.detach().to(state_dtype, copy=True)
                self.state[p]["outer_momentum"] = torch.zeros_like(p, dtype=state_dtype)

    def _params(self) -> list[torch.Tensor]:
        return ordered_params(self.param_groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None):
        loss = self.inner.step(closure)
        self.local_step += 1
        if self.local_step % self.sync_every == 0:
            self.outer_step()
        self.ledger.end_step()
        return loss

    def _combine(self, deltas: list[torch.Tensor]) -> list[torch.Tensor]:
        """Local pseudo-gradients -> the update every replica applies (identical on all)."""
        raise NotImplementedError

    @torch.no_grad()
    def outer_step(self) -> None:
        params = self._params()
        deltas = [self.state[p]["anchor"] - p.to(self.state[p]["anchor"].dtype) for p in params]
        updates = self._combine(deltas)
        mu = self.outer_momentum
        for p, g in zip(params, updates):
            state = self.state[p]
            buf = state["outer_momentum"]
            buf.mul_(mu).add_(g)
            state["anchor"].sub_(g.add(buf, alpha=mu) if self.nesterov else buf, alpha=self.outer_lr)
            p.copy_(state["anchor"])
        self.outer_steps += 1

    # -- checkpointing: outer state here, the inner optimizer's under "inner" ---------------
    def _extra_state(self):
        return {"local_step": self.local_step, "outer_steps": self.outer_steps, "inner": self.inner.state_dict()}

    def _load_extra_state(self, extra):
        self.local_step = extra["local_step"]
        self.outer_steps = extra["outer_steps"]
        self.inner.load_state_dict(extra["inner"])
        # Both loads replace their param_groups list; share the inner one again.
        self.param_groups = self.inner.param_groups


class DiLoCo(OuterLoop):
    method = "diloco"

    def _combine(self, deltas):
        all_reduce_mean_(deltas, self.transport, op="outer_all_reduce")
        return deltas


class DCTDiLoCo(OuterLoop):
    method = "dct_diloco"

    def __init__(
        self,
        inner: torch.optim.Optimizer,
        *,
        sync_every: int,
        decay: float = 0.9,
        topk: int = 32,
        chunk: int = 64,
        value_dtype: str = "fp32",
        transform: str = "dct",
        average: str = "senders",
        **outer_kwargs,
    ):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1); got {decay!r}")
        settings = dict(decay=decay, topk=topk, chunk=chunk, value_dtype=value_dtype, transform=transform, average=average)
        super().__init__(inner, sync_every=sync_every, settings=settings, **outer_kwargs)
        self.decay = decay
        for p in self._params():
            self.state[p]["residual"] = torch.zeros_like(self.state[p]["anchor"])
        self.sync = SparseAllGather(
            [p.shape for p in self._params()],
            chunk=chunk, topk=topk, value_dtype=value_dtype, transform=transform, average=average,
            transport=self.transport, op="outer_sparse_all_gather",
        )

    def _combine(self, deltas):
        residuals = []
        for p, delta in zip(self._params(), deltas):
            e = self.state[p]["residual"]
            e.mul_(self.decay).add_(delta)
            residuals.append(e)
        return self.sync.exchange(residuals)  # sent components leave the residuals
