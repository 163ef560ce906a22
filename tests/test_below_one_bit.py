"""Below one bit a parameter a sync (issue 56): dct_diloco's ``subset_fraction`` (a random subset of
each tensor's elements, the same on every replica, no index on the wire) and ``low_rank`` (each
matrix's buffer as PowerSGD's rank-r factors, averaged by two dense all-reduces). One 3-rank gloo
launch runs both around the one-bit recipe (SIGN_OUTER) with a checkpoint taken mid-interval and
resumed; each is checked against a single-process replay written from the definition, with the
bytes of each sync."""

import copy
import math

import pytest
import torch

from ds_lowcomm.optim.outer import DCTDiLoCo, DCTDiLoCoSettings
from ds_lowcomm.optim.recipes import SIGN_OUTER
from ds_lowcomm.settings import ConfigError
from lowcomm_task.workers import run_local_workers

from .conftest import tiny_loss, tiny_model

WORLD, H, STEPS, SAVE_AT, LR = 3, 2, 8, 3, 0.05
# (low_rank: its biases by the all-gather, which the replay writes; auto would take the two-phase
# all-reduce at 3 replicas, tested in test_compressed_allreduce.py)
CASES = {"subset": {"subset_fraction": 0.25}, "low_rank": {"low_rank": 2, "exchange": "all_gather"}}


def _optimizer(model, case):
    outer = {k: v for k, v in SIGN_OUTER.items() if k != "method"}
    return DCTDiLoCo(torch.optim.SGD(model.parameters(), lr=LR), **{**outer, "sync_every": H, **CASES[case]})


def _train(model, opt, rank, steps, sent=None):
    for s in steps:
        opt.zero_grad()
        tiny_loss(model, rank, s).backward()
        opt.step()
        if sent is not None:
            sent.append(opt.ledger.step_bytes()[0])


def _worker(rank, world):
    out = {}
    for case in CASES:
        model = tiny_model()
        opt = _optimizer(model, case)
        sent = []
        _train(model, opt, rank, range(SAVE_AT), sent)
        saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        _train(model, opt, rank, range(SAVE_AT, STEPS), sent)
        resumed_model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        resumed = _optimizer(resumed_model, case)
        resumed_model.load_state_dict(saved[0])
        resumed.load_state_dict(saved[1])
        _train(resumed_model, resumed, rank, range(SAVE_AT, STEPS))
        out[case] = {"anchors": [a.clone() for a in opt.synced_values()],
                     "params": [p.detach().clone() for p in model.parameters()],
                     "resumed": [p.detach().clone() for p in resumed_model.parameters()],
                     "sent": sent, "by_op": opt.ledger.summary()["by_op"], "exchange": opt.exchange}
    return out


@pytest.fixture(scope="module")
def results():
    return run_local_workers(_worker, WORLD)


# -- the replay, from the definition -----------------------------------------------------------
def _sign(v: torch.Tensor) -> torch.Tensor:
    """One sign bit each (0 counts as +) times the mean magnitude."""
    scale = v.abs().mean()
    return torch.where(v < 0, -scale, scale)


def _subset(numel: int, fraction: float, sync: int, position: int) -> torch.Tensor:
    """ceil(f n) distinct positions from a permutation drawn with the seed sync * 1000003 + position."""
    g = torch.Generator().manual_seed(sync * 1_000_003 + position)
    return torch.randperm(numel, generator=g)[: math.ceil(fraction * numel)].sort().values


def _replay(case):
    models = [tiny_model() for _ in range(WORLD)]
    anchors = [p.detach().clone() for p in models[0].parameters()]
    errors = [[torch.zeros_like(a) for a in anchors] for _ in range(WORLD)]
    qs = {}
    for s in range(STEPS):
        for rank, m in enumerate(models):
            m.zero_grad()
            tiny_loss(m, rank, s).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= LR * p.grad
        if (s + 1) % H:
            continue
        sync = (s + 1) // H - 1
        for i, a in enumerate(anchors):
            for r, m in enumerate(models):
                errors[r][i].mul_(SIGN_OUTER["decay"]).add_(a - list(m.parameters())[i].detach())
            if case == "low_rank" and a.dim() == 2:
                rank = min(CASES[case]["low_rank"], *a.shape)
                if i not in qs:
                    qs[i] = torch.randn(a.shape[1], rank, generator=torch.Generator().manual_seed(i))
                p_mean = sum(e[i] @ qs[i] for e in errors) / WORLD
                basis = torch.linalg.qr(p_mean).Q
                local_q = [e[i].T @ basis for e in errors]
                for e, q in zip(errors, local_q):
                    e[i] -= basis @ q.T
                qs[i] = sum(local_q) / WORLD
                update = basis @ qs[i].T
            else:
                pick = (_subset(a.numel(), CASES[case]["subset_fraction"], sync, i) if case == "subset"
                        else torch.arange(a.numel()))
                update = torch.zeros(a.numel())
                for e in errors:
                    sent = _sign(e[i].reshape(-1)[pick])
                    e[i].view(-1)[pick] -= sent
                    update[pick] += sent / WORLD
                update = update.view(a.shape)
            a -= SIGN_OUTER["outer_lr"] * update  # no outer momentum
        for m in models:
            with torch.no_grad():
                for p, a in zip(m.parameters(), anchors):
                    p.copy_(a)
    return anchors


@pytest.mark.parametrize("case", list(CASES))
def test_matches_its_replay_stays_identical_and_resumes_exactly(results, case):
    replay = _replay(case)
    initial = list(tiny_model().parameters())
    assert max((w - i).abs().max() for w, i in zip(replay, initial)) > 1e-3  # it really moved
    for rank in range(WORLD):
        got = results[rank][case]
        for a, w in zip(got["anchors"], replay):
            torch.testing.assert_close(a, w, rtol=0, atol=2e-6)
        for a, b in zip(got["anchors"], results[0][case]["anchors"]):
            assert torch.equal(a, b)  # replicas identical after every sync
        for a, b in zip(got["resumed"], got["params"]):
            assert torch.equal(a, b)  # the resumed run is the uninterrupted one, bit for bit


def test_bytes_of_each_sync_are_below_one_bit_a_parameter(results):
    shapes = [tuple(p.shape) for p in tiny_model().parameters()]  # (32, 16), (32,), (4, 32), (4,)
    numel = sum(math.prod(s) for s in shapes)
    # subset: each tensor's ceil(n / 4) values as sign bits after a 4-byte scale, one health byte;
    # an all-gather (auto keeps it: the subset moves every sync) books the payload once sent
    k = [math.ceil(math.prod(s) * 0.25) for s in shapes]
    payload = sum(4 + (c + 7) // 8 for c in k) + 1
    subset = results[0]["subset"]
    assert subset["exchange"] == "all_gather"
    assert [b for b in subset["sent"] if b] == [payload] * (STEPS // H)
    assert sum(k) == 169 and numel == 676  # a quarter: 0.25 value bits a parameter
    # low rank 2: P (rows x 2) and Q (cols x 2) of each matrix in fp32 through dense all-reduces
    # (the ledger books an all-reduce's buffer once each way), a health byte each, the biases as one
    # sign payload (two 4-byte scales, 32 and 4 bits, a health byte)
    ops = results[0]["low_rank"]["by_op"]
    syncs, p_floats, q_floats = STEPS // H, 32 * 2 + 4 * 2, 16 * 2 + 32 * 2
    assert ops["outer_low_rank_p"] == {"calls": syncs, "sent": syncs * 4 * p_floats, "received": syncs * 4 * p_floats}
    assert ops["outer_low_rank_q"] == {"calls": syncs, "sent": syncs * 4 * q_floats, "received": syncs * 4 * q_floats}
    assert ops["outer_low_rank_p_health"]["sent"] == ops["outer_low_rank_q_health"]["sent"] == syncs
    assert ops["outer_sparse_all_gather"]["sent"] == syncs * (4 + 4 + 4 + 1 + 1)


def test_settings_refused_by_name():
    with pytest.raises(ConfigError, match=r"lowcomm.subset_fraction must be a number in \(0, 1\]"):
        DCTDiLoCoSettings.from_flat({"subset_fraction": 0})
    with pytest.raises(ConfigError, match=r"lowcomm.low_rank must be an integer >= 0"):
        DCTDiLoCoSettings.from_flat({"low_rank": -1})
    with pytest.raises(ConfigError, match=r"subset_fraction and lowcomm.low_rank are two ways"):
        DCTDiLoCoSettings.from_flat({"subset_fraction": 0.5, "low_rank": 1})
    with pytest.raises(ConfigError, match=r"exchange all_reduce does not take subset_fraction < 1"):
        DCTDiLoCoSettings.from_flat({"subset_fraction": 0.5, "exchange": "all_reduce", "topk": 64, "chunk": 8,
                                     "transform": "none", "value_dtype": "sign"})
    from ds_lowcomm.deepspeed.config import split_config

    def deepspeed(stage, **extra):
        return split_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                             "zero_optimization": {"stage": stage}, **extra,
                             "lowcomm": {"method": "dct_diloco", "low_rank": 2}})

    deepspeed(0)  # whole matrices
    with pytest.raises(ConfigError, match=r"lowcomm.low_rank needs zero_optimization.stage 0 in fp32 .*got stage 2"):
        deepspeed(2)
    with pytest.raises(ConfigError, match=r"got stage 0, bf16.enabled true"):
        deepspeed(0, bf16={"enabled": True})
