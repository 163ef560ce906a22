"""The compressed all-reduce (comm/compressed_allreduce.py) and dct_diloco's ``exchange`` setting.
One 8-rank gloo launch computes every case: the exchange over groups of 2, 3, 4 and 8 ranks, ranks
sitting out or non-finite, the pieces of a ZeRO partition, an unused layer at 3 and 8 replicas with
either exchange, and the one-bit recipe (SIGN_OUTER) at 8 replicas, blocking and overlapped, with a
checkpoint taken and resumed. Each case is checked against a single-process replay written from
the definition (each rank's signs and scales, each piece's contributors, their shared scale and
the exact sum of their signs), with the bytes each rank sent and received per phase."""

import copy
import math

import pytest
import torch
import torch.distributed as dist

from ds_lowcomm.comm import ByteLedger, CompressedAllReduce, Pieces, TorchDistTransport
from ds_lowcomm.optim.outer import DCTDiLoCo, DCTDiLoCoSettings, SparseLoCoSettings, resolve_exchange
from ds_lowcomm.optim.recipes import SIGN_OUTER
from ds_lowcomm.settings import ConfigError
from lowcomm_task.workers import run_local_workers

WORLD = 8
GROUP_SIZES = (2, 3, 4, 8)
# 60 elements: chunks of 30, 20, 15 and 8 (the last 4); the third tensor is zero on every rank (no
# contributor: it must not move), the second zero on rank 1 alone (one contributor fewer there)
SHAPES = [(5, 7), (13,), (3, 4)]
EXCHANGES = 2
RECIPE_STEPS, RECIPE_SAVE_AT = 8, 3
# (H, sync_delay): blocking; landing at the next step; landing two steps on (phase 2 goes out between)
RECIPE_RUNS = ((2, 0), (2, 1), (3, 2))
PIECES_NUMEL, PIECE_OFFSETS = 70, (0, 40, 56)  # SHAPES inside one flat tensor, padding between them


def _inputs(n: int, rank: int, exchange: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * n + 100 * rank + 10 * exchange)
    first = torch.randn(SHAPES[0], generator=g) * (1 + rank)
    first[0] = first[0].abs() + 0.1  # a row positive on every rank (its count is n: the wrap), and
    first[1] = -first[1].abs() - 0.1  # one negative on every rank (its count is 0)
    second = torch.zeros(SHAPES[1]) if rank == 1 else torch.randn(SHAPES[1], generator=g)
    return [first, second, torch.zeros(SHAPES[2])]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


class _Unused(torch.nn.Module):
    """A model whose optimizer holds a layer its forward pass never uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.used(x)


def _recipe_optimizer(model, transport, **extra):
    outer = {k: v for k, v in SIGN_OUTER.items() if k != "method"}
    return DCTDiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), transport=transport,
                     **{**outer, "sync_every": 2, **extra})


def _train(model, opt, rank: int, steps: range, gathers: list | None = None) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(10_000 * rank + step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if gathers is not None:  # how many second phases have been issued after each step
            gathers.append(opt.ledger.by_op.get("outer_compressed_all_reduce_gather", [0])[0])


def _recipe_run(rank, h: int, delay: int) -> dict:
    """The recipe at 8 replicas (auto: the all-reduce) at H ``h``, landing ``delay`` steps after each
    send; a checkpoint after RECIPE_SAVE_AT steps (a sync in flight, with a delay), resumed by a new
    optimizer."""
    extra = {"sync_every": h, **({"sync_delay": delay} if delay else {})}
    transport = TorchDistTransport(ledger=ByteLedger())
    model = _model()
    opt = _recipe_optimizer(model, transport, **extra)
    gathers = []
    _train(model, opt, rank, range(RECIPE_SAVE_AT), gathers)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    _train(model, opt, rank, range(RECIPE_SAVE_AT, RECIPE_STEPS), gathers)
    resumed_model = _model(seed=1)  # other starting values: all of it must come from the checkpoint
    resumed = _recipe_optimizer(resumed_model, TorchDistTransport(ledger=ByteLedger()), **extra)
    resumed_model.load_state_dict(saved[0])
    resumed.load_state_dict(saved[1])
    _train(resumed_model, resumed, rank, range(RECIPE_SAVE_AT, RECIPE_STEPS))
    bounds = next(iter(opt._all_reduces.values())).bounds
    return {"exchange": opt.exchange, "record": opt._record["exchange"], "gathers": gathers, "bounds": bounds,
            "anchors": [a.clone() for a in opt.synced_values()], "params": [p.detach().clone() for p in model.parameters()],
            "resumed_params": [p.detach().clone() for p in resumed_model.parameters()],
            "steps_sent": list(opt.ledger._step_sent), "steps_received": list(opt.ledger._step_received),
            "by_op": {op: list(row) for op, row in opt.ledger.by_op.items()}}


def _worker(rank, world_size):
    out = {"exchange": {}, "unused": {}}
    groups = {n: dist.new_group(list(range(n))) for n in GROUP_SIZES}  # every rank creates every group
    for n in GROUP_SIZES:
        if rank >= n:
            continue
        transport = TorchDistTransport(groups[n], ledger=ByteLedger())
        sync = CompressedAllReduce(SHAPES, transport=transport)
        runs = []
        for e in range(EXCHANGES):
            buffers = _inputs(n, rank, e)
            means = sync.exchange(buffers)
            ledger = {op: list(row) for op, row in transport.ledger.by_op.items()}
            transport.ledger = ByteLedger()
            runs.append({"means": means, "left": buffers, "ledger": ledger})
        out["exchange"][n] = runs
        out.setdefault("bounds", {})[n] = sync.bounds
    if rank < 4:  # 4 ranks: rank 1 sits out (a healed replica), then rank 2 has a NaN (nonfinite skip)
        transport = TorchDistTransport(groups[4], ledger=ByteLedger())
        sync = CompressedAllReduce(SHAPES, transport=transport)
        runs = []
        for e, (sits_out, nan_rank) in enumerate(((1, None), (None, 2))):
            buffers = _inputs(4, rank, e)
            if rank == nan_rank:
                buffers[0][3, 3] = float("nan")
            transport.sits_out = rank == sits_out
            before = [b.clone() for b in buffers]
            means = sync.exchange(buffers)
            runs.append({"means": means, "left": buffers,
                         "kept": all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(before, buffers))})
        out["left_out"] = {"runs": runs, "nonfinite": transport.ledger.nonfinite}
        try:  # compile asked where auto picks the all-reduce: refused by name, when the optimizer is built
            _recipe_optimizer(_model(), TorchDistTransport(groups[4]), compile=True)
        except ConfigError as err:
            out["compile_refused"] = str(err)
    if rank < 3:  # 3 ranks, the tensors as pieces of one flat tensor with padding (a ZeRO partition)
        layout = Pieces(PIECES_NUMEL, tuple(zip(PIECE_OFFSETS, SHAPES)))
        flat = torch.full((PIECES_NUMEL,), 7.0)  # padding: neither sent nor changed
        for view, t in zip(layout.views(flat), _inputs(3, rank, 0)):
            view.copy_(t)
        sync = CompressedAllReduce([layout], transport=TorchDistTransport(groups[3], ledger=ByteLedger()))
        (mean,) = sync.exchange([flat])
        out["pieces"] = {"mean": mean, "left": flat}
    for n in (3, 8):  # an unused layer never moves, whichever exchange
        for exchange in ("all_gather", "all_reduce"):
            if rank < n:
                model = _Unused()
                opt = _recipe_optimizer(model, TorchDistTransport(groups[n]), exchange=exchange)
                before = model.unused.weight.detach().clone(), model.unused.bias.detach().clone()
                for step in range(4):
                    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 * rank + step))
                    opt.zero_grad()
                    model(x).pow(2).mean().backward()
                    opt.step()
                out["unused"][(n, exchange)] = max((model.unused.weight - before[0]).abs().max().item(),
                                                   (model.unused.bias - before[1]).abs().max().item())
    out["recipe"] = {run: _recipe_run(rank, *run) for run in RECIPE_RUNS}
    try:  # fewer elements than replicas: no chunk for some of them
        CompressedAllReduce([(5,)], transport=TorchDistTransport())
    except ValueError as err:
        out["too_few"] = str(err)
    return out


@pytest.fixture(scope="module")
def results():
    return run_local_workers(_worker, WORLD)


# -- the replay, from the definition -------------------------------------------------------------
def _replay(n: int, exchanges: int = EXCHANGES, senders=lambda e: None, inputs=_inputs):
    """Per exchange: the mean every rank ends with (flat) and each rank's buffers after (flat).
    Each rank sends each element's sign (0 counts as +) and each tensor's mean magnitude; a
    tensor's contributors are the ranks averaged (``senders(e)``, None: all) whose magnitude is not
    zero; they share the mean of their magnitudes s, and each element's mean is s x the sum of the
    contributors' signs / the ranks averaged; what a contributor's signs stood for (s x sign)
    leaves its buffer."""
    out = []
    for e in range(exchanges):
        tensors = [[t.reshape(-1).float() for t in inputs(n, r, e)] for r in range(n)]
        ranks = senders(e) or list(range(n))
        mean, left = [], [[t.clone() for t in ts] for ts in tensors]
        for k in range(len(SHAPES)):
            magnitudes = {r: torch.linalg.vector_norm(tensors[r][k], 1) / tensors[r][k].numel() for r in ranks}
            contributors = [r for r in ranks if magnitudes[r] > 0]
            total = torch.zeros(())
            for r in contributors:
                total = total + magnitudes[r]
            shared = total / max(1, len(contributors))
            signs = {r: torch.where(tensors[r][k] < 0, -1.0, 1.0) for r in contributors}
            count = sum(signs.values(), torch.zeros_like(tensors[0][k]))
            mean.append(shared * count / len(ranks))
            for r in contributors:
                left[r][k] = tensors[r][k] - shared * signs[r]
        out.append({"mean": torch.cat(mean), "left": [torch.cat(ts) for ts in left]})
    return out


def _wire(sizes: list[int], n: int, bounds: list[int]) -> tuple[list[int], int, int]:
    """From the wire format, for tensors of ``sizes`` (laid end to end as a snake draft deals them,
    largest first, into n heaps, heap after heap) cut at ``bounds`` into n chunks:
    phase 1's part to each chunk's owner (its sign bits, the scale of each tensor it touches, a
    flag byte; every part at the largest one's size), phase 2's part (each chunk's counts mod n in ceil(log2 n) bits, each touched
    tensor's shared scale (4 bytes) and contributor count (1 byte); every part at the largest one's
    size), and the least largest part any cut into n non-empty chunks could have (by dynamic
    programming over every cut)."""
    ranked = sorted(range(len(sizes)), key=lambda k: (-sizes[k], k))  # the flat order: a snake draft into n heaps
    heaps = [[k for i, k in enumerate(ranked) if (i % n if (i // n) % 2 == 0 else n - 1 - i % n) == j] for j in range(n)]
    sizes = [sizes[k] for heap in heaps for k in heap]
    starts = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
    width = max(1, math.ceil(math.log2(n)))

    def touched(lo, hi):
        return sum(1 for k in range(len(sizes)) if starts[k] < hi and starts[k + 1] > lo)

    def part(lo, hi):
        return ((hi - lo) * width + 7) // 8 + 5 * touched(lo, hi)

    numel = starts[-1]
    assert bounds[0] == 0 and bounds[-1] == numel and len(bounds) == n + 1
    assert all(a < b for a, b in zip(bounds, bounds[1:]))  # every chunk non-empty, in order
    phase1 = max((hi - lo + 7) // 8 + 4 * touched(lo, hi) + 1 for lo, hi in zip(bounds, bounds[1:]))
    best = {(0, 0): 0}  # (chunks, elements covered) -> the least largest part
    for j in range(1, n + 1):
        for hi in range(j, numel + 1):
            options = [max(best[(j - 1, lo)], part(lo, hi)) for lo in range(j - 1, hi) if (j - 1, lo) in best]
            if options:
                best[(j, hi)] = min(options)
    return phase1, max(part(lo, hi) for lo, hi in zip(bounds, bounds[1:])), best[(n, numel)]


def _ledger_bytes(sizes: list[int], n: int, rank: int, bounds: list[int]) -> dict:
    phase1, phase2, least = _wire(sizes, n, bounds)
    assert phase2 == least  # the chunks are cut so that the largest phase 2 part is as small as it can be
    return {"compressed_all_reduce_scatter": [1, (n - 1) * phase1, (n - 1) * phase1],
            "compressed_all_reduce_gather": [1, phase2, (n - 1) * phase2]}


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("n", GROUP_SIZES)
def test_exchange_matches_its_replay_identical_on_every_rank(results, n):
    for e, expect in enumerate(_replay(n)):
        means = [torch.cat([m.reshape(-1) for m in results[r]["exchange"][n][e]["means"]]) for r in range(n)]
        for rank in range(n):
            run = results[rank]["exchange"][n][e]
            assert torch.equal(means[rank], means[0])  # the same bits on every rank
            assert [tuple(m.shape) for m in run["means"]] == SHAPES
            _close(means[rank], expect["mean"])
            _close(torch.cat([t.reshape(-1) for t in run["left"]]), expect["left"][rank])
            assert run["ledger"] == _ledger_bytes([math.prod(s) for s in SHAPES], n, rank, results[rank]["bounds"][n])
        assert torch.equal(means[0][48:], torch.zeros(12))  # zero on every rank: no move
        assert means[0][:7].min() > 0 and means[0][7:14].max() < 0  # all positive / all negative counted


def test_a_rank_sitting_out_or_non_finite_is_left_out_of_the_mean_and_keeps_its_buffers(results):
    replay = _replay(4, exchanges=2, senders=lambda e: [0, 2, 3] if e == 0 else [0, 1, 3])
    for e, expect in enumerate(replay):
        for rank in range(4):
            run = results[rank]["left_out"]["runs"][e]
            _close(torch.cat([m.reshape(-1) for m in run["means"]]), expect["mean"])
            assert run["kept"] == (rank == (1, 2)[e])  # the one left out sent nothing of its buffers
            if not run["kept"]:
                _close(torch.cat([t.reshape(-1) for t in run["left"]]), expect["left"][rank])
    for rank in range(4):  # only the NaN is counted (sitting out is not non-finite), on every rank
        assert results[rank]["left_out"]["nonfinite"] == {"compressed_all_reduce": {"2": 1}}


def test_pieces_of_a_flat_tensor_are_exchanged_without_their_padding(results):
    (expect,) = _replay(3, exchanges=1)
    gaps = torch.ones(PIECES_NUMEL, dtype=torch.bool)
    for offset, shape in zip(PIECE_OFFSETS, SHAPES):
        gaps[offset : offset + math.prod(shape)] = False
    for rank in range(3):
        got = results[rank]["pieces"]
        _close(got["mean"][~gaps], expect["mean"])
        assert torch.equal(got["mean"][gaps], torch.zeros(int(gaps.sum())))
        _close(got["left"][~gaps], expect["left"][rank])
        assert torch.equal(got["left"][gaps], torch.full((int(gaps.sum()),), 7.0))


def test_an_unused_layer_never_moves_with_either_exchange(results):
    for n in (3, 8):
        for exchange in ("all_gather", "all_reduce"):
            assert {results[r]["unused"][(n, exchange)] for r in range(n)} == {0.0}, (n, exchange)


def test_compile_is_refused_by_name_where_the_all_reduce_runs(results):
    assert "lowcomm.compile true" in results[0]["compile_refused"]
    assert "exchange auto at 4 replicas" in results[0]["compile_refused"]
    with pytest.raises(ConfigError, match="lowcomm.compile true .*exchange all_reduce"):
        DCTDiLoCoSettings.from_flat({**{k: v for k, v in SIGN_OUTER.items() if k != "method"},
                                     "exchange": "all_reduce", "compile": True})


@pytest.mark.parametrize("run", RECIPE_RUNS)
def test_the_recipe_at_eight_replicas_stays_identical_and_resumes_exactly(results, run):
    h, delay = run
    recipes = [results[r]["recipe"][run] for r in range(WORLD)]
    assert {r["exchange"] for r in recipes} == {"all_reduce"}
    assert recipes[0]["record"] == "auto"  # the user's setting, not what it resolved to
    for r in recipes:
        for a, b in zip(r["anchors"], recipes[0]["anchors"]):
            assert torch.equal(a, b)  # replicas identical after every sync
        for a, b in zip(r["resumed_params"], r["params"]):
            assert torch.equal(a, b)  # the resumed run is the uninterrupted one, bit for bit
    # each phase's bytes against the wire format, over the model's parameters end to end
    sizes = [p.numel() for p in _model().parameters()]
    phase1, phase2, least = _wire(sizes, WORLD, recipes[0]["bounds"])
    assert phase2 == least
    sends = RECIPE_STEPS // h
    second = len([t for t in range(h, RECIPE_STEPS + 1, h) if t + 1 <= RECIPE_STEPS or not delay])
    by_op = recipes[0]["by_op"]
    assert by_op["outer_compressed_all_reduce_scatter"] == [sends, sends * 7 * phase1, sends * 7 * phase1]
    assert by_op["outer_compressed_all_reduce_gather"] == [second, second * phase2, second * 7 * phase2]
    assert "outer_sparse_all_gather" not in by_op
    # the second phase goes out one step after the send (delay 0: at once), landing `delay` steps after it
    gathers = recipes[0]["gathers"]
    for t in range(1, RECIPE_STEPS + 1):
        out = len([s for s in range(h, t + 1, h) if s + min(delay, 1) <= t])
        assert gathers[t - 1] == out, (t, gathers)


def test_too_few_elements_for_the_replicas_names_the_fix(results):
    assert "set lowcomm.exchange all_gather" in results[0]["too_few"]


def test_exchange_is_chosen_where_it_sends_fewer_bytes_and_refused_by_name():
    codec = DCTDiLoCoSettings.from_flat({k: v for k, v in SIGN_OUTER.items() if k != "method"}).codec
    assert [resolve_exchange("auto", codec, n) for n in (1, 2, 3, 4, 8)] == ["all_gather"] * 3 + ["all_reduce"] * 2
    assert resolve_exchange("all_reduce", codec, 2) == "all_reduce"
    assert resolve_exchange("all_gather", codec, 8) == "all_gather"
    sparse = SparseLoCoSettings().codec  # 64 of 4096 kept: not dense
    assert resolve_exchange("auto", sparse, 8) == "all_gather"
    for value_dtype in ("bf16", "2bit"):  # every element, but not one sign bit each
        dense = DCTDiLoCoSettings.from_flat({"topk": 64, "chunk": 8, "transform": "none",
                                             "value_dtype": value_dtype}).codec
        assert resolve_exchange("auto", dense, 8) == "all_gather"
    with pytest.raises(ConfigError, match=r"lowcomm.exchange must be one of auto, all_gather, all_reduce; got 'ring'"):
        DCTDiLoCoSettings.from_flat({"exchange": "ring"})
    with pytest.raises(ConfigError, match=r"lowcomm.exchange all_reduce needs one sign bit .*got transform 'dct'"):
        DCTDiLoCoSettings.from_flat({"exchange": "all_reduce", "topk": 64, "chunk": 8})
    with pytest.raises(ConfigError, match=r"lowcomm.exchange all_reduce needs one sign bit .*value_dtype '2bit'"):
        SparseLoCoSettings.from_flat({"exchange": "all_reduce", "topk": 4096})
    from ds_lowcomm.optim.fault_tolerance import check_method

    check_method({"method": "dct_diloco", "exchange": "all_reduce"})  # any quorum's size
