"""``python -m lowcomm_bench scaling``: bytes and sync time per worker as workers and models grow,
and cross-replica bytes as replicas grow.

1. Workers x model size: each method trains the reference task for a few steps on 2, 4 and 8
   local worker processes (gloo) and 3 model widths about 10x apart in parameters; reported per
   worker: bytes sent and received per sync and the time spent in communication per sync (the
   ledger's "comm" seconds: blocked in collectives). Sparse all-gathers receive (n-1) payloads,
   so their received bytes grow with n; an all-reduce's do not.
2. Replicas: DeepSpeed engines with 2 replicas of 1, 2 and 4 ranks (ZeRO 0: each rank syncs the
   parameters it owns across replicas). Reported: cross-replica bytes per rank and per replica;
   the per-replica total stays flat as the replica grows (the sync is split, not repeated).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from pathlib import Path

from lowcomm_task.workers import run_local_workers
from ds_lowcomm.optim.recipes import RECIPES
from lowcomm_task.deepspeed_main import run
from lowcomm_task.model import GPT, GPTConfig
from lowcomm_task.spec import TrainSpec
from lowcomm_task.train import train_worker

METHODS = ("adamw", "demo", "dct_diloco", "sparseloco")
WIDTHS = (64, 200, 640)  # 2 layers: about 0.11M, 1.0M and 9.9M parameters
SYNC_EVERY = 5  # outer methods: 2 syncs in the default 10 steps


def num_params(width: int, n_layer: int) -> int:
    return GPT(GPTConfig(n_layer=n_layer, n_embd=width, n_head=4, seq_len=64)).num_params()


def worker_spec(method: str, width: int, n_layer: int, steps: int) -> TrainSpec:
    lowcomm = dict(RECIPES[method]["lowcomm"])
    if "sync_every" in lowcomm:
        lowcomm["sync_every"] = SYNC_EVERY
    return TrainSpec(lowcomm=lowcomm, lr=RECIPES[method]["lr"], steps=steps, batch=4, warmup=1, eval_every=steps,
                     val_batches=1, verbose=False, model=GPTConfig(n_layer=n_layer, n_embd=width, n_head=4, seq_len=64),
                     max_train_bytes=400_000)


def scale_workers(args) -> list[dict]:
    rows = []
    for width in args.widths:
        params = num_params(width, args.n_layer)
        for workers in args.workers:
            for method in args.methods:
                per_rank = run_local_workers(train_worker, workers, worker_spec(method, width, args.n_layer, args.steps))
                ledgers = [r["ledger"] for r in per_rank]
                syncs = sum(1 for s in range(args.steps) if method in ("adamw", "demo") or (s + 1) % SYNC_EVERY == 0)
                train_ops = [{op: v for op, v in lg["by_op"].items() if op != "setup"} for lg in ledgers]
                row = {
                    "method": method, "workers": workers, "width": width, "params": params, "syncs": syncs,
                    "bytes_sent_per_sync": _mean(sum(v["sent"] for v in ops.values()) for ops in train_ops) / syncs,
                    "bytes_received_per_sync": _mean(sum(v["received"] for v in ops.values()) for ops in train_ops) / syncs,
                    "comm_s_per_sync": _mean(r["comm_s"] for r in per_rank) / syncs,
                    "codec_s_per_sync": _mean(r["codec_s"] for r in per_rank) / syncs,
                }
                rows.append(row)
                print(f"{method:<11} n={workers} {params / 1e6:5.2f}M  recv/sync {row['bytes_received_per_sync'] / 1e6:8.3f} MB"
                      f"  comm/sync {1e3 * row['comm_s_per_sync']:7.1f} ms", flush=True)
    return rows


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _replica_worker(rank: int, world: int, replica_size: int, steps: int, workdir: str) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "zero_optimization": {"stage": 0},
        "lowcomm": {**RECIPES["dct_diloco"]["lowcomm"], "sync_every": SYNC_EVERY, "replica_size": replica_size},
    }
    path = Path(workdir) / f"replica{replica_size}.json"
    if rank == 0:
        path.write_text(json.dumps(cfg))
    import torch.distributed as dist

    dist.barrier()
    return run(TrainSpec(steps=steps, eval_every=steps, model=GPTConfig(n_layer=2, n_embd=128, seq_len=64),
                         max_train_bytes=400_000, deepspeed_config=str(path)))


def scale_replicas(args, workdir: Path) -> list[dict]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rows = []
    for replica_size in args.replica_sizes:
        world = 2 * replica_size
        m = run_local_workers(_replica_worker, world, replica_size, args.steps, str(workdir))[0]
        per_rank = [sum(v["sent"] for op, v in lg["method"]["by_op"].items() if op != "setup") for lg in m["ledgers"]]
        rows.append({
            "replicas": 2, "replica_size": replica_size, "world": world,
            "cross_replica_bytes_per_rank": sum(per_rank) / world,
            "cross_replica_bytes_per_replica": sum(per_rank) / 2,
            "engine_bytes_per_rank": m["engine_bytes_sent_per_worker"],
            "replicas_identical": len(set(m["params_digests"])) == 1,
        })
        print(f"replica_size {replica_size}: cross-replica {rows[-1]['cross_replica_bytes_per_rank'] / 1e6:.3f} MB/rank, "
              f"{rows[-1]['cross_replica_bytes_per_replica'] / 1e6:.3f} MB/replica", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench scaling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/scaling")
    ap.add_argument("--workers", default="2,4,8")
    ap.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--replica-sizes", default="1,2,4")
    args = ap.parse_args(argv)
    args.workers = [int(x) for x in args.workers.split(",")]
    args.widths = [int(x) for x in args.widths.split(",")]
    args.methods = [m.strip() for m in args.methods.split(",")]
    args.replica_sizes = [int(x) for x in args.replica_sizes.split(",")] if args.replica_sizes else []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workers = scale_workers(args)
    replicas = scale_replicas(args, out) if args.replica_sizes else []
    for name, rows in (("scaling_workers", workers), ("scaling_replicas", replicas)):
        if rows:
            with open(out / f"{name}.csv", "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
    result = {"args": {k: v for k, v in vars(args).items()}, "workers": workers, "replicas": replicas}
    (out / "scaling.json").write_text(json.dumps(result, indent=1))
    plot(out / "scaling.png", workers, replicas)
    return result


def plot(path: Path, workers: list[dict], replicas: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    widest = max(r["width"] for r in workers)
    for method in sorted({r["method"] for r in workers}):
        mine = [r for r in workers if r["method"] == method and r["width"] == widest]
        axes[0].plot([r["workers"] for r in mine], [r["bytes_received_per_sync"] / 1e6 for r in mine], marker="o", label=method)
        axes[1].plot([r["workers"] for r in mine], [1e3 * r["comm_s_per_sync"] for r in mine], marker="o", label=method)
    axes[0].set_title(f"received per sync, {max(r['params'] for r in workers) / 1e6:.1f}M params")
    axes[0].set_ylabel("MB per worker")
    axes[1].set_title("time in communication per sync")
    axes[1].set_ylabel("ms per worker")
    for ax in axes[:2]:
        ax.set_xlabel("workers")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if replicas:
        sizes = [r["replica_size"] for r in replicas]
        axes[2].plot(sizes, [r["cross_replica_bytes_per_replica"] / 1e6 for r in replicas], marker="o", label="per replica")
        axes[2].plot(sizes, [r["cross_replica_bytes_per_rank"] / 1e6 for r in replicas], marker="o", label="per rank")
        axes[2].set_xlabel("ranks per replica (2 replicas)")
        axes[2].set_ylabel("cross-replica MB sent")
        axes[2].set_title("dct_diloco across 2 replicas, ZeRO 0")
        axes[2].grid(alpha=0.3)
        axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
