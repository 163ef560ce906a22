"""What :func:`megatron_patches.install.apply` returns: Megatron's optimizer with a ds_lowcomm
method in it, used exactly like Megatron's (``step()`` returns ``(update_successful, grad_norm,
num_zeros_in_grad)``; ``zero_grad``, ``param_groups`` for the LR scheduler, ``get_loss_scale``
and everything else are Megatron's optimizer's), plus ``ledger`` (the method's bytes) and a
``state_dict()`` that holds the method's state next to Megatron's."""

from __future__ import annotations

from typing import Any

import torch

from . import internals as mi
from . import sharded_state


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


def model_params_of_mains(optimizer) -> dict[int, torch.Tensor]:
    """id(fp32 main copy) -> the model's bf16/fp16 parameter it copies (mixed precision); the
    model's fp32 parameters are stepped as they are."""
    out: dict[int, torch.Tensor] = {}
    for opt in chained(optimizer):
        if optimizer_kind(opt) == "float16":
            for model_group, main_group in zip(mi.get(opt, mi.FLOAT16_GROUPS), mi.get(opt, mi.FP32_FROM_FLOAT16_GROUPS)):
                out.update({id(main): p for p, main in zip(model_group, main_group)})
    return out


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

    def _load_own(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` gave."""
        raise NotImplementedError

    def stepped_params(self) -> list[torch.Tensor]:
        """The tensors Megatron's optimizer steps (fp32 main copies under mixed precision)."""
        return [p for opt in chained(self.optimizer) for g in torch_optimizer(opt).param_groups for p in g["params"]]

    def state_holders(self) -> list[sharded_state.Holder]:
        """The torch optimizers whose per-parameter state goes into distributed checkpoints by
        parameter: the one inside each of Megatron's (Adam, or the method's in its place)."""
        return [sharded_state.Holder(f"inner{j}", torch_optimizer(opt))
                for j, opt in enumerate(chained(self.optimizer))]

    def _shard_of(self, model_sharded_state_dict):
        mains = model_params_of_mains(self.optimizer)
        return sharded_state.sharded_params(model_sharded_state_dict, lambda p: mains.get(id(p), p))

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading: bool = False, metadata: dict | None = None,
                           **kwargs) -> dict:
        """For Megatron's distributed checkpoints (``torch_dist``): the whole state, each
        parameter's state sharded as the parameter (``model_sharded_state_dict``: the model's,
        as Megatron passes it), so it reshards (megatron_patches/sharded_state.py). ``metadata``:
        the content metadata dict, which carries the state's kinds and plain values (required)."""
        shard_of = self._shard_of(model_sharded_state_dict)
        if is_loading:
            request, self._sharded_plan = sharded_state.for_loading(self.method, metadata, self.state_holders(),
                                                                    self.stepped_params(), shard_of)
            return request
        return sharded_state.for_saving(self.state_dict(), self.stepped_params(), self.state_holders(), shard_of,
                                        self.method, metadata)

    def load_state_dict(self, state_dict: dict) -> None:
        """What :meth:`state_dict` gave, or what ``dist_checkpointing.load`` returned for
        :meth:`sharded_state_dict` (then the stepped parameters too)."""
        if not sharded_state.is_sharded(state_dict):
            self._load_own(state_dict)
            return
        plan = self.__dict__.pop("_sharded_plan", None)
        if plan is None:
            raise sharded_state.ShardedStateError("load_state_dict got a distributed checkpoint's state without "
                                                  "sharded_state_dict(..., is_loading=True) having asked for it")
        params = self.stepped_params()
        state, saved_params = sharded_state.rebuild(state_dict, plan, self.state_dict(), params)
        self._load_own(state)
        if len(params) != len(saved_params):
            raise sharded_state.ShardedStateError(f"the checkpoint holds {len(saved_params)} parameters for this "
                                                  f"rank; its optimizer steps {len(params)}")
        with torch.no_grad():
            for p, saved in zip(params, saved_params):
                p.copy_(saved)
        for opt in chained(self.optimizer):
            copy_main_params_to_model_params(opt)

    def __getattr__(self, name):  # everything else is Megatron's optimizer's
        return getattr(self.__dict__["optimizer"], name)


__all__ = ["MegatronLowcomm", "chained", "copy_main_params_to_model_params", "model_params_of_mains", "optimizer_kind",
           "torch_optimizer"]
