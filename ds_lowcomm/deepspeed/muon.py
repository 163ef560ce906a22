"""DeepSpeed's Muon (``"optimizer": {"type": "Muon", ...}``) with a lowcomm method.

DeepSpeed 0.19 builds ``MuonWithAuxAdam`` from such a section: every parameter tagged
``use_muon`` goes to a Muon half (momentum, Newton-Schulz, decoupled weight decay), the rest to an
auxiliary Adam, each half with the section's settings (``muon_lr`` / ``adam_lr`` over ``lr``).
With a lowcomm section ds_lowcomm builds the same optimizer with DeepSpeed's own code and uses it:

- as the **inner optimizer** of diloco, dct_diloco and sparseloco (MuLoCo's setting): DeepSpeed's
  ``MuonWithAuxAdam`` itself, its auxiliary Adam torch's (``torch_adam`` either way). At ZeRO 0
  its step is DeepSpeed's, on whole matrices. At ZeRO 1-3 the optimizer is handed flat partitions,
  so ZeRO's step is preceded by :class:`ZeroMuonUpdate`: each partition's momentum is folded in
  place (elementwise, as DeepSpeed's ``muon_update``), each matrix is assembled from the replica's
  partitions and orthogonalised whole by DeepSpeed's own Newton-Schulz (``comm.MatrixAssembly``),
  and the partition's gradient becomes its piece of the update, which ``MuonWithAuxAdam`` applies
  to a flat partition (as under DeepSpeed's own ZeRO Muon);
- as **demo's step** (``lowcomm.method`` demo): the Muon half's parameters step along demo's
  exchanged momentum orthogonalised (``update`` muon, scaled as DeepSpeed scales Muon's update, so
  the section's lr is a Muon lr), the Adam half's by sign, each with its half's lr and weight decay.

Which parameters take Muon's step is :func:`ds_lowcomm.optim.muon.takes_muon_step`'s decision
(a ``use_muon`` tag wins), written onto the parameters as ``use_muon`` tags before DeepSpeed's
grouping reads them. Every DeepSpeed internal used here goes through ``internals.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..comm import MatrixAssembly
from ..optim.muon import MuonWithAdamW, muon_update, tag_muon_params
from ..settings import ConfigError, Settings, check_bool, check_choice, check_fraction, check_nonnegative, check_positive
from . import internals

NS_METHODS = ("gram", "standard")
# what demo keeps of its own and a DeepSpeed Muon section may not set for it
DEMO_REFUSED = {"momentum": "demo's momentum is lowcomm.decay",
                "betas": "demo steps the parameters outside Muon's half by sign, without Adam's moments",
                "eps": "demo steps the parameters outside Muon's half by sign, without Adam's moments"}


@dataclass(frozen=True)
class MuonSection(Settings):
    """The ``optimizer.params`` of ``"type": "Muon"``, as DeepSpeed 0.19 reads them. None: absent
    (DeepSpeed's own default applies: lr 0.02 for Muon's half and 3e-4 for Adam's, momentum 0.95,
    weight decay 0, ns_method gram, betas (0.9, 0.95), eps 1e-10)."""

    lr: float | None = None
    muon_lr: float | None = None
    adam_lr: float | None = None
    momentum: float | None = None
    weight_decay: float | None = None
    ns_method: str | None = None
    betas: tuple | None = None
    eps: float | None = None
    adam_w_mode: bool = True  # the auxiliary Adam: AdamW (true) or Adam with L2 (false), as DeepSpeed
    torch_adam: bool = False  # either way: the auxiliary Adam is torch's (DeepSpeed: FusedAdam unless true)
    per_head_muon: bool = False  # refused: DeepSpeed's per-head Newton-Schulz is not carried over

    def check(self, where: str) -> None:
        for key in ("lr", "muon_lr", "adam_lr"):
            if getattr(self, key) is not None:
                check_positive(where, key, getattr(self, key))
        if self.momentum is not None:
            check_fraction(where, "momentum", self.momentum)
        if self.weight_decay is not None:
            check_nonnegative(where, "weight_decay", self.weight_decay)
        if self.ns_method is not None:
            check_choice(where, "ns_method", self.ns_method, NS_METHODS)
        if self.betas is not None:
            if not isinstance(self.betas, tuple) or len(self.betas) != 2:
                raise ConfigError(f"{where}.betas must be a list of two numbers in [0, 1); got {self.betas!r}")
            for beta in self.betas:
                check_fraction(where, "betas[]", beta)
        if self.eps is not None:
            check_nonnegative(where, "eps", self.eps)
        check_bool(where, "adam_w_mode", self.adam_w_mode)
        check_bool(where, "torch_adam", self.torch_adam)
        if self.per_head_muon:
            raise ConfigError(f"{where}.per_head_muon must be false with lowcomm (DeepSpeed's per-head "
                              "Newton-Schulz is not carried over: each matrix is orthogonalised whole); got true")

    def deepspeed_params(self) -> dict[str, Any]:
        """The keys DeepSpeed's grouping reads (``_muon_param_groups``), as given."""
        keys = ("lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "ns_method", "betas", "eps")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}

    def check_for(self, method: str, where: str = "optimizer.params") -> None:
        """What carries over to ``method`` (refused by name where it would be ignored)."""
        if method == "demo":
            for key, why in DEMO_REFUSED.items():
                if getattr(self, key) is not None:
                    raise ConfigError(f"{where}.{key}: not with lowcomm.method demo ({why}); leave it out")
            if not self.adam_w_mode:
                raise ConfigError(f"{where}.adam_w_mode must be true with lowcomm.method demo (its weight decay "
                                  "is decoupled); got false")
        elif method in ("adamw", "mtdao", "dion"):
            kind = "orthonormal" if method == "dion" else "Adam-type"
            raise ConfigError(f"optimizer.type Muon: not with lowcomm.method {method} ({method} is its own "
                              f"{kind} optimizer); use it with demo, diloco, dct_diloco or sparseloco, or "
                              "optimizer.type AdamW")


def tag_params(model: torch.nn.Module, params, require: bool = True) -> None:
    """``use_muon`` on every trainable parameter, as ``takes_muon_step`` decides (a tag the user
    set is kept: ``tag_muon_params``); with ``require``, parameters passed in ``params`` that the model does not
    hold must be tagged (as DeepSpeed's Muon asks)."""
    tag_muon_params(model)
    for group in params if require else ():
        for p in (group["params"] if isinstance(group, dict) else [group]):
            if getattr(p, "use_muon", None) is None:
                raise ConfigError("optimizer.type Muon: a parameter in model_parameters is not the model's and has no "
                                  "use_muon tag; set p.use_muon = True / False on it (as DeepSpeed asks)")
            if p.use_muon and p.dim() < 2:
                raise ConfigError(f"optimizer.type Muon: a parameter of shape {tuple(p.shape)} is tagged use_muon "
                                  "true; Muon's step is for matrices (2+ dimensions)")


def deepspeed_groups(params, section: MuonSection) -> list[dict]:
    """DeepSpeed's own split of ``params`` (a list of tensors or param groups) into Muon's and
    Adam's halves, with the section's settings and DeepSpeed's defaults filled in."""
    split = internals.static(internals.MUON_PARAM_GROUPS)(list(params), section.deepspeed_params())
    # DeepSpeed's optimizer fills each half's defaults into the group dicts (and sorts Muon's by size)
    return internals.live(internals.MUON_WITH_AUX_ADAM)(split).param_groups


def build_inner(params, section: MuonSection) -> torch.optim.Optimizer:
    """DeepSpeed's ``MuonWithAuxAdam`` over ``params``, as DeepSpeed builds it with ``torch_adam``."""
    groups = internals.static(internals.MUON_PARAM_GROUPS)(list(params), section.deepspeed_params())
    adam = torch.optim.AdamW if section.adam_w_mode else torch.optim.Adam
    return internals.live(internals.MUON_WITH_AUX_ADAM)(groups, adam_optimizer=adam, adam_optimizer_kwargs={},
                                                       adam_w_mode=section.adam_w_mode, fallback_to_inline=False)


def demo_groups(params, section: MuonSection) -> list[dict]:
    """demo's param groups from DeepSpeed's halves: Muon's by update muon (scaled as DeepSpeed's
    Muon scales its update, so its lr is a Muon lr), Adam's by sign; each half's lr and weight decay."""
    out = []
    for g in deepspeed_groups(params, section):
        rule = {"update": "muon", "muon_scale": "deepspeed"} if g["use_muon"] else {"update": "sign"}
        out.append({"params": g["params"], "lr": g["lr"], "weight_decay": g["weight_decay"], **rule})
    return out


def orthogonalize(update: torch.Tensor, ns_method: str) -> torch.Tensor:
    """DeepSpeed's Newton-Schulz of a whole matrix (its ``muon_update`` past the momentum): the
    method's iteration in its precision, scaled by sqrt(max(1, rows / cols))."""
    name = internals.GRAM_NEWTON_SCHULZ if ns_method == "gram" else internals.NEWTON_SCHULZ5
    out = internals.live(name)(update, steps=5)
    return (out * internals.live(internals.ASPECT_RATIO_SCALE)(update.size(-2), update.size(-1))).to(update.dtype)


@dataclass(frozen=True)
class MuonHalf:
    """How an inner optimizer's Muon half steps a matrix at ZeRO 1-3: which param groups are its
    (``takes``), the optimizer whose state holds each partition's ``momentum_buffer`` (``states``)
    and the whole matrix's update from its momentum-blended gradient (``update(matrix, group)``)."""

    takes: Callable[[dict], bool]
    states: torch.optim.Optimizer
    update: Callable[[torch.Tensor, dict], torch.Tensor]


def deepspeed_half(inner) -> MuonHalf:
    """DeepSpeed's ``MuonWithAuxAdam``: its ``use_muon`` groups, DeepSpeed's Newton-Schulz."""
    return MuonHalf(lambda group: bool(group["use_muon"]), inner,
                    lambda x, group: orthogonalize(x, group.get("ns_method", "gram")))


def torch_half(inner) -> MuonHalf:
    """ds_lowcomm's ``MuonWithAdamW`` (``lowcomm.inner_optimizer`` muon): torch's Muon half, its
    update torch's own (``optim.muon.muon_update``); the half then applies the partitions'
    prepared updates as torch's Muon applies its update."""
    inner.prepared_updates = True
    return MuonHalf(inner.takes_muon_step, inner.muon, muon_update)


class ZeroMuonUpdate:
    """ZeRO 1-3: before the method steps the partitions, the gradient of each partition of a Muon
    group becomes its piece of Muon's update (momentum lerp, Nesterov's blend unless the group
    says ``nesterov`` false, the update of the whole matrix assembled over the replica: ``half``),
    which the inner optimizer then applies to a flat partition (DeepSpeed's ``MuonWithAuxAdam``
    as under DeepSpeed's own ZeRO Muon; ``MuonWithAdamW`` with ``prepared_updates``). The
    momentum is the half's ``momentum_buffer`` of each partition (in the method's checkpoints)."""

    def __init__(self, inner: torch.optim.Optimizer, half: MuonHalf, flats: list[torch.Tensor], groups: list[int],
                 assembly: MatrixAssembly):
        self.inner, self.half, self.flats, self.groups, self.assembly = inner, half, flats, groups, assembly

    @torch.no_grad()
    def __call__(self) -> None:
        inputs, grads = [], []
        for flat, gid in zip(self.flats, self.groups):
            group = self.inner.param_groups[gid]
            if not self.half.takes(group):
                inputs.append(torch.zeros(0, device=flat.device))
                grads.append(None)
                continue
            grad = flat.grad if flat.grad is not None else torch.zeros_like(flat)
            state = self.half.states.state[flat]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(flat)
            momentum, beta = state["momentum_buffer"], group["momentum"]
            finite = torch.isfinite(grad).all()
            momentum.copy_(torch.where(finite, momentum.lerp(grad, 1 - beta), momentum))
            nesterov = group.get("nesterov", True)
            inputs.append(grad.lerp(momentum, beta) if nesterov else momentum.clone())
            grads.append(grad)
        outputs = [x.clone() for x in inputs]
        groups = self.inner.param_groups
        self.assembly.apply_(inputs, outputs, lambda m, x: self.half.update(x, groups[m.group]))
        for flat, grad, out in zip(self.flats, grads, outputs):
            if grad is not None:
                flat.grad = torch.where(torch.isfinite(grad).all(), out.to(grad.dtype), grad)


def matrix_steps(optimizer, ledger, timeout_s):
    """What ZeRO 1-3 (zero.py) must assemble for ``optimizer``'s step, or None: demo's matrices
    of the groups whose update is muon, or the ``use_muon`` groups of a DeepSpeed Muon inner."""
    from ..optim import DeMo
    from .zero import MatrixSteps

    if isinstance(optimizer, DeMo):
        if not any(optimizer.orthogonalizes(g) for g in optimizer.param_groups):
            return None

        def attach(flats, groups, assembly):
            ids = [id(f) for f in flats]

            def directions(means, fn):  # every flat's muon direction: sign's, its matrices' pieces orthogonalised
                inputs = [means[i].float() if i in means else torch.zeros(0) for i in ids]
                outputs = [x.sign() for x in inputs]
                assembly.apply_(inputs, outputs, fn)
                return {i: out for i, out in zip(ids, outputs) if i in means}

            optimizer.matrix_directions = directions

        def is_matrix(p, shape, gid):
            return (len(shape) >= 2 and optimizer.orthogonalizes(optimizer.param_groups[gid])
                    and getattr(p, "use_muon", None) is not False)

        return MatrixSteps(is_matrix, attach, ledger, timeout_s)
    inner = getattr(optimizer, "inner", None)
    if isinstance(inner, internals.live(internals.MUON_WITH_AUX_ADAM)):
        half = deepspeed_half(inner)
    elif isinstance(inner, MuonWithAdamW) and inner.muon is not None:
        half = torch_half(inner)
    else:
        return None
    return MatrixSteps(lambda p, shape, gid: half.takes(inner.param_groups[gid]),
                       lambda flats, groups, assembly: ZeroMuonUpdate(inner, half, flats, groups, assembly),
                       ledger, timeout_s)
