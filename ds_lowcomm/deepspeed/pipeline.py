"""Replicas made of DeepSpeed pipelines (``deepspeed.pipe.PipelineModule``, ``engine.train_batch()``).

A ``PipelineModule`` lays the world out as ``pipe`` x ``data``: every ``data`` index is one whole
pipeline of ``num_stages`` ranks, and DeepSpeed's data-parallel groups join the ranks of one stage
across *all* pipelines. With ds_lowcomm a replica is ``lowcomm.replica_size / num_stages``
consecutive pipelines (by ``data`` index): so ``replica_size`` must be a multiple of ``num_stages``.
Here:
- the replicas are read off the module's own topology (whatever rank order it uses, so a plain
  ``PipelineModule(num_stages=S)`` works unchanged); a rank's cross-replica peers are the ranks of
  the same stage and pipeline slot in the other replicas, so each stage's parameters are synced
  among the stage-matched ranks only;
- DeepSpeed's data-parallel group is narrowed to one replica (new groups per replica and stage put
  on the module's grid before the engine is built): DeepSpeed reduces gradients and partitions
  ZeRO 1 state inside the replica only;
- the start-up broadcast goes over each stage's ranks of every pipeline (stages hold different
  layers), from the stage's first pipeline.
Tied layers (``TiedLayerSpec``) keep DeepSpeed's own tied-gradient reduction inside each pipeline;
every copy then sees the same gradients and the same exchange, so copies stay equal.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ..comm import ReplicaTopology
from ..settings import ConfigError
from . import internals as ds
from .internals import get, put


def _rank(topo, pipe: int, data: int) -> int:
    ranks = ds.method(topo, ds.TOPOLOGY_FILTER_MATCH)(pipe=pipe, data=data)
    return ranks[0]


def pipeline_replicas(module, replica_size: int, zero_stage: int, timeout_s: float | None = None) -> ReplicaTopology:
    """The replica topology of a ``PipelineModule`` (collective: creates the process groups)."""
    grid, topo = ds.grid(module), ds.method(module, ds.MODULE_TOPOLOGY)()
    stages, pipelines = get(grid, ds.GRID_PIPE_SIZE), get(grid, ds.GRID_DATA_SIZE)
    if get(grid, ds.GRID_MODEL_SIZE) > 1:
        raise ConfigError("model: a PipelineModule topology with a 'model' (tensor-slicing) axis > 1 is not "
                          "supported by ds_lowcomm")
    if zero_stage > 1:
        raise ConfigError(f"zero_optimization.stage must be 0 or 1 with DeepSpeed's pipeline engine (DeepSpeed "
                          f"refuses ZeRO 2 and 3 with pipeline parallelism); got {zero_stage}")
    if replica_size % stages or pipelines % (replica_size // stages):
        allowed = [stages * d for d in range(1, pipelines + 1) if pipelines % d == 0]
        raise ConfigError(f"lowcomm.replica_size must be a whole number of pipelines of num_stages {stages} that "
                          f"divides the {pipelines} pipelines of this world; got {replica_size} (allowed: "
                          f"{', '.join(map(str, allowed))})")
    per = replica_size // stages  # pipelines per replica (data-parallel ranks inside a replica)
    replicas = [[_rank(topo, s, d) for d in range(k * per, (k + 1) * per) for s in range(stages)]
                for k in range(pipelines // per)]
    return ReplicaTopology.from_replicas(replicas, data_rank=get(grid, ds.GRID_DATA_ID), data_world=pipelines,
                                         data_per_replica=per, timeout_s=timeout_s)


def stage_group(module):
    """This stage's ranks in every pipeline (DeepSpeed's data-parallel group before narrowing)."""
    return get(ds.grid(module), ds.GRID_DP_PROC_GROUP)


def narrow_data_parallel_to_replica(module, topology: ReplicaTopology, timeout_s: float | None = None) -> None:
    """Make the grid's data-parallel group (DeepSpeed's gradient reduction, ZeRO 1 partitions, its
    loader) the ranks of this stage inside this replica (collective)."""
    grid, topo = ds.grid(module), ds.method(module, ds.MODULE_TOPOLOGY)()
    stages, per = get(grid, ds.GRID_PIPE_SIZE), topology.data_per_replica
    me = dist.get_rank()
    timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    groups = []
    for k in range(topology.num_replicas):
        for s in range(stages):
            ranks = [_rank(topo, s, d) for d in range(k * per, (k + 1) * per)]
            group = dist.new_group(ranks, **timeout)
            groups.append(ranks)
            if me in ranks:
                put(grid, ds.GRID_DP_RANKS, ranks)
                put(grid, ds.GRID_DP_PROC_GROUP, group)
    put(grid, ds.GRID_DP_GROUPS, groups)
    put(grid, ds.GRID_DATA_SIZE, per)
    put(grid, ds.GRID_DATA_ID, get(grid, ds.GRID_DATA_ID) % per)
