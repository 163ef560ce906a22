"""``python -m lowcomm_bench megatron``: every method inside Megatron-Core against stock
Megatron data-parallel training, on the same GPTModel, data and iterations.

Runs ``launch/pretrain_gpt.py`` under torchrun (2 replicas; ``--tp 2`` for 4 processes) once
without ``--lowcomm-*`` (stock Megatron DDP: its gradient all-reduce) and once per method with
the method's reference recipe (``configs/<method>.json``). Bytes are the method's, per worker, counted where they are sent (the
ledger); stock Megatron's are those of ``adamw``, which replaces DDP's all-reduce with the same
dense mean and gives the same losses bit for bit (tests/test_megatron_methods.py). Reports bytes
per step, the ratio to stock, the held-out loss and wall time.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# name -> --lowcomm-* arguments: each method's reference recipe (configs/<method>.json, the
# settings ``ds-lowcomm compare`` uses), so outer methods sync every 20 steps as there.
ENTRIES = {"stock": [], **{m: ["--lowcomm-config", str(ROOT / "configs" / f"{m}.json")]
                           for m in ("adamw", "demo", "mtdao", "diloco", "dct_diloco", "sparseloco")}}
COLUMNS = ["tp", "entry", "iters", "bytes_per_step_per_worker", "x_fewer_than_stock", "val_loss", "wall_s"]


def steps_per_sync(name: str, extra: list[str]) -> int:
    """Iterations to an entry's first sync: ``--lowcomm-sync-every`` among the extra arguments,
    else its config's ``sync_every``, else 1 (stock, adamw and demo exchange every step); after
    mtdao's warm start (``switch_step``), whose syncs are counted from it."""
    def given(flag: str):
        return int(extra[extra.index(flag) + 1]) if flag in extra[:-1] else None

    section = json.loads(Path(ENTRIES[name][1]).read_text())["lowcomm"] if ENTRIES[name] else {}
    every = given("--lowcomm-sync-every") or section.get("sync_every", 1)
    switch = given("--lowcomm-switch-step")
    return int(every + (section.get("switch_step", 0) if switch is None else switch))


def run_entry(name: str, tp: int, iters: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(2 * tp),
               str(ROOT / "launch" / "pretrain_gpt.py"), "--tensor-model-parallel-size", str(tp),
               "--train-iters", str(iters), "--log-interval", str(iters), "--eval-iters", "8",
               "--metrics-out", str(metrics), *ENTRIES[name], *extra]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        return json.loads(metrics.read_text())


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m lowcomm_bench megatron", description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--entries", nargs="+", default=list(ENTRIES), choices=list(ENTRIES))
    p.add_argument("--out", default="runs/bench/megatron")
    p.add_argument("extra", nargs="*", help="more pretrain_gpt.py arguments (after --)")
    args = p.parse_args(argv)
    short = {name: h for name in args.entries if (h := steps_per_sync(name, args.extra)) > args.iters}
    if short:  # such a run sends nothing, and its row would say 0 bytes
        raise SystemExit(f"--iters {args.iters} is shorter than the sync interval of "
                         f"{', '.join(f'{n} ({h} iterations)' for n, h in short.items())}: it would never sync; "
                         f"use --iters >= {max(short.values())} or leave {', '.join(short)} out of --entries")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for tp in args.tp:
        results = {name: run_entry(name, tp, args.iters, args.extra) for name in args.entries}
        stock = results.get("adamw")
        # Stock DDP sends adamw's gradient all-reduce, not the one-byte health flag beside it.
        stock_bytes = stock["bytes_by_op"]["all_reduce"]["sent"] / len(stock["bytes_sent_per_step"]) if stock else None
        for name, m in results.items():
            per_step = m.get("bytes_sent_per_step")
            mean = sum(per_step) / len(per_step) if per_step else stock_bytes
            rows.append({"tp": tp, "entry": name, "iters": args.iters, "bytes_per_step_per_worker": round(mean),
                         "x_fewer_than_stock": round(stock_bytes / mean, 1) if stock_bytes and mean else "",
                         "val_loss": round(m["val_loss"], 4), "wall_s": round(m["seconds"], 1)})
            print(rows[-1], flush=True)
    with open(out / "megatron.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
