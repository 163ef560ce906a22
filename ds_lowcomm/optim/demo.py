"""DeMo: decoupled momentum (Peng, Quesnelle, Kingma 2024), synchronised every step.

No gradient all-reduce: each rank keeps its own momentum, sends only its top-k DCT components
(which then leave its momentum), and every rank steps along the sign of everyone's mean
components, so replicas stay identical. With ``overlap`` the step along the mean comes one step
after its exchange starts, so the exchange is hidden behind the next forward/backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..codec import CodecSettings
from ..comm import Pending, ReplicaShard, Transport
from ..settings import check_bool, check_choice, check_fraction, check_positive
from .adamw import AdamSettings
from .base import LowcommOptimizer, StatefulSettings
from .muon import takes_muon_step


# How the parameters move along q, the exchanged mean of the momenta's components (the same on
# every rank): "sign", DeMo's (every element by lr); "adam", q / (sqrt(v) + eps) with v a
# bias-corrected running mean of q * q (each element by its own signal-to-noise: an AdamW-style
# second moment on the decoded momentum); "normalized", q / rms(q) per tensor (q's shape kept, the
# same mean step size as sign's); "muon", q orthogonalised (DeMo v2's Muon option; see
# orthogonalize) for tensors of 2 or more dimensions, sign's step for the others. A param group may
# name its own rule (its "update" key, as torch groups set their own lr): muon_param_groups gives
# embeddings sign's step, as Muon is run.
UPDATES = ("sign", "adam", "normalized", "muon")


@dataclass(frozen=True)
class DeMoSettings(StatefulSettings):
    decay: float = 0.999  # the momentum's decay (DeMo's compression_decay)
    codec: CodecSettings = field(default_factory=CodecSettings)
    # Start each step's exchange without waiting for it and step along it one step later, so the
    # all-gather runs during the next forward/backward (a one-step-delayed update).
    overlap: bool = False
    update: str = "sign"
    # A running sum u = mean_momentum * u + q of the exchanged means (the same on every rank), and
    # the step taken along q + mean_momentum * u (Nesterov's form) instead of q. Each step's q holds
    # only that step's top-k components; u keeps the recent steps' too, a denser direction for no
    # bytes. 0: q alone (DeMo's).
    mean_momentum: float = 0.0
    # The share of what a rank sent that stays in its momentum (Dion's error feedback, its mu: what
    # was caught leaves by 1 - keep_sent a step, so the components that lead go on being sent and
    # each step's mean q is a momentum, not the step's innovation). 0: DeMo's, what is sent leaves.
    keep_sent: float = 0.0
    beta2: float = 0.999  # update "adam": the decay of v
    # update "adam": q carries the lr (DeMo folds it into the momentum), so q and sqrt(v) are about
    # lr x a gradient, 1e-7 and up; eps only keeps 0 / 0 at 0
    eps: float = 1e-12

    def check(self, where: str) -> None:
        super().check(where)
        check_fraction(where, "decay", self.decay)
        check_bool(where, "overlap", self.overlap)
        check_choice(where, "update", self.update, UPDATES)
        check_fraction(where, "mean_momentum", self.mean_momentum)
        check_fraction(where, "keep_sent", self.keep_sent)
        check_fraction(where, "beta2", self.beta2)
        check_positive(where, "eps", self.eps)


class DeMo(LowcommOptimizer):
    method = "demo"
    settings_class = DeMoSettings

    def __init__(self, params, lr: float = 4e-4, *, weight_decay: float = 0.0, settings: DeMoSettings | None = None,
                 transport: Transport | None = None, shard: ReplicaShard | None = None, ledger_steps: bool = True,
                 **flat_settings):
        """``flat_settings``: decay, topk, chunk, value_dtype, transform, average, state_dtype, overlap,
        update, mean_momentum, keep_sent, beta2, eps (or one ``settings=DeMoSettings(...)``)."""
        settings = self.resolve_settings(settings, flat_settings)
        hyper = AdamSettings.from_flat({"lr": lr, "weight_decay": weight_decay}, where="DeMo")
        super().__init__(params, dict(lr=hyper.lr, weight_decay=hyper.weight_decay))
        self._init_comm(settings, transport, shard, ledger_steps)

    def _update(self, params):
        owned = {id(p) for p in self._owned(params)}
        synced, grads, lrs, decays, rules = [], [], [], [], []
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad or not p.numel():  # frozen or empty: not decayed, not exchanged (as _current_params)
                    continue
                if id(p) not in owned:  # another rank of this replica syncs it and sends it here
                    continue
                synced.append(p)
                grads.append(p.grad)  # a parameter without a gradient still takes part in the exchange
                lrs.append(group["lr"])
                decays.append(group["weight_decay"])
                rules.append(group.get("update", self.settings.update))
        if synced and self.settings.overlap:
            # Step along the exchange started one step ago (landed meanwhile, or landing now),
            # then start this step's: it travels while the caller runs the next forward/backward.
            landed = self._land_in_flight(synced)
            self._in_flight = (tuple(id(p) for p in synced), self.start_momentum_sync(synced, grads, lrs))
            for p, q, lr, wd, rule in zip(synced, landed, lrs, decays, rules):
                if q is not None:
                    self._step_along(p, q, lr, wd, rule)
        elif synced or self.fault_tolerance is not None:  # every rank of a replica asks torchft, owning any or not
            ft = self.fault_tolerance
            if ft is not None:  # the momenta as they were, for an exchange that is then discarded
                self._keep_for_discard(synced)
            means = self.start_momentum_sync(synced, grads, lrs).wait() if synced else []
            if ft is None or ft.commit():
                for p, q, lr, wd, rule in zip(synced, means, lrs, decays, rules):
                    self._step_along(p, q, lr, wd, rule)
            else:  # a peer failed during it: every replica skips this step alike
                self._restore_discarded(synced)
        self._share(params)
        if self.fault_tolerance is not None:
            self.fault_tolerance.start_interval()  # the next step's quorum (a joining replica heals)

    def add_param_group(self, param_group: dict) -> None:
        if "update" in param_group:  # a group's own rule: checked as the setting is
            check_choice("DeMo param group", "update", param_group["update"], UPDATES)
        super().add_param_group(param_group)

    def _step_along(self, p: torch.Tensor, q: torch.Tensor, lr: float, weight_decay: float, rule: str) -> None:
        """Move ``p`` along the exchanged mean ``q`` (with ``mean_momentum``, along q + beta * u)
        by the ``update`` rule ``rule`` (its group's, else the settings')."""
        beta = self.settings.mean_momentum
        if beta:
            state = self.state[p]
            if "mean_momentum" not in state:
                state["mean_momentum"] = torch.zeros_like(p, dtype=self.state_dtype)
            u = state["mean_momentum"]
            u.mul_(beta).add_(q.to(u.dtype))
            q = q.to(u.dtype).add(u, alpha=beta)
        if rule == "sign":
            direction = q.sign()
        elif rule == "adam":
            state = self.state[p]
            if "direction_sq" not in state:
                state["direction_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                state["update_steps"] = 0
            v, beta2 = state["direction_sq"], self.settings.beta2
            state["update_steps"] += 1
            q = q.to(v.dtype)
            v.mul_(beta2).addcmul_(q, q, value=1.0 - beta2)
            direction = q / ((v / (1.0 - beta2 ** state["update_steps"])).sqrt_() + self.settings.eps)
        elif rule == "muon":
            direction = orthogonalize(q) if q.dim() >= 2 else q.sign()
        else:  # normalized
            q = q.float()
            direction = q / q.square().mean().sqrt().clamp_min(torch.finfo(torch.float32).tiny)
        descend_(p, direction, lr, weight_decay)

    def _land_in_flight(self, params: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """overlap: the means of the exchange started at the previous step (None before the first
        one); after a checkpoint they wait in the state instead."""
        in_flight, self._in_flight = getattr(self, "_in_flight", None), None
        if in_flight is not None:
            if in_flight[0] != tuple(id(p) for p in params):
                raise RuntimeError("demo overlap: the parameters changed between two steps")
            return list(in_flight[1].wait())
        return [self.state[p].pop("landed_direction", None) for p in params]

    def state_dict(self):
        # An exchange in flight cannot be saved: let it land now and keep its result for its step.
        in_flight, self._in_flight = getattr(self, "_in_flight", None), None
        if in_flight is not None:
            by_id = {id(p): p for g in self.param_groups for p in g["params"]}
            for pid, q in zip(in_flight[0], in_flight[1].wait()):
                self.state[by_id[pid]]["landed_direction"] = q
        return super().state_dict()

    def load_state_dict(self, state_dict):
        self._in_flight = None
        super().load_state_dict(state_dict)

    def start_momentum_sync(self, params: list[torch.Tensor], grads: list[torch.Tensor | None],
                            lrs: list[float]) -> Pending:
        """Fold each gradient into its parameter's momentum (scaled by the lr, as DeMo does), send
        the momenta's top-k DCT components and remove them from the momenta (error feedback; with
        ``keep_sent`` k, k of them stay).
        ``wait()`` returns, per parameter, the mean over ranks of the sent components. Used by
        :meth:`step`, and by integrations that run the exchange in the framework's gradient
        sync (megatron_patches: per gradient bucket, during the backward pass).

        Non-finite gradients on this rank: its momenta stay as they are and it sits this exchange
        out (every rank steps along the healthy ranks' mean; see comm/collectives.py)."""
        momenta = []
        finite = self._grads_finite(grads, "momentum_fold")
        for p, g, lr in zip(params, grads, lrs):
            state = self.state[p]
            if "momentum" not in state:
                state["momentum"] = torch.zeros_like(p, dtype=self.state_dtype)
            m = state["momentum"]
            if finite:
                m.mul_(self.settings.decay)
                if g is not None:
                    m.add_(g.to(m.dtype), alpha=lr)
            momenta.append(m)
        keep = self.settings.keep_sent
        before = [m.clone() for m in momenta] if keep and finite else None
        pending = self._sync_for(list(params), "sparse_all_gather").start(momenta, self._healthy() and finite)
        if before is not None:  # the sent components left at start(): keep_sent of them comes back
            for m, b in zip(momenta, before):
                m.lerp_(b, keep)
        return pending


# Newton-Schulz's quintic iteration (Jordan et al., Muon), coefficients chosen to push every
# singular value into about [0.7, 1.2] in 5 steps: close enough to an orthogonal factor for a step.
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)


def orthogonalize(q: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """``q`` as a matrix (its first dimension by the rest) with its singular values pushed to about 1,
    scaled by sqrt(max(rows, cols)) so its RMS is about 1, as sign's is: the lr carries over. In
    fp32 whatever q's dtype (bf16's 8 bits would blur the iteration's cancellations)."""
    x = q.float().reshape(q.shape[0], -1)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp_min(torch.finfo(torch.float32).tiny)
    a, b, c = NEWTON_SCHULZ
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.T
    return (x * max(x.shape) ** 0.5).reshape(q.shape)


def muon_param_groups(model: torch.nn.Module) -> list[dict]:
    """``model``'s trainable parameters as DeMo's param groups for ``update`` "muon", as Muon is run
    (:func:`ds_lowcomm.optim.muon.takes_muon_step` decides, for every path): the matrices that do not
    take Muon's step (embeddings, the output head, tagged ``use_muon = False``) step by sign, the rest
    by the settings' rule (whose 1-D tensors step by sign too)."""
    decision = takes_muon_step(model)
    rest, signed = [], []
    for p in model.parameters():  # shared parameters once
        if p.requires_grad:
            (signed if p.dim() >= 2 and not decision[id(p)] else rest).append(p)
    return [g for g in ({"params": rest}, {"params": signed, "update": "sign"}) if g["params"]]


def descend_(p: torch.Tensor, direction: torch.Tensor, lr: float, weight_decay: float) -> None:
    """Decoupled weight decay, then a step of ``lr`` along ``direction``."""
    if weight_decay:
        p.mul_(1.0 - lr * weight_decay)
    p.add_(direction.to(p.dtype), alpha=-lr)


def sign_step_(p: torch.Tensor, direction: torch.Tensor, lr: float, weight_decay: float) -> None:
    """DeMo's parameter update: a step along the sign of ``direction``."""
    descend_(p, direction.sign(), lr, weight_decay)
