"""ds_lowcomm's outer-loop methods (DiLoCo, DCT-DiLoCo, SparseLoCo) around Megatron's optimizer.

:func:`megatron_patches.install.apply` switches Megatron DDP's data-parallel gradient sync off
(each replica trains on its own between syncs; that also skips the 1/dp gradient scaling that
only made sense for the all-reduce) and wraps Megatron's optimizer in :class:`OuterLoopOptimizer`:
its ``step()`` runs Megatron's ``step()`` (grad copy, clipping, Adam; mixed precision as
Megatron does it) as the outer loop's inner step, counts the local step, and every
``sync_every`` steps exchanges the pseudo-gradients across the data-parallel group and sets the
parameters to the new global ones (the main fp32 copies, then copied into the model's bf16/fp16
parameters). It returns Megatron's ``(update_successful, grad_norm, num_zeros_in_grad)``. A
Megatron step skipped for an fp16 overflow still counts as a local step. A plain
``torch.optim.Optimizer`` may stand in for Megatron's.
"""

from __future__ import annotations

from typing import Any

from ds_lowcomm.optim.outer import OuterLoop
from ds_lowcomm.optim.registry import OUTER_METHODS

from .sharded_state import Holder
from .wrapper import MegatronLowcomm, chained, copy_main_params_to_model_params


class _MegatronInner:
    """Megatron's optimizer as the outer loop's inner optimizer: its param_groups, its step
    (result kept for the caller), its state."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.last_result: Any = None

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups):  # OuterLoop forwards assignments; Megatron's are fixed
        if groups is not self.optimizer.param_groups:
            raise RuntimeError("the param_groups of a Megatron optimizer cannot be replaced")

    def step(self):
        self.last_result = self.optimizer.step()
        return self.last_result

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self.optimizer.load_state_dict(state_dict)

    def after_sync(self):
        """New global parameters landed in the optimizer's (main) params: copy them into the
        model's where they are separate (fp16/bf16)."""
        for opt in chained(self.optimizer):
            copy_main_params_to_model_params(opt)


class OuterLoopOptimizer(MegatronLowcomm):
    """Megatron's optimizer with ds_lowcomm's outer loop around it (see the module docstring).
    ``outer`` is the :class:`~ds_lowcomm.optim.outer.OuterLoop` (its ``ledger``, ``outer_steps``)."""

    def __init__(self, optimizer, outer: OuterLoop, inner: _MegatronInner | None):
        super().__init__(optimizer)
        self.method = outer.method
        self.outer = outer
        self._inner = inner

    def step(self, *args, **kwargs):
        before = self.outer.outer_steps
        self.outer.step()
        if self._inner is None:
            return None
        if self.outer.outer_steps != before:
            self._inner.after_sync()
        return self._inner.last_result

    @property
    def ledger(self):
        return self.outer.ledger

    def state_dict(self):
        """The outer loop's state, Megatron's optimizer's under ``lowcomm.inner``."""
        return self.outer.state_dict()

    def state_holders(self):
        return super().state_holders() + [Holder("outer", self.outer)]

    def _load_own(self, state_dict):
        self.outer.load_state_dict(state_dict)


__all__ = ["OUTER_METHODS", "OuterLoopOptimizer"]
