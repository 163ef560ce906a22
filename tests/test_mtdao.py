"""MT-DAO: against torch's Adam/AdamW (its one-momentum special case), a replay of the algorithm
from its definition on 2 real gloo processes, and its compressed syncs against its dense ones."""

import numpy as np
import pytest
import torch

from ds_lowcomm.workers import run_local_workers
from ds_lowcomm.optim import MTDAO

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


def _codecs_worker(rank, world):
    """Every codec's run in one launch of 2 processes (a launch costs more than the runs)."""
    return {name: _worker(rank, world, codec) for name, codec in CODECS.items()}


@pytest.fixture(scope="module")
def runs():
    results = run_local_workers(_codecs_worker, 2)
    return {name: [r[name] for r in results] for name in CODECS}


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
