"""A plain DeepSpeed training script, made a ds_lowcomm one by two changes (marked below): the
import and the config's "lowcomm" section. Everything else is what a DeepSpeed user writes: own
model and Dataset, training_data=, gradient accumulation, clipping and a scheduler from the
config, two parameter groups, save/load_checkpoint with client_state.

    deepspeed --num_gpus 2 examples/deepspeed_user.py --deepspeed_config examples/deepspeed_user.json
"""

import argparse
import gc
import json
import os

import deepspeed  # noqa: F401  (still there: the launcher, deepspeed.comm, ... are DeepSpeed's)
import torch

import ds_lowcomm.deepspeed as dl  # change 1 of 2: initialize comes from ds_lowcomm (change 2: the config)


class Regression(torch.utils.data.Dataset):
    """Sample i: (i, x, y), y a fixed function of x; the index names the sample."""

    def __init__(self, n=2048):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(16, 4, generator=g))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return i, self.x[i], self.y[i]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-dir", default="ckpt_user")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--out", default=None, help="write what happened as JSON (rank 0)")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    torch.manual_seed(1234 + int(os.environ.get("RANK", 0)))  # ranks seeded differently: rank 0's weights win
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "weight_decay": 0.0}]
    data = Regression()

    engine, _, loader, _ = dl.initialize(args=args, model=model, model_parameters=groups, training_data=data)
    first_batch = None
    losses = []
    it = iter(loader)
    while engine.global_steps < args.steps:
        try:
            idx, x, y = next(it)
        except StopIteration:
            it = iter(loader)
            idx, x, y = next(it)
        first_batch = idx.tolist() if first_batch is None else first_batch
        boundary = engine.is_gradient_accumulation_boundary()  # this step() ends an optimizer step
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        if boundary:
            losses.append(loss.item())
            if engine.global_steps == args.steps // 2:
                engine.save_checkpoint(args.save_dir, client_state={"losses": list(losses)})

    # Resume from the middle: a fresh engine, the same script's calls.
    torch.manual_seed(99)
    model2 = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    groups2 = [{"params": model2[0].parameters()}, {"params": model2[2].parameters(), "weight_decay": 0.0}]
    engine2, *_ = dl.initialize(args=args, model=model2, model_parameters=groups2)
    _, client = engine2.load_checkpoint(args.save_dir)

    summary = engine.lowcomm.summary()
    rank = torch.distributed.get_rank()
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, first_batch)
    if rank == 0:
        report = {"first_batches": everyone, "losses": losses, "train_batch_size": engine.train_batch_size(),
                  "resumed_at": engine2.global_steps, "client_losses": client["losses"],
                  "bytes_per_step": summary["bytes_sent_per_step"],
                  "compression_vs_allreduce": summary["compression_vs_allreduce"]}
        print(json.dumps(report))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f)
    torch.distributed.barrier()
    # the engines released: DeepSpeed's own references to their parameters dropped (see the end below)
    engine.destroy()
    engine2.destroy()


if __name__ == "__main__":
    main()
    # The end of a run, in this order: the engines' last reference cycles collected while the
    # process groups are still up, then DeepSpeed's torch.distributed torn down (DeepSpeed drops
    # its own references to the groups too) and the groups collected, so that torch joins their
    # gloo worker threads now. A worker still holding its last collective's tensors when the
    # interpreter shuts down aborts the process (pytorch/pytorch#190489).
    gc.collect()
    deepspeed.comm.destroy_process_group()
    gc.collect()
