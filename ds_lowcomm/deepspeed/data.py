"""Data and batch sizes across replicas.

DeepSpeed sees one replica as its whole data-parallel world (the ``mpu``). Left alone, its loader
would shard the data over one replica only (two replicas' ranks of the same local rank would read
the same batches) and its ``train_batch_size`` would count one replica. Here both keep the meaning
they have in plain DeepSpeed over the whole world: every rank of every replica reads its own shard,
and ``train_batch_size`` = micro batch x gradient accumulation x every data-parallel rank.
The same holds for the user's own ``engine.set_train_batch_size(n)`` and ``engine.deepspeed_io(dataset)``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..comm import ReplicaTopology
from ..settings import ConfigError
from . import internals
from .state import STATE

BATCH_FIELDS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def data_parallel_rank() -> int:
    """This rank's data-parallel rank across all replicas: the ``rank`` a ``DistributedSampler``
    of a loader you build yourself should use (the global rank; with pipeline replicas, the index
    of this rank's pipeline, the same on its first and last stage)."""
    _require_dist()
    return STATE.topology.data_rank if STATE.topology is not None else dist.get_rank()


def data_parallel_world_size() -> int:
    """The number of data-parallel ranks across all replicas: the ``num_replicas`` of a
    ``DistributedSampler`` (the world size; with pipeline replicas, the number of pipelines)."""
    _require_dist()
    return STATE.topology.data_world if STATE.topology is not None else dist.get_world_size()


def _require_dist() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call ds_lowcomm.deepspeed.initialize "
                           "(or deepspeed.init_distributed) first")


def replica_batch_config(ds: dict[str, Any], topology: ReplicaTopology) -> int:
    """Check the batch fields of DeepSpeed config ``ds`` over the whole world and rewrite
    ``train_batch_size`` (if given) for DeepSpeed's per-replica view, in place.

    Returns the global train batch size. Resolution follows DeepSpeed's own rules
    (``runtime/config.py`` ``_set_batch_related_parameters``) with every data-parallel rank counted.
    """
    world, size = topology.data_world, topology.data_per_replica
    given = {k: ds.get(k) for k in BATCH_FIELDS}
    for k, v in given.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise ConfigError(f"{k} must be a positive integer; got {v!r}")
    tbs, micro, gas = (given[k] for k in BATCH_FIELDS)
    if tbs is None and micro is None:
        raise ConfigError("train_batch_size or train_micro_batch_size_per_gpu is required")
    if tbs is not None and micro is not None and gas is None:
        gas = tbs // micro // world
    elif tbs is not None and gas is not None and micro is None:
        micro = tbs // world // gas
    elif tbs is not None and micro is None:
        gas, micro = 1, tbs // world
    elif gas is None:
        gas = 1
    if tbs is None:
        tbs = micro * gas * world
    if micro < 1 or gas < 1 or tbs != micro * gas * world:
        shown = ", ".join(f"{k} {v}" for k, v in given.items() if v is not None)
        raise ConfigError(
            f"batch sizes ({shown}) do not fit {world} data-parallel ranks ({world // size} replicas x "
            f"{size}{' (lowcomm.replica_size)' if size == topology.replica_size else ' pipelines'}): train_batch_size must equal train_micro_batch_size_per_gpu x "
            f"gradient_accumulation_steps x {world} (as in DeepSpeed, every rank of every replica counts); "
            f"here {micro} x {gas} x {world} = {micro * gas * world} != {tbs}")
    if given["train_batch_size"] is not None:
        ds["train_batch_size"] = micro * gas * size  # what one replica (DeepSpeed's world) takes
    return tbs


def _timer_batch_size(engine) -> None:
    """The throughput timer's samples per step: ``engine.train_batch_size()``, every replica's."""
    internals.put(internals.get(engine, internals.TPUT_TIMER), internals.TIMER_BATCH_SIZE, engine.train_batch_size())


def report_global_batch(engine, topology: ReplicaTopology) -> None:
    """Make ``engine.train_batch_size()`` (and so ``engine.global_samples``, its throughput timer and
    checkpoints) count every replica, as plain DeepSpeed over the whole world does."""
    world, size = topology.data_world, topology.data_per_replica
    if world == size:  # one replica (over torchft: each of several jobs is one, and counts them all)
        return
    per_replica = internals.method(engine, internals.TRAIN_BATCH_SIZE, of_class=True)

    def train_batch_size():  # replicas may differ in data-parallel ranks (lowcomm.replicas)
        return per_replica() // size * world

    internals.replace_method(engine, internals.TRAIN_BATCH_SIZE, train_batch_size)
    _timer_batch_size(engine)


class _WorldDataView:
    """The replica ``mpu`` with its data-parallel rank and size taken over every replica."""

    def __init__(self, mpu, topology: ReplicaTopology):
        self._mpu, self._topology = mpu, topology

    def get_data_parallel_world_size(self) -> int:
        return self._topology.data_world

    def get_data_parallel_rank(self) -> int:
        return self._topology.data_rank

    def __getattr__(self, name):
        return getattr(self._mpu, name)


def patch_world_batch_and_io(engine, topology: ReplicaTopology) -> None:
    """Make ``engine.set_train_batch_size(n)`` and ``engine.deepspeed_io(dataset)`` mean what they
    mean in plain DeepSpeed over the whole world: ``n`` counts every data-parallel rank of every
    replica (DeepSpeed is handed its per-replica share), and the loader shards over every rank."""
    replicas = topology.data_world // topology.data_per_replica  # over torchft, the other jobs' replicas too
    if replicas == 1 or getattr(engine, "_lowcomm_world_io", False):  # one replica: DeepSpeed's world is the world
        return
    engine._lowcomm_world_io = True
    set_train_batch_size_per_replica = internals.method(engine, internals.SET_TRAIN_BATCH_SIZE, of_class=True)
    deepspeed_io_per_replica = internals.method(engine, internals.DEEPSPEED_IO, of_class=True)

    def set_train_batch_size(train_batch_size):
        micro, world = engine.train_micro_batch_size_per_gpu(), topology.data_world
        if (isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int) or train_batch_size <= 0
                or train_batch_size % (micro * world)):
            raise ConfigError(
                f"set_train_batch_size({train_batch_size!r}): train_batch_size must be a positive multiple of "
                f"train_micro_batch_size_per_gpu {micro} x {world} data-parallel ranks ({replicas} replicas x "
                f"{topology.data_per_replica}) = {micro * world} (as in DeepSpeed, every rank "
                f"of every replica counts)")
        set_train_batch_size_per_replica(train_batch_size // world * topology.data_per_replica)
        _timer_batch_size(engine)

    def deepspeed_io(dataset, *args, **kwargs):
        if engine.curriculum_learning_enabled():
            raise ConfigError("curriculum learning (data_efficiency) with DeepSpeed's loader shards by DeepSpeed's "
                              "data-parallel group, one replica: not supported with more than one replica yet")
        # the sampler's rank and size come from the mpu (internals.LOOKED_UP): take them over every replica
        mpu = internals.get(engine, internals.ENGINE_MPU)
        internals.put(engine, internals.ENGINE_MPU, _WorldDataView(mpu, topology))
        try:
            return deepspeed_io_per_replica(dataset, *args, **kwargs)
        finally:
            internals.put(engine, internals.ENGINE_MPU, mpu)

    internals.replace_method(engine, internals.SET_TRAIN_BATCH_SIZE, set_train_batch_size)
    internals.replace_method(engine, internals.DEEPSPEED_IO, deepspeed_io)


def build_training_loader(engine, training_data, topology: ReplicaTopology):
    """DeepSpeed's own training loader (``engine.deepspeed_io``: micro batch size, collate_fn,
    its ``DistributedSampler``, drop_last, ...) sharded over every rank of every replica (through
    ``patch_world_batch_and_io``); set as ``engine.training_dataloader`` and returned."""
    patch_world_batch_and_io(engine, topology)
    loader = engine.deepspeed_io(training_data)
    engine.training_data = training_data
    engine.training_dataloader = loader
    return loader


def build_pipeline_loader(engine, training_data, topology: ReplicaTopology):
    """A pipeline engine's repeating loader (first and last stage) built as DeepSpeed builds it
    (``_build_data_iter``), sharded over every pipeline of every replica: a pipeline's first and
    last stage read the same batches, each pipeline its own."""
    # _build_data_iter reads both (internals.LOOKED_UP)
    mpu, dp_world = internals.get(engine, internals.ENGINE_MPU), internals.get(engine, internals.ENGINE_DP_WORLD_SIZE)
    internals.put(engine, internals.ENGINE_MPU, _WorldDataView(mpu, topology))
    internals.put(engine, internals.ENGINE_DP_WORLD_SIZE, topology.data_world)
    try:
        internals.method(engine, internals.BUILD_DATA_ITER)(training_data)
    finally:
        internals.put(engine, internals.ENGINE_MPU, mpu)
        internals.put(engine, internals.ENGINE_DP_WORLD_SIZE, dp_world)
    engine.training_data = training_data
    first_or_last = engine.is_first_stage() or engine.is_last_stage()
    return internals.get(engine, internals.TRAINING_DATALOADER) if first_or_last else None
