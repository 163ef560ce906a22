"""``python -m ds_lowcomm.bench sweep``: a method's settings that matter, against steps to adamw's
held-out loss and the loss at a fixed budget.

For each combination of ``--grid`` (JSON: ``{"lr": [..], "lowcomm.sync_every": [..]}``, keys the
spec's fields or ``lowcomm.<key>``, merged over the method's ``compare`` recipe), the reference
task trains on ``--workers`` local processes for ``--budget`` steps (its schedule spread over
them) and records the first evaluation at or below ``--target`` (adamw's held-out loss after 300
steps on 2 workers, 2.1140, the target of ``time_to_loss``; rows before 2026-11-25 used 2.1075,
adamw's loss at step 225 of its 900-step schedule, slightly stricter), the final held-out loss
and the bytes sent per worker. Steps and losses do not depend on the link (the exchanges are
deterministic), so this runs on loopback and its steps hold for ``time_to_loss``'s test hosts. Appends to ``sweep.csv`` under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
from pathlib import Path

from ..config import METHODS
from ..task.train import train_worker
from ..workers import run_local_workers
from .runs import add_model_args, method_spec, model_of
from .time_to_loss import steps_to_target

COLUMNS = ["method", "workers", "budget", "settings", "steps_to_target", "final_val_loss", "target_loss",
           "bytes_sent_per_worker"]


def with_settings(spec, settings: dict):
    """``spec`` with ``lr``-style fields and ``lowcomm.<key>`` settings replaced."""
    lowcomm = dict(spec.lowcomm)
    fields = {}
    for key, value in settings.items():
        if key.startswith("lowcomm."):
            lowcomm[key.split(".", 1)[1]] = value
        else:
            fields[key] = value
    return dataclasses.replace(spec, lowcomm=lowcomm, **fields)


def train_all(rank: int, world: int, specs: list) -> list[dict]:
    return [train_worker(rank, world, spec) for spec in specs]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m ds_lowcomm.bench sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", required=True, choices=METHODS)
    ap.add_argument("--grid", required=True, help='JSON object of lists, e.g. {"lr": [0.001, 0.002]}')
    ap.add_argument("--target", type=float, default=2.1140, help="held-out loss to reach (adamw's, 300 steps)")
    ap.add_argument("--budget", type=int, default=900)
    ap.add_argument("--eval-every", type=int, default=15)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--stop-at-target", action="store_true", help="stop each run at the target (faster)")
    ap.add_argument("--out", default="runs/bench/sweep")
    add_model_args(ap)
    args = ap.parse_args(argv)
    grid = json.loads(args.grid)
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise SystemExit('--grid: a JSON object whose values are non-empty lists, e.g. {"lr": [0.001]}')
    base = method_spec(args.method, args.budget, args.eval_every, **model_of(args))
    combos = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    specs = [with_settings(base, c) for c in combos]  # every spec checked before any worker starts
    if args.stop_at_target:
        specs = [dataclasses.replace(s, stop_at_val_loss=args.target) for s in specs]
    per_rank = run_local_workers(train_all, args.workers, specs)
    rows = []
    for i, (combo, spec) in enumerate(zip(combos, specs)):
        r = per_rank[0][i]
        rows.append({"method": args.method, "workers": args.workers, "budget": args.budget,
                     "settings": json.dumps(combo, sort_keys=True),
                     "steps_to_target": steps_to_target(r["history"], args.target),
                     "final_val_loss": r["final_val_loss"], "target_loss": args.target,
                     "bytes_sent_per_worker": sum(x["bytes_sent"] for x in per_rank_i(per_rank, i)) / args.workers})
        print(f"{args.method} {rows[-1]['settings']}: steps to target {rows[-1]['steps_to_target']}, "
              f"final {r['final_val_loss']:.4f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "sweep.csv"
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            w.writeheader()
        w.writerows(rows)
    return rows


def per_rank_i(per_rank: list[list[dict]], i: int) -> list[dict]:
    return [results[i] for results in per_rank]


if __name__ == "__main__":
    main()
