"""Muon's side of the methods: which parameters take Muon's step, decided once for every path, and
the dense Muon that users run beside AdamW (``torch.optim.Muon`` on the hidden matrices, AdamW on
the rest), as one optimizer.

Which parameters: as Muon is run (Jordan et al.; DeepSpeed's ``MuonWithAuxAdam``; Megatron-Core's
muon), the weight matrices of hidden layers take Muon's orthogonalised step; embeddings (a row per
token, not a linear map), the output head (tied to the embedding or not) and every 1-D parameter
(norms, biases) take the other rule (AdamW's, or sign's in demo). A parameter tagged
``p.use_muon = True/False`` (DeepSpeed's convention) is taken at its word.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def _head_weights(model: torch.nn.Module) -> set[int]:
    """The output head's weight where the model names it (transformers' ``get_output_embeddings``)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    return {id(weight)} if isinstance(weight, torch.Tensor) else set()


def takes_muon_step(model: torch.nn.Module) -> dict[int, bool]:
    """{id(parameter): whether it takes Muon's step} for ``model``'s trainable parameters: its
    ``use_muon`` tag where it has one, else 2+ dimensions and neither an embedding's weight
    (``nn.Embedding``; a tied head with it) nor the output head's."""
    others = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)} | _head_weights(model)
    decision = {}
    for p in model.parameters():
        if p.requires_grad:
            tag = getattr(p, "use_muon", None)
            decision[id(p)] = bool(tag) if tag is not None else (p.dim() >= 2 and id(p) not in others)
    return decision


def tag_muon_params(model: torch.nn.Module, not_muon: Iterable = ()) -> None:
    """Write :func:`takes_muon_step`'s decision onto ``model``'s trainable parameters as
    ``use_muon`` tags, as DeepSpeed's Muon asks for them, where a parameter has none; ``not_muon``:
    parameters a framework marks as taking the other rule (Megatron's embedding and output
    layer), tagged False first. Integrations whose optimizer sees copies or partitions of the
    parameters read the decision back from the tags."""
    for p in not_muon:
        if getattr(p, "use_muon", None) is None:
            p.use_muon = False
    decision = takes_muon_step(model)
    for p in model.parameters():
        if p.requires_grad and getattr(p, "use_muon", None) is None:
            p.use_muon = decision[id(p)]


def split_muon_params(model: torch.nn.Module, params: Iterable | None = None) -> tuple[list, list]:
    """(Muon's, the others') among ``params`` (default: the model's trainable parameters, shared
    ones once), in their order, by :func:`takes_muon_step`."""
    decision = takes_muon_step(model)
    seen, muon, other = set(), [], []
    for p in (model.parameters() if params is None else params):
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (muon if decision.get(id(p), p.dim() >= 2) else other).append(p)
    return muon, other


def split_told_params(params: Iterable, what: str) -> tuple[list, list]:
    """(Muon's, the others') among ``params`` as an optimizer is given them: each tensor by its param
    group's ``use_muon`` key (``ds_lowcomm.optim.model_param_groups`` sets it), else by its own
    ``use_muon`` tag (DeepSpeed's convention). With no model at hand a 2-D tensor may be an embedding,
    so a tensor told neither way is refused, naming ``what`` asks."""
    from ..settings import ConfigError

    muon, other, untold = [], [], 0
    for group in params:
        tensors = group["params"] if isinstance(group, dict) else group
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for p in tensors:
            told = group.get("use_muon") if isinstance(group, dict) else None
            told = getattr(p, "use_muon", None) if told is None else told
            if told is None:
                untold += 1
            else:
                (muon if told else other).append(p)
    if untold:
        raise ConfigError(f"{what} but {untold} parameter(s) do not say whether they take the orthogonalised step: "
                          "pass ds_lowcomm.optim.model_param_groups(cfg, model, params) (groups marked use_muon, as "
                          "Muon is run: hidden matrices orthogonalised, embeddings, head and 1-D by AdamW) or tag "
                          "every parameter with p.use_muon = True/False")
    return muon, other


DENSE_OPTIMIZERS = ("adamw", "muon")


def dense_state_bytes(optimizer: str, shapes, matrices, param_bytes: int) -> float:
    """Bytes of state a dense ``optimizer`` keeps for tensors of ``shapes``, in the parameters'
    dtype (``param_bytes`` an element; step counters left out): "adamw", torch's AdamW (exp_avg,
    exp_avg_sq); "muon", :class:`MuonWithAdamW` (torch's Muon's momentum buffer on the 2-D tensors
    that take its step, ``matrices``: one bool per shape; AdamW's two moments on the rest)."""
    from ..comm.wire import elements
    from ..settings import ConfigError, check_choice

    check_choice("plan", "optimizer", optimizer, DENSE_OPTIMIZERS)
    if optimizer == "adamw":
        return 2 * param_bytes * elements(shapes)
    if matrices is None:
        raise ConfigError("plan: Muon's state needs which tensors take its step (matrices)")
    on_matrices = sum(math.prod(s) for s, m in zip(shapes, matrices) if m and len(s) == 2)
    return param_bytes * on_matrices + 2 * param_bytes * (elements(shapes) - on_matrices)


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` on ``muon_params`` (matrices; a tensor of more dimensions, which torch's
    Muon refuses, goes with the others), ``torch.optim.AdamW`` on ``adamw_params``, as one optimizer:
    one ``step``, ``zero_grad``, ``state_dict``, and ``param_groups`` that a learning-rate scheduler
    scales together (Muon's groups first; each keeps its own peak lr). ``muon`` and ``adamw``: the
    two optimizers' keyword arguments."""

    def __init__(self, muon_params: Iterable, adamw_params: Iterable, muon: dict, adamw: dict):
        # ZeRO 1-3 (ds_lowcomm.deepspeed.muon): the Muon half holds flat partitions whose gradients
        # are already its orthogonalised updates, applied here as torch's Muon applies them
        self.prepared_updates = False
        muon_params, adamw_params = list(muon_params), list(adamw_params)
        adamw_params += [p for p in muon_params if p.dim() != 2]
        muon_params = [p for p in muon_params if p.dim() == 2]
        self.optimizers = [opt for opt in (torch.optim.Muon(muon_params, **muon) if muon_params else None,
                                           torch.optim.AdamW(adamw_params, **adamw) if adamw_params else None)
                           if opt is not None]
        if not self.optimizers:
            raise ValueError("MuonWithAdamW: no parameters")
        # the base class's bookkeeping (hooks, zero_grad) over the two optimizers' own groups and state
        super().__init__([{"params": g["params"]} for opt in self.optimizers for g in opt.param_groups], {})
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def muon(self) -> torch.optim.Muon | None:
        """The Muon half (None: no matrix takes Muon's step)."""
        return next((opt for opt in self.optimizers if isinstance(opt, torch.optim.Muon)), None)

    def takes_muon_step(self, group: dict) -> bool:
        """Whether ``group`` (one of ``param_groups``) is the Muon half's."""
        return self.muon is not None and any(group is g for g in self.muon.param_groups)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for opt in self.optimizers:
            if self.prepared_updates and opt is self.muon:
                _apply_prepared_updates(opt)
            else:
                opt.step()
        return loss

    def state_dict(self):
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict):
        saved = state_dict["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"MuonWithAdamW: the checkpoint holds {len(saved)} optimizers, this one {len(self.optimizers)}")
        for opt, sd in zip(self.optimizers, saved):
            opt.load_state_dict(sd)
        self.param_groups = [g for opt in self.optimizers for g in opt.param_groups]


def _apply_prepared_updates(muon: torch.optim.Muon) -> None:
    """torch's Muon step past its update: decoupled weight decay, then the gradient (already
    ``muon_update``'s result, its lr adjustment included) at the group's lr."""
    for group in muon.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(p.grad, alpha=-group["lr"])


@torch.no_grad()
def muon_update(matrix: torch.Tensor, group: dict) -> torch.Tensor:
    """torch's Muon update of a whole matrix that momentum was already folded into: Newton-Schulz
    with ``group``'s settings, times its lr adjustment for the matrix's shape (so that a step of
    ``lr`` along it is torch's step of ``adjusted_lr``). Computed by torch's Muon itself (public
    API: one step at lr 1, without momentum or weight decay, from zero), so that it is what
    ``torch.optim.Muon`` runs, in every torch version."""
    scratch = torch.zeros_like(matrix, dtype=torch.float32)
    scratch.grad = matrix.float()
    keys = ("ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")
    torch.optim.Muon([scratch], lr=1.0, momentum=0.0, nesterov=False, weight_decay=0.0,
                     **{k: group[k] for k in keys if k in group}).step()
    return scratch.neg_()
