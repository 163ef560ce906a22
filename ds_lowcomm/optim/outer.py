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

from ..comm import Transport, all_reduce_mean_
from .base import LowcommOptimizer, ordered_params


class OuterLoop(LowcommOptimizer):
    """Base of the DiLoCo family. It wraps ``inner`` and *is* its param_groups: LR schedulers
    and DeepSpeed see (and may swap, as ZeRO does per step) the inner optimizer's groups."""

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
        codec: dict | None = None,
    ):
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1; got {sync_every!r}")
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0; got {outer_lr!r}")
        if not 0.0 <= outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1); got {outer_momentum!r}")
        super().__init__(ordered_params(inner.param_groups), {})
        self.inner = inner  # from here on, param_groups are the inner optimizer's
        self.__dict__.pop("_own_groups", None)
        self.sync_every = sync_every
        self.outer_lr = outer_lr
        self.outer_momentum = outer_momentum
        self.nesterov = nesterov
        self.state_dtype = state_dtype
        self._init_comm(
            transport,
            dict(sync_every=sync_every, outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
                 inner=type(inner).__name__, state_dtype=str(state_dtype), **(settings or {})),
            codec=codec,
        )

    @property
    def param_groups(self):
        if "inner" in self.__dict__:
            return self.inner.param_groups
        return self.__dict__.setdefault("_own_groups", [])  # only while Optimizer.__init__ runs

    @param_groups.setter
    def param_groups(self, groups):
        if "inner" in self.__dict__:
            self.inner.param_groups = groups
        else:
            self.__dict__["_own_groups"] = groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @property
    def local_step(self) -> int:
        """Inner steps taken (by the first parameter currently in param_groups)."""
        params = self._current_params()
        return self.state[params[0]].get("local_step", 0) if params else 0

    @property
    def outer_steps(self) -> int:
        params = self._current_params()
        return self.state[params[0]].get("outer_steps", 0) if params else 0

    def step(self, closure=None):
        params = self._current_params()
        if self._is_placeholder_step(params):
            return None
        owned = self._owned(params)
        with torch.no_grad():
            for p in params:
                state = self.state[p]
                if "local_step" not in state:
                    state["local_step"] = 0
                    state["outer_steps"] = 0
            for p in owned:
                state = self.state[p]
                if "anchor" not in state:  # the global parameters every replica starts from
                    state["anchor"] = p.detach().to(self.state_dtype, copy=True)
                    state["outer_momentum"] = torch.zeros_like(state["anchor"])
        loss = self.inner.step(closure)
        for p in params:
            self.state[p]["local_step"] += 1
        if self.state[params[0]]["local_step"] % self.sync_every == 0:
            if owned:
                self.outer_step(owned)
            self._share(params)
            for p in params:
                self.state[p]["outer_steps"] += 1
        self._finish_step()
        return loss

    def _combine(self, params: list[torch.Tensor], deltas: list[torch.Tensor]) -> list[torch.Tensor]:
        """Local pseudo-gradients -> the update every replica applies (identical on all)."""
        raise NotImplementedError

    @torch.no_grad()
    def outer_step(self, params: list[torch.Tensor] | None = None) -> None:
        params = self._current_params() if params is None else params
        deltas = [self.state[p]["anchor"] - p.to(self.state_dtype) for p in params]
        updates = self._combine(params, deltas)
        mu = self.outer_momentum
        for p, g in zip(params, updates):
            state = self.state[p]
            buf = state["outer_momentum"]
            buf.mul_(mu).add_(g)
            state["anchor"].sub_(g.add(buf, alpha=mu) if self.nesterov else buf, alpha=self.outer_lr)
            p.copy_(state["anchor"])

    # -- checkpointing: outer state here, the inner optimizer's under "inner" ---------------
    def _extra_state(self):
        return {"inner": self.inner.state_dict()}

    def _load_extra_state(self, extra):
        self.inner.load_state_dict(extra["inner"])


class DiLoCo(OuterLoop):
    method = "diloco"

    def _combine(self, params, deltas):
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
        codec = dict(topk=topk, chunk=chunk, value_dtype=value_dtype, transform=transform, average=average)
        super().__init__(inner, sync_every=sync_every, settings=dict(decay=decay), codec=codec, **outer_kwargs)
        self.decay = decay

    def _combine(self, params, deltas):
        residuals = []
        for p, delta in zip(params, deltas):
            state = self.state[p]
            if "residual" not in state:
                state["residual"] = torch.zeros_like(delta)
            state["residual"].mul_(self.decay).add_(delta)
            residuals.append(state["residual"])
        # sent components leave the residuals
        return self._sync_for(params, "outer_sparse_all_gather").exchange(residuals)
