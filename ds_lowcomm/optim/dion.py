"""Dion (Ahn et al. 2025, arXiv 2504.05295): an orthonormal step from a low-rank approximation of
the momentum, kept by error feedback, synchronised every step by all-reducing the low-rank factors
instead of the gradient.

For each weight matrix that takes the orthonormal step (as Muon is run: hidden matrices; see
:func:`ds_lowcomm.optim.muon.split_told_params`), viewed as B with rows >= columns (transposed
when it is wide), rank r = ceil(rank_fraction x min(rows, cols)), every rank keeps its own
momentum M (no gradient is averaged) and all ranks share Q (cols x r, the warm start):

    M <- M + G                                 this rank's gradient, no decay
    P <- QR(mean_ranks(B Q)).Q                 one warm-started power iteration (all-reduce 1)
    R <- mean_ranks(B^T P)                     (all-reduce 2)
    M <- M - (1 - mu) P R^T                    error feedback: what the factors caught decays by mu
    Q <- R / column norms(R)
    X <- X (1 - lr wd) - lr sqrt(fan_out / fan_in) P Q^T     (X as (fan_out, fan_in))

Because mean_ranks(B_i Q) = mean(B) Q, the mean of the ranks' momenta follows the single-process
algorithm exactly. The other parameters (embeddings, head, 1-D) take AdamW's step on their
gradients' dense all-reduced mean (Dion's scalar optimizer), at the optimizer's lr; the matrices'
lr is ``matrix_lr``. Each step is two all-reduces: every matrix's P with the others' gradients,
then every R. The bytes per worker, (rows + cols) x r values per matrix, do not grow with the
number of replicas (an all-reduce's do not), unlike an all-gather of top-k components.
Checked against microsoft/dion (dion_reference.py, dion_simple.py); the QR is Householder's
(``torch.linalg.qr``), where the published code defaults to a randomised Cholesky QR of the same
factor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..codec import orthonormal_columns, shared_randn
from ..comm import ReplicaShard, Transport, start_all_reduce_mean_
from ..comm.wire import WirePlan, dense_mean_messages
from ..settings import ConfigError, check_choice, check_fraction, check_nonnegative, check_positive
from .adamw import AdamSettings
from .base import LowcommOptimizer, StatefulSettings
from .muon import split_told_params

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class DionSettings(StatefulSettings):
    rank_fraction: float = 0.25  # r / min(rows, cols), rounded up (at least 1)
    mu: float = 0.95  # the share of the caught momentum kept (error feedback)
    matrix_lr: float = 0.01  # the lr of the orthonormal step; the optimizer's lr is the AdamW's of the rest
    value_dtype: str = "fp32"  # what travels: the factors and the other gradients, fp32 or bf16
    epsilon: float = 1e-8  # Q's column normalisation

    def check(self, where: str) -> None:
        super().check(where)
        if not (isinstance(self.rank_fraction, (int, float)) and not isinstance(self.rank_fraction, bool)
                and 0 < self.rank_fraction <= 1):
            raise ConfigError(f"{where}.rank_fraction must be a number in (0, 1]; got {self.rank_fraction!r}")
        check_fraction(where, "mu", self.mu)
        check_positive(where, "matrix_lr", self.matrix_lr)
        check_choice(where, "value_dtype", self.value_dtype, tuple(WIRE_DTYPES))
        check_nonnegative(where, "epsilon", self.epsilon)


def dion_rank(shape: tuple[int, ...], rank_fraction: float) -> int:
    """r for a matrix of ``shape`` (first dimension by the rest): ceil(fraction x min), at least 1."""
    rows, cols = shape[0], math.prod(shape[1:])
    return max(1, min(rows, cols, math.ceil(rank_fraction * min(rows, cols))))


class Dion(LowcommOptimizer):
    method = "dion"
    settings_class = DionSettings
    replica_state = ("momentum",)  # each rank's own (no gradient is averaged)

    def __init__(self, params, lr: float = 1e-3, *, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 settings: DionSettings | None = None, transport: Transport | None = None,
                 shard: ReplicaShard | None = None, ledger_steps: bool = True, clip_grad: float = 0.0, **flat_settings):
        """``params``: groups marked ``use_muon`` (``model_param_groups``) or tagged tensors;
        ``lr``, ``betas``, ``eps``, ``weight_decay``: the AdamW of the other parameters (the
        weight decay the matrices' too); ``flat_settings``: rank_fraction, mu, matrix_lr,
        value_dtype, epsilon, state_dtype (or one ``settings=DionSettings(...)``)."""
        settings = self.resolve_settings(settings, flat_settings)
        adam = AdamSettings.from_flat({"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay},
                                      where="Dion")
        if shard is not None:
            raise ConfigError("lowcomm.replica_size must be 1 with method dion (its factors are per matrix; a "
                              "replica of several ranks would each hold pieces)")
        params = list(params)
        for g in params:
            extra = sorted(set(g) - {"params", "use_muon"}) if isinstance(g, dict) else []
            if extra:
                raise ConfigError(f"dion param groups take params and use_muon only (the lrs are matrix_lr and the "
                                  f"optimizer's); got {', '.join(extra)}")
        matrices, others = split_told_params(params, "method dion")
        others += [p for p in matrices if p.dim() < 2]  # a 1-D tensor has no orthonormal step
        matrices = [p for p in matrices if p.dim() >= 2]
        groups = [g for g in ({"params": matrices, "lr": settings.matrix_lr, "dion": True},
                              {"params": others, "lr": adam.lr, "dion": False}) if g["params"]]
        super().__init__(groups, dict(lr=adam.lr, betas=adam.betas, eps=adam.eps, weight_decay=adam.weight_decay))
        self._init_comm(settings, transport, shard, ledger_steps, clip_grad)

    def set_routes(self, routes) -> None:
        raise ConfigError("method dion does not run between replicas of different shapes yet (its factors are per "
                          "weight matrix)")

    def _q_init(self, index: int, cols: int, r: int, device) -> torch.Tensor:
        """The shared warm start of matrix ``index``: the same on every rank with no message (a
        generator seeded by the matrix's position, on the CPU, whatever the device)."""
        return shared_randn(cols, r, index, device=device, dtype=self.state_dtype)

    def _update(self, params):
        self._clip_(params)  # this rank's gradient, before it enters its momentum (as demo's)
        live = {id(p) for p in params}
        mats, rest = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in live:
                    (mats if group["dion"] else rest).append((p, group))
        grads = [p.grad for p, _ in mats + rest]
        finite = self._grads_finite(grads, "dion_fold")  # if not: no fold, this rank sits the exchange out
        healthy = self._healthy() and finite
        wire = WIRE_DTYPES[self.settings.value_dtype]
        views = []
        for i, (p, _) in enumerate(mats):
            state = self.state[p]
            if "momentum" not in state:  # (a healed replica's starts at zero: replica_state; its Q is the peer's)
                state["momentum"] = torch.zeros_like(p, dtype=self.state_dtype)
            if "Q" not in state:
                rows, cols = p.shape[0], p[0].numel()
                tall = rows >= cols
                state["Q"] = self._q_init(i, cols if tall else rows, dion_rank(p.shape, self.settings.rank_fraction),
                                          p.device)
            m = state["momentum"]
            if finite and p.grad is not None:
                m.add_(p.grad.to(m.dtype))
            mat = m.view(m.shape[0], -1)
            views.append(mat if mat.shape[0] >= mat.shape[1] else mat.T)  # rows >= cols
        dense = [(p.grad if p.grad is not None else torch.zeros_like(p)).to(wire, copy=True) for p, _ in rest]

        def run():
            local_p = [(b @ self.state[p]["Q"].to(b.dtype)).to(wire) for (p, _), b in zip(mats, views)]
            start_all_reduce_mean_(local_p + dense, self.transport, op="dion_all_reduce", healthy=healthy).wait()
            ps, local_r = [], []
            for b, pm in zip(views, local_p):
                pm = orthonormal_columns(pm)
                ps.append(pm)
                local_r.append((b.T.float() @ pm).to(wire))
            start_all_reduce_mean_(local_r, self.transport, op="dion_all_reduce", healthy=healthy).wait()
            return ps, local_r

        # it averages the other parameters' gradients in place (the factors are made afresh each
        # try; the momenta change only after it): what a driver keeps
        landed = self._run_exchange(dense, run)
        if landed is None:  # a driver discarded it: every replica skips this step alike (the momenta keep the fold)
            return
        ps, local_r = landed
        for (p, group), b, pm, r in zip(mats, views, ps, local_r):
            state, r = self.state[p], r.float()
            if not pm.any():  # nothing caught on any rank (all momenta zero): no step, Q kept
                continue
            if finite:
                b.sub_((pm @ r.T).to(b.dtype), alpha=1.0 - self.settings.mu)
            q = r / (r.norm(dim=0, keepdim=True) + self.settings.epsilon)
            state["Q"].copy_(q)
            x = p.view(p.shape[0], -1)
            step = pm @ q.T if x.shape[0] >= x.shape[1] else q @ pm.T
            lr = group["lr"]
            if group["weight_decay"]:
                p.mul_(1.0 - lr * group["weight_decay"])
            x.add_(step.to(p.dtype), alpha=-lr * math.sqrt(x.shape[0] / x.shape[1]))
        for (p, group), g in zip(rest, dense):
            adamw_step_(p, g, self.state[p], group, self.state_dtype)

    # -- declared costs (see LowcommOptimizer.planned_wire) --
    @staticmethod
    def _factors(settings, shapes, matrices) -> tuple[list[tuple[int, int, int]], int]:
        """((rows, cols, r) of each matrix viewed tall, the other tensors' elements)."""
        if matrices is None:
            raise ConfigError("plan: dion's bytes and state need which tensors take its orthonormal step (matrices)")
        factors = [(max(s[0], math.prod(s[1:])), min(s[0], math.prod(s[1:])), dion_rank(s, settings.rank_fraction))
                   for s, m in zip(shapes, matrices) if m and len(s) >= 2]
        others = sum(math.prod(s) for s, m in zip(shapes, matrices) if not (m and len(s) >= 2))
        return factors, others

    @classmethod
    def planned_wire(cls, settings, shapes, *, matrices=None, **_):
        factors, others = cls._factors(settings, shapes, matrices)
        wire = WIRE_DTYPES[settings.value_dtype].itemsize
        first = sum(rows * r for rows, _, r in factors) + others  # every P, with the others' gradients
        second = sum(cols * r for _, cols, r in factors)  # every R
        return WirePlan.every_step([*dense_mean_messages("dion_all_reduce", [first * wire]),
                                    *dense_mean_messages("dion_all_reduce", [second * wire])])

    @classmethod
    def planned_state_bytes(cls, settings, shapes, *, matrices=None, **_):
        # momentum and Q on the matrices, AdamW's two moments on the rest, all in state_dtype
        factors, others = cls._factors(settings, shapes, matrices)
        elements = sum(rows * cols + cols * r for rows, cols, r in factors) + 2 * others
        return elements * cls.state_element_bytes(settings)


def adamw_step_(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, dtype: torch.dtype) -> None:
    """torch's AdamW on one tensor (decoupled weight decay, bias-corrected moments, eps outside the
    square root), its moments in ``dtype``."""
    if "exp_avg" not in state:
        state["exp_avg"] = torch.zeros_like(p, dtype=dtype)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype)
        state["adam_steps"] = 0
    beta1, beta2 = group["betas"]
    state["adam_steps"] += 1
    t = state["adam_steps"]
    g = grad.to(dtype)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    lr = group["lr"]
    if group["weight_decay"]:
        p.mul_(1.0 - lr * group["weight_decay"])
    denom = (v.sqrt() / math.sqrt(1.0 - beta2 ** t)).add_(group["eps"])
    p.addcdiv_(m.to(p.dtype), denom.to(p.dtype), value=-lr / (1.0 - beta1 ** t))
