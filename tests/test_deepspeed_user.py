"""A user's own script through ds_lowcomm.deepspeed.initialize, next to plain deepspeed.initialize:
its own model and Dataset (training_data=), gradient accumulation, two parameter groups, ranks
seeded differently. Real processes, gloo."""

import os
import re

import pytest
import torch

from ds_lowcomm.config import ConfigError
from lowcomm_task.workers import run_local_workers

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
    try:
        dl.initialize(model=make_model(0), config=config(lowcomm, train_batch_size=8 * 2 * world + 2))
        out["error"] = None
    except ConfigError as err:
        out["error"] = str(err)
    dist.barrier()
    return out


# 2 ranks x replica_size 1 is run under the deepspeed launcher by examples/deepspeed_user.py (test_deepspeed.py)
@pytest.mark.parametrize("world,replica_size", [(4, 2)])
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
        assert r["error"] is not None and f"train_batch_size {8 * 2 * world + 2}" in r["error"], r["error"]
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
    """The fields of ReplicaTopology that the batch arithmetic reads (no process groups needed)."""

    def __init__(self, world, replica_size):
        self.world_size, self.replica_size, self.num_replicas = world, replica_size, world // replica_size
        self.data_world, self.data_per_replica = world, replica_size


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


def _traffic_and_batch_worker(rank, world):
    import deepspeed
    import deepspeed.comm as ds_comm

    import ds_lowcomm.deepspeed as dl

    out = {}
    data = Numbered()

    # (1, 2) adamw across 2 replicas of one rank: the user's own deepspeed.comm call, per-step figures
    model = make_model(0)
    model[0].bias.requires_grad_(False)  # frozen: not part of the dense all-reduce
    engine, _, _, _ = dl.initialize(model=model, config=config({"method": "adamw", "replica_size": 1}))
    run = engine.lowcomm
    out["engine_ops_at_start"] = dict(run.engine_ledger.by_op)
    ledgers_at_start = run.ledger.sent + run.engine_ledger.sent
    it = iter(torch.utils.data.DataLoader(data, batch_size=8))
    for micro in range(3 * 2):  # 3 optimizer steps of 2 micro batches
        _, x, y = next(it)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        if micro == 2:  # mid-step, as a user's logging all-reduce would be
            engine_before = (run.engine_ledger.calls, run.engine_ledger.sent)
            user_tensor = torch.ones(1000)  # 4000 bytes
            ds_comm.all_reduce(user_tensor)
            out["user_all_reduce_value"] = user_tensor[0].item()
            out["engine_untouched_by_user_call"] = (run.engine_ledger.calls, run.engine_ledger.sent) == engine_before
        engine.step()
    sent_in_training = run.ledger.sent + run.engine_ledger.sent - ledgers_at_start
    out["independent_ratio"] = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad) / (sent_in_training / 3)
    out["summary"] = run.summary()

    # (4) DeepSpeed keeps the replica mpu process-wide: a later plain engine takes a replica as its
    # data-parallel world (documented in the README). Its own backward's collectives are DeepSpeed's.
    plain, _, _, _ = deepspeed.initialize(model=make_model(0), config=config(gradient_accumulation_steps=1))
    out["plain_after_dp_world_size"] = plain.dp_world_size
    user_calls, engine_calls = run.user_ledger.calls, run.engine_ledger.calls
    _, x, y = next(it)
    plain.backward(torch.nn.functional.mse_loss(plain(x), y))  # a boundary: DeepSpeed's gradient all-reduce
    out["plain_backward_calls"] = (run.user_ledger.calls - user_calls, run.engine_ledger.calls - engine_calls)

    # (3) set_train_batch_size and deepspeed_io over every rank of every replica
    engine, _, loader, _ = dl.initialize(model=make_model(0), config=config({"method": "adamw", "replica_size": 1}),
                                         training_data=data)
    out["io_batches"] = first_batches(engine.deepspeed_io(data))
    out["loader_batches"] = first_batches(loader)
    engine.set_train_batch_size(8 * 4 * world)  # accumulation 4, as plain DeepSpeed over `world` ranks
    out["after_set"] = (engine.train_batch_size(), engine.gradient_accumulation_steps())
    boundaries = []
    it = iter(loader)
    for _ in range(4):
        _, x, y = next(it)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        boundaries.append(engine.is_gradient_accumulation_boundary())
        engine.step()
    out["boundaries"] = boundaries
    out["after_4_micro"] = (engine.lowcomm.ledger.steps, engine.global_samples)
    try:
        engine.set_train_batch_size(8 * 2 * world + 8)
        out["set_error"] = None
    except ConfigError as err:
        out["set_error"] = str(err)
    out["after_refusal"] = (engine.train_batch_size(), engine.gradient_accumulation_steps())
    return out


def test_user_traffic_summary_and_batch_size():
    world = 2
    results = run_local_workers(_traffic_and_batch_worker, world)
    for rank, r in enumerate(results):
        s = r["summary"]
        # (1) the user's all-reduce lands in the user ledger with its bytes, not in DeepSpeed's
        assert r["user_all_reduce_value"] == world
        assert s["user_ledger"]["by_op"] == {"user.all_reduce": {"calls": 1, "sent": 4000, "received": 4000}}
        assert (s["user_bytes_sent"], s["user_bytes_received"]) == (4000, 4000)
        assert r["engine_untouched_by_user_call"]
        assert not any(op.startswith("user.") for op in s["engine_ledger"]["by_op"])
        assert s["engine_bytes_sent"] == s["engine_ledger"]["bytes_sent"]
        assert s["bytes_sent"] == s["cross_replica_bytes_sent"] + s["engine_bytes_sent"]
        # DeepSpeed's own start-up collectives (called from its engine) stay the engine's
        assert any(op.startswith("deepspeed.") for op in r["engine_ops_at_start"]), r["engine_ops_at_start"]
        # ... and so do those of a user's plain_engine.backward
        user_calls, engine_calls = r["plain_backward_calls"]
        assert user_calls == 0 and engine_calls > 0, r["plain_backward_calls"]
        # (2) per step: adamw all-reduces the trainable gradients once per optimizer step, dense fp32
        trainable = 8 * 16 + 16 * 1 + 1  # first layer's weight, second layer; the first bias is frozen
        assert s["steps"] == 3
        assert s["dense_allreduce_bytes_per_step"] == 4 * trainable
        assert s["cross_replica_bytes_sent_per_step"] == 4 * trainable + 1  # + the health flag byte
        assert s["engine_bytes_sent_per_step"] == 0  # replica of one rank: DeepSpeed moves no byte
        assert s["compression_vs_allreduce"] == pytest.approx(r["independent_ratio"]) \
            == pytest.approx(4 * trainable / (4 * trainable + 1))
        assert s["method_seconds"]["comm"] > 0 and s["engine_comm_seconds"] >= 0
        # (4) documented: a plain engine built after ours sees one replica as its data-parallel world
        assert r["plain_after_dp_world_size"] == 1
        # (3) set_train_batch_size counts every replica; accumulation as plain DeepSpeed over the world
        assert r["after_set"] == (8 * 4 * world, 4)
        assert r["boundaries"] == [False, False, False, True]
        assert r["after_4_micro"] == (1, 8 * 4 * world)
        assert r["set_error"] is not None and "train_batch_size" in r["set_error"], r["set_error"]
        assert f"set_train_batch_size({8 * 2 * world + 8})" in r["set_error"] and "= 16" in r["set_error"]
        assert r["after_refusal"] == r["after_set"]
        # deepspeed_io by the user: DeepSpeed's loader over every rank, the same as training_data='s
        assert r["io_batches"] == r["loader_batches"]
    shards = [i for r in results for b in r["io_batches"] for i in b]
    assert len(shards) == world * 2 * 8 and len(set(shards)) == len(shards)  # distinct shards per rank
