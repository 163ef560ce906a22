"""What :func:`megatron_patches.install.apply` returns: Megatron's optimizer with a ds_lowcomm
method in it, used exactly like Megatron's (``step()`` returns ``(update_successful, grad_norm,
num_zeros_in_grad)``; ``zero_grad``, ``param_groups`` for the LR scheduler, ``get_loss_scale``
and everything else are Megatron's optimizer's), plus ``ledger`` (the method's bytes) and a
``state_dict()`` that holds the method's state next to Megatron's."""

from __future__ import annotations

from typing import Any

import torch

from . import internals as mi


def chained(optimizer) -> list:
    """The optimizers a Megatron ``ChainedOptimizer`` holds (or the one given)."""
    if isinstance(optimizer, mi.live(mi.CHAINED_OPTIMIZER)):
        return list(mi.get(optimizer, mi.CHAINED_OPTIMIZERS))
    return [optimizer]


def optimizer_kind(opt) -> str:
    """What one of :func:`chained`'s optimizers is, by type: ``"float16"`` (Megatron's bf16/fp16
    parameters with fp32 main copies), ``"fp32"`` (Megatron's, stepping the model's own
    parameters) or ``"torch"`` (a torch optimizer; outer-loop methods only). Anything else, e.g.
    Megatron's distributed optimizers, is refused with a ConfigError naming the supported ones."""
    from ds_lowcomm.settings import ConfigError

    if isinstance(opt, mi.live(mi.FLOAT16_OPTIMIZER)):
        return "float16"
    if isinstance(opt, mi.live(mi.FP32_OPTIMIZER)):
        return "fp32"
    if isinstance(opt, torch.optim.Optimizer):
        return "torch"
    raise ConfigError(f"{type(opt).__name__} is not supported by ds_lowcomm yet: the optimizer must be what "
                      "get_megatron_optimizer builds without the distributed optimizer (Float16OptimizerWithFloat16"
                      "Params, FP32Optimizer, or a ChainedOptimizer of them), or a torch.optim.Optimizer "
                      "(diloco, dct_diloco, sparseloco)")


def torch_optimizer(opt):
    """The torch optimizer that steps: the one inside Megatron's, or ``opt`` itself."""
    return opt if optimizer_kind(opt) == "torch" else mi.get(opt, mi.OPTIMIZER_INNER)


def copy_main_params_to_model_params(opt) -> None:
    """New values landed in ``opt``'s parameters: copy them into the model's where those are
    separate (Megatron's bf16/fp16 parameters); fp32 and torch optimizers step the model's own."""
    if optimizer_kind(opt) == "float16":
        mi.live(mi.COPY_MAIN_TO_MODEL)(opt)


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


__all__ = ["MegatronLowcomm", "chained", "copy_main_params_to_model_params", "optimizer_kind", "torch_optimizer"]
