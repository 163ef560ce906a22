"""Collectives over torchft's reconfigurable process group, and a heal transport that loads data only.

Replicas started as independent jobs meet through torchft (``torchft>=0.2.0,<0.3``): its lighthouse
decides who is in each quorum and its ``Manager`` reconfigures a process group over them.
:class:`TorchftTransport` runs ds_lowcomm's collectives over that group: its ``rank`` and
``world_size`` are the current quorum's, read at each collective. A collective that fails (a peer
died or stalled past the group's timeout) is reported to the manager, and every later collective
of the same exchange returns at once: the exchange's result is garbage and is discarded at
``should_commit`` (optim/fault_tolerance.py), on every replica alike.

:func:`heal_transport` is how a joining replica gets a live peer's state (torchft's checkpoint
transport API, its HTTP transport's URLs): the peer serves a copy from a background thread while
it trains and commits on, and the joiner loads it with ``torch.load(weights_only=True)``: tensors
and plain data only, never code. :func:`safe_http_transport` is torchft's own HTTP transport
loading so (torchft's loads with ``weights_only=False``), for torchft's DiLoCo (the benchmarks'
peer), which serves its live state under torchft's lock. torchft's lighthouse and transports are
unauthenticated: run them on a private network.

The torchft internals used (the HTTP transport's loader, replaced; the manager's quorum id, read
to tell a new membership) are declared and checked with the supported version before use
(:data:`INTERNALS`).
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
# torch's streaming format, the one torchft's HTTP transport sends (its own FrameworkInternals: torch's range)
_SERIALIZATION = "torch.distributed._serialization"
STREAMING_SAVE = Internal(_SERIALIZATION, "_streaming_save", "function", params=("obj", "f"),
                          use="writes the heal snapshot as torchft's transport does (heal_transport's server)")
STREAMING_LOAD = Internal(_SERIALIZATION, "_streaming_load", "function", params=("f", "weights_only"),
                          use="reads a peer's heal state with weights_only=True")
TORCH_SERIALIZATION = FrameworkInternals("torch", (STREAMING_SAVE, STREAMING_LOAD), (), {}, "torch.",
                                         user="ds_lowcomm", copies="", label="torch")


def _streaming_save(obj, f) -> None:
    TORCH_SERIALIZATION.live(STREAMING_SAVE)(obj, f)


def _streaming_load(f, weights_only: bool = True):
    return TORCH_SERIALIZATION.live(STREAMING_LOAD)(f, weights_only=weights_only)


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

    @property
    def rank(self) -> int:
        rank = self.manager.participating_rank() if self.manager is not None else None
        return 0 if rank is None else rank

    @property
    def world_size(self) -> int:
        if self.manager is None:
            return 1
        return self.manager.num_participants()

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

    def _all_to_all(self, send, out, send_splits, recv_splits):
        if self.world_size == 1:
            out.copy_(send)
            return lambda: None
        return self._run(lambda: self.pg.alltoall_base(out, send, recv_splits, send_splits, c10d.AllToAllOptions()))

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
    from torchft.checkpointing.http_transport import HTTPTransport

    class SafeHTTPTransport(HTTPTransport):
        def metadata(self) -> str:
            address = super().metadata()
            return address.replace(f"//{socket.gethostname()}:", f"//{host}:", 1) if host else address

        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            import urllib.request

            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    return SafeHTTPTransport(timeout, num_chunks=0)


def _checkpoint_transport_base():
    from torchft.checkpointing.transport import CheckpointTransport

    return CheckpointTransport


class _DualStackServer(ThreadingHTTPServer):
    """Every address of this machine, IPv6 and IPv4 (where IPv6 is there), a thread per request."""

    daemon_threads = True
    address_family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET

    def server_bind(self):
        if self.address_family == socket.AF_INET6:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def heal_transport(timeout: timedelta, host: str | None = None, on_released: Callable[[Any], None] | None = None):
    """How a joining replica gets a live peer's state (torchft's ``CheckpointTransport``, the same
    URLs as its HTTP transport), served from a background thread so that the peer's own steps and
    exchanges go on meanwhile. torchft's HTTP transport serves the live state under a lock that
    the manager takes at every ``should_commit``: a peer's commit waits until a read in flight
    ends, and its next exchange with it. Here what is staged must be a copy of its own (fault
    tolerance stages a CPU copy, never changed after): ``disallow_checkpoint`` (each commit) only
    stops new reads of it; a read in flight goes on from the copy, and ``on_released(state)`` runs
    once nothing serves or reads that copy any more (its memory can go). Loads with
    ``weights_only=True``: tensors and plain data only. ``host``: the address peers fetch from
    (default this machine's hostname)."""
    CheckpointTransport = _checkpoint_transport_base()

    class HealTransport(CheckpointTransport):
        def __init__(self):
            self._timeout = timeout
            self._host = host or socket.gethostname()
            self._cond = threading.Condition()
            self._staged: tuple[int, Any] | None = None  # (step, state) new reads get
            self._readers: dict[int, int] = {}  # id(state) -> reads in flight
            self._retired: dict[int, Any] = {}  # states no longer staged, reads of them in flight
            self.on_released = on_released
            self.events: list[tuple[str, int]] = []  # ("served" | "released", step): what happened, in order
            transport = self

            class Handler(BaseHTTPRequestHandler):
                def log_message(self, *args):  # quiet (torchft logs its own)
                    pass

                def do_GET(self):
                    parts = self.path.split("/")
                    if len(parts) != 4 or parts[1] != "checkpoint" or parts[3] != "full" or not parts[2].isdigit():
                        self.send_error(400, f"expected /checkpoint/<step>/full, got {self.path}")
                        return
                    state = transport._open(int(parts[2]))
                    if state is None:
                        self.send_error(400, f"step {parts[2]} is not served here")
                        return
                    try:
                        self.send_response(200)
                        self.send_header("Content-type", "application/octet-stream")
                        self.end_headers()
                        _streaming_save(state, self.wfile)
                    finally:
                        transport._close(int(parts[2]), state)

            self._server = _DualStackServer(("", 0), Handler)
            self._thread = threading.Thread(target=self._server.serve_forever, daemon=True, name="ds_lowcomm_heal")
            self._thread.start()

        def metadata(self) -> str:
            return f"http://{self._host}:{self._server.server_address[1]}/checkpoint/"

        def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
            with self._cond:
                self._retire()
                self._staged = (step, state_dict)
                self._cond.notify_all()

        def disallow_checkpoint(self) -> None:
            with self._cond:
                self._retire()

        def _retire(self) -> None:  # (under the lock) no new reads of what is staged
            if self._staged is not None:
                step, state = self._staged
                self._staged = None
                if self._readers.get(id(state)):
                    self._retired[id(state)] = (step, state)
                else:
                    self._release(step, state)

        def _release(self, step: int, state: Any) -> None:
            self.events.append(("released", step))
            if self.on_released is not None:
                self.on_released(state)

        def reading(self) -> bool:
            """Whether a read is in flight."""
            with self._cond:
                return bool(self._readers)

        def _open(self, step: int) -> Any:
            """The state of ``step`` for a read (counted), waiting up to the timeout while nothing is staged."""
            with self._cond:
                self._cond.wait_for(lambda: self._staged is not None, timeout=self._timeout.total_seconds())
                if self._staged is None or self._staged[0] != step:
                    return None
                state = self._staged[1]
                self._readers[id(state)] = self._readers.get(id(state), 0) + 1
                return state

        def _close(self, step: int, state: Any) -> None:
            with self._cond:
                self.events.append(("served", step))
                self._readers[id(state)] -= 1
                if not self._readers[id(state)]:
                    del self._readers[id(state)]
                    retired = self._retired.pop(id(state), None)
                    if retired is not None:
                        self._release(*retired)

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
            import urllib.request

            with urllib.request.urlopen(f"{metadata}{step}/full", timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

        def shutdown(self, wait: bool = True) -> None:
            self._server.shutdown() if wait else setattr(self._server, "_BaseServer__shutdown_request", True)
            if wait:
                self._server.server_close()
                self._thread.join()

    return HealTransport()


__all__ = ["INTERNALS", "TorchftTransport", "heal_transport", "safe_http_transport"]
