"""Every method inside DeepSpeed's ZeRO optimizers, from a user's own script: parameters whose
gradient is zero stay exactly where they are at every stage (transform blocks never span two
parameters of a flat partition), one exchange per sync over all parameter groups, and ZeRO 3
inside replicas trains and resumes exactly. Real processes, real DeepSpeed engines, gloo."""

import os

import pytest
import torch

from lowcomm_task.workers import run_local_workers

os.environ.setdefault("DS_ACCELERATOR", "cpu")

METHODS = {
    "adamw": {"method": "adamw"},
    "demo": {"method": "demo", "topk": 4, "chunk": 8, "decay": 0.9},
    "diloco": {"method": "diloco", "sync_every": 3},
    "dct_diloco": {"method": "dct_diloco", "sync_every": 3, "topk": 8, "chunk": 8, "average": "world"},
    # one sign bit an element through the compressed all-reduce (each piece of a partition its own scale)
    "dct_diloco_all_reduce": {"method": "dct_diloco", "sync_every": 3, "topk": 64, "chunk": 8, "transform": "none",
                              "value_dtype": "sign", "average": "world", "exchange": "all_reduce"},
    "sparseloco": {"method": "sparseloco", "sync_every": 3, "topk": 8, "chunk": 64},
    "mtdao": {"method": "mtdao", "sync_every": 3, "sync_codec": "topk", "topk": 8, "chunk": 8},
}
STEPS = 6  # two outer intervals of 3


class Net(torch.nn.Module):
    """A small MLP with a trainable parameter whose gradient is exactly zero (it enters the loss
    times 0), placed between two used ones so a flat partition has it in its middle, and a frozen
    one (requires_grad=False, in the decayed group, as ``model.parameters()`` would pass it)."""

    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Parameter(torch.eye(8) * 2.0, requires_grad=False)
        self.inp = torch.nn.Linear(8, 24)
        self.idle = torch.nn.Parameter(torch.full((24, 24), 1.0))
        self.out = torch.nn.Linear(24, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x @ self.frozen))) + 0.0 * self.idle.sum()


def _config(method, stage, replica_size):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
            "zero_optimization": {"stage": stage}, "lowcomm": {**METHODS[method], "replica_size": replica_size}}


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 8, generator=g)
    return x, 0.5 * x.sum(dim=1, keepdim=True)


def _engine(method, stage, replica_size):
    import ds_lowcomm.deepspeed as dl

    torch.manual_seed(0)
    model = Net()
    groups = [{"params": [model.frozen, *model.inp.parameters()]},  # decayed
              {"params": [model.idle, *model.out.parameters()], "weight_decay": 0.0}]
    engine, *_ = dl.initialize(model=model, model_parameters=groups, config=_config(method, stage, replica_size))
    return engine


def _full_params(engine, stage):
    """Every parameter by name, whole (gathered from the replica's partitions at ZeRO 3), as fp32 copies."""
    import deepspeed

    named = dict(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(named.values())):
            return {n: p.detach().float().clone() for n, p in named.items()}
    return {n: p.detach().float().clone() for n, p in named.items()}


def _train(engine, rank, steps):
    for step in steps:
        x, y = _batch(rank, step)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def _frozen_worker(rank, world, stages, replica_size):
    import torch.distributed as dist

    out = {}
    for stage in stages:
        for method in METHODS:
            engine = _engine(method, stage, replica_size)
            before = _full_params(engine, stage)
            _train(engine, rank, range(STEPS))
            after = _full_params(engine, stage)
            ops = engine.lowcomm.ledger.by_op
            out[(stage, method)] = {
                "frozen_unchanged": torch.equal(before["frozen"], after["frozen"]),
                "idle_unchanged": torch.equal(before["idle"], after["idle"]),
                "idle_max_move": (after["idle"] - before["idle"]).abs().max().item(),
                # (a one-element bias under demo's sign steps may come back to where it was)
                "unmoved": [n for n in ("inp.weight", "out.weight") if torch.equal(before[n], after[n])],
                "params": after,
                # one compressed (or dense) exchange per sync, however many parameter groups
                "calls": {op: row[0] for op, row in ops.items() if op != "setup"},
            }
            dist.barrier()
    return out


# Compressed exchanges per run of 6 steps: demo every step; the outer methods at steps 3 and 6.
EXPECTED_CALLS = {"adamw": ("all_reduce", 6), "demo": ("sparse_all_gather", 6), "diloco": ("outer_all_reduce", 2),
                  "dct_diloco": ("outer_sparse_all_gather", 2), "sparseloco": ("outer_sparse_all_gather", 2),
                  "dct_diloco_all_reduce": ("outer_compressed_all_reduce_scatter", 2),
                  "mtdao": ("mtdao_sparse_all_gather", 2)}


def _check_frozen(results, world):
    for key, r in results[0].items():
        for rank in range(world):
            mine = results[rank][key]
            assert mine["idle_unchanged"], (key, rank, mine["idle_max_move"])
            assert mine["frozen_unchanged"], (key, rank)
            assert not mine["unmoved"], (key, mine["unmoved"])
            # every rank of every replica holds the same model after the last sync
            assert all(torch.equal(mine["params"][n], r["params"][n]) for n in r["params"]), (key, rank)
        op, calls = EXPECTED_CALLS[key[1]]
        assert r["calls"].get(op) == calls, (key, r["calls"])


def test_zero_gradient_parameters_stay_put_at_every_stage():
    """One rank per replica: the partition is the whole group, so only block boundaries matter."""
    _check_frozen(run_local_workers(_frozen_worker, 2, (0, 1, 2, 3), 1), 2)


def _four_rank_worker(rank, world, workdir):
    """One launch of 4 processes for both 4-rank tests below (a launch costs more than the runs)."""
    return {"frozen": _frozen_worker(rank, world, (1, 2, 3), 2), "resume": _resume_worker(rank, world, workdir)}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    results = run_local_workers(_four_rank_worker, 4, str(tmp_path_factory.mktemp("zero3")))
    return {key: [r[key] for r in results] for key in ("frozen", "resume")}


def test_zero_gradient_parameters_stay_put_inside_replicas(four_ranks):
    """Two ranks per replica, ZeRO 1/2/3: partition edges cut parameters too."""
    _check_frozen(four_ranks["frozen"], 4)


def _resume_worker(rank, world, workdir):
    import torch.distributed as dist
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    out = {}
    for method in METHODS:
        ckpt = os.path.join(workdir, method)
        full = _engine(method, 3, 2)
        _train(full, rank, range(4))
        full.save_checkpoint(ckpt)  # inside an outer interval of diloco & co (H = 3)
        at_save = _full_params(full, 3)
        if rank == 0:  # DeepSpeed's own tool reads the checkpoint: replica 0's parameters
            fp32 = get_fp32_state_dict_from_zero_checkpoint(ckpt)
            out[f"{method}_zero_to_fp32"] = all(torch.equal(fp32[n], at_save[n]) for n in at_save)
        dist.barrier()
        _train(full, rank, range(4, STEPS))
        resumed = _engine(method, 3, 2)
        resumed.load_checkpoint(ckpt)
        _train(resumed, rank, range(4, STEPS))
        a, b = _full_params(full, 3), _full_params(resumed, 3)
        out[method] = {
            "exact": all(torch.equal(a[n], b[n]) for n in a),
            "bytes": (full.lowcomm.ledger.sent, resumed.lowcomm.ledger.sent),
            "loss_fell": _loss(full, rank) < _loss(_engine(method, 3, 2), rank),
            "params": a,
        }
    return out


def _loss(engine, rank):
    x, y = _batch(rank, 999)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(engine(x), y).item()


def test_every_method_at_zero3_with_replicas_resumes_exactly(four_ranks):
    """2 replicas x 2 ranks at ZeRO 3: each rank's method runs on its own partitions and syncs them
    with the matching partitions of the other replica; a resume mid-interval is exact."""
    results = four_ranks["resume"]
    for method in METHODS:
        for rank in range(4):
            r = results[rank][method]
            assert r["exact"], (method, rank)
            assert r["bytes"][0] == r["bytes"][1], (method, rank)  # the ledger resumes too
            assert r["loss_fell"], (method, rank)
            assert all(torch.equal(r["params"][n], results[0][method]["params"][n]) for n in r["params"]), method
        assert results[0][f"{method}_zero_to_fp32"], method
