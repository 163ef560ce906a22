"""``apply(model_chunks, optimizer, config)``: any ds_lowcomm method inside a Megatron-Core model
and optimizer.

**Replicas are Megatron's data-parallel ranks.** A replica is one model-parallel group (its
TP x PP ranks); rank r of replica a holds the same parameter shards as rank r of replica b, so
each (TP, PP) position's data-parallel group is the set of peers it exchanges with, and the
method's transport runs over ``parallel_state.get_data_parallel_group()``. Tensor-parallel,
sequence-parallel and pipeline traffic, and the layernorm and tied-embedding reductions, stay
Megatron's own.

How each method goes in:

=============================  ================================================================
adamw (the dense baseline)     Megatron DDP's bucket-level gradient all-reduce is replaced by
                               ds_lowcomm's dense mean (grad_sync.py; same numbers, counted in the
                               ledger); Megatron's optimizer steps as usual.
demo                           The bucket-level sync becomes DeMo's exchange (momentum, top-k DCT
                               components, decode-mean), with and without ``overlap_grad_reduce``;
                               Megatron's inner Adam is replaced by DeMo's sign step (lr and weight
                               decay from Megatron's param groups and scheduler).
mtdao                          No gradient sync; Megatron's inner Adam is replaced by MT-DAO, which
                               averages parameters and momenta every ``sync_every`` steps.
diloco, dct_diloco, sparseloco No gradient sync; Megatron's whole optimizer step is the inner step
                               of ds_lowcomm's outer loop (outer.py); with ``inner_optimizer`` muon
                               (MuLoCo) the Adam inside it is first swapped for ds_lowcomm's Muon
                               + AdamW (inner_muon.py).
=============================  ================================================================

In every case Megatron's own mixed precision stays: the methods step the fp32 main parameters
Megatron's optimizer keeps and Megatron copies them into the bf16 model parameters.

Before anything else, a megatron-core outside the supported range stops the run
(:class:`~ds_lowcomm.versions.UnsupportedVersionError`; ``DS_LOWCOMM_ALLOW_UNSUPPORTED_VERSIONS=1``
to try anyway), as does any Megatron internal used here that is missing or changed
(:class:`~ds_lowcomm.reflect.FrameworkInternalsError`, :mod:`megatron_patches.internals`).

Refused with a :class:`~ds_lowcomm.settings.ConfigError`, before any exchange: the distributed
optimizer, Megatron FSDP, virtual pipeline stages (several model chunks), context parallelism > 1,
expert-parallel parameters, ``calculate_per_token_loss``, an optimizer other than Megatron's
Float16OptimizerWithFloat16Params / FP32Optimizer (or a ChainedOptimizer of them) or a torch one,
fp16 with demo or mtdao (a dynamic loss scale would enter DeMo's momenta; an overflow skips the
step on one replica only: use bf16), the mpi transport, and a ``replica_size`` other than 1 or the
model-parallel size.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_lowcomm.comm import Transport, assert_same_across_ranks, build_transport
from ds_lowcomm.comm.consistency import settings_differences
from ds_lowcomm.optim.demo import DeMo, sign_step_
from ds_lowcomm.optim.mtdao import MTDAO
from ds_lowcomm.optim.registry import LowcommConfig, build_optimizer
from ds_lowcomm.settings import ConfigError

from .keys import describe, refuse_unhonoured
from .grad_sync import DeMoExchange, DenseMean, install_grad_sync, switch_off_grad_sync
from .outer import OUTER_METHODS, OuterLoopOptimizer, _MegatronInner
from . import inner_muon
from . import internals as mi
from . import sharded_state
from .wrapper import MegatronLowcomm, chained, model_params_of_mains, optimizer_kind, torch_optimizer

GRAD_SYNC_METHODS = ("adamw", "demo")  # replace the bucket-level gradient all-reduce


class SignDescent(torch.optim.Optimizer):
    """DeMo's update as Megatron's inner optimizer: the gradient it is given is already the
    exchanged mean of the momenta's components (grad_sync.DeMoExchange). Takes Megatron's
    param_group dicts as they are, so Megatron's scheduler keeps setting their lr. With ``demo``
    it steps through DeMo's own rule (``update`` sign, adam, normalized, muon; ``mean_momentum``)
    with DeMo's state of the model parameter each of its tensors is (or is the fp32 main copy of:
    ``model_of``), so that state is in the method's checkpoints; a matrix split over the
    tensor-parallel group is orthogonalised whole (:func:`tensor_parallel_matrices`). Without
    ``demo``, DeMo's sign step."""

    def __init__(self, param_groups: list[dict], demo: DeMo | None = None, model_of: dict | None = None):
        super().__init__(param_groups, {"lr": 0.0, "weight_decay": 0.0})
        self.demo, self.model_of = demo, model_of or {}

    @torch.no_grad()
    def step(self, closure=None):
        if self.demo is not None:
            mains = [p for g in self.param_groups for p in g["params"]]
            self.demo.step_copies([self.model_of.get(id(p), p) for p in mains], mains,
                                  [g["lr"] for g in self.param_groups for _ in g["params"]],
                                  [g["weight_decay"] for g in self.param_groups for _ in g["params"]])
            return
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    sign_step_(p, p.grad, group["lr"], group["weight_decay"])


def tensor_parallel_matrices(demo: DeMo, model_params: list[torch.Tensor], optimizer) -> None:
    """DeMo's muon matrices split over the tensor-parallel group, orthogonalised whole: each is
    assembled from its shards on one owning rank of the group (an all-to-all, comm.MatrixAssembly;
    the tensor-parallel group's fast links, bytes in DeMo's ledger as ``tp_matrix_assembly``),
    Newton-Schulz runs there once, and every rank takes its shard of the result. A shard split
    along its columns (a row-parallel layer) is assembled as the transpose's rows."""
    from megatron.core import parallel_state as ps

    from ds_lowcomm.comm import Matrix, MatrixAssembly, MatrixPiece, TorchDistTransport

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1 or demo.settings.update != "muon":
        return
    where = {id(p): (gi, pi) for gi, g in enumerate(demo.param_groups) for pi, p in enumerate(g["params"])}
    shards = [(p, mi.tensor_parallel_shard(p)) for p in model_params
              if p.dim() == 2 and mi.tensor_parallel_shard(p) is not None and demo.rule_of(p, *where[id(p)]) == "muon"]
    if not shards:
        return
    if len(chained(optimizer)) > 1:  # each would step its own share: the matrices' one collective needs them all
        raise ConfigError("lowcomm.update muon at tensor parallelism > 1 with a ChainedOptimizer of several "
                          "optimizers is not supported yet: build one Megatron optimizer over every parameter")
    group = ps.get_tensor_model_parallel_group()
    transport = TorchDistTransport(group, ledger=demo.ledger, timeout_s=demo.transport.timeout_s)
    matrices = []
    for k, (p, dim) in enumerate(shards):
        rows, cols = p.shape if dim == 0 else (p.shape[1], p.shape[0])  # a column split: the transpose's rows
        n = p.numel()
        matrices.append(Matrix(rows * tp, cols, tuple(MatrixPiece(r, r * n, n, k, 0) for r in range(tp)),
                               where[id(p)][0]))
    assembly = MatrixAssembly(matrices, transport, transport.rank, tp, op="tp_matrix_assembly")
    ids = [id(p) for p, _ in shards]
    split_dim = {id(m): dim for m, (_, dim) in zip(assembly.matrices, shards)}

    def directions(means, fn):
        inputs = [(means[id(p)] if dim == 0 else means[id(p)].T).float().reshape(-1) for p, dim in shards]
        outputs = [x.clone() for x in inputs]

        def whole(m, x):  # orthogonalised as the matrix it is (a column split: transposed back and forth)
            return fn(m, x) if split_dim[id(m)] == 0 else fn(m, x.T).T

        assembly.apply_(inputs, outputs, whole)
        return {i: (out.view(p.shape) if dim == 0 else out.view(p.shape[1], p.shape[0]).T)
                for i, (p, dim), out in zip(ids, shards, outputs)}

    demo.matrix_directions = directions


class PerStepOptimizer(MegatronLowcomm):
    """Megatron's optimizer with a per-step method in it (adamw, demo, mtdao); ``step()`` is
    Megatron's, closing a ledger step. ``demo`` holds DeMo's momenta (its exchange runs in the
    gradient sync)."""

    def __init__(self, optimizer, config: LowcommConfig, transport: Transport, demo: DeMo | None = None):
        super().__init__(optimizer)
        self.method = config.method
        self.config = config
        self.transport = transport
        self.demo = demo

    def step(self, *args, **kwargs):
        result = self.optimizer.step()
        self.ledger.end_step()
        return result

    @property
    def ledger(self):
        return self.transport.ledger

    def state_dict(self) -> dict:
        """Megatron's optimizer's state (with MT-DAO's moments, where it is the inner optimizer)
        and the method's: its settings, its ledger, DeMo's momenta."""
        lowcomm: dict[str, Any] = {"settings": self.config.effective(), "ledger": self.ledger.state_dict()}
        if self.demo is not None:
            lowcomm["demo"] = self.demo.state_dict()
        return {"optimizer": self.optimizer.state_dict(), "lowcomm": lowcomm}

    def state_holders(self):
        return super().state_holders() + ([sharded_state.Holder("demo", self.demo)] if self.demo is not None else [])

    def _load_own(self, state_dict: dict) -> None:
        saved, mine = state_dict["lowcomm"]["settings"], self.config.effective()
        if saved != mine:
            raise ValueError("checkpoint was saved with other lowcomm settings: "
                             + settings_differences(saved, mine, "saved", "now"))
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.demo is not None:
            self.demo.load_state_dict(state_dict["lowcomm"]["demo"])
        self.ledger.load_state_dict(state_dict["lowcomm"]["ledger"])


# What Megatron-Core 0.16's TensorParallelMuon calls in emerging-optimizers: the API of its v0.1.0
# release (Python >= 3.10). Its 0.2.0 and later renamed both keywords (``nesterov``, ``tp_mode``) and
# need Python >= 3.12: megatron-core 0.16.1 fails on them with a TypeError when building Muon.
_EMERGING_API = (("emerging_optimizers.orthogonalized_optimizers", "OrthogonalizedOptimizer", "use_nesterov"),
                 ("emerging_optimizers.orthogonalized_optimizers.muon_utils", "newton_schulz_tp", "mode"))


def megatron_muon_unavailable() -> str | None:
    """Why Megatron-Core's Muon cannot be built here (None: it can): NVIDIA's emerging-optimizers
    package missing, failing to import (the reason), or of an API this Megatron-Core does not call."""
    import importlib
    import importlib.metadata
    import inspect
    import sys

    try:
        version = importlib.metadata.version("emerging-optimizers")
    except importlib.metadata.PackageNotFoundError:
        version = None
    python = f"Python {sys.version_info.major}.{sys.version_info.minor}"
    if version is None:
        return ("NVIDIA's emerging-optimizers package is not installed. The package index's emerging-optimizers "
                "(0.3.0) needs Python >= 3.12 (here " + python + ") and renamed the keywords megatron-core 0.16 "
                "calls; megatron-core 0.16 calls the API of emerging-optimizers' v0.1.0 release")
    if not mi.live(mi.HAVE_EMERGING_OPTIMIZERS):
        try:
            importlib.import_module(_EMERGING_API[1][0])
            reason = "Megatron-Core's import of it failed"
        except Exception as err:  # noqa: BLE001  (the reason is what the user needs)
            reason = f"{type(err).__name__}: {err}"
        return f"emerging-optimizers {version} is installed but does not import under {python} ({reason})"
    for module, name, keyword in _EMERGING_API:
        params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
        if keyword not in params:
            return (f"emerging-optimizers {version} is installed, but Megatron-Core's TensorParallelMuon calls "
                    f"{name}({keyword}=...), which this version does not take (the API of emerging-optimizers "
                    "v0.1.0 is the one megatron-core 0.16 calls)")
    return None


def megatron_muon_optimizer(config, model_chunks):
    """Megatron-Core's Muon (``get_megatron_muon_optimizer``: TensorParallelMuon on the hidden
    matrices, Adam on the rest, chained), as Megatron-LM's ``--optimizer muon`` builds it without
    the layer-wise distributed optimizer. It needs NVIDIA's emerging-optimizers package at the API
    this Megatron-Core calls: refused by name, saying why, where it cannot be built."""
    muon = mi.live(mi.MEGATRON_MUON_OPTIMIZER)
    check_megatron_muon()
    return muon(config, model_chunks)


def check_megatron_muon() -> None:
    """``--optimizer muon``'s check, before any rank communicates: a ConfigError saying why
    Megatron-Core's Muon cannot be built here, if it cannot."""
    why = megatron_muon_unavailable()
    if why is not None:
        raise ConfigError(f"--optimizer muon: Megatron-Core's Muon cannot be built here: {why}. Use --optimizer adam "
                          "(an outer method's inner Adam), or MuLoCo with ds_lowcomm's Muon in its place: --optimizer "
                          "adam with --lowcomm-inner-optimizer muon (torch's Muon, as on the DeepSpeed and plain "
                          "torch paths)")


def describe_optimizer(optimizer) -> str:
    """Megatron's optimizer in words, with its settings as its param groups hold them at the start
    (each of a ChainedOptimizer's: Megatron's Muon is TensorParallelMuon chained with Adam)."""
    parts = []
    def described(inner) -> str:
        if isinstance(inner, inner_muon.MegatronMuonWithAdamW):  # each half with its own settings
            return " + ".join(described(half) for half in inner.optimizers)
        group = inner.param_groups[0] if inner.param_groups else {}
        shown = {k: group[k] for k in ("lr", "betas", "eps", "momentum", "nesterov", "weight_decay") if k in group}
        return f"{type(inner).__name__} ({', '.join(f'{k} {v}' for k, v in shown.items())})"

    for opt in chained(optimizer):
        where = "" if optimizer_kind(opt) == "torch" else f"Megatron's {type(opt).__name__} of "
        parts.append(where + described(torch_optimizer(opt)))
    clip = [mi.get(opt, mi.OPTIMIZER_CONFIG).clip_grad for opt in chained(optimizer) if optimizer_kind(opt) != "torch"]
    return " + ".join(parts) + (f", clip_grad {clip[0]}" if clip else "")


def _is_megatron_optimizer(optimizer) -> bool:
    return all(optimizer_kind(opt) != "torch" for opt in chained(optimizer))


def _check_supported(model_chunks, optimizer, cfg: LowcommConfig) -> None:
    from megatron.core import parallel_state as ps

    ddp, base_data_parallel, megatron_module = mi.live(mi.DDP), mi.live(mi.DP_BASE), mi.live(mi.MEGATRON_MODULE)
    refuse_unhonoured(cfg)  # the section's keys (the launchers check them earlier, with the keys given)
    mp_size = ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size()
    if cfg.comm.replica_size not in (1, mp_size):
        raise ConfigError(f"lowcomm.replica_size must be 1 (or {mp_size}, the model-parallel size) with "
                          "Megatron-Core: a replica is one model-parallel group; "
                          f"got {cfg.comm.replica_size!r}")
    if ps.get_context_parallel_world_size() != 1:
        raise ConfigError("Megatron-Core with context parallelism > 1 is not supported by ds_lowcomm yet")
    if len(model_chunks) != 1:
        raise ConfigError(f"Megatron-Core with virtual pipeline stages ({len(model_chunks)} model chunks) is not "
                          "supported by ds_lowcomm yet: leave --num-layers-per-virtual-pipeline-stage unset")
    for chunk in model_chunks:
        if isinstance(chunk, base_data_parallel) and not isinstance(chunk, ddp):
            raise ConfigError(f"{type(chunk).__name__} (Megatron FSDP or another data-parallel wrapper) is not "
                              "supported by ds_lowcomm yet: use megatron.core.distributed.DistributedDataParallel")
        if cfg.method in GRAD_SYNC_METHODS and not isinstance(chunk, ddp):
            raise ConfigError(f"lowcomm.method {cfg.method!r} replaces Megatron DDP's gradient sync: wrap the model "
                              "in megatron.core.distributed.DistributedDataParallel")
        if isinstance(chunk, ddp) and mi.get(chunk, mi.DDP_DDP_CONFIG).use_distributed_optimizer:
            raise ConfigError("Megatron's distributed optimizer is not supported by ds_lowcomm yet: "
                              "build the model with use_distributed_optimizer=False (--use-distributed-optimizer off)")
        if isinstance(chunk, megatron_module) and mi.get(chunk, mi.MODULE_CONFIG).calculate_per_token_loss:
            raise ConfigError("calculate_per_token_loss is not supported by ds_lowcomm yet (gradients are summed, "
                              "not averaged, across data-parallel ranks): leave it off")
        for name, p in chunk.named_parameters():
            if p.requires_grad and mi.is_expert_parallel(p):
                raise ConfigError(f"expert-parallel parameter {name} is not supported by ds_lowcomm yet")
    chained_optimizer = mi.live(mi.CHAINED_OPTIMIZER)
    if isinstance(optimizer, chained_optimizer) and type(optimizer) is not chained_optimizer:
        raise ConfigError(f"{type(optimizer).__name__} is not supported by ds_lowcomm yet: pass the optimizer "
                          "get_megatron_optimizer builds without a distributed optimizer")
    if isinstance(optimizer, mi.live(mi.LAYER_WISE_OPTIMIZER)):
        raise ConfigError("Megatron's LayerWiseDistributedOptimizer (Muon's layer-wise distributed optimizer) is not "
                          "supported by ds_lowcomm yet: build Megatron's Muon without it (a ChainedOptimizer)")
    for opt in chained(optimizer):
        if isinstance(opt, mi.live(mi.DISTRIBUTED_OPTIMIZER)):
            raise ConfigError("Megatron's DistributedOptimizer is not supported by ds_lowcomm yet")
        if cfg.method in ("demo", "mtdao") and optimizer_kind(opt) != "torch" and isinstance(
                torch_optimizer(opt), mi.live(mi.TENSOR_PARALLEL_MUON)):
            raise ConfigError(f"--optimizer muon (Megatron's Muon) with lowcomm.method {cfg.method!r}: {cfg.method} "
                              "replaces the optimizer's step with its own; for DeMo's Muon step use "
                              "--lowcomm-update muon with Megatron's Adam, or an outer method (diloco, dct_diloco, "
                              "sparseloco) around Megatron's Muon")
        kind = optimizer_kind(opt)  # refuses any other type
        if cfg.method in ("demo", "mtdao") and kind != "torch" and mi.get(opt, mi.OPTIMIZER_CONFIG).fp16:
            raise ConfigError(f"lowcomm.method {cfg.method!r} with fp16 is not supported: a dynamic loss scale "
                              "would enter the method's state and an overflow skips a step on one replica only; "
                              "use bf16")
    if cfg.method in ("demo", "mtdao") and not _is_megatron_optimizer(optimizer):
        raise ConfigError(f"lowcomm.method {cfg.method!r} replaces the Adam inside Megatron's optimizer: pass "
                          "the optimizer get_megatron_optimizer built")


def _groups_by_model_param(optimizer) -> dict[int, dict]:
    """id(model parameter) -> the param group (lr, weight_decay) Megatron's optimizer steps it in
    (through its fp32 main copy under mixed precision)."""
    out: dict[int, dict] = {}
    for opt in chained(optimizer):
        # Under mixed precision the groups hold the fp32 main copies; float16_groups[i] the model's
        # own parameters of group i. fp32: the groups hold the model's parameters.
        model_groups = mi.get(opt, mi.FLOAT16_GROUPS) if optimizer_kind(opt) == "float16" else None
        for i, group in enumerate(torch_optimizer(opt).param_groups):
            for p in group["params"] + (list(model_groups[i]) if model_groups is not None else []):
                out[id(p)] = group
    return out


def _replace_inner(optimizer, build) -> None:
    """Put ``build(param_groups)`` in place of the torch optimizer inside each of Megatron's."""
    for opt in chained(optimizer):
        mi.put(opt, mi.OPTIMIZER_INNER, build(torch_optimizer(opt).param_groups))


def _mark_main_params_trainable(optimizer) -> None:
    """Megatron's fp32 main copies of bf16/fp16 parameters are made with ``detach()``, so they
    have ``requires_grad=False``; ds_lowcomm's optimizers leave such tensors out (frozen). Every
    tensor in Megatron's param groups is trainable (Megatron leaves frozen ones out of them)."""
    for opt in chained(optimizer):
        for group in torch_optimizer(opt).param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    p.requires_grad_(True)


def _model_params(model_chunks) -> list[torch.Tensor]:
    return [p for chunk in model_chunks for p in chunk.parameters() if p.requires_grad and p.numel()]


def apply(model_chunks, optimizer, config: LowcommConfig | dict | None) -> MegatronLowcomm:
    """Install ``config.method`` (see the module docstring) into ``model_chunks`` (Megatron DDP
    chunks; a plain module for the outer-loop methods) and ``optimizer`` (Megatron's, from
    ``get_megatron_optimizer``; a torch one for the outer-loop methods). Call after
    ``initialize_model_parallel`` and after building both; use the returned object in place of
    ``optimizer`` (its ``step()``, ``zero_grad()``, ``param_groups``, ``state_dict()``).
    ``config``: a :class:`LowcommConfig` or a flat "lowcomm" section. The learning rate stays
    Megatron's (and its scheduler's). Every rank must start from the same parameters (checked).
    First of all, the installed megatron-core must be a supported version with every internal
    megatron_patches uses as declared (:func:`megatron_patches.internals.ensure_checked`)."""
    mi.ensure_checked()
    from megatron.core import parallel_state as ps

    if not isinstance(config, LowcommConfig):
        from .args import refuse_fault_tolerance

        refuse_fault_tolerance(config)
        given = list(config or {})
        config = LowcommConfig.from_dict(config, where="lowcomm")
        refuse_unhonoured(config, given)
    config.validate()
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    _check_supported(model_chunks, optimizer, config)
    transport = build_transport("torch", group=ps.get_data_parallel_group(), timeout_s=config.comm.timeout_s)
    if config.method in OUTER_METHODS and config.settings.inner_optimizer == "muon":  # MuLoCo: for Megatron's Adam
        inner_muon.install(model_chunks, optimizer, config.settings, transport.ledger, config.comm.timeout_s)
    if torch.distributed.get_rank() == 0:  # the run's first log line: what runs, at which settings
        print(describe(config, describe_optimizer(optimizer)), flush=True)
    transport.nonfinite = config.comm.nonfinite  # a rank with NaN/inf to send: skip it, or raise (lowcomm.nonfinite)
    _mark_main_params_trainable(optimizer)

    if config.method in OUTER_METHODS:
        switch_off_grad_sync(model_chunks)
        inner = None if isinstance(optimizer, torch.optim.Optimizer) else _MegatronInner(optimizer)
        # lr: only the default inner AdamW's, which inner_factory replaces (a scheduler may hold 0 now).
        outer = build_optimizer(config, [], lr=1.0, transport=transport,
                                inner_factory=lambda _params: inner if inner is not None else optimizer,
                                inner_factory_honours=("adamw", "muon"))
        return OuterLoopOptimizer(optimizer, outer, inner)

    if config.method == "adamw":
        assert_same_across_ranks(transport, {"method": "adamw", "world_size": transport.world_size},
                                 _model_params(model_chunks))
        install_grad_sync(model_chunks, DenseMean(transport))
        return PerStepOptimizer(optimizer, config, transport)

    if config.method == "demo":
        if config.settings.update == "muon":
            inner_muon.tag_muon_params(model_chunks)
        params = _model_params(model_chunks)
        demo = DeMo(params, lr=1.0, settings=config.settings, transport=transport,
                    ledger_steps=False)  # its momenta, exchange and rule's state; lr per step from Megatron's groups
        install_grad_sync(model_chunks, DeMoExchange(demo, lambda: _groups_by_model_param(optimizer)))
        tensor_parallel_matrices(demo, params, optimizer)
        model_of = model_params_of_mains(optimizer)
        _replace_inner(optimizer, lambda groups: SignDescent(groups, demo, model_of))
        return PerStepOptimizer(optimizer, config, transport, demo=demo)

    assert config.method == "mtdao", config.method
    switch_off_grad_sync(model_chunks)

    def mtdao(groups):
        # lr, weight decay and eps stay in Megatron's group dicts (its scheduler sets them); the
        # arguments here are only defaults for keys a group lacks. beta2 is Megatron's Adam's.
        adam = groups[0]
        return MTDAO(groups, lr=1.0, beta2=adam.get("betas", (0.9, 0.999))[1], eps=adam.get("eps", 1e-8),
                     settings=config.settings, transport=transport, ledger_steps=False)

    _replace_inner(optimizer, mtdao)
    return PerStepOptimizer(optimizer, config, transport)


__all__ = ["apply", "check_megatron_muon", "describe_optimizer", "megatron_muon_unavailable", "GRAD_SYNC_METHODS",
           "PerStepOptimizer", "SignDescent"]
