"""What every ds_lowcomm optimizer shares: its settings object, a transport with its ledger, the
start-up consistency check, the step skeleton, lazily built sync layouts, and a state_dict that
keeps state dtypes and the communication state.

State and layouts are built at the first real step, for whatever parameters the param_groups
hold then: DeepSpeed swaps them after construction (fp32 master copies for bf16/fp16, flat
partitions for ZeRO 1/2/3, declared as parameter pieces with ``set_pieces``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..codec import FLOAT_DTYPES
from ..comm import (ByteLedger, Pending, Pieces, ReplicaShard, Routes, SparseAllGather, TorchDistTransport,
                    Transport, all_finite, assert_same_across_ranks, start_all_reduce_mean_)
from ..comm.consistency import gather_json, settings_differences
from ..comm.wire import WirePlan
from ..settings import Settings, check_choice

STATE_DTYPES = tuple(FLOAT_DTYPES)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StatefulSettings(Settings):
    """Settings of a method that keeps per-parameter state (momenta, residuals, anchors)."""

    state_dtype: str = "fp32"  # whatever the parameters' dtype

    def check(self, where: str) -> None:
        check_choice(where, "state_dtype", self.state_dtype, STATE_DTYPES)


def ordered_params(param_groups) -> list[torch.Tensor]:
    return [p for g in param_groups for p in g["params"]]


class LowcommOptimizer(torch.optim.Optimizer):
    """Base class. A method sets ``method`` and ``settings_class`` and writes ``_update(params)``
    (called under no_grad by :meth:`step`); it may add checkpointed counters via ``_extra_state``.

    Construction arguments every method takes:
    - ``transport``: the method's collectives (default: torch.distributed's default group);
    - ``shard``: at ZeRO 0 with replicas of several ranks, this rank syncs only the parameters it
      owns and shares them inside its replica (see comm/shard.py);
    - ``ledger_steps``: whether ``step()`` closes a ledger step (the DeepSpeed glue closes it at
      the engine's step boundary instead, since ZeRO steps once per parameter group);
    - ``clip_grad``: > 0 scales the gradient the method's step uses to that global 2-norm at most
      (torch's ``clip_grad_norm_``): the mean gradient of a synchronous step (adamw, mtdao's warm
      start: as DDP clips after its all-reduce), this rank's own gradient otherwise (local steps,
      DeMo's momentum). Under DeepSpeed and Megatron their own clipping runs instead (before the
      method's step, on the replica's gradient) and this stays 0.
    """

    method: ClassVar[str] = ""
    settings_class: ClassVar[type[Settings]] = Settings

    @classmethod
    def resolve_settings(cls, settings: Settings | None, flat: dict[str, Any]) -> Settings:
        """The method's settings: an object, or flat keyword arguments (``topk=8, chunk=8``)."""
        if settings is not None:
            if flat:
                raise TypeError(f"{cls.__name__}: pass settings= or keyword settings ({', '.join(flat)}), not both")
            if not isinstance(settings, cls.settings_class):
                raise TypeError(f"{cls.__name__}: settings must be a {cls.settings_class.__name__}; "
                                f"got {type(settings).__name__}")
            settings.validate()
            return settings
        return cls.settings_class.from_flat(flat, where=f"{cls.__name__}", strict=True)

    def _init_comm(self, settings: Settings, transport: Transport | None, shard: ReplicaShard | None,
                   ledger_steps: bool, clip_grad: float = 0.0, **record: Any) -> None:
        """Attach the settings and the transport and check, on every rank, that all ranks agree
        on the settings (and ``record``'s extras) and start from the same parameters."""
        if not (isinstance(clip_grad, (int, float)) and not isinstance(clip_grad, bool) and 0 <= clip_grad < float("inf")):
            raise ValueError(f"clip_grad must be a number >= 0 (0: no clipping); got {clip_grad!r}")
        if clip_grad and shard is not None:
            raise ValueError("clip_grad with a replica shard: the framework that shards the replica clips "
                             "(DeepSpeed's gradient_clipping)")
        self.clip_grad = float(clip_grad)
        if clip_grad:  # (absent at 0, so that the records of checkpoints saved before it still match)
            record = {**record, "clip_grad": self.clip_grad}
        self.settings = settings
        self.transport = transport if transport is not None else TorchDistTransport()
        self.shard = shard
        self._owner_state = None  # collect_replica_state()'s, until the next state_dict()
        self.ledger_steps = ledger_steps
        self._syncs: dict[tuple[int, ...], SparseAllGather] = {}
        self._pieces: dict[int, Pieces] = {}
        self._routes: Routes | None = None  # replicas of different shapes: syncs by parameter name
        self._routes_key: tuple[int, ...] = ()
        # Set by an integration while its framework builds itself: DeepSpeed's fp16/bf16 wrapper
        # and ZeRO 1/2 call step() once at construction with zero gradients. Those calls are
        # skipped on every rank alike (no collective, no state, no counter). Whether a step is
        # real is never guessed from this rank's gradients: a rank whose first gradients are all
        # zero would skip a collective the other ranks issue.
        self.framework_setup = False
        # A local update skipped for non-finite gradients under lowcomm.nonfinite "raise": the next
        # exchange goes out flagged, so that every rank raises there together (not this one alone).
        self._unhealthy = False
        params = self._current_params()
        self._record = {
            "method": self.method,
            "world_size": self.transport.world_size,
            **settings.flat(),
            **record,
            "param_shapes": [list(p.shape) for p in params],
            "param_dtypes": [str(p.dtype) for p in params],
        }
        if getattr(self.transport, "checks_at_start", True):  # torchft: no group before the first quorum
            assert_same_across_ranks(self.transport, self._record, params)

    @property
    def ledger(self):
        return self.transport.ledger

    @property
    def state_dtype(self) -> torch.dtype:
        return FLOAT_DTYPES[self.settings.state_dtype]

    def _current_params(self) -> list[torch.Tensor]:
        """The tensors the method steps now; frozen ones (``requires_grad=False``, e.g. passed in
        with ``model.parameters()``) and empty ones (nothing to send) take no part."""
        return [p for p in ordered_params(self.param_groups) if p.requires_grad and p.numel()]

    def set_pieces(self, flat: torch.Tensor, pieces: Pieces) -> None:
        """Declare that ``flat`` (a tensor the optimizer steps, e.g. a ZeRO partition) is made of
        these parameter pieces: compressed exchanges then code each piece on its own. Before the
        first step."""
        if flat.numel() != pieces.numel:
            raise ValueError(f"pieces cover {pieces.numel} elements; the tensor has {flat.numel()}")
        if self._syncs:
            raise RuntimeError("set_pieces must come before the first step")
        self._pieces[id(flat)] = pieces

    def leave_syncs(self, what: str, final: bool = False) -> None:
        """Replicas of different shapes: tell the peers this rank goes on to ``what`` after its
        syncs so far: a step every rank takes (a checkpoint), or, ``final``, the end of its syncs
        (``Routes.leave``). Nothing otherwise."""
        if self._routes is not None:
            self._routes.leave(what, final)

    def set_routes(self, routes: Routes) -> None:
        """Replicas of different shapes (comm/routes.py): every exchange goes along ``routes``,
        built over this rank's trainable tensors in ``param_groups`` order. Before the first step;
        checks, along every route, the settings and that the starting values agree."""
        params = self._current_params()
        if routes.numels != [p.numel() for p in params]:
            raise ValueError(f"routes cover tensors of {routes.numels} elements; the optimizer steps "
                             f"{[p.numel() for p in params]}")
        if self._syncs:
            raise RuntimeError("set_routes must come before the first step")
        self._routes, self._routes_key = routes, tuple(id(p) for p in params)
        for route in routes.routes:
            route.transport.nonfinite = self.transport.nonfinite
        # Shapes, world sizes and step counts differ between replicas by design; the rest must not.
        record = {k: v for k, v in self._record.items()
                  if k not in ("world_size", "param_shapes", "param_dtypes", "sync_every")}
        routes.check_same(record, [p.detach() for p in params])

    def _repeats(self, params: list[torch.Tensor]) -> int:
        """Routed exchanges take every tensor at once (or that list several times over: state
        tensors of several kinds); a subset differs by rank between replica shapes."""
        ids, n = tuple(id(p) for p in params), len(self._routes_key)
        if not n or len(ids) % n or any(ids[i : i + n] != self._routes_key for i in range(0, len(ids), n)):
            raise RuntimeError(f"{self.method}: with replicas of different shapes every exchange must cover all "
                               "the optimizer's tensors (lowcomm.fragments must be 1)")
        return len(ids) // n

    # -- the non-finite guard (the collectives check what they send; see comm/collectives.py) --
    def _grads_finite(self, grads: list[torch.Tensor | None], what: str) -> bool:
        """Whether this rank's gradients are all finite. If not, the caller skips its local update
        (as a loss scaler skips an overflowed step: nothing non-finite enters the state); the skip
        is counted in the ledger under ``what`` with this rank and logged. It changes no
        collective: under "raise" the next exchange is flagged and every rank raises there."""
        if all_finite(grads):
            return True
        me = self.transport.peer_ranks()[self.transport.rank]
        self.ledger.record_nonfinite(what, [me])
        logger.warning("%s: non-finite gradients on global rank %d: its local update of this step is skipped",
                       what, me)
        if self.transport.nonfinite == "raise":
            self._unhealthy = True
        return False

    def _clip_(self, params: list[torch.Tensor]) -> None:
        """``clip_grad``: scale the gradients of ``params`` together to that 2-norm at most."""
        if self.clip_grad:
            with_grad = [p for p in params if p.grad is not None]
            if with_grad:
                torch.nn.utils.clip_grad_norm_(with_grad, self.clip_grad)

    def _healthy(self) -> bool:
        """This rank's health flag for the exchange it starts now (see :meth:`_grads_finite`)."""
        healthy, self._unhealthy = not self._unhealthy, False
        return healthy

    def _start_mean_(self, params: list[torch.Tensor], tensors: list[torch.Tensor], op: str) -> Pending:
        """Dense mean of ``tensors`` (laid out as ``params``) across replicas, in place on ``wait()``."""
        if self._routes is None:
            return start_all_reduce_mean_(tensors, self.transport, op=op, healthy=self._healthy())
        n = len(self._routes_key)
        parts = [self._routes.start_all_reduce_mean_(tensors[i : i + n], op=op)
                 for i in range(0, self._repeats(params) * n, n)]
        return Pending(lambda: [t for part in parts for t in part.wait()], None)

    def _sync_for(self, params: list[torch.Tensor], op: str) -> SparseAllGather:
        """The compressed exchange for tensors laid out as these parameters (built once per list,
        then reused): each parameter's shape, or its pieces (``set_pieces``)."""
        key = tuple(id(p) for p in params)
        sync = self._syncs.get(key)
        if sync is None and self._routes is not None:
            sync = _RepeatedRoutes(self._routes.sparse_all_gather(op=op, **self.settings.codec.flat()),
                                   len(self._routes_key), self._repeats(params))
            self._syncs[key] = sync
        if sync is None:
            layouts = [self._pieces.get(id(p), p.shape) for p in params]
            sync = SparseAllGather(layouts, transport=self.transport, op=op, **self.settings.codec.flat())
            self._syncs[key] = sync
        return sync

    # -- the step -------------------------------------------------------------------------
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.framework_setup:  # a framework's step() while it builds itself: not a training step
            return loss
        params = self._current_params()
        with torch.no_grad():
            self._update(params)
        if self.ledger_steps:
            self.ledger.end_step()
        return loss

    def _update(self, params: list[torch.Tensor]) -> None:
        """One step of the method on ``params`` (gradients in ``p.grad``), its syncs included."""
        raise NotImplementedError

    # -- what the method costs, declared from its settings and the tensor shapes ---------------
    # ``planned_wire`` and ``planned_state_bytes`` say what a run of the method sends and keeps for
    # tensors of ``shapes`` (one worker's): the ledger tests check them against what the method
    # books and holds, and ``ds-lowcomm plan`` prices them. ``matrices``: one bool per shape, whether
    # that tensor takes an orthogonalised step (Muon's, dion's), as ``takes_muon_step`` decides.
    @classmethod
    def planned_wire(cls, settings: Settings, shapes, *, matrices=None, replicas: int = 2, grad_bytes: int = 4,
                     param_bytes: int = 4) -> WirePlan:
        """What the method puts on the wire among ``replicas`` workers: the messages of a sync and
        their schedule. ``grad_bytes``: an element of a dense gradient mean (2 in bf16);
        ``param_bytes``: an element of the parameters."""
        raise NotImplementedError(f"{cls.__name__} declares no wire plan")

    @classmethod
    def planned_state_bytes(cls, settings: Settings, shapes, *, matrices=None, param_bytes: int = 4,
                            local_optimizer: str | None = None) -> float:
        """Bytes of state the method holds for tensors of ``shapes`` past a sync (step counters
        left out), its per-step or inner optimizer's included: ``local_optimizer`` where something
        outside the settings chooses that (DeepSpeed's Muon section; :meth:`local_optimizer`)."""
        raise NotImplementedError(f"{cls.__name__} declares no state")

    @staticmethod
    def state_element_bytes(settings: StatefulSettings) -> int:
        """Bytes an element of the method's state takes (its ``state_dtype``)."""
        return FLOAT_DTYPES[settings.state_dtype].itemsize

    @classmethod
    def local_optimizer(cls, settings: Settings, given: str | None = None) -> str | None:
        """The dense optimizer that takes the method's local steps ("adamw", "muon"), where it has
        one (None: the method's own update): ``given`` (DeepSpeed's optimizer section), else its own."""
        return given

    # -- the exchange protocol: how a driver runs the method's syncs from outside ---------------
    # Every sync of a method goes through _run_exchange(changes, run): ``run`` sends it and lands
    # it (returns what landed), ``changes`` are the tensors it changes in place. Without a driver it
    # just runs. A driver (live fault tolerance, optim/fault_tolerance.py, set by its attach) wraps
    # it: it may keep ``changes`` first, run it in a quorum, put them back and run it again, or
    # discard it (None: the method then does what a sync that did not happen means for it, on
    # every replica alike). The rest of the protocol says where the method stands
    # (``step_count``), what a heal carries (``replica_state``, ``synced_values``), what replicas
    # hold alike (``replica_tensors``) and how a healed replica joins the next sync without
    # holding the others up (``skip_to_next_exchange``). The driver takes its next quorum after a
    # step in which a sync ran (an optimizer step post-hook, as torchft's LocalSGD). No method
    # knows of fault tolerance.
    exchange_driver = None
    # State a heal does not carry (a joining replica starts it at zero, as a new replica would): a
    # replica's own error feedback. The peer's would be sent twice, by the peer and by the joiner.
    replica_state: ClassVar[tuple[str, ...]] = ()
    # Whether an exchange reads the method's state afresh when it runs (the outer loops: their
    # pseudo-gradients from the anchors), so that a heal just before it is safe: a driver may then
    # check that the replicas agree at the start of the next exchange rather than at the quorum.
    reads_state_at_exchange: ClassVar[bool] = False

    def _run_exchange(self, changes: list[torch.Tensor], run):
        """One sync: ``run()`` (started and landed; returns what landed), through the driver where
        there is one. ``changes``: what ``run`` changes in place (error feedback, momenta, the
        gradients it averages; only those, not the method's whole state), which a driver keeps so
        that the sync can be put back and run again, or discarded. Returns what landed, or None
        where the driver discarded the sync (every replica alike)."""
        if self.exchange_driver is None:
            return run()
        return self.exchange_driver.run_exchange(changes, run)

    def step_count(self) -> int | None:
        """The method's own count of its steps, restored with its state (where the training loop
        stands: a healed replica reads its data on from there); None where it keeps none (a
        driver counts them)."""
        return None

    def skip_to_next_exchange(self) -> int | None:
        """After a heal: move this replica to the step just before its next sync, which it then
        sits out (it takes the others' mean), so that it reaches that sync when the others do,
        however long its heal took. Returns the steps jumped (their batches are read later), or
        None where the method syncs every step and nothing is skipped."""
        return None

    def synced_values(self) -> list[torch.Tensor | None]:
        """Per parameter of ``_current_params()``, the state tensor holding its value as of the
        last sync where the method keeps one (the outer methods' anchors), else None: a heal taken
        right after a sync sends those once, not the parameters too."""
        return [None] * len(self._current_params())

    def _owned(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return params if self.shard is None else self.shard.owned(params)

    def _share(self, params: list[torch.Tensor]) -> None:
        if self.shard is not None:
            self.shard.share(params)

    # -- checkpointing ------------------------------------------------------------------
    def replica_tensors(self) -> list[torch.Tensor]:
        """What every replica holds identically at a step boundary (compared after a checkpoint
        load): the parameters this rank syncs. Outer methods: their anchors."""
        return self._owned(self._current_params())

    def check_replicas_agree(self) -> None:
        """Collective over the method's transport: raise on every rank if the replicas' copies of
        :meth:`replica_tensors` differ (a corrupted or mixed-up checkpoint)."""
        if self._routes is not None:
            return
        # The check's few bytes go to a scratch ledger: the restored one stays the run's record of
        # training traffic, equal to an uninterrupted run's.
        ledger, self.transport.ledger = self.transport.ledger, ByteLedger()
        try:
            assert_same_across_ranks(self.transport, {"method": self.method}, self.replica_tensors(),
                                     differs="(a replica) holds other values than rank 0 after the checkpoint load, "
                                             "where every replica's must be equal: a checkpoint file was changed or "
                                             "files of different checkpoints were mixed")
        finally:
            self.transport.ledger = ledger

    def collect_replica_state(self) -> None:
        """Before a checkpoint at ZeRO 0 with several ranks a replica (a :class:`ReplicaShard`):
        each parameter's method state that only its owner holds (an outer loop's anchor, residual,
        outer momentum...) is sent to the replica's other ranks, so that the one file DeepSpeed's
        stage 0 writes per replica (its data-parallel rank 0's) holds every rank's, and the next
        :meth:`state_dict` includes it. Collective over the replica's ranks (call it on all);
        its bytes are in no ledger (checkpoint traffic)."""
        self._owner_state = None
        if self.shard is None or self.shard.replica_size == 1:
            return
        params = self._current_params()
        owners, me = self.shard.owners(params), self.shard.local_rank
        transport = self.shard.transport
        ledger, transport.ledger = transport.ledger, ByteLedger()

        def spec(t: torch.Tensor) -> list:
            return [list(t.shape), str(t.dtype).removeprefix("torch.")]

        def from_rank(j: int, mine: torch.Tensor | None, shape_dtype: list, device) -> torch.Tensor:
            """Rank j's tensor (``mine`` on rank j), on every rank of the replica."""
            shape, dtype = shape_dtype
            t = mine.to(device) if j == me else torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            transport.broadcast_(t, src=j, op="checkpoint_state")
            return t

        try:
            mine = {str(i): {k: spec(v) for k, v in self.state[p].items() if torch.is_tensor(v)}
                    for i, p in enumerate(params)}
            everyone = gather_json(transport, mine)
            # each rank's ledger too: they count different shares of the parameters
            ledgers = gather_json(transport, {k: v.tolist() if torch.is_tensor(v) else v
                                              for k, v in self.ledger.state_dict().items()})
            owner_keys, received = {}, {}
            for i, p in enumerate(params):
                j = owners[i]
                others = {k for r, keys in enumerate(everyone) if r != j for k in keys[str(i)]}
                keys = sorted(set(everyone[j][str(i)]) - others)
                owner_keys[str(i)] = keys
                for k in keys:
                    t = from_rank(j, self.state[p].get(k), everyone[j][str(i)][k], p.device)
                    if j != me:
                        received.setdefault(i, {})[k] = t
        finally:
            transport.ledger = ledger
        self._owner_state = ({"keys": owner_keys, "ledgers": ledgers}, received)

    def drop_collected_state(self) -> None:
        """Forget what :meth:`collect_replica_state` received (a rank whose state was not saved)."""
        self._owner_state = None

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["lowcomm"] = {"settings": self._record, "ledger": self.ledger.state_dict(), **self._extra_state()}
        owner_state, self._owner_state = self._owner_state, None
        if owner_state is not None:  # collect_replica_state(): the other ranks' owned state, and which keys
            owner_keys, received = owner_state
            for i, tensors in received.items():
                sd["state"][i] = {**sd["state"].get(i, {}), **tensors}
            sd["lowcomm"]["owner_state"] = owner_keys
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        lowcomm = state_dict.pop("lowcomm", None)
        if lowcomm is None:
            raise ValueError(f"not a ds_lowcomm {self.method} optimizer state (no 'lowcomm' entry)")
        mine, saved = self._record, lowcomm["settings"]
        if mine != saved:
            raise ValueError("checkpoint was saved with other lowcomm settings: "
                             + settings_differences(saved, mine, "saved", "now"))
        load_preserving_dtypes(self, state_dict)
        owner_state = lowcomm.get("owner_state")
        ledger = lowcomm["ledger"]
        if owner_state is not None and self.shard is not None:
            # every rank loaded the replica's one file: each keeps only its own parameters' owned
            # state, and takes its own ledger
            params = self._current_params()
            owned = {id(p) for p in self._owned(params)}
            for i, keys in owner_state["keys"].items():
                p = params[int(i)]
                if id(p) not in owned:
                    for k in keys:
                        self.state[p].pop(k, None)
            ledger = dict(owner_state["ledgers"][self.shard.local_rank])
            for k in ("step_sent", "step_received"):
                ledger[k] = torch.tensor(ledger[k], dtype=torch.int64)
        self.ledger.load_state_dict(ledger)
        self._load_extra_state(lowcomm)


class _RepeatedRoutes:
    """A routed exchange over the tensor list given ``times`` times over (one exchange each)."""

    def __init__(self, sync, n: int, times: int):
        self.sync, self.n, self.times = sync, n, times

    def exchange(self, buffers, healthy: bool = True):
        return self.start(buffers, healthy).wait()

    def start(self, buffers, healthy: bool = True) -> Pending:
        parts = [self.sync.start(buffers[i : i + self.n], healthy) for i in range(0, self.n * self.times, self.n)]
        return Pending(lambda: [t for part in parts for t in part.wait()], None)


def load_preserving_dtypes(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """``Optimizer.load_state_dict`` casts floating state to each parameter's dtype, which would
    round fp32 momenta of bf16/fp16 parameters; load, then put the saved dtypes back."""
    torch.optim.Optimizer.load_state_dict(optimizer, state_dict)
    params = ordered_params(optimizer.param_groups)
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    by_id = dict(zip(saved_ids, params))
    for pid, saved in state_dict["state"].items():
        p = by_id[pid]
        for key, value in saved.items():
            if torch.is_tensor(value) and value.is_floating_point() and key != "step":
                optimizer.state[p][key] = value.to(device=p.device, copy=True)
