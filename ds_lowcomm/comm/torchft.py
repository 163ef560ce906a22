"""Collectives over torchft's reconfigurable process group, and a heal transport that loads data only.

Replicas started as independent jobs meet through torchft (``torchft>=0.2.0,<0.3``): its lighthouse
decides who is in each quorum and its ``Manager`` reconfigures a process group over them.
:class:`TorchftTransport` runs ds_lowcomm's collectives over that group: its ``rank`` and
``world_size`` are the current quorum's, read at each collective. A collective that fails (a peer
died or stalled past the group's timeout) is reported to the manager, and every later collective
of the same exchange returns at once: the exchange's result is garbage and is discarded at
``should_commit`` (optim/fault_tolerance.py), on every replica alike.

:class:`SafeHTTPTransport` is torchft's HTTP checkpoint transport (how a joining replica gets a
live peer's state) loading with ``torch.load(weights_only=True)``: tensors and plain data only,
never code (torchft's own loads with ``weights_only=False``). torchft's lighthouse and transports
are unauthenticated: run them on a private network.

The torchft internals used (the HTTP transport's loader, replaced; the manager's quorum id, read
to tell a new membership) are declared and checked with the supported version before use
(:data:`INTERNALS`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed.distributed_c10d as c10d

from ..reflect import FrameworkInternals, Internal, read_instance
from .ledger import ByteLedger
from .transport import Transport

DISTRIBUTION = "torchft"
_HTTP = "torchft.checkpointing.http_transport"
LOAD_FROM_ADDRESS = Internal(_HTTP, "HTTPTransport._load_from_address", "method", params=("address", "timeout"),
                             match="override", use="loads a peer's state with weights_only=True (SafeHTTPTransport)")
QUORUM_ID = Internal("torchft.manager", "Manager._quorum_id", "instance",
                     use="tells a quorum of new members, whose parameters are compared (optim/fault_tolerance.py)")
INTERNALS = FrameworkInternals(DISTRIBUTION, (LOAD_FROM_ADDRESS, QUORUM_ID), (), {}, "torchft", user="ds_lowcomm",
                               copies="", label="torchft")


def quorum_id(manager) -> int:
    """The id of ``manager``'s current quorum: the lighthouse bumps it when the members change."""
    return int(read_instance(DISTRIBUTION, QUORUM_ID, manager))


class TorchftTransport(Transport):
    """ds_lowcomm's collectives over torchft's process group ``pg`` (configured by ``manager`` at
    each quorum: gloo here). ``failed``: the first error of the current exchange (None when
    healthy); :meth:`reset` before each exchange."""

    checks_at_start = False  # no group exists before the first quorum: the manager heals instead

    def __init__(self, pg, manager=None, ledger: ByteLedger | None = None, timeout_s: float | None = None):
        self.pg = pg
        self.manager = manager  # set once the manager is built around pg
        self.ledger = ledger if ledger is not None else ByteLedger()
        self.device = torch.device("cpu")
        self.timeout_s = timeout_s
        self.failed: Exception | None = None
        # This replica sits the current exchange out (it has just healed): it sends nothing of its
        # own and takes the others' mean (comm/collectives.py's flag).
        self.sits_out = False

    # Asynchronous quorum: a replica healing in a quorum is in its group but not participating; the
    # collectives run over the whole group (it sits them out), not torchft's participants.
    whole_group = False

    @property
    def rank(self) -> int:
        if self.whole_group and self.manager is not None and self.manager.num_participants():
            return self.pg.parent.rank()
        rank = self.manager.participating_rank() if self.manager is not None else None
        return 0 if rank is None else rank

    @property
    def world_size(self) -> int:
        if self.manager is None:
            return 1
        n = self.manager.num_participants()
        return self.pg.size() if self.whole_group and n else n

    def reset(self) -> None:
        self.failed = None

    def describe_peers(self) -> str:
        return f"the {self.world_size} replicas of the current torchft quorum"

    def _run(self, issue: Callable[[], Any]) -> Callable[[], object]:
        if self.world_size == 1:
            return lambda: None
        if self.failed is not None or (self.manager is not None and self.manager.errored() is not None):
            # This replica already failed in this round (a collective, or its heal): it sends
            # nothing, so the others' collective fails too and every replica discards the sync
            # (a replica whose heal failed must not contribute its stale state). Nothing arrives
            # either: ``failed`` says so to whoever would read the buffers.
            self.failed = self.failed or self.manager.errored()
            return lambda: None
        try:
            work = issue()
        except Exception as err:  # noqa: BLE001  (a reconfigured or aborted group raises at issue)
            self._fail(err)
            return lambda: None
        return work.wait

    def _fail(self, err: Exception) -> None:
        if self.failed is None:
            self.failed = err
            if self.manager is not None:
                self.manager.report_error(err)

    def _landed(self, wait: Callable[[], object], op: str) -> None:
        try:
            wait()
        except Exception as err:  # noqa: BLE001  (a dead or stalled peer: this exchange is discarded)
            self._fail(err)

    def _all_gather(self, send, out):
        if self.world_size == 1:
            out[0].copy_(send)
            return lambda: None
        return self._run(lambda: self.pg.allgather([list(out.unbind(0))], [send], c10d.AllgatherOptions()))

    def _all_reduce_sum(self, buf):
        opts = c10d.AllreduceOptions()
        opts.reduceOp = c10d.ReduceOp.SUM
        return self._run(lambda: self.pg.allreduce([buf], opts))

    def _broadcast(self, buf, src):
        opts = c10d.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self._run(lambda: self.pg.broadcast([buf], opts))()


def safe_http_transport(timeout: timedelta, host: str | None = None):
    """torchft's HTTP checkpoint transport, whole state in one piece, loading tensors and plain
    data only (``weights_only=True``; anything else is refused and the heal fails). ``host``: the
    address peers fetch from (torchft advertises this machine's hostname, which may resolve to a
    loopback address the peers cannot reach)."""
    INTERNALS.ensure_checked()
    import socket

    from torchft.checkpointing.http_transport import HTTPTransport

    class SafeHTTPTransport(HTTPTransport):
        def metadata(self) -> str:
            address = super().metadata()
            return address.replace(f"//{socket.gethostname()}:", f"//{host}:", 1) if host else address

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            import urllib.request

            from torch.distributed._serialization import _streaming_load  # the format torchft sends

            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    return SafeHTTPTransport(timeout, num_chunks=0)


__all__ = ["INTERNALS", "TorchftTransport", "safe_http_transport"]
