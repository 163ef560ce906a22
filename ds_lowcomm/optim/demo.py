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
from ..comm.wire import WirePlan, elements, sparse_all_gather_message
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
# How update "muon" scales the orthogonalised matrix (a param group's "muon_scale"): "rms", RMS
# about 1 as sign's (DeMo's lrs carry over); "deepspeed", sqrt(max(1, rows / cols)) as DeepSpeed's
# Muon (the group's lr is then a DeepSpeed Muon lr: a config whose optimizer is DeepSpeed's Muon).
MUON_SCALES = ("rms", "deepspeed")
GROUP_RULE_KEYS = ("update", "muon_scale")  # what a param group may set of its own besides lr and weight decay


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

    def unused_keys(self) -> dict[str, str]:
        out = super().unused_keys()
        if self.update != "adam":
            for key in ("beta2", "eps"):
                out[key] = f"update adam's second moment; got update {self.update}"
        return out


class DeMo(LowcommOptimizer):
    method = "demo"
    settings_class = DeMoSettings
    replica_state = ("momentum",)  # each rank's own, with what it has not sent yet

    def __init__(self, params, lr: float = 4e-4, *, weight_decay: float = 0.0, settings: DeMoSettings | None = None,
                 transport: Transport | None = None, shard: ReplicaShard | None = None, ledger_steps: bool = True,
                 clip_grad: float = 0.0, **flat_settings):
        """``flat_settings``: decay, topk, chunk, value_dtype, transform, average, state_dtype, overlap,
        update, mean_momentum, keep_sent, beta2, eps (or one ``settings=DeMoSettings(...)``)."""
        settings = self.resolve_settings(settings, flat_settings)
        hyper = AdamSettings.from_flat({"lr": lr, "weight_decay": weight_decay}, where="DeMo")
        super().__init__(params, dict(lr=hyper.lr, weight_decay=hyper.weight_decay))
        # a param group's own rule is a setting every rank must share (recorded only where a group
        # sets one, so that checkpoints of runs without them load as they did)
        rules = [{k: g[k] for k in GROUP_RULE_KEYS if k in g} for g in self.param_groups]
        # Matrices tagged ``use_muon = False`` (DeepSpeed's convention; takes_muon_step's decision)
        # step by sign in a muon group: kept by (group, position), which a framework's swap of the
        # parameters for master copies keeps (a ZeRO partition's matrices: see matrix_directions)
        self._not_muon = {(gi, pi) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])
                          if getattr(p, "use_muon", None) is False}
        self._group_sizes = [len(g["params"]) for g in self.param_groups]
        self._init_comm(settings, transport, shard, ledger_steps, clip_grad, **({"group_rules": rules} if any(rules) else {}))

    def _update(self, params):
        self._clip_(params)  # this rank's gradient, before it enters its momentum
        owned = {id(p) for p in self._owned(params)}
        synced, grads, lrs, decays, rules, scales = [], [], [], [], [], []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if not p.requires_grad or not p.numel():  # frozen or empty: not decayed, not exchanged (as _current_params)
                    continue
                if id(p) not in owned:  # another rank of this replica syncs it and sends it here
                    continue
                synced.append(p)
                grads.append(p.grad)  # a parameter without a gradient still takes part in the exchange
                lrs.append(group["lr"])
                decays.append(group["weight_decay"])
                rules.append(self.rule_of(p, gi, pi))
                scales.append(group.get("muon_scale", "rms"))
        if synced and self.settings.overlap:
            # Step along the exchange started one step ago (landed meanwhile, or landing now),
            # then start this step's: it travels while the caller runs the next forward/backward.
            landed = self._land_in_flight(synced)
            self._in_flight = (tuple(id(p) for p in synced), self.start_momentum_sync(synced, grads, lrs))
            self._step_each(synced, landed, lrs, decays, rules, scales)
        else:  # every rank of a replica runs the exchange, owning any parameter or not (a driver asks each)
            # it changes the momenta (folded in, sent components out): what a driver keeps
            momenta = [self._momentum(p) for p in synced]
            means = self._run_exchange(
                momenta, lambda: self.start_momentum_sync(synced, grads, lrs).wait() if synced else [])
            if means is not None:  # else a driver discarded it: every replica skips this step alike
                # a replica healed at the exchange (a driver's asynchronous quorum) steps with its peer's schedule
                by_id = {id(p): g for g in self.param_groups for p in g["params"]}
                lrs = [by_id[id(p)]["lr"] for p in synced]
                self._step_each(synced, means, lrs, decays, rules, scales)
        self._share(params)

    def add_param_group(self, param_group: dict) -> None:
        if "update" in param_group:  # a group's own rule: checked as the setting is
            check_choice("DeMo param group", "update", param_group["update"], UPDATES)
        if "muon_scale" in param_group:
            check_choice("DeMo param group", "muon_scale", param_group["muon_scale"], MUON_SCALES)
        super().add_param_group(param_group)

    # Set by an integration whose framework holds matrices in pieces (ZeRO 1-3's partitions,
    # Megatron's tensor-parallel shards): ``matrix_directions(means, orthogonalize)`` takes the
    # exchanged means {id(tensor DeMo steps): q} and returns the muon direction of those of them
    # that hold matrix pieces, each matrix orthogonalised whole (``orthogonalize(matrix, whole)``,
    # assembled from its pieces over the ranks that hold them: comm.MatrixAssembly; a collective,
    # called at the same step on each of them). None: every tensor DeMo steps is a whole parameter.
    matrix_directions = None

    def orthogonalizes(self, group: dict) -> bool:
        """Whether the matrices (2+ dimensions) of this param group take Muon's orthogonalised step
        (those not tagged ``use_muon = False``)."""
        return group.get("update", self.settings.update) == "muon"

    def _step_each(self, params, means, lrs, decays, rules, scales, targets=None) -> None:
        """Step every parameter along its exchanged mean (None: nothing landed yet, with overlap);
        matrices held in pieces are orthogonalised whole first (one collective). ``targets``: the
        tensors to move instead (a framework's copies of ``params``; the state is ``params``')."""
        means = [None if q is None else self._with_mean_momentum(p, q) for p, q in zip(params, means)]
        directions = self._assembled_directions(params, means)
        for i, (p, q, lr, wd, rule, scale) in enumerate(zip(params, means, lrs, decays, rules, scales)):
            if q is not None:
                self._step_along(p, q, lr, wd, rule, directions.get(id(p)), scale,
                                 None if targets is None else targets[i])

    def _assembled_directions(self, params, means) -> dict[int, torch.Tensor]:
        if self.matrix_directions is None or all(q is None for q in means):
            return {}
        groups = self.param_groups
        return self.matrix_directions(
            {id(p): q for p, q in zip(params, means) if q is not None},
            lambda m, x: orthogonalize(x, scale=groups[m.group].get("muon_scale", "rms")))

    def rule_of(self, p: torch.Tensor, group_index: int, position: int) -> str:
        """The update rule of the tensor at ``position`` of param group ``group_index``: its group's
        (else the settings'), sign for a matrix tagged ``use_muon = False`` in a muon group."""
        group = self.param_groups[group_index]
        rule = group.get("update", self.settings.update)
        shaped = len(group["params"]) == self._group_sizes[group_index]  # parameters or their copies, not a partition
        return "sign" if rule == "muon" and shaped and (group_index, position) in self._not_muon else rule

    def step_copies(self, params: list[torch.Tensor], copies: list[torch.Tensor], lrs: list[float],
                    decays: list[float]) -> None:
        """Move ``copies`` (a framework's own copies of these parameters of DeMo's: Megatron's fp32
        main parameters) along the exchanged means in their ``.grad``, by each parameter's rule,
        with DeMo's state of the parameter (mean momentum, adam's second moment: in DeMo's
        state_dict). Megatron's inner step (megatron_patches.SignDescent)."""
        where = {id(p): (gi, pi) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])}
        rules = [self.rule_of(p, *where[id(p)]) for p in params]
        scales = [self.param_groups[where[id(p)][0]].get("muon_scale", "rms") for p in params]
        self._step_each(params, [c.grad for c in copies], lrs, decays, rules, scales, targets=copies)

    def _with_mean_momentum(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``q``, or with ``mean_momentum`` b, q + b * u after u <- b * u + q (per-parameter state)."""
        beta = self.settings.mean_momentum
        if beta:
            state = self.state[p]
            if "mean_momentum" not in state:
                state["mean_momentum"] = torch.zeros_like(p, dtype=self.state_dtype)
            u = state["mean_momentum"]
            u.mul_(beta).add_(q.to(u.dtype))
            q = q.to(u.dtype).add(u, alpha=beta)
        return q

    def _step_along(self, p: torch.Tensor, q: torch.Tensor, lr: float, weight_decay: float, rule: str,
                    assembled: torch.Tensor | None = None, scale: str = "rms",
                    target: torch.Tensor | None = None) -> None:
        """Move ``p`` along ``q`` (the exchanged mean, with mean momentum folded in) by the
        ``update`` rule ``rule`` (its group's, else the settings'); ``assembled``: the muon
        direction of a tensor holding matrix pieces, its matrices orthogonalised whole; ``scale``:
        the group's muon_scale; ``target``: what moves (``p`` itself, or a framework's copy of it)."""
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
            if assembled is not None:
                direction = assembled
            else:
                direction = orthogonalize(q, scale=scale) if q.dim() >= 2 else q.sign()
        else:  # normalized
            q = q.float()
            direction = q / q.square().mean().sqrt().clamp_min(torch.finfo(torch.float32).tiny)
        descend_(p if target is None else target, direction, lr, weight_decay)

    def _momentum(self, p: torch.Tensor) -> torch.Tensor:
        state = self.state[p]
        if "momentum" not in state:
            state["momentum"] = torch.zeros_like(p, dtype=self.state_dtype)
        return state["momentum"]

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
        lowcomm = state_dict.get("lowcomm") if isinstance(state_dict, dict) else None
        if lowcomm is not None and "group_rules" in self._record and "group_rules" not in lowcomm["settings"]:
            # saved before the groups' rules were recorded: the groups then were those of this run
            # (a run's groups come from its model and settings, which the record compares)
            saved = {**lowcomm["settings"], "group_rules": self._record["group_rules"]}
            state_dict = {**state_dict, "lowcomm": {**lowcomm, "settings": saved}}
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
            m = self._momentum(p)
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

    # -- declared costs (see LowcommOptimizer.planned_wire) --
    @classmethod
    def planned_wire(cls, settings, shapes, **_):
        # with overlap the exchange started in one step is waited for in the next
        return WirePlan.every_step([sparse_all_gather_message("sparse_all_gather", shapes, settings.codec,
                                                              overlap_steps=int(settings.overlap))])

    @classmethod
    def planned_state_bytes(cls, settings, shapes, **_):
        # the momentum; the running sum of the means (mean_momentum); update adam's second moment
        tensors = 1 + bool(settings.mean_momentum) + (settings.update == "adam")
        return tensors * cls.state_element_bytes(settings) * elements(shapes)


# Newton-Schulz's quintic iteration (Jordan et al., Muon), coefficients chosen to push every
# singular value into about [0.7, 1.2] in 5 steps: close enough to an orthogonal factor for a step.
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)


def orthogonalize(q: torch.Tensor, steps: int = 5, scale: str = "rms") -> torch.Tensor:
    """``q`` as a matrix (its first dimension by the rest) with its singular values pushed to about 1,
    scaled (``scale`` "rms") by sqrt(max(rows, cols)) so its RMS is about 1, as sign's is: the lr
    carries over; or ("deepspeed") by sqrt(max(1, rows / cols)), as DeepSpeed's Muon (and Jordan's)
    scales it, so that a DeepSpeed Muon section's lr means what it means there. In fp32 whatever
    q's dtype (bf16's 8 bits would blur the iteration's cancellations)."""
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
    rows, cols = x.shape
    factor = max(rows, cols) ** 0.5 if scale == "rms" else max(1.0, rows / cols) ** 0.5
    return (x * factor).reshape(q.shape)


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
