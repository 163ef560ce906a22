"""The MPI transport: the same collectives over mpi4py, for clusters launched with mpirun.

Payloads travel as packed byte buffers (``Iallgather``), dense tensors with ``Iallreduce`` (SUM)
and ``Bcast``; the non-blocking forms return a :class:`Pending` like the torch.distributed
transport's, and the ledger records the same bytes. CPU tensors are handed to MPI as numpy views
of their memory (no copy). GPU tensors go to MPI directly when the MPI library is CUDA-aware
(:func:`cuda_aware`), otherwise they are staged through host memory. MPI has no bf16/fp16 SUM:
half-precision all-reduces are summed in fp32 and rounded back (and the fp32 bytes are what the
ledger records, since that is what travels).
"""

from __future__ import annotations

import os
import subprocess
import time
from functools import lru_cache

import torch

from ..settings import ConfigError
from .ledger import ByteLedger
from .transport import Pending, Transport

# Requests in flight with the buffers MPI reads and writes until they complete. Held here, not
# only by their Pending: a sync nobody waits for (a streaming fragment still in flight when
# training ends) must not free memory MPI is still writing into. Completed ones are dropped as
# new collectives start; finalize_if_used() waits for the rest.
_OUTSTANDING: list[tuple[object, list]] = []

_LAUNCH_HINT = "launch with `mpirun -np N python launch/train.py ...`, or set lowcomm.transport to \"torch\""


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise ConfigError(f"lowcomm.transport is 'mpi' but mpi4py is not importable ({err}): pip install "
                          f"'ds_lowcomm[mpi]' (needs an MPI library such as OpenMPI), or {_LAUNCH_HINT}") from None
    return MPI


@lru_cache(maxsize=1)
def cuda_aware() -> bool:
    """Whether the MPI library takes GPU buffers: MPI 4.1's query where the library has it, else
    OpenMPI's build flag (``ompi_info``); False when neither says yes."""
    MPI = _mpi()
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:  # noqa: BLE001 - an MPI without the MPIX extension raises here
            pass
    try:
        out = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "mpi_built_with_cuda_support:value:true" in out


class MPITransport(Transport):
    """Collectives over an mpi4py communicator (default: COMM_WORLD)."""

    def __init__(self, comm=None, ledger: ByteLedger | None = None, device: torch.device | str = "cpu"):
        MPI = _mpi()
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        self.ledger = ledger if ledger is not None else ByteLedger()
        self.device = torch.device(device)
        self._sum = MPI.SUM

    @classmethod
    def cross_replica(cls, replica_size: int, ledger: ByteLedger | None = None) -> "MPITransport":
        """The ranks with this rank's local rank in every replica (as ``ReplicaTopology.cross_group``)."""
        world = _mpi().COMM_WORLD
        rank = world.Get_rank()
        return cls(world.Split(color=rank % replica_size, key=rank // replica_size), ledger)

    # -- buffers ------------------------------------------------------------------------------
    def _staged(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where MPI can read it: itself on the CPU or with CUDA-aware MPI, else a host copy."""
        t = t.contiguous()
        if t.device.type == "cpu" or cuda_aware():
            return t
        return t.cpu()

    @staticmethod
    def _buffer(t: torch.Tensor):
        # numpy views share the tensor's memory; GPU tensors (CUDA-aware MPI only) go as they
        # are, through __cuda_array_interface__
        return t.numpy() if t.device.type == "cpu" else t

    # -- collectives --------------------------------------------------------------------------
    def start_all_gather_bytes(self, payload, op="all_gather"):
        start = time.perf_counter()
        send = self._staged(payload)
        out = torch.empty(self.world_size, send.numel(), dtype=torch.uint8, device=send.device)
        buffers = [send, out, self._buffer(send), self._buffer(out)]
        request = _track(self.comm.Iallgather(buffers[2], buffers[3]), buffers)
        n = send.numel()
        self.ledger.record(op, n, (self.world_size - 1) * n)
        self.ledger.add_time("comm", time.perf_counter() - start)

        def finish():
            request.Wait()
            return out if out.device == payload.device else out.to(payload.device)

        return Pending(finish, self.ledger)

    def start_all_reduce_sum_(self, tensor, op="all_reduce"):
        start = time.perf_counter()
        work = self._staged(tensor)
        if work.dtype in (torch.bfloat16, torch.float16):
            work = work.float()
        elif work.data_ptr() == tensor.data_ptr() and not tensor.is_contiguous():
            work = work.clone()
        buffers = [work, self._buffer(work)]
        request = _track(self.comm.Iallreduce(_in_place(), buffers[1], op=self._sum), buffers)
        n = work.numel() * work.element_size()
        self.ledger.record(op, n, n)
        self.ledger.add_time("comm", time.perf_counter() - start)

        def finish():
            request.Wait()
            if work.data_ptr() != tensor.data_ptr():
                tensor.copy_(work)
            return tensor

        return Pending(finish, self.ledger)

    def broadcast_(self, tensor, src=0, op="broadcast"):
        start = time.perf_counter()
        work = self._staged(tensor)
        self.comm.Bcast(self._buffer(work.view(torch.uint8) if work.dtype == torch.bfloat16 else work), root=src)
        if work.data_ptr() != tensor.data_ptr():
            tensor.copy_(work)
        n = tensor.numel() * tensor.element_size()
        self.ledger.record(op, n if self.rank == src else 0, 0 if self.rank == src else n)
        self.ledger.add_time("comm", time.perf_counter() - start)
        return tensor


def _track(request, buffers: list):
    _OUTSTANDING[:] = [(r, b) for r, b in _OUTSTANDING if not r.Test()]
    _OUTSTANDING.append((request, buffers))
    return request


def _in_place():
    return _mpi().IN_PLACE


def started_by_mpirun() -> bool:
    env = os.environ
    return any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"))


def finalize_if_used() -> None:
    """MPI_Finalize where this process used MPI: mpirun counts a rank that leaves without it as
    failed (call it before any ``os._exit``)."""
    import sys

    if "mpi4py.MPI" in sys.modules:
        MPI = sys.modules["mpi4py.MPI"]
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Request.Waitall([r for r, _ in _OUTSTANDING])  # every rank started them: they complete
            _OUTSTANDING.clear()
            MPI.Finalize()
