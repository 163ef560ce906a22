"""The methods in 2 and 4 real gloo processes: against single-process replays, plain
all-reduce references, and each other."""


import numpy as np
import pytest
import torch
import torch.distributed as dist

from ds_lowcomm.codec import ChunkPlan, topk_count
from ds_lowcomm.codec.dct import from_blocks, to_blocks
from ds_lowcomm.comm import TorchDistTransport
from lowcomm_task.workers import run_local_workers
from ds_lowcomm.config import ConfigError
from ds_lowcomm.optim import DCTDiLoCo, DeMo, DiLoCo
from ds_lowcomm.optim.demo import muon_param_groups, orthogonalize

from .conftest import dct_by_definition, params_digest, tiny_batch, tiny_loss, tiny_model


# --- one launch per world size for the successful runs below (a launch costs more than a run) ---

def _jobs_worker(rank, world, jobs):
    """Run each ``(name, fn, args)`` of ``jobs`` in turn on this rank; every rank runs them in the same order."""
    return {name: fn(rank, world, *args) for name, fn, args in jobs}


def _jobs(world):
    jobs = [("demo", _demo_worker, (5,)), ("diloco_h1", _diloco_averaging_worker, ()), ("dion", _dion_worker, (5,))]
    if world == 2:
        jobs += [("muloco", _muloco_worker, ()), ("sync_diloco", _sync_schedule_worker, ("diloco",)),
                 ("sync_dct_diloco", _sync_schedule_worker, ("dct_diloco",)),
                 ("dct_lossless", _dct_lossless_worker, ()), ("dct_sign", _dct_sign_worker, ()),
                 ("bf16_state", _bf16_state_worker, ()),
                 ("demo_sign", _demo_sign_worker, ()), ("demo_overlap", _demo_worker, (5, True)),
                 ("demo_adam", _demo_worker, (5, False, "adam")), ("demo_normalized", _demo_worker, (5, False, "normalized")),
                 ("demo_muon", _demo_worker, (5, False, "muon")),
                 ("demo_outer", _demo_worker, (5, False, "sign", 0.8)),
                 ("clipping", _clipping_worker, ()),
                 ("demo_keep", _demo_worker, (5, False, "muon", 0.0, 0.9)),
                 ("zero_first", _zero_first_gradients_worker, ()),  # these two build groups of their own
                 ("nonfinite", _nonfinite_worker, ())]
    return jobs


@pytest.fixture(scope="module")
def launches():
    """world size -> job name -> the per-rank results, each world size launched once, when first asked for."""
    done = {}

    def get(world, name):
        if world not in done:
            results = run_local_workers(_jobs_worker, world, _jobs(world))
            done[world] = {job: [r[job] for r in results] for job, _, _ in _jobs(world)}
        return done[world][name]

    return get


# --- DeMo against a replay written from the algorithm's definition -------------------------

DEMO = dict(lr=0.01, decay=0.9, topk=8, chunk=8, weight_decay=0.1)


def _demo_worker(rank, world, steps, overlap=False, update="sign", mean_momentum=0.0, keep_sent=0.0):
    model = tiny_model()
    initial = [p.detach().clone() for p in model.parameters()]
    params = model.parameters()
    if update == "muon":  # the last layer in a group of its own rule, sign (MUON_RULES)
        params = [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters()), "update": "sign"}]
    opt = DeMo(params, **DEMO, overlap=overlap, update=update, beta2=0.9, mean_momentum=mean_momentum,
               keep_sent=keep_sent)
    grads = []
    for s in range(steps):
        tiny_loss(model, rank, s).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return {"initial": initial, "grads": grads, "final": [p.detach().clone() for p in model.parameters()],
            "digest": params_digest(model), "by_op": opt.ledger.summary()["by_op"], "steps": opt.ledger.steps,
            "payload": opt._sync_for(list(model.parameters()), "sparse_all_gather").payload_bytes}


def _demo_sign_worker(rank, world):
    """DeMo with 1-bit sign values: error feedback removes exactly what the receivers decode."""
    from ds_lowcomm.codec import SparseSpec

    model = tiny_model()
    opt = DeMo(model.parameters(), **{**DEMO, "value_dtype": "sign"})
    sync = None
    fed_back = []
    for s in range(4):
        tiny_loss(model, rank, s).backward()
        before = {p: opt.state[p]["momentum"].clone() * DEMO["decay"] + DEMO["lr"] * p.grad
                  if "momentum" in opt.state[p] else DEMO["lr"] * p.grad for p in model.parameters()}
        opt.step()
        opt.zero_grad()
        for p in model.parameters():  # what left the momentum = what a receiver decodes from its payload
            spec = SparseSpec.build(p.shape, chunk=DEMO["chunk"], topk=DEMO["topk"], value_dtype="sign")
            payload, sent = spec.compress(before[p])
            fed_back.append(bool(torch.equal(spec.decompress_mean(payload[None]), sent))
                            and torch.allclose(before[p] - sent, opt.state[p]["momentum"], atol=1e-7))
        sync = opt._sync_for(list(model.parameters()), "sparse_all_gather")
    specs = [SparseSpec.build(p.shape, chunk=DEMO["chunk"], topk=DEMO["topk"], value_dtype="sign")
             for p in model.parameters()]
    expected = sum(spec.index_bytes + 4 + (spec.count + 7) // 8 for spec in specs) + 1  # + the health flag byte
    return {"digest": params_digest(model), "fed_back": fed_back, "payload": sync.payload_bytes,
            "expected_payload": expected}


def test_demo_with_sign_values(launches):
    results = launches(2, "demo_sign")
    assert len({r["digest"] for r in results}) == 1  # bit-identical replicas
    for r in results:
        assert all(r["fed_back"])
        assert r["payload"] == r["expected_payload"]


def _block_dct(x, plan, inverse=False):
    ch, cw = dct_by_definition(plan.h), dct_by_definition(plan.w)
    blocks = to_blocks(torch.as_tensor(x), plan).numpy()
    out = ch.T @ blocks @ cw if inverse else ch @ blocks @ cw.T
    return from_blocks(torch.as_tensor(out), plan).numpy()


def _orthogonalized(q):
    """Muon's direction from its spectral definition, not by running the iteration: q as a
    (rows, rest) matrix = U S V^T (an SVD), its singular values over its Frobenius norm each taken 5
    times through Newton-Schulz's quintic p(s) = a s + b s^3 + c s^5 (Jordan et al.'s coefficients,
    torch.optim.Muon's), U p(...p(S)) V^T, times sqrt(max(rows, cols)). The matrix iteration
    X <- aX + (b XX^T + c (XX^T)^2) X maps each singular value by p and keeps U and V."""
    x = q.reshape(q.shape[0], -1)
    u, sv, vt = np.linalg.svd(x, full_matrices=False)
    sv = sv / np.sqrt((sv * sv).sum())
    for _ in range(5):
        sv = 3.4445 * sv - 4.7750 * sv**3 + 2.0315 * sv**5
    return ((u * sv) @ vt * np.sqrt(max(x.shape))).reshape(q.shape)


# The demo_muon job's rule per parameter (tiny_model's weight, bias, weight, bias): the first
# layer by the settings' muon (its bias: sign, being 1-D), the last layer's group by sign.
MUON_RULES = ["muon", "muon", "sign", "sign"]


def _replay_demo(initial, grads_by_rank, delayed=False, update="sign", mean_momentum=0.0, keep_sent=0.0):
    """DeMo from its definition; ``delayed``: each step moves along the previous step's exchange;
    ``update``: the step along the exchanged mean q, sign(q) (DeMo's), Adam's q / sqrt(v) with v
    the bias-corrected running mean of q^2 (beta2 0.9), q / rms(q), or Muon's (the parameters
    MUON_RULES names, the others sign); ``mean_momentum`` b: q is
    first replaced by q + b * u, u the running sum u = b * u + q; ``keep_sent`` k: a rank's momentum
    loses (1 - k) x what it sent (Dion's error feedback), not all of it."""
    world, steps = len(grads_by_rank), len(grads_by_rank[0])
    params = [p.double().numpy().copy() for p in initial]
    moms = [[np.zeros_like(p) for p in params] for _ in range(world)]
    second = [np.zeros_like(p) for p in params]
    outer = [np.zeros_like(p) for p in params]
    lr, beta, wd = DEMO["lr"], DEMO["decay"], DEMO["weight_decay"]
    landed = [None] * len(params)
    for s in range(steps):
        for i, p in enumerate(params):
            plan = ChunkPlan.for_shape(p.shape, DEMO["chunk"])
            k = topk_count(plan, DEMO["topk"], DEMO["chunk"])
            total = np.zeros(p.shape)
            count = np.zeros(p.shape)
            for r in range(world):
                m = moms[r][i]
                m *= beta
                m += lr * grads_by_rank[r][s][i].double().numpy()
                coeffs = to_blocks(torch.as_tensor(_block_dct(m, plan)), plan).reshape(plan.num_blocks, -1).numpy()
                kept = np.zeros_like(coeffs)
                for b in range(plan.num_blocks):
                    top = np.argsort(-np.abs(coeffs[b]))[:k]
                    kept[b, top] = coeffs[b, top]
                kept_t = from_blocks(torch.as_tensor(kept).reshape(plan.num_blocks, plan.h, plan.w), plan).numpy()
                m -= (1 - keep_sent) * _block_dct(kept_t, plan, inverse=True)
                total += kept_t
                count += kept_t != 0
            q = _block_dct(total / np.maximum(count, 1), plan, inverse=True)
            outer[i] = mean_momentum * outer[i] + q
            q = q + mean_momentum * outer[i]
            if update == "adam":
                second[i] = 0.9 * second[i] + 0.1 * q * q
                direction = q / (np.sqrt(second[i] / (1 - 0.9 ** (s + 1))) + 1e-12)
            elif update == "normalized":
                direction = q / np.sqrt(np.mean(q * q))
            elif update == "muon" and MUON_RULES[i] == "muon" and q.ndim >= 2:
                direction = _orthogonalized(q)
            else:
                direction = np.sign(q)
            if delayed:
                direction, landed[i] = landed[i], direction
            if direction is not None:
                p *= 1 - lr * wd
                p -= lr * direction
    return params


def _assert_replicas_equal_and_match(results, replay):
    """Every rank's parameters bit-identical (one digest), and rank 0's equal to the replay's."""
    assert len({r["digest"] for r in results}) == 1
    for got, want in zip(results[0]["final"], replay):
        np.testing.assert_allclose(got.double().numpy(), want, atol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_demo_matches_single_process_replay_and_replicas_agree(world, launches):
    results = launches(world, "demo")
    replay = _replay_demo(results[0]["initial"], [r["grads"] for r in results])
    _assert_replicas_equal_and_match(results, replay)
    moved = max(np.abs(w - i.double().numpy()).max() for w, i in zip(replay, results[0]["initial"]))
    assert moved > 0.04  # five steps of 0.01 really moved the parameters
    for r in results:
        # One collective per step (not one per parameter), each exactly one packed payload.
        assert r["steps"] == 5
        assert r["by_op"]["sparse_all_gather"] == {
            "calls": 5, "sent": 5 * r["payload"], "received": 5 * (world - 1) * r["payload"]}


@pytest.mark.parametrize("job,update,mean_momentum,keep_sent", [("demo_adam", "adam", 0.0, 0.0),
                                                                  ("demo_normalized", "normalized", 0.0, 0.0),
                                                                  ("demo_muon", "muon", 0.0, 0.0),
                                                                  ("demo_outer", "sign", 0.8, 0.0),
                                                                  ("demo_keep", "muon", 0.0, 0.9)])
def test_demo_update_rules_match_the_replay(job, update, mean_momentum, keep_sent, launches):
    """The other steps along the exchanged mean: the replay's, replicas bit-identical, and not sign's."""
    results = launches(2, job)
    replay = _replay_demo(results[0]["initial"], [r["grads"] for r in results], update=update,
                          mean_momentum=mean_momentum, keep_sent=keep_sent)
    _assert_replicas_equal_and_match(results, replay)
    signs = _replay_demo(results[0]["initial"], [r["grads"] for r in results])
    assert max(np.abs(g.double().numpy() - u).max() for g, u in zip(results[0]["final"], signs)) > 1e-3


def test_muon_direction_is_near_the_polar_factor():
    """update "muon": q's orthogonal polar factor U V^T (from an SVD), scaled to RMS 1; the 5
    Newton-Schulz steps leave every singular value within [0.6, 1.25] of it (Muon's design); equal
    to the spectral definition (an SVD, each singular value through the quintic) to fp32's
    rounding; and to torch.optim.Muon's own step (one step, no momentum or weight decay: -lr x
    sqrt(max(1, rows/cols)) x its Newton-Schulz, run in bf16) to bf16's."""
    g = torch.Generator().manual_seed(3)
    for shape in [(24, 40), (40, 24), (8, 3, 5), (128, 32)]:
        q = torch.randn(*shape, generator=g, dtype=torch.float64)
        got = orthogonalize(q).double().reshape(shape[0], -1)
        u, _, vt = torch.linalg.svd(q.reshape(shape[0], -1), full_matrices=False)
        polar = (u @ vt) * max(got.shape) ** 0.5
        cosine = (got * polar).sum() / (got.norm() * polar.norm())
        assert cosine > 0.97, (shape, cosine)
        sv = torch.linalg.svdvals(got / max(got.shape) ** 0.5)
        assert 0.6 < sv.min() and sv.max() < 1.25, (shape, sv)
        np.testing.assert_allclose(orthogonalize(q.float()).numpy(), _orthogonalized(q.numpy()), atol=2e-5)
        if len(shape) == 2:
            rows, cols = shape
            p = torch.nn.Parameter(torch.zeros(shape))
            muon = torch.optim.Muon([p], lr=1.0, weight_decay=0.0, momentum=0.0, nesterov=False)
            p.grad = q.float().clone()
            muon.step()
            theirs = -p.detach().double() / max(1.0, rows / cols) ** 0.5
            ours = got / max(rows, cols) ** 0.5
            assert (ours - theirs).norm() / theirs.norm() < 0.03, shape  # bf16's 8 bits through 5 steps


def test_muon_param_groups_step_embeddings_by_sign():
    model = torch.nn.ModuleDict({"tok": torch.nn.Embedding(10, 6), "proj": torch.nn.Linear(6, 6)})
    model["head"] = torch.nn.Linear(6, 10, bias=False)
    model["head"].weight = model["tok"].weight  # tied: once, with the embeddings
    groups = muon_param_groups(model)
    assert [[id(p) for p in g["params"]] for g in groups] == [
        [id(model["proj"].weight), id(model["proj"].bias)], [id(model["tok"].weight)]]
    assert "update" not in groups[0] and groups[1]["update"] == "sign"
    with pytest.raises(ConfigError, match="update must be one of sign, adam, normalized, muon; got 'bogus'"):
        DeMo([{"params": list(model["proj"].parameters()), "update": "bogus"}], lr=0.01)


def test_demo_overlap_steps_along_the_previous_exchange(launches):
    """overlap: step t moves along the exchange started at step t - 1 (the replay's delayed
    form); replicas agree bit for bit; every step still sends one payload."""
    results = launches(2, "demo_overlap")
    replay = _replay_demo(results[0]["initial"], [r["grads"] for r in results], delayed=True)
    _assert_replicas_equal_and_match(results, replay)
    undelayed = _replay_demo(results[0]["initial"], [r["grads"] for r in results])
    assert max(np.abs(g.double().numpy() - u).max() for g, u in zip(results[0]["final"], undelayed)) > 1e-3
    for r in results:
        assert r["by_op"]["sparse_all_gather"]["calls"] == 5


# --- DiLoCo --------------------------------------------------------------------------------

def _diloco_averaging_worker(rank, world):
    """DiLoCo with H=1, outer lr 1, no momentum == average the parameters after every inner step."""
    model, ref = tiny_model(), tiny_model()
    opt = DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=1, outer_lr=1.0, outer_momentum=0.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    worst = 0.0
    for s in range(4):
        for m, o in ((model, opt), (ref, ref_opt)):
            tiny_loss(m, rank, s).backward()
            o.step()
            o.zero_grad()
        with torch.no_grad():
            for p in ref.parameters():
                dist.all_reduce(p)
                p /= world
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())))
    return worst, params_digest(model)


@pytest.mark.parametrize("world", [2, 4])
def test_diloco_h1_is_parameter_averaging(world, launches):
    results = launches(world, "diloco_h1")
    assert all(worst < 1e-6 for worst, _ in results)
    assert len({d for _, d in results}) == 1


CLIP = 0.05


def _clipping_worker(rank, world):
    """clip_grad: adamw clips the mean gradient (DDP's all-reduce, then torch's clip), the outer
    methods each replica's own before the inner step; equal bits with those references."""
    from ds_lowcomm.optim import AllReduceAdamW

    out = {}
    model, ref = tiny_model(), tiny_model()
    opt = AllReduceAdamW(model.parameters(), lr=1e-2, clip_grad=CLIP)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)  # (ds_lowcomm's default decay)
    for s in range(3):
        for m in (model, ref):
            tiny_loss(m, rank, s).backward()
        opt.step()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out["adamw"] = (all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())), float(norm))
    model, ref = tiny_model(), tiny_model()
    opt = DiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=10, clip_grad=CLIP)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for s in range(3):  # no sync yet: local steps on each replica's own clipped gradient
        for m in (model, ref):
            tiny_loss(m, rank, s).backward()
        opt.step()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    out["diloco"] = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    return out


def test_clip_grad_clips_the_gradient_each_step_uses(launches):
    for r in launches(2, "clipping"):
        equal, norm = r["adamw"]
        assert equal and norm > 2 * CLIP  # the clipping bit
        assert r["diloco"]


def _sync_schedule_worker(rank, world, method):
    model = tiny_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if method == "diloco":
        opt = DiLoCo(inner, sync_every=3)
    else:
        opt = DCTDiLoCo(inner, sync_every=3, topk=8, chunk=8)
    digests, sent = [], []
    for s in range(6):
        tiny_loss(model, rank, s).backward()
        opt.step()
        opt.zero_grad()
        digests.append(params_digest(model))
        sent.append(opt.ledger.step_bytes()[0])
    return digests, sent, opt.outer_steps


@pytest.mark.parametrize("method", ["diloco", "dct_diloco"])
def test_outer_methods_sync_every_h_steps_and_replicas_agree_after(method, launches):
    results = launches(2, f"sync_{method}")
    (d0, sent0, outer0), (d1, _, _) = results
    for s in range(6):
        synced = (s + 1) % 3 == 0
        assert (d0[s] == d1[s]) == synced, f"step {s + 1}: replicas {'differ' if synced else 'agree'}"
    assert outer0 == 2
    assert [b > 0 for b in sent0] == [False, False, True, False, False, True]  # bytes only on sync steps


def _dct_lossless_worker(rank, world):
    """topk = chunk**2, decay 0, world average: DCT-DiLoCo sends everything and equals DiLoCo."""
    a, b = tiny_model(), tiny_model()
    opt_a = DiLoCo(torch.optim.SGD(a.parameters(), lr=0.1), sync_every=2)
    opt_b = DCTDiLoCo(torch.optim.SGD(b.parameters(), lr=0.1), sync_every=2, topk=64, chunk=8, decay=0.0,
                      average="world")
    for s in range(6):
        for m, o in ((a, opt_a), (b, opt_b)):
            tiny_loss(m, rank, s).backward()
            o.step()
            o.zero_grad()
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def test_dct_diloco_with_everything_sent_equals_diloco(launches):
    assert all(d < 1e-5 for d in launches(2, "dct_lossless"))


def _dct_sign_worker(rank, world):
    """dct_diloco sending every element of its error-feedback buffer as one sign bit (topk = chunk**2,
    no transform, value_dtype sign: muloco_sign's codec), against a replay of both ranks written from
    the definition in float64: e = decay * e + (anchor - p); each tensor sends sign(e) * mean|e| and
    keeps the rest in e; the anchor steps along the ranks' mean. Also the bytes a sync sends: one
    scale and one bit per element per tensor, no index, and the health byte."""
    model = tiny_model()
    opt = DCTDiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, topk=64, chunk=8, decay=0.9,
                    transform="none", value_dtype="sign", average="world", outer_lr=1.0, outer_momentum=0.0)
    replicas = [tiny_model().double() for _ in range(world)]
    anchors = [p.detach().clone() for p in replicas[0].parameters()]
    residuals = [[torch.zeros_like(a) for a in anchors] for _ in range(world)]
    worst, sent_bytes = 0.0, []
    for s in range(6):
        tiny_loss(model, rank, s).backward()
        opt.step()
        opt.zero_grad()
        sent_bytes.append(opt.ledger.step_bytes()[0])
        for r, m in enumerate(replicas):
            x, y = tiny_batch(r, s)
            torch.nn.functional.mse_loss(m(x.double()), y.double()).backward()
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        if s % 2 == 1:
            with torch.no_grad():
                for i, anchor in enumerate(anchors):
                    mean = torch.zeros_like(anchor)
                    for r, m in enumerate(replicas):
                        e = residuals[r][i]
                        e.mul_(0.9).add_(anchor - list(m.parameters())[i])
                        scale = e.abs().mean()
                        sent = torch.where(e < 0, -scale, scale)
                        e -= sent
                        mean += sent / world
                    anchor -= mean
                    for m in replicas:
                        list(m.parameters())[i].copy_(anchor)
        worst = max(worst, max((a.double() - b).abs().max().item()
                               for a, b in zip(model.parameters(), replicas[rank].parameters())))
    expected = sum(4 + (p.numel() + 7) // 8 for p in model.parameters()) + 1
    return worst, sent_bytes, expected


def test_dct_diloco_sending_every_sign_against_its_definition(launches):
    for worst, sent, expected in launches(2, "dct_sign"):
        assert worst < 1e-5
        assert sent == [0, expected, 0, expected, 0, expected]


def _muloco_worker(rank, world):
    """diloco with inner_optimizer muon (MuLoCo), H 2, outer lr 1, no momentum: every rank's torch
    Muon (Nesterov) on the tagged matrix and AdamW on the rest, the parameters averaged every 2 steps."""
    from ds_lowcomm.optim import LowcommConfig, build_optimizer

    model, ref = tiny_model(), tiny_model()
    for m in (model, ref):
        m[0].weight.use_muon = True  # DeepSpeed's tags: the one hidden matrix by Muon, the rest by AdamW
        for p in (m[0].bias, m[2].weight, m[2].bias):
            p.use_muon = False
    cfg = LowcommConfig.from_dict({"method": "diloco", "sync_every": 2, "outer_lr": 1.0, "outer_momentum": 0.0,
                                   "inner_optimizer": "muon", "inner_muon_lr": 0.05, "inner_muon_momentum": 0.9})
    opt = build_optimizer(cfg, model.parameters(), lr=0.01, weight_decay=0.1)
    ref_opts = [torch.optim.Muon([ref[0].weight], lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1),
                torch.optim.AdamW([ref[0].bias, ref[2].weight, ref[2].bias], lr=0.01, weight_decay=0.1)]
    worst = 0.0
    for s in range(6):
        for m, opts in ((model, [opt]), (ref, ref_opts)):
            tiny_loss(m, rank, s).backward()
            for o in opts:
                o.step()
                o.zero_grad()
        if s % 2 == 1:
            with torch.no_grad():
                for p in ref.parameters():
                    dist.all_reduce(p)
                    p /= world
        worst = max(worst, max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters())))
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), tiny_model().parameters()))
    return worst, moved, params_digest(model), type(opt.inner).__name__


def test_muloco_is_diloco_around_torch_muon_and_adamw(launches):
    results = launches(2, "muloco")
    assert all(worst < 1e-6 and moved > 0.05 for worst, moved, _, _ in results)
    assert len({d for _, _, d, _ in results}) == 1 and results[0][3] == "MuonWithAdamW"


# --- Dion against a replay written from its published definition (arXiv 2504.05295) ----------------

DION = dict(lr=0.01, weight_decay=0.1, rank_fraction=0.5, matrix_lr=0.05, mu=0.9)


def _dion_groups(model):
    """tiny_model's weights (one tall 32x16, one wide 4x32: Dion works on its transpose) by Dion's
    step, the biases by AdamW's."""
    return [{"params": [model[0].weight, model[2].weight], "use_muon": True},
            {"params": [model[0].bias, model[2].bias], "use_muon": False}]


def _dion_worker(rank, world, steps):
    from ds_lowcomm.optim import Dion

    model = tiny_model()
    initial = [p.detach().clone() for p in model.parameters()]
    opt = Dion(_dion_groups(model), **DION)
    grads = []
    for s in range(steps):
        tiny_loss(model, rank, s).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return {"initial": initial, "grads": grads, "final": [p.detach().clone() for p in model.parameters()],
            "digest": params_digest(model), "by_op": opt.ledger.summary()["by_op"]}


def _replay_dion(initial, grads_by_rank):
    """Dion from the paper's Algorithm (its distributed form: every rank its momentum M_r, the power
    iteration's products averaged): M_r += G_r; P = orth(mean_r(B_r Q)) by QR; R = mean_r(B_r^T P);
    M_r -= (1 - mu) P R^T; Q = R / column norms; X = X (1 - lr wd) - lr sqrt(fan_out / fan_in) P Q^T,
    with B the momentum as a tall matrix. The biases: torch's AdamW on the mean gradient (betas 0.9,
    0.95, eps 1e-8). Q starts as the implementation's shared draw (a generator seeded by the matrix's
    position), the one convention taken from it."""
    world, steps = len(grads_by_rank), len(grads_by_rank[0])
    x = [p.double().numpy().copy() for p in initial]
    mats, lr, mlr, wd, mu = (0, 2), DION["lr"], DION["matrix_lr"], DION["weight_decay"], DION["mu"]
    moms = {i: [np.zeros_like(x[i]) for _ in range(world)] for i in mats}
    qs, adam = {}, {i: [np.zeros_like(x[i]), np.zeros_like(x[i])] for i in (1, 3)}
    for pos, i in enumerate(mats):
        rows, cols = x[i].shape
        r = int(np.ceil(DION["rank_fraction"] * min(rows, cols)))
        qs[i] = torch.randn(min(rows, cols), r, generator=torch.Generator().manual_seed(pos)).double().numpy()
    for s in range(steps):
        for i in mats:
            tall = x[i].shape[0] >= x[i].shape[1]
            for r in range(world):
                moms[i][r] += grads_by_rank[r][s][i].double().numpy()
            b = [m if tall else m.T for m in moms[i]]
            p, _ = np.linalg.qr(sum(bm @ qs[i] for bm in b) / world)
            rr = sum(bm.T @ p for bm in b) / world
            for bm in b:
                bm -= (1 - mu) * p @ rr.T  # a view of moms[i][r]
            qs[i] = rr / (np.linalg.norm(rr, axis=0, keepdims=True) + 1e-8)
            step = p @ qs[i].T if tall else qs[i] @ p.T
            x[i] = x[i] * (1 - mlr * wd) - mlr * np.sqrt(x[i].shape[0] / x[i].shape[1]) * step
        for i in (1, 3):
            g = sum(grads_by_rank[r][s][i].double().numpy() for r in range(world)) / world
            m, v = adam[i]
            m[:] = 0.9 * m + 0.1 * g
            v[:] = 0.95 * v + 0.05 * g * g
            x[i] = x[i] * (1 - lr * wd) - lr * (m / (1 - 0.9 ** (s + 1))) / (np.sqrt(v / (1 - 0.95 ** (s + 1))) + 1e-8)
    return x


@pytest.mark.parametrize("world", [2, 4])
def test_dion_matches_its_replay_and_all_reduces_its_factors(world, launches):
    results = launches(world, "dion")
    replay = _replay_dion(results[0]["initial"], [r["grads"] for r in results])
    _assert_replicas_equal_and_match(results, replay)
    moved = max(np.abs(w - i.double().numpy()).max() for w, i in zip(replay, results[0]["initial"]))
    assert moved > 0.05
    # what travels a step: P (32x8 and, transposed, 32x2) with the biases' 36 gradients, then R (16x8, 4x2):
    # fp32, the same whatever the number of ranks (all-reduces)
    for r in results:
        assert r["by_op"]["dion_all_reduce"] == {"calls": 10, "sent": 5 * 4 * (256 + 64 + 36 + 128 + 8),
                                                 "received": 5 * 4 * (256 + 64 + 36 + 128 + 8)}


def test_dion_and_inner_muon_need_to_be_told_which_parameters_are_matrices():
    from ds_lowcomm.optim import Dion, LowcommConfig, build_optimizer

    with pytest.raises(ConfigError, match="method dion but 4 parameter"):
        Dion(tiny_model().parameters(), lr=0.01)
    cfg = LowcommConfig.from_dict({"method": "diloco", "inner_optimizer": "muon"})
    with pytest.raises(ConfigError, match="inner_optimizer is 'muon' but 4 parameter"):
        build_optimizer(cfg, tiny_model().parameters(), lr=0.01)
    with pytest.raises(ConfigError, match="rank_fraction must be a number in \\(0, 1\\]; got 0"):
        LowcommConfig.from_dict({"method": "dion", "rank_fraction": 0})
    with pytest.raises(ConfigError, match="inner_optimizer must be one of adamw, muon; got 'lion'"):
        LowcommConfig.from_dict({"method": "sparseloco", "inner_optimizer": "lion"})


# --- start-up checks ---------------------------------------------------------------------------

def _mismatch_worker(rank, world, what):
    model = tiny_model()
    if what == "init" and rank == 1:
        with torch.no_grad():
            model[0].weight.add_(1.0)
    DeMo(model.parameters(), lr=0.01, topk=32 if (what != "topk" or rank == 0) else 16)


@pytest.mark.parametrize("what,message", [("topk", "topk: rank 0 has 32, rank 1 has 16"),
                                          ("init", "starts from different parameters")])
def test_mismatch_across_ranks_is_detected(what, message):
    with pytest.raises(RuntimeError, match=message):
        run_local_workers(_mismatch_worker, 2, what)


# --- state -------------------------------------------------------------------------------------

def _bf16_state_worker(rank, world):
    model = tiny_model().to(torch.bfloat16)
    opt = DeMo(model.parameters(), lr=0.01)
    for s in range(2):
        x, y = tiny_batch(rank, s)
        torch.nn.functional.mse_loss(model(x.bfloat16()), y.bfloat16()).backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    other = DeMo(model.parameters(), lr=0.01, transport=TorchDistTransport())
    other.load_state_dict(sd)
    moms = [(opt.state[p]["momentum"], other.state[p]["momentum"]) for p in model.parameters()]
    return all(b.dtype == torch.float32 and torch.equal(a, b) for a, b in moms), other.ledger.sent == opt.ledger.sent


def test_fp32_state_of_bf16_params_survives_load(launches):
    for ok, ledger_ok in launches(2, "bf16_state"):
        assert ok and ledger_ok


ZERO_FIRST_METHODS = {"adamw": {}, "demo": {"topk": 4, "chunk": 8}, "diloco": {"sync_every": 3},
                      "dct_diloco": {"sync_every": 3}, "sparseloco": {"sync_every": 3}, "mtdao": {"sync_every": 3}}


def _zero_first_gradients_worker(rank, world):
    from ds_lowcomm.comm import ReplicaTopology
    from ds_lowcomm.optim import LowcommConfig, build_optimizer

    cross = ReplicaTopology.build(1, timeout_s=30.0).cross_group  # a regression fails in 30 s, not 30 min
    out = {}
    for method, extra in ZERO_FIRST_METHODS.items():
        model = tiny_model()
        opt = build_optimizer(LowcommConfig.from_dict({"method": method, **extra}), model.parameters(), lr=1e-2,
                              transport=TorchDistTransport(cross))
        for step in range(3):
            loss = tiny_loss(model, rank, step)
            if rank == 1 and step == 0:
                loss = loss * 0.0  # this rank's first gradients are all zero; the other's are not
            loss.backward()
            opt.step()
            opt.zero_grad()
        out[method] = (params_digest(model), opt.ledger.steps)
    return out


def test_a_rank_with_zero_first_gradients_takes_part_in_every_sync(launches):
    """Whether a step is real is never decided from one rank's gradients: both ranks issue the
    same collectives (before: every method hung), count 3 steps, and agree after the sync."""
    a, b = launches(2, "zero_first")
    for method in ZERO_FIRST_METHODS:
        assert a[method] == b[method], method
        assert a[method][1] == 3, method


# --- the non-finite guard (issue 15 item 3) ---------------------------------------------------

SYNC2 = {"sync_every": 2}
NONFINITE_METHODS = {
    "adamw": {}, "mtdao": SYNC2, "mtdao_topk": {"method": "mtdao", "sync_codec": "topk", **SYNC2},
    "diloco": SYNC2, "dct_diloco": SYNC2, "sparseloco_2bit": {"method": "sparseloco", **SYNC2},
    "sparseloco_fp32": {"method": "sparseloco", "value_dtype": "fp32", **SYNC2},
    **{f"demo_{v}": {"method": "demo", "topk": 4, "chunk": 8, "value_dtype": v}
       for v in ("fp32", "bf16", "fp16", "int8", "2bit", "sign")},
}
OUTER = ("diloco", "dct_diloco", "sparseloco_2bit", "sparseloco_fp32", "mtdao", "mtdao_topk")


class _WatchedTransport(TorchDistTransport):
    """The real gloo transport, noting what this rank puts on the wire: whether every dense
    all-reduce buffer was finite, and whether every sparse payload flagged unhealthy was zeros."""

    def __init__(self, group):
        super().__init__(group)
        self.dense_finite, self.flagged_zero = [], []

    def start_all_reduce_sum_(self, tensor, op="all_reduce"):
        self.dense_finite.append(bool(torch.isfinite(tensor).all()))
        return super().start_all_reduce_sum_(tensor, op)

    def start_all_gather_bytes(self, payload, op="all_gather"):
        if "sparse" in op and payload[-1] == 0:  # a sparse exchange flagged unhealthy
            self.flagged_zero.append(not bool(payload.any()))
        return super().start_all_gather_bytes(payload, op)


def _nonfinite_run(rank, cross, name, extra, poison, value, policy, poisoned_ranks=(1,)):
    from ds_lowcomm.optim import LowcommConfig, build_optimizer

    raw = {"method": name, **extra, "nonfinite": policy} if "method" not in extra else {**extra, "nonfinite": policy}
    model = tiny_model()
    transport = _WatchedTransport(cross)
    opt = build_optimizer(LowcommConfig.from_dict(raw), model.parameters(), lr=1e-2, transport=transport)
    error = None
    try:
        for step in range(4):
            tiny_loss(model, rank, step).backward()
            if rank in poisoned_ranks and step == 1:
                target = model[0].weight.grad if poison == "grad" else model[0].weight.data
                target.view(-1)[5] = value  # one element, one rank, one step
            opt.step()
            opt.zero_grad()
    except Exception as err:  # noqa: BLE001 - the test reads which error every rank saw
        error = f"{type(err).__name__}: {err}"
    params = [p.detach().clone() for p in model.parameters()]
    return {"finite": all(bool(torch.isfinite(p).all()) for p in params), "digest": params_digest(model),
            "nonfinite": opt.ledger.summary()["nonfinite"], "error": error,
            "wire_ok": all(transport.dense_finite) and all(transport.flagged_zero)}


def _nonfinite_worker(rank, world):
    from ds_lowcomm.comm import ReplicaTopology

    cross = ReplicaTopology.build(1, timeout_s=30.0).cross_group  # a regression fails in 30 s, not 30 min
    out = {}
    for name, extra in NONFINITE_METHODS.items():
        for value in (float("nan"), float("inf")):
            out[(name, "grad", str(value))] = _nonfinite_run(rank, cross, name, extra, "grad", value, "skip")
        if name in OUTER:  # a replica whose parameters went non-finite (an overflowed inner step)
            out[(name, "param", "nan")] = _nonfinite_run(rank, cross, name, extra, "param", float("nan"), "skip")
    for name in ("adamw", "demo_int8", "diloco", "sparseloco_2bit"):
        out[(name, "raise")] = _nonfinite_run(rank, cross, name, NONFINITE_METHODS[name], "grad", float("nan"), "raise")
        out[(name, "all")] = _nonfinite_run(rank, cross, name, NONFINITE_METHODS[name], "grad", float("nan"), "skip",
                                            poisoned_ranks=(0, 1))
    return out


def test_a_non_finite_value_on_one_rank_poisons_no_replica(launches):
    """One NaN or inf element on rank 1 at one step, every method and value format: nothing
    non-finite goes on the wire (dense buffers finite, flagged sparse payloads all zeros), both
    ranks end finite and identical, and the skip is counted with rank 1's number. Before: the
    healthy rank's model went non-finite (adamw, diloco, dct_diloco, mtdao, sparseloco fp32), demo
    froze the block, sparseloco's 2-bit values crashed."""
    a, b = launches(2, "nonfinite")
    for key, ra in a.items():
        if key[1] in ("raise", "all"):
            continue
        rb = b[key]
        assert ra["error"] is None and rb["error"] is None, (key, ra["error"], rb["error"])
        assert ra["finite"] and rb["finite"], key
        assert ra["digest"] == rb["digest"], key
        assert ra["wire_ok"] and rb["wire_ok"], key
        seen = [ranks for r in (ra, rb) for ranks in r["nonfinite"].values()]  # a local skip: rank 1's own ledger
        assert any("1" in ranks for ranks in seen) and not any("0" in ranks for ranks in seen), (key, seen)


def test_nonfinite_raise_stops_every_rank_and_all_ranks_poisoned_moves_nothing(launches):
    """lowcomm.nonfinite "raise": every rank raises NonFiniteError naming rank 1 at the same
    exchange (none waits for the other). Every rank poisoned under "skip": the flagged exchange
    averages nothing, and the models stay finite and identical."""
    a, b = launches(2, "nonfinite")
    for name in ("adamw", "demo_int8", "diloco", "sparseloco_2bit"):
        for r in (a[(name, "raise")], b[(name, "raise")]):
            assert r["error"] is not None and r["error"].startswith("NonFiniteError"), (name, r["error"])
            assert "[1]" in r["error"] and "nonfinite is 'raise'" in r["error"], r["error"]
            assert r["wire_ok"]
        ra, rb = a[(name, "all")], b[(name, "all")]
        assert ra["error"] is None and ra["finite"] and rb["finite"] and ra["digest"] == rb["digest"], name
