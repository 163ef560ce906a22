"""The MPI transport: the same collectives over mpi4py (``Iallgather``, ``Iallreduce`` SUM,
``Ibcast``), for clusters launched with mpirun; each waits at most ``timeout_s`` for a peer.

CPU tensors are handed to MPI as numpy views of their memory (no copy). GPU tensors go to MPI
directly when the MPI library is CUDA-aware (:func:`cuda_aware`), otherwise they are staged
through host memory. MPI has no bf16/fp16 SUM: half-precision all-reduces are summed in fp32
(the fp32 bytes are what the ledger records, since that is what travels).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from functools import lru_cache

import torch

from ..settings import ConfigError
from .ledger import ByteLedger
from .transport import Transport

# Requests in flight with the buffers MPI reads and writes until they complete. Held here, not
# only by their Pending: a sync nobody waits for (a streaming fragment still in flight when
# training ends) must not free memory MPI is still writing into. Completed ones are dropped as
# new collectives start; finalize_if_used() waits for the rest.
_OUTSTANDING: list[tuple[object, list]] = []

LAUNCH_HINT = "launch with `mpirun -np N python launch/train.py ...`, or set lowcomm.transport to \"torch\""


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise ConfigError(f"lowcomm.transport is 'mpi' but mpi4py is not importable ({err}): pip install "
                          f"'ds_lowcomm[mpi]' (needs an MPI library such as OpenMPI), or {LAUNCH_HINT}") from None
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

    def __init__(self, comm=None, ledger: ByteLedger | None = None, device: torch.device | str = "cpu",
                 timeout_s: float = 300.0):
        MPI = _mpi()
        self.timeout_s = timeout_s  # lowcomm.timeout_s: MPI itself would wait for a stalled peer forever
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        self.ledger = ledger if ledger is not None else ByteLedger()
        self.device = torch.device(device)
        self._sum, self._in_place = MPI.SUM, MPI.IN_PLACE

    @classmethod
    def cross_replica(cls, local_rank: int, replica: int, ledger: ByteLedger | None = None,
                      timeout_s: float = 300.0) -> "MPITransport":
        """The ranks with this rank's local rank in every replica, ordered by replica (as
        ``ReplicaTopology.cross_group``); collective over COMM_WORLD."""
        return cls(_mpi().COMM_WORLD.Split(color=local_rank, key=replica), ledger, timeout_s=timeout_s)

    def _home(self, t):
        # the CPU, or the GPU itself with CUDA-aware MPI
        return t.device if t.device.type == "cpu" or cuda_aware() else torch.device("cpu")

    def _stage_for_sum(self, t):
        # MPI has no bf16/fp16 SUM: summed in fp32, rounded back by the copy into ``t``
        buf = self._stage(t)
        return buf.float() if buf.dtype in (torch.bfloat16, torch.float16) else buf

    def _all_gather(self, send, out):
        views = _buffer(send), _buffer(out)
        return _track(self.comm.Iallgather(*views), [send, out, *views], self.timeout_s)

    def _all_reduce_sum(self, buf):
        view = _buffer(buf)
        return _track(self.comm.Iallreduce(self._in_place, view, op=self._sum), [buf, view], self.timeout_s)

    def _broadcast(self, buf, src):
        view = _buffer(buf)  # non-blocking too: a blocking Bcast would wait for a stalled root forever
        _track(self.comm.Ibcast(view, root=src), [buf, view], self.timeout_s)()


def _buffer(t: torch.Tensor):
    """What MPI reads ``t`` through: a numpy view of its memory on the CPU, the tensor itself (its
    ``__cuda_array_interface__``) on a GPU. Half-precision tensors go as their bytes (numpy has no
    bfloat16 and mpi4py maps no MPI type to float16; only broadcasts see them, sums are in fp32)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.uint8)
    return t.numpy() if t.device.type == "cpu" else t


def _track(request, buffers: list, timeout_s: float):
    """Hold ``request`` and its buffers until it completes; return what waits for it, at most
    ``timeout_s`` (then RuntimeError, which the transport reports naming the operation)."""
    _OUTSTANDING[:] = [(r, b) for r, b in _OUTSTANDING if not r.Test()]
    _OUTSTANDING.append((request, buffers))

    def wait():
        start = time.monotonic()
        pause = 0.0
        while not request.Test():
            waited = time.monotonic() - start
            if waited > timeout_s:
                raise RuntimeError(f"no answer from a peer within {timeout_s:g} s")
            time.sleep(pause)
            pause = min(0.005, waited / 100)  # spin at first (a quick collective), then poll gently

    return wait


def started_by_mpirun() -> bool:
    env = os.environ
    return any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"))


def finalize_if_used() -> None:
    """MPI_Finalize where this process used MPI: mpirun counts a rank that leaves without it as
    failed (call it before any ``os._exit``)."""
    if "mpi4py.MPI" in sys.modules:
        MPI = sys.modules["mpi4py.MPI"]
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Request.Waitall([r for r, _ in _OUTSTANDING])  # every rank started them: they complete
            _OUTSTANDING.clear()
            MPI.Finalize()
