"""``python -m lowcomm_bench hetero``: replicas of different shapes against the same ranks as
replicas of one shape.

On 3 test hosts (one rank each, every host on the shaped link), the reference GPT with
SparseLoCo (``ds-lowcomm compare``'s recipe):
- ``3 x whole``: three whole-model replicas (``lowcomm.replicas`` [1, 1, 1]);
- ``whole + 2 stages``: rank 0 holds the whole model, ranks 1-2 one model as 2 pipeline stages
  (activations uncompressed), and the same with the stage boundary compressed (``lowrank`` rank
  16, selective: only the grouped replica has a boundary).
Every run is the same code path (DeepSpeed pipeline engines, 1 stage for a whole replica) and
the same steps. Reports the held-out loss after the last outer step, the method's bytes across
replicas and the bytes between stages (both per worker, counted where they are sent), and wall
time through the link.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
from pathlib import Path

from .hosts import run_on_hosts
from .netns import TestNetwork, check_can_create
from .runs import LINKS, effective_shape, method_spec

COLUMNS = ["link", "layout", "repeat", "final_val_loss", "cross_replica_mb_per_worker", "activation_mb_per_worker",
           "wall_s", "train_s"]

LAYOUTS = {
    "3 x whole": [{"ranks": 1}, {"ranks": 1}, {"ranks": 1}],
    "whole + 2 stages (none)": [{"ranks": 1}, {"ranks": 2, "pipeline_stages": 2}],
    "whole + 2 stages (lowrank 16)": [{"ranks": 1}, {"ranks": 2, "pipeline_stages": 2, "activations": {
        "forward": "lowrank", "backward": "lowrank", "rank": 16}}],
}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m lowcomm_bench hetero", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--links", nargs="+", default=["100mbit-20ms"], choices=sorted(LINKS))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default="runs/bench/hetero")
    args = p.parse_args(argv)
    check_can_create()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = method_spec("sparseloco", args.steps, eval_every=args.steps)
    rows = []
    for link in args.links:
        shape, _ = effective_shape(LINKS[link])
        for repeat in range(args.repeats):
            for name, replicas in LAYOUTS.items():
                spec = dataclasses.replace(base, label=name, lowcomm={**base.lowcomm, "replicas": replicas})
                with TestNetwork(3, shape) as net:
                    per_rank, wall = run_on_hosts(net, spec)
                row = {
                    "link": link, "layout": name, "repeat": repeat, "final_val_loss": per_rank[0]["final_val_loss"],
                    "cross_replica_mb_per_worker": sum(r["bytes_sent"] for r in per_rank) / 3 / 1e6,
                    "activation_mb_per_worker": sum(r.get("activation_bytes_sent", 0) for r in per_rank) / 3 / 1e6,
                    "wall_s": wall, "train_s": max(r["train_s"] for r in per_rank),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(out / "hetero.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
