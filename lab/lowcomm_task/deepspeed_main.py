"""The reference task trained through a real DeepSpeed engine: the body of ``launch/train.py``.

The training loop is :func:`lowcomm_task.train.train_worker` with a DeepSpeed engine's step:
same data, model, initialisation and schedule as ``ds-lowcomm compare`` (so with ZeRO 0, fp32,
one rank per replica and no gradient clipping, the two paths give the same parameters). With
``--pipeline-stages S`` the GPT runs as a DeepSpeed pipeline of S stages (see
:class:`lowcomm_task.steps.PipelineStep`). Works
under the deepspeed launcher, torchrun and mpirun (OpenMPI's environment is mapped to
torch.distributed's; MASTER_ADDR defaults to 127.0.0.1, so set it for multi-node runs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from ds_lowcomm.checkpoint_io import LATEST
from ds_lowcomm.comm.mpi import finalize_if_used
from ds_lowcomm.config import ConfigError
from ds_lowcomm.deepspeed.config import load_config, split_config
from ds_lowcomm.deepspeed.launcher import mpi_environment

from .data import DATA_SHARDS
from .spec import DEFAULTS, TrainSpec
from .train import train_worker
from .workers import exit_without_teardown


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Train the reference task with DeepSpeed and a lowcomm method.")
    p.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON with a 'lowcomm' section")
    p.add_argument("--steps", type=int, default=DEFAULTS.steps)
    p.add_argument("--metrics-out", default=None, help="JSON file with the run's metrics (written by rank 0)")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p.add_argument("--data", default=DEFAULTS.data, help="text file or directory (default: Python's standard library)")
    p.add_argument("--data-shards", default=DEFAULTS.data_shards, choices=DATA_SHARDS,
                   help="how the training bytes are split between ranks: contiguous or interleaved (lowcomm_task.data)")
    p.add_argument("--warmup", type=int, default=DEFAULTS.warmup, help="linear warm-up steps of the default schedule")
    p.add_argument("--lr-decay", default=DEFAULTS.lr_decay, choices=("cosine", "none"),
                   help="after the warm-up, the default schedule's cosine to 10%% of the peak, or none (held)")
    p.add_argument("--eval-every", type=int, default=0, help="default: steps/10")
    p.add_argument("--n-layer", type=int, default=DEFAULTS.model.n_layer)
    p.add_argument("--n-embd", type=int, default=DEFAULTS.model.n_embd)
    p.add_argument("--n-head", type=int, default=DEFAULTS.model.n_head)
    p.add_argument("--seq-len", type=int, default=DEFAULTS.model.seq_len)
    p.add_argument("--seed", type=int, default=DEFAULTS.seed)
    p.add_argument("--save-dir", default=None, help="checkpoint directory")
    p.add_argument("--save-at", type=int, default=0, help="save a checkpoint after this step")
    p.add_argument("--save-every", type=int, default=0, help="save a checkpoint after every multiple of this step")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="TAG",
                   help="resume from checkpoint TAG of --save-dir (e.g. step40), or with no TAG (or 'latest') from "
                        "the last complete one. Under torchrun --max-restarts, a restarted group resumes from the "
                        "latest checkpoint of --save-dir by itself")
    p.add_argument("--max-train-bytes", type=int, default=DEFAULTS.max_train_bytes)
    p.add_argument("--pipeline-stages", type=int, default=DEFAULTS.pipeline_stages,
                   help="> 0: the GPT as a DeepSpeed pipeline of this many stages (ranks: a multiple of it); "
                        "lowcomm.replica_size defaults to it (one pipeline per replica)")
    return p


def spec_from_args(args: argparse.Namespace) -> TrainSpec:
    if args.resume and not args.save_dir:
        raise ConfigError("--resume needs --save-dir")
    resume = args.resume
    if resume is None and elastic_restart() and args.save_dir and os.path.isfile(os.path.join(args.save_dir, LATEST)):
        resume = "latest"  # torchrun restarted the group after a worker was lost: go on from the last checkpoint
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"[ds_lowcomm] elastic restart {os.environ['TORCHELASTIC_RESTART_COUNT']}: resuming from "
                  f"{args.save_dir}/{LATEST}", file=sys.stderr, flush=True)
    return TrainSpec.from_args(args, resume_from=args.save_dir if resume else None, resume_tag=resume or "latest")


def _init_after_elastic_restart() -> None:
    """torchrun's static rendezvous keeps one agent store across restarts, so a restarted rank
    can read the dead group's addresses from it (gloo: "Connection refused" at start-up). Each
    attempt's group takes keys of its own here."""
    from datetime import timedelta

    from deepspeed.accelerator import get_accelerator

    world, attempt = int(os.environ["WORLD_SIZE"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(minutes=5))
    dist.init_process_group(get_accelerator().communication_backend_name(),
                            store=dist.PrefixStore(f"ds_lowcomm/attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=world)


def elastic_restart() -> bool:
    """Whether torchrun (elastic) started this process after a failure of the group."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def run(spec: TrainSpec, metrics_out: str | None = None) -> dict:
    """Train ``spec`` (with ``spec.deepspeed_config``) on this rank; every rank returns the run's
    metrics, rank 0 also writes them to ``metrics_out``."""
    import deepspeed

    mpi_environment()
    if not dist.is_initialized() and elastic_restart() and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        _init_after_elastic_restart()
    if not dist.is_initialized():
        deepspeed.init_distributed()  # the accelerator's backend
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))

    result = train_worker(rank, world, spec)
    summary = result["lowcomm"]
    everyone = [None] * world
    dist.all_gather_object(everyone, {"digest": result["params_digest"], "stage": result.get("stage"), **summary})
    metrics = {
        "method": summary["method"],
        "zero_stage": summary["zero_stage"],
        "world_size": world,
        "replica_size": summary["replica_size"],
        "pipeline_stages": spec.pipeline_stages,
        "steps": spec.steps,
        "final_train_loss": result["final_train_loss"],
        "final_val_loss": result["final_val_loss"],
        "bytes_sent_per_worker": sum(e["bytes_sent"] for e in everyone) / world,
        "cross_replica_bytes_sent_per_worker": sum(e["cross_replica_bytes_sent"] for e in everyone) / world,
        "engine_bytes_sent_per_worker": sum(e["engine_bytes_sent"] for e in everyone) / world,
        # between pipeline stages (0 without a pipeline)
        "activation_bytes_sent_per_worker": sum(e["activation_bytes_sent"] for e in everyone) / world,
        "params_digests": [e["digest"] for e in everyone],  # a pipeline's: of each rank's own stage
        "stages": [e["stage"] for e in everyone],  # each rank's pipeline stage (None without a pipeline)
        "engine_ops_during_training": result["engine_ops_during_training"],
        "wall_s": result["wall_s"],
        "history": result["history"],
        "ledgers": [{"method": e["method_ledger"], "engine": e["engine_ledger"], "activations": e["activation_ledger"]}
                    for e in everyone],
    }
    if rank == 0 and metrics_out:
        os.makedirs(os.path.dirname(os.path.abspath(metrics_out)), exist_ok=True)
        with open(metrics_out, "w") as f:
            json.dump(metrics, f, indent=1)
    return metrics


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        if args.deepspeed_config:  # a bad file fails here, on every rank alike, before any rank waits for the others
            split_config(load_config(args.deepspeed_config))
        spec = spec_from_args(args)
    except ConfigError as err:  # before torch.distributed starts: a clear line, no traceback, no wait
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    run(spec, args.metrics_out)
    dist.barrier()
    dist.destroy_process_group()
    finalize_if_used()  # with lowcomm.transport "mpi"
    # Everything is written and every rank has passed the barrier. Leave without running C++
    # destructors: gloo/DeepSpeed background threads now and then abort the interpreter's
    # shutdown ("terminate called without an active exception", SIGABRT) after a good run.
    exit_without_teardown(0)
