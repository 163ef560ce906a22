"""Transports: the few collectives the methods need, each recording its bytes in the ledger.

Only byte buffers and float tensors cross a transport; what they mean is decided above it.
:class:`Transport` does what every backend shares (staging, timing, the ledger, copying results
back); a backend says where its buffers live and issues the raw collectives.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .ledger import ByteLedger


class Pending:
    """A collective in flight. ``wait()`` blocks until it has landed and returns its result (the
    same object on every later call). Only the time spent issuing and waiting is booked as
    "comm" time: a collective that lands while the caller computes costs the step nothing.
    With ``ledger=None`` nothing is timed here (for wrappers whose parts time themselves).

    A collective of several phases (the compressed all-reduce) gives ``advance``: what starts its
    next phase once the first has landed. ``advance()`` runs it early (every rank at the same
    point: it issues a collective), so that the next phase too is in flight while the caller
    computes; ``wait()`` runs it where no one did."""

    def __init__(self, finish, ledger: ByteLedger | None, advance=None):
        self._finish = finish
        self._advance = advance
        self._ledger = ledger
        self._done = False
        self._result = None

    def advance(self) -> None:
        if self._advance is not None and not self._done:
            self._advance()
        self._advance = None

    def wait(self):
        if not self._done:
            start = time.perf_counter()
            self._result = self._finish()
            if self._ledger is not None:
                self._ledger.add_time("comm", time.perf_counter() - start)
            self._done, self._finish, self._advance = True, None, None
        return self._result


class Transport:
    """Interface: rank, world_size, ledger, device, and three collectives.

    The ``start_*`` forms are non-blocking (issue, record the bytes, return a :class:`Pending`);
    the blocking forms are ``start_*(...).wait()``. Collectives must be started in the same order
    on every rank. A backend implements ``_all_gather``, ``_all_reduce_sum`` and ``_broadcast``
    on buffers staged by ``_home`` (and ``_stage_for_sum``); the rest happens here. A transport
    may instead override the public forms it needs (a test double, say).
    """

    rank: int
    world_size: int
    ledger: ByteLedger
    # The first error of the current exchange where a transport lets one fail without raising
    # (torchft's: the exchange is discarded on every replica): its buffers hold no data to decode.
    failed: Exception | None = None
    device: torch.device  # where this transport's buffers must live
    nonfinite: str = "skip"  # a rank with NaN/inf to send: "skip" it in that exchange, or "raise" (collectives.py)
    # While True this rank sits the exchanges out: it sends nothing of its own (zeros, flagged so)
    # and takes the others' mean (collectives.py). Set by whoever drives the replica: fault
    # tolerance for a replica that has just healed, a caller that leaves a replica out on purpose.
    sits_out: bool = False
    # lowcomm.timeout_s: seconds a collective may wait for a peer; None: the backend's own limit
    timeout_s: float | None = None

    # -- what a backend provides --------------------------------------------------------------
    def _home(self, t: torch.Tensor) -> torch.device:
        """The device the backend reads ``t`` from."""
        return self.device

    def _stage_for_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The buffer an all-reduce of ``t`` sums (its bytes are what the ledger records)."""
        return self._stage(t)

    def _all_gather(self, send: torch.Tensor, out: torch.Tensor) -> Callable[[], object]:
        """Start gathering every rank's ``send`` into the rows of ``out``; return what waits for it."""
        raise NotImplementedError

    def _all_reduce_sum(self, buf: torch.Tensor) -> Callable[[], object]:
        """Start summing ``buf`` over ranks in place; return what waits for it."""
        raise NotImplementedError

    def _broadcast(self, buf: torch.Tensor, src: int) -> None:
        raise NotImplementedError

    def _all_to_all(self, send: torch.Tensor, out: torch.Tensor, send_splits: list[int],
                    recv_splits: list[int]) -> Callable[[], object]:
        """Start sending ``send``'s consecutive parts (``send_splits`` elements, one per rank) to
        each rank, receiving each rank's part for this one into ``out`` (``recv_splits``)."""
        raise NotImplementedError(f"{type(self).__name__} has no all-to-all")

    # -- the collectives ----------------------------------------------------------------------
    def start_all_gather_bytes(self, payload: torch.Tensor, op: str = "all_gather") -> Pending:
        """Flat uint8 payload of equal length on every rank -> Pending of (world_size, length) uint8."""
        start = time.perf_counter()
        send = self._stage(payload)
        out = torch.empty(self.world_size, send.numel(), dtype=torch.uint8, device=send.device)
        landed = self._all_gather(send, out)
        self._book(op, send.numel(), (self.world_size - 1) * send.numel(), start)

        def finish():
            self._landed(landed, op)
            return out if out.device == payload.device else out.to(payload.device)

        return Pending(finish, self.ledger)

    def start_all_reduce_sum_(self, tensor: torch.Tensor, op: str = "all_reduce") -> Pending:
        """Sum ``tensor`` over ranks in place -> Pending of ``tensor``. Do not touch ``tensor``
        before ``wait()``."""
        start = time.perf_counter()
        buf = self._stage_for_sum(tensor)
        landed = self._all_reduce_sum(buf)
        n = buf.numel() * buf.element_size()
        self._book(op, n, n, start)

        def finish():
            self._landed(landed, op)
            return _copy_back(buf, tensor)

        return Pending(finish, self.ledger)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0, op: str = "broadcast") -> torch.Tensor:
        start = time.perf_counter()
        buf = self._stage(tensor)
        self._landed(lambda: self._broadcast(buf, src), op)
        _copy_back(buf, tensor)
        n = tensor.numel() * tensor.element_size()
        self._book(op, n if self.rank == src else 0, 0 if self.rank == src else n, start)
        return tensor

    def start_all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                         op: str = "all_to_all") -> Pending:
        """Flat ``send`` cut into ``send_splits`` (elements per rank, in rank order) -> Pending of
        a flat tensor of ``recv_splits`` (what each rank sent this one). A rank's part for itself
        is moved but not counted: the ledger books what crosses to other ranks."""
        start = time.perf_counter()
        buf = self._stage(send)
        out = torch.empty(sum(recv_splits), dtype=buf.dtype, device=buf.device)
        landed = self._all_to_all(buf, out, list(send_splits), list(recv_splits))
        size = buf.element_size()
        self._book(op, (sum(send_splits) - send_splits[self.rank]) * size,
                   (sum(recv_splits) - recv_splits[self.rank]) * size, start)

        def finish():
            self._landed(landed, op)
            return out if out.device == send.device else out.to(send.device)

        return Pending(finish, self.ledger)

    def all_gather_bytes(self, payload: torch.Tensor, op: str = "all_gather") -> torch.Tensor:
        return self.start_all_gather_bytes(payload, op).wait()

    def all_reduce_sum_(self, tensor: torch.Tensor, op: str = "all_reduce") -> torch.Tensor:
        return self.start_all_reduce_sum_(tensor, op).wait()

    # -- shared steps -------------------------------------------------------------------------
    def _landed(self, wait: Callable[[], object], op: str) -> None:
        """Wait for a collective; a backend's failure (a peer's timeout, a lost peer) is re-raised
        naming the operation and the group's ranks, on every rank that was waiting."""
        try:
            wait()
        except RuntimeError as err:
            bound = "" if self.timeout_s is None else f" = {self.timeout_s:g}"
            raise CollectiveError(f"{op}: collective over ranks {self.describe_peers()} failed on rank "
                                  f"{self.rank} of {self.world_size} ({type(err).__name__}: {err}); a peer "
                                  f"stalled or died (lowcomm.timeout_s{bound} bounds the wait)") from err

    def describe_peers(self) -> str:
        return f"0..{self.world_size - 1} of this group"

    def peer_ranks(self) -> list[int]:
        """Each rank of this transport's global rank (for messages and the ledger)."""
        return list(range(self.world_size))

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` contiguous where the backend reads it: itself, or a copy there."""
        t = t.contiguous()
        home = self._home(t)
        return t if t.device == home else t.to(home)

    def _book(self, op: str, sent: int, received: int, start: float) -> None:
        """Record the bytes and the time spent issuing (the wait is timed by :class:`Pending`)."""
        self.ledger.record(op, sent, received)
        self.ledger.add_time("comm", time.perf_counter() - start)


def _copy_back(buf: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    if buf.data_ptr() != tensor.data_ptr():
        tensor.copy_(buf)
    return tensor


class CollectiveError(RuntimeError):
    """A collective did not complete: a peer timed out or went away."""


class TorchDistTransport(Transport):
    """torch.distributed over a process group (gloo on CPU, NCCL on GPUs). Tensors elsewhere are
    staged on the backend's device: GPU parameters over gloo (a cross-datacenter gloo group, say),
    CPU-offloaded masters over NCCL.

    ``timeout_s`` bounds each collective's wait for a peer on any group, the user's default group
    included (whose own timeout, torch's 30 minutes by default, stays the user's): every operation
    is issued with that timeout in its options, which gloo applies to that operation alone and
    then aborts it (its worker thread is free again, so the process can exit); on other backends
    (NCCL), whose operations do not read it, ``wait`` is given the timeout as well (torch: it then
    blocks until the work completes or raises). None: the group's own timeout."""

    def __init__(self, group: dist.ProcessGroup | None = None, ledger: ByteLedger | None = None,
                 timeout_s: float | None = None):
        if not dist.is_initialized():
            raise RuntimeError("TorchDistTransport needs torch.distributed.init_process_group() first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.ledger = ledger if ledger is not None else ByteLedger()
        self.device = backend_device(group)
        self.timeout_s = timeout_s
        self._handed: tuple[torch.Tensor, ...] = ()  # the last operation's tensors (see _waiter)

    def describe_peers(self) -> str:
        return "[" + ", ".join(map(str, self.peer_ranks())) + "] (global)"

    def peer_ranks(self) -> list[int]:
        if self.group is None:
            return list(range(dist.get_world_size()))
        return list(dist.get_process_group_ranks(self.group))

    # The operations go to the process group object itself (as torch.distributed's own functions
    # do), with options: its functions have no timeout argument.
    def _options(self, opts):
        if self.timeout_s is not None:
            opts.timeout = timedelta(seconds=self.timeout_s)
        return opts

    def _waiter(self, work, *handed: torch.Tensor) -> Callable[[], object]:
        # The tensors handed to the backend stay referenced here until the next operation: a gloo
        # worker thread ends its bookkeeping of an operation after wait() has returned, and a
        # tensor whose last reference it drops there while the interpreter shuts down aborts the
        # process ("terminate called without an active exception", pytorch/pytorch#190489).
        self._handed = handed
        if self.timeout_s is None or self.device.type == "cpu":  # gloo (or none asked): the operation's own
            return work.wait
        timeout = timedelta(seconds=self.timeout_s)
        return lambda: work.wait(timeout)

    @property
    def _pg(self) -> dist.ProcessGroup:
        return self.group if self.group is not None else dist.group.WORLD

    def _all_gather(self, send, out):
        flat = out.view(-1)
        return self._waiter(self._pg._allgather_base(flat, send, self._options(c10d.AllgatherOptions())), flat, send, out)

    def _all_reduce_sum(self, buf):
        opts = self._options(c10d.AllreduceOptions())
        opts.reduceOp = dist.ReduceOp.SUM
        return self._waiter(self._pg.allreduce([buf], opts), buf)

    def _all_to_all(self, send, out, send_splits, recv_splits):
        opts = self._options(c10d.AllToAllOptions())
        return self._waiter(self._pg.alltoall_base(out, send, recv_splits, send_splits, opts), out, send)

    def _broadcast(self, buf, src):
        opts = self._options(c10d.BroadcastOptions())
        opts.rootRank, opts.rootTensor = src, 0  # src: a rank of this group
        self._waiter(self._pg.broadcast([buf], opts), buf)()


def backend_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where ``group``'s collectives take their tensors: the CPU for gloo and MPI, else the
    current accelerator (NCCL)."""
    if dist.get_backend(group) in ("gloo", "mpi"):
        return torch.device("cpu")
    accel = getattr(torch, "accelerator", None)
    if accel is not None and accel.current_accelerator() is not None:
        return torch.device(accel.current_accelerator().type, accel.current_device_index())
    return torch.device("cuda", torch.cuda.current_device())
