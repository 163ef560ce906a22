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
are kept, as overlapped Local SGD / CO2 keep them, instead of being overwritten). P = 1 with no
delay is plain DiLoCo.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass, field

import torch

from ..codec import CodecSettings, orthonormal_columns, shared_randn, shared_subset
from ..comm import (ByteLedger, CompressedAllReduce, Pending, ReplicaShard, SparseAllGather, Transport, all_finite,
                    start_all_reduce_mean_)
from ..settings import (ConfigError, Settings, check_bool, check_choice, check_fraction, check_int, check_nonnegative,
                        check_positive, check_unit)
from .base import LowcommOptimizer, StatefulSettings, ordered_params

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
    checked by the outer loop's settings."""

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
        check_int(where, "fragments", self.fragments, 1, sync_every, hint="sync_every: one fragment sync per step at most")
        check_int(where, "sync_delay", self.sync_delay, 0, sync_every - 1,
                  hint="a fragment's sync must land before its next one starts")
        if self.carry_local_steps and not self.sync_delay:
            raise ConfigError(f"{where}.carry_local_steps needs {where}.sync_delay >= 1 (with 0 a sync lands at its "
                              "send: there are no steps in flight to carry)")


@dataclass(frozen=True)
class OuterSettings(StatefulSettings):
    """What the whole DiLoCo family shares: H, the outer optimizer, the inner optimizer's
    implementation, streaming."""

    sync_every: int = 128  # H: inner steps per outer step
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

    def check(self, where: str) -> None:
        super().check(where)
        check_int(where, "sync_every", self.sync_every, 1)
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
        self.streaming.check_against(where, self.sync_every)

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
# ("all_gather"), or the two-phase compressed all-reduce of comm/compressed_allreduce.py
# ("all_reduce": about 2 payloads per rank whatever the number of replicas, for dense payloads:
# every element kept, transform none); "auto": the all-reduce at 3 or more replicas for the sign
# and 2-bit formats on dense payloads (where it sends fewer bytes), the all-gather otherwise.
EXCHANGES = ("auto", "all_gather", "all_reduce")
ALL_REDUCE_AUTO_FORMATS = ("sign", "2bit")


def _check_exchange(where: str, exchange: str, codec: CodecSettings) -> None:
    check_choice(where, "exchange", exchange, EXCHANGES)
    if exchange == "all_reduce" and (codec.transform != "none" or codec.topk != codec.chunk * codec.chunk):
        raise ConfigError(f"{where}.exchange all_reduce needs a dense payload ({where}.transform none and {where}.topk = "
                          f"chunk*chunk = {codec.chunk * codec.chunk}: every element kept); got transform "
                          f"{codec.transform!r}, topk {codec.topk} (use exchange all_gather or auto)")


def _check_below_one_bit(where: str, settings) -> None:
    """``subset_fraction`` and ``low_rank`` (the fields below): their bounds and what they exclude."""
    f = settings.subset_fraction
    if not (isinstance(f, (int, float)) and not isinstance(f, bool) and 0.0 < f <= 1.0):
        raise ConfigError(f"{where}.subset_fraction must be a number in (0, 1] (1: every element); got {f!r}")
    check_int(where, "low_rank", settings.low_rank, 0, hint="0: off")
    if f < 1.0 and settings.low_rank:
        raise ConfigError(f"{where}.subset_fraction and {where}.low_rank are two ways below one bit a parameter: set "
                          f"one (got subset_fraction {f}, low_rank {settings.low_rank})")
    if f < 1.0 and settings.exchange == "all_reduce":
        raise ConfigError(f"{where}.exchange all_reduce does not take subset_fraction < 1 (its server error is kept per "
                          f"position, and the subset moves every sync); use exchange all_gather or auto, or "
                          f"subset_fraction 1 (got {f})")


# Per-parameter state a checkpoint holds in place of the server error chunks (spread_server_error).
WHOLE_SERVER_ERROR = "whole_server_error"


def resolve_exchange(exchange: str, codec: CodecSettings, world_size: int, subset_fraction: float = 1.0) -> str:
    """``exchange`` setting -> "all_gather" or "all_reduce" for a sync among ``world_size``
    replicas (auto: the compressed all-reduce at 3 or more, for a dense sign / 2-bit payload; a
    random subset (``subset_fraction`` < 1) moves every sync, where auto keeps the all-gather).
    A fixed group decides once; under fault tolerance each quorum decides by its own size."""
    if exchange != "auto":
        return exchange
    if subset_fraction < 1.0:
        return "all_gather"
    dense = codec.transform == "none" and codec.topk == codec.chunk * codec.chunk
    fits = dense and codec.value_dtype in ALL_REDUCE_AUTO_FORMATS and world_size >= 3
    return "all_reduce" if fits else "all_gather"


@dataclass(frozen=True)
class DCTDiLoCoSettings(DiLoCoSettings):
    decay: float = 0.9  # of the error-feedback buffer the top-k components are taken from
    codec: CodecSettings = field(default_factory=CodecSettings)
    exchange: str = "auto"  # EXCHANGES
    # Below one bit a parameter a sync (issue 56), one or the other:
    # - subset_fraction f < 1: a sync sends ceil(f * n) of each tensor's n elements through the codec,
    #   the same positions on every replica, drawn from the sync's number (no index travels); error
    #   feedback keeps the rest for later syncs.
    # - low_rank r > 0: each matrix's buffer M (2-D and up, as rows x rest) travels as rank-r
    #   factors, averaged by two dense fp32 all-reduces (PowerSGD's power step: P = M Q, P
    #   orthonormalised, Q = M^T P; Q warm-started from the last sync); what P P^T M leaves stays in
    #   the buffer. Other tensors go through the codec as before.
    subset_fraction: float = 1.0
    low_rank: int = 0

    def check(self, where: str) -> None:
        super().check(where)
        check_fraction(where, "decay", self.decay)
        _check_exchange(where, self.exchange, self.codec)
        _check_below_one_bit(where, self)


@dataclass(frozen=True)
class SparseLoCoSettings(OuterSettings):
    """SparseLoCo's published recipe: H 30, outer lr 1, error feedback 0.95, 64 of 4096 per
    64x64 chunk without a transform, 2-bit values; no outer momentum."""

    sync_every: int = 30
    outer_lr: float = 1.0
    decay: float = 0.95
    codec: CodecSettings = field(default_factory=lambda: CodecSettings(
        topk=64, chunk=64, value_dtype="2bit", transform="none", average="world"))
    exchange: str = "auto"  # EXCHANGES
    # below one bit a parameter a sync: as DCTDiLoCoSettings's
    subset_fraction: float = 1.0
    low_rank: int = 0

    def check(self, where: str) -> None:
        super().check(where)
        check_fraction(where, "decay", self.decay)
        _check_exchange(where, self.exchange, self.codec)
        _check_below_one_bit(where, self)


# The settings a checkpoint saved before they existed lacks (the outer optimizer's, the inner
# optimizer's choice, the overlapped landing); it was made with their defaults.
_OUTER_OPTIMIZER_KEYS = ("outer_optimizer", "outer_betas", "outer_eps", "outer_weight_decay")
_INNER_OPTIMIZER_KEYS = ("inner_optimizer", "inner_muon_lr", "inner_muon_momentum")
_LANDING_KEYS = ("carry_local_steps",)


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
        h = self.settings.sync_every
        offset = (fragment + 1) * h // self.settings.streaming.fragments
        return step >= offset and (step - offset) % h == 0

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
        ahead = 1
        while not any(self._sends_at(f, step + ahead) for f in range(self.settings.streaming.fragments)):
            ahead += 1
        return ahead

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
        missing = [k for k in (*_OUTER_OPTIMIZER_KEYS, *_INNER_OPTIMIZER_KEYS, *_LANDING_KEYS)
                   if lowcomm is not None and k not in lowcomm["settings"]]
        if missing:
            # Saved before these were settings: with their defaults (the state's keys did not change).
            defaults = self.settings_class().flat()
            saved = {**{k: defaults[k] for k in missing}, **lowcomm["settings"]}
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

        h, n = settings.sync_every, settings.streaming.fragments
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
        self._fixed_group = getattr(self.transport, "checks_at_start", True)  # torchft's: members change
        if self.settings.low_rank and not self._fixed_group:
            raise ConfigError("lowcomm.low_rank is not supported with lowcomm.fault_tolerance yet (its warm-started "
                              "factors change inside a sync's tries); use low_rank 0 (subset_fraction runs there)")
        # "all_gather" or "all_reduce" in a fixed group: the record (and so a checkpoint) holds what
        # the syncs do. Under fault tolerance, auto stays "auto": each quorum picks by its own size.
        # (a format auto never sends through the all-reduce is "all_gather" there too).
        many = self.transport.world_size if self._fixed_group else 3
        self.exchange = resolve_exchange(self.settings.exchange, self.settings.codec, many,
                                         self.settings.subset_fraction)
        if not self._fixed_group and self.settings.exchange == "auto" and self.exchange == "all_reduce":
            self.exchange = "auto"
        self._record["exchange"] = self.exchange
        self._all_reduces: dict[tuple[int, ...], CompressedAllReduce] = {}
        # The compressed all-reduce's server error buffer per sync (this rank's chunk of the flat
        # pseudo-gradients), keyed by the positions of the sync's tensors among the optimizer's, and
        # beside it the chunk it holds, as (replicas, rank): (0, -1) before the first sync. Both
        # change in place (a fault-tolerance driver keeps them for a try that fails).
        self._server_error: dict[str, torch.Tensor] = {}
        self._server_chunk: dict[str, torch.Tensor] = {}
        self._spread = False  # spread_server_error(): the state holds the whole server error instead

    def set_routes(self, routes):
        if self.settings.subset_fraction < 1.0 or self.settings.low_rank:
            raise ConfigError("lowcomm.subset_fraction < 1 and lowcomm.low_rank are not supported with replicas of "
                              "different shapes (each route's tensors differ); use subset_fraction 1 and low_rank 0")
        if self.exchange != "all_gather":
            if self.settings.exchange == "all_reduce":
                raise ConfigError("lowcomm.exchange all_reduce is not supported with replicas of different shapes "
                                  "(each route's chunks would differ); use all_gather or auto")
            self.exchange = self._record["exchange"] = "all_gather"
        super().set_routes(routes)

    def set_pieces(self, flat, pieces):
        if self.settings.low_rank:
            raise ConfigError("lowcomm.low_rank needs whole matrices: ZeRO stages 1-3 hand the optimizer flat "
                              "partitions (use ZeRO stage 0, or subset_fraction to go below one bit)")
        super().set_pieces(flat, pieces)

    def _positions(self, params) -> list[int]:
        """Each parameter's position among the optimizer's: the same on every replica."""
        position = {id(p): i for i, p in enumerate(self._current_params())}
        return [position[id(p)] for p in params]

    def _server_key(self, params) -> str:
        return ",".join(str(i) for i in self._positions(params))

    def _exchange_now(self) -> str:
        """This sync's exchange: the fixed group's, or (fault tolerance, auto) this quorum's."""
        if self.exchange != "auto":
            return self.exchange
        return resolve_exchange("auto", self.settings.codec, self.transport.world_size, self.settings.subset_fraction)

    def _exchanged(self, params):
        # decayed, added to and sent from by each sync; where the all-reduce may run, the server
        # error and the chunk it holds too (made here, empty, before the first sync: a driver keeps
        # what exists before a try)
        residuals = [self._residual(p) for p in params]
        if self.exchange == "all_gather" or not params:
            return residuals
        return residuals + list(self._server_buffers(params))

    def _server_buffers(self, params) -> tuple[torch.Tensor, torch.Tensor]:
        """This sync's server error buffer and the chunk it holds (a CPU tensor: read every sync
        without a device sync), made empty and (0, -1) before the first sync."""
        name = self._server_key(params)
        if name not in self._server_error:
            self._server_error[name] = torch.zeros(0, dtype=torch.float32, device=self._residual(params[0]).device)
            self._server_chunk[name] = torch.tensor([0, -1], dtype=torch.int64)
        return self._server_error[name], self._server_chunk[name]

    def _held_servers(self) -> list[str]:
        """The syncs whose server error holds a chunk (not just made)."""
        return [k for k, chunk in self._server_chunk.items() if int(chunk[1]) >= 0]

    def _all_reduce_for(self, params) -> CompressedAllReduce:
        """The compressed all-reduce of these parameters among this group's (quorum's) ranks."""
        key = (*(id(p) for p in params), self.transport.world_size)  # another size cuts other chunks
        sync = self._all_reduces.get(key)
        if sync is None:
            sync = self._all_reduces[key] = CompressedAllReduce(
                [self._pieces.get(id(p), p.shape) for p in params], value_dtype=self.settings.codec.value_dtype,
                transport=self.transport, op="outer_compressed_all_reduce")
        return sync

    def _residual(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "residual" not in state:
            state["residual"] = torch.zeros_like(state["anchor"])
        return state["residual"]

    def _start_combine(self, params, deltas):
        finite = all_finite(deltas)  # if not, the residuals stay as they are and this rank sits out
        residuals = []
        for p, delta in zip(params, deltas):
            residual = self._residual(p)
            if finite:
                residual.mul_(self.settings.decay).add_(delta)
            residuals.append(residual)
        healthy = self._healthy() and finite
        if self.settings.low_rank:
            return self._start_low_rank(params, residuals, healthy)
        if self.settings.subset_fraction < 1.0:
            return self._start_subset(params, residuals, healthy)
        return self._start_codec(params, residuals, healthy)

    def _start_codec(self, params, residuals, healthy: bool) -> Pending:
        """The codec's exchange of these residuals: sent components leave them now; the means arrive on wait()."""
        if not params:
            return Pending(lambda: [], None)
        if self._exchange_now() == "all_reduce":
            return self._start_all_reduce(params, residuals, healthy)
        return self._sync_for(params, "outer_sparse_all_gather").start(residuals, healthy)

    def _start_subset(self, params, residuals, healthy: bool) -> Pending:
        """``subset_fraction``: the same random positions of each residual on every replica (drawn
        from the sync's number and the tensor's position) go through the codec as one vector per
        tensor; what they send leaves them, the rest stays in the residuals."""
        sync_number = int(self.state[params[0]]["outer_steps"])
        picks = [shared_subset(r.numel(), self.settings.subset_fraction, sync_number, position, device=r.device)
                 for r, position in zip(residuals, self._positions(params))]
        values = [r.reshape(-1)[pick] for r, pick in zip(residuals, picks)]  # copies
        key = ("subset", *(id(p) for p in params))
        sync = self._syncs.get(key)
        if sync is None:
            sync = SparseAllGather([(v.numel(),) for v in values], transport=self.transport,
                                   op="outer_subset_all_gather", **self.settings.codec.flat())
            self._syncs[key] = sync
        pending = sync.start(values, healthy)  # error feedback on the copies ...
        for r, pick, v in zip(residuals, picks, values):
            r.view(-1)[pick] = v  # ... written back to their positions

        def finish():
            out = []
            for r, pick, mean in zip(residuals, picks, pending.wait()):
                full = torch.zeros(r.numel(), dtype=torch.float32, device=r.device)
                full[pick] = mean.reshape(-1)
                out.append(full.view(r.shape))
            return out

        return Pending(finish, None)

    def _start_low_rank(self, params, residuals, healthy: bool) -> Pending:
        """``low_rank``: each matrix's residual M (rows x rest) as PowerSGD's rank-r power step, the
        other tensors through the codec, both started now; wait() runs the second all-reduce."""
        mats = [i for i, r in enumerate(residuals) if r.dim() >= 2]
        rest = sorted(set(range(len(params))) - set(mats))
        views, local_p = [], []
        for i, position in zip(mats, self._positions([params[i] for i in mats])):
            m = residuals[i].view(residuals[i].shape[0], -1)
            state = self.state[params[i]]
            if "low_rank_q" not in state:  # the shared warm start: the same on every replica, no message
                rank = min(self.settings.low_rank, *m.shape)
                state["low_rank_q"] = shared_randn(m.shape[1], rank, position, device=m.device)
            views.append(m)
            local_p.append(m.float() @ state["low_rank_q"])
        p_sum = start_all_reduce_mean_(local_p, self.transport, op="outer_low_rank_p", healthy=healthy)
        codec = self._start_codec([params[i] for i in rest], [residuals[i] for i in rest], healthy)

        def finish():
            out: list[torch.Tensor | None] = [None] * len(params)
            local_q = []
            ps = [orthonormal_columns(pm) for pm in p_sum.wait()]
            for m, pm in zip(views, ps):
                local_q.append(m.float().T @ pm)
            if healthy:  # what P P^T M sends leaves the buffer
                for m, pm, q in zip(views, ps, local_q):
                    m.sub_((pm @ q.T).to(m.dtype))
            start_all_reduce_mean_(local_q, self.transport, op="outer_low_rank_q", healthy=healthy).wait()
            for i, pm, q in zip(mats, ps, local_q):
                if pm.any():  # else nothing caught on any replica: no move, the warm start kept
                    self.state[params[i]]["low_rank_q"].copy_(q)
                out[i] = (pm @ q.T).view(residuals[i].shape)
            for i, mean in zip(rest, codec.wait()):
                out[i] = mean
            return out

        return Pending(finish, None)

    def _start_all_reduce(self, params, residuals, healthy: bool) -> Pending:
        n, rank = self.transport.world_size, self.transport.rank
        sync = self._all_reduce_for(params)
        name = self._server_key(params)
        server, chunk = self._server_buffers(params)
        held = tuple(int(v) for v in chunk)
        fits = held == (n, rank) and server.numel() == sync.server_error_numel
        if not fits and held != (0, -1) and self._fixed_group:
            raise ValueError(f"the checkpoint's server error buffer {name!r} is rank {held[1]}'s chunk of {held[0]} "
                             f"replicas, {server.numel()} elements; this is rank {rank} of {n}, whose chunk has "
                             f"{sync.server_error_numel} (saved at another number of replicas or another sharding: "
                             "resharding the all-reduce's server error is not supported)")
        if not fits:
            # The first sync, or (fault tolerance) a quorum that cuts other chunks: what this rank
            # held is another chunk's error, and the chunk it serves now starts at zero (its mean
            # goes out without its last rounding's rest: one sync's, at a membership change).
            # After a load of the whole server error (spread_server_error()), its chunk of it.
            server.resize_(sync.server_error_numel).zero_()
            whole = [self.state[p].pop(WHOLE_SERVER_ERROR, None) for p in params]
            if held == (0, -1) and all(w is not None for w in whole):
                server.copy_(sync.server_error_chunk([w.to(server.device) for w in whole]))
            chunk.copy_(torch.tensor([n, rank]))
        return sync.start(residuals, server, healthy)

    def spread_server_error(self) -> None:
        """Before a checkpoint that reshards the parameters' state (Megatron-Core's distributed
        checkpoints): each sync's server error, put together from the chunks its replicas hold,
        as per-parameter state (``whole_server_error``: the parameter's shape, fp32, equal on
        every replica), which the next :meth:`state_dict` holds in place of this rank's chunk. It
        then follows any new sharding or replica count as the anchors do, and the first sync after
        a load cuts its chunk from it. Collective over the replicas (call it on every rank); its
        bytes go to no ledger (checkpoint traffic). :meth:`drop_spread_server_error` after the save."""
        params = self._current_params()
        ledger, self.transport.ledger = self.transport.ledger, ByteLedger()
        try:
            for name in sorted(self._held_servers()):  # the same syncs on every replica
                mine = [params[int(i)] for i in name.split(",")]
                whole = self._all_reduce_for(mine).gather_server_error(self._server_error[name], [self._residual(p) for p in mine])
                for p, w in zip(mine, whole):
                    self.state[p][WHOLE_SERVER_ERROR] = w.to(p.device, copy=True)
        finally:
            self.transport.ledger = ledger
        self._spread = True

    def drop_spread_server_error(self) -> None:
        """After the checkpoint :meth:`spread_server_error` was for: the chunks alone again."""
        self._spread = False
        for p in self._current_params():
            self.state[p].pop(WHOLE_SERVER_ERROR, None)

    def _extra_state(self):
        extra = super()._extra_state()
        held = [] if self._spread else self._held_servers()
        if held:  # absent with the all-gather (and where spread): its checkpoints keep their form
            extra["server_error"] = {k: self._server_error[k].clone() for k in held}
            extra["server_chunk"] = {k: [int(v) for v in self._server_chunk[k]] for k in held}
        return extra

    def _replica_extra(self):
        held = self._held_servers()
        return {**{f"server_error/{k}": self._server_error[k] for k in held},
                **{f"server_chunk/{k}": self._server_chunk[k] for k in held}}

    def _with_replica_extra(self, extra, received):
        for name, t in received.items():
            kind, key = name.split("/", 1)
            if kind == "server_error":
                extra.setdefault("server_error", {})[key] = t
            else:
                extra.setdefault("server_chunk", {})[key] = [int(v) for v in t]

    def _load_extra_state(self, extra):
        super()._load_extra_state(extra)
        params = self._current_params()
        device = params[0].device if params else torch.device("cpu")
        # ZeRO 0 with several ranks a replica: the file holds every rank's; each keeps its own syncs'
        mine = {str(i) for i in self._positions(self._owned(params))}
        saved = {k: v for k, v in extra.get("server_error", {}).items() if set(k.split(",")) <= mine}
        self._server_error = {k: v.to(device=device, dtype=torch.float32, copy=True) for k, v in saved.items()}
        # saved before the chunk was recorded: in a fixed group, this rank's chunk at this size (a
        # length that does not fit is refused at the next sync)
        now = [self.transport.world_size, self.transport.rank]
        chunks = extra.get("server_chunk", {})
        self._server_chunk = {k: torch.tensor(chunks.get(k, now), dtype=torch.int64) for k in self._server_error}

    def load_state_dict(self, state_dict):
        lowcomm = state_dict.get("lowcomm") if isinstance(state_dict, dict) else None
        if lowcomm is not None and "exchange" not in lowcomm["settings"]:
            # saved before exchange was a setting: its syncs were all-gathers
            state_dict = {**state_dict, "lowcomm": {**lowcomm, "settings": {**lowcomm["settings"],
                                                                            "exchange": "all_gather"}}}
        super().load_state_dict(state_dict)

    @classmethod
    def _planned_sync(cls, settings, shapes, replicas):
        from ..comm.wire import compressed_all_reduce_messages, sparse_all_gather_message

        if settings.subset_fraction < 1.0 or settings.low_rank:
            raise ConfigError("plan: subset_fraction < 1 and low_rank are not planned (leave them at 1 and 0)")
        delay = settings.streaming.sync_delay
        if resolve_exchange(settings.exchange, settings.codec, replicas) == "all_reduce":
            return compressed_all_reduce_messages("outer_compressed_all_reduce", shapes, settings.codec.value_dtype,
                                                  replicas, delay)
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
