"""Cross-replica syncs matched by parameter name (comm/routes.py), 4 real processes.

Replica 0 is rank 0 with every parameter whole; replica 1 is ranks 1-2 as two "stages" (the
tied parameter on both); replica 2 is rank 3 with its parameters in one flat tensor, one of them
cut in two by a partition edge, with padding between pieces. References are computed in one
process on each segment from every replica's values: a weighted mean, and SparseSpec's own
compress/decompress of the three replicas' segments.
"""

import pytest
import torch

from ds_lowcomm.codec import SparseSpec
from ds_lowcomm.comm import Piece, Routes
from ds_lowcomm.comm.routes import whole
from ds_lowcomm.settings import ConfigError
from lowcomm_task.workers import run_local_workers

SHAPES = {"a": (8, 16), "b": (32,), "tied": (4, 8), "c": (16, 16)}
REPLICAS = [[0], [1, 2], [3]]
WEIGHTS = [1.0, 2.0, 3.0]
CUT = 100  # replica 2 holds c[:CUT] and c[CUT:] as separate 1-D pieces


def _value(replica, name):
    g = torch.Generator().manual_seed(1000 * replica + sum(map(ord, name)))
    return torch.randn(SHAPES[name], generator=g)


def _holdings(rank):
    """(tensors, pieces per tensor) of this rank, filled with its replica's values."""
    if rank == 0:
        names = ["a", "b", "tied", "c"]
    elif rank in (1, 2):
        names = ["a", "tied"] if rank == 1 else ["tied", "b", "c"]
    else:  # one flat tensor: a, 2 padding, c[CUT:], b, c[:CUT], tied, 3 padding
        replica = 2
        parts, pieces, at = [], [], 0

        def put(name, start, length):
            nonlocal at
            parts.append(_value(replica, name).reshape(-1)[start : start + length])
            pieces.append(Piece(name, SHAPES[name], start, length, at))
            at += length

        def pad(n):
            nonlocal at
            parts.append(torch.full((n,), 7.0))
            at += n

        put("a", 0, 128), pad(2), put("c", CUT, 256 - CUT), put("b", 0, 32), put("c", 0, CUT), put("tied", 0, 32), pad(3)
        return [torch.cat(parts)], [pieces]
    replica = 0 if rank == 0 else 1
    return [_value(replica, n) for n in names], [[whole(n, SHAPES[n])] for n in names]


def _segments(name):
    return [(0, CUT), (CUT, 256)] if name == "c" else [(0, torch.Size(SHAPES[name]).numel())]


def _reference(name, start, end, fn):
    """fn(list of the replicas' segment values) for one segment."""
    return fn([_value(k, name).reshape(-1)[start:end] for k in range(3)])


def _per_element(rank, pieces_list, fn):
    """The reference for every element this rank holds (padding: None)."""
    out = []
    for pieces in pieces_list:
        table = {}
        for p in pieces:
            for lo, hi in _segments(p.name):
                if lo >= p.start and hi <= p.start + p.length:
                    table[(p.offset + lo - p.start, hi - lo)] = _reference(p.name, lo, hi, fn)
        out.append(table)
    return out


def _routes_worker(rank, world):
    tensors, pieces = _holdings(rank)
    numels = [t.numel() for t in tensors]
    routes = Routes.build(pieces, numels, REPLICAS, WEIGHTS, timeout_s=60)
    out = {"routes": [r.ranks for r in routes.routes]}

    # Dense weighted mean, in place; padding untouched.
    dense = [t.clone() for t in tensors]
    routes.start_all_reduce_mean_(dense).wait()
    ref = _per_element(rank, pieces, lambda xs: sum(w * x for w, x in zip(WEIGHTS, xs)) / sum(WEIGHTS))
    out["dense_err"] = max((dense[i].view(-1)[o : o + n] - r).abs().max().item()
                           for i, table in enumerate(ref) for (o, n), r in table.items())
    if rank == 3:
        out["padding"] = [dense[0][128:130].tolist(), dense[0][-3:].tolist()]

    # Sparse: each segment coded with its own spec (whole shape, or 1-D where cut), weighted mean.
    codec = dict(chunk=8, topk=3, value_dtype="fp32", average="senders")
    sync = routes.sparse_all_gather(**codec)
    bufs = [t.clone() for t in tensors]
    means = sync.exchange(bufs)

    errs, ef_errs = [], []
    for i, p_list in enumerate(pieces):
        for p in p_list:
            for lo, hi in _segments(p.name):
                if not (lo >= p.start and hi <= p.start + p.length):
                    continue
                cut = (lo, hi) != (0, torch.Size(SHAPES[p.name]).numel())
                shape = (hi - lo,) if cut else SHAPES[p.name]
                spec = SparseSpec.build(shape, chunk=8, topk=3, value_dtype="fp32", transform="dct")
                xs = [_value(k, p.name).reshape(-1)[lo:hi].reshape(shape) for k in range(3)]
                rows = torch.stack([spec.compress(x)[0] for x in xs])
                expect = spec.decompress_mean(rows, "senders", WEIGHTS).reshape(-1)
                sent_mine = spec.compress(xs[0 if rank == 0 else 1 if rank in (1, 2) else 2])[1].reshape(-1)
                at = p.offset + lo - p.start
                errs.append((means[i].view(-1)[at : at + hi - lo] - expect).abs().max().item())
                orig = tensors[i].view(-1)[at : at + hi - lo]
                ef_errs.append((bufs[i].view(-1)[at : at + hi - lo] - (orig - sent_mine)).abs().max().item())
    out["sparse_err"], out["ef_err"] = max(errs), max(ef_errs)
    if rank == 3:
        out["sparse_padding"] = [means[0][128:130].tolist(), means[0][-3:].tolist()]
    out["sent"] = routes.ledger.summary()["bytes_sent"]
    out["payload"] = sync.payload_bytes

    # Broadcast: every holder takes the lowest holder's values (replica 0's).
    bc = [t.clone() for t in tensors]
    routes.broadcast_(bc)
    ref0 = _per_element(rank, pieces, lambda xs: xs[0])
    out["broadcast_err"] = max((bc[i].view(-1)[o : o + n] - r).abs().max().item()
                               for i, table in enumerate(ref0) for (o, n), r in table.items())
    routes.check_same({"method": "x"}, bc)  # same values along every route after the broadcast
    try:
        routes.check_same({"method": "x"}, tensors)
        out["check_caught"] = False
    except ValueError:
        out["check_caught"] = True

    # A parameter replica 1 lacks: the same clear error on every rank, before any group is made.
    missing = [list(p) for p in pieces]
    if rank in (1, 2):
        missing = [[p for p in ps if p.name != "b"] for ps in pieces]
    try:
        Routes.build(missing, numels, REPLICAS, WEIGHTS)
        out["missing"] = None
    except ConfigError as err:
        out["missing"] = str(err)
    return out


def test_routes_match_parameters_by_name_across_replica_shapes():
    results = run_local_workers(_routes_worker, 4)
    for rank, r in enumerate(results):
        assert r["dense_err"] < 1e-5, (rank, r["dense_err"])
        assert r["sparse_err"] < 1e-5, (rank, r["sparse_err"])
        assert r["ef_err"] < 1e-5, (rank, r["ef_err"])
        assert r["broadcast_err"] == 0.0
        assert r["sent"] >= r["payload"] > 0
        assert r["check_caught"]  # before the broadcast every route starts from unequal values
        assert "'b'" in r["missing"] and "replica 1" in r["missing"] and "no counterpart" in r["missing"]
    assert results[3]["padding"] == [[7.0, 7.0], [7.0, 7.0, 7.0]]  # dense: padding left alone
    assert results[3]["sparse_padding"] == [[0.0, 0.0], [0.0, 0.0, 0.0]]  # sparse: padding has no mean
    # Ranks 1 and 2 share the tied parameter's route with 0 and 3; every rank is in a route with 0.
    assert all(0 in ranks for r in results for ranks in r["routes"])
    assert (0, 1, 2, 3) in results[1]["routes"] and (0, 1, 2, 3) in results[2]["routes"]
