"""DiLoCo-style outer loops around any inner optimizer.

Every replica runs ``sync_every`` (H) inner steps on its own data; then the pseudo-gradient
Delta_r = anchor - theta_r is combined across replicas, the anchor (the global parameters, kept
in ``state_dtype``, fp32 by default) takes one step of the outer optimizer along the combined
Delta, and every replica restarts from the new anchor. Inner optimizer state stays local, as in
the paper. The outer optimizer is a ``torch.optim`` optimizer over the anchors, fed the combined
Delta as ``.grad`` (as torchft's local SGD does): ``outer_optimizer`` "sgd" (default; with the
method's momentum, DiLoCo's Nesterov 0.9, SparseLoCo's none), "adam" or "adamw".

- :class:`DiLoCo`: Delta is averaged with a dense all-reduce.
- :class:`DCTDiLoCo` (Nedelkoski et al. 2025): Delta accumulates into a decayed local buffer
  e_r <- decay * e_r + Delta_r treated as a signal; only its top-k DCT components travel
  (sparse all-gather) and leave it; the mean of everyone's components drives the outer step.
  Every replica applies the same decoded update, so replicas stay identical, as with DiLoCo.
- :class:`SparseLoCo` (arXiv 2508.15706): the same error-feedback buffer (decay 0.95), chunked
  top-k without a transform by default, 2-bit values, 12-bit indices, and no outer momentum:
  anchor <- anchor - outer_lr * mean_r(sent_r).

Streaming (Streaming DiLoCo, arXiv 2501.18512), for all three: with ``fragments`` P > 1 the
parameters are cut into P contiguous groups of about equal size; fragment f syncs at local steps
t with t = (f + 1) * H // P (mod H), so one fragment at a time is on the wire. A sync is started
without blocking and lands ``sync_delay`` inner steps later (the inner steps run meanwhile); the
landed global fragment replaces the local one, or with ``fragment_mix`` a > 0 becomes
a * local + (1 - a) * global, or with ``carry_local_steps`` becomes the new global fragment plus
this replica's own progress since the send (the inner steps that ran while the sync was in flight
are kept, as overlapped Local SGD / CO2 keep them, instead of being overwritten)
(:class:`StreamingSettings`). P = 1 with no delay is plain DiLoCo.

H may grow during training (``sync_every_schedule``, short intervals first): H(t) is the H of the
last [from_step, H] entry with from_step <= t (else ``sync_every``), and each fragment's next sync
comes H(its last sync) steps after it (:meth:`OuterSettings.next_sync`).
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from dataclasses import dataclass, field

import torch

from ..codec import CodecSettings
from ..comm import CompressedAllReduce, Pending, ReplicaShard, Transport, all_finite
from ..settings import (ConfigError, Settings, check_bool, check_choice, check_fraction, check_int, check_nonnegative,
                        check_positive, check_unit)
from .base import LowcommOptimizer, StatefulSettings, ordered_params

logger = logging.getLogger(__name__)

INNER_IMPLS = ("torch", "apex")
# The inner optimizer's rule: "adamw" (every parameter), or "muon" (torch's Muon, Nesterov, on the
# hidden weight matrices, AdamW on embeddings, head and 1-D parameters: MuLoCo's inner optimizer)
INNER_OPTIMIZERS = ("adamw", "muon")
OUTER_OPTIMIZERS = ("sgd", "adam", "adamw")  # torch.optim's SGD, Adam, AdamW


def contiguous_fragments(params: list, n: int) -> list[list]:
    """``params`` in order, cut into ``n`` contiguous groups of about equal element count (each
    at least one tensor): Streaming DiLoCo's fragments."""
    total = sum(p.numel() for p in params)
    out, current, seen = [], [], 0
    for i, p in enumerate(params):
        current.append(p)
        seen += p.numel()
        remaining_tensors, remaining_frags = len(params) - i - 1, n - len(out) - 1
        if remaining_frags and (seen >= total * (len(out) + 1) / n or remaining_tensors == remaining_frags):
            out.append(current)
            current = []
    out.append(current)
    return out


@dataclass(frozen=True)
class StreamingSettings(Settings):
    """Streaming DiLoCo: the parameters in ``fragments`` groups synced on a staggered schedule;
    each sync lands ``sync_delay`` inner steps after it is sent, and the landed global fragment
    replaces (``fragment_mix`` 0) or is mixed with the local one, or (``carry_local_steps``)
    takes the replica's steps made while it was in flight on top. Bounds that depend on H are
    checked by the outer loop's settings. (Eager updates, arXiv 2502.12996, the outer step at the
    send, were measured at long H and dropped: docs/results/long-intervals.md.)"""

    fragments: int = 1
    sync_delay: int = 0
    fragment_mix: float = 0.0
    # The landed fragment is the new anchor plus this replica's progress since the send: the
    # sync_delay inner steps run while it was in flight count, where replacing drops them.
    carry_local_steps: bool = False

    def check(self, where: str) -> None:
        check_unit(where, "fragment_mix", self.fragment_mix)
        check_bool(where, "carry_local_steps", self.carry_local_steps)
        if self.carry_local_steps and self.fragment_mix:
            raise ConfigError(f"{where}.carry_local_steps and {where}.fragment_mix are two ways to land a sync: "
                              f"set fragment_mix to 0 with carry_local_steps true (got {self.fragment_mix})")

    def check_against(self, where: str, sync_every: int) -> None:
        """Bounds at ``sync_every``: the smallest H the run takes (sync_every's, its schedule's)."""
        check_int(where, "fragments", self.fragments, 1, sync_every,
                  hint="the smallest H of sync_every and sync_every_schedule: one fragment sync per step at most")
        check_int(where, "sync_delay", self.sync_delay, 0, sync_every - 1,
                  hint="a fragment's sync must land before its next one starts, at the smallest H of sync_every "
                       "and sync_every_schedule")
        if self.carry_local_steps and not self.sync_delay:
            raise ConfigError(f"{where}.carry_local_steps needs {where}.sync_delay >= 1 (with 0 a sync lands at its "
                              "send: there are no steps in flight to carry)")


def _check_schedule(where: str, schedule) -> None:
    form = ("a list of [from_step, H] pairs of integers >= 1 with from_step strictly ascending (empty: sync_every "
            "throughout)")
    if not isinstance(schedule, tuple):
        raise ConfigError(f"{where}.sync_every_schedule must be {form}; got {schedule!r}")
    last = 0
    for entry in schedule:
        if not (isinstance(entry, tuple) and len(entry) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in entry)):
            shown = list(entry) if isinstance(entry, tuple) else entry
            raise ConfigError(f"{where}.sync_every_schedule must be {form}; got the entry {shown!r}")
        if entry[0] <= last:
            raise ConfigError(f"{where}.sync_every_schedule must be {form}; got from_step {entry[0]} after {last}")
        last = entry[0]


@dataclass(frozen=True)
class OuterSettings(StatefulSettings):
    """What the whole DiLoCo family shares: H, the outer optimizer, the inner optimizer's
    implementation, streaming."""

    sync_every: int = 128  # H: inner steps per outer step (before sync_every_schedule's first entry)
    # H growing during training: [from_step, H] pairs (this replica's inner steps, from_step >= 1
    # strictly ascending, H >= 1); H(t) is the H of the last entry with from_step <= t, else
    # sync_every, and each fragment's next sync comes H(its last sync) steps after it. Empty: sync_every throughout.
    sync_every_schedule: tuple = ()
    outer_lr: float = 0.7  # the outer optimizer's lr, whichever it is
    # The torch optimizer stepping the anchors: "sgd" takes outer_momentum and nesterov (fields of
    # the methods that have outer momentum), "adam"/"adamw" outer_betas and outer_eps.
    outer_optimizer: str = "sgd"
    outer_betas: tuple = (0.9, 0.999)
    outer_eps: float = 1e-8
    outer_weight_decay: float = 0.0  # torch's weight_decay of the outer optimizer (decoupled for adamw)
    inner_impl: str = "torch"  # the inner AdamW: torch's, or NVIDIA apex's FusedAdam where installed
    # The inner optimizer: AdamW on everything, or Muon on the hidden matrices (at inner_muon_lr,
    # momentum inner_muon_momentum) with AdamW (the optimizer's lr, betas) on the rest, as Muon is run
    inner_optimizer: str = "adamw"
    inner_muon_lr: float = 0.02
    inner_muon_momentum: float = 0.95
    streaming: StreamingSettings = field(default_factory=StreamingSettings)
    # Class attributes, not settings: overridden by fields where a method has outer momentum.
    outer_momentum = 0.0
    nesterov = False

    def __post_init__(self):
        # JSON gives the pairs as lists: tuples, as the keyword form and a frozen object want
        schedule = self.sync_every_schedule
        if isinstance(schedule, (list, tuple)) and all(isinstance(e, (list, tuple)) for e in schedule):
            object.__setattr__(self, "sync_every_schedule", tuple(tuple(e) for e in schedule))

    # -- the sync schedule: a pure function of the step (nothing to checkpoint) ------------------
    def smallest_interval(self) -> int:
        return min([self.sync_every, *(h for _, h in self.sync_every_schedule)])

    def _sync_runs(self, fragment: int):
        """The fragment's sync steps as runs of equal spacing: (first sync step of the run, its H,
        the step the run stops before, None for the last), one per schedule segment it syncs in.
        Its first sync is at (fragment + 1) * sync_every // fragments, each next at the last + H(last)."""
        starts = [start for start, _ in self.sync_every_schedule]
        s = (fragment + 1) * self.sync_every // self.streaming.fragments
        for h, end in zip([self.sync_every, *(h for _, h in self.sync_every_schedule)], [*starts, None]):
            if end is not None and s >= end:
                continue  # no sync of this fragment falls in this segment
            yield s, h, end
            if end is None:
                return
            s += -(-(end - s) // h) * h  # the run's first sync at or past its end

    def next_sync(self, fragment: int, step: int) -> int:
        """The first local step >= ``step`` at which ``fragment`` syncs."""
        for s, h, end in self._sync_runs(fragment):
            at = s if step <= s else s + -(-(step - s) // h) * h
            if end is None or at < end:
                return at
        raise AssertionError("unreachable: the last run has no end")

    def syncs_in(self, steps: int, fragment: int = 0) -> int:
        """How many syncs ``fragment`` makes in local steps 1 .. ``steps`` (what a sync's bytes
        are multiplied by over a budget)."""
        count = 0
        for s, h, end in self._sync_runs(fragment):
            last = steps if end is None else min(steps, end - 1)
            if s > last:
                break
            count += (last - s) // h + 1
        return count

    def check(self, where: str) -> None:
        super().check(where)
        check_int(where, "sync_every", self.sync_every, 1)
        _check_schedule(where, self.sync_every_schedule)
        check_positive(where, "outer_lr", self.outer_lr)
        check_choice(where, "outer_optimizer", self.outer_optimizer, OUTER_OPTIMIZERS)
        if not isinstance(self.outer_betas, tuple) or len(self.outer_betas) != 2:
            raise ConfigError(f"{where}.outer_betas must be a list of two numbers in [0, 1); got {self.outer_betas!r}")
        for beta in self.outer_betas:
            check_fraction(where, "outer_betas[]", beta)
        check_positive(where, "outer_eps", self.outer_eps)
        check_nonnegative(where, "outer_weight_decay", self.outer_weight_decay)
        check_choice(where, "inner_impl", self.inner_impl, INNER_IMPLS)
        check_choice(where, "inner_optimizer", self.inner_optimizer, INNER_OPTIMIZERS)
        if self.inner_optimizer == "muon" and self.inner_impl != "torch":
            raise ConfigError(f"{where}.inner_impl must be torch with inner_optimizer muon (torch's Muon); "
                              f"got {self.inner_impl!r}")
        check_positive(where, "inner_muon_lr", self.inner_muon_lr)
        check_fraction(where, "inner_muon_momentum", self.inner_muon_momentum)
        self.streaming.check_against(where, self.smallest_interval())

    def unused_keys(self) -> dict[str, str]:
        out = super().unused_keys()
        if self.inner_optimizer != "muon":
            for key in ("inner_muon_lr", "inner_muon_momentum"):
                out[key] = (f"ds_lowcomm's inner Muon's settings, which apply with inner_optimizer muon only; "
                            f"got inner_optimizer {self.inner_optimizer}")
        if self.outer_optimizer == "sgd":
            for key in ("outer_betas", "outer_eps"):
                out[key] = "the outer Adam's (outer_optimizer adam or adamw); got outer_optimizer sgd"
        return out


@dataclass(frozen=True)
class DiLoCoSettings(OuterSettings):
    outer_momentum: float = 0.9
    nesterov: bool = True

    def check(self, where: str) -> None:
        super().check(where)
        check_fraction(where, "outer_momentum", self.outer_momentum)
        check_bool(where, "nesterov", self.nesterov)

    def unused_keys(self) -> dict[str, str]:
        out = super().unused_keys()
        if self.outer_optimizer != "sgd":
            for key in ("outer_momentum", "nesterov"):
                out[key] = f"the outer SGD's (outer_optimizer sgd); got outer_optimizer {self.outer_optimizer}"
        elif not self.outer_momentum:
            out["nesterov"] = "Nesterov's form of the outer momentum, which is 0 (outer_momentum)"
        return out


# How a sync's compressed pseudo-gradients travel: every rank's payload to every rank
# ("all_gather"), or the compressed all-reduce of comm/compressed_allreduce.py ("all_reduce": one
# sign bit an element each way, then ceil(log2 n) bits of the exact count of positive signs, for a
# dense sign payload: every element kept, transform none, value_dtype sign); "auto": the all-reduce
# from 4 replicas for such payloads (where it sends fewer bytes), the all-gather otherwise. Chosen
# once, when the optimizer is built.
EXCHANGES = ("auto", "all_gather", "all_reduce")


def dense_sign(codec: CodecSettings) -> bool:
    """Whether ``codec`` sends every element as one sign bit (what the compressed all-reduce takes)."""
    return codec.transform == "none" and codec.topk == codec.chunk * codec.chunk and codec.value_dtype == "sign"


# From this many replicas the compressed all-reduce sends fewer bytes than the all-gather (at 3,
# as many: 2/3 x (1 + 2 bits) an element against 2 payloads of 1 bit, with a round trip more)
ALL_REDUCE_FROM = 4


def resolve_exchange(exchange: str, codec: CodecSettings, world_size: int) -> str:
    """``exchange`` setting -> "all_gather" or "all_reduce" for syncs among ``world_size``
    replicas (auto: the compressed all-reduce from ALL_REDUCE_FROM replicas, for a dense sign payload)."""
    if exchange != "auto":
        return exchange
    return "all_reduce" if dense_sign(codec) and world_size >= ALL_REDUCE_FROM else "all_gather"


@dataclass(frozen=True)
class ErrorFeedbackSettings(StatefulSettings):
    """What dct_diloco and sparseloco share: the error-feedback buffer each sync is coded from
    (decayed by ``decay`` before the new pseudo-gradient is added), the codec, and the exchange."""

    decay: float = 0.9
    codec: CodecSettings = field(default_factory=CodecSettings)
    exchange: str = "auto"  # EXCHANGES

    def check(self, where: str) -> None:
        super().check(where)
        check_fraction(where, "decay", self.decay)
        check_choice(where, "exchange", self.exchange, EXCHANGES)
        if self.exchange == "all_reduce" and not dense_sign(self.codec):
            c = self.codec
            raise ConfigError(f"{where}.exchange all_reduce needs one sign bit for every element ({where}.transform "
                              f"none, {where}.topk = chunk*chunk = {c.chunk * c.chunk}, {where}.value_dtype sign); "
                              f"got transform {c.transform!r}, topk {c.topk}, value_dtype {c.value_dtype!r} "
                              "(use exchange all_gather or auto)")
        if self.exchange == "all_reduce" and self.codec.compile:
            raise ConfigError(f"{where}.compile true compiles the sparse all-gather's codec; {where}.exchange all_reduce "
                              "has no compiled form: set compile false, or exchange all_gather")


@dataclass(frozen=True)
class DCTDiLoCoSettings(DiLoCoSettings, ErrorFeedbackSettings):
    pass


@dataclass(frozen=True)
class SparseLoCoSettings(OuterSettings, ErrorFeedbackSettings):
    """SparseLoCo's published recipe: H 30, outer lr 1, error feedback 0.95, 64 of 4096 per
    64x64 chunk without a transform, 2-bit values; no outer momentum."""

    sync_every: int = 30
    outer_lr: float = 1.0
    decay: float = 0.95
    codec: CodecSettings = field(default_factory=lambda: CodecSettings(
        topk=64, chunk=64, value_dtype="2bit", transform="none", average="world"))


# The settings a checkpoint saved before they existed lacks (the outer optimizer's, the inner
# optimizer's choice, the overlapped landings, the growing H); it was made with their defaults.
_OUTER_OPTIMIZER_KEYS = ("outer_optimizer", "outer_betas", "outer_eps", "outer_weight_decay")
_INNER_OPTIMIZER_KEYS = ("inner_optimizer", "inner_muon_lr", "inner_muon_momentum")
_LANDING_KEYS = ("carry_local_steps", "sync_every_schedule")
# Settings since removed, with the values their checkpoints hold when unused.
_REMOVED_KEYS = {"subset_fraction": 1.0, "low_rank": 0, "eager": False}


def build_outer_optimizer(settings: OuterSettings, anchors: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The torch optimizer ``settings.outer_optimizer`` over ``anchors``. Each anchor is stepped on
    its own (``foreach=False``): once per sync that costs nothing, and on every device "sgd" then
    runs the very kernels of the hand-written step it replaced, so its results are bit for bit those."""
    common = dict(lr=settings.outer_lr, weight_decay=settings.outer_weight_decay, foreach=False)
    if settings.outer_optimizer == "sgd":
        mu = settings.outer_momentum
        # torch refuses nesterov without momentum, which the hand-written step ignored
        return torch.optim.SGD(anchors, momentum=mu, nesterov=settings.nesterov and mu > 0, **common)
    adam = torch.optim.Adam if settings.outer_optimizer == "adam" else torch.optim.AdamW
    return adam(anchors, betas=settings.outer_betas, eps=settings.outer_eps, **common)


class _AnchorState(MutableMapping):
    """The outer optimizer's state of one anchor, kept in the method's state of its parameter, so
    that ``state_dict()`` holds it per parameter beside the anchor (ZeRO partitions and shards
    alike) and a load restores it with the method's. Keys are stored as ``outer_opt_<key>``, but
    SGD's momentum buffer keeps the name it had before the outer step was a torch optimizer,
    ``outer_momentum``: checkpoints of the default load as they are."""

    _PREFIX = "outer_opt_"

    def __init__(self, state: dict):
        self._state = state

    def _key(self, key: str) -> str:
        return "outer_momentum" if key == "momentum_buffer" else self._PREFIX + key

    def __getitem__(self, key):
        return self._state[self._key(key)]

    def __setitem__(self, key, value):
        self._state[self._key(key)] = value

    def __delitem__(self, key):
        del self._state[self._key(key)]

    def __iter__(self):
        for key in list(self._state):
            if key == "outer_momentum":
                yield "momentum_buffer"
            elif key.startswith(self._PREFIX):
                yield key[len(self._PREFIX):]

    def __len__(self):
        return sum(1 for _ in self)


class OuterLoop(LowcommOptimizer):
    """Base of the DiLoCo family. It wraps ``inner`` and *is* its param_groups: LR schedulers
    and DeepSpeed see (and may swap, as ZeRO does per step) the inner optimizer's groups."""

    settings_class = OuterSettings
    reads_state_at_exchange = True  # each sync's pseudo-gradients come from the anchors when it runs

    def __init__(self, inner: torch.optim.Optimizer, *, settings: OuterSettings | None = None,
                 transport: Transport | None = None, shard: ReplicaShard | None = None, ledger_steps: bool = True,
                 clip_grad: float = 0.0, **flat_settings):
        """``flat_settings``: the method's settings as keywords (``sync_every=500``, ...), or one
        ``settings=`` object of the method's settings class."""
        settings = self.resolve_settings(settings, flat_settings)
        super().__init__(ordered_params(inner.param_groups), {})
        self.inner = inner  # from here on, param_groups are the inner optimizer's
        self.__dict__.pop("_own_groups", None)
        # fragment (its param ids) -> (the params this rank syncs, their sync in flight)
        self._in_flight: dict[tuple[int, ...], tuple[list[torch.Tensor], Pending]] = {}
        self._fragment_cache: dict[tuple[int, ...], list[list[torch.Tensor]]] = {}
        # The torch optimizer over the anchors, built at the first sync; a param group is added for
        # each fragment's anchors at its first sync (and again after a load replaced the anchors).
        self.anchor_optimizer: torch.optim.Optimizer | None = None
        self._anchor_ids: set[int] = set()
        self._init_comm(settings, transport, shard, ledger_steps, clip_grad, inner=type(inner).__name__)

    @property
    def param_groups(self):
        if "inner" in self.__dict__:
            return self.inner.param_groups
        return self.__dict__.setdefault("_own_groups", [])  # only while Optimizer.__init__ runs

    @param_groups.setter
    def param_groups(self, groups):
        if "inner" in self.__dict__:
            self.inner.param_groups = groups
        else:
            self.__dict__["_own_groups"] = groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @property
    def outer_steps(self) -> int:
        """Outer steps applied to the first parameter currently in param_groups."""
        params = self._current_params()
        return self.state[params[0]].get("outer_steps", 0) if params else 0

    # -- the fragment schedule ---------------------------------------------------------------
    def fragments_of(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """``params`` cut into ``fragments`` contiguous groups of about equal element count."""
        key = tuple(id(p) for p in params)
        cached = self._fragment_cache.get(key)
        if cached is not None:
            return cached
        n = self.settings.streaming.fragments
        if len(params) < n:
            raise ValueError(f"lowcomm.fragments is {n} but this optimizer steps {len(params)} tensor(s) at a time "
                             "(ZeRO 1-3 hand it one flat partition): use fragments <= the number of tensors")
        out = contiguous_fragments(params, n)
        self._fragment_cache[key] = out
        return out

    def _sends_at(self, fragment: int, step: int) -> bool:
        return self.settings.next_sync(fragment, step) == step

    # -- the step ----------------------------------------------------------------------------
    def _update(self, params):
        owned_ids = {id(p) for p in self._owned(params)}
        for p in params:
            state = self.state[p]
            if "local_step" not in state:
                state["local_step"] = 0
                state["outer_steps"] = 0
            if id(p) in owned_ids and "anchor" not in state:  # the global parameters every replica starts from
                state["anchor"] = p.detach().to(self.state_dtype, copy=True)
                if self.settings.outer_optimizer == "sgd" and self.settings.outer_momentum > 0:
                    # Zeros, as before SGD was torch's: torch would start from a copy of the first
                    # update (equal but for the sign of zeros), and checkpoints keep their keys.
                    state["outer_momentum"] = torch.zeros_like(state["anchor"])
        if self._grads_finite([p.grad for p in params], "inner_step"):  # else this replica skips this inner step
            self._clip_(params)  # this replica's own gradient, before its inner step
            self.inner.step()
        for p in params:
            self.state[p]["local_step"] += 1
        t = self.state[params[0]]["local_step"]
        for _, pending in self._in_flight.values():  # sent at an earlier step: its next phase goes out now
            pending.advance()
        for f, fragment in enumerate(self.fragments_of(params)):
            owned = [p for p in fragment if id(p) in owned_ids]
            if self._sends_at(f, t) and not self.settings.streaming.sync_delay:
                self._sync_now(fragment, owned)  # sent and landed in this step
                continue
            if self._sends_at(f, t):
                self._send(fragment, owned, t)
            if self.state[fragment[0]].get("sync_sent_at") == t - self.settings.streaming.sync_delay:
                self._land(fragment, owned)

    def step_count(self) -> int:
        params = self._current_params()
        return int(self.state[params[0]].get("local_step", 0)) if params else 0

    def skip_to_next_exchange(self) -> int | None:
        params = self._current_params()
        if not params or "local_step" not in self.state[params[0]]:
            return None
        jump = self.steps_to_next_sync(int(self.state[params[0]]["local_step"])) - 1
        for p in params:
            self.state[p]["local_step"] += jump
        return jump

    def synced_values(self):
        return [self.state[p].get("anchor") for p in self._current_params()]

    def steps_to_next_sync(self, step: int) -> int:
        """Inner steps from local step ``step`` to the next one at which a fragment syncs."""
        return min(self.settings.next_sync(f, step + 1) for f in range(self.settings.streaming.fragments)) - step

    def _send(self, fragment: list[torch.Tensor], owned: list[torch.Tensor], step: int) -> None:
        for p in fragment:
            self.state[p]["sync_sent_at"] = step
        if owned:
            if self.settings.streaming.carry_local_steps:  # where this replica's in-flight steps start
                for p in owned:
                    # in the parameter's own dtype: an exact copy, so the progress is exact whatever state_dtype
                    self.state[p]["sent_from"] = p.detach().clone()
            deltas = [self.state[p]["anchor"] - p.to(self.state_dtype) for p in owned]
            self._in_flight[tuple(id(p) for p in fragment)] = (owned, self._start_combine(owned, deltas))

    def _land(self, fragment: list[torch.Tensor], owned: list[torch.Tensor]) -> None:
        if owned:
            in_flight = self._in_flight.pop(tuple(id(p) for p in fragment), None)
            # After state_dict() (a checkpoint) the landed result waits in the state instead.
            updates = in_flight[1].wait() if in_flight else [self.state[p].pop("landed_update") for p in owned]
            carried = None
            if self.settings.streaming.carry_local_steps:
                carried = [p.float() - self.state[p].pop("sent_from").float() for p in owned]
            self._apply_outer(owned, updates, carried)
        self._share(fragment)
        for p in fragment:
            state = self.state[p]
            del state["sync_sent_at"]
            state["outer_steps"] += 1

    def _sync_now(self, fragment: list[torch.Tensor], owned: list[torch.Tensor]) -> None:
        """A fragment's sync, sent and landed in this step (sync_delay 0). Where a driver
        discarded it (fault tolerance: no try of it could be committed), the parameters go back to
        the anchors (this interval's local progress is lost, as the others' is, so every replica
        starts the next one alike)."""

        def run():
            deltas = [self.state[p]["anchor"] - p.to(self.state_dtype) for p in owned]
            return self._start_combine(owned, deltas).wait() if owned else []

        # every rank of a replica runs it, its owned parameters or none (a driver asks each: the answer is the replica's)
        updates = self._run_exchange(self._exchanged(owned), run)
        if owned:
            if updates is not None:
                self._apply_outer(owned, updates)
            else:
                for p in owned:
                    p.copy_(self.state[p]["anchor"].to(p.dtype))
        self._share(fragment)
        for p in fragment:
            self.state[p]["outer_steps"] += updates is not None

    def _exchanged(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """What a sync changes in place in these parameters' state (kept for a try that fails):
        nothing here (the pseudo-gradients are made afresh; the anchors and the outer optimizer
        change only once it is committed)."""
        return []

    def _apply_outer(self, params: list[torch.Tensor], updates: list[torch.Tensor],
                     carried: list[torch.Tensor] | None = None) -> None:
        """The outer optimizer steps these parameters' anchors along ``updates`` (their ``.grad``;
        the other anchors have none, so it leaves them be); the parameters take the new anchors
        (plus ``carried``, this replica's steps since the send, with ``carry_local_steps``)."""
        anchors = [self.state[p]["anchor"] for p in params]
        optimizer = self._anchor_optimizer_for(params)
        for anchor, update in zip(anchors, updates):
            # The compressed exchanges decode to fp32; a torch optimizer takes a .grad of its
            # parameter's dtype, so with state_dtype bf16/fp16 the outer step runs in that dtype.
            anchor.grad = update.to(anchor.dtype)
        try:
            optimizer.step()
        finally:
            for anchor in anchors:
                anchor.grad = None
        mix = self.settings.streaming.fragment_mix
        for i, (p, anchor) in enumerate(zip(params, anchors)):
            if carried is not None:
                p.copy_(anchor.float() + carried[i])  # one rounding to the parameter's dtype
            elif mix:
                p.mul_(mix).add_(anchor.to(p.dtype), alpha=1.0 - mix)
            else:
                p.copy_(anchor)

    def _anchor_optimizer_for(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        """The outer optimizer, holding these parameters' anchors, its state for each a view of the
        parameter's state (:class:`_AnchorState`)."""
        new = [p for p in params if id(self.state[p]["anchor"]) not in self._anchor_ids]
        if new:
            anchors = [self.state[p]["anchor"] for p in new]
            if self.anchor_optimizer is None:
                self.anchor_optimizer = build_outer_optimizer(self.settings, anchors)
            else:
                self.anchor_optimizer.add_param_group({"params": anchors})
            for p, anchor in zip(new, anchors):
                self.anchor_optimizer.state[anchor] = _AnchorState(self.state[p])
                self._anchor_ids.add(id(anchor))
        return self.anchor_optimizer

    def _start_combine(self, params: list[torch.Tensor], deltas: list[torch.Tensor]) -> Pending:
        """Local pseudo-gradients -> (in flight) the update every replica applies, identical on all."""
        raise NotImplementedError

    # -- checkpointing: outer state here, the inner optimizer's under "inner" ---------------
    def replica_tensors(self):
        # Between outer steps the replicas' parameters differ by design; their anchors never do.
        return [self.state[p].get("anchor", p) for p in self._owned(self._current_params())]

    def state_dict(self):
        # A sync in flight cannot be saved: let it land now and keep its result for its step.
        for owned, pending in self._in_flight.values():
            for p, update in zip(owned, pending.wait()):
                self.state[p]["landed_update"] = update
        self._in_flight.clear()
        return super().state_dict()

    def _extra_state(self):
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state_dict):
        lowcomm = state_dict.get("lowcomm") if isinstance(state_dict, dict) else None
        if lowcomm is not None:
            saved = dict(lowcomm["settings"])
            for key, default in _REMOVED_KEYS.items():  # saved before they were removed
                if key in saved and saved.pop(key) != default:
                    raise ValueError(f"the checkpoint was saved with lowcomm.{key}, a setting this release removed "
                                     f"(it lost on its numbers): resume it with the release that wrote it")
            # Saved before these were settings: with their defaults (the state's keys did not change).
            defaults = self.settings_class().flat()
            missing = [k for k in (*_OUTER_OPTIMIZER_KEYS, *_INNER_OPTIMIZER_KEYS, *_LANDING_KEYS) if k not in saved]
            saved = {**{k: defaults[k] for k in missing}, **saved}
            state_dict = {**state_dict, "lowcomm": {**lowcomm, "settings": saved}}
        super().load_state_dict(state_dict)

    def _load_extra_state(self, extra):
        self.inner.load_state_dict(extra["inner"])
        self._in_flight.clear()
        # The load replaced the anchors and their state: the outer optimizer is rebuilt around them.
        self.anchor_optimizer, self._anchor_ids = None, set()

    # -- declared costs (see LowcommOptimizer.planned_wire) --
    @classmethod
    def local_optimizer(cls, settings, given=None):
        return given or settings.inner_optimizer  # given: DeepSpeed's Muon section as the inner optimizer

    @classmethod
    def planned_wire(cls, settings, shapes, *, replicas=2, **_):
        from ..comm.wire import WirePlan  # (the declarations' imports stay beside them)

        # a growing H priced at its last value: a long run spends nearly all its steps there
        schedule = settings.sync_every_schedule
        h, n = (schedule[-1][1] if schedule else settings.sync_every), settings.streaming.fragments
        parts = [list(shapes)] if n <= 1 else [
            [tuple(t.shape) for t in group]
            for group in contiguous_fragments([torch.empty(s, device="meta") for s in shapes], n)]
        # fragment f syncs after steps (f + 1) H // P, then every H (_sends_at)
        return WirePlan(h, tuple(tuple(cls._planned_sync(settings, part, replicas)) for part in parts),
                        tuple((f + 1) * h // n for f in range(len(parts))))

    @classmethod
    def _planned_sync(cls, settings, shapes, replicas: int) -> list:
        """The messages of one sync of tensors of ``shapes`` (``_start_combine``'s)."""
        raise NotImplementedError

    @classmethod
    def planned_state_bytes(cls, settings, shapes, *, matrices=None, param_bytes=4, local_optimizer=None):
        from ..comm.wire import elements
        from .muon import dense_state_bytes

        state = cls.state_element_bytes(settings)
        if settings.outer_optimizer == "sgd":
            outer = state if settings.outer_momentum else 0  # its momentum buffer
        else:
            outer = 2 * state  # Adam's two moments
        # carry_local_steps: while a sync is in flight, a copy of its parameters at the send (their
        # own dtype); counted whole, the peak with one fragment
        carried = param_bytes if settings.streaming.carry_local_steps else 0
        inner = dense_state_bytes(cls.local_optimizer(settings, local_optimizer), shapes, matrices, param_bytes)
        return inner + (state + outer + carried) * elements(shapes)  # + the anchor


class DiLoCo(OuterLoop):
    method = "diloco"
    settings_class = DiLoCoSettings

    def _start_combine(self, params, deltas):
        pending = self._start_mean_(params, deltas, "outer_all_reduce")
        return Pending(lambda: (pending.wait(), deltas)[1], None)

    @classmethod
    def _planned_sync(cls, settings, shapes, replicas):
        from ..comm.wire import dense_mean_messages, elements

        return dense_mean_messages("outer_all_reduce", [elements(shapes) * cls.state_element_bytes(settings)],
                                   settings.streaming.sync_delay)


class DCTDiLoCo(OuterLoop):
    method = "dct_diloco"
    settings_class = DCTDiLoCoSettings
    replica_state = ("residual",)  # each replica's own pseudo-gradients not sent yet

    def __init__(self, inner, **kwargs):
        super().__init__(inner, **kwargs)
        # How the syncs travel, chosen once: by the replicas of this group, or under fault tolerance
        # (torchft: members come and go) by the payload alone (the all-reduce keeps no state between
        # syncs, so it runs at any quorum's size, and at 2 or 3 sends the all-gather's bytes).
        fixed_group = getattr(self.transport, "checks_at_start", True)
        replicas = self.transport.world_size if fixed_group else ALL_REDUCE_FROM
        self.exchange = resolve_exchange(self.settings.exchange, self.settings.codec, replicas)
        if self.exchange == "all_reduce" and self.settings.codec.compile:
            raise ConfigError(f"lowcomm.compile true compiles the sparse all-gather's codec; these syncs go through "
                              f"the compressed all-reduce (exchange {self.settings.exchange}"
                              f"{' at ' + str(replicas) + ' replicas' if self.settings.exchange == 'auto' else ''}), "
                              "which has no compiled form: set compile false, or exchange all_gather")
        self._all_reduces: dict[tuple[int, ...], CompressedAllReduce] = {}

    def set_routes(self, routes):
        if self.exchange != "all_gather":
            if self.settings.exchange == "all_reduce":
                raise ConfigError("lowcomm.exchange all_reduce is not supported with replicas of different shapes "
                                  "(each route's chunks would differ); use all_gather or auto")
            self.exchange = "all_gather"
        super().set_routes(routes)

    def _exchanged(self, params):
        return [self._residual(p) for p in params]  # decayed, added to and sent from by each sync

    def _all_reduce_for(self, params) -> CompressedAllReduce:
        """The compressed all-reduce of these parameters among this group's (quorum's) ranks."""
        key = (*(id(p) for p in params), self.transport.world_size)  # another size cuts other chunks
        sync = self._all_reduces.get(key)
        if sync is None:
            sync = self._all_reduces[key] = CompressedAllReduce(
                [self._pieces.get(id(p), p.shape) for p in params], transport=self.transport,
                op="outer_compressed_all_reduce")
        return sync

    def _residual(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "residual" not in state:
            state["residual"] = torch.zeros_like(state["anchor"])
        return state["residual"]

    def _start_combine(self, params, deltas):
        """The residuals take the pseudo-gradients and go out through the codec: what they send leaves
        them (at once through the all-gather, once it lands through the all-reduce); the means
        arrive on wait()."""
        finite = all_finite(deltas)  # if not, the residuals stay as they are and this rank sits out
        residuals = []
        for p, delta in zip(params, deltas):
            residual = self._residual(p)
            if finite:
                residual.mul_(self.settings.decay).add_(delta)
            residuals.append(residual)
        healthy = self._healthy() and finite
        if not params:
            return Pending(lambda: [], None)
        if self.exchange == "all_reduce":
            return self._all_reduce_for(params).start(residuals, healthy)
        return self._sync_for(params, "outer_sparse_all_gather").start(residuals, healthy)

    def load_state_dict(self, state_dict):
        lowcomm = state_dict.get("lowcomm") if isinstance(state_dict, dict) else None
        if lowcomm is not None:
            saved = dict(lowcomm["settings"])
            if "exchange" not in saved:  # saved before exchange was a setting: its syncs were all-gathers
                saved["exchange"] = "all_gather"
            if self.settings.exchange == "auto" and saved["exchange"] == self.exchange:
                saved["exchange"] = "auto"  # saved when the record held what auto resolved to
            # An earlier release's all-reduce rounded the mean again and kept that rounding's rest (its
            # server error, under these keys): less than one sync's rounding, which this one never makes.
            old = [k for k in ("server_error", "server_chunk") if k in lowcomm]
            states = {i: {k: v for k, v in st.items() if k != "whole_server_error"}
                      for i, st in state_dict.get("state", {}).items()}
            if old or any(len(states[i]) != len(st) for i, st in state_dict.get("state", {}).items()):
                logger.warning("this checkpoint holds the server error of an earlier release's compressed all-reduce "
                               "(a rounding rest of its last sync); this release's all-reduce has none: dropped")
            lowcomm = {k: v for k, v in lowcomm.items() if k not in old}
            state_dict = {**state_dict, "state": states, "lowcomm": {**lowcomm, "settings": saved}}
        super().load_state_dict(state_dict)

    @classmethod
    def _planned_sync(cls, settings, shapes, replicas):
        from ..comm.wire import compressed_all_reduce_messages, sparse_all_gather_message

        delay = settings.streaming.sync_delay
        if resolve_exchange(settings.exchange, settings.codec, replicas) == "all_reduce":
            return compressed_all_reduce_messages("outer_compressed_all_reduce", shapes, replicas, delay)
        return [sparse_all_gather_message("outer_sparse_all_gather", shapes, settings.codec, delay)]

    @classmethod
    def planned_state_bytes(cls, settings, shapes, **kwargs):
        from ..comm.wire import elements

        residual = cls.state_element_bytes(settings) * elements(shapes)  # the error feedback
        return super().planned_state_bytes(settings, shapes, **kwargs) + residual


class SparseLoCo(DCTDiLoCo):
    """DCT-DiLoCo's error-feedback sync with SparseLoCo's defaults and no outer momentum."""

    method = "sparseloco"
    settings_class = SparseLoCoSettings
