"""The compressed collectives in 2 and 4 real gloo processes, against dense all-reduce references."""

import pytest
import torch
import torch.distributed as dist

from ds_lowcomm.checkpoint_io import params_digest
from ds_lowcomm.codec import SparseSpec
from ds_lowcomm.codec.dct import dct_decode, dct_encode
from ds_lowcomm.comm import SparseAllGather, TorchDistTransport, all_reduce_mean_
from lowcomm_task.workers import run_local_workers

SHAPES = [(64, 128), (128,), (16, 3, 5, 5), (100, 30)]


def _local_sparse_coeffs(x, spec):
    """This rank's kept coefficients as a dense tensor, written independently of the codec's packing."""
    coeffs = dct_encode(x, spec.plan)
    idx = coeffs.abs().topk(spec.k, dim=-1).indices
    return torch.zeros_like(coeffs).scatter_(-1, idx, coeffs.gather(-1, idx))


def _sparse_vs_dense_worker(rank, world, average):
    torch.manual_seed(100 + rank)
    transport = TorchDistTransport()
    sync = SparseAllGather(SHAPES, chunk=16, topk=32, value_dtype="fp32", transport=transport, average=average)
    buffers = [torch.randn(s) for s in SHAPES]
    originals = [b.clone() for b in buffers]
    means = sync.exchange(buffers)

    out = {"max_err": 0.0, "ef_err": 0.0}
    for spec, mean, orig, buf in zip(sync.specs, means, originals, buffers):
        local = _local_sparse_coeffs(orig, spec)
        total, count = local.clone(), (local != 0).float()
        dist.all_reduce(total)
        dist.all_reduce(count)
        ref = total / world if average == "world" else total / count.clamp(min=1)
        out["max_err"] = max(out["max_err"], (mean - dct_decode(ref, spec.plan)).abs().max().item())
        # Error feedback: what stays in the buffer is the original minus what was sent.
        out["ef_err"] = max(out["ef_err"], (buf - (orig - dct_decode(local, spec.plan))).abs().max().item())
    out["digest"] = params_digest(means)
    by_op = transport.ledger.by_op["sparse_all_gather"]
    out["ledger"] = {"calls": by_op[0], "sent": by_op[1], "received": by_op[2]}
    out["payload"] = sync.payload_bytes
    out["spec_bytes"] = sum(s.nbytes for s in sync.specs)
    return out


def _cases_worker(rank, world):
    """Both averages (and, at 2 ranks, the dense mean) in one launch per world size."""
    out = {average: _sparse_vs_dense_worker(rank, world, average) for average in ("world", "senders")}
    if world == 2:
        out["dense"] = _dense_worker(rank, world)
    return out


@pytest.fixture(scope="module")
def launches():
    """world size -> case -> the per-rank results, each world size launched once, when first asked for."""
    done = {}

    def get(world, case):
        if world not in done:
            done[world] = run_local_workers(_cases_worker, world)
        return [r[case] for r in done[world]]

    return get


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("average", ["world", "senders"])
def test_sparse_all_gather_equals_dense_all_reduce(world, average, launches):
    results = launches(world, average)
    for r in results:
        assert r["max_err"] < 1e-5
        assert r["ef_err"] < 1e-5
        # Ledger: one collective, bytes equal to the packed payload, (n-1) payloads received.
        assert r["ledger"] == {"calls": 1, "sent": r["payload"], "received": (world - 1) * r["payload"]}
        assert r["payload"] == r["spec_bytes"] + 1  # + the health flag byte
    assert len({r["digest"] for r in results}) == 1  # bit-identical on every rank


def test_payload_size_by_hand():
    # 64x128 fp32, chunk 16 -> 32 blocks of 256 coefficients, topk 32 of 256 -> 32 kept per block
    # (topk/chunk**2 = 1/8 density); indices fit one byte (256 positions); values 4 bytes.
    spec = SparseSpec.build((64, 128), chunk=16, topk=32, value_dtype="fp32")
    assert spec.nbytes == 32 * 32 * (1 + 4)


def _dense_worker(rank, world):
    transport = TorchDistTransport()
    tensors = [torch.full((3, 4), float(rank)), torch.arange(5.0) * (rank + 1), torch.ones(2, dtype=torch.float64) * rank]
    all_reduce_mean_(tensors, transport)
    return [t.tolist() for t in tensors], transport.ledger.summary()["by_op"]


def test_dense_all_reduce_mean(launches):
    (r0, ledger), (r1, _) = launches(2, "dense")
    assert r0 == r1
    assert r0[0] == [[0.5] * 4] * 3
    assert r0[1] == [0.0, 1.5, 3.0, 4.5, 6.0]
    assert r0[2] == [0.5, 0.5]
    # One flat buffer per dtype: fp32 (12 + 5 floats) and fp64 (2 doubles).
    assert ledger["all_reduce"] == {"calls": 2, "sent": 17 * 4 + 2 * 8, "received": 17 * 4 + 2 * 8}


def _stalled_peer_worker(rank, world):
    import time

    from ds_lowcomm.comm import CollectiveError, ReplicaTopology

    topology = ReplicaTopology.build(1, timeout_s=3.0)  # two replicas of one rank: the cross group is both
    transport = TorchDistTransport(topology.cross_group)
    if rank == 1:
        time.sleep(12)  # stalled (a kill -STOP, a hung data loader) past the other rank's timeout
    start = time.perf_counter()
    try:
        transport.all_gather_bytes(torch.zeros(16, dtype=torch.uint8), op="sparse_all_gather")
        return {"error": None}
    except CollectiveError as err:
        return {"error": str(err), "waited": time.perf_counter() - start}


def test_a_stalled_peer_fails_the_collective_within_the_timeout():
    """lowcomm.timeout_s reaches the groups ds_lowcomm creates: the waiting rank fails after about
    3 s (torch's default would wait 30 minutes), naming the operation and the group's ranks."""
    waiting, stalled = run_local_workers(_stalled_peer_worker, 2)
    assert waiting["error"] is not None and 2.5 < waiting["waited"] < 10, waiting
    assert "sparse_all_gather" in waiting["error"] and "[0, 1]" in waiting["error"], waiting["error"]
    assert stalled["error"] is not None  # its peer has given up: it fails too instead of hanging
