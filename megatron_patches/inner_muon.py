"""MuLoCo on Megatron-Core: ds_lowcomm's own Muon (``lowcomm.inner_optimizer muon``) as an outer
method's inner optimizer, in place of the Adam inside Megatron's optimizer.

Megatron's optimizer is built as usual (``--optimizer adam``); :func:`install` swaps the torch Adam
inside it (each of a ChainedOptimizer's) for :class:`MegatronMuonWithAdamW` over the same tensors
(the fp32 main copies under mixed precision): torch's Muon (Nesterov, ``inner_muon_momentum``) on
the hidden matrices, torch's AdamW on the rest with Megatron's Adam settings. Which tensors take
Muon's step is ``ds_lowcomm.optim.muon.takes_muon_step``'s decision on the model's parameters,
Megatron's word embeddings and output layer tagged not-Muon first (``tag_muon_params``).
Megatron's optimizer keeps everything else: gradient copy, unscaling, clipping, the main-to-model
copy; the outer loop wraps its ``step()`` as with Adam.

Learning rate: every one of Megatron's param groups is split in two, its Muon tensors and its
others, each keeping the group's scheduler keys (``wd_mult``, ``lr_mult``, ``is_decoupled_lr``...).
The Muon half's peak (``max_lr``) is ``inner_muon_lr`` and its floor (``min_lr``) is the group's
``min_lr`` scaled by ``inner_muon_lr / max_lr``, so Megatron's OptimizerParamScheduler (which
writes ``lr`` from each group's own ``max_lr``/``min_lr``) warms up and decays both halves alike,
each from its own peak. The Muon groups say ``default_config`` False, so Megatron logs Adam's lr.

At tensor parallelism > 1 a rank holds a shard of each hidden matrix, and Muon's step of the
shard is not the shard of the whole matrix's step: :class:`TensorParallelMuonUpdate` folds each
shard's momentum in place (elementwise), assembles the momentum-blended matrix whole over the
tensor-parallel group (``comm.MatrixAssembly``, as demo's Muon does on Megatron), runs torch's
own Muon update on it (``ds_lowcomm.optim.muon.muon_update``) and hands each rank its shard, which
the Muon half applies as torch's Muon applies its update (``prepared_updates``).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from ds_lowcomm.optim.muon import MuonWithAdamW, muon_update
from ds_lowcomm.settings import ConfigError

from . import internals as mi
from .wrapper import chained, model_params_of_mains, optimizer_kind, torch_optimizer


class MegatronMuonWithAdamW(MuonWithAdamW):
    """``MuonWithAdamW`` over param groups (Megatron's, split as the module docstring says), with
    torch's state-dict format (``state`` by index over ``param_groups``: Muon's groups, then
    AdamW's), which Megatron's optimizers read (``state``, ``param_groups``, the common ``step``).
    The two halves share one ``state`` dict (their tensors are disjoint). Loading takes the saved
    per-tensor state and keeps the groups' own settings (Megatron matches saved groups to its own
    by ``wd_mult``/``lr_mult``/..., which do not tell a Muon group from its Adam twin, so the
    saved groups' sizes travel apart, in ``group_sizes``; the lr is the scheduler's either way)."""

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], muon: dict, adamw: dict):
        self.prepared_updates = False
        if any(p.dim() != 2 for g in muon_groups for p in g["params"]):
            raise ValueError("MegatronMuonWithAdamW: Muon's groups hold matrices only")
        self.optimizers = [opt for opt in (torch.optim.Muon(muon_groups, **muon) if muon_groups else None,
                                           torch.optim.AdamW(adamw_groups, **adamw) if adamw_groups else None)
                           if opt is not None]
        if not self.optimizers:
            raise ValueError("MegatronMuonWithAdamW: no parameters")
        torch.optim.Optimizer.__init__(self, [{"params": g["params"]} for opt in self.optimizers
                                              for g in opt.param_groups], {})
        self._share_state()
        self.prepare: TensorParallelMuonUpdate | None = None  # at TP > 1: the Muon half's updates, whole

    @torch.no_grad()
    def step(self, closure=None):
        if self.prepare is not None:
            self.prepare()
        return super().step(closure)

    def _share_state(self, state=None) -> None:
        groups = [g for opt in self.optimizers for g in opt.param_groups]
        self.param_groups = groups
        self.state = state if state is not None else defaultdict(dict)
        for opt in self.optimizers:
            opt.state = self.state

    def state_dict(self):
        state = torch.optim.Optimizer.state_dict(self)
        # each group's tensor count apart: Megatron's load matches groups by keys a Muon group shares
        # with its Adam twin and rewrites their "params" lists (its _filter_and_reorder_param_groups)
        state["group_sizes"] = [len(g["params"]) for g in state["param_groups"]]
        return state

    def load_state_dict(self, state_dict):
        sizes = [len(g["params"]) for g in self.param_groups]
        if state_dict.get("group_sizes") != sizes:
            raise ValueError(f"MegatronMuonWithAdamW: the checkpoint's param groups hold "
                             f"{state_dict.get('group_sizes')} tensors (Muon's groups, then AdamW's), this "
                             f"optimizer's {sizes}")
        at, mine = 0, []
        for g, n in zip(self.param_groups, sizes):  # torch's indices: the tensors in group order
            mine.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(at, at + n))})
            at += n
        halves = [len(opt.param_groups) for opt in self.optimizers]
        torch.optim.Optimizer.load_state_dict(self, {"state": state_dict["state"], "param_groups": mine})
        # torch made new group dicts and a new state dict: hand them back to the two halves
        at = 0
        for opt, n in zip(self.optimizers, halves):
            opt.param_groups = self.param_groups[at:at + n]
            at += n
        self._share_state(self.state)


class TensorParallelMuonUpdate:
    """Tensor parallelism > 1: before ``inner`` steps, each Muon tensor's gradient becomes its piece
    of torch's Muon update of the whole matrix: the momentum buffer (``inner``'s state, as torch's
    Muon keeps it) lerped toward the gradient, Nesterov's blend, the blend assembled whole over the
    tensor-parallel group on one owning rank (a column split, i.e. a row-parallel layer, as the
    transpose's rows), ``muon_update`` there (Newton-Schulz, the lr adjustment for the whole
    shape), every rank's shard handed back; a matrix Megatron does not split is updated here.
    ``inner`` then applies them (``prepared_updates``: decoupled weight decay, the step at lr).
    ``model_of``: main copy -> model parameter (which carries Megatron's split). Collective over
    the tensor-parallel group (bytes in ``ledger`` as ``tp_matrix_assembly``)."""

    def __init__(self, inner: MegatronMuonWithAdamW, model_of: dict, ledger, timeout_s: float):
        from megatron.core import parallel_state as ps

        from ds_lowcomm.comm import Matrix, MatrixAssembly, MatrixPiece, TorchDistTransport

        self.inner, self.muon = inner, inner.muon
        tp = ps.get_tensor_model_parallel_world_size()
        self.tensors = []  # (main tensor, its group's index in the Muon half, split dim or None)
        for gi, g in enumerate(self.muon.param_groups):
            for p in g["params"]:
                self.tensors.append((p, gi, mi.tensor_parallel_shard(model_of.get(id(p), p))))
        split = [(p, gi, dim) for p, gi, dim in self.tensors if dim is not None]
        transport = TorchDistTransport(ps.get_tensor_model_parallel_group(), ledger=ledger, timeout_s=timeout_s)
        matrices = []
        for k, (p, gi, dim) in enumerate(split):
            rows, cols = p.shape if dim == 0 else (p.shape[1], p.shape[0])
            n = p.numel()
            matrices.append(Matrix(rows * tp, cols, tuple(MatrixPiece(r, r * n, n, k, 0) for r in range(tp)), gi))
        self.split = split
        self.assembly = MatrixAssembly(matrices, transport, transport.rank, tp, op="tp_matrix_assembly")
        self.split_dim = {id(m): dim for m, (_, _, dim) in zip(self.assembly.matrices, split)}

    def _blend(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """torch's Muon before Newton-Schulz: the momentum buffer lerped toward the gradient (in
        place), Nesterov's blend of the two (or the buffer)."""
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        state = self.muon.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        momentum = state["momentum_buffer"]
        momentum.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(momentum, group["momentum"]) if group["nesterov"] else momentum.clone()

    @torch.no_grad()
    def __call__(self) -> None:
        groups = self.muon.param_groups
        blends = {}
        for p, gi, dim in self.tensors:
            blends[id(p)] = self._blend(p, groups[gi])
            if dim is None:  # whole here
                p.grad = muon_update(blends[id(p)], groups[gi]).to(p.dtype)
        inputs = [(blends[id(p)] if dim == 0 else blends[id(p)].T).float().reshape(-1) for p, _, dim in self.split]
        outputs = [x.clone() for x in inputs]

        def whole(m, x):  # the matrix as it is (a column split: transposed back and forth)
            dim = self.split_dim[id(m)]
            return muon_update(x, groups[m.group]) if dim == 0 else muon_update(x.T, groups[m.group]).T

        self.assembly.apply_(inputs, outputs, whole)
        for (p, _, dim), out in zip(self.split, outputs):
            update = out.view(p.shape) if dim == 0 else out.view(p.shape[1], p.shape[0]).T
            p.grad = update.to(p.dtype).contiguous()


def _split_groups(groups: list[dict], adam_defaults: dict, takes_muon, muon_lr: float) -> tuple[list, list]:
    """Megatron's param groups -> (Muon's groups, AdamW's groups), as the module docstring says."""
    muon_groups, adamw_groups = [], []
    for g in groups:
        muon = [p for p in g["params"] if takes_muon(p)]
        other = [p for p in g["params"] if not takes_muon(p)]
        if muon:
            # the group's scheduler keys, without Adam's own settings (Muon has its own eps)
            keys = {k: v for k, v in g.items() if k != "params" and k not in adam_defaults}
            peak = g.get("max_lr", g["lr"])
            scale = muon_lr / peak if peak else 0.0
            keys.update(lr=g["lr"] * scale if peak else muon_lr, weight_decay=g["weight_decay"],
                        max_lr=muon_lr, default_config=False)
            if g.get("min_lr") is not None:
                keys["min_lr"] = g["min_lr"] * scale
            muon_groups.append({**keys, "params": muon})
        if other:
            adamw_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": other})
    return muon_groups, adamw_groups


def tag_muon_params(model_chunks) -> None:
    """The one decision of which parameters take Muon's step (ds_lowcomm.optim.muon.takes_muon_step),
    with Megatron's own marks: its word embeddings and output layer (``is_embedding_or_output_parameter``)
    are tagged ``use_muon = False`` first, as Megatron-Core's Muon leaves them to Adam."""
    from ds_lowcomm.optim.muon import tag_muon_params

    for chunk in model_chunks:
        tag_muon_params(chunk, [p for p in chunk.parameters() if mi.is_embedding_or_output(p)])


def install(model_chunks, optimizer, settings, ledger, timeout_s: float) -> list[MegatronMuonWithAdamW]:
    """Swap the Adam inside each of Megatron's optimizers for :class:`MegatronMuonWithAdamW`
    (``settings``: the outer method's, its ``inner_muon_lr`` and ``inner_muon_momentum``); at
    tensor parallelism > 1, each one's Muon half assembled whole (:class:`TensorParallelMuonUpdate`,
    its bytes in ``ledger``, its waits bounded by ``timeout_s``). Refused by name, before any rank
    communicates: a torch optimizer in place of Megatron's, Megatron's own Muon, several optimizers
    chained at TP > 1."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1 and len(chained(optimizer)) > 1:  # each would assemble its own share in a collective of its own
        raise ConfigError("lowcomm.inner_optimizer muon at tensor parallelism > 1 with a ChainedOptimizer of several "
                          "optimizers is not supported yet: build one Megatron optimizer over every parameter")

    for opt in chained(optimizer):
        if optimizer_kind(opt) == "torch":
            raise ConfigError("lowcomm.inner_optimizer muon on Megatron-Core swaps the Adam inside Megatron's "
                              "optimizer: pass the optimizer get_megatron_optimizer built (--optimizer adam), or "
                              "pass your own torch optimizer and leave inner_optimizer adamw")
        inner = torch_optimizer(opt)
        if not isinstance(inner, torch.optim.Adam):  # torch's AdamW is an Adam
            raise ConfigError(f"lowcomm.inner_optimizer muon on Megatron-Core replaces Megatron's Adam; its optimizer "
                              f"holds {type(inner).__name__} (--optimizer must be adam: Megatron's own Muon and "
                              "ds_lowcomm's are two inner Muons)")
    tag_muon_params(model_chunks)
    model_of = model_params_of_mains(optimizer)

    tagged = {id(p): bool(p.use_muon) for chunk in model_chunks for p in chunk.parameters() if p.requires_grad}

    def takes_muon(p) -> bool:  # (a main copy by its model parameter's tag)
        return p.dim() == 2 and tagged.get(id(model_of.get(id(p), p)), False)

    built = []
    for opt in chained(optimizer):
        adam = torch_optimizer(opt)
        muon_groups, adamw_groups = _split_groups(adam.param_groups, adam.defaults, takes_muon, settings.inner_muon_lr)
        inner = MegatronMuonWithAdamW(muon_groups, adamw_groups,
                                      muon={"lr": settings.inner_muon_lr, "momentum": settings.inner_muon_momentum,
                                            "nesterov": True},
                                      adamw={k: adam.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")})
        if tp > 1 and inner.muon is not None:
            inner.prepare = TensorParallelMuonUpdate(inner, model_of, ledger, timeout_s)
            inner.prepared_updates = True
        mi.put(opt, mi.OPTIMIZER_INNER, inner)
        built.append(inner)
    return built


__all__ = ["MegatronMuonWithAdamW", "TensorParallelMuonUpdate", "install"]
