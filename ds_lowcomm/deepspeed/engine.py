"""``ds_lowcomm.deepspeed.initialize``: ``deepspeed.initialize`` with a lowcomm method wired in.

What it does, in order:
1. Validates the config's ``lowcomm`` and ``optimizer`` sections (before any communication).
2. Initialises torch.distributed through DeepSpeed if needed, builds the replica topology
   (``lowcomm.replica_size`` consecutive ranks per replica) and checks that every rank has the
   same effective settings. Checks the batch sizes over every data-parallel rank and hands
   DeepSpeed its per-replica ``train_batch_size`` (``data.py``); broadcasts rank 0's parameters
   and buffers to every rank (``broadcast.py``).
3. Builds the method's optimizer over the cross-replica process group and hands it to
   DeepSpeed as a client optimizer, with an ``mpu`` whose data-parallel group is the replica:
   DeepSpeed (ZeRO 0-3 included) reduces gradients, partitions state and broadcasts the
   initial parameters only inside a replica. With one rank per replica at ZeRO 0 the engine's
   gradient all-reduce is switched off: the method does all the communication. At ZeRO 1-3 the
   method works on ZeRO's partitions parameter by parameter (``zero.py``). Builds
   DeepSpeed's loader of ``training_data`` sharded over every replica, and makes
   ``engine.train_batch_size()`` count every replica. With ``lowcomm.fault_tolerance`` the job is
   one replica of several jobs meeting through torchft (``fault_tolerance.py``): the method's
   transport is torchft's, and the first quorum (a heal, for a replica behind) ends ``initialize``.
4. Patches the engine's ``step`` (ledger step boundaries) and ``save_checkpoint`` /
   ``load_checkpoint`` (one DeepSpeed checkpoint per replica, so every rank's method state is
   kept, plus a ``lowcomm.json`` that refuses a resume with another world size or method; see
   ``checkpoint.py``).
"""

from __future__ import annotations

import argparse
import types

from dataclasses import dataclass, field, replace
from typing import Any

from ..comm import ByteLedger, ReplicaTopology, TorchDistTransport, assert_same_across_ranks
from ..optim import LowcommOptimizer, build_optimizer, model_param_groups, takes_muon_decision
from ..settings import ConfigError
from .activations import install_activation_compression
from .checkpoint import patch_checkpoint
from .comm_counter import count_deepspeed_collectives
from .config import SplitConfig, load_config, split_config
from .data import patch_world_batch_and_io, replica_batch_config, report_global_batch
from .layout import choose_layout
from .overflow import agree_on_overflow
from .state import STATE
from . import backend, hetero, internals, muon, zero


@dataclass
class LowcommRun:
    """What ``initialize`` attaches to the engine as ``engine.lowcomm``."""

    config: SplitConfig
    topology: ReplicaTopology
    optimizer: LowcommOptimizer
    engine_ledger: ByteLedger  # DeepSpeed's own collectives (inside a replica)
    user_ledger: ByteLedger = field(default_factory=ByteLedger)  # the user's own calls on deepspeed.comm
    activation_ledger: ByteLedger = field(default_factory=ByteLedger)  # between pipeline stages
    dense_allreduce_bytes_per_step: int = 0  # a dense fp32 all-reduce of the trainable parameters
    fault_tolerance: Any = None  # lowcomm.fault_tolerance: this replica's FaultTolerance (heals, discarded), or None

    @property
    def ledger(self) -> ByteLedger:  # the method's traffic (across replicas)
        return self.optimizer.ledger

    def done(self) -> None:
        """This rank runs no more syncs (call it after the training loop). With replicas of
        different shapes, a peer replica still waiting for a sync is then told at once that the
        replicas ran different numbers of syncs, instead of at ``timeout_s``; otherwise nothing."""
        self.optimizer.leave_syncs("done", final=True)
        if self.fault_tolerance is not None:  # this replica leaves the quorum
            self.fault_tolerance.shutdown()

    def ledgers(self) -> dict[str, ByteLedger]:
        """The run's ledgers besides the method's (saved in its checkpoints: checkpoint.py)."""
        return {"engine": self.engine_ledger, "user": self.user_ledger, "activations": self.activation_ledger}

    def summary(self) -> dict[str, Any]:
        method = self.ledger.summary()
        engine = self.engine_ledger.summary()
        user = self.user_ledger.summary()
        activations = self.activation_ledger.summary()
        return {
            "method": self.config.lowcomm.method,
            "replica_size": self.topology.replica_size,
            "num_replicas": self.topology.num_replicas,
            "zero_stage": self.config.zero_stage,
            "cross_replica_bytes_sent": method["bytes_sent"],
            "cross_replica_bytes_received": method["bytes_received"],
            "engine_bytes_sent": engine["bytes_sent"],
            "engine_bytes_received": engine["bytes_received"],
            "bytes_sent": method["bytes_sent"] + engine["bytes_sent"],
            **self._per_step(),
            "method_seconds": dict(self.ledger.seconds),  # "codec", "comm"
            "engine_comm_seconds": self.engine_ledger.seconds.get("comm", 0.0),
            # Muon's matrices assembled from ZeRO partitions inside the replica (in engine_bytes_sent too)
            "matrix_assembly_bytes_sent": self.engine_ledger.by_op.get("matrix_assembly", [0, 0, 0])[1],
            "activation_bytes_sent": activations["bytes_sent"],  # pipeline stage boundaries
            "user_bytes_sent": user["bytes_sent"],
            "user_bytes_received": user["bytes_received"],
            "method_ledger": method,
            "engine_ledger": engine,
            "user_ledger": user,
            "activation_ledger": activations,
            **({"fault_tolerance": self.fault_tolerance.report()}
               if self.fault_tolerance is not None else {}),
        }

    def _per_step(self) -> dict[str, Any]:
        """Mean bytes this rank sent per optimizer step (closed steps; start-up traffic in none), and
        the ratio to a dense fp32 all-reduce of the trainable parameters. None before the first step."""
        def mean_sent(ledger: ByteLedger) -> float | None:
            n = ledger.steps
            return sum(ledger.step_bytes(i)[0] for i in range(n)) / n if n else None

        cross, engine = mean_sent(self.ledger), mean_sent(self.engine_ledger)
        per_step = None if cross is None else cross + (engine or 0.0)
        return {
            "steps": self.ledger.steps,
            "cross_replica_bytes_sent_per_step": cross,
            "engine_bytes_sent_per_step": engine,
            "bytes_sent_per_step": per_step,
            "dense_allreduce_bytes_per_step": self.dense_allreduce_bytes_per_step,
            "compression_vs_allreduce": self.dense_allreduce_bytes_per_step / per_step if per_step else None,
        }


def _default_backend() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().communication_backend_name()


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               config_params=None, **kwargs):
    """Same arguments and return tuple as ``deepspeed.initialize``; the engine gains ``engine.lowcomm``."""
    internals.ensure_checked()  # a supported deepspeed, its private internals as declared, before touching any
    import deepspeed

    # 1. Every setting checked before any communication.
    split = _checked_config(args, config, config_params, optimizer, mpu, model)
    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        args = argparse.Namespace(**{**vars(args), "deepspeed_config": None})  # the config goes by dict
    # Also when torch.distributed is already up: DeepSpeed then wraps the existing group.
    backend.init_distributed(_default_backend())  # and frees DeepSpeed's shared-memory name
    engine_ledger, user_ledger = ByteLedger(), ByteLedger()
    count_deepspeed_collectives(engine_ledger, user_ledger)

    # 2. The layout of replicas (layout.py); every rank with the same settings, from rank 0's weights.
    layout = choose_layout(split, model, engine_ledger)
    topology, timeout_s = layout.topology, layout.timeout_s
    # data_parallel_rank() / _world_size() for the user's own loaders: the numbers, not the groups
    # (process state outliving the engine would keep them from torch's teardown, state.py)
    STATE.topology = replace(topology, replica_group=None, cross_group=None, single_group=None)
    layout.agreed_settings = {
        # flat keys, so that a difference names its field
        **{f"lowcomm.{k}": v for k, v in split.lowcomm.effective().items()},
        **layout.shared_settings(),
        "zero_optimization.stage": split.zero_stage,
        # every replica skips an overflowed step together (overflow.py): one precision everywhere
        **{f"{k}.enabled": bool(split.deepspeed.get(k, {}).get("enabled", False)) for k in ("fp16", "bf16")},
        **{f"optimizer.params.{k}": v for k, v in (split.optimizer or split.muon).flat().items()}}
    assert_same_across_ranks(TorchDistTransport(ledger=engine_ledger, timeout_s=timeout_s), layout.agreed_settings)
    # every setting that runs, in the run's first lines on rank 0: printed whatever the log level
    # (DeepSpeed's logger is at WARNING unless told otherwise, which would hide an INFO line)
    deepspeed.utils.logging.print_dist(describe_settings(split, layout.agreed_settings), ranks=[0])
    global_batch = replica_batch_config(split.deepspeed, topology)  # train_batch_size counts every replica
    params = list(model_parameters) if model_parameters is not None else [p for p in model.parameters() if p.requires_grad]
    layout.broadcast_initial_state(params)  # before the optimizer's own check of equal starts

    # 3. The method's optimizer, handed to DeepSpeed as a client optimizer.
    groups, hyper, inner_factory = _method_groups(split, model, params, model_parameters is not None)
    opt = build_optimizer(layout.method_settings(), groups, transport=layout.transport(), shard=layout.shard(),
                          ledger_steps=False,  # engine.step closes the ledgers' steps (_patch_engine)
                          inner_factory=inner_factory, **hyper)
    opt.framework_setup = True  # DeepSpeed's construction-time step() calls are not training steps
    engine, ds_opt, loader, sched = deepspeed.initialize(
        args=args, model=model, optimizer=opt, model_parameters=params, training_data=None,  # loader: below
        lr_scheduler=lr_scheduler, mpu=layout.mpu(), dist_init_required=dist_init_required,
        collate_fn=collate_fn, config=split.deepspeed, **kwargs,
    )
    opt.framework_setup = False

    # 4. The method meets the engine.
    agree_on_overflow(engine, topology.num_replicas, opt.ledger, timeout_s)  # fp16/bf16: skip steps together
    if split.zero_stage == 0:
        # Inside a replica DeepSpeed averages gradients as usual; with one data-parallel rank per
        # replica there is nothing to average and the method does all the communication.
        internals.put(engine, layout.backward_allreduce_flag(), topology.data_per_replica > 1)
    else:  # the method on ZeRO's flat partitions: parameter pieces, one exchange per step; Muon's
        # matrices assembled over the replica (its bytes in the engine ledger, op matrix_assembly)
        zero.install(engine.optimizer, opt, split.zero_stage, muon.matrix_steps(opt, engine_ledger, timeout_s))
    patch_world_batch_and_io(engine, topology)  # the user's set_train_batch_size and deepspeed_io
    if training_data:
        loader = layout.loader(engine, training_data)
    report_global_batch(engine, topology)
    assert engine.train_batch_size() == global_batch, (engine.train_batch_size(), global_batch)
    # replicas of different shapes: routes by parameter name; over torchft: the first quorum (a
    # replica behind the others heals from a live peer here)
    layout.connect(engine, opt)
    engine_ledger.drop_open_step()  # DeepSpeed's start-up collectives belong to no step
    trainable = sum(internals.get(p, internals.PARAM_DS_NUMEL) if split.zero_stage == 3 else p.numel()
                    for p in model.parameters() if p.requires_grad)  # ZeRO 3: a parameter's whole size
    run = LowcommRun(split, topology, opt, engine_ledger, user_ledger, dense_allreduce_bytes_per_step=4 * trainable,
                     fault_tolerance=getattr(layout, "fault_tolerance", None))
    if layout.codes_activations():  # activations between stages: counted apart, coded if asked
        install_activation_compression(engine, split.activations, run.activation_ledger)
    engine.lowcomm = run
    _patch_engine(engine, run)
    return engine, ds_opt, loader, sched


def describe_settings(split: SplitConfig, agreed: dict) -> str:
    """One line: which inner (or per-step) optimizer runs with which settings, then every agreed
    setting (the lowcomm section's effective values, the optimizer section's, ZeRO and precision)."""
    effective = split.lowcomm.effective()
    if split.muon is not None:
        inner = "DeepSpeed's Muon at optimizer.params (muon_lr or lr, momentum; adam_lr for the rest)"
    elif effective.get("inner_optimizer") == "muon":
        inner = (f"torch's Muon at lowcomm.inner_muon_lr {effective['inner_muon_lr']}, momentum "
                 f"{effective['inner_muon_momentum']}; AdamW at optimizer.params.lr {split.optimizer.lr} for the rest")
    else:
        inner = f"AdamW at optimizer.params.lr {split.optimizer.lr}"
    role = "inner optimizer" if "sync_every" in effective else "optimizer"
    return (f"ds_lowcomm: {split.lowcomm.method}, {role}: {inner}; settings: "
            + ", ".join(f"{k}={v}" for k, v in agreed.items()))


def _method_groups(split: SplitConfig, model, params: list, own_groups: bool):
    """What the method's optimizer is built from: its param groups, its lr and Adam settings, and
    (DeepSpeed's Muon as an outer method's inner optimizer) the inner optimizer's factory.
    The user's own groups are kept as given; without them, the plain loop's (update muon: as Muon
    is run, ``model_param_groups``). With optimizer.type Muon, ``use_muon`` tags (the user's, else
    ``takes_muon_step``'s) split every group into DeepSpeed's Muon and Adam halves (muon.py)."""
    if split.muon is None:
        if takes_muon_decision(split.lowcomm):  # as tags: your groups (the HF Trainer's) keep it too
            muon.tag_params(model, params, require=False)
        groups = params if own_groups else model_param_groups(split.lowcomm, model, params)
        return groups, split.optimizer.torch_kwargs(), None
    muon.tag_params(model, params)
    lr = {"lr": split.muon.lr or split.muon.muon_lr or 0.02}  # every group carries its own (DeepSpeed's halves)
    if split.lowcomm.method == "demo":
        return muon.demo_groups(params, split.muon), lr, None
    return params, lr, lambda _: muon.build_inner(params, split.muon)


def _checked_config(args, config, config_params, optimizer, mpu, model) -> SplitConfig:
    """The config's sections, checked (``ConfigError`` naming the field), and what ds_lowcomm
    takes over from ``deepspeed.initialize``'s arguments refused."""
    raw = config if config is not None else config_params
    if raw is None:
        raw = getattr(args, "deepspeed_config", None)
    if raw is None:
        raise ConfigError("no DeepSpeed config: pass config=... or --deepspeed_config FILE")
    split = split_config(load_config(raw))
    if optimizer is not None:
        raise ConfigError("optimizer=: ds_lowcomm builds the optimizer from the config's optimizer and "
                          "lowcomm sections; leave optimizer out")
    if mpu is not None:
        raise ConfigError("mpu=: the data-parallel layout comes from lowcomm.replica_size; leave mpu out")
    from deepspeed.pipe import PipelineModule

    effective = split.lowcomm.effective()
    if isinstance(model, PipelineModule) and split.zero_stage >= 1 and (
            split.muon is not None or effective.get("update") == "muon" or effective.get("inner_optimizer") == "muon"):
        raise ConfigError("Muon's step (lowcomm.update muon, lowcomm.inner_optimizer muon or optimizer.type Muon) "
                          f"with a pipeline: only at zero_optimization.stage 0; got {split.zero_stage}")
    compressing = (split.activations.forward, split.activations.backward) != ("none", "none")
    if compressing and not isinstance(model, PipelineModule) and not split.replicas:  # replicas: the pipelined ones
        raise ConfigError("lowcomm.activations: codecs between pipeline stages need DeepSpeed's pipeline engine "
                          "(model=PipelineModule(...)); leave it out (or none/none) for other models")
    return split


def replica_layout(config) -> hetero.ReplicaPlace:
    """This rank's replica under ``lowcomm.replicas`` (replicas of different shapes; see
    ``hetero.py``). Call it before building the model: it checks the layout against the world size
    and makes DeepSpeed see this replica's ranks as its world."""
    internals.ensure_checked()  # a supported deepspeed, its private internals as declared, before touching any
    split = split_config(load_config(config))
    if not split.replicas:
        raise ConfigError("replica_layout: the config has no lowcomm.replicas (replicas of one shape need no "
                          "layout call: lowcomm.replica_size)")
    backend.init_distributed(_default_backend())  # and frees DeepSpeed's shared-memory name
    # Before any rank enters its replica: a rank with another layout would wait in other groups.
    assert_same_across_ranks(TorchDistTransport(timeout_s=split.lowcomm.comm.timeout_s),
                             {"lowcomm.replicas": [spec.describe() for spec in split.replicas]})
    return hetero.enter_replica(split.replicas, split.lowcomm.comm.timeout_s,
                                split.lowcomm.effective().get("sync_every", 1))


def _patch_engine(engine, run: LowcommRun) -> None:
    def end_step():
        run.optimizer.ledger.end_step()
        run.engine_ledger.end_step()
        run.activation_ledger.end_step()

    from deepspeed.runtime.pipe.engine import PipelineEngine

    if isinstance(engine, PipelineEngine):  # one train_batch() = one optimizer step
        train_batch = engine.train_batch

        def lowcomm_train_batch(self, *args, **kwargs):
            out = train_batch(*args, **kwargs)
            end_step()
            return out

        engine.train_batch = types.MethodType(lowcomm_train_batch, engine)
    else:
        step = engine.step

        def lowcomm_step(self, *args, **kwargs):
            boundary = self.is_gradient_accumulation_boundary()
            out = step(*args, **kwargs)
            if boundary:
                end_step()
            return out

        engine.step = types.MethodType(lowcomm_step, engine)
    patch_checkpoint(engine, run)  # save_checkpoint / load_checkpoint: see checkpoint.py
