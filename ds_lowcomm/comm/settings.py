"""The collective backend's settings: which transport carries the method's traffic, and how
many consecutive ranks form one replica (see :mod:`.topology`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import Settings, check_choice, check_int

TRANSPORTS = ("torch", "mpi")


@dataclass(frozen=True)
class CommSettings(Settings):
    transport: str = "torch"  # torch.distributed, or MPI (mpi4py) under mpirun
    replica_size: int = 1  # ranks per replica (the DeepSpeed glue's data-parallel group)

    def check(self, where: str) -> None:
        check_choice(where, "transport", self.transport, TRANSPORTS)
        check_int(where, "replica_size", self.replica_size, 1)
