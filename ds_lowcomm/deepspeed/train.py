"""The reference task trained through a real DeepSpeed engine (what ``launch/train.py`` runs).

Same data, model, initialisation and schedule as ``ds-lowcomm compare`` (so with ZeRO 0, fp32,
one rank per replica and no gradient clipping, the two paths give the same parameters). Works
under the deepspeed launcher, torchrun and mpirun (OpenMPI's environment is mapped to
torch.distributed's; MASTER_ADDR defaults to 127.0.0.1, so set it for multi-node runs).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from ..comm.mpi import finalize_if_used
from ..task.data import ByteCorpus
from ..task.model import GPT, GPTConfig
from ..task.train import evaluate, lr_lambda, mean_over_ranks, params_digest


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train the reference task with DeepSpeed and a lowcomm method.")
    p.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON with a 'lowcomm' section")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--metrics-out", default=None, help="JSON file with the run's metrics (written by rank 0)")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p.add_argument("--data", default=None, help="text file or directory (default: Python's standard library)")
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps of the default schedule")
    p.add_argument("--eval-every", type=int, default=0, help="default: steps/10")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dir", default=None, help="checkpoint directory")
    p.add_argument("--save-at", type=int, default=0, help="save a checkpoint after this step")
    p.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --save-dir")
    p.add_argument("--max-train-bytes", type=int, default=4_000_000)
    return p


def mpi_environment() -> None:
    """Map OpenMPI's rank variables to torch.distributed's when started by mpirun."""
    env = os.environ
    if "OMPI_COMM_WORLD_RANK" in env and "RANK" not in env:
        env["RANK"] = env["OMPI_COMM_WORLD_RANK"]
        env["WORLD_SIZE"] = env["OMPI_COMM_WORLD_SIZE"]
        env["LOCAL_RANK"] = env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", "29511")


def run(args: argparse.Namespace) -> dict:
    import deepspeed

    from .engine import _default_backend, initialize

    mpi_environment()
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=_default_backend())
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))

    with open(args.deepspeed_config) as f:
        ds_config = json.load(f)
    model_cfg = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head, seq_len=args.seq_len)
    corpus = ByteCorpus(args.data, max_train_bytes=args.max_train_bytes)
    torch.manual_seed(args.seed)  # the same initialisation on every rank
    model = GPT(model_cfg)
    schedule = None
    if "scheduler" not in ds_config:  # the reference schedule, as in ds-lowcomm compare
        schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup or 1, args.steps))  # noqa: E731
    engine, _, _, _ = initialize(model=model, config=ds_config, lr_scheduler=schedule)
    micro = engine.train_micro_batch_size_per_gpu()
    accum = engine.gradient_accumulation_steps()
    val = corpus.val_batches(8, micro, model_cfg.seq_len)
    eval_every = args.eval_every or max(1, args.steps // 10)

    engine_ops_at_start = copy.deepcopy(engine.lowcomm.engine_ledger.by_op)
    start = 0
    if args.resume:
        _, client = engine.load_checkpoint(args.save_dir)
        start = client["step"]
    history, recent = [], []
    t0 = time.perf_counter()
    for step in range(start, args.steps):
        for m in range(accum):
            x, y = corpus.train_batch(rank, world, step * accum + m, micro, model_cfg.seq_len, args.seed)
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            recent = (recent + [loss.item()])[-eval_every * accum:]
        done = step + 1
        if done % eval_every == 0 or done == args.steps:
            val_on_device = [(a.to(engine.device), b.to(engine.device)) for a, b in val]
            train_loss, val_loss = mean_over_ranks(sum(recent) / len(recent), evaluate(engine.module, val_on_device))
            history.append({"step": done, "train_loss": train_loss, "val_loss": val_loss,
                            "bytes_sent": engine.lowcomm.summary()["bytes_sent"]})
            if rank == 0:
                print(f"[{engine.lowcomm.config.lowcomm.method} zero{engine.lowcomm.config.zero_stage}] step {done:5d}/"
                      f"{args.steps}  train {train_loss:.4f}  val {val_loss:.4f}", flush=True)
        if args.save_dir and args.save_at == done:
            engine.save_checkpoint(args.save_dir, tag=f"step{done}", client_state={"step": done})
    wall = time.perf_counter() - t0

    summary = engine.lowcomm.summary()
    everyone = [None] * world
    dist.all_gather_object(everyone, {"digest": params_digest(engine.module), **summary})
    metrics = {
        "method": summary["method"],
        "zero_stage": summary["zero_stage"],
        "world_size": world,
        "replica_size": summary["replica_size"],
        "steps": args.steps,
        "final_train_loss": history[-1]["train_loss"] if history else float("nan"),
        "final_val_loss": history[-1]["val_loss"] if history else float("nan"),
        "bytes_sent_per_worker": sum(e["bytes_sent"] for e in everyone) / world,
        "cross_replica_bytes_sent_per_worker": sum(e["cross_replica_bytes_sent"] for e in everyone) / world,
        "engine_bytes_sent_per_worker": sum(e["engine_bytes_sent"] for e in everyone) / world,
        "params_digests": [e["digest"] for e in everyone],
        # DeepSpeed's own collectives issued after initialisation: [calls, sent, received] per op
        "engine_ops_during_training": {
            op: [a - b for a, b in zip(row, engine_ops_at_start.get(op, [0, 0, 0]))]
            for op, row in engine.lowcomm.engine_ledger.by_op.items()
            if row != engine_ops_at_start.get(op)
        },
        "wall_s": wall,
        "history": history,
        "ledgers": [{"method": e["method_ledger"], "engine": e["engine_ledger"]} for e in everyone],
    }
    if rank == 0 and args.metrics_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.metrics_out)), exist_ok=True)
        with open(args.metrics_out, "w") as f:
            json.dump(metrics, f, indent=1)
    return metrics


def main(argv: list[str] | None = None) -> None:
    run(parser().parse_args(argv))
    dist.barrier()
    dist.destroy_process_group()
    finalize_if_used()  # with lowcomm.transport "mpi"
    # Everything is written and every rank has passed the barrier. Leave without running C++
    # destructors: gloo/DeepSpeed background threads now and then abort the interpreter's
    # shutdown ("terminate called without an active exception", SIGABRT) after a good run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
