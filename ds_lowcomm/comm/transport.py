"""Transports: the few collectives the methods need, each recording its bytes in the ledger.

Only byte buffers and float tensors cross a transport; what they mean is decided above it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .ledger import ByteLedger

# torch >= 2.13 renamed all_gather_into_tensor (the old name warns); accept both.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Pending:
    """A collective in flight. ``wait()`` blocks until it has landed and returns its result (the
    same object on every later call). Only the time spent issuing and waiting is booked as
    "comm" time: a collective that lands while the caller computes costs the step nothing.
    With ``ledger=None`` nothing is timed here (for wrappers whose parts time themselves)."""

    def __init__(self, finish, ledger: ByteLedger | None):
        self._finish = finish
        self._ledger = ledger
        self._done = False
        self._result = None

    def wait(self):
        if not self._done:
            start = time.perf_counter()
            self._result = self._finish()
            if self._ledger is not None:
                self._ledger.add_time("comm", time.perf_counter() - start)
            self._done, self._finish = True, None
        return self._result


class Transport:
    """Interface: rank, world_size, ledger, device, and three collectives.

    A transport implements the ``start_*`` forms (non-blocking: issue, record the bytes, return
    a :class:`Pending`) and ``broadcast_``; the blocking forms are ``start_*(...).wait()``.
    Collectives must be started in the same order on every rank.
    """

    rank: int
    world_size: int
    ledger: ByteLedger
    device: torch.device  # where this transport's buffers must live

    def start_all_gather_bytes(self, payload: torch.Tensor, op: str = "all_gather") -> Pending:
        """Flat uint8 payload of equal length on every rank -> Pending of (world_size, length) uint8."""
        raise NotImplementedError

    def start_all_reduce_sum_(self, tensor: torch.Tensor, op: str = "all_reduce") -> Pending:
        """Sum ``tensor`` over ranks in place -> Pending of ``tensor``. Do not touch ``tensor``
        before ``wait()``."""
        raise NotImplementedError

    def broadcast_(self, tensor: torch.Tensor, src: int = 0, op: str = "broadcast") -> torch.Tensor:
        raise NotImplementedError

    def all_gather_bytes(self, payload: torch.Tensor, op: str = "all_gather") -> torch.Tensor:
        return self.start_all_gather_bytes(payload, op).wait()

    def all_reduce_sum_(self, tensor: torch.Tensor, op: str = "all_reduce") -> torch.Tensor:
        return self.start_all_reduce_sum_(tensor, op).wait()


class TorchDistTransport(Transport):
    """torch.distributed over a process group (gloo on CPU, NCCL on GPUs)."""

    def __init__(self, group: dist.ProcessGroup | None = None, ledger: ByteLedger | None = None):
        if not dist.is_initialized():
            raise RuntimeError("TorchDistTransport needs torch.distributed.init_process_group() first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.ledger = ledger if ledger is not None else ByteLedger()
        self.device = backend_device(group)

    def _timed(self, start: float) -> None:
        self.ledger.add_time("comm", time.perf_counter() - start)

    def _staged(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where the backend can use it: itself, or a copy on ``self.device`` (GPU
        parameters over gloo, e.g. a cross-datacenter gloo group; CPU-offloaded masters over NCCL)."""
        t = t.contiguous()
        return t if t.device == self.device else t.to(self.device)

    def start_all_gather_bytes(self, payload, op="all_gather"):
        start = time.perf_counter()
        send = self._staged(payload)
        out = torch.empty(self.world_size, send.numel(), dtype=torch.uint8, device=send.device)
        work = _all_gather_single(out.view(-1), send, group=self.group, async_op=True)
        n = send.numel()
        self.ledger.record(op, n, (self.world_size - 1) * n)
        self._timed(start)

        def finish():
            work.wait()
            return out if out.device == payload.device else out.to(payload.device)

        return Pending(finish, self.ledger)

    def start_all_reduce_sum_(self, tensor, op="all_reduce"):
        start = time.perf_counter()
        staged = self._staged(tensor)
        work = dist.all_reduce(staged, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        n = staged.numel() * staged.element_size()
        self.ledger.record(op, n, n)
        self._timed(start)

        def finish():
            work.wait()
            if staged.data_ptr() != tensor.data_ptr():
                tensor.copy_(staged)
            return tensor

        return Pending(finish, self.ledger)

    def broadcast_(self, tensor, src=0, op="broadcast"):
        start = time.perf_counter()
        staged = self._staged(tensor)
        dist.broadcast(staged, src=dist.get_global_rank(self.group, src) if self.group else src, group=self.group)
        if staged.data_ptr() != tensor.data_ptr():
            tensor.copy_(staged)
        n = tensor.numel() * tensor.element_size()
        self.ledger.record(op, n if self.rank == src else 0, 0 if self.rank == src else n)
        self._timed(start)
        return tensor


def backend_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where ``group``'s collectives take their tensors: the CPU for gloo and MPI, else the
    current accelerator (NCCL)."""
    if dist.get_backend(group) in ("gloo", "mpi"):
        return torch.device("cpu")
    accel = getattr(torch, "accelerator", None)
    if accel is not None and accel.current_accelerator() is not None:
        return torch.device(accel.current_accelerator().type, accel.current_device_index())
    return torch.device("cuda", torch.cuda.current_device())


def build_transport(name: str, *, group: dist.ProcessGroup | None = None, replica_size: int = 1,
                    ledger: ByteLedger | None = None) -> Transport:
    """The transport ``lowcomm.transport`` names, over ``group`` (torch) or the matching MPI
    communicator (mpi: the whole world, or the cross-replica ranks when ``replica_size`` > 1)."""
    if name == "torch":
        return TorchDistTransport(group, ledger)
    if name != "mpi":
        raise ValueError(f"lowcomm.transport must be one of torch, mpi; got {name!r}")
    from ..settings import ConfigError
    from .mpi import MPITransport, started_by_mpirun

    if not started_by_mpirun():
        raise ConfigError("lowcomm.transport is 'mpi' but this process was not started by mpirun: launch with "
                          "`mpirun -np N python launch/train.py ...`, or set lowcomm.transport to \"torch\"")
    transport = MPITransport.cross_replica(replica_size, ledger) if replica_size > 1 else MPITransport(ledger=ledger)
    if dist.is_initialized():  # MPI's ranks must be torch.distributed's, or syncs would pair the wrong peers
        mine = dist.get_rank(group) if group is not None else dist.get_rank()
        size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        if (transport.rank, transport.world_size) != (mine, size):
            raise ConfigError(f"lowcomm.transport is 'mpi' but MPI has rank {transport.rank} of {transport.world_size} "
                              f"where torch.distributed has {mine} of {size}: start one process per rank with "
                              "mpirun and take RANK/WORLD_SIZE from OMPI_COMM_WORLD_RANK/SIZE")
    return transport
