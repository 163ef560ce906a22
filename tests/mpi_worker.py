"""Run under mpirun by tests/test_mpi.py: the same collectives and trainings over the MPI transport
and over torch.distributed (gloo) in one job, for the same inputs. Writes OUT/rank<r>.json.
``mpi_worker.py OUT cuda`` puts the tensors on the GPU (tests/test_gpu.py): both transports then
stage them through host memory, or MPI reads them in place where it is CUDA-aware."""

import json
import os
import sys

import torch
import torch.distributed as dist

from ds_lowcomm.checkpoint_io import params_digest
from ds_lowcomm.comm import ByteLedger, SparseAllGather, TorchDistTransport, all_reduce_mean_
from ds_lowcomm.comm.mpi import MPITransport, cuda_aware, finalize_if_used
from ds_lowcomm.config import LowcommConfig
from ds_lowcomm.deepspeed.launcher import mpi_environment
from ds_lowcomm.optim import build_optimizer

SHAPES = [(64, 128), (128,), (16, 3, 5, 5), (100, 30)]
METHODS = {
    "adamw": {"method": "adamw"},
    "demo": {"method": "demo", "topk": 4, "chunk": 8, "decay": 0.9, "value_dtype": "int8"},
    "diloco": {"method": "diloco", "sync_every": 3},
    "dct_diloco": {"method": "dct_diloco", "sync_every": 3, "topk": 8, "chunk": 8, "value_dtype": "bf16"},
    "sparseloco": {"method": "sparseloco", "sync_every": 3, "topk": 8, "chunk": 8},
    "mtdao": {"method": "mtdao", "sync_every": 3, "sync_codec": "topk", "topk": 8, "chunk": 8},
    "dct_diloco_streaming": {"method": "dct_diloco", "sync_every": 4, "fragments": 2, "sync_delay": 1, "topk": 8,
                             "chunk": 8},
}


def _ops(ledger):
    return {op: [row[1], row[2]] for op, row in ledger.by_op.items()}


def sparse_equal(rank, device):
    out = {}
    for value_dtype in ("fp32", "bf16", "int8", "2bit"):
        for average in ("senders", "world"):
            torch.manual_seed(100 * rank + 7)
            buffers = [torch.randn(s).to(device) for s in SHAPES]
            results = []
            for transport in (TorchDistTransport(ledger=ByteLedger()), MPITransport(ledger=ByteLedger())):
                mine = [b.clone() for b in buffers]
                sync = SparseAllGather(SHAPES, chunk=16, topk=8, value_dtype=value_dtype, transport=transport,
                                       average=average)
                results.append((sync.exchange(mine), mine, _ops(transport.ledger)))
            (m1, r1, l1), (m2, r2, l2) = results
            out[f"{value_dtype}/{average}"] = {
                "means_equal": all(torch.equal(a, b) for a, b in zip(m1, m2)),
                "residuals_equal": all(torch.equal(a, b) for a, b in zip(r1, r2)),
                "ledgers_equal": l1 == l2,
            }
    return out


def dense_equal(rank):
    torch.manual_seed(rank)
    tensors = [torch.randn(1000), torch.randn(30, 7), torch.randn(50).bfloat16()]
    a = [t.clone() for t in tensors]
    b = [t.clone() for t in tensors]
    all_reduce_mean_(a, TorchDistTransport())
    all_reduce_mean_(b, MPITransport())
    return {"bit_identical": all(torch.equal(x, y) for x, y in zip(a[:2], b[:2])),
            "max_abs_diff": max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))}


def non_blocking(rank, world):
    """Three collectives in flight before any wait; waited in reverse order."""
    mpi = MPITransport()
    x1 = torch.full((5,), rank, dtype=torch.uint8)
    y = torch.full((4,), float(rank + 1))
    x2 = torch.arange(3, dtype=torch.uint8) + 10 * rank
    p1, p2, p3 = mpi.start_all_gather_bytes(x1), mpi.start_all_reduce_sum_(y), mpi.start_all_gather_bytes(x2)
    g2, s, g1 = p3.wait(), p2.wait(), p1.wait()
    return (g1.tolist() == [[r] * 5 for r in range(world)]
            and s.tolist() == [world * (world + 1) / 2] * 4
            and g2.tolist() == [[10 * r, 10 * r + 1, 10 * r + 2] for r in range(world)])


def broadcasts(rank):
    """A broadcast of every float format from rank 1 lands bit for bit (half precision goes as bytes)."""
    mpi = MPITransport()
    ok = True
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.linspace(-1, 1, 7).to(dtype) * (rank + 1)
        mpi.broadcast_(x, src=1)
        ok &= torch.equal(x, torch.linspace(-1, 1, 7).to(dtype) * 2)
    return bool(ok)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def train(rank, lowcomm, transport, device):
    model = _model().to(device)
    opt = build_optimizer(LowcommConfig.from_dict(lowcomm), model.parameters(), lr=0.01, transport=transport)
    for step in range(8):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
        opt.zero_grad()
    params = [p.detach().cpu() for p in model.parameters()]
    digest = params_digest(params)
    return digest, params, opt.ledger.sent


def trainings(rank, device):
    out = {}
    for name, lowcomm in METHODS.items():
        d1, p1, s1 = train(rank, lowcomm, TorchDistTransport(), device)
        d2, p2, s2 = train(rank, {**lowcomm, "transport": "mpi"}, MPITransport(), device)
        out[name] = {"bit_identical": d1 == d2, "bytes_equal": s1 == s2,
                     "max_abs_diff": max((a - b).abs().max().item() for a, b in zip(p1, p2))}
    return out


def main(out_dir, device="cpu"):
    mpi_environment()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result = {"rank": rank, "world": world, "mpi_rank": MPITransport().rank, "sparse": sparse_equal(rank, device),
              "dense": dense_equal(rank), "non_blocking": non_blocking(rank, world), "broadcasts": broadcasts(rank), "train": trainings(rank, device),
              "cuda_aware": cuda_aware()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    finalize_if_used()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
