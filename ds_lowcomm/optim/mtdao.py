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

import torch

from ..comm import Transport, start_all_reduce_mean_
from .base import LowcommOptimizer


class MTDAO(LowcommOptimizer):
    method = "mtdao"
    # With replicas of several ranks at ZeRO 0 every rank of a replica holds the whole (identical)
    # state and averages all of it with its cross-replica peers: ``shard`` is not used, so the
    # sync is not split by owner inside a replica as the other methods' are.

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        *,
        momentum_betas: tuple[float, ...] = (0.999,),
        momentum_weights: tuple[float, ...] = (0.7,),
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        sync_every: int = 32,
        momentum_sync_every: tuple[int, ...] | None = None,
        second_moment_sync_every: int | None = None,
        sync_codec: str = "dense",
        topk: int = 32,
        chunk: int = 64,
        value_dtype: str = "fp32",
        transform: str = "dct",
        average: str = "world",
        state_dtype: torch.dtype = torch.float32,
        transport: Transport | None = None,
    ):
        momentum_betas, momentum_weights = tuple(momentum_betas), tuple(momentum_weights)
        if not lr > 0:
            raise ValueError(f"lr must be > 0; got {lr!r}")
        if not momentum_betas or any(not 0.0 <= b < 1.0 for b in momentum_betas):
            raise ValueError(f"momentum_betas must be a non-empty list of numbers in [0, 1); got {momentum_betas!r}")
        if len(momentum_weights) != len(momentum_betas) or any(not 0.0 <= w <= 1.0 for w in momentum_weights) \
                or sum(momentum_weights) > 1.0 + 1e-12:
            raise ValueError(f"momentum_weights must hold one weight in [0, 1] per beta, summing to at most 1; "
                             f"got {momentum_weights!r}")
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"beta2 must be in [0, 1); got {beta2!r}")
        momentum_sync_every = tuple(momentum_sync_every) if momentum_sync_every is not None else (sync_every,) * len(momentum_betas)
        second_moment_sync_every = second_moment_sync_every or sync_every
        if len(momentum_sync_every) != len(momentum_betas):
            raise ValueError(f"momentum_sync_every must hold one period per beta; got {momentum_sync_every!r}")
        if min(sync_every, second_moment_sync_every, *momentum_sync_every) < 1:
            raise ValueError("sync periods must be >= 1")
        if sync_codec not in ("dense", "topk"):
            raise ValueError(f"sync_codec must be one of dense, topk; got {sync_codec!r}")
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay, beta2=beta2))
        self.momentum_betas = momentum_betas
        self.momentum_weights = momentum_weights
        self.periods = {"param": sync_every, "v": second_moment_sync_every,
                        **{f"u{j}": k for j, k in enumerate(momentum_sync_every)}}
        self.sync_codec = sync_codec
        self.state_dtype = state_dtype
        codec = dict(topk=topk, chunk=chunk, value_dtype=value_dtype, transform=transform, average=average)
        self._init_comm(
            transport,
            dict(momentum_betas=list(momentum_betas), momentum_weights=list(momentum_weights), beta2=beta2,
                 sync_every=sync_every, momentum_sync_every=list(momentum_sync_every),
                 second_moment_sync_every=second_moment_sync_every, sync_codec=sync_codec, state_dtype=str(state_dtype)),
            codec=codec if sync_codec == "topk" else None,
        )

    @property
    def steps_taken(self) -> int:
        params = self._current_params()
        return self.state[params[0]].get("step", 0) if params else 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = self._evaluate_closure(closure)
        params = self._current_params()
        if self._is_placeholder_step(params):
            return loss
        grad_weight = 1.0 - sum(self.momentum_weights)
        for group in self.param_groups:
            lr, wd, eps, beta2 = group["lr"], group["weight_decay"], group["eps"], group["beta2"]
            for p in group["params"]:
                state = self.state[p]
                if "step" not in state:
                    state["step"] = 0
                    for j in range(len(self.momentum_betas)):
                        state[f"u{j}"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["v"] = torch.zeros_like(p, dtype=self.state_dtype)
                    if self.sync_codec == "topk":
                        # The value at the last sync (equal on every rank: the common start, zero
                        # states) and this rank's change not sent yet, kept in fp32.
                        for name in [n for n in self.periods if n != "v"]:
                            start = p.detach().float().clone() if name == "param" else torch.zeros_like(p, dtype=torch.float32)
                            state[f"{name}_synced"] = start
                            state[f"{name}_unsent"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                if p.grad is None:  # no update, but the tensor still takes part in the syncs
                    continue
                t = state["step"]
                g = p.grad.to(self.state_dtype)
                v = state["v"]
                v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                direction = g * grad_weight
                for j, (beta, weight) in enumerate(zip(self.momentum_betas, self.momentum_weights)):
                    u = state[f"u{j}"]
                    u.mul_(beta).add_(g, alpha=1.0 - beta)
                    if weight:
                        direction.add_(u, alpha=weight / (1.0 - beta**t))
                denom = (v / (1.0 - beta2**t)).sqrt_().add_(eps)
                if wd:
                    p.mul_(1.0 - lr * wd)
                p.addcdiv_(direction.to(p.dtype), denom.to(p.dtype), value=-lr)
        self._sync_due(params, self.state[params[0]]["step"])
        self._finish_step()
        return loss

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
        dense = [x for (p, name), x in zip(names, tensors) if self.sync_codec == "dense" or name == "v"]
        pending = start_all_reduce_mean_(dense, self.transport, op="mtdao_all_reduce") if dense else None
        compressed = [(p, name, x) for (p, name), x in zip(names, tensors) if self.sync_codec == "topk" and name != "v"]
        if compressed:
            self._sync_compressed(compressed)
        if pending is not None:
            pending.wait()

    def _sync_compressed(self, items: list[tuple[torch.Tensor, str, torch.Tensor]]) -> None:
        """Send the change since the last sync plus the unsent remainder; adopt last sync + mean."""
        changes = []
        for p, name, x in items:
            state = self.state[p]
            unsent = state[f"{name}_unsent"]
            unsent.add_(x.float()).sub_(state[f"{name}_synced"])
            changes.append(unsent)
        sync = self._sync_for([x for _, _, x in items], "mtdao_sparse_all_gather")
        means = sync.exchange(changes)  # the sent parts leave `unsent`
        for (p, name, x), mean in zip(items, means):
            synced = self.state[p][f"{name}_synced"]
            synced.add_(mean)
            x.copy_(synced)
