"""Replica topology: ``replica_size`` consecutive ranks form one replica.

Inside a replica the ranks are ordinary data-parallel peers (DeepSpeed/ZeRO runs there, over
fast links); across replicas only the lowcomm method talks (slow links). Rank ``r`` belongs to
replica ``r // replica_size`` with local rank ``r % replica_size``; its cross-replica peers are
the ranks with the same local rank in the other replicas, so each rank syncs only its share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..settings import ConfigError


@dataclass
class ReplicaTopology:
    world_size: int
    rank: int
    replica_size: int
    replica_group: dist.ProcessGroup | None  # this rank's replica (DeepSpeed's data-parallel group)
    cross_group: dist.ProcessGroup | None  # same local rank in every replica (the lowcomm group)
    single_group: dist.ProcessGroup | None  # just this rank (model-parallel group of size 1)

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.replica_size

    @property
    def replica(self) -> int:
        return self.rank // self.replica_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.replica_size

    @classmethod
    def build(cls, replica_size: int) -> "ReplicaTopology":
        """Create the process groups; every rank must call this with the same ``replica_size``."""
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % replica_size != 0:
            raise ConfigError(
                f"lowcomm.replica_size must divide the world size {world}; got {replica_size} "
                f"(allowed: {', '.join(str(d) for d in range(1, world + 1) if world % d == 0)})"
            )
        replicas = world // replica_size
        mine = {}
        # new_group is collective: every rank creates every group, in the same order.
        for r in range(replicas):
            ranks = list(range(r * replica_size, (r + 1) * replica_size))
            g = dist.new_group(ranks)
            if rank in ranks:
                mine["replica"] = g
        for j in range(replica_size):
            ranks = list(range(j, world, replica_size))
            g = dist.new_group(ranks)
            if rank in ranks:
                mine["cross"] = g
        for r in range(world):
            g = dist.new_group([r])
            if r == rank:
                mine["single"] = g
        return cls(world, rank, replica_size, mine["replica"], mine["cross"], mine["single"])
