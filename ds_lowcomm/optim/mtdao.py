"""MT-DAO: multi-timescale momenta with local updates (Iacob et al., arXiv 2510.05361).

Every rank runs an Adam-type optimizer on its own data with N first moments u_j (each with its
own beta_j and weight w_j) and one second moment v:

    u_j <- beta_j u_j + (1 - beta_j) g          v <- beta2 v + (1 - beta2) g^2
    theta <- theta (1 - lr wd) - lr [(1 - sum_j w_j) g + sum_j w_j u_j / c_j] / (sqrt(v / c_v) + eps)

with Adam's bias corrections c = 1 - beta^t. N = 1 is quasi-hyperbolic momentum (QHAdam's
recommended w 0.7, beta 0.999 are the defaults). Slow momenta (beta ~ 0.999) carry the global
direction across the long gaps between syncs. Instead of a gradient all-reduce, the ranks
average the parameters every ``sync_every`` steps, momentum j every ``momentum_sync_every[j]``
and v every ``second_moment_sync_every`` (all 32 by default), all that is due at a step in one
collective. ``sync_codec="topk"`` sends the parameters and first moments compressed: each rank
sends the top-k (optionally DCT) components of its change since the last sync plus what it has
not sent yet (error feedback) and everyone adds the mean of the sent changes to the last synced
value. The second moment stays dense: it divides the step, and a compressed average leaves the
components nobody sent at their last synced value, which before the first sync is zero (a
measured divergence on the reference task).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..codec import CodecSettings
from ..comm import ReplicaShard, Transport
from ..settings import ConfigError, check_choice, check_fraction, check_int
from .adamw import AdamSettings
from .base import LowcommOptimizer, StatefulSettings

SYNC_CODECS = ("dense", "topk")


@dataclass(frozen=True)
class MTDAOSettings(StatefulSettings):
    sync_every: int = 32  # the parameters' sync period
    momentum_betas: tuple = (0.999,)  # one first moment per beta (QHAdam's recommended single one)
    momentum_weights: tuple = (0.7,)  # each moment's weight in the update; the raw gradient gets the rest
    momentum_sync_every: tuple | None = None  # one period per momentum (default: sync_every)
    second_moment_sync_every: int | None = None  # default: sync_every
    sync_codec: str = "dense"  # or "topk": parameters and momenta through the codec (second moment dense)
    codec: CodecSettings = field(default_factory=lambda: CodecSettings(average="world"))

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
                 shard: ReplicaShard | None = None, ledger_steps: bool = True, **flat_settings):
        """``lr``, ``beta2``, ``eps``, ``weight_decay``: the Adam hyperparameters (beta2 is an
        AdamW's ``betas[1]``); ``flat_settings``: momentum_betas, momentum_weights, sync_every,
        momentum_sync_every, second_moment_sync_every, sync_codec, the codec's keys, state_dtype
        (or one ``settings=MTDAOSettings(...)``)."""
        settings = self.resolve_settings(settings, flat_settings)
        hyper = AdamSettings.from_flat({"lr": lr, "betas": (0.9, beta2), "eps": eps, "weight_decay": weight_decay},
                                       where="MTDAO")
        super().__init__(params, dict(lr=hyper.lr, eps=hyper.eps, weight_decay=hyper.weight_decay, beta2=beta2))
        self.periods = settings.periods()
        self._init_comm(settings, transport, shard, ledger_steps, beta2=beta2)

    def _update(self, params):
        betas, weights = self.settings.momentum_betas, self.settings.momentum_weights
        grad_weight = 1.0 - sum(weights)
        finite = self._grads_finite([p.grad for p in params], "mtdao_local_step")  # if not: this rank's local step is skipped
        for group in self.param_groups:
            lr, wd, eps, beta2 = group["lr"], group["weight_decay"], group["eps"], group["beta2"]
            for p in group["params"]:
                if not p.requires_grad or not p.numel():  # frozen or empty: not decayed, not exchanged (as _current_params)
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = 0
                    for j in range(len(betas)):
                        state[f"u{j}"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["v"] = torch.zeros_like(p, dtype=self.state_dtype)
                    if self.settings.sync_codec == "topk":
                        # The value at the last sync (equal on every rank: the common start, zero
                        # states) and this rank's change not sent yet, kept in fp32.
                        for name in [n for n in self.periods if n != "v"]:
                            start = p.detach().float().clone() if name == "param" else torch.zeros_like(p, dtype=torch.float32)
                            state[f"{name}_synced"] = start
                            state[f"{name}_unsent"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                if p.grad is None or not finite:  # no update, but the tensor still takes part in the syncs
                    continue
                t = state["step"]
                g = p.grad.to(self.state_dtype)
                v = state["v"]
                v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                direction = g * grad_weight
                for j, (beta, weight) in enumerate(zip(betas, weights)):
                    u = state[f"u{j}"]
                    u.mul_(beta).add_(g, alpha=1.0 - beta)
                    if weight:
                        direction.add_(u, alpha=weight / (1.0 - beta**t))
                denom = (v / (1.0 - beta2**t)).sqrt_().add_(eps)
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.addcdiv_(direction.to(p.dtype), denom.to(p.dtype), value=-lr)
        self._sync_due(params, self.state[params[0]]["step"])

    def replica_tensors(self):
        # Dense syncs: the parameters right after a parameter sync; topk: the last synced values.
        params = self._current_params()
        if not params or "step" not in self.state[params[0]]:
            return params
        if self.settings.sync_codec == "topk":
            return [self.state[p]["param_synced"] for p in params]
        return params if self.state[params[0]]["step"] % self.periods["param"] == 0 else []

    def _sync_due(self, params: list[torch.Tensor], t: int) -> None:
        """Average everything whose period divides step t, in one collective."""
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

        def exchange():
            pending = self._start_mean_(dense_params, dense, "mtdao_all_reduce") if dense else None
            if compressed:
                self._sync_compressed(compressed)
            if pending is not None:
                pending.wait()
            return True

        ft = self.fault_tolerance
        if ft is None:
            exchange()
            return
        # what the exchange changes in place: the averaged tensors; compressed, also what was synced and is unsent
        changed = [*dense, *(t for p, name, x in compressed
                             for t in (x, self.state[p][f"{name}_synced"], self.state[p][f"{name}_unsent"]))]
        # not committed: every replica keeps its own values, as before the sync (put back)
        self._exchange_in_quorum(changed, exchange)
        ft.start_interval()  # the next sync's quorum (a joining replica heals)

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
