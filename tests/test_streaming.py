"""Streaming outer sync (fragments on a staggered schedule, landing sync_delay steps later) in 2
real gloo processes, against a single-process replay of Streaming DiLoCo."""

import numpy as np
import pytest
import torch

from lowcomm_task.workers import run_local_workers
from ds_lowcomm.optim import DiLoCo

from .conftest import replay_sgd_step, tiny_loss, tiny_model

LR, H, STEPS = 0.1, 4, 11
OUTER = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True)
FRAGMENTS = [[0], [1, 2, 3]]  # tiny_model(): 512-element weight | its bias, 128-element weight, bias


def _worker(rank, world, delay, mix, carry=False):
    model = tiny_model()
    params = list(model.parameters())
    opt = DiLoCo(torch.optim.SGD(params, lr=LR), sync_every=H, fragments=2, sync_delay=delay, fragment_mix=mix,
                 carry_local_steps=carry, **OUTER)
    position = {id(p): i for i, p in enumerate(params)}
    fragments = [[position[id(p)] for p in f] for f in opt.fragments_of(params)]
    in_flight, sent = [], []
    for s in range(STEPS):
        tiny_loss(model, rank, s).backward()
        opt.step()
        opt.zero_grad()
        in_flight.append(len(opt._in_flight))
        sent.append(opt.ledger.step_bytes()[0])
    return {"final": [p.detach().clone() for p in params], "fragments": fragments, "in_flight": in_flight,
            "sent": sent}


def _replay(world, delay, mix, carry=False):
    models = [tiny_model() for _ in range(world)]
    anchor = [p.detach().double().numpy().copy() for p in models[0].parameters()]
    momentum = [np.zeros_like(a) for a in anchor]
    pending = {}
    for s in range(STEPS):
        t = s + 1
        replay_sgd_step(models, s, LR)
        for f, members in enumerate(FRAGMENTS):
            offset = (f + 1) * H // len(FRAGMENTS)
            if t >= offset and (t - offset) % H == 0:  # send: the mean pseudo-gradient, as of now
                local = [[list(m.parameters())[i].detach().double().numpy() for i in members] for m in models]
                pending[f] = (t, [sum(anchor[i] - local[r][n] for r in range(world)) / world
                                  for n, i in enumerate(members)], [[x.copy() for x in own] for own in local])
            if f in pending and pending[f][0] == t - delay:  # land
                for n, i in enumerate(members):
                    g = pending[f][1][n]
                    momentum[i] = OUTER["outer_momentum"] * momentum[i] + g
                    anchor[i] = anchor[i] - OUTER["outer_lr"] * (g + OUTER["outer_momentum"] * momentum[i])
                    for r, m in enumerate(models):
                        with torch.no_grad():
                            p = list(m.parameters())[i]
                            now = p.double().numpy()
                            # carry: the replica's own steps since the send, on top of the new anchor
                            new = anchor[i] + (now - pending[f][2][r][n]) if carry else mix * now + (1 - mix) * anchor[i]
                            p.copy_(torch.as_tensor(new))
                del pending[f]
    return [[p.detach().double().numpy() for p in m.parameters()] for m in models]


CASES = [(0, 0.0), (1, 0.5), (3, 0.0), (2, 0.0, True)]


def _carry_bf16_state(rank, world):
    """fp32 parameters, anchors in bf16 (state_dtype), carry_local_steps: at the landing step,
    what the parameters become, beside the same sum worked out here in fp32 from the parameters
    at the send and the inner step (SGD) just before the landing."""
    model = tiny_model()
    params = list(model.parameters())
    opt = DiLoCo(torch.optim.SGD(params, lr=LR), sync_every=H, sync_delay=2, carry_local_steps=True,
                 state_dtype="bf16", **OUTER)
    for s in range(H + 1):  # sent after step H, in flight during H + 1
        tiny_loss(model, rank, s).backward()
        opt.step()
        opt.zero_grad()
    sent = [opt.state[p]["sent_from"].clone() for p in params]
    tiny_loss(model, rank, H + 1).backward()
    with torch.no_grad():
        inner = [p - LR * p.grad for p in params]  # SGD's step, the last before the landing
    opt.step()  # lands
    return {"landed": [p.detach().clone() for p in params], "sent": sent, "inner": inner,
            "anchors": [opt.state[p]["anchor"].float() for p in params]}


def _cases_worker(rank, world):
    """Every case in one launch of 2 processes (a launch costs more than the runs)."""
    return {**{case: _worker(rank, world, *case) for case in CASES}, "bf16": _carry_bf16_state(rank, world)}


@pytest.fixture(scope="module")
def runs():
    results = run_local_workers(_cases_worker, 2)
    return {case: [r[case] for r in results] for case in [*CASES, "bf16"]}


@pytest.mark.parametrize("case", CASES)
def test_streaming_diloco_matches_replay(case, runs):
    results = runs[case]
    replay = _replay(2, *case)
    delay = case[0]
    assert results[0]["fragments"] == FRAGMENTS
    for r, res in enumerate(results):
        for got, want in zip(res["final"], replay[r]):
            np.testing.assert_allclose(got.double().numpy(), want, atol=2e-6)
    # fragment 0 goes at steps 2, 6, 10 and fragment 1 at 4, 8: one fragment on the wire at a time
    sends = [t for t in range(1, STEPS + 1) if results[0]["sent"][t - 1] > 0]
    assert sends == [2, 4, 6, 8, 10]
    if delay:
        # each sync is still in flight while the next `delay` inner steps run (with delay 3, two at once)
        assert results[0]["in_flight"] == [sum(t0 <= t < t0 + delay for t0 in sends) for t in range(1, STEPS + 1)]


def test_carried_steps_keep_fp32_precision_with_bf16_anchors(runs):
    """The steps carried onto a bf16 anchor are the fp32 parameters' exact progress: the copy at
    the send is the parameter's own dtype, not state_dtype's (a bf16 copy would round the progress
    away at the size of the parameters, far more than the check's tolerance)."""
    for res in runs["bf16"]:
        for landed, sent, inner, anchor in zip(res["landed"], res["sent"], res["inner"], res["anchors"]):
            assert sent.dtype == torch.float32
            torch.testing.assert_close(landed, anchor + (inner - sent), rtol=0, atol=1e-6)
            rounded = anchor + (inner.bfloat16().float() - sent.bfloat16().float())
            assert (rounded - landed).abs().max() > 1e-4


def test_fragments_are_contiguous_and_balanced():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 10, 10, 10, 40, 5, 5)]
    opt = DiLoCo(torch.optim.SGD(params, lr=0.1), sync_every=8, fragments=3, transport=_SoloTransport())
    sizes = [[p.numel() for p in f] for f in opt.fragments_of(params)]
    assert sizes == [[10, 10, 10], [10, 40], [5, 5]]
    with pytest.raises(ValueError, match="lowcomm.fragments is 3 but this optimizer steps 2 tensor"):
        opt.fragments_of(params[:2])


class _SoloTransport:
    """A one-rank transport (no process group) for pure schedule logic."""

    def __init__(self):
        from ds_lowcomm.comm import ByteLedger

        self.rank, self.world_size, self.ledger, self.device = 0, 1, ByteLedger(), torch.device("cpu")

    def all_gather_bytes(self, payload, op="all_gather"):
        return payload[None]
