"""Streaming outer sync (fragments on a staggered schedule, landing sync_delay steps later) in 2
real gloo processes, against single-process replays written from the definitions: Streaming
DiLoCo's landings, H growing during training (sync_every_schedule), and dct_diloco's one-bit
compressed all-reduce on fragments in flight; each resumed from a checkpoint taken with a sync in
flight."""

import numpy as np
import pytest
import torch

from lowcomm_task.workers import run_local_workers
from ds_lowcomm.optim import DCTDiLoCo, DiLoCo

from .conftest import replay_sgd_step, resumed_tiny, same_bits, tiny_checkpoint, tiny_loss, tiny_model, train_tiny

LR, H, STEPS = 0.1, 4, 11
OUTER = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True)
FRAGMENTS = [[0], [1, 2, 3]]  # tiny_model(): 512-element weight | its bias, 128-element weight, bias


def _sends_by_definition(sync_every, schedule, fragments, steps):
    """Each fragment's sync steps up to ``steps``, from the definition: H(t) is the H of the last
    [from_step, H] entry with from_step <= t, else sync_every; fragment f first syncs at
    (f + 1) * sync_every // fragments, then each next at the last + H(last)."""
    def interval(t):
        return ([h for start, h in schedule if start <= t] or [sync_every])[-1]

    out = {}
    for f in range(fragments):
        t, out[f] = (f + 1) * sync_every // fragments, []
        while t <= steps:
            out[f].append(t)
            t += interval(t)
    return out


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


def _replay(world, delay, mix, carry=False, sync_every=H, schedule=(), steps=STEPS):
    sends = _sends_by_definition(sync_every, schedule, len(FRAGMENTS), steps)
    models = [tiny_model() for _ in range(world)]
    anchor = [p.detach().double().numpy().copy() for p in models[0].parameters()]
    momentum = [np.zeros_like(a) for a in anchor]
    pending = {}
    for s in range(steps):
        t = s + 1
        replay_sgd_step(models, s, LR)
        for f, members in enumerate(FRAGMENTS):
            if t in sends[f]:  # send: the mean pseudo-gradient, as of now
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


# H growing during training, 2 fragments: fragment 0 syncs at 2, 6, 10 (H 4), 13, 16 (H 3 from
# step 7), 21 (H 5 from 16); fragment 1 at 4, 8, 11, 14, 17, 22. Saved at step 12, fragment 1's
# sync (sent at 11) in flight.
GROW = dict(sync_every=4, sync_every_schedule=((7, 3), (16, 5)), fragments=2, sync_delay=2)
GROW_STEPS, GROW_SAVE_AT = 24, 12
# dct_diloco's one-bit compressed all-reduce on 2 fragments landing a step later (sends at 1, 4, 7,
# 10, 13 and 3, 6, 9, 12), saved at step 7 with fragment 0's in flight.
SIGN_STREAMING = dict(sync_every=3, fragments=2, sync_delay=1, value_dtype="sign", transform="none", chunk=4,
                      topk=16, exchange="all_reduce", decay=0.9, outer_lr=0.8, outer_momentum=0.5, nesterov=True)
SIGN_STEPS, SIGN_SAVE_AT = 13, 7


def _run_and_resume(rank, build, steps, save_at):
    """``build``'s optimizer trained ``steps`` steps, a checkpoint taken after ``save_at`` and resumed
    from in a fresh model and optimizer (which first checks that the replicas agree)."""
    model = tiny_model()
    opt = build(model)
    sent = []
    for s in range(steps):
        train_tiny(opt, model, rank, s, s + 1)
        sent.append(opt.ledger.step_bytes()[0])
        if s + 1 == save_at:
            in_flight_at_save = len(opt._in_flight)
            checkpoint = tiny_checkpoint(opt, model)
    params = list(model.parameters())
    return {"final": [p.detach().clone() for p in params], "sent": sent, "in_flight_at_save": in_flight_at_save,
            "anchors": [opt.state[p]["anchor"].clone() for p in params], "outer_steps": opt.outer_steps,
            "resumed": resumed_tiny(build, rank, checkpoint, save_at, steps, after_load=lambda o: o.check_replicas_agree())}


def _cases_worker(rank, world):
    """Every case in one launch of 2 processes (a launch costs more than the runs)."""
    sgd = lambda model: torch.optim.SGD(model.parameters(), lr=LR)
    return {**{case: _worker(rank, world, *case) for case in CASES}, "bf16": _carry_bf16_state(rank, world),
            "growing": _run_and_resume(rank, lambda m: DiLoCo(sgd(m), **GROW, **OUTER), GROW_STEPS, GROW_SAVE_AT),
            "sign": _run_and_resume(rank, lambda m: DCTDiLoCo(sgd(m), **SIGN_STREAMING), SIGN_STEPS, SIGN_SAVE_AT)}


@pytest.fixture(scope="module")
def runs():
    results = run_local_workers(_cases_worker, 2)
    return {case: [r[case] for r in results] for case in [*CASES, "bf16", "growing", "sign"]}


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


@pytest.mark.parametrize("sync_every,schedule,fragments", [
    (4, ((7, 3), (16, 5)), 2), (5, ((3, 1),), 1), (10, ((25, 20), (60, 7)), 3), (6, (), 3),
    (4, ((6, 2),), 2),  # from step 6 on, both fragments' syncs fall on the same steps (each keeps its own H)
])
def test_the_sync_schedule_follows_its_definition(sync_every, schedule, fragments):
    """Where each fragment syncs, the steps to the next sync, a healed replica's jump to just before
    it, and the syncs counted over a budget, against the definition's walk."""
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(3)]
    opt = DiLoCo(torch.optim.SGD(params, lr=0.1), sync_every=sync_every, sync_every_schedule=schedule,
                 fragments=fragments, transport=_SoloTransport())
    steps = 90
    sends = _sends_by_definition(sync_every, schedule, fragments, steps + 40)
    for f in range(fragments):
        assert [t for t in range(1, steps + 1) if opt._sends_at(f, t)] == [t for t in sends[f] if t <= steps]
        assert [opt.settings.syncs_in(n, f) for n in range(steps)] == [sum(t <= n for t in sends[f]) for n in range(steps)]
    every = sorted({t for f in sends for t in sends[f]})
    for t in range(steps):
        ahead = next(u for u in every if u > t) - t
        assert opt.steps_to_next_sync(t) == ahead
        for p in params:
            opt.state[p]["local_step"] = t
        assert opt.skip_to_next_exchange() == ahead - 1  # to the step before the next sync
        assert opt.state[params[0]]["local_step"] == t + ahead - 1


class _SoloTransport:
    """A one-rank transport (no process group) for pure schedule logic."""

    def __init__(self):
        from ds_lowcomm.comm import ByteLedger

        self.rank, self.world_size, self.ledger, self.device = 0, 1, ByteLedger(), torch.device("cpu")

    def all_gather_bytes(self, payload, op="all_gather"):
        return payload[None]


def test_growing_h_syncs_where_its_definition_says_and_resumes_exactly(runs):
    sends = _sends_by_definition(GROW["sync_every"], GROW["sync_every_schedule"], 2, GROW_STEPS)
    assert sends == {0: [2, 6, 10, 13, 16, 21], 1: [4, 8, 11, 14, 17, 22]}
    replay = _replay(2, GROW["sync_delay"], 0.0, sync_every=GROW["sync_every"], schedule=GROW["sync_every_schedule"],
                     steps=GROW_STEPS)
    for r, res in enumerate(runs["growing"]):
        assert [t for t in range(1, GROW_STEPS + 1) if res["sent"][t - 1] > 0] == sorted(sends[0] + sends[1])
        for got, want in zip(res["final"], replay[r]):
            np.testing.assert_allclose(got.double().numpy(), want, atol=2e-6)
        assert res["in_flight_at_save"] == 1
        assert same_bits(res["resumed"], res["final"]), r


def _sign_replay(world, settings, steps):
    """dct_diloco's one-bit compressed all-reduce on fragments in flight, the replicas in one
    process (fp32, as they run): at a fragment's send each replica adds Delta_r (the anchor - its
    parameters) to its decayed buffer, each tensor of which travels as its signs and its scale
    (the mean magnitude): the mean is the replicas' mean scale times the mean of their signs, and
    what a replica's signs stood for (that shared scale times its sign) leaves its buffer. The mean
    lands ``sync_delay`` steps later: the shared anchor takes a Nesterov SGD step along it and every
    replica's fragment takes the anchor."""
    sends = _sends_by_definition(settings["sync_every"], (), len(FRAGMENTS), steps)
    models = [tiny_model() for _ in range(world)]
    params = [list(m.parameters()) for m in models]
    anchor = [p.detach().clone() for p in params[0]]
    momentum = [torch.zeros_like(a) for a in anchor]
    residual = [[torch.zeros_like(a) for a in anchor] for _ in range(world)]
    mu, lr = settings["outer_momentum"], settings["outer_lr"]
    pending = {}
    for s in range(steps):
        t = s + 1
        replay_sgd_step(models, s, LR)
        for f, members in enumerate(FRAGMENTS):
            if t in sends[f]:
                means = {}
                for i in members:
                    for r in range(world):
                        residual[r][i].mul_(settings["decay"]).add_(anchor[i] - params[r][i].detach())
                    shared = sum(residual[r][i].abs().sum() / residual[r][i].numel() for r in range(world)) / world
                    signs = [torch.where(residual[r][i] < 0, -1.0, 1.0) for r in range(world)]
                    means[i] = shared * sum(signs) / world
                    for r in range(world):
                        residual[r][i].sub_(shared * signs[r])
                pending[f] = (t, means)
            if f in pending and pending[f][0] == t - settings["sync_delay"]:
                for i, g in pending.pop(f)[1].items():
                    momentum[i].mul_(mu).add_(g)
                    anchor[i].add_(g.add(momentum[i], alpha=mu), alpha=-lr)
                    for r in range(world):
                        with torch.no_grad():
                            params[r][i].copy_(anchor[i])
    return [[p.detach() for p in ps] for ps in params]


def test_one_bit_all_reduce_on_fragments_in_flight_matches_replay_and_resumes_exactly(runs):
    settings, steps, delay = SIGN_STREAMING, SIGN_STEPS, SIGN_STREAMING["sync_delay"]
    replay = _sign_replay(2, settings, steps)
    sends = _sends_by_definition(settings["sync_every"], (), 2, steps)
    # the compressed all-reduce's second phase goes out at the landing
    sending = {t + d for t in sends[0] + sends[1] for d in (0, delay) if t + d <= steps}
    results = runs["sign"]
    for r, res in enumerate(results):
        for got, want in zip(res["final"], replay[r]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert {t for t in range(1, steps + 1) if res["sent"][t - 1] > 0} == sending
        # an outer step at each landing (the first parameter is fragment 0's)
        assert res["outer_steps"] == len([t for t in sends[0] if t + delay <= steps])
        assert res["in_flight_at_save"] == 1
        assert same_bits(res["resumed"], res["final"]), r
    assert same_bits(results[0]["anchors"], results[1]["anchors"])  # one anchor: every replica's alike
