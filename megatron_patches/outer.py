"""ds_lowcomm's outer-loop methods (DiLoCo, DCT-DiLoCo, SparseLoCo) around a Megatron-Core model.

The choice made here (first version):

- **A replica is one Megatron model-parallel group** (its TP x PP ranks), and the replicas are
  Megatron's **data-parallel ranks**: the user initialises ``parallel_state`` as usual
  (``initialize_model_parallel(tp, pp)``), and rank r of replica a holds the same parameter
  shards as rank r of replica b. Each (TP, PP) position's data-parallel group is therefore the set
  of peers it exchanges with; :func:`apply` builds the transport over
  ``parallel_state.get_data_parallel_group()``.
- **Megatron's data-parallel gradient sync is switched off** so each replica trains on its own
  between syncs: every bucket group of every Megatron ``DistributedDataParallel`` chunk gets a
  no-op ``start_grad_sync``/``finish_grad_sync`` (instance attributes; the classes are not
  touched). That also skips the 1/dp_size gradient scaling that only made sense for the
  all-reduce. Everything else in ``finalize_model_grads`` stays: tensor-parallel layernorm
  grads, the pipeline's tied embedding grads. Megatron's own code is not changed otherwise.
- **Megatron's optimizer is the inner optimizer**: :func:`apply` returns a wrapper whose
  ``step()`` runs Megatron's ``step()`` (its grad copy, clipping, Adam) as the outer loop's inner
  step, counts the local step, and every ``sync_every`` steps exchanges the pseudo-gradients
  across the data-parallel group and sets the parameters to the new global ones. The wrapper
  returns Megatron's ``(update_successful, grad_norm, num_zeros_in_grad)`` and forwards
  everything else (``zero_grad``, ``param_groups`` for the LR scheduler, ...) to Megatron's
  optimizer. A plain ``torch.optim.Optimizer`` may be given instead.

Not supported yet, refused with a message: the distributed optimizer (its param groups are
shards and it needs the data-parallel reduce-scatter), context parallelism > 1 and
expert-parallel parameters (their data-parallel group differs), the per-step methods (adamw,
demo, mtdao: they replace the gradient all-reduce itself), ``lowcomm.transport`` mpi, and
Megatron's sharded (distributed) checkpoints of the wrapper: ``state_dict()`` is ds_lowcomm's
(outer state, with Megatron's optimizer state under ``lowcomm.inner``). With fp16/bf16 the
main (fp32) parameters are synced and copied into the model's after a sync (not tested here).
A Megatron step skipped for an fp16 overflow still counts as a local step.

Replicas must start from the same parameters (Megatron-LM's ``get_model`` broadcasts them across
the data-parallel group; seeding every replica alike does too); the outer loop checks it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ds_lowcomm.comm import build_transport
from ds_lowcomm.optim.outer import OuterLoop
from ds_lowcomm.optim.registry import LowcommConfig, build_optimizer
from ds_lowcomm.settings import ConfigError

OUTER_METHODS = ("diloco", "dct_diloco", "sparseloco")


def _chained(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


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
        for opt in _chained(self.optimizer):
            copy = getattr(opt, "_copy_main_params_to_model_params", None)
            if copy is not None:
                copy()


def switch_off_grad_sync(model_chunks: Sequence[torch.nn.Module]) -> int:
    """Make Megatron DDP's data-parallel gradient reduction a no-op on these chunks (each
    replica keeps its own gradients). Returns how many bucket groups were switched off."""
    n = 0
    for chunk in model_chunks:
        groups = list(getattr(chunk, "bucket_groups", [])) + list(getattr(chunk, "expert_parallel_bucket_groups", []))
        for group in groups:
            group.start_grad_sync = _no_sync
            group.finish_grad_sync = _no_sync
            n += 1
    return n


def _no_sync(*args, **kwargs) -> None:
    return None


def _check_supported(model_chunks, optimizer, cfg: LowcommConfig) -> None:
    from megatron.core import parallel_state as ps

    if cfg.method not in OUTER_METHODS:
        raise ConfigError(f"lowcomm.method {cfg.method!r} is not supported with Megatron-Core yet; "
                          f"allowed: {', '.join(OUTER_METHODS)}")
    if cfg.comm.transport != "torch":
        raise ConfigError("lowcomm.transport must be torch with Megatron-Core (the data-parallel group's "
                          f"collectives); got {cfg.comm.transport!r}")
    mp_size = ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size()
    if cfg.comm.replica_size not in (1, mp_size):
        raise ConfigError(f"lowcomm.replica_size must be 1 (or {mp_size}, the model-parallel size) with "
                          "Megatron-Core: a replica is one model-parallel group; "
                          f"got {cfg.comm.replica_size!r}")
    if ps.get_context_parallel_world_size() != 1:
        raise ConfigError("Megatron-Core with context parallelism > 1 is not supported by ds_lowcomm yet")
    for chunk in model_chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and getattr(ddp_config, "use_distributed_optimizer", False):
            raise ConfigError("Megatron's distributed optimizer is not supported by ds_lowcomm's outer loop yet: "
                              "build the model with use_distributed_optimizer=False")
        for name, p in chunk.named_parameters():
            if p.requires_grad and not getattr(p, "allreduce", True):
                raise ConfigError(f"expert-parallel parameter {name} is not supported by ds_lowcomm yet")
    for opt in _chained(optimizer):
        if type(opt).__name__ == "DistributedOptimizer":
            raise ConfigError("Megatron's DistributedOptimizer is not supported by ds_lowcomm's outer loop yet")


class MegatronLowcomm:
    """Megatron's optimizer with ds_lowcomm's outer loop around it (see the module docstring).
    ``outer`` is the :class:`~ds_lowcomm.optim.outer.OuterLoop` (its ``ledger``, ``outer_steps``)."""

    def __init__(self, optimizer, outer: OuterLoop, inner: _MegatronInner | None):
        self.optimizer = optimizer
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

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none)

    @property
    def ledger(self):
        return self.outer.ledger

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self):
        return self.outer.state_dict()

    def load_state_dict(self, state_dict):
        self.outer.load_state_dict(state_dict)

    def __getattr__(self, name):  # everything else is Megatron's optimizer's
        return getattr(self.__dict__["optimizer"], name)


def apply(model_chunks, optimizer, config: LowcommConfig | dict | None) -> MegatronLowcomm:
    """Put ds_lowcomm's outer loop (``config.method``: diloco, dct_diloco or sparseloco) around
    ``optimizer`` (a Megatron optimizer, e.g. from ``get_megatron_optimizer``, or a torch one)
    for ``model_chunks`` (Megatron DDP-wrapped or plain modules), the replicas being Megatron's
    data-parallel ranks. Call after ``initialize_model_parallel`` and after building both; use
    the returned object's ``step()`` in place of ``optimizer.step()``. ``config``: a
    :class:`LowcommConfig` or a flat "lowcomm" section. The learning rate stays the inner
    optimizer's (and its scheduler's)."""
    from megatron.core import parallel_state as ps

    if not isinstance(config, LowcommConfig):
        config = LowcommConfig.from_dict(config, where="lowcomm")
    config.validate()
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    _check_supported(model_chunks, optimizer, config)
    switch_off_grad_sync(model_chunks)
    transport = build_transport("torch", group=ps.get_data_parallel_group())
    if isinstance(optimizer, torch.optim.Optimizer):
        inner, inner_obj = None, optimizer
    else:
        inner = _MegatronInner(optimizer)
        inner_obj = inner
    # lr: only the default inner AdamW's, which inner_factory replaces (a scheduler may hold 0 now).
    outer = build_optimizer(config, [], lr=1.0, transport=transport, inner_factory=lambda _params: inner_obj)
    return MegatronLowcomm(optimizer, outer, inner)


__all__ = ["apply", "switch_off_grad_sync", "MegatronLowcomm", "OUTER_METHODS"]
