"""``build_transport``: the transport ``lowcomm.transport`` names. It lives apart from both
transports' modules so that neither needs to import the other."""

from __future__ import annotations

import torch.distributed as dist

from ..settings import ConfigError
from .ledger import ByteLedger
from .mpi import LAUNCH_HINT, MPITransport, started_by_mpirun
from .transport import TorchDistTransport, Transport


def build_transport(name: str, *, group: dist.ProcessGroup | None = None, cross: tuple[int, int] | None = None,
                    ledger: ByteLedger | None = None, timeout_s: float = 300.0) -> Transport:
    """The transport ``lowcomm.transport`` names, over ``group`` (torch) or the matching MPI
    communicator (mpi: the whole world, or, with ``cross`` = (local rank, replica) from the replica
    topology, the ranks of this local rank in every replica). Each of its collectives waits at
    most ``timeout_s`` for a peer (lowcomm.timeout_s), whatever the group's own timeout."""
    if name == "torch":
        return TorchDistTransport(group, ledger, timeout_s=timeout_s)
    if name != "mpi":
        raise ValueError(f"lowcomm.transport must be one of torch, mpi; got {name!r}")
    if not started_by_mpirun():
        raise ConfigError(f"lowcomm.transport is 'mpi' but this process was not started by mpirun: {LAUNCH_HINT}")
    # MPI's waits poll to the timeout (MPI itself has none)
    transport = (MPITransport.cross_replica(*cross, ledger, timeout_s=timeout_s) if cross is not None
                 else MPITransport(ledger=ledger, timeout_s=timeout_s))
    if dist.is_initialized():  # MPI's ranks must be torch.distributed's, or syncs would pair the wrong peers
        mine, size = dist.get_rank(group), dist.get_world_size(group)
        if (transport.rank, transport.world_size) != (mine, size):
            raise ConfigError(f"lowcomm.transport is 'mpi' but MPI has rank {transport.rank} of {transport.world_size} "
                              f"where torch.distributed has {mine} of {size}: start one process per rank with "
                              "mpirun and take RANK/WORLD_SIZE from OMPI_COMM_WORLD_RANK/SIZE")
    return transport
