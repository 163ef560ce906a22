"""Live fault tolerance for the outer-loop methods: replicas as independent jobs that die and
rejoin while the others keep training, on torchft (``torchft>=0.2.0,<0.3``, the ``ft`` extra).

Each replica is its own job and each of its processes builds one :class:`FaultTolerance`: a
torchft ``Manager`` (with the lighthouse's address and this replica's id; a replica of several
ranks runs one per rank, rank r meeting rank r of the others) over a reconfigurable gloo group,
and the :class:`~ds_lowcomm.comm.torchft.TorchftTransport` the method exchanges over.
Then :meth:`FaultTolerance.attach` puts it into an outer method (diloco, dct_diloco, sparseloco),
demo or adamw:

- **Every sync is a quorum's.** Outer methods and mtdao: at the start of each interval (before
  the first step, then right after each sync lands) the replicas that are alive form a quorum;
  the interval's exchange runs over them and the mean is over them. demo and adamw: the same at
  every step.
- **Every sync is committed or discarded on all replicas alike** (torchft's ``should_commit``): a
  peer that dies or stalls past ``timeout_s`` during the exchange makes it fail, and every
  participant then restores what the exchange changed (error-feedback residuals, DeMo's momenta)
  and, outer methods, sets its parameters back to the anchors (the interval's local progress is
  lost); demo and adamw skip the step; mtdao's replicas keep their own parameters and moments, as
  before the sync. Never a partial sync applied.
- **Healing from a peer.** A new or restarted replica joins at the next quorum and gets the full
  state (parameters, anchors, outer momentum, residuals, the inner optimizer's state, step and sync
  counters: the optimizer's ``state_dict()``) from a live peer through torchft's HTTP checkpoint
  transport, loaded with ``weights_only=True`` (:func:`~ds_lowcomm.comm.torchft.safe_http_transport`).
  It is taken right after a sync, when every replica's parameters equal the anchors, so the
  healed replica is identical to the others. Its bytes go to the ledger as ``heal``.
- **Data.** :attr:`FaultTolerance.step` (the replica's steps, restored by the heal) is the
  position in the replica's own data shard: shard by replica id, not by how many are alive.

- **Starting alike.** While no sync has been committed (torchft's step 0), every quorum's
  replicas take the weights of its first (a broadcast): replicas seeded apart start alike.

Streaming DiLoCo's fragments each take a quorum at their own sync. Not yet (:func:`check_method`
refuses them by name before any work): demo with overlap, a sync_delay > 0 (an exchange in flight
across a quorum change), the MPI transport. The reference task's
training loop reads ``lowcomm.fault_tolerance`` (task/steps.py), and so does the DeepSpeed glue
(each replica its own DeepSpeed job: deepspeed/fault_tolerance.py). torchft's lighthouse and
transport are unauthenticated: a private network only.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

import torch

from ..comm.consistency import gather_json, settings_differences
from ..comm.torchft import TorchftTransport, safe_http_transport
from ..settings import ConfigError, Settings, check_int, check_positive


WHERE = "lowcomm.fault_tolerance"


@dataclass
class FaultToleranceSettings(Settings):
    """``lowcomm.fault_tolerance``: where the lighthouse is, who this replica is. Environment
    variables as torchft's own fill what the section leaves out: ``TORCHFT_LIGHTHOUSE``,
    ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS``."""

    lighthouse: str = ""  # host:port (or http://host:port) of torchft's lighthouse
    replica_id: str = ""  # unique and stable across restarts of this replica
    # How many data shards the replicas split the data into (the replicas started, not the ones
    # alive): with the training loop's data, replica_id is an integer below it and names its shard.
    num_replica_groups: int = 0
    min_replicas: int = 1  # a quorum needs at least this many replicas; fewer: syncs are discarded
    timeout_s: float = 30.0  # a collective's or a heal's wait for a peer
    quorum_timeout_s: float = 600.0  # a quorum's wait (a restarted replica waits up to one interval)
    host: str = ""  # the address the other replicas reach this one at (default: this machine's hostname)

    def check(self, where: str) -> None:
        if not self.lighthouse or not isinstance(self.lighthouse, str):
            raise ConfigError(f"{where}.lighthouse: the lighthouse's host:port is required "
                              "(or TORCHFT_LIGHTHOUSE in the environment)")
        if not self.replica_id or not isinstance(self.replica_id, str):
            raise ConfigError(f"{where}.replica_id: a replica id unique to this replica, stable across its "
                              "restarts, is required (or REPLICA_GROUP_ID in the environment)")
        check_int(where, "num_replica_groups", self.num_replica_groups, 0)
        check_int(where, "min_replicas", self.min_replicas, 1)
        for name in ("timeout_s", "quorum_timeout_s"):
            check_positive(where, name, getattr(self, name))
        if not isinstance(self.host, str):
            raise ConfigError(f"{where}.host must be a host name or address; got {self.host!r}")

    @classmethod
    def from_section(cls, raw: Mapping[str, Any] | None = None, where: str = WHERE) -> "FaultToleranceSettings":
        """From the nested ``"fault_tolerance"`` mapping (unknown keys refused by name), torchft's
        environment variables filling what it leaves out. Validated."""
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where} must be a mapping of {', '.join(cls.flat_keys())}; got {raw!r}")
        given = dict(raw)
        given.setdefault("lighthouse", os.environ.get("TORCHFT_LIGHTHOUSE", ""))
        given.setdefault("replica_id", os.environ.get("REPLICA_GROUP_ID", ""))
        if "NUM_REPLICA_GROUPS" in os.environ and "num_replica_groups" not in given:
            try:
                given["num_replica_groups"] = int(os.environ["NUM_REPLICA_GROUPS"])
            except ValueError:
                raise ConfigError(f"NUM_REPLICA_GROUPS must be an integer; got {os.environ['NUM_REPLICA_GROUPS']!r}")
        if isinstance(given["replica_id"], int) and not isinstance(given["replica_id"], bool):
            given["replica_id"] = str(given["replica_id"])
        return cls.from_flat(given, where=where, strict=True)

    def data_shard(self, where: str = WHERE) -> tuple[int, int]:
        """(this replica's shard, the number of shards) for a loader that shards by replica."""
        if self.num_replica_groups < 1 or not self.replica_id.isdigit() \
                or int(self.replica_id) >= self.num_replica_groups:
            raise ConfigError(f"{where}: the training loop reads replica_id's data shard: num_replica_groups must be "
                              f">= 1 (or NUM_REPLICA_GROUPS) and replica_id an integer below it; got replica_id "
                              f"{self.replica_id!r}, num_replica_groups {self.num_replica_groups}")
        return int(self.replica_id), self.num_replica_groups


SUPPORTED_METHODS = ("diloco", "dct_diloco", "sparseloco", "demo", "adamw", "mtdao")


def check_method(effective: Mapping[str, Any], where: str = "lowcomm") -> None:
    """Refuse, by name and before any work, a method setting live fault tolerance does not support
    yet (``effective``: the lowcomm section's effective settings)."""
    method = effective.get("method")
    if method not in SUPPORTED_METHODS:
        raise ConfigError(f"{where}.method must be one of {', '.join(SUPPORTED_METHODS)} with {where}.fault_tolerance; "
                          f"got {method!r}")
    if effective.get("sync_delay", 0) != 0:
        raise ConfigError(f"{where}.sync_delay must be 0 with {where}.fault_tolerance (a fragment's exchange in flight "
                          f"across a quorum change is not supported yet; fragments > 1 are); got "
                          f"{effective.get('sync_delay')}")
    if effective.get("overlap"):
        raise ConfigError(f"{where}.overlap must be false with {where}.fault_tolerance (an exchange in flight across a "
                          "quorum change is not supported yet)")
    if method == "mtdao" and effective.get("switch_step", 0):
        raise ConfigError(f"{where}.switch_step must be 0 with {where}.fault_tolerance (mtdao's warm start, a gradient "
                          f"all-reduce every step, does not run in torchft's quorums yet); got {effective['switch_step']}")
    if effective.get("transport", "torch") != "torch":
        raise ConfigError(f"{where}.transport must be torch with {where}.fault_tolerance (the exchange runs over "
                          f"torchft's process group); got {effective.get('transport')!r}")


def _cloned(obj: Any) -> Any:
    """A copy of a state dict whose tensors the training loop will not change under a peer's read."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cloned(v) for v in obj)
    return obj


class FaultTolerance:
    """One replica's membership in the torchft quorum and the transport its method uses."""

    def __init__(self, settings: FaultToleranceSettings, host: str | None = None, rank: int = 0, world_size: int = 1,
                 store: tuple[str, int] | None = None, store_server: Any = None):
        """``rank``/``world_size``: this process within its replica (a replica of several ranks runs
        one manager per rank: rank r meets rank r of every other replica, and heals from it);
        ``store``: the replica's TCPStore (host, port), which rank 0 of a replica of several ranks
        serves (:func:`replica_store`), and ``store_server`` that store on rank 0 (kept alive here:
        every quorum's process group meets in it); None: one of its own (a one-rank replica)."""
        settings.validate(WHERE)
        from ..comm.torchft import INTERNALS

        INTERNALS.ensure_checked()  # torchft in the supported range, its internal as declared
        from torchft import Manager, ProcessGroupGloo

        self.settings = settings
        host = host or settings.host or socket.gethostname()
        timeout = timedelta(seconds=settings.timeout_s)
        pg = ProcessGroupGloo(timeout=timeout)
        self.transport = TorchftTransport(pg, timeout_s=settings.timeout_s)
        self._store = store_server
        if store is None:
            self._store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            store = (host, self._store.port)
        self.optimizer, self.stateful, self.after_step = None, (), ()
        self._mid_step = False  # whether the quorum being taken is inside an optimizer step
        lighthouse = settings.lighthouse if "://" in settings.lighthouse else f"http://{settings.lighthouse}"
        self.manager = Manager(
            pg=pg, min_replica_size=settings.min_replicas, use_async_quorum=False,
            load_state_dict=self._load, state_dict=self._state, replica_id=settings.replica_id,
            store_addr=store[0], store_port=store[1], rank=rank, world_size=world_size, lighthouse_addr=lighthouse,
            hostname=host, timeout=timeout, quorum_timeout=timedelta(seconds=settings.quorum_timeout_s),
            connect_timeout=timeout, checkpoint_transport=safe_http_transport(timeout, host),
            # not torchft's init_sync: it picks the source replica per rank, and a replica's ranks
            # would start from different replicas' weights; start_interval broadcasts one's instead
            init_sync=False)
        self.transport.manager = self.manager
        self.heals = 0
        self.discarded = 0

    # -- the method ----------------------------------------------------------------------------
    def attach(self, optimizer, *stateful, after_step=(), settings: Mapping[str, Any] | None = None) -> None:
        """Put this replica's quorum into ``optimizer`` (an outer method, demo or adamw, built with
        ``transport=self.transport``) and take the first quorum (a joining replica heals here).
        ``stateful``: more objects with ``state_dict()``/``load_state_dict()`` a joining replica
        gets from its peer (a learning-rate scheduler: its position; plain data only).
        ``after_step``: what the training loop runs after each optimizer step (the scheduler's
        ``step``). A peer serves its state from inside its optimizer step, before those ran; a
        replica healed here, outside a step, runs them once, so that it stands where its peer will.
        ``settings``: what every replica must agree on (flat keys naming the fields; default: the
        method's settings), compared across the replicas that start together and with the peer a
        replica heals from: a difference is an error naming the field, never a silent mix."""
        check_method(optimizer._record)  # the same rules the config's check applied, on what was built
        if optimizer.transport is not self.transport:
            raise ConfigError("build the optimizer with transport=fault_tolerance.transport")
        self.optimizer, self.stateful, self.after_step = optimizer, stateful, tuple(after_step)
        self.agreed = json.loads(json.dumps(dict(settings) if settings is not None else
                                            {f"lowcomm.{k}": v for k, v in optimizer._record.items()}))
        optimizer.fault_tolerance = self
        self._steps = 0
        self.start_interval(stepped=False)

    @property
    def step(self) -> int:
        """This replica's steps (restored by a heal): where it is in its own data shard."""
        from .mtdao import MTDAO
        from .outer import OuterLoop

        opt = self.optimizer
        key = "local_step" if isinstance(opt, OuterLoop) else "step" if isinstance(opt, MTDAO) else None
        if key is not None:  # its own counter (a quorum is taken once per sync, not per step)
            params = opt._current_params()
            return int(opt.state[params[0]].get(key, 0)) if params else 0
        return self._steps

    # -- called by the method --------------------------------------------------------------------
    def start_interval(self, stepped: bool = True) -> None:
        """After each step (outer methods: after each sync) and at attach (``stepped`` False): a
        quorum of the replicas alive now; a replica that is behind heals from a peer here."""
        self._steps += stepped
        self.transport.reset()
        self._mid_step = stepped
        try:
            self.manager.start_quorum(allow_heal=True)
        finally:
            self._mid_step = False
        if self.manager.current_step() == 0 and self.transport.world_size > 1:
            self._start_alike()

    def _start_alike(self) -> None:
        """No sync committed yet (every participant is at torchft's step 0, or it would have healed:
        so all of them are here): every replica takes the weights of the quorum's first, as
        DeepSpeed's ranks take rank 0's (replicas seeded apart start alike). A failed broadcast is
        this round's error: the next sync is discarded where it failed, and a replica left behind
        heals at the next quorum."""
        # the replicas that start together agree on their settings (else every one of them raises)
        everyone = gather_json(self.transport, self.agreed)
        if self.transport.failed is None:  # a failed gather: this round is discarded, no verdict
            for replica, theirs in enumerate(everyone[1:], start=1):
                if theirs != everyone[0]:  # every replica the same verdict
                    raise ConfigError("lowcomm.fault_tolerance: the replicas' settings differ ("
                                      + settings_differences(everyone[0], theirs, "the quorum's replica 0 has",
                                                             f"its replica {replica} has") + ")")
        tensors = [*self.optimizer._current_params(),
                   *(t for obj in self.stateful for t in getattr(obj, "tensors", ()))]
        with torch.no_grad():
            for t in tensors:
                self.transport.broadcast_(t.data, src=0, op="start_alike")

    def before_exchange(self) -> None:
        self.transport.reset()

    def commit(self) -> bool:
        """Whether this sync lands (on every replica alike); False: it is discarded."""
        ok = self.manager.should_commit()
        self.discarded += not ok
        return ok

    # -- the state a joining replica gets --------------------------------------------------------
    def _state(self) -> dict:
        opt = self.optimizer
        params = opt._current_params()
        anchors = [opt.state[p].get("anchor") for p in params]
        if all(a is not None and torch.equal(p, a.to(p.dtype)) for p, a in zip(params, anchors)):
            params = None  # an outer method's quorum follows a sync: the parameters are the anchors, sent once
        return _cloned({"optimizer": opt.state_dict(), "params": params,
                        "steps": self._steps, "stateful": [obj.state_dict() for obj in self.stateful],
                        "mid_step": self._mid_step, "settings": self.agreed})

    def _load(self, state: dict) -> None:
        if state["settings"] != self.agreed:  # before anything of the peer's is taken
            raise ConfigError("lowcomm.fault_tolerance: this replica's settings differ from the peer it heals from ("
                              + settings_differences(state["settings"], self.agreed, "the peer has", "this replica has")
                              + ")")
        opt = self.optimizer
        nbytes = tensor_bytes(state)
        ledger = opt.ledger.state_dict()  # this replica's own record, not the peer's
        opt.load_state_dict(state["optimizer"])
        opt.ledger.load_state_dict(ledger)
        opt.ledger.record("heal", 0, nbytes)
        with torch.no_grad():
            params = opt._current_params()
            saved = state["params"] or [opt.state[p]["anchor"] for p in params]
            for p, value in zip(params, saved):
                p.copy_(value.to(p.dtype))
        for obj, saved in zip(self.stateful, state["stateful"]):
            obj.load_state_dict(saved)
        self._steps = int(state["steps"])
        if state["mid_step"] and not self._mid_step:  # the rest of the peer's step, which it runs after this
            for finish in self.after_step:
                finish()
        self.heals += 1
        print(f"ds_lowcomm fault tolerance: replica {self.settings.replica_id} healed from a peer at step "
              f"{self.step}: {nbytes} bytes at {time.time():.3f}", file=sys.stderr, flush=True)

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def replica_store(host: str, transport) -> tuple[Any, tuple[str, int]]:
    """For a replica of several ranks: rank 0 serves the TCPStore its ranks' torchft managers meet
    in, and every rank learns its address (collective over ``transport``, the replica's own group).
    Returns (the store rank 0 must keep alive, or None; (host, port))."""
    store = None
    if transport.rank == 0:
        store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
    host, port = gather_json(transport, [host, store.port] if store is not None else None)[0]  # rank 0's
    return store, (host, port)


def tensor_bytes(obj: Any) -> int:
    """The bytes of every tensor in a nested state (dicts, lists, tuples): a heal's size."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


__all__ = ["FaultTolerance", "FaultToleranceSettings", "SUPPORTED_METHODS", "check_method", "replica_store", "tensor_bytes"]
