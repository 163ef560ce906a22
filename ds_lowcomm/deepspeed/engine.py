"""``ds_lowcomm.deepspeed.initialize``: ``deepspeed.initialize`` with a lowcomm method wired in.

What it does, in order:
1. Validates the config's ``lowcomm`` and ``optimizer`` sections (before any communication).
2. Initialises torch.distributed through DeepSpeed if needed, builds the replica topology
   (``lowcomm.replica_size`` consecutive ranks per replica) and checks that every rank has the
   same effective settings.
3. Builds the method's optimizer over the cross-replica process group and hands it to
   DeepSpeed as a client optimizer, with an ``mpu`` whose data-parallel group is the replica:
   DeepSpeed (ZeRO 0/1/2 included) reduces gradients, partitions state and broadcasts the
   initial parameters only inside a replica. With one rank per replica at ZeRO 0 the engine's
   gradient all-reduce is switched off: the method does all the communication.
4. Patches the engine's ``step`` (ledger step boundaries) and ``save_checkpoint`` /
   ``load_checkpoint`` (one DeepSpeed checkpoint per replica, so every rank's method state is
   kept, plus a ``lowcomm.json`` that refuses a resume with another world size or method).
"""

from __future__ import annotations

import argparse
import json
import os
import types
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..comm import ByteLedger, ReplicaShard, ReplicaTopology, TorchDistTransport, assert_same_across_ranks, build_transport
from ..optim import LowcommOptimizer, build_optimizer
from ..settings import ConfigError
from .comm_counter import count_deepspeed_collectives
from .config import SplitConfig, load_config, split_config
from .mpu import ReplicaMPU

CHECKPOINT_META = "lowcomm.json"


@dataclass
class LowcommRun:
    """What ``initialize`` attaches to the engine as ``engine.lowcomm``."""

    config: SplitConfig
    topology: ReplicaTopology
    optimizer: LowcommOptimizer
    engine_ledger: ByteLedger  # DeepSpeed's own collectives (inside a replica)

    @property
    def ledger(self) -> ByteLedger:  # the method's traffic (across replicas)
        return self.optimizer.ledger

    def summary(self) -> dict[str, Any]:
        method = self.ledger.summary()
        engine = self.engine_ledger.summary()
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
            "method_ledger": method,
            "engine_ledger": engine,
        }


def _default_backend() -> str:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().communication_backend_name()


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               config_params=None, **kwargs):
    """Same arguments and return tuple as ``deepspeed.initialize``; the engine gains ``engine.lowcomm``."""
    import deepspeed

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

    if isinstance(model, PipelineModule):
        raise ConfigError("model: DeepSpeed's pipeline engine is not supported by ds_lowcomm yet")
    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        args = argparse.Namespace(**{**vars(args), "deepspeed_config": None})  # config goes by dict

    # Also when torch.distributed is already up: DeepSpeed then wraps the existing group.
    deepspeed.init_distributed(dist_backend=_default_backend())
    engine_ledger = ByteLedger()
    count_deepspeed_collectives(engine_ledger)

    topology = ReplicaTopology.build(split.lowcomm.comm.replica_size)
    assert_same_across_ranks(  # flat keys, so that a difference names its field
        TorchDistTransport(ledger=engine_ledger),
        {**{f"lowcomm.{k}": v for k, v in split.lowcomm.effective().items()},
         "zero_optimization.stage": split.zero_stage,
         **{f"optimizer.params.{k}": v for k, v in split.optimizer.flat().items()}},
    )
    params = list(model_parameters) if model_parameters is not None else [p for p in model.parameters() if p.requires_grad]
    # The method's traffic across replicas goes over lowcomm.transport (torch.distributed or MPI);
    # DeepSpeed's own (inside a replica) and the check above stay on torch.distributed.
    transport = build_transport(split.lowcomm.comm.transport, group=topology.cross_group,
                                replica_size=topology.replica_size)
    shard = None
    if split.zero_stage == 0 and topology.replica_size > 1:
        # Every rank of a replica holds the whole model: split the cross-replica sync by owner.
        shard = ReplicaShard(topology.local_rank, topology.replica_size,
                             TorchDistTransport(topology.replica_group, ledger=engine_ledger))
    # engine.step closes the ledger's steps (ZeRO steps the optimizer once per parameter group)
    opt = build_optimizer(split.lowcomm, params, transport=transport, shard=shard, ledger_steps=False,
                          **split.optimizer.torch_kwargs())
    engine, ds_opt, loader, sched = deepspeed.initialize(
        args=args, model=model, optimizer=opt, model_parameters=params, training_data=training_data,
        lr_scheduler=lr_scheduler, mpu=ReplicaMPU(topology), dist_init_required=dist_init_required,
        collate_fn=collate_fn, config=split.deepspeed, **kwargs,
    )
    if split.zero_stage == 0:
        # Inside a replica DeepSpeed averages gradients as usual; with one rank per replica there
        # is nothing to average and the method does all the communication.
        engine.enable_backward_allreduce = topology.replica_size > 1
    run = LowcommRun(split, topology, opt, engine_ledger)
    engine.lowcomm = run
    _patch_engine(engine, run)
    return engine, ds_opt, loader, sched


def _patch_engine(engine, run: LowcommRun) -> None:
    step, save, load = engine.step, engine.save_checkpoint, engine.load_checkpoint

    def lowcomm_step(self, *args, **kwargs):
        boundary = self.is_gradient_accumulation_boundary()
        out = step(*args, **kwargs)
        if boundary:
            run.optimizer.ledger.end_step()
        return out

    def replica_dir(base: str) -> str:
        # One DeepSpeed checkpoint per replica: DeepSpeed writes the files of data-parallel rank 0
        # (ZeRO 0) or of each data-parallel rank (ZeRO 1/2) of *its* group, so without this the
        # replicas would overwrite each other and every rank's method state but one would be lost.
        return os.path.join(base, f"replica{run.topology.replica:05d}")

    def meta(self) -> dict[str, Any]:
        return {"world_size": run.topology.world_size, "replica_size": run.topology.replica_size,
                "method": run.config.lowcomm.method, "zero_stage": run.config.zero_stage}

    def lowcomm_save(self, save_dir, tag=None, client_state={}, save_latest=True, **kwargs):
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"  # DeepSpeed's default
        if dist.get_rank() == 0:
            # DeepSpeed writes its "latest" file on global rank 0 only, so the other replicas'
            # directories lack it: the latest tag is kept here, for every replica.
            os.makedirs(save_dir, exist_ok=True)
            with open(os.path.join(save_dir, CHECKPOINT_META), "w") as f:
                json.dump({**meta(self), "latest": tag if save_latest else None}, f)
        return save(replica_dir(save_dir), tag, client_state=client_state, save_latest=save_latest, **kwargs)

    def lowcomm_load(self, load_dir, tag=None, **kwargs):
        path = os.path.join(load_dir, CHECKPOINT_META)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{load_dir}: no {CHECKPOINT_META}; not a checkpoint written by ds_lowcomm")
        with open(path) as f:
            saved = json.load(f)
        now = meta(self)
        diffs = [f"{k}: saved {saved.get(k)!r}, now {now[k]!r}" for k in now if saved.get(k) != now[k]]
        if diffs:
            raise ValueError(f"{load_dir}: checkpoint does not fit this run ({'; '.join(diffs)})")
        tag = tag if tag is not None else saved.get("latest")
        if tag is None:
            raise FileNotFoundError(f"{load_dir}: no latest checkpoint recorded; pass tag=")
        path, client_state = load(replica_dir(load_dir), tag, **kwargs)
        if path is None:
            raise FileNotFoundError(f"{replica_dir(load_dir)}/{tag}: DeepSpeed found no checkpoint to load")
        return path, client_state

    engine.step = types.MethodType(lowcomm_step, engine)
    engine.save_checkpoint = types.MethodType(lowcomm_save, engine)
    engine.load_checkpoint = types.MethodType(lowcomm_load, engine)
