"""One replica of the DeepSpeed live fault-tolerance test (tests/test_fault_tolerance.py), a plain
DeepSpeed script as a user writes it (ds_lowcomm's initialize, the config's lowcomm section with
its fault_tolerance, training_data, a scheduler from the config), run under the deepspeed launcher
as its own job: ``REPLICA_GROUP_ID`` and ``TORCHFT_LIGHTHOUSE`` in the environment say which
replica it is and where the others are. Each rank writes one JSON line per step to
``--out``.rank<r>.jsonl."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deepspeed  # noqa: E402,F401
import torch  # noqa: E402

import ds_lowcomm.deepspeed as dl  # noqa: E402
from ds_lowcomm.checkpoint_io import params_digest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from deepspeed_user import Regression  # noqa: E402  (sample i: (i, x, y))


class Pairs(torch.utils.data.Dataset):
    """(x, y) of each sample: what a pipeline engine's loader hands its first and last stage."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i][1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", required=True)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--hold-at", type=int, default=None, help="at this step, wait for --hold-file to exist")
    ap.add_argument("--hold-file", default=None)
    ap.add_argument("--start-file", default=None, help="before initialize, wait for this file to exist")
    ap.add_argument("--pipeline", action="store_true", help="the model as a PipelineModule of 2 stages")
    ap.add_argument("--local_rank", type=int, default=-1)
    ap = deepspeed.add_config_arguments(ap)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    out = open(f"{args.out}.rank{rank}.jsonl", "a")
    out.write(json.dumps({"event": "start", "time": time.time()}) + "\n")
    out.flush()
    while args.start_file and not Path(args.start_file).exists():
        time.sleep(0.05)
    # seeded by replica and rank: every replica starts from one replica's weights (DeepSpeed's
    # rank 0's inside it, torchft's first quorum across them)
    torch.manual_seed(1000 * int(os.environ["REPLICA_GROUP_ID"]) + rank)
    layers = [torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)]
    if args.pipeline:  # each rank a stage; the engine reads (x, y) pairs of training_data itself
        from deepspeed.pipe import PipelineModule

        deepspeed.init_distributed(dist_backend="gloo")
        model = PipelineModule(layers=layers, num_stages=2, loss_fn=torch.nn.MSELoss(), partition_method="uniform")
        data = Pairs(Regression(4096))
    else:
        model, data = torch.nn.Sequential(*layers), Regression(4096)
    engine, _, loader, _ = dl.initialize(args=args, model=model, model_parameters=model.parameters(),
                                         training_data=data)
    ft = engine.lowcomm.fault_tolerance
    it = iter(loader) if loader is not None and not args.pipeline else None
    while engine.global_steps < args.steps:
        step = engine.global_steps
        if step == args.hold_at:  # the test holds the run here until a restarted replica is up
            while not Path(args.hold_file).exists():
                time.sleep(0.05)
        if args.pipeline:
            idx, loss = torch.tensor([]), engine.train_batch()
        else:
            idx, x, y = next(it)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
        opt = engine.lowcomm.optimizer
        out.write(json.dumps({"step": engine.global_steps, "samples": idx.tolist(), "loss": loss.item(),
                              "digest": params_digest(model), "heals": ft.heals, "discarded": ft.discarded,
                              "outer_steps": getattr(opt, "outer_steps", None), "lr": engine.get_lr()[0],
                              "global_samples": engine.global_samples,
                              "heal_bytes": opt.ledger.by_op.get("heal", [0, 0, 0])[2], "time": time.time()}) + "\n")
        out.flush()
        time.sleep(args.step_sleep)
    engine.lowcomm.done()
    out.write(json.dumps({"event": "done", "time": time.time()}) + "\n")
    out.close()


if __name__ == "__main__":
    main()
