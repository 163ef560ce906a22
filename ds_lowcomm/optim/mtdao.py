"""MT-DAO: multi-timescale momenta with local updates (Iacob et al., arXiv 2510.05361).

Every rank runs an Adam-type optimizer on its own data with N first moments u_j (each with its
own beta_j and weight w_j) and one second moment v:

    u_j <- beta_j u_j + (1 - beta_j) g          v <- beta2 v + (1 - beta2) g^2
    theta <- theta (1 - lr wd) - lr [(1 - sum_j w_j) g + sum_j w_j u_j / c_j] / (sqrt(v) / sqrt(c_v) + eps)

with Adam's bias corrections c = 1 - beta^t, rounded as the authors' optimizers round them
(QHAdamW for one momentum, AggMoAdamW for several: torchtitan/experiments/fl/optimizers). N = 1
is quasi-hyperbolic momentum. Slow momenta (beta ~ 0.999) carry the global direction across the
long gaps between syncs. Instead of a gradient all-reduce, the ranks average the parameters every
``sync_every`` steps, momentum j every ``momentum_sync_every[j]`` and v every
``second_moment_sync_every`` (all 32 by default), all that is due at a step in one collective.

The authors' recipe (their configs ``mosaic_mup_*_qhadamw*.toml``) starts warm: with
``switch_step`` S > 0, steps 1..S are plain synchronous Adam (the gradients averaged every step,
betas ``warm_betas``, the update of one momentum of weight 1); then the switch: the first moments
are zeroed (the step counter, hence the bias corrections, and v are kept), the momenta, weights and
beta2 become the settings', the learning rate is multiplied by ``switch_lr_scale`` from step S + 1
on, and the periodic syncs start, each period counted from S. ``outer_optimizer`` "sgd" (their
Nesterov variant) replaces the parameters' plain average by an outer SGD step (``outer_lr``,
``outer_momentum``, ``nesterov``) on the parameters of the last sync, along their difference to
the average (DiLoCo's outer step).

``sync_codec="topk"`` sends the parameters and first moments compressed: each rank sends the
top-k (optionally DCT) components of its change since the last sync plus what it has not sent yet
(error feedback) and everyone adds the mean of the sent changes to the last synced value. The
second moment stays dense: it divides the step, and a compressed average leaves the components
nobody sent at their last synced value, which before the first sync is zero (a measured divergence
on the reference task).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..codec import CodecSettings
from ..comm import ReplicaShard, Transport
from ..comm.wire import WirePlan, dense_mean_messages, elements, sparse_all_gather_message
from ..settings import ConfigError, check_bool, check_choice, check_fraction, check_int, check_positive
from .adamw import AdamSettings
from .base import LowcommOptimizer, StatefulSettings

SYNC_CODECS = ("dense", "topk")
OUTER_OPTIMIZERS = ("none", "sgd")  # the parameters' sync: their mean, or an outer SGD step along it
# Settings a checkpoint saved before they existed lacks; it was made with their defaults.
_ADDED_KEYS = ("beta2", "switch_step", "warm_betas", "switch_lr_scale", "outer_optimizer", "outer_lr",
               "outer_momentum", "nesterov")


@dataclass(frozen=True)
class MTDAOSettings(StatefulSettings):
    sync_every: int = 32  # the parameters' sync period
    momentum_betas: tuple = (0.999,)  # one first moment per beta (QHAdam's recommended single one)
    momentum_weights: tuple = (0.7,)  # each moment's weight in the update; the raw gradient gets the rest
    momentum_sync_every: tuple | None = None  # one period per momentum (default: sync_every)
    second_moment_sync_every: int | None = None  # default: sync_every
    sync_codec: str = "dense"  # or "topk": parameters and momenta through the codec (second moment dense)
    codec: CodecSettings = field(default_factory=lambda: CodecSettings(average="world"))
    beta2: float | None = None  # the second moment's decay after the switch; None: the optimizer's betas[1]
    # The warm start: steps 1..switch_step are synchronous Adam with warm_betas (0: none, local from step 1)
    switch_step: int = 0
    warm_betas: tuple = (0.9, 0.999)
    switch_lr_scale: float = 1.0  # the learning rate's factor from step switch_step + 1 on
    outer_optimizer: str = "none"  # "sgd": an outer SGD step at each parameter sync (dense syncs only)
    outer_lr: float = 1.0
    outer_momentum: float = 0.9
    nesterov: bool = True

    def check(self, where: str) -> None:
        super().check(where)
        check_int(where, "sync_every", self.sync_every, 1)
        check_choice(where, "sync_codec", self.sync_codec, SYNC_CODECS)
        betas, weights = self.momentum_betas, self.momentum_weights
        if not isinstance(betas, tuple) or not betas:
            raise ConfigError(f"{where}.momentum_betas must be a non-empty list of numbers in [0, 1); got {betas!r}")
        for b in betas:
            check_fraction(where, "momentum_betas[]", b)
        if not isinstance(weights, tuple) or len(weights) != len(betas):
            raise ConfigError(f"{where}.momentum_weights must be a list with one weight per momentum_betas entry "
                              f"({len(betas)}); got {weights!r}")
        for w in weights:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w <= 1.0:
                raise ConfigError(f"{where}.momentum_weights entries must be numbers in [0, 1]; got {weights!r}")
        if sum(weights) > 1.0 + 1e-12:
            raise ConfigError(f"{where}.momentum_weights must sum to at most 1 (the rest weighs the raw gradient); "
                              f"got {weights!r} (sum {sum(weights)})")
        periods = self.momentum_sync_every
        if periods is not None:
            if not isinstance(periods, tuple) or len(periods) != len(betas):
                raise ConfigError(f"{where}.momentum_sync_every must be a list with one period per momentum_betas "
                                  f"entry ({len(betas)}), or null for sync_every; got {periods!r}")
            for k in periods:
                check_int(where, "momentum_sync_every[]", k, 1)
        if self.second_moment_sync_every is not None:
            check_int(where, "second_moment_sync_every", self.second_moment_sync_every, 1)
        if self.beta2 is not None:
            check_fraction(where, "beta2", self.beta2)
        check_int(where, "switch_step", self.switch_step, 0)
        if not isinstance(self.warm_betas, tuple) or len(self.warm_betas) != 2:
            raise ConfigError(f"{where}.warm_betas must be a list of two numbers in [0, 1); got {self.warm_betas!r}")
        for beta in self.warm_betas:
            check_fraction(where, "warm_betas[]", beta)
        check_positive(where, "switch_lr_scale", self.switch_lr_scale)
        check_choice(where, "outer_optimizer", self.outer_optimizer, OUTER_OPTIMIZERS)
        check_positive(where, "outer_lr", self.outer_lr)
        check_fraction(where, "outer_momentum", self.outer_momentum)
        check_bool(where, "nesterov", self.nesterov)
        if self.outer_optimizer != "none" and self.sync_codec != "dense":
            raise ConfigError(f"{where}.outer_optimizer {self.outer_optimizer} needs sync_codec dense (the compressed "
                              f"syncs keep their own last synced values); got sync_codec {self.sync_codec}")

    def unused_keys(self) -> dict[str, str]:
        out = super().unused_keys()
        if self.sync_codec == "dense":
            for key in CodecSettings.flat_keys():
                out[key] = "the codec's, which sync_codec topk uses; got sync_codec dense"
        if self.outer_optimizer == "none":
            for key in ("outer_lr", "outer_momentum", "nesterov"):
                out[key] = "the outer SGD's (outer_optimizer sgd); got outer_optimizer none"
        elif not self.outer_momentum:
            out["nesterov"] = "Nesterov's form of the outer momentum, which is 0 (outer_momentum)"
        if not self.switch_step:
            out["warm_betas"] = "the warm start's (steps 1..switch_step); got switch_step 0"
        return out

    def periods(self) -> dict[str, int]:
        """Sync period of the parameters ("param"), each first moment ("u0", ...) and the second ("v")."""
        moments = self.momentum_sync_every or (self.sync_every,) * len(self.momentum_betas)
        return {"param": self.sync_every, "v": self.second_moment_sync_every or self.sync_every,
                **{f"u{j}": k for j, k in enumerate(moments)}}


class MTDAO(LowcommOptimizer):
    method = "mtdao"
    settings_class = MTDAOSettings
    # With replicas of several ranks at ZeRO 0 every rank of a replica holds the whole (identical)
    # state and averages all of it with its cross-replica peers: ``shard`` is not used, so the
    # sync is not split by owner inside a replica as the other methods' are.

    def __init__(self, params, lr: float = AdamSettings.lr, *, beta2: float = AdamSettings.betas[1],
                 eps: float = AdamSettings.eps, weight_decay: float = AdamSettings.weight_decay,
                 settings: MTDAOSettings | None = None, transport: Transport | None = None,
                 shard: ReplicaShard | None = None, ledger_steps: bool = True, clip_grad: float = 0.0,
                 **flat_settings):
        """``lr``, ``beta2``, ``eps``, ``weight_decay``: the Adam hyperparameters (beta2 is an
        AdamW's ``betas[1]``; the settings' ``beta2``, if set, takes its place); ``flat_settings``:
        momentum_betas, momentum_weights, sync_every, momentum_sync_every, second_moment_sync_every,
        sync_codec, the codec's keys, state_dtype, beta2, switch_step, warm_betas, switch_lr_scale,
        outer_optimizer, outer_lr, outer_momentum, nesterov (or one ``settings=MTDAOSettings(...)``)."""
        settings = self.resolve_settings(settings, flat_settings)
        if settings.beta2 is not None:
            beta2 = settings.beta2
        hyper = AdamSettings.from_flat({"lr": lr, "betas": (0.9, beta2), "eps": eps, "weight_decay": weight_decay},
                                       where="MTDAO")
        super().__init__(params, dict(lr=hyper.lr, eps=hyper.eps, weight_decay=hyper.weight_decay, beta2=beta2))
        self.periods = settings.periods()
        self._init_comm(settings, transport, shard, ledger_steps, clip_grad, beta2=beta2)

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        state["step"] = 0
        for j in range(len(self.settings.momentum_betas)):
            state[f"u{j}"] = torch.zeros_like(p, dtype=self.state_dtype)
        state["v"] = torch.zeros_like(p, dtype=self.state_dtype)
        return state

    def _start_local(self, p: torch.Tensor, state: dict) -> None:
        """The start of the local phase (after the warm start's switch, or at the first step): the
        first moments from zero, and what the syncs keep, from this point (equal on every rank)."""
        for j in range(len(self.settings.momentum_betas)):
            state[f"u{j}"].zero_()
        if self.settings.sync_codec == "topk":
            # The value at the last sync and this rank's change not sent yet, kept in fp32.
            for name in [n for n in self.periods if n != "v"]:
                state[f"{name}_synced"] = (p.detach().float().clone() if name == "param"
                                           else torch.zeros_like(p, dtype=torch.float32))
                state[f"{name}_unsent"] = torch.zeros_like(p, dtype=torch.float32)
        if self.settings.outer_optimizer != "none":  # the parameters of the last sync, which the outer step moves
            state["anchor"] = p.detach().to(self.state_dtype, copy=True)
            state["outer_momentum"] = torch.zeros_like(state["anchor"])

    def _stepped(self, params) -> list[tuple[torch.Tensor, dict, dict]]:
        """(parameter, its state, its group) of every tensor this method steps, state counted up."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad or not p.numel():  # frozen or empty: not decayed, not exchanged (as _current_params)
                    continue
                state = self.state[p] if "step" in self.state[p] else self._init_state(p)
                state["step"] += 1
                out.append((p, state, group))
        return out

    def _update(self, params):
        stepped = self._stepped(params)
        if not stepped:
            return
        t, switch = stepped[0][1]["step"], self.settings.switch_step
        if t <= switch:
            self._warm_step(params, stepped, t)
            return
        if t == switch + 1:
            for p, state, _ in stepped:
                self._start_local(p, state)
        finite = self._grads_finite([p.grad for p in params], "mtdao_local_step")  # if not: this rank's local step is skipped
        if finite:
            self._clip_(params)  # this rank's own gradient (the authors clip each replica's)
        scale = self.settings.switch_lr_scale if switch else 1.0
        for p, state, group in stepped:
            if p.grad is not None and finite:  # else no update, but the tensor still takes part in the syncs
                self._adam_step(p, state, p.grad, group["lr"] * scale, group, self.settings.momentum_betas,
                                self.settings.momentum_weights, group["beta2"], t)
        self._sync_due(params, t - switch)

    def _warm_step(self, params, stepped, t: int) -> None:
        """Synchronous Adam: the mean gradient (clipped as DDP clips, after the mean), the update of
        one momentum (u0) of weight 1 with ``warm_betas``, the same on every rank."""
        for p in params:
            if p.grad is None:  # keep the flat buffer's layout the same on every rank
                p.grad = torch.zeros_like(p)
        if self.exchange_driver is not None:  # refused at configuration (optim/fault_tolerance.py): a backstop
            raise RuntimeError("mtdao's warm start (switch_step > 0) does not run under a driver of its exchanges "
                               "(fault tolerance) yet")
        self._start_mean_(params, [p.grad for p in params], "mtdao_grad_all_reduce").wait()
        self._clip_(params)
        beta1, beta2 = self.settings.warm_betas
        for p, state, group in stepped:
            self._adam_step(p, state, p.grad, group["lr"], group, (beta1,), (1.0,), beta2, t)

    def _adam_step(self, p, state, grad, lr: float, group, betas, weights, beta2: float, t: int) -> None:
        """One update of ``p`` in the authors' order and rounding: decay, moments, the denominator
        sqrt(v) / sqrt(1 - beta2^t) + eps, each moment divided by its bias correction, then QHAdamW's
        g (1 - w) + m w (one momentum) or AggMoAdamW's g (1 - sum w) + sum_j w_j m_j (several)."""
        g = grad.to(self.state_dtype)
        wd = group["weight_decay"]
        if wd:
            p.mul_(1.0 - lr * wd)  # torch's AdamW decay (the authors decay by wd x lr / the initial lr; 0 in their recipes)
        us = [state[f"u{j}"] for j in range(len(betas))]
        for u, beta in zip(us, betas):
            u.mul_(beta).add_(g, alpha=1.0 - beta)
        v = state["v"]
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v.sqrt() / math.sqrt(1.0 - beta2**t)).add_(group["eps"])
        if len(betas) == 1:
            w = weights[0]
            direction = g * (1.0 - w) + (us[0] / (1.0 - betas[0] ** t)) * w
        else:
            direction = g.mul(1.0 - sum(weights))
            for u, beta, w in zip(us, betas, weights):
                direction.add_(u / (1.0 - beta**t), alpha=w)
        p.addcdiv_(direction.to(p.dtype), denom.to(p.dtype), value=-lr)

    def step_count(self) -> int:
        params = self._current_params()
        return int(self.state[params[0]].get("step", 0)) if params else 0

    def synced_values(self):
        return [self.state[p].get("anchor") for p in self._current_params()]

    def replica_tensors(self):
        # Equal on every replica: the parameters in the warm start and right after a parameter sync;
        # the last synced values (topk) or parameters (an outer step) at any step boundary.
        params = self._current_params()
        if not params or "step" not in self.state[params[0]]:
            return params
        t = self.state[params[0]]["step"] - self.settings.switch_step
        if t <= 0:
            return params
        if self.settings.sync_codec == "topk":
            return [self.state[p]["param_synced"] for p in params]
        if self.settings.outer_optimizer != "none":
            return [self.state[p]["anchor"] for p in params]
        return params if t % self.periods["param"] == 0 else []

    def load_state_dict(self, state_dict):
        lowcomm = state_dict.get("lowcomm") if isinstance(state_dict, dict) else None
        if lowcomm is not None and "switch_step" not in lowcomm["settings"]:
            # Saved before the recipe's settings existed: with their defaults (the state's keys did not change).
            defaults = MTDAOSettings().flat()
            saved = {**{k: defaults[k] for k in _ADDED_KEYS}, **lowcomm["settings"]}
            state_dict = {**state_dict, "lowcomm": {**lowcomm, "settings": saved}}
        super().load_state_dict(state_dict)

    def _sync_due(self, params: list[torch.Tensor], t: int) -> None:
        """Average everything whose period divides ``t`` (local steps since the switch), in one
        collective; with an outer optimizer the parameters' mean moves the anchors instead."""
        due = [name for name, k in self.periods.items() if t % k == 0]
        if not due:
            return
        tensors, names = [], []
        for name in due:
            for p in params:
                tensors.append(p if name == "param" else self.state[p][name])
                names.append((p, name))
        compress = self.settings.sync_codec == "topk"
        dense = [x for (p, name), x in zip(names, tensors) if not compress or name == "v"]
        dense_params = [p for (p, name) in names if not compress or name == "v"]
        compressed = [(p, name, x) for (p, name), x in zip(names, tensors) if compress and name != "v"]

        def run():
            pending = self._start_mean_(dense_params, dense, "mtdao_all_reduce") if dense else None
            if compressed:
                self._sync_compressed(compressed)
            if pending is not None:
                pending.wait()
            return True

        # what it changes in place: the averaged tensors; compressed, also what was synced and is unsent
        changes = [*dense, *(t for p, name, x in compressed
                             for t in (x, self.state[p][f"{name}_synced"], self.state[p][f"{name}_unsent"]))]
        # None: a driver discarded it (put back): every replica keeps its own values, as before the sync
        committed = self._run_exchange(changes, run) is not None
        if committed and "param" in due and self.settings.outer_optimizer != "none":
            self._outer_step(params)

    def _sync_compressed(self, items: list[tuple[torch.Tensor, str, torch.Tensor]]) -> None:
        """Send the change since the last sync plus the unsent remainder; adopt last sync + mean."""
        changes = []
        for p, name, x in items:
            state = self.state[p]
            unsent = state[f"{name}_unsent"]
            unsent.add_(x.float()).sub_(state[f"{name}_synced"])
            changes.append(unsent)
        sync = self._sync_for([p for p, _, _ in items], "mtdao_sparse_all_gather")  # x has p's layout
        means = sync.exchange(changes, self._healthy())  # the sent parts leave `unsent`
        for (p, name, x), mean in zip(items, means):
            synced = self.state[p][f"{name}_synced"]
            synced.add_(mean)
            x.copy_(synced)

    def _outer_step(self, params: list[torch.Tensor]) -> None:
        """The parameters hold their mean: the anchors (the last sync's parameters) take one SGD
        step along anchor - mean (torch's SGD: buf = mu buf + d; Nesterov d + mu buf), and every
        replica restarts from them."""
        lr, mu, nesterov = self.settings.outer_lr, self.settings.outer_momentum, self.settings.nesterov
        for p in params:
            state = self.state[p]
            anchor, buf = state["anchor"], state["outer_momentum"]
            delta = anchor - p.to(anchor.dtype)
            if mu:
                buf.mul_(mu).add_(delta)
                delta = delta.add(buf, alpha=mu) if nesterov else buf
            anchor.add_(delta, alpha=-lr)
            p.copy_(anchor)

    # -- declared costs (see LowcommOptimizer.planned_wire) --
    @classmethod
    def planned_wire(cls, settings, shapes, *, grad_bytes=4, param_bytes=4, **_):
        periods = settings.periods()
        if len(set(periods.values())) != 1:
            raise ConfigError("plan: mtdao with different periods per state is not declared; give one sync_every")
        numel, state = elements(shapes), cls.state_element_bytes(settings)
        if settings.sync_codec == "dense":  # everything due at once: one flat all-reduce per dtype
            by_dtype: dict[int, int] = {}
            for name in periods:  # the parameters in their own dtype, the moments in state_dtype
                size = param_bytes if name == "param" else state
                by_dtype[size] = by_dtype.get(size, 0) + numel * size
            sync = dense_mean_messages("mtdao_all_reduce", list(by_dtype.values()))
        else:  # everything but v compressed in one all-gather; v dense
            compressed = [s for name in periods if name != "v" for s in shapes]
            sync = [*dense_mean_messages("mtdao_all_reduce", [numel * state]),
                    sparse_all_gather_message("mtdao_sparse_all_gather", compressed, settings.codec)]
        warm = dense_mean_messages("mtdao_grad_all_reduce", [numel * grad_bytes])  # the warm start's gradient mean
        return WirePlan(settings.sync_every, (tuple(sync),), (settings.sync_every,), settings.switch_step, tuple(warm))

    @classmethod
    def planned_state_bytes(cls, settings, shapes, **_):
        state = cls.state_element_bytes(settings)
        moments = len(settings.momentum_betas)
        per = state * (moments + 1)  # the first moments and v
        if settings.sync_codec == "topk":  # each compressed quantity's last synced value and unsent change, fp32
            per += 2 * 4 * (1 + moments)
        if settings.outer_optimizer != "none":  # the anchor and the outer momentum
            per += 2 * state
        return per * elements(shapes)
