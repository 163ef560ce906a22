"""The baseline: AdamW after a dense all-reduce of the gradients every step (what DDP does),
and the Adam hyperparameters every method's per-step or inner optimizer takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import ReplicaShard, Transport
from ..comm.wire import WirePlan, dense_mean_messages, elements
from ..settings import ConfigError, Settings, check_fraction, check_nonnegative, check_positive
from .base import LowcommOptimizer
from .muon import dense_state_bytes


@dataclass(frozen=True)
class AdamSettings(Settings):
    """lr, betas, eps, weight_decay of the per-step optimizer (adamw, demo: lr and weight decay;
    mtdao: beta2 is ``betas[1]``) or of the inner AdamW of the outer-loop methods: the
    ``"optimizer"`` section of a DeepSpeed config. Defaults are torch's AdamW's, but for the
    weight decay (0: set it where you want it)."""

    lr: float = 1e-3
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def check(self, where: str) -> None:
        check_positive(where, "lr", self.lr)
        if not isinstance(self.betas, tuple) or len(self.betas) != 2:
            raise ConfigError(f"{where}.betas must be a list of two numbers in [0, 1); got {self.betas!r}")
        for beta in self.betas:
            check_fraction(where, "betas[]", beta)
        check_nonnegative(where, "eps", self.eps)
        check_nonnegative(where, "weight_decay", self.weight_decay)

    def torch_kwargs(self) -> dict:
        return {"lr": float(self.lr), "betas": tuple(self.betas), "eps": float(self.eps),
                "weight_decay": float(self.weight_decay)}


@dataclass(frozen=True)
class AllReduceSettings(Settings):
    """The baseline has no settings of its own (its hyperparameters are :class:`AdamSettings`)."""

    def check(self, where: str) -> None:
        pass


class AllReduceAdamW(LowcommOptimizer, torch.optim.AdamW):
    method = "adamw"
    settings_class = AllReduceSettings

    def __init__(self, params, lr: float = AdamSettings.lr, *, transport: Transport | None = None,
                 shard: ReplicaShard | None = None, ledger_steps: bool = True, clip_grad: float = 0.0,
                 **adamw_kwargs):
        adam = AdamSettings.from_flat({"lr": lr, **adamw_kwargs}, where="optimizer", strict=True)
        torch.optim.AdamW.__init__(self, params, **adam.torch_kwargs())
        self._init_comm(AllReduceSettings(), transport, shard, ledger_steps, clip_grad)

    def _update(self, params):
        owned = self._owned(params)
        for p in params:
            if p.grad is None:  # keep the flat buffer's layout the same on every rank
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in owned]
        # it averages the gradients in place: what a driver keeps, for a try that fails
        committed = self._run_exchange(grads, lambda: self._start_mean_(owned, grads, "all_reduce").wait()) is not None
        self._clip_(params)  # the mean gradient, as DDP clips after its all-reduce
        if self.shard is not None:  # AdamW skips parameters without a gradient
            keep = {id(p) for p in owned}
            for p in params:
                if id(p) not in keep:
                    p.grad = None
        if committed:  # else no replica could commit it: every replica skips this step alike
            torch.optim.AdamW.step(self)
        self._share(params)

    # -- declared costs (see LowcommOptimizer.planned_wire) --
    @classmethod
    def local_optimizer(cls, settings, given=None):
        # AdamW here; the planner's dense Muon baseline is DDP's same all-reduce before torch's Muon
        return given or "adamw"

    @classmethod
    def planned_wire(cls, settings, shapes, *, grad_bytes=4, **_):
        return WirePlan.every_step(dense_mean_messages("all_reduce", [elements(shapes) * grad_bytes]), gradients=True)

    @classmethod
    def planned_state_bytes(cls, settings, shapes, *, matrices=None, param_bytes=4, local_optimizer=None):
        return dense_state_bytes(cls.local_optimizer(settings, local_optimizer), shapes, matrices, param_bytes)
