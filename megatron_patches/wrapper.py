"""What :func:`megatron_patches.install.apply` returns: Megatron's optimizer with a ds_lowcomm
method in it, used exactly like Megatron's (``step()`` returns ``(update_successful, grad_norm,
num_zeros_in_grad)``; ``zero_grad``, ``param_groups`` for the LR scheduler, ``get_loss_scale``
and everything else are Megatron's optimizer's), plus ``ledger`` (the method's bytes) and a
``state_dict()`` that holds the method's state next to Megatron's."""

from __future__ import annotations

from typing import Any


def chained(optimizer) -> list:
    """The optimizers a Megatron ``ChainedOptimizer`` holds (or the one given)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


class MegatronLowcomm:
    """Base of the wrappers: forwards what it does not define to Megatron's optimizer."""

    method: str = ""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, *args, **kwargs) -> Any:
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none)

    @property
    def ledger(self):
        raise NotImplementedError

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self) -> dict:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict) -> None:
        raise NotImplementedError

    def sharded_state_dict(self, *args, **kwargs):
        # Megatron's distributed checkpoint would hold Megatron's optimizer state without the
        # method's: refuse rather than save a checkpoint that cannot resume the run.
        raise NotImplementedError(
            "ds_lowcomm's method state is not in Megatron's distributed (sharded) checkpoints yet; "
            "use launch/pretrain_gpt.py's checkpoints (megatron_patches/checkpoint.py: one file per rank) "
            "or Megatron-LM's --ckpt-format torch (see docs/megatron_lm.md for what it keeps)")

    def __getattr__(self, name):  # everything else is Megatron's optimizer's
        return getattr(self.__dict__["optimizer"], name)


__all__ = ["MegatronLowcomm", "chained"]
