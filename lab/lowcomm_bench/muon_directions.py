"""``python -m lowcomm_bench muon_directions``: how close each compressed method's step is to
dense Muon's, step by step, on the same gradients (issue 41: why demo with Muon's step needs more
steps than dense Muon).

One process follows dense Muon's trajectory on the reference task (the ``muon`` entry: torch's
Muon, Nesterov, on the hidden matrices, AdamW on the rest, the reference schedule) with two
simulated ranks: each step both ranks' gradients (their own batches, as 2 workers read them) are
computed at the same parameters, their mean steps dense Muon, and every compressed method's state
is fed the same two gradients (open loop: the methods do not move the parameters). For each
hidden matrix and step the cosine between the method's direction and dense Muon's, orth(mean g +
mu M), is recorded; reported per method: its mean over the matrices, over windows of steps.

Methods (their codec is the library's, ``SparseBatch``, in the settings of the bench entries):
demo's ``update`` muon (orth of the mean q of the sent components, which leave the momentum),
with ``mean_momentum`` (orth(q + b u), u = b u + q), ``keep_sent``, more components, and dion
(its step P Q^T). Writes ``muon_directions.csv`` (every window) and ``.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ds_lowcomm.codec import SparseBatch, SparseSpec
from ds_lowcomm.optim.demo import orthogonalize
from ds_lowcomm.optim.dion import dion_rank
from ds_lowcomm.optim.muon import MuonWithAdamW, split_muon_params
from lowcomm_task.reference import ReferenceTask
from lowcomm_task.spec import TrainSpec
from lowcomm_task.steps import lr_lambda

from .codec import write_csv
from .runs import add_model_args, model_of

# name -> settings: demo's (chunk, topk, decay, mean_momentum, keep_sent; int8 values, senders' mean) or dion's
METHODS = {
    "demo_muon": {"chunk": 8, "topk": 1, "decay": 0.995},
    "demo_muon_c16": {"chunk": 16, "topk": 2, "decay": 0.995},
    "demo_muon keep_sent 0.9": {"chunk": 8, "topk": 1, "decay": 0.995, "keep_sent": 0.9},
    "demo_muon mean_momentum 0.95": {"chunk": 8, "topk": 1, "decay": 0.995, "mean_momentum": 0.95},
    "demo_muon decay 0.95 mean_momentum 0.95": {"chunk": 8, "topk": 1, "decay": 0.95, "mean_momentum": 0.95},
    "demo_muon topk 8 mean_momentum 0.95": {"chunk": 8, "topk": 8, "decay": 0.995, "mean_momentum": 0.95},
    "demo_muon topk 64 mean_momentum 0.95": {"chunk": 8, "topk": 64, "decay": 0.995, "mean_momentum": 0.95},
    "dion rank 1/4": {"dion": 0.25},
    "dion rank 1/32": {"dion": 0.03125},
    # error feedback on the gradient through a rank-r power iteration (PowerSGD's), the decoded mean
    # into a momentum kept apart (the same on every rank) and Muon's step on it (Nesterov's form)
    "powersgd rank 1 + muon": {"powersgd": 1},
    "powersgd rank 4 + muon": {"powersgd": 4},
    # for scale: dense, without momentum; and one rank's own Muon on its half of the batch
    "orth(mean g) without momentum": {"dense": 0.0},
    "rank 0's own Muon": {"dense": 0.95, "ranks": [0]},
}
DEFAULT_METHODS = ("demo_muon", "demo_muon_c16", "demo_muon mean_momentum 0.95", "demo_muon topk 8 mean_momentum 0.95",
                   "demo_muon topk 64 mean_momentum 0.95", "dion rank 1/4", "powersgd rank 4 + muon",
                   "orth(mean g) without momentum", "rank 0's own Muon")


class DemoDirection:
    """demo's exchange of two ranks' momenta and its orthogonalised step, one process."""

    def __init__(self, shapes, s: dict, ranks: int):
        self.s = s
        self.batch = SparseBatch([SparseSpec.build(sh, chunk=s["chunk"], topk=s["topk"], value_dtype="int8")
                                  for sh in shapes])
        self.moms = [[torch.zeros(sh) for sh in shapes] for _ in range(ranks)]
        self.u = [torch.zeros(sh) for sh in shapes]

    def step(self, grads_by_rank, lr: float) -> list[torch.Tensor]:
        payloads = []
        for moms, grads in zip(self.moms, grads_by_rank):
            for m, g in zip(moms, grads):
                m.mul_(self.s["decay"]).add_(g, alpha=lr)
            payload, sent = self.batch.compress(moms)
            keep = self.s.get("keep_sent", 0.0)
            for m, x in zip(moms, sent):
                m.sub_(x, alpha=1.0 - keep)
            payloads.append(payload)
        qs = self.batch.decompress_mean(torch.stack(payloads), "senders")
        b = self.s.get("mean_momentum", 0.0)
        out = []
        for q, u in zip(qs, self.u):
            if b:
                u.mul_(b).add_(q)
                q = q + b * u
            out.append(orthogonalize(q))
        return out


class DionDirection:
    """dion's power iteration over two ranks' momenta and its step P Q^T, one process."""

    def __init__(self, shapes, fraction: float, ranks: int, mu: float = 0.95):
        self.mu = mu
        self.moms = [[torch.zeros(sh) for sh in shapes] for _ in range(ranks)]
        self.qs = [torch.randn(min(sh), dion_rank(sh, fraction), generator=torch.Generator().manual_seed(i))
                   for i, sh in enumerate(shapes)]

    def step(self, grads_by_rank, lr: float) -> list[torch.Tensor]:
        out = []
        for i, q in enumerate(self.qs):
            for moms, grads in zip(self.moms, grads_by_rank):
                moms[i].add_(grads[i])
            tall = self.moms[0][i].shape[0] >= self.moms[0][i].shape[1]
            bs = [m[i] if tall else m[i].T for m in self.moms]
            p = torch.linalg.qr(sum(b @ q for b in bs) / len(bs)).Q
            r = sum(b.T @ p for b in bs) / len(bs)
            for b in bs:
                b.sub_(p @ r.T, alpha=1.0 - self.mu)
            self.qs[i] = r / (r.norm(dim=0, keepdim=True) + 1e-8)
            out.append(p @ self.qs[i].T if tall else self.qs[i] @ p.T)
        return out


class PowerSGDMuonDirection:
    """PowerSGD's compressed mean of the ranks' gradients plus error feedback (rank r, one warm-started
    power iteration), Muon's Nesterov momentum on the decoded mean, and its orthogonalised step."""

    def __init__(self, shapes, rank: int, ranks: int, mu: float = 0.95):
        self.mu = mu
        self.errs = [[torch.zeros(sh) for sh in shapes] for _ in range(ranks)]
        self.moms = [torch.zeros(sh) for sh in shapes]
        self.qs = [torch.randn(min(sh), min(rank, *sh), generator=torch.Generator().manual_seed(i))
                   for i, sh in enumerate(shapes)]

    def step(self, grads_by_rank, lr: float) -> list[torch.Tensor]:
        out = []
        for i, q in enumerate(self.qs):
            tall = self.moms[i].shape[0] >= self.moms[i].shape[1]
            bs = []
            for errs, grads in zip(self.errs, grads_by_rank):
                errs[i].add_(grads[i])
                bs.append(errs[i] if tall else errs[i].T)
            p = torch.linalg.qr(sum(b @ q for b in bs) / len(bs)).Q
            r = sum(b.T @ p for b in bs) / len(bs)
            mean = p @ r.T
            for b in bs:
                b.sub_(mean)
            self.qs[i] = r
            g = mean if tall else mean.T
            self.moms[i].mul_(self.mu).add_(g)
            out.append(orthogonalize(g + self.mu * self.moms[i]))
        return out


class DenseDirection:
    """Muon's step on the mean gradient of ``ranks`` (all: dense; one: that rank alone), momentum ``mu``."""

    def __init__(self, shapes, mu: float, ranks: list[int] | None):
        self.mu, self.ranks = mu, ranks
        self.moms = [torch.zeros(sh) for sh in shapes]

    def step(self, grads_by_rank, lr: float) -> list[torch.Tensor]:
        chosen = [grads_by_rank[r] for r in (self.ranks or range(len(grads_by_rank)))]
        out = []
        for i, m in enumerate(self.moms):
            g = sum(gs[i] for gs in chosen) / len(chosen)
            m.mul_(self.mu).add_(g)
            out.append(orthogonalize(g + self.mu * m))
        return out


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-30))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench muon_directions", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/muon_directions")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--schedule-steps", type=int, default=900, help="the schedule's length (the fair protocol's budget)")
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.008, help="AdamW's (dense Muon's tuned)")
    ap.add_argument("--muon-lr", type=float, default=0.05)
    ap.add_argument("--demo-lr", type=float, default=0.006, help="folded into demo's momenta (its schedule)")
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma list of: {', '.join(METHODS)}")
    add_model_args(ap)
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",")]
    spec = TrainSpec(steps=args.schedule_steps, model=model_of(args), seed=0, verbose=False)
    task = ReferenceTask(spec)
    torch.manual_seed(0)
    model = task.build_model()
    muon_params, others = split_muon_params(model)
    muon_kw = {"lr": args.muon_lr, "momentum": 0.95, "nesterov": True, "weight_decay": 0.0}
    opt = MuonWithAdamW(muon_params, others, muon=muon_kw, adamw={"lr": args.lr, "betas": spec.betas})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup, args.schedule_steps))
    shapes = [tuple(p.shape) for p in muon_params]
    def follower(settings):
        if "dion" in settings:
            return DionDirection(shapes, settings["dion"], 2)
        if "powersgd" in settings:
            return PowerSGDMuonDirection(shapes, settings["powersgd"], 2)
        if "dense" in settings:
            return DenseDirection(shapes, settings["dense"], settings.get("ranks"))
        return DemoDirection(shapes, settings, 2)

    follow = {m: follower(METHODS[m]) for m in methods}
    momentum = [torch.zeros(sh) for sh in shapes]
    sums = {m: 0.0 for m in methods}
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for step in range(args.steps):
        grads, other_grads = [], []
        for rank in range(2):
            x, y = task.train_batch(rank, 2, step, spec.batch)
            model(x, y).backward()
            grads.append([p.grad.detach().clone() for p in muon_params])
            other_grads.append([p.grad.detach().clone() for p in others])
            opt.zero_grad(set_to_none=True)
        mean = [(a + b) / 2 for a, b in zip(*grads)]
        dense = []
        for m, g in zip(momentum, mean):  # dense Muon's direction (torch's Nesterov form, up to scale)
            m.mul_(0.95).add_(g)
            dense.append(orthogonalize(g + 0.95 * m))
        scale = lr_lambda(args.warmup, args.schedule_steps)(step)
        for name, f in follow.items():
            dirs = f.step(grads, args.demo_lr * scale)
            sums[name] += sum(cosine(d, t) for d, t in zip(dirs, dense)) / len(dense)
        for p, a, b in [*zip(muon_params, *grads), *zip(others, *other_grads)]:  # dense Muon: the ranks' mean
            p.grad = (a + b) / 2
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        if (step + 1) % args.window == 0:
            for name in methods:
                rows.append({"method": name, "steps": f"{step + 2 - args.window}-{step + 1}",
                             "mean_cosine_to_muon": sums[name] / args.window})
                sums[name] = 0.0
            print("  ".join(f"{r['method']}: {r['mean_cosine_to_muon']:.3f}" for r in rows[-len(methods):]),
                  flush=True)
            write_csv(out / "muon_directions.csv", rows, ["method", "steps", "mean_cosine_to_muon"])
    (out / "muon_directions.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
