"""SparseLoCo in 2 and 4 real gloo processes, against a single-process replay written from the
algorithm's definition (error feedback, chunked top-k, 2-bit values decoded through bin means)."""

import numpy as np
import pytest
import torch

from ds_lowcomm.codec import ChunkPlan, SparseSpec, topk_count
from ds_lowcomm.codec.dct import from_blocks, to_blocks
from lowcomm_task.workers import run_local_workers
from ds_lowcomm.optim import SparseLoCo

from .conftest import params_digest, replay_sgd_step, tiny_loss, tiny_model

SETTINGS = dict(sync_every=2, decay=0.95, topk=4, chunk=8, outer_lr=0.65)
LR, STEPS = 0.1, 6


def _worker(rank, world):
    model = tiny_model()
    opt = SparseLoCo(torch.optim.SGD(model.parameters(), lr=LR), **SETTINGS)
    digests, sent = [], []
    for s in range(STEPS):
        tiny_loss(model, rank, s).backward()
        opt.step()
        opt.zero_grad()
        digests.append(params_digest(model))
        sent.append(opt.ledger.step_bytes()[0])
    return {"final": [p.detach().clone() for p in model.parameters()], "digests": digests, "sent": sent,
            "payload": opt._sync_for(list(model.parameters()), "outer_sparse_all_gather").payload_bytes,
            "by_op": opt.ledger.summary()["by_op"]}


def _two_bit(values):
    """4 equal bins over mean +- 3 sigma of this tensor's kept values; each decodes to its bin's mean."""
    mean, sigma = values.mean(), values.std()
    bins = np.searchsorted(mean + sigma * np.array([-1.5, 0.0, 1.5]), values, side="right")
    return np.array([values[bins == b].mean() for b in bins])


def _replay(world):
    models = [tiny_model() for _ in range(world)]
    anchor = [p.detach().double().numpy().copy() for p in models[0].parameters()]
    errors = [[np.zeros_like(a) for a in anchor] for _ in range(world)]
    for s in range(STEPS):
        replay_sgd_step(models, s, LR)
        if (s + 1) % SETTINGS["sync_every"]:
            continue
        for i, a in enumerate(anchor):
            plan = ChunkPlan.for_shape(a.shape, SETTINGS["chunk"])
            k = topk_count(plan, SETTINGS["topk"], SETTINGS["chunk"])
            total = np.zeros_like(a)
            for r, m in enumerate(models):
                e = errors[r][i]
                e *= SETTINGS["decay"]
                e += a - list(m.parameters())[i].detach().double().numpy()
                blocks = to_blocks(torch.as_tensor(e), plan).reshape(plan.num_blocks, -1).numpy()
                top = np.argsort(-np.abs(blocks), axis=1)[:, :k]
                kept = np.zeros_like(blocks)
                rows = np.arange(plan.num_blocks)[:, None]
                kept[rows, top] = _two_bit(blocks[rows, top].ravel()).reshape(top.shape)
                sent = from_blocks(torch.as_tensor(kept).reshape(plan.num_blocks, plan.h, plan.w), plan).numpy()
                e -= sent
                total += sent
            a -= SETTINGS["outer_lr"] * total / world  # no outer momentum
        for m in models:
            with torch.no_grad():
                for p, a in zip(m.parameters(), anchor):
                    p.copy_(torch.as_tensor(a))
    return anchor


@pytest.mark.parametrize("world", [2, 4])
def test_sparseloco_matches_single_process_replay(world):
    results = run_local_workers(_worker, world)
    replay = _replay(world)
    for got, want in zip(results[0]["final"], replay):
        np.testing.assert_allclose(got.double().numpy(), want, atol=2e-6)
    initial = [p.detach().double().numpy() for p in tiny_model().parameters()]
    assert max(np.abs(w - i).max() for w, i in zip(replay, initial)) > 0.01  # it really moved
    for s in range(STEPS):
        synced = (s + 1) % SETTINGS["sync_every"] == 0
        assert (len({r["digests"][s] for r in results}) == 1) == synced, s
        # bytes only on sync steps, exactly one packed payload each
        assert all((r["sent"][s] == r["payload"]) if synced else r["sent"][s] == 0 for r in results)


def test_sparseloco_wire_is_12bit_indices_and_2bit_values():
    # one 64x64 chunk, 64 kept: 96 bytes of indices, 16 of 2-bit codes, a 16-byte lookup table
    spec = SparseSpec.build((64, 64), chunk=64, topk=64, value_dtype="2bit", transform="none")
    assert spec.nbytes == 96 + 16 + 16
    assert 4096 * 4 // spec.nbytes == 128  # vs the chunk's dense fp32 pseudo-gradient
    assert 64 * (8 + 4) // spec.nbytes == 6  # vs int64 indices + fp32 values
