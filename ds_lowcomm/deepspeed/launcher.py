"""What a training script started by a launcher needs before torch.distributed comes up."""

from __future__ import annotations

import os


def mpi_environment() -> None:
    """Map OpenMPI's rank variables to torch.distributed's when started by mpirun."""
    env = os.environ
    if "OMPI_COMM_WORLD_RANK" in env and "RANK" not in env:
        env["RANK"] = env["OMPI_COMM_WORLD_RANK"]
        env["WORLD_SIZE"] = env["OMPI_COMM_WORLD_SIZE"]
        env["LOCAL_RANK"] = env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", "29511")
