"""``ds_lowcomm.deepspeed.install()``: the frameworks that call ``deepspeed.initialize`` for you
(the Hugging Face Trainer, Accelerate, Lightning's ``DeepSpeedStrategy``) use ds_lowcomm where
their DeepSpeed config has a ``"lowcomm"`` section.

One call, before the framework builds its engine, puts :func:`initialize` in place of
``deepspeed.initialize`` (the frameworks look it up on the module at each call). A config
without the section goes to DeepSpeed's own function, untouched: plain DeepSpeed, bit for bit.
With it, what the frameworks pass is taken as ds_lowcomm takes it:

- the optimizer: ds_lowcomm builds the method from the config's ``"optimizer"`` section. Where
  the framework built a torch ``AdamW``/``Adam`` itself (no such section: the Trainer's
  ``create_optimizer``, Lightning's ``configure_optimizers``), its hyperparameters become that
  section and its parameter groups (the very dicts: per-group weight decay and the learning rate
  its scheduler sets) the method's; any other optimizer is refused by name. Accelerate's
  ``DummyOptim`` arrives as ``model_parameters`` already;
- the scheduler: a callable (Accelerate's ``DummyScheduler``) or a built one, as DeepSpeed takes it;
- ``mpu`` (sequence parallelism): refused, as ``ds_lowcomm.deepspeed.initialize`` refuses it.

The frameworks' own data loaders shard over the whole world (every rank of every replica reads
its own shard), which is what replicas need; their gradient accumulation, mixed precision and
checkpoint calls go through the engine as with plain DeepSpeed.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from ..settings import ConfigError
from . import backend, internals

def install() -> None:
    """Route ``deepspeed.initialize`` through ds_lowcomm where the config has a ``"lowcomm"``
    section (idempotent). Call it once per process, before the framework initialises DeepSpeed."""
    internals.ensure_checked()
    import deepspeed

    from ..versions import check_supported, installed_version

    for framework in ("transformers", "accelerate", "lightning"):  # those of them installed: a supported one
        if installed_version(framework) is not None:
            check_supported(framework)
    # The framework starts DeepSpeed's backend itself (deepspeed.init_distributed), not through
    # ds_lowcomm's start: a build lock a killed process left would hang it forever.
    backend.release_stale_comm_op_lock()

    plain = internals.live(internals.DEEPSPEED_INITIALIZE)
    if getattr(plain, "_ds_lowcomm_plain", None) is not None:  # installed already
        return

    signature = inspect.signature(plain)

    @functools.wraps(plain)
    def initialize(*args, **kwargs):
        kwargs = dict(signature.bind(*args, **kwargs).arguments)  # by name, as DeepSpeed's would take them
        config = _config_of(kwargs)
        if not (isinstance(config, dict) and "lowcomm" in config):
            _refuse_leftover_mpu(kwargs)
            return plain(**kwargs)
        return _lowcomm_initialize(config, kwargs)

    initialize._ds_lowcomm_plain = plain
    internals.check_override(internals.DEEPSPEED_INITIALIZE, initialize)
    deepspeed.initialize = initialize


def uninstall() -> None:
    """Put DeepSpeed's own ``deepspeed.initialize`` back."""
    import deepspeed

    plain = getattr(deepspeed.initialize, "_ds_lowcomm_plain", None)
    if plain is not None:
        deepspeed.initialize = plain


def _refuse_leftover_mpu(kwargs: dict) -> None:
    """A plain engine built after a ds_lowcomm one in this process would take the earlier engine's
    replica as its data-parallel group: DeepSpeed keeps an engine's ``mpu`` in
    ``deepspeed.utils.groups.mpu`` for every later engine that brings none."""
    from .mpu import ReplicaMPU

    if kwargs.get("mpu") is None and isinstance(internals.live(internals.GROUPS_MPU), ReplicaMPU):
        raise ConfigError("a DeepSpeed config without a lowcomm section, after a ds_lowcomm engine in this process: "
                          "DeepSpeed would give the new engine the earlier one's replica as its data-parallel group "
                          "(deepspeed.utils.groups.mpu); build plain engines in a process of their own, or first")


def _config_of(kwargs: dict) -> Any:
    from .config import load_config

    raw = kwargs.get("config")
    if raw is None:
        raw = kwargs.get("config_params")
    if raw is None:
        raw = getattr(kwargs.get("args"), "deepspeed_config", None)
    if raw is None:
        return None
    return load_config(raw) if not isinstance(raw, dict) else raw


def _lowcomm_initialize(config: dict, kwargs: dict):
    from .engine import initialize

    kwargs = dict(kwargs)
    config = dict(config)
    kwargs.pop("config_params", None)
    optimizer = kwargs.pop("optimizer", None)
    if optimizer is not None:
        name = type(optimizer).__name__
        import torch

        if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
            raise ConfigError(f"optimizer: the framework built a {name}; with a lowcomm section ds_lowcomm builds "
                              "the method from an AdamW/Adam: give the DeepSpeed config an \"optimizer\" section "
                              "(the framework then passes a placeholder) or let it build torch's AdamW or Adam")
        if "optimizer" in config:
            raise ConfigError("optimizer: the config has an \"optimizer\" section and the framework passed its own "
                              f"{name} too; keep one")
        d = optimizer.defaults
        config["optimizer"] = {"type": name, "params": {  # torch's AdamW or Adam: the config type of that name
            "lr": d["lr"], "betas": list(d["betas"]), "eps": d["eps"], "weight_decay": d["weight_decay"]}}
        for key, refused in (("amsgrad", True), ("maximize", True)):
            if d.get(key) == refused:
                raise ConfigError(f"optimizer: {name}({key}=True) is not what ds_lowcomm's methods step")
        # its groups themselves: their weight decay, and the learning rate the framework's scheduler sets
        kwargs["model_parameters"] = optimizer.param_groups
    kwargs["config"] = config
    return initialize(**kwargs)


__all__ = ["install", "uninstall"]
