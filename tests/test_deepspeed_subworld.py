"""Sub-worlds: one 3-rank job where rank 0 trains a plain DeepSpeed engine (sub-world [0]) while
ranks 1-2 train the same layers as a 2-stage pipeline engine (sub-world [1, 2]). Each group's losses
are bit-identical to the same engine run alone as its own job; the pipeline's checkpoint round trip
works inside its sub-world; DeepSpeed's byte counter composes with the sub-world in either order.
Real processes, real DeepSpeed engines, gloo."""

import os

import torch

from lowcomm_task.workers import run_local_workers

os.environ.setdefault("DS_ACCELERATOR", "cpu")

MICRO, ACCUM, STEPS, SAVE_AT = 4, 2, 4, 2


def layers():
    torch.manual_seed(0)
    return [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)]


def batches(n):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n * MICRO, 8, generator=g)
    y = torch.tanh(x.sum(1, keepdim=True))
    return [(x[i * MICRO:(i + 1) * MICRO], y[i * MICRO:(i + 1) * MICRO]) for i in range(n)]


def config():
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM, "steps_per_print": 10**6,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": 0}}


def _plain(data):
    """Whole model, plain engine; one loss per micro-batch."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=torch.nn.Sequential(*layers()), config=config())
    losses = []
    for x, y in data[:STEPS * ACCUM]:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses}


def _pipe(data, ckpt):
    """2-stage pipeline engine; one loss per train_batch. Saves after SAVE_AT steps, trains on, loads,
    and retrains the same batches: the losses after the load repeat those after the save."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(layers=layers(), num_stages=2, loss_fn=torch.nn.functional.mse_loss,
                            partition_method="uniform")
    engine, *_ = deepspeed.initialize(model=module, config=config(),
                                      model_parameters=[p for p in module.parameters() if p.requires_grad])
    per_step = [iter(data[i * ACCUM:(i + 1) * ACCUM]) for i in range(STEPS)]
    losses = [engine.train_batch(per_step[i]).item() for i in range(SAVE_AT)]
    engine.save_checkpoint(ckpt)
    losses += [engine.train_batch(per_step[i]).item() for i in range(SAVE_AT, STEPS)]
    engine.load_checkpoint(ckpt)
    again = [engine.train_batch(iter(data[i * ACCUM:(i + 1) * ACCUM])).item() for i in range(SAVE_AT, STEPS)]
    return {"losses": losses, "after_load": again, "stage": engine.stage_id, "global_rank": engine.global_rank}


def _worker(rank, world, layout, ckpt):
    import deepspeed
    import deepspeed.comm as ds_dist
    import torch.distributed as dist

    from ds_lowcomm.comm import ByteLedger
    from ds_lowcomm.deepspeed.comm_counter import count_deepspeed_collectives
    from ds_lowcomm.deepspeed.subworld import active_subworld, enter_subworld, to_global

    data = batches(STEPS * ACCUM)
    out = {}
    if layout == "alone":  # the reference: the engine's own job, no sub-world
        deepspeed.init_distributed(dist_backend="gloo")
        out.update(_plain(data) if world == 1 else _pipe(data, ckpt))
        return out

    ranks = [0] if rank == 0 else [1, 2]
    ledger, user_ledger = ByteLedger(), ByteLedger()
    if rank == 0:  # counter first, then the sub-world ...
        deepspeed.init_distributed(dist_backend="gloo")
        count_deepspeed_collectives(ledger, user_ledger)
        enter_subworld(ranks, timeout_s=60)
    else:  # ... and the other way round
        enter_subworld(ranks, timeout_s=60)
        count_deepspeed_collectives(ledger, user_ledger)
    enter_subworld(ranks)  # again: nothing happens
    try:
        enter_subworld([0, 1, 2])
        out["reentry"] = None
    except RuntimeError as err:
        out["reentry"] = str(err)
    deepspeed.init_distributed(dist_backend="gloo")  # a no-op now
    out["view"] = (ds_dist.get_rank(), ds_dist.get_world_size(), active_subworld(),
                   [to_global(r) for r in range(len(ranks))], dist.get_rank(), dist.get_world_size())
    ones = torch.ones(3)
    ds_dist.all_reduce(ones)  # the user's own call: over the sub-world, counted as the user's
    out["user_sum"] = ones.tolist()
    out.update(_plain(data) if rank == 0 else _pipe(data, ckpt))
    out["user_bytes"] = {op: row[1] + row[2] for op, row in user_ledger.by_op.items()}
    out["bytes"] = {op: row[1] + row[2] for op, row in ledger.by_op.items()}  # sent + received
    dist.barrier()  # torch's own default group is still the whole job
    return out


def test_subworlds_match_engines_run_alone(tmp_path):
    # one thread each: the same float arithmetic in the 3-rank job as in the references
    both = run_local_workers(_worker, 3, "mixed", str(tmp_path / "mixed"), threads=1)
    plain = run_local_workers(_worker, 1, "alone", None, threads=1)[0]
    pipe = run_local_workers(_worker, 2, "alone", str(tmp_path / "alone"), threads=1)

    assert both[0]["view"] == (0, 1, [0], [0], 0, 3)
    assert both[1]["view"] == (0, 2, [1, 2], [1, 2], 1, 3)
    assert both[2]["view"] == (1, 2, [1, 2], [1, 2], 2, 3)
    assert all("already in the sub-world" in out["reentry"] for out in both)
    assert [out["user_sum"] for out in both] == [[1.0] * 3, [2.0] * 3, [2.0] * 3]

    # bit-identical to the engines' own jobs
    assert len(plain["losses"]) == STEPS * ACCUM and plain["losses"][-1] < plain["losses"][0]
    assert both[0]["losses"] == plain["losses"]
    for r in (1, 2):
        mine, ref = both[r], pipe[r - 1]
        assert (mine["stage"], mine["global_rank"]) == (ref["stage"], ref["global_rank"]) == (r - 1, r - 1)
        assert mine["losses"] == ref["losses"] and mine["after_load"] == ref["after_load"]
        # the load restored the saved state: the retrained steps repeat the ones after the save
        assert mine["after_load"] == mine["losses"][SAVE_AT:]
    assert both[1]["losses"] == both[2]["losses"]  # train_batch's loss is broadcast over the pipeline
    assert os.path.isdir(tmp_path / "mixed")

    # counting composes in either order: rank 0's calls are over its group of one (no bytes; over the
    # whole job they would have some), the pipeline's loss broadcast over its 2 ranks has bytes
    assert both[0]["bytes"] and sum(both[0]["bytes"].values()) == 0, both[0]["bytes"]
    for r in (1, 2):
        assert both[r]["bytes"].get("deepspeed.broadcast", 0) > 0, both[r]["bytes"]
    # the user's call is told apart from DeepSpeed's through the sub-world's wrapper too
    assert [out["user_bytes"] for out in both] == [{"user.all_reduce": 0}] + [{"user.all_reduce": 24}] * 2
    assert not any(op.startswith("user.") for out in both for op in out["bytes"])
