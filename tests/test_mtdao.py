"""MT-DAO: against torch's Adam/AdamW (its one-momentum special case), a replay of the algorithm
from its definition on 2 real gloo processes, the authors' recipe (warm start, switch, clipping,
per-state periods, outer Nesterov step) replayed bit for bit, and its compressed syncs against its
dense ones."""

import math

import numpy as np
import pytest
import torch

from lowcomm_task.workers import run_local_workers
from ds_lowcomm.optim import MTDAO
from ds_lowcomm.optim.mtdao import MTDAOSettings

from .conftest import params_digest, tiny_loss, tiny_model

LR = 0.01


def _adam_special_case_worker(rank, world):
    """One momentum with weight 1 is Adam (bias corrections, eps outside the root, decoupled decay)."""
    a, b = tiny_model(), tiny_model()
    opt_a = MTDAO(a.parameters(), lr=LR, momentum_betas=(0.9,), momentum_weights=(1.0,), beta2=0.99,
                  weight_decay=0.1, sync_every=10**6)
    opt_b = torch.optim.AdamW(b.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.1)
    for s in range(5):
        for m, o in ((a, opt_a), (b, opt_b)):
            tiny_loss(m, rank, s).backward()
            o.step()
            o.zero_grad()
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def test_one_momentum_with_weight_one_is_adamw():
    assert run_local_workers(_adam_special_case_worker, 1)[0] < 1e-6


CASE = dict(momentum_betas=(0.9, 0.995), momentum_weights=(0.3, 0.5), beta2=0.99, eps=1e-8, sync_every=2,
            momentum_sync_every=(3, 1), second_moment_sync_every=4)
STEPS = 7


def _worker(rank, world, codec):
    model = tiny_model()
    opt = MTDAO(model.parameters(), lr=LR, **CASE, **codec)
    digests, sent = [], []
    for s in range(STEPS):
        tiny_loss(model, rank, s).backward()
        opt.step()
        opt.zero_grad()
        digests.append(params_digest(model))
        sent.append(opt.ledger.step_bytes()[0])
    return {"final": [p.detach().clone() for p in model.parameters()], "digests": digests, "sent": sent,
            "by_op": opt.ledger.summary()["by_op"]}


def _replay(world):
    """The algorithm from its definition, in float64, every rank simulated in one process."""
    models = [tiny_model() for _ in range(world)]
    betas, weights, beta2, eps = CASE["momentum_betas"], CASE["momentum_weights"], CASE["beta2"], CASE["eps"]
    params = [[p.detach().double().numpy().copy() for p in m.parameters()] for m in models]
    us = [[[np.zeros_like(p) for p in params[0]] for _ in betas] for _ in range(world)]
    vs = [[np.zeros_like(p) for p in params[0]] for _ in range(world)]
    for s in range(STEPS):
        t = s + 1
        for r, m in enumerate(models):
            with torch.no_grad():
                for p, value in zip(m.parameters(), params[r]):
                    p.copy_(torch.as_tensor(value))
            tiny_loss(m, r, s).backward()
            for i, p in enumerate(m.parameters()):
                g = p.grad.double().numpy()
                p.grad = None
                vs[r][i] = beta2 * vs[r][i] + (1 - beta2) * g * g
                direction = (1 - sum(weights)) * g
                for j, (beta, w) in enumerate(zip(betas, weights)):
                    us[r][j][i] = beta * us[r][j][i] + (1 - beta) * g
                    direction = direction + w * us[r][j][i] / (1 - beta**t)
                params[r][i] = params[r][i] - LR * direction / (np.sqrt(vs[r][i] / (1 - beta2**t)) + eps)

        def average(get, put):
            for i in range(len(params[0])):
                mean = sum(get(r, i) for r in range(world)) / world
                for r in range(world):
                    put(r, i, mean.copy())

        if t % CASE["sync_every"] == 0:
            average(lambda r, i: params[r][i], lambda r, i, x: params[r].__setitem__(i, x))
        for j, k in enumerate(CASE["momentum_sync_every"]):
            if t % k == 0:
                average(lambda r, i: us[r][j][i], lambda r, i, x: us[r][j].__setitem__(i, x))
        if t % CASE["second_moment_sync_every"] == 0:
            average(lambda r, i: vs[r][i], lambda r, i, x: vs[r].__setitem__(i, x))
    return params


CODECS = {
    "dense": {},
    "lossless": dict(sync_codec="topk", topk=64, chunk=8, transform="dct", value_dtype="fp32", average="world"),
    "lossy": dict(sync_codec="topk", topk=4, chunk=8, value_dtype="bf16"),
}


# The authors' recipe in small (torchtitan/experiments/fl: QHAdamW / AggMoAdamW, desloc.py, the
# hyperparameter switch): synchronous Adam for SWITCH steps, then the switch and local steps with
# each state on its own period, counted from the switch; clipping that bites in both phases.
SWITCH = 3
RECIPES = {
    # several momenta (AggMoAdamW's rounding), a period per state, weight decay
    "aggmo": dict(momentum_betas=(0.9, 0.995), momentum_weights=(0.3, 0.5), beta2=0.99, sync_every=2,
                  momentum_sync_every=(3, 1), second_moment_sync_every=4, switch_step=SWITCH,
                  warm_betas=(0.9, 0.999), switch_lr_scale=4.0),
    # the published form: one slow momentum (QHAdamW's rounding) and the outer Nesterov step
    "qh_nesterov": dict(momentum_betas=(0.999,), momentum_weights=(0.98,), beta2=0.999, sync_every=4,
                        momentum_sync_every=(2,), second_moment_sync_every=3, switch_step=SWITCH,
                        warm_betas=(0.9, 0.999), switch_lr_scale=4.0, outer_optimizer="sgd", outer_lr=0.7,
                        outer_momentum=0.9, nesterov=True),
}
RECIPE_STEPS, CLIP, WD = SWITCH + 12, 0.05, 0.1


def _recipe_worker(rank, world, recipe):
    model = tiny_model()
    initial = [p.detach().clone() for p in model.parameters()]
    # beta2 here is the optimizer's (an AdamW's betas[1]); the settings' beta2 takes its place
    opt = MTDAO(model.parameters(), lr=LR, beta2=0.5, weight_decay=WD, clip_grad=CLIP,
                settings=MTDAOSettings(**RECIPES[recipe]))
    grads, after = [], []
    for s in range(RECIPE_STEPS):
        tiny_loss(model, rank, s).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        after.append([p.detach().clone() for p in model.parameters()])
    return {"initial": initial, "grads": grads, "after": after, "state": [dict(opt.state[p]) for p in model.parameters()],
            "by_op": opt.ledger.summary()["by_op"]}


def _clipped(grads, max_norm):
    """The gradients scaled to a 2-norm of at most max_norm, as torch (and through it torchtitan,
    DeepSpeed, Megatron) clips: the norm of the tensors' norms, max_norm / (norm + 1e-6) capped at 1."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    return [g.clone().mul_(coef) for g in grads]


def _adam_(p, us, v, g, lr, betas, weights, beta2, eps, t):
    """The authors' update of one tensor, in their order and rounding (qhadamw.py, aggmo_adamw.py,
    single-tensor path; torch's AdamW weight decay)."""
    p.mul_(1.0 - lr * WD)
    for u, beta in zip(us, betas):
        u.mul_(beta).add_(g, alpha=1.0 - beta)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = (v.sqrt() / math.sqrt(1.0 - beta2**t)).add_(eps)
    if len(us) == 1:  # QHAdamW: g (1 - v1) + m_hat v1
        numerator = g * (1.0 - weights[0]) + (us[0] / (1.0 - betas[0] ** t)) * weights[0]
    else:  # AggMoAdamW: g (1 - sum v) + sum_j v_j m_hat_j
        numerator = g.mul(1.0 - sum(weights))
        for u, beta, w in zip(us, betas, weights):
            numerator.add_(u / (1.0 - beta**t), alpha=w)
    p.addcdiv_(numerator, denom, value=-lr)


def _replay_recipe(initial, grads_by_rank, recipe, reset_momenta=True):
    """The recipe from its definition, every rank simulated in one process, in the run's dtype:
    returns each step's parameters of every rank."""
    case = RECIPES[recipe]
    world, eps = len(grads_by_rank), 1e-8
    betas, weights = case["momentum_betas"], case["momentum_weights"]
    params = [[p.clone() for p in initial] for _ in range(world)]
    us = [[[torch.zeros_like(p) for p in initial] for _ in betas] for _ in range(world)]
    vs = [[torch.zeros_like(p) for p in initial] for _ in range(world)]
    anchors, outer = None, None
    periods = {"param": case["sync_every"], "v": case["second_moment_sync_every"],
               **{j: k for j, k in enumerate(case["momentum_sync_every"])}}

    def average(tensors_of):  # the mean over ranks, as an all-reduce sum divided by the world size
        for i in range(len(initial)):
            mean = sum(tensors_of(r)[i] for r in range(world)) / world
            for r in range(world):
                tensors_of(r)[i].copy_(mean)

    history = []
    for s in range(RECIPE_STEPS):
        t = s + 1
        if t <= SWITCH:  # synchronous Adam: the mean gradient, clipped, one momentum of weight 1
            mean = _clipped([sum(grads_by_rank[r][s][i] for r in range(world)) / world
                             for i in range(len(initial))], CLIP)
            for r in range(world):
                for i in range(len(initial)):
                    _adam_(params[r][i], [us[r][0][i]], vs[r][i], mean[i], LR, case["warm_betas"][:1], (1.0,),
                           case["warm_betas"][1], eps, t)
        else:
            if t == SWITCH + 1:  # the switch: momenta zeroed, the step counter and v kept
                if reset_momenta:
                    for r in range(world):
                        for u in us[r]:
                            for x in u:
                                x.zero_()
                if case.get("outer_optimizer") == "sgd":  # the replicas' common parameters at the switch
                    anchors = [p.clone() for p in params[0]]
                    outer = torch.optim.SGD(anchors, lr=case["outer_lr"], momentum=case["outer_momentum"],
                                            nesterov=case["nesterov"])
            for r in range(world):
                g = _clipped(grads_by_rank[r][s], CLIP)  # each replica's own gradient
                for i in range(len(initial)):
                    _adam_(params[r][i], [u[i] for u in us[r]], vs[r][i], g[i], LR * case["switch_lr_scale"], betas,
                           weights, case["beta2"], eps, t)
            k = t - SWITCH
            if k % periods["param"] == 0:
                average(lambda r: params[r])
                if anchors is not None:  # DiLoCo's outer step, as the authors run torch's SGD on it
                    for anchor, mean in zip(anchors, params[0]):
                        anchor.grad = anchor - mean
                    outer.step()
                    for r in range(world):
                        for p, anchor in zip(params[r], anchors):
                            p.copy_(anchor)
            for j in range(len(betas)):
                if k % periods[j] == 0:
                    average(lambda r, j=j: us[r][j])
            if k % periods["v"] == 0:
                average(lambda r: vs[r])
        history.append([[p.clone() for p in params[r]] for r in range(world)])
    return history, us, vs


def _codecs_worker(rank, world):
    """Every codec's run and the recipes' in one launch of 2 processes (a launch costs more than the runs)."""
    return {**{name: _worker(rank, world, codec) for name, codec in CODECS.items()},
            **{recipe: _recipe_worker(rank, world, recipe) for recipe in RECIPES}}


@pytest.fixture(scope="module")
def runs():
    results = run_local_workers(_codecs_worker, 2)
    return {name: [r[name] for r in results] for name in [*CODECS, *RECIPES]}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_authors_recipe_matches_its_replay_bit_for_bit(recipe, runs):
    """Warm start (the mean gradient, clipped), the switch (momenta zeroed, counter and v kept, new
    betas and weights, lr x4), local steps clipped per replica, each state averaged on its own period
    counted from the switch (and the outer Nesterov step): equal bits on both ranks after every step."""
    results = runs[recipe]
    history, us, vs = _replay_recipe(results[0]["initial"], [r["grads"] for r in results], recipe)
    for s in range(RECIPE_STEPS):
        for r, res in enumerate(results):
            for got, want in zip(res["after"][s], history[s][r]):
                assert torch.equal(got, want), (recipe, "step", s + 1, "rank", r, (got - want).abs().max().item())
    for r, res in enumerate(results):
        for i, state in enumerate(res["state"]):
            assert state["step"] == RECIPE_STEPS
            assert torch.equal(state["v"], vs[r][i])
            for j in range(len(RECIPES[recipe]["momentum_betas"])):
                assert torch.equal(state[f"u{j}"], us[r][j][i])
    # the warm start all-reduces the gradients once a step, the local phase syncs as scheduled
    assert results[0]["by_op"]["mtdao_grad_all_reduce"]["calls"] == SWITCH
    # the clipping bit (every step's norm is above CLIP) and the switch's reset matters: without it
    # the replay ends elsewhere
    assert all(torch.linalg.vector_norm(torch.stack([g.norm() for g in step])) > 2 * CLIP for step in results[0]["grads"])
    unreset, _, _ = _replay_recipe(results[0]["initial"], [r["grads"] for r in results], recipe, reset_momenta=False)
    assert not all(torch.equal(a, b) for a, b in zip(unreset[-1][0], history[-1][0]))


def test_mtdao_matches_replay_with_its_sync_periods(runs):
    results = runs["dense"]
    replay = _replay(2)
    for r, res in enumerate(results):
        for got, want in zip(res["final"], replay[r]):
            np.testing.assert_allclose(got.double().numpy(), want, atol=2e-6)
    for s in range(STEPS):  # replicas agree right after each parameter sync, not between
        assert (results[0]["digests"][s] == results[1]["digests"][s]) == ((s + 1) % CASE["sync_every"] == 0), s
    # something syncs at every step here (momentum 1 has period 1): one collective per step, not one per tensor
    assert results[0]["by_op"]["mtdao_all_reduce"]["calls"] == STEPS


def test_compressed_syncs_sending_everything_equal_dense_syncs(runs):
    dense, lossless = runs["dense"], runs["lossless"]
    for a, b in zip(dense, lossless):
        for x, y in zip(a["final"], b["final"]):
            np.testing.assert_allclose(x.numpy(), y.numpy(), atol=1e-5)


def test_compressed_syncs_send_less_and_keep_replicas_equal_after_parameter_syncs(runs):
    dense, lossy = runs["dense"], runs["lossy"]
    assert sum(lossy[0]["sent"]) < sum(dense[0]["sent"]) / 4
    for s in range(STEPS):
        if (s + 1) % CASE["sync_every"] == 0:
            assert lossy[0]["digests"][s] == lossy[1]["digests"][s], s
