"""The two-phase compressed all-reduce (comm/compressed_allreduce.py) and dct_diloco's
``exchange`` setting. One 8-rank gloo launch computes every case: the exchange over groups of 2,
3, 4 and 8 ranks (sign and 2-bit), and the one-bit recipe (SIGN_OUTER) at 8 replicas with a
checkpoint taken and resumed. Each case is checked against a single-process replay written from
the definition (what every rank sends, what each chunk's owner averages, re-quantises and keeps as
its server error), with the bytes each rank sent and received per phase."""

import copy
import math

import pytest
import torch
import torch.distributed as dist

from ds_lowcomm.codec import ValueFormat
from ds_lowcomm.comm import ByteLedger, CompressedAllReduce, Pieces, TorchDistTransport
from ds_lowcomm.optim.outer import DCTDiLoCo, DCTDiLoCoSettings, SparseLoCoSettings, resolve_exchange
from ds_lowcomm.optim.recipes import SIGN_OUTER
from ds_lowcomm.settings import ConfigError
from lowcomm_task.workers import run_local_workers

WORLD = 8
GROUP_SIZES = (2, 3, 4, 8)
SHAPES = [(5, 7), (13,), (3, 4)]  # 60 elements: chunks of 30, 20, 15 and 8 (the last 4)
EXCHANGES = 3  # per format, the server error carried from one to the next
FORMATS = ("sign", "2bit")
RECIPE_STEPS, RECIPE_SAVE_AT, RECIPE_H = 8, 4, 2
PIECES_NUMEL, PIECE_OFFSETS = 70, (0, 40, 56)  # SHAPES inside one flat tensor, padding between them


def _inputs(fmt: str, n: int, rank: int, exchange: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * n + 100 * rank + 10 * exchange + FORMATS.index(fmt))
    return [torch.randn(shape, generator=g) * (1 + rank) for shape in SHAPES]


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _recipe_optimizer(model, transport):
    outer = {k: v for k, v in SIGN_OUTER.items() if k != "method"}
    return DCTDiLoCo(torch.optim.AdamW(model.parameters(), lr=1e-2), transport=transport,
                     **{**outer, "sync_every": RECIPE_H})


def _train(model, opt, rank: int, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(10_000 * rank + step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _worker(rank, world_size):
    out = {"exchange": {}}
    groups = {n: dist.new_group(list(range(n))) for n in GROUP_SIZES}  # every rank creates every group
    for n in GROUP_SIZES:
        if rank >= n:
            continue
        for fmt in FORMATS:
            transport = TorchDistTransport(groups[n], ledger=ByteLedger())
            sync = CompressedAllReduce(SHAPES, value_dtype=fmt, transport=transport)
            server = torch.zeros(sync.server_error_numel)
            runs = []
            for e in range(EXCHANGES):
                buffers = _inputs(fmt, n, rank, e)
                means = sync.exchange(buffers, server)
                ledger = {op: list(row) for op, row in transport.ledger.by_op.items()}
                transport.ledger = ByteLedger()
                runs.append({"means": means, "left": buffers, "server": server.clone(), "ledger": ledger})
            out["exchange"][f"{fmt}{n}"] = runs
    if rank < 4:  # 4 ranks, sign: rank 1 sits out (a healed replica), then rank 2 has a NaN (nonfinite skip)
        transport = TorchDistTransport(groups[4], ledger=ByteLedger())
        sync = CompressedAllReduce(SHAPES, value_dtype="sign", transport=transport)
        server = torch.zeros(sync.server_error_numel)
        runs = []
        for e, (sits_out, nan_rank) in enumerate(((1, None), (None, 2))):
            buffers = _inputs("sign", 4, rank, e)
            if rank == nan_rank:
                buffers[1][3] = float("nan")
            transport.sits_out = rank == sits_out
            before = [b.clone() for b in buffers]
            means = sync.exchange(buffers, server)
            runs.append({"means": means, "kept": all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(before, buffers)),
                         "server": server.clone()})
        out["left_out"] = {"runs": runs, "nonfinite": transport.ledger.nonfinite}
    if rank < 3:  # 3 ranks, sign, the tensors as pieces of one flat tensor with padding (a ZeRO partition)
        layout = Pieces(PIECES_NUMEL, tuple(zip(PIECE_OFFSETS, SHAPES)))
        flat = torch.full((PIECES_NUMEL,), 7.0)  # padding: neither sent nor changed
        for view, t in zip(layout.views(flat), _inputs("sign", 3, rank, 0)):
            view.copy_(t)
        sync = CompressedAllReduce([layout], value_dtype="sign", transport=TorchDistTransport(groups[3], ledger=ByteLedger()))
        (mean,) = sync.exchange([flat], torch.zeros(sync.server_error_numel))
        out["pieces"] = {"mean": mean, "left": flat}
    # the recipe at 8 replicas: auto picks the all-reduce; a checkpoint at RECIPE_SAVE_AT, resumed
    transport = TorchDistTransport(ledger=ByteLedger())
    model = _model()
    opt = _recipe_optimizer(model, transport)
    _train(model, opt, rank, range(RECIPE_SAVE_AT))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    opt.spread_server_error()  # the server error whole, as per-parameter state (what Megatron's checkpoints hold)
    spread = copy.deepcopy(opt.state_dict())
    opt.drop_spread_server_error()
    _train(model, opt, rank, range(RECIPE_SAVE_AT, RECIPE_STEPS))
    resumed = {}
    for name, state in (("chunks", saved[1]), ("whole", spread)):
        resumed_model = _model(seed=1)  # other starting values: all of it must come from the checkpoint
        resumed[name] = _recipe_optimizer(resumed_model, TorchDistTransport(ledger=ByteLedger()))
        resumed_model.load_state_dict(saved[0])
        resumed[name].load_state_dict(state)
        _train(resumed_model, resumed[name], rank, range(RECIPE_SAVE_AT, RECIPE_STEPS))
        resumed[name] = (resumed_model, resumed[name])
    out["recipe"] = {
        "exchange": opt.exchange, "record": opt._record["exchange"],
        "anchors": [a.clone() for a in opt.synced_values()], "params": [p.detach().clone() for p in model.parameters()],
        "server": dict(opt._server_error), "saved_server": saved[1]["lowcomm"]["server_error"],
        "resumed_params": {k: [p.detach().clone() for p in m.parameters()] for k, (m, _) in resumed.items()},
        "resumed_server": {k: dict(o._server_error) for k, (_, o) in resumed.items()},
        "whole": [spread["state"][i]["whole_server_error"] for i in range(len(list(model.parameters())))],
        "spread_extra": sorted(spread["lowcomm"]),
        "steps_sent": list(opt.ledger._step_sent), "steps_received": list(opt.ledger._step_received),
        "by_op": {op: list(row) for op, row in opt.ledger.by_op.items()},
    }
    return out


@pytest.fixture(scope="module")
def results():
    return run_local_workers(_worker, WORLD)


# -- the replay, from the definition -------------------------------------------------------------
def _quantise(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """The values a chunk decodes to: sign: mean magnitude with each element's sign (0 counts as +);
    2bit: the codec's 4-bin lookup (its own tests cover it)."""
    if fmt == "sign":
        scale = x.abs().mean()
        return torch.where(x < 0, -scale, scale)
    return ValueFormat("2bit").pack(x)[1]


def _replay(fmt: str, n: int, exchanges: int = EXCHANGES, senders=lambda e: None):
    """Per exchange: the mean every rank ends with, each rank's buffers after, each rank's server
    error. ``senders(e)``: the ranks averaged in exchange e (None: all)."""
    numel = sum(math.prod(s) for s in SHAPES)
    c = math.ceil(numel / n)
    bounds = [(j * c, min(numel, (j + 1) * c)) for j in range(n)]
    servers = [torch.zeros(hi - lo) for lo, hi in bounds]
    out = []
    for e in range(exchanges):
        flats = [torch.cat([t.reshape(-1) for t in _inputs(fmt, n, r, e)]) for r in range(n)]
        sent = [torch.cat([_quantise(fmt, f[lo:hi]) for lo, hi in bounds]) for f in flats]
        ranks = senders(e) or list(range(n))
        mean_chunks = []
        for j, (lo, hi) in enumerate(bounds):
            total = sent[ranks[0]][lo:hi].clone()
            for r in ranks[1:]:
                total += sent[r][lo:hi]
            compensated = total / len(ranks) + servers[j]
            q = _quantise(fmt, compensated)
            servers[j] = compensated - q
            mean_chunks.append(q)
        out.append({"mean": torch.cat(mean_chunks), "left": [f - s for f, s in zip(flats, sent)],
                    "servers": [s.clone() for s in servers]})
    return out


def _chunk_bytes(fmt: str, c: int) -> int:
    return (4 + (c + 7) // 8) if fmt == "sign" else (16 + (c + 3) // 4)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", GROUP_SIZES)
def test_two_phase_exchange_matches_its_replay(results, fmt, n):
    replay = _replay(fmt, n)
    numel = sum(math.prod(s) for s in SHAPES)
    cb = _chunk_bytes(fmt, math.ceil(numel / n))
    for e, expect in enumerate(replay):
        for rank in range(n):
            run = results[rank]["exchange"][f"{fmt}{n}"][e]
            mean = torch.cat([m.reshape(-1) for m in run["means"]])
            torch.testing.assert_close(mean, expect["mean"], rtol=0, atol=0)  # identical on every rank
            assert [tuple(m.shape) for m in run["means"]] == SHAPES
            left = torch.cat([t.reshape(-1) for t in run["left"]])
            torch.testing.assert_close(left, expect["left"][rank], rtol=0, atol=0)
            torch.testing.assert_close(run["server"], expect["servers"][rank], rtol=0, atol=0)
            # (n-1)/n of a payload each phase: n-1 chunks (and their flag bytes) out and in, then
            # this rank's chunk out and the n-1 others in
            assert run["ledger"] == {"compressed_all_reduce_scatter": [1, (n - 1) * (cb + 1), (n - 1) * (cb + 1)],
                                     "compressed_all_reduce_gather": [1, cb, (n - 1) * cb]}


def test_a_rank_sitting_out_or_non_finite_is_left_out_of_the_mean_and_keeps_its_buffers(results):
    replay = _replay("sign", 4, exchanges=2, senders=lambda e: [0, 2, 3] if e == 0 else [0, 1, 3])
    for e, expect in enumerate(replay):
        for rank in range(4):
            run = results[rank]["left_out"]["runs"][e]
            torch.testing.assert_close(torch.cat([m.reshape(-1) for m in run["means"]]), expect["mean"], rtol=0, atol=0)
            torch.testing.assert_close(run["server"], expect["servers"][rank], rtol=0, atol=0)
            assert run["kept"] == (rank == (1, 2)[e])  # the one left out sent nothing of its buffers
    for rank in range(4):  # only the NaN is counted (sitting out is not non-finite), on every rank
        assert results[rank]["left_out"]["nonfinite"] == {"compressed_all_reduce": {"2": 1}}


def test_pieces_of_a_flat_tensor_are_exchanged_without_their_padding(results):
    (expect,) = _replay("sign", 3, exchanges=1)
    gaps = torch.ones(PIECES_NUMEL, dtype=torch.bool)
    for offset, shape in zip(PIECE_OFFSETS, SHAPES):
        gaps[offset : offset + math.prod(shape)] = False
    for rank in range(3):
        got = results[rank]["pieces"]
        torch.testing.assert_close(got["mean"][~gaps], expect["mean"], rtol=0, atol=0)
        assert torch.equal(got["mean"][gaps], torch.zeros(int(gaps.sum())))
        torch.testing.assert_close(got["left"][~gaps], expect["left"][rank], rtol=0, atol=0)
        assert torch.equal(got["left"][gaps], torch.full((int(gaps.sum()),), 7.0))


def test_the_recipe_at_eight_replicas_stays_identical_and_resumes_exactly(results):
    recipes = [results[r]["recipe"] for r in range(WORLD)]
    assert {r["exchange"] for r in recipes} == {"all_reduce"} and recipes[0]["record"] == "all_reduce"
    for r in recipes[1:]:
        for a, b in zip(r["anchors"], recipes[0]["anchors"]):
            assert torch.equal(a, b)  # replicas identical after every sync
    servers = [r["server"] for r in recipes]
    assert list(servers[0]) == ["0,1,2,3"] and any(s["0,1,2,3"].abs().sum() > 0 for s in servers)
    for r in recipes:
        for how in ("chunks", "whole"):  # from each rank's chunk, or from the whole (each rank cuts its chunk again)
            for a, b in zip(r["resumed_params"][how], r["params"]):
                assert torch.equal(a, b), how  # the resumed run is the uninterrupted one, bit for bit
            assert torch.equal(r["resumed_server"][how]["0,1,2,3"], r["server"]["0,1,2,3"]), how
        assert not torch.equal(r["saved_server"]["0,1,2,3"], r["server"]["0,1,2,3"])  # it moved after the save
    # the whole server error: the 8 chunks end to end, cut into the parameters' shapes, equal on every rank;
    # in place of the chunks
    flat = torch.cat([r["saved_server"]["0,1,2,3"] for r in recipes])
    whole = recipes[0]["whole"]
    assert [tuple(w.shape) for w in whole] == [tuple(p.shape) for p in _model().parameters()]
    assert torch.equal(torch.cat([w.reshape(-1) for w in whole]), flat)
    assert all(torch.equal(a, b) for r in recipes[1:] for a, b in zip(r["whole"], whole))
    assert "server_error" not in recipes[0]["spread_extra"] and "server_chunk" not in recipes[0]["spread_extra"]
    # bytes of each sync: the ledger's steps with a sync, against the formula
    numel = sum(p.numel() for p in _model().parameters())
    cb = _chunk_bytes("sign", math.ceil(numel / WORLD))
    sync_sent = [s for s in recipes[0]["steps_sent"] if s]
    assert len(sync_sent) == RECIPE_STEPS // RECIPE_H
    assert set(sync_sent) == {(WORLD - 1) * (cb + 1) + cb}
    assert {s for s in recipes[0]["steps_received"] if s} == {(WORLD - 1) * (cb + 1) + (WORLD - 1) * cb}
    assert "outer_sparse_all_gather" not in recipes[0]["by_op"]


def test_exchange_is_chosen_where_it_sends_fewer_bytes_and_refused_by_name():
    codec = DCTDiLoCoSettings.from_flat({k: v for k, v in SIGN_OUTER.items() if k != "method"}).codec
    assert [resolve_exchange("auto", codec, n) for n in (1, 2, 3, 8)] == ["all_gather"] * 2 + ["all_reduce"] * 2
    assert resolve_exchange("all_reduce", codec, 2) == "all_reduce"
    assert resolve_exchange("all_gather", codec, 8) == "all_gather"
    sparse = SparseLoCoSettings().codec  # 64 of 4096 kept: not dense
    assert resolve_exchange("auto", sparse, 8) == "all_gather"
    bf16 = DCTDiLoCoSettings.from_flat({"topk": 64, "chunk": 8, "transform": "none", "value_dtype": "bf16"}).codec
    assert resolve_exchange("auto", bf16, 8) == "all_gather"
    with pytest.raises(ConfigError, match=r"lowcomm.exchange must be one of auto, all_gather, all_reduce; got 'ring'"):
        DCTDiLoCoSettings.from_flat({"exchange": "ring"})
    with pytest.raises(ConfigError, match=r"lowcomm.exchange all_reduce needs a dense payload .*got transform 'dct'"):
        DCTDiLoCoSettings.from_flat({"exchange": "all_reduce", "topk": 64, "chunk": 8})
    with pytest.raises(ConfigError, match=r"lowcomm.exchange all_reduce needs a dense payload .*topk 64"):
        SparseLoCoSettings.from_flat({"exchange": "all_reduce"})
    from ds_lowcomm.optim.fault_tolerance import check_method

    check_method({"method": "dct_diloco", "exchange": "all_reduce"})  # each quorum cuts its own chunks
