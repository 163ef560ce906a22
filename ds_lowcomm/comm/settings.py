"""The collective backend's settings: which transport carries the method's traffic, how many
consecutive ranks form one replica (see :mod:`.topology`), and how long a collective may wait."""

from __future__ import annotations

from dataclasses import dataclass

from .collectives import NONFINITE_POLICIES
from ..settings import Settings, check_choice, check_int, check_positive

TRANSPORTS = ("torch", "mpi")


@dataclass(frozen=True)
class CommSettings(Settings):
    transport: str = "torch"  # torch.distributed, or MPI (mpi4py) under mpirun
    replica_size: int = 1  # ranks per replica (the DeepSpeed glue's data-parallel group)
    # Seconds any collective ds_lowcomm issues may wait for a peer before every waiting rank fails
    # naming the operation: on its own groups, on the user's (per operation, transport.py), over MPI.
    timeout_s: float = 300.0
    # A rank with NaN/inf to send: "skip" sends nothing of it and averages the healthy ranks
    # (counted and logged), "raise" stops every rank with an error naming the ranks.
    nonfinite: str = "skip"

    def check(self, where: str) -> None:
        check_choice(where, "transport", self.transport, TRANSPORTS)
        check_int(where, "replica_size", self.replica_size, 1)
        check_positive(where, "timeout_s", self.timeout_s)
        check_choice(where, "nonfinite", self.nonfinite, NONFINITE_POLICIES)
