"""The outer step is a torch optimizer over the anchors (``outer_optimizer``), in 2 real gloo
processes, one launch for every check: the default SGD gives bit for bit DiLoCo's outer step as
ds_lowcomm wrote it by hand before (written out below from the paper); Adam matches a
single-process replay with torch.optim.Adam on the averaged pseudo-gradients; the outer
optimizer's state resumes exactly, and a checkpoint of the earlier format loads."""

import functools

import pytest
import torch
import torch.distributed as dist

from ds_lowcomm.optim import DiLoCo, LowcommConfig, SparseLoCo, build_optimizer
from ds_lowcomm.settings import ConfigError
from lowcomm_task.workers import run_local_workers

from .conftest import replay_sgd_step, resumed_tiny, same_bits, tiny_checkpoint, tiny_loss, tiny_model, train_tiny

LR, WORLD = 0.1, 2  # the inner SGD's lr
FRAGMENTS = [[0], [1, 2, 3]]  # tiny_model() in 2 fragments: 512-element weight | its bias, 128-element weight, bias

# The default (SGD) against the hand-written step: H 4, 13 steps (syncs at 4, 8, 12; with two
# fragments at 2, 6, 10 and 4, 8, 12).
SGD_H, SGD_STEPS, SGD_SAVE_AT = 4, 13, 6
SGD_CASES = {
    "nesterov": dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True),
    "momentum, 2 fragments": dict(outer_lr=0.7, outer_momentum=0.9, nesterov=False, fragments=2),
    "no momentum": dict(outer_lr=1.0, outer_momentum=0.0, nesterov=False),
}
OLD_STATE_KEYS = {"anchor", "outer_momentum", "local_step", "outer_steps"}  # a parameter's state before

# Adam, streamed: 2 fragments, each sync landing a step after it is sent; saved at step 6 with
# fragment 0's sync in flight.
ADAM = {"method": "diloco", "sync_every": 4, "fragments": 2, "sync_delay": 1, "outer_optimizer": "adam",
        "outer_lr": 0.01, "outer_betas": [0.8, 0.99], "outer_eps": 1e-3}
ADAM_STEPS, ADAM_SAVE_AT = 11, 6


def _diloco_by_definition(rank, world, outer_lr, outer_momentum, nesterov, fragments=1):
    """DiLoCo written out, with its outer step as ds_lowcomm computed it by hand before it was a
    torch optimizer: at a fragment's sync, the mean over replicas of Delta = anchor - theta; then
    buf = mu * buf + Delta and anchor -= lr * (Delta + mu * buf) (Nesterov), lr * buf (momentum)
    or lr * Delta (none); every replica restarts from the anchor."""
    model = tiny_model()
    params = list(model.parameters())
    inner = torch.optim.SGD(params, lr=LR)
    anchors = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(a) for a in anchors]
    members = FRAGMENTS if fragments == 2 else [list(range(len(params)))]
    for s in range(SGD_STEPS):
        tiny_loss(model, rank, s).backward()
        inner.step()
        inner.zero_grad()
        t = s + 1
        for f, indices in enumerate(members):
            offset = (f + 1) * SGD_H // len(members)
            if t < offset or (t - offset) % SGD_H:
                continue
            for i in indices:
                gathered = [torch.empty_like(anchors[i]) for _ in range(world)]
                dist.all_gather(gathered, anchors[i] - params[i].detach())
                g = functools.reduce(torch.add, gathered) / world
                if outer_momentum > 0:
                    bufs[i].mul_(outer_momentum).add_(g)
                    g = g.add(bufs[i], alpha=outer_momentum) if nesterov else bufs[i]
                anchors[i].sub_(g, alpha=outer_lr)
                with torch.no_grad():
                    params[i].copy_(anchors[i])
    return {"params": [p.detach().clone() for p in params], "anchors": anchors, "bufs": bufs}


def _sgd_case(rank, world, settings):
    build = lambda model: DiLoCo(torch.optim.SGD(model.parameters(), lr=LR), sync_every=SGD_H, **settings)
    model = tiny_model()
    opt = build(model)
    train_tiny(opt, model, rank, 0, SGD_SAVE_AT)
    checkpoint = tiny_checkpoint(opt, model)
    train_tiny(opt, model, rank, SGD_SAVE_AT, SGD_STEPS)
    params = list(model.parameters())
    outer = opt.anchor_optimizer
    position = {id(p): i for i, p in enumerate(params)}

    def earlier_format(sd):  # what a checkpoint saved before outer_optimizer (and the landings, the schedule) were settings holds
        settings = sd["lowcomm"]["settings"]
        for key in ("outer_optimizer", "outer_betas", "outer_eps", "outer_weight_decay", "carry_local_steps",
                    "sync_every_schedule"):
            del settings[key]
        return sd

    def with_eager(on):  # what a checkpoint saved while eager was a setting (since removed) holds
        def edit(sd):
            sd["lowcomm"]["settings"]["eager"] = on
            return sd
        return edit

    try:
        resumed_tiny(build, rank, checkpoint, SGD_SAVE_AT, SGD_SAVE_AT, with_eager(True))
        eager_refused = None
    except ValueError as err:
        eager_refused = str(err)

    return {
        "params": [p.detach().clone() for p in params],
        "anchors": [opt.state[p]["anchor"].clone() for p in params],
        "bufs": [opt.state[p].get("outer_momentum") for p in params],
        "state_keys": [sorted(opt.state[p]) for p in params],
        "outer": (type(outer).__name__, outer.defaults["momentum"], outer.defaults["nesterov"],
                  outer.defaults["lr"], len(outer.param_groups)),
        "fragments": [[position[id(p)] for p in f] for f in opt.fragments_of(params)],
        "resumed": resumed_tiny(build, rank, checkpoint, SGD_SAVE_AT, SGD_STEPS),
        "resumed_earlier_format": resumed_tiny(build, rank, checkpoint, SGD_SAVE_AT, SGD_STEPS, earlier_format),
        "resumed_eager_off": resumed_tiny(build, rank, checkpoint, SGD_SAVE_AT, SGD_STEPS, with_eager(False)),
        "eager_refused": eager_refused,
        "reference": _diloco_by_definition(rank, world, **settings),
    }


def _adam_case(rank):
    cfg = LowcommConfig.from_dict(ADAM)
    build = lambda model: build_optimizer(cfg, model.parameters(), lr=LR,
                                          inner_factory=lambda ps: torch.optim.SGD(ps, lr=LR))
    model = tiny_model()
    opt = build(model)
    train_tiny(opt, model, rank, 0, ADAM_SAVE_AT)
    in_flight_at_save = len(opt._in_flight)
    checkpoint = tiny_checkpoint(opt, model)
    train_tiny(opt, model, rank, ADAM_SAVE_AT, ADAM_STEPS)
    outer = opt.anchor_optimizer
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "outer": (type(outer).__name__, outer.defaults["betas"], outer.defaults["eps"], len(outer.param_groups)),
        "state_keys": sorted(opt.state_dict()["state"][0]),
        "in_flight_at_save": in_flight_at_save,
        "resumed": resumed_tiny(build, rank, checkpoint, ADAM_SAVE_AT, ADAM_STEPS),
    }


def _sparseloco_case(rank):
    model = tiny_model()
    opt = SparseLoCo(torch.optim.SGD(model.parameters(), lr=LR), sync_every=2, topk=4, chunk=4)
    train_tiny(opt, model, rank, 0, 2)
    outer = opt.anchor_optimizer
    return {"outer": (type(outer).__name__, outer.defaults["momentum"]),
            "state_keys": sorted(opt.state[next(model.parameters())])}


def _worker(rank, world):
    return {"sgd": {name: _sgd_case(rank, world, settings) for name, settings in SGD_CASES.items()},
            "adam": _adam_case(rank), "sparseloco": _sparseloco_case(rank)}


@pytest.fixture(scope="module")
def runs():
    return run_local_workers(_worker, WORLD)


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_default_sgd_is_bit_for_bit_the_hand_written_outer_step(case, runs):
    settings = SGD_CASES[case]
    for rank, result in enumerate(r["sgd"][case] for r in runs):
        reference = result["reference"]
        assert same_bits(result["params"], reference["params"]), (case, rank)
        assert same_bits(result["anchors"], reference["anchors"]), (case, rank)
        if settings["outer_momentum"]:  # torch's momentum buffer is the one the checkpoints always held
            assert same_bits(result["bufs"], reference["bufs"]), (case, rank)
        # one param group per fragment, each added at its fragment's first sync
        fragments = settings.get("fragments", 1)
        assert result["outer"] == ("SGD", settings["outer_momentum"], settings["nesterov"], settings["outer_lr"],
                                   fragments)
        assert result["fragments"] == (FRAGMENTS if fragments == 2 else [[0, 1, 2, 3]])
        # the per-parameter state holds what it held before (checkpoints keep their format)
        want = OLD_STATE_KEYS if settings["outer_momentum"] else OLD_STATE_KEYS - {"outer_momentum"}
        assert all(set(keys) == want for keys in result["state_keys"]), result["state_keys"]
        # saved mid-interval, loaded into a fresh optimizer: the same bits as the run never stopped,
        # also from a checkpoint whose settings predate outer_optimizer
        assert same_bits(result["resumed"], result["params"]), (case, rank)
        assert same_bits(result["resumed_earlier_format"], result["params"]), (case, rank)
        # and from one saved while eager was a setting: off, it resumes; on, it is refused by name
        assert same_bits(result["resumed_eager_off"], result["params"]), (case, rank)
        assert "saved with lowcomm.eager, a setting this release removed" in result["eager_refused"], (case, rank)


def _adam_replay():
    """The 2 replicas in one process: inner SGD steps, and at each fragment's sync (landing a step
    later) torch.optim.Adam (one per fragment) steps the anchors along the mean pseudo-gradient."""
    models = [tiny_model() for _ in range(WORLD)]
    anchors = [p.detach().clone() for p in models[0].parameters()]
    adams = [torch.optim.Adam([anchors[i] for i in members], lr=ADAM["outer_lr"], betas=tuple(ADAM["outer_betas"]),
                              eps=ADAM["outer_eps"]) for members in FRAGMENTS]
    pending = {}
    for s in range(ADAM_STEPS):
        t = s + 1
        replay_sgd_step(models, s, LR)
        for f, members in enumerate(FRAGMENTS):
            offset = (f + 1) * ADAM["sync_every"] // len(FRAGMENTS)
            if t >= offset and (t - offset) % ADAM["sync_every"] == 0:
                pending[f] = (t, [sum(anchors[i] - list(m.parameters())[i].detach() for m in models) / WORLD
                                  for i in members])
            if f in pending and pending[f][0] == t - ADAM["sync_delay"]:
                for i, mean in zip(members, pending.pop(f)[1]):
                    anchors[i].grad = mean
                adams[f].step()
                with torch.no_grad():
                    for i in members:
                        anchors[i].grad = None
                        for m in models:
                            list(m.parameters())[i].copy_(anchors[i])
    return [[p.detach() for p in m.parameters()] for m in models]


def test_adam_outer_optimizer_matches_a_replay_and_resumes_exactly(runs):
    replay = _adam_replay()
    for rank, result in enumerate(r["adam"] for r in runs):
        assert result["outer"] == ("Adam", (0.8, 0.99), 1e-3, 2)
        for got, want in zip(result["params"], replay[rank]):
            torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
        # Adam's moments and step count are in the method's per-parameter state
        assert {"outer_opt_exp_avg", "outer_opt_exp_avg_sq", "outer_opt_step"} <= set(result["state_keys"])
        assert "outer_momentum" not in result["state_keys"]
        assert result["in_flight_at_save"] == 1
        assert same_bits(result["resumed"], result["params"]), rank


def test_sparseloco_steps_its_anchors_with_sgd_without_momentum(runs):
    for result in (r["sparseloco"] for r in runs):
        assert result["outer"] == ("SGD", 0.0)
        assert set(result["state_keys"]) == OLD_STATE_KEYS - {"outer_momentum"} | {"residual"}


@pytest.mark.parametrize("raw,message", [
    ({"method": "diloco", "outer_optimizer": "lion"}, r"lowcomm.outer_optimizer must be one of sgd, adam, adamw; got 'lion'"),
    ({"method": "sparseloco", "outer_betas": [0.9]}, r"lowcomm.outer_betas must be a list of two numbers in \[0, 1\)"),
    ({"method": "diloco", "outer_betas": [0.9, 1.0]}, r"lowcomm.outer_betas\[\] must be a number in \[0.0, 1.0\)"),
    ({"method": "dct_diloco", "outer_eps": 0}, r"lowcomm.outer_eps must be a number > 0; got 0"),
    ({"method": "diloco", "outer_weight_decay": -0.1}, r"lowcomm.outer_weight_decay must be a number >= 0; got -0.1"),
])
def test_bad_outer_optimizer_settings_name_the_field(raw, message):
    with pytest.raises(ConfigError, match=message):
        LowcommConfig.from_dict(raw)


def test_outer_optimizer_settings_read_from_the_flat_section():
    cfg = LowcommConfig.from_dict({"method": "sparseloco", "outer_optimizer": "adamw", "outer_betas": [0.8, 0.9],
                                   "outer_weight_decay": 0.1})
    assert (cfg.outer_optimizer, cfg.outer_betas, cfg.outer_eps, cfg.outer_weight_decay) == ("adamw", (0.8, 0.9), 1e-8, 0.1)
    assert LowcommConfig.from_dict({"method": "diloco"}).outer_optimizer == "sgd"
