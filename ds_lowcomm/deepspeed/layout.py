"""How a job's ranks form replicas: the three layouts ``initialize`` knows, one chosen per engine.

- :class:`Replicas`: ``lowcomm.replica_size`` consecutive ranks per replica, any ``nn.Module``;
  DeepSpeed's data-parallel group is the replica (through an ``mpu``).
- :class:`PipelineReplicas`: replicas made of DeepSpeed pipelines (``PipelineModule``), read off
  the module's own grid (``pipeline.py``).
- :class:`ShapedReplicas`: replicas of different shapes (``lowcomm.replicas``), each its own
  DeepSpeed world (``subworld.py``), synced by parameter name along routes (``hetero.py``).

A layout owns everything that differs between them: the replica topology, the settings every rank
must share besides the method's, how every rank starts from rank 0's weights, the transport (and
the shard among a replica's equal copies) of the method's cross-replica traffic, the lowcomm
settings this replica's optimizer takes, what DeepSpeed is given as its ``mpu``, how the method
meets the engine once built, and the loader of ``training_data``. ``initialize`` (engine.py) calls
the same steps in the same order for each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..comm import ByteLedger, ReplicaShard, ReplicaTopology, TorchDistTransport, build_transport
from ..comm.transport import Transport
from . import hetero, internals, pipeline
from .broadcast import broadcast_initial_state
from .config import SplitConfig
from .data import build_pipeline_loader, build_training_loader
from .mpu import ReplicaMPU


@dataclass
class Layout:
    split: SplitConfig
    model: Any
    topology: ReplicaTopology
    ledger: ByteLedger  # DeepSpeed's own traffic and the start-up's (the engine ledger)
    agreed_settings: dict = None  # what initialize checked every rank agrees on (flat keys)

    @property
    def timeout_s(self) -> float | None:
        return self.split.lowcomm.comm.timeout_s

    @property
    def piped(self) -> bool:
        from deepspeed.pipe import PipelineModule

        return isinstance(self.model, PipelineModule)

    # -- before the optimizer ----------------------------------------------------------------
    def shared_settings(self) -> dict[str, Any]:
        """What every rank must agree on besides the method's, optimizer's and precision settings."""
        return {f"lowcomm.activations.{k}": v for k, v in self.split.activations.flat().items()}

    def broadcast_initial_state(self, params: list) -> None:
        """Every rank starts from rank 0's parameters and buffers (collective)."""
        broadcast_initial_state(self.model, params, self.ledger, timeout_s=self.timeout_s)

    def transport(self) -> Transport:
        """The method's cross-replica traffic: over lowcomm.transport (torch.distributed or MPI);
        DeepSpeed's own, inside a replica, and the start-up checks stay on torch.distributed."""
        topology = self.topology
        return build_transport(self.split.lowcomm.comm.transport, group=topology.cross_group,
                               cross=(topology.local_rank, topology.replica) if topology.num_replicas > 1 else None,
                               timeout_s=self.timeout_s)

    def shard(self) -> ReplicaShard | None:
        """At ZeRO 0 every data-parallel rank of a replica holds the same parameters: the
        cross-replica sync is split among them by owner."""
        if self.split.zero_stage != 0 or self.topology.data_per_replica == 1:
            return None
        return ReplicaShard(self.topology.local_rank, self.topology.replica_size,
                            TorchDistTransport(self.topology.replica_group, ledger=self.ledger))

    def method_settings(self):
        """The lowcomm settings this replica's optimizer takes."""
        return self.split.lowcomm

    def mpu(self):
        """DeepSpeed's ``mpu``: one replica as its data-parallel group."""
        return ReplicaMPU(self.topology)

    # -- once DeepSpeed's engine is built ----------------------------------------------------
    def backward_allreduce_flag(self) -> internals.Internal:
        """The engine flag of DeepSpeed's ZeRO 0 gradient all-reduce (on inside a replica of more
        than one data-parallel rank; off otherwise: the method does all the communication)."""
        return internals.PIPELINE_BACKWARD_ALLREDUCE if self.piped else internals.BACKWARD_ALLREDUCE

    def connect(self, engine, optimizer) -> None:
        """Anything the method needs from the built engine (routes, for replicas of different shapes)."""

    def loader(self, engine, training_data):
        """DeepSpeed's loader of ``training_data``, sharded over every (pipeline) rank of every replica."""
        build = build_pipeline_loader if self.piped else build_training_loader
        return build(engine, training_data, self.topology)

    def codes_activations(self) -> bool:
        """Whether this rank's model has pipeline stage boundaries to count (and code)."""
        return self.piped and internals.get(internals.grid(self.model), internals.GRID_PIPE_SIZE) > 1


class Replicas(Layout):
    @classmethod
    def build(cls, split: SplitConfig, model, ledger: ByteLedger) -> "Replicas":
        return cls(split, model, ReplicaTopology.build(split.lowcomm.comm.replica_size, split.lowcomm.comm.timeout_s),
                   ledger)


class PipelineReplicas(Layout):
    @classmethod
    def build(cls, split: SplitConfig, model, ledger: ByteLedger) -> "PipelineReplicas":
        return cls(split, model, pipeline.pipeline_replicas(model, split.lowcomm.comm.replica_size, split.zero_stage,
                                                            split.lowcomm.comm.timeout_s), ledger)

    def broadcast_initial_state(self, params: list) -> None:
        # stages hold different layers: each stage from its first pipeline; then DeepSpeed's
        # data-parallel group becomes this stage inside this replica
        broadcast_initial_state(self.model, params, self.ledger, group=pipeline.stage_group(self.model),
                                timeout_s=self.timeout_s)
        pipeline.narrow_data_parallel_to_replica(self.model, self.topology, self.timeout_s)

    def shard(self) -> ReplicaShard | None:
        if self.split.zero_stage != 0 or self.topology.data_per_replica == 1:
            return None
        grid = internals.grid(self.model)
        return ReplicaShard(internals.get(grid, internals.GRID_DATA_ID), internals.get(grid, internals.GRID_DATA_SIZE),
                            TorchDistTransport(internals.get(grid, internals.GRID_DP_PROC_GROUP), ledger=self.ledger))

    def mpu(self):
        return None  # the module's grid, narrowed to the replica above


@dataclass
class ShapedReplicas(Layout):
    place: hetero.ReplicaPlace = None

    @classmethod
    def build(cls, split: SplitConfig, model, ledger: ByteLedger) -> "ShapedReplicas":
        place = hetero.current_place(split.replicas)
        hetero.check_model(model, place)
        if place.spec.activations is not None:  # this replica's own codecs between its stages
            split.activations = place.spec.activations
        return cls(split, model, hetero.topology(place, model, split.lowcomm.comm.timeout_s), ledger, place=place)

    def shared_settings(self) -> dict[str, Any]:
        return {"lowcomm.replicas": [spec.describe() for spec in self.split.replicas]}

    def broadcast_initial_state(self, params: list) -> None:
        hetero.broadcast_initial_state(self.model, self.timeout_s)  # by name: replicas hold different parts

    def transport(self) -> Transport:
        # The syncs go along routes by name (connect); the optimizer's construction check is this
        # rank's own, and the routes check the rest.
        return TorchDistTransport(dist.new_group([dist.get_rank()], use_local_synchronization=True))

    def shard(self) -> ReplicaShard | None:
        return None  # routes count a replica's equal ZeRO 0 copies as one

    def method_settings(self):
        return hetero.inner_steps(self.place, self.split.lowcomm)

    def mpu(self):
        return None  # the replica is DeepSpeed's whole world (subworld.py)

    def connect(self, engine, optimizer) -> None:
        optimizer.set_routes(hetero.method_routes(self.model, optimizer, engine.optimizer, self.split.zero_stage,
                                                  self.place, self.split.lowcomm, self.timeout_s))


@dataclass
class TorchftReplica(Layout):
    """This job is one replica of several jobs meeting through torchft (``lowcomm.fault_tolerance``;
    ``fault_tolerance.py``): its whole DeepSpeed world is the replica; the method's cross-replica
    traffic goes over torchft's process group, rank r of this replica with rank r of the others."""

    fault_tolerance: Any = None  # optim.fault_tolerance.FaultTolerance

    @classmethod
    def build(cls, split: SplitConfig, model, ledger: ByteLedger) -> "TorchftReplica":
        from deepspeed.pipe import PipelineModule

        replica, replicas = split.fault_tolerance.data_shard()
        world, timeout_s = dist.get_world_size(), split.lowcomm.comm.timeout_s
        if isinstance(model, PipelineModule):  # its pipelines (and stages) as one replica
            topology = pipeline.pipeline_replicas(model, world, split.zero_stage, timeout_s)
            per = topology.data_per_replica  # the data-parallel ranks are the replica's pipelines
            topology.data_rank, topology.data_world = replica * per + topology.data_rank, replicas * per
            return TorchftPipelineReplica._with_manager(split, model, topology, ledger)
        topology = ReplicaTopology.from_replicas([list(range(world))], data_rank=replica * world + dist.get_rank(),
                                                 data_world=replicas * world, data_per_replica=world,
                                                 timeout_s=timeout_s)
        return cls._with_manager(split, model, topology, ledger)

    @classmethod
    def _with_manager(cls, split: SplitConfig, model, topology: ReplicaTopology, ledger: ByteLedger):
        """This rank's torchft manager (rank r meets rank r of every other replica)."""
        import socket

        from ..optim.fault_tolerance import FaultTolerance, replica_store

        settings, timeout_s = split.fault_tolerance, split.lowcomm.comm.timeout_s
        world, rank = dist.get_world_size(), dist.get_rank()
        host = settings.host or socket.gethostname()
        store, address, replica = None, None, None
        if world > 1:  # the replica's managers meet in rank 0's store, and its ranks agree over its own group
            replica = TorchDistTransport(topology.replica_group, ledger=ledger, timeout_s=timeout_s)
            store, address = replica_store(host, replica)
        ft = FaultTolerance(settings, host=host, rank=rank, world_size=world, store=address, store_server=store,
                            replica_transport=replica)
        return cls(split, model, topology, ledger, fault_tolerance=ft)

    def shared_settings(self) -> dict[str, Any]:
        ft = {f"lowcomm.fault_tolerance.{k}": v for k, v in self.split.fault_tolerance.flat().items() if k != "host"}
        return {**super().shared_settings(), **ft}

    def transport(self) -> Transport:
        return self.fault_tolerance.transport

    def connect(self, engine, optimizer) -> None:
        """Join the replicas' quorum: a replica behind them heals from a live peer here (the
        method's state, the engine's position and schedule, the model's own tensors)."""
        from .fault_tolerance import EngineState, ModelWeights

        position = EngineState(engine)
        # what the other replicas must share: this one's agreed settings but its own id, and its batch shape
        agreed = {k: v for k, v in self.agreed_settings.items() if k != "lowcomm.fault_tolerance.replica_id"}
        agreed.update(train_micro_batch_size_per_gpu=engine.train_micro_batch_size_per_gpu(),
                      gradient_accumulation_steps=engine.gradient_accumulation_steps(), replica_ranks=self.topology.world_size)
        self.fault_tolerance.attach(optimizer, position, ModelWeights(self.model, params=self.split.zero_stage > 0),
                                    after_step=(position.finish_step,), settings=agreed)

    def loader(self, engine, training_data):
        from .fault_tolerance import build_loader

        return build_loader(engine, training_data, self.topology, lambda: self.fault_tolerance.data_lag)


@dataclass
class TorchftPipelineReplica(TorchftReplica, PipelineReplicas):
    """A replica of DeepSpeed pipelines over torchft: rank r (a stage of a pipeline) meets the same
    stage of the same pipeline in every other replica; inside, as :class:`PipelineReplicas`."""

    def loader(self, engine, training_data):
        from .fault_tolerance import build_pipeline_loader

        return build_pipeline_loader(engine, training_data, self.topology, lambda: self.fault_tolerance.data_lag)


def choose_layout(split: SplitConfig, model, ledger: ByteLedger) -> Layout:
    """This engine's layout (collective: builds the topology's process groups)."""
    if split.fault_tolerance is not None:
        return TorchftReplica.build(split, model, ledger)
    if split.replicas:
        return ShapedReplicas.build(split, model, ledger)
    from deepspeed.pipe import PipelineModule

    return (PipelineReplicas if isinstance(model, PipelineModule) else Replicas).build(split, model, ledger)
