"""A user's own script through ds_lowcomm.deepspeed.initialize, next to plain deepspeed.initialize:
its own model and Dataset (training_data=), gradient accumulation, two parameter groups, ranks
seeded differently. Real processes, gloo."""

import os
import re

import pytest
import torch

from ds_lowcomm.config import ConfigError
from ds_lowcomm.workers import run_local_workers

os.environ.setdefault("DS_ACCELERATOR", "cpu")


class Numbered(torch.utils.data.Dataset):
    """Sample i: (i, x, y) with y a fixed linear function of x, so that the index names the sample."""

    def __init__(self, n=256):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return i, self.x[i], self.y[i]


def make_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def config(lowcomm=None, **batch):
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}}, **batch}
    if lowcomm is not None:
        cfg["lowcomm"] = lowcomm
    return {k: v for k, v in cfg.items() if v is not None}


def first_batches(loader, n=2):
    it = iter(loader)
    return [next(it)[0].tolist() for _ in range(n)]


def _user_worker(rank, world, replica_size):
    import deepspeed
    import torch.distributed as dist

    import ds_lowcomm.deepspeed as dl

    out = {}
    data = Numbered()
    batch = {"train_batch_size": 8 * 2 * world}

    # plain DeepSpeed over the whole world, for reference
    plain_model = make_model(0)
    engine, _, loader, _ = deepspeed.initialize(model=plain_model, config=config(**batch), training_data=data)
    out["plain_batches"] = first_batches(loader)
    out["plain_train_batch_size"] = engine.train_batch_size()
    it = iter(loader)
    for _ in range(2):  # one optimizer step of 2 micro batches
        _, x, y = next(it)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    out["plain_global_samples"] = engine.global_samples

    # ds_lowcomm, ranks seeded differently, two parameter groups
    model = make_model(100 + rank)
    rank0 = [p.detach().clone() for p in make_model(100).parameters()]
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "weight_decay": 0.0}]
    lowcomm = {"method": "diloco", "sync_every": 1, "replica_size": replica_size}
    engine, _, loader, _ = dl.initialize(model=model, model_parameters=groups, config=config(lowcomm, **batch),
                                         training_data=data)
    out["start_is_rank0"] = all(torch.equal(p, q) for p, q in zip(engine.module.parameters(), rank0))
    out["loader_is_engine's"] = loader is engine.training_dataloader
    out["batches"] = first_batches(loader)
    out["dp"] = (dl.data_parallel_rank(), dl.data_parallel_world_size())
    out["train_batch_size"] = engine.train_batch_size()
    setup = engine.lowcomm.engine_ledger.by_op["setup"]
    out["setup_bytes"] = setup[1] + setup[2]
    losses = []
    it = iter(loader)
    for step in range(3 * 2):  # 3 optimizer steps of 2 micro batches (a DiLoCo sync every step)
        _, x, y = next(it)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == 1:
            out["global_samples_after_one_step"] = engine.global_samples
    out["losses"] = losses
    out["params"] = [p.detach().clone() for p in engine.module.parameters()]
    out["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())

    # A train_batch_size that the world does not divide into is refused, naming the fields.
    out["error"] = "not tried"
    if world == 2:
      try:
        dl.initialize(model=make_model(0), config=config(lowcomm, train_batch_size=8 * 2 * world + 2))
        out["error"] = None
      except ConfigError as err:
        out["error"] = str(err)
    dist.barrier()
    return out


@pytest.mark.parametrize("world,replica_size", [(2, 1), (4, 2)])
def test_user_script(world, replica_size):
    results = run_local_workers(_user_worker, world, replica_size)
    for rank, r in enumerate(results):
        # (a) DeepSpeed's loader, sharded over every rank of every replica: what plain DeepSpeed gives
        assert r["loader_is_engine's"]
        assert r["batches"] == r["plain_batches"], rank
        assert all(len(b) == 8 for b in r["batches"])  # micro batch size per rank
        assert r["dp"] == (rank, world)
        # (b) train_batch_size counts every data-parallel rank, as in plain DeepSpeed
        assert r["train_batch_size"] == r["plain_train_batch_size"] == 8 * 2 * world
        assert r["global_samples_after_one_step"] == 8 * 2 * world
        assert r["plain_global_samples"] == 8 * 2 * world
        # (c) differently seeded ranks start from rank 0's weights, counted as start-up traffic
        assert r["start_is_rank0"], rank
        assert r["setup_bytes"] >= r["model_bytes"]
        assert all(torch.isfinite(torch.tensor(r["losses"])))
        # (d) the clear refusal
        if world == 2:
            assert r["error"] is not None and "train_batch_size 34" in r["error"], r["error"]
            assert "train_micro_batch_size_per_gpu 8" in r["error"] and "gradient_accumulation_steps 2" in r["error"]
    first = [tuple(b) for r in results for b in r["batches"][:1]]
    assert len(set(first)) == world, first  # every rank a distinct first batch
    every = [i for r in results for b in r["batches"] for i in b]
    assert len(set(every)) == len(every)  # no sample read twice by two ranks
    # trained and synced: after DiLoCo's syncs all ranks hold the same weights, and the loss fell
    for r in results[1:]:
        assert all(torch.equal(p, q) for p, q in zip(r["params"], results[0]["params"]))
    assert sum(r["losses"][-1] for r in results) < sum(r["losses"][0] for r in results)


class _Topology:
    def __init__(self, world, replica_size):
        self.world_size, self.replica_size, self.num_replicas = world, replica_size, world // replica_size


@pytest.mark.parametrize("batch,message", [
    ({"train_batch_size": 34, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}, "!= 34"),
    ({"train_batch_size": 36, "train_micro_batch_size_per_gpu": 8}, "8 x 2 x 2 = 32 != 36"),
    ({"train_batch_size": 3}, "train_batch_size 3"),
    ({"train_batch_size": 0}, "positive integer"),
    ({"gradient_accumulation_steps": 2}, "train_micro_batch_size_per_gpu is required"),
])
def test_batch_sizes_that_do_not_fit_are_refused(batch, message):
    from ds_lowcomm.deepspeed.data import replica_batch_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        replica_batch_config(dict(batch), _Topology(2, 1))


@pytest.mark.parametrize("batch,world,replica_size,global_batch,deepspeed_sees", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}, 2, 1, 32, 16),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}, 4, 2, 64, 32),  # accumulation 2, derived
    ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 4, 2, 64, 32),  # micro batch 8, derived
    ({"train_batch_size": 8}, 4, 2, 8, 4),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}, 2, 1, 8, None),  # left to DeepSpeed
])
def test_train_batch_size_counts_every_replica(batch, world, replica_size, global_batch, deepspeed_sees):
    from ds_lowcomm.deepspeed.data import replica_batch_config

    ds = dict(batch)
    assert replica_batch_config(ds, _Topology(world, replica_size)) == global_batch
    assert ds.get("train_batch_size") == deepspeed_sees
    assert {k: v for k, v in ds.items() if k != "train_batch_size"} == {k: v for k, v in batch.items() if k != "train_batch_size"}
