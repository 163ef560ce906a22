"""Live fault tolerance for the outer-loop methods: replicas as independent jobs that die and
rejoin while the others keep training, on torchft (``torchft>=0.2.0,<0.3``, the ``ft`` extra).

Each replica is its own job and each of its processes builds one :class:`FaultTolerance`: a
torchft ``Manager`` (with the lighthouse's address and this replica's id; a replica of several
ranks runs one per rank, rank r meeting rank r of the others) over a reconfigurable gloo group,
and the :class:`~ds_lowcomm.comm.torchft.TorchftTransport` the method exchanges over.
Then :meth:`FaultTolerance.attach` drives a method (diloco, dct_diloco, sparseloco and their
streaming variants, demo with any update rule, adamw, mtdao, dion) from outside, through the
methods' exchange protocol (optim/base.py; no method knows of fault tolerance): the method runs
each sync through the driver's :meth:`FaultTolerance.run_exchange` with the tensors it changes in
place, and the driver takes its next quorum from the optimizer's step post-hook (as torchft's
LocalSGD drives its outer loop), after a step in which a sync ran. The method says where it
stands (``step_count``), what a heal leaves out (``replica_state``) and sends once
(``synced_values``), what replicas hold alike (``replica_tensors``), and how a healed replica
skips to its next sync (``skip_to_next_exchange``):

- **Every sync is a quorum's.** Outer methods and mtdao: at the start of each interval (before
  the first step, then right after each sync lands) the replicas that are alive form a quorum;
  the interval's exchange runs over them and the mean is over them. demo, adamw and dion: the
  same at every step.
- **Every sync is committed, tried again, or discarded, on all replicas alike** (torchft's
  ``should_commit``). A peer that dies or stalls past ``timeout_s`` during the exchange makes it
  fail; every participant puts back what the exchange changed in place (error-feedback residuals,
  DeMo's momenta, the gradients adamw averages, what mtdao averages: only those are copied before
  an exchange, on the device, and dropped once it is committed) and runs it again among the
  previous members still alive (torchft's shrink-only quorum: nobody joins or heals in it; a dead
  or stopped replica is out once its heartbeats stop), up to ``retries`` times (2) while they
  make ``min_replicas``. Where no try is committed the sync is discarded: outer methods set their
  parameters back to the anchors (the interval's local progress is lost), demo and adamw skip the
  step (dion's momenta keep the step's gradient), mtdao's replicas keep their own parameters and
  moments. Never a partial sync applied.
- **Healing from a peer.** A new, restarted or lagging replica joins at the next quorum and gets
  its state from a live peer through torchft's HTTP checkpoint transport, loaded with
  ``weights_only=True`` (:func:`~ds_lowcomm.comm.torchft.safe_http_transport`): parameters,
  anchors, outer momentum, the inner optimizer's state, step and sync counters (the optimizer's
  ``state_dict()``), not each replica's own error feedback (the method's ``replica_state``:
  residuals, DeMo's momenta; the peer's would be sent twice), which starts at zero as a new
  replica's would; with ``heal_inner_state`` false, not the inner optimizer's state either (each
  replica's own in the outer methods: the joiner starts it afresh, and the heal is about half the
  bytes). The peer copies it straight to CPU memory when the quorum forms and serves it
  from a background thread (:func:`~ds_lowcomm.comm.torchft.heal_transport`) while it trains,
  exchanges and commits on: its commits stop new reads of the copy but do not wait for one in
  flight (torchft's own transport holds the peer's commit, and so its next exchange, until the
  read ends); the copy is freed when its last read ends, or at the next commit if none is in
  flight. It is taken right after a sync, when every replica's parameters equal the anchors, so
  the healed replica is identical to the others. Its bytes go to the ledger as ``heal``.
- **Not holding the others up** (outer methods). A healed replica's position jumps to the step
  before its next sync, which it sits out (it sends nothing of its own, takes the others' mean
  and is identical after it): it is at that exchange when the others are, however long its heal
  took, as long as that is under one sync interval.
- **Data.** :attr:`FaultTolerance.step` (the replica's steps, restored by the heal) is where the
  training loop stands; :attr:`FaultTolerance.data_step` where it reads its own data shard (shard
  by replica id, not by how many are alive): the step less the steps it jumped over to sit out a
  sync, whose batches are read afterwards, in order. A restarted replica's previous life read
  batches after its last committed sync that no committed sync holds, and its shard's batches
  went unread while it was away: every replica keeps, per replica id, where its data stood at the
  last sync committed with it (:attr:`FaultTolerance.positions`, learned from the members at each
  membership and retry, healed with the state), so the restarted replica learns from its peer
  where its own stood, says which batches were not trained (its log line) and reads them first,
  in order (``report()["reread"]``). A replica new to the peers (no sync committed with it)
  reads its shard from its peer's position.
- **Starting alike, and agreeing when meeting.** While no sync has been committed (torchft's step
  0), every quorum's replicas take the weights of its first (a broadcast): replicas seeded apart
  start alike. Replicas whose first quorums formed apart (``min_replicas`` 1, one up before the
  other) and that meet at equal steps are not healed by torchft: at every quorum of new members
  they compare what must be alike (the method's ``replica_tensors``: anchors or parameters,
  float64 checksums over the whole replica) and those that differ heal from the replicas holding
  what most of them hold (ties: the quorum's first). The outer methods compare at the start of
  the next sync (their anchors do not move until then; a replica healed there sits that sync
  out): at the quorum a joiner would enter the comparison only once its heal had ended, and the
  others would wait for it there instead of training.

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

from ..comm.consistency import gather_json, param_checksums, same_checksums, settings_differences
from ..comm.torchft import TorchftTransport, heal_transport, quorum_id
from ..settings import ConfigError, Settings, check_bool, check_int, check_positive


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
    # A sync a peer died or stalled in: how many times its exchange is tried again among the
    # replicas still alive before it is discarded (0: discarded at once, every replica alike)
    retries: int = 2
    timeout_s: float = 30.0  # a collective's or a heal's wait for a peer
    quorum_timeout_s: float = 600.0  # a quorum's wait (a restarted replica waits up to one interval)
    host: str = ""  # the address the other replicas reach this one at (default: this machine's hostname)
    # Outer methods: whether a heal sends the inner optimizer's state (AdamW's moments, Muon's
    # momentum: each replica's own, never averaged). False: the joiner starts it afresh, as a new
    # optimizer does, and the heal is the anchors, outer momentum and counters only (about half
    # the bytes with AdamW inside): where a heal outlasts a sync interval, the others wait for it
    # at the sync the joiner sits out (bench faults, docs/reliability.md). The plain and DeepSpeed paths.
    heal_inner_state: bool = True

    def check(self, where: str) -> None:
        if not self.lighthouse or not isinstance(self.lighthouse, str):
            raise ConfigError(f"{where}.lighthouse: the lighthouse's host:port is required "
                              "(or TORCHFT_LIGHTHOUSE in the environment)")
        if not self.replica_id or not isinstance(self.replica_id, str):
            raise ConfigError(f"{where}.replica_id: a replica id unique to this replica, stable across its "
                              "restarts, is required (or REPLICA_GROUP_ID in the environment)")
        check_int(where, "num_replica_groups", self.num_replica_groups, 0)
        check_int(where, "min_replicas", self.min_replicas, 1)
        check_int(where, "retries", self.retries, 0)
        for name in ("timeout_s", "quorum_timeout_s"):
            check_positive(where, name, getattr(self, name))
        if not isinstance(self.host, str):
            raise ConfigError(f"{where}.host must be a host name or address; got {self.host!r}")
        check_bool(where, "heal_inner_state", self.heal_inner_state)

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


SUPPORTED_METHODS = ("diloco", "dct_diloco", "sparseloco", "demo", "adamw", "mtdao", "dion")


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


def _to_cpu(obj: Any) -> Any:
    """A copy of a state in CPU memory, taken straight from wherever its tensors live (no copy on
    the device): what a joining replica reads over HTTP while this one trains on."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _free(state: Any) -> None:
    """Free the memory of a state's tensors (a served copy nothing reads any more)."""
    for t in _tensors(state):
        t.set_()


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


class FaultTolerance:
    """One replica's membership in the torchft quorum and the transport its method uses."""

    def __init__(self, settings: FaultToleranceSettings, host: str | None = None, rank: int = 0, world_size: int = 1,
                 store: tuple[str, int] | None = None, store_server: Any = None, replica_transport: Any = None):
        """``rank``/``world_size``: this process within its replica (a replica of several ranks runs
        one manager per rank: rank r meets rank r of every other replica, and heals from it);
        ``store``: the replica's TCPStore (host, port), which rank 0 of a replica of several ranks
        serves (:func:`replica_store`), and ``store_server`` that store on rank 0 (kept alive here:
        every quorum's process group meets in it); None: one of its own (a one-rank replica).
        ``replica_transport``: the replica's own ranks (a replica of several ranks), over which they
        agree on what their replica holds. The torchft manager heartbeats from here on: the
        lighthouse waits for a heartbeating replica at a quorum (replicas started together meet in
        their first)."""
        settings.validate(WHERE)
        from ..comm.torchft import INTERNALS

        INTERNALS.ensure_checked()  # torchft in the supported range, its internals as declared
        from torchft import ProcessGroupGloo

        self.settings = settings
        self.host = host or settings.host or socket.gethostname()
        self._timeout = timedelta(seconds=settings.timeout_s)
        self.transport = TorchftTransport(ProcessGroupGloo(timeout=self._timeout), timeout_s=settings.timeout_s)
        self.replica_transport = replica_transport
        self._store = store_server
        if store is None:
            self._store = torch.distributed.TCPStore(self.host, 0, is_master=True, wait_for_workers=False)
            store = (self.host, self._store.port)
        # how a joining replica reads this one's state: a CPU copy, served from a background thread
        # while this replica trains and commits on; freed once served (or at a commit, unread)
        self.checkpoints = heal_transport(self._timeout, self.host, on_released=_free)
        from torchft import Manager

        lighthouse = settings.lighthouse if "://" in settings.lighthouse else f"http://{settings.lighthouse}"
        self.manager = Manager(
            pg=self.transport.pg, min_replica_size=settings.min_replicas, use_async_quorum=False,
            load_state_dict=self._load, state_dict=self._state, replica_id=settings.replica_id,
            store_addr=store[0], store_port=store[1], rank=rank, world_size=world_size, lighthouse_addr=lighthouse,
            hostname=self.host, timeout=self._timeout, quorum_timeout=timedelta(seconds=settings.quorum_timeout_s),
            connect_timeout=self._timeout, checkpoint_transport=self.checkpoints,
            # not torchft's init_sync: it picks the source replica per rank, and a replica's ranks
            # would start from different replicas' weights; start_interval broadcasts one's instead
            init_sync=False)
        self.transport.manager = self.manager
        self.optimizer, self.stateful, self.after_step = None, (), ()
        self._mid_step = False  # whether the quorum being taken is inside an optimizer step
        self.heals = 0  # states this replica loaded from a peer (restarted, behind, or apart)
        self.discarded = 0  # syncs no try of which could be committed
        self.retried = 0  # tries again of a sync a peer failed in, among the replicas still alive
        self.reconciled = 0  # quorums whose members met holding different parameters (one side healed)
        self.sat_out = 0  # syncs this replica sat out after a heal (outer methods)
        self.data_lag = 0  # batches of its shard it jumped over, or its restart skipped: read later (data_step)
        self.reread = 0  # batches of its shard a restart had skipped (read after its heal)
        # per replica id, where its data stood (batches of its shard read) at the last sync
        # committed with it: a restarted replica learns from its peer which batches it lost
        self.positions: dict[str, int] = {}
        self._members: dict[str, int] | None = None  # the current members' data lags, by replica id
        self._fresh = True  # nothing committed or healed in this process yet (a restarted replica)
        self._sitting_out = False
        self._members_due = False  # the members' check waits for the next exchange (start_interval)
        self._at_exchange = False  # that check is running: a heal in it sits this exchange out
        self._tries = 0
        self._quorum_seen: int | None = None
        self._served: list[torch.Tensor] = []  # the last state served to a joining replica (CPU)

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
        if not self.settings.heal_inner_state and _optimizer_states(getattr(optimizer, "inner", None)) == 0:
            raise ConfigError(f"{WHERE}.heal_inner_state false is for the outer methods with a torch inner optimizer "
                              f"(diloco, dct_diloco, sparseloco, streaming); {optimizer.method} has none to leave out")
        # the method's syncs run through run_exchange; after a step in which one ran, the next quorum
        optimizer.exchange_driver = self
        self._hook = optimizer.register_step_post_hook(self._after_step)
        self._steps = 0
        self._exchanged = False
        self.start_interval(stepped=False)

    @property
    def step(self) -> int:
        """This replica's steps (restored by a heal): where the training loop stands. The method's
        own count where it keeps one (a quorum is taken once per sync, not per step), else the
        steps counted here (a sync and a quorum every step)."""
        own = self.optimizer.step_count()
        return self._steps if own is None else own

    @property
    def data_step(self) -> int:
        """Where this replica reads its own data shard: its step, less the batches it jumped over
        to sit out a sync after a heal (read now, in order, rather than skipped)."""
        return self.step - self.data_lag

    # -- driving the method's exchanges (the protocol of optim/base.py) ----------------------------
    def run_exchange(self, changes: list[torch.Tensor], run):
        """One sync of the method in this replica's quorum, until torchft commits it: ``changes``
        (what ``run`` changes in place) are copied first and put back when a try fails, so that it
        runs again among the replicas still alive (:meth:`retry`), or is discarded. Only those
        tensors are copied, not the method's whole state. Returns what landed, or None when the
        sync was discarded (every replica alike)."""
        self._exchanged = True  # the next quorum after this step
        kept = [t.clone() for t in changes]
        while True:
            self.before_exchange()
            landed = run()
            if self.commit():
                return landed
            for t, before in zip(changes, kept):
                if t.shape != before.shape:  # a buffer sized by the quorum's (the all-reduce's server error)
                    t.resize_(before.shape)
                t.copy_(before)
            if not self.retry():
                return None

    def _after_step(self, optimizer, args, kwargs) -> None:
        """The optimizer's step post-hook: after a step in which a sync ran, the next quorum."""
        if self._exchanged:
            self._exchanged = False
            self.start_interval()

    def start_interval(self, stepped: bool = True) -> None:
        """After each step (outer methods: after each sync) and at attach (``stepped`` False): a
        quorum of the replicas alive now; a replica that is behind heals from a peer here, and
        replicas new to each other check that they hold the same parameters."""
        self._steps += stepped
        self._tries = 0
        self.transport.reset()
        self._mid_step = stepped
        try:
            self.manager.start_quorum(allow_heal=True)
        finally:
            self._mid_step = False
        if self.optimizer.reads_state_at_exchange and self.manager.current_step() > 0:
            # An outer method: the members' check waits for the next sync, where every member is
            # anyway (a replica healing in this quorum sits it out). Here a joiner would enter it
            # only once its heal has ended, and the others would wait for that instead of training.
            self._members_due = True
        else:
            self._check_members()

    def _check_members(self) -> None:
        """Once per membership (torchft's quorum id; the lighthouse bumps it when the members
        change or a commit failed), where there are others: at torchft's step 0 every replica takes
        the first's weights; later, the members compare their parameters (:meth:`_agree`). Either
        way they learn who the members are (for :attr:`positions`)."""
        quorum = quorum_id(self.manager)
        if self.transport.world_size <= 1:
            self._members = {self.settings.replica_id: self.data_lag}
        if quorum == self._quorum_seen or self.transport.world_size <= 1 or self.manager.errored() is not None:
            return
        self._quorum_seen = quorum
        if self.manager.current_step() == 0:
            self._start_alike()
        else:
            self._agree()

    def _start_alike(self) -> None:
        """No sync committed yet (every participant is at torchft's step 0, or it would have healed:
        so all of them are here): every replica takes the weights of the quorum's first, as
        DeepSpeed's ranks take rank 0's (replicas seeded apart start alike). A failed broadcast is
        this round's error: the next sync is tried again or discarded where it failed, and a
        replica left behind heals at the next quorum."""
        # the replicas that start together agree on their settings (else every one of them raises)
        everyone = gather_json(self.transport, {"settings": self.agreed, **self._me()})
        self._learn_members(everyone)
        if self.transport.failed is None:  # a failed gather: this round is discarded, no verdict
            for replica, theirs in enumerate(everyone[1:], start=1):
                if theirs["settings"] != everyone[0]["settings"]:  # every replica the same verdict
                    raise ConfigError("lowcomm.fault_tolerance: the replicas' settings differ ("
                                      + settings_differences(everyone[0]["settings"], theirs["settings"],
                                                             "the quorum's replica 0 has", f"its replica {replica} has")
                                      + ")")
        tensors = {id(t): t for t in (*self.optimizer._current_params(), *self.optimizer.replica_tensors(),  # anchors
                                      *(t for obj in self.stateful for t in getattr(obj, "tensors", ())))}.values()
        with torch.no_grad():
            for t in tensors:
                self.transport.broadcast_(t.data, src=0, op="start_alike")
        if self.transport.failed is not None:
            self._quorum_seen = None  # not settled: again at the next quorum

    def _agree(self) -> None:
        """Replicas that meet after syncs committed apart (their first quorums formed without each
        other, min_replicas 1) are at the same torchft step, so torchft heals none of them: they
        compare what every replica must hold alike (the method's ``replica_tensors``: outer
        methods' anchors, the others' parameters, as float64 checksums over the whole replica)
        and, where they differ, heal from the replicas holding the values most of them hold (ties:
        the quorum's first), through the same transport a joining replica heals over."""
        sums = param_checksums(self.optimizer.replica_tensors())
        if self.replica_transport is not None and self.replica_transport.world_size > 1:  # the replica's, on each rank
            sums = [x for rank in gather_json(self.replica_transport, sums) for x in rank]
        everyone = gather_json(self.transport, {"sums": sums, "at": self.checkpoints.metadata(), **self._me()})
        self._learn_members(everyone)
        if self.transport.failed is not None:
            self._quorum_seen = None
            return
        groups: list[list[int]] = []  # ranks holding the same values, in the order of their first
        for r, theirs in enumerate(everyone):
            group = next((g for g in groups if same_checksums(everyone[g[0]]["sums"], theirs["sums"])), None)
            if group is None:
                groups.append([r])
            else:
                group.append(r)
        if len(groups) == 1:
            return
        source = max(groups, key=len)  # the first of the largest: ties go to the quorum's first
        src, me, step = source[0], self.transport.rank, self.manager.current_step()
        if me == src:
            self._serve([r for g in groups if g is not source for r in g], step)
        gather_json(self.transport, None)  # the source's state is up before anyone asks for it
        if self.transport.failed is not None:
            self._quorum_seen = None
            return
        self.reconciled += 1
        print(f"ds_lowcomm fault tolerance: replica {self.settings.replica_id} met replicas holding other parameters "
              f"at torchft step {step} (quorum ranks {groups}); "
              + ("it serves its state" if me == src else "it keeps its own" if me in source else "it heals"),
              file=sys.stderr, flush=True)
        if me not in source:
            try:
                state = self.checkpoints.recv_checkpoint(src_rank=src, metadata=everyone[src]["at"], step=step,
                                                         timeout=self._timeout)
            except Exception as err:  # noqa: BLE001  (the source died: this round fails, checked again)
                self.manager.report_error(err)
                self._quorum_seen = None
                return
            self._load(state["user"]["default"])

    def _me(self) -> dict:
        return {"replica": self.settings.replica_id, "lag": self.data_lag}

    def _learn_members(self, everyone: list) -> None:
        """The members of this quorum and their data lags, from a gather of :meth:`_me` (None where
        it failed: positions are then not advanced until the members are known again)."""
        failed = self.transport.failed is not None or any(e is None for e in everyone)
        self._members = None if failed else {e["replica"]: e["lag"] for e in everyone}

    def _serve(self, to: list[int], step: int) -> None:
        """Stage this replica's state for the quorum ranks ``to`` to read (a background thread serves it)."""
        self.checkpoints.send_checkpoint(dst_ranks=to, step=step, timeout=self._timeout,
                                         state_dict={"user": {"default": self._state()},
                                                     "torchft": self.manager.state_dict()})

    def before_exchange(self) -> None:
        if self._members_due:
            self._members_due, self._at_exchange = False, True
            try:
                self._check_members()
            finally:
                self._at_exchange = False
        self.transport.reset()
        self.transport.sits_out = self._sitting_out

    def commit(self) -> bool:
        """Whether this sync lands (on every replica alike); False: try again (:meth:`retry`) or discard it."""
        ok = self.manager.should_commit()
        if ok:
            self._fresh = False
            if self._members is not None:  # where each member's data stands in the syncs committed with it
                own = self.optimizer.step_count()
                at = own if own is not None else self._steps + 1  # (per-step methods count the step at its end)
                for replica, lag in self._members.items():
                    self.positions[replica] = at - lag
        # should_commit stopped new reads of this replica's served state, without waiting for a read
        # in flight (that one goes on from the copy, which the transport frees when it ends)
        if not self.checkpoints.reading():
            _free(self._served)
        self._served = []
        if ok:
            self._sitting_out = self.transport.sits_out = False
        return ok

    def retry(self) -> bool:
        """After a sync that failed (a peer died or stalled in it): its exchange again among the
        previous members still alive (torchft's shrink-only quorum: nobody joins, nobody heals in
        it, a dead or stopped replica is left out once its heartbeats stop), up to ``retries``
        times, where they still make ``min_replicas``. False: the sync is discarded."""
        if self._tries >= self.settings.retries or self.transport.world_size - 1 < self.settings.min_replicas:
            self.discarded += 1
            self._sitting_out = self.transport.sits_out = False
            return False
        self._tries += 1
        self.retried += 1
        self.transport.reset()
        settled = self._quorum_seen is not None
        self.manager.start_quorum(allow_heal=False, shrink_only=True)
        if settled:  # some of the members that agreed at this interval's start, its local progress on: nothing to check
            self._quorum_seen = quorum_id(self.manager)
            # but who is left (for positions): the members still alive tell
            try:
                self._learn_members(gather_json(self.transport, self._me()))
            except ValueError:  # another peer failed in the gather (what arrived is not JSON): not known
                self._members = None
        else:
            self._check_members()
        return True

    # -- the state a joining replica gets --------------------------------------------------------
    def _state(self) -> dict:
        """This replica's state for a peer to heal from, copied to CPU memory, less each replica's
        own error feedback (the method's ``replica_state``: the joiner starts it at zero)."""
        opt = self.optimizer
        params = opt._current_params()
        if all(a is not None and torch.equal(p, a.to(p.dtype)) for p, a in zip(params, opt.synced_values())):
            params = None  # an outer method's quorum follows a sync: the parameters are the anchors, sent once
        optimizer = opt.state_dict()
        optimizer["state"] = {i: {k: v for k, v in s.items() if k not in opt.replica_state}
                              for i, s in optimizer["state"].items()}
        if not self.settings.heal_inner_state:  # the joiner starts its inner optimizer's state afresh
            optimizer["lowcomm"] = {**optimizer["lowcomm"], "inner": _without_state(optimizer["lowcomm"]["inner"])}
        state = _to_cpu({"optimizer": optimizer, "params": params,
                         "steps": self._steps, "stateful": [obj.state_dict() for obj in self.stateful],
                         "mid_step": self._mid_step, "settings": self.agreed, "positions": dict(self.positions)})
        self._served = list(_tensors(state))
        return state

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
            saved = state["params"] or opt.synced_values()
            for p, value in zip(params, saved):
                p.copy_(value.to(p.dtype))
        for obj, saved in zip(self.stateful, state["stateful"]):
            obj.load_state_dict(saved)
        self._steps = int(state["steps"])
        if state["mid_step"] and not self._mid_step:  # the rest of the peer's step, which it runs after this
            for finish in self.after_step:
                finish()
        self.heals += 1
        at = self.step
        # a restarted replica: the batches of its shard its previous life read after its last
        # committed sync, and those up to here, were never trained: it reads them first
        lost = state.get("positions", {}).get(self.settings.replica_id) if self._fresh else None
        skipped = max(0, self.data_step - lost) if lost is not None else 0
        self.positions = dict(state.get("positions", {}))
        self._fresh = False
        self.data_lag += skipped
        self.reread += skipped
        jumped = self._sit_out()
        print(f"ds_lowcomm fault tolerance: replica {self.settings.replica_id} healed from a peer at step "
              f"{at}: {nbytes} bytes at {time.time():.3f}"
              + (f"; batches {lost} to {lost + skipped - 1} of its shard (read after its last committed sync, or "
                 f"due while it was away) were not trained: it reads them first" if skipped else "")
              + (f"; it sits out the sync at step {self.step + 1} and reads its shard on from step {self.data_step}"
                 if jumped else "; it sits out this sync" if self._at_exchange
                 else f"; it reads its shard on from step {self.data_step}"), file=sys.stderr, flush=True)

    def _sit_out(self) -> int:
        """After a heal, where the method syncs every so many steps: the replica's position jumps
        to just before its next sync (the method's ``skip_to_next_exchange``), which it sits out
        (it sends nothing of its own and takes the others' mean, as every replica does): it is at
        that exchange when the others are, however long its heal took, so they do not wait for it.
        The batches of its shard it jumps over are read later (:attr:`data_step`). Healed by the
        members' check at the start of a sync (:meth:`before_exchange`), it is at that sync already:
        it jumps nothing and sits that one out. Returns the steps jumped."""
        jump = 0 if self._at_exchange else self.optimizer.skip_to_next_exchange()
        if jump is None:
            return 0
        for _ in range(jump):  # the schedule and the engine's position as the others' will be
            for finish in self.after_step:
                finish()
        self.data_lag += jump
        self._sitting_out = True
        self.sat_out += 1
        return jump

    def report(self) -> dict:
        """What fault tolerance did on this replica, for the run's report."""
        return {"heals": self.heals, "discarded": self.discarded, "retried": self.retried,
                "reconciled": self.reconciled, "sat_out": self.sat_out, "data_lag": self.data_lag, "reread": self.reread}

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


def _map_optimizer_states(sd: Any, fn) -> Any:
    """``sd`` (a state_dict, nested dicts and lists) with ``fn`` applied to every torch optimizer
    state_dict in it ({"state": {...}, "param_groups": [...]}; MuonWithAdamW nests two)."""
    if isinstance(sd, dict) and isinstance(sd.get("state"), dict) and isinstance(sd.get("param_groups"), list):
        return fn(sd)
    if isinstance(sd, dict):
        return {k: _map_optimizer_states(v, fn) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_map_optimizer_states(v, fn) for v in sd]
    return sd


def _without_state(sd: Any) -> Any:
    """An optimizer's state_dict with every torch optimizer's per-parameter state left out (its
    param_groups kept): what a new optimizer holds."""
    return _map_optimizer_states(sd, lambda o: {**o, "state": {}})


def _optimizer_states(optimizer) -> int:
    """How many torch optimizer state_dicts ``optimizer``'s holds (nested ones counted); 0 for None."""
    found: list = []
    if optimizer is not None:
        _map_optimizer_states(optimizer.state_dict(), found.append)
    return len(found)


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
