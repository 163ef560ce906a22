"""Replica topology: which ranks form each replica, and who syncs with whom across replicas.

Inside a replica the ranks are ordinary data-parallel peers, or pipeline stages (DeepSpeed/ZeRO
runs there, over fast links); across replicas only the lowcomm method talks (slow links). By
default ``replica_size`` consecutive ranks form a replica: rank ``r`` belongs to replica
``r // replica_size`` with local rank ``r % replica_size``. A pipeline engine's layout gives the
replicas as lists of ranks (:meth:`ReplicaTopology.from_replicas`). Either way a rank's
cross-replica peers are the ranks with the same local rank in the other replicas (the same
pipeline stage and data-parallel slot), so each rank syncs only its share.

Data parallelism across the whole job: ``data_rank`` / ``data_world`` are this rank's
data-parallel rank and the number of data-parallel ranks over every replica (the world, or the
number of pipelines when replicas are pipelines); ``data_per_replica`` of them per replica.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ..settings import ConfigError


@dataclass
class ReplicaTopology:
    world_size: int
    rank: int
    replicas: list[list[int]]  # each replica's global ranks, in local-rank order
    replica_group: dist.ProcessGroup | None  # this rank's replica (DeepSpeed's data-parallel group)
    cross_group: dist.ProcessGroup | None  # same local rank in every replica (the lowcomm group)
    single_group: dist.ProcessGroup | None  # just this rank (model-parallel group of size 1)
    data_rank: int = -1  # defaults: every rank is a data-parallel rank
    data_world: int = -1
    data_per_replica: int = -1

    def __post_init__(self):
        if self.data_world < 0:
            self.data_rank, self.data_world, self.data_per_replica = self.rank, self.world_size, self.replica_size

    @property
    def replica_size(self) -> int:
        return len(self.replicas[0])

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def replica(self) -> int:
        return next(i for i, ranks in enumerate(self.replicas) if self.rank in ranks)

    @property
    def local_rank(self) -> int:
        return self.replicas[self.replica].index(self.rank)

    @classmethod
    def build(cls, replica_size: int, timeout_s: float | None = None) -> "ReplicaTopology":
        """Consecutive ranks per replica; every rank must call this with the same ``replica_size``."""
        world = dist.get_world_size()
        if world % replica_size != 0:
            raise ConfigError(
                f"lowcomm.replica_size must divide the world size {world}; got {replica_size} "
                f"(allowed: {', '.join(str(d) for d in range(1, world + 1) if world % d == 0)})"
            )
        return cls.from_replicas([list(range(r, r + replica_size)) for r in range(0, world, replica_size)],
                                 timeout_s=timeout_s)

    @classmethod
    def from_replicas(cls, replicas: list[list[int]], data_rank: int = -1, data_world: int = -1,
                      data_per_replica: int = -1, timeout_s: float | None = None) -> "ReplicaTopology":
        """Replicas given as rank lists (equal sizes, together every rank once); collective: every
        rank calls it with the same lists. ``timeout_s``: how long the groups' collectives wait
        (None: torch's default)."""
        world, rank = dist.get_world_size(), dist.get_rank()
        flat = sorted(r for ranks in replicas for r in ranks)
        if flat != list(range(world)) or len({len(r) for r in replicas}) != 1:
            raise ValueError(f"replicas must be equal-sized and cover ranks 0..{world - 1} once; got {replicas}")
        size = len(replicas[0])
        key = (tuple(tuple(r) for r in replicas), timeout_s)
        timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        built = _GROUPS.setdefault(dist.distributed_c10d._get_default_group(), {})
        if key in built:  # another engine in this process, same layout
            return cls(world, rank, [list(r) for r in replicas], *built[key], data_rank, data_world, data_per_replica)
        mine = {}
        # new_group is collective: every rank creates every group, in the same order.
        for ranks in replicas:
            g = dist.new_group(ranks, **timeout)
            if rank in ranks:
                mine["replica"] = g
        for j in range(size):
            ranks = [replica[j] for replica in replicas]
            g = dist.new_group(ranks, **timeout)
            if rank in ranks:
                mine["cross"] = g
        for r in range(world):
            g = dist.new_group([r], **timeout)
            if r == rank:
                mine["single"] = g
        groups = (mine["replica"], mine["cross"], mine["single"])
        built[key] = groups
        return cls(world, rank, [list(r) for r in replicas], *groups, data_rank, data_world, data_per_replica)


# Process groups of the layouts built in this process, reused by later engines (every rank builds
# the same layouts in the same order, so every rank reuses alike); kept per default group, so a
# re-initialised torch.distributed gets new ones. Weakly: once torch has destroyed the default group
# and the engines are gone, the groups go with it and torch joins their gloo worker threads then,
# not at interpreter shutdown (pytorch/pytorch#190489: a worker still holding a tensor then aborts).
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # default group -> {layout: groups}
