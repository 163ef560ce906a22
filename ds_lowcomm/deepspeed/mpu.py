"""A DeepSpeed ``mpu`` whose data-parallel group is one replica.

DeepSpeed then reduces gradients (and partitions ZeRO state, and broadcasts the initial
parameters) only inside the replica; the lowcomm method syncs across replicas.
"""

from __future__ import annotations

import torch.distributed as dist

from ..comm import ReplicaTopology


class ReplicaMPU:
    def __init__(self, topology: ReplicaTopology):
        self.topology = topology

    # data parallel = the replica
    def get_data_parallel_group(self):
        return self.topology.replica_group

    def get_data_parallel_world_size(self) -> int:
        return self.topology.replica_size

    def get_data_parallel_rank(self) -> int:
        return self.topology.local_rank

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.topology.replicas[self.topology.replica])

    # no model parallelism inside a replica (pipeline replicas come with the pipeline engine)
    def get_model_parallel_group(self):
        return self.topology.single_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_global_rank(self) -> int:
        return dist.get_rank()
