"""The held-out loss inside outer intervals: the long_h recipe around dense Muon's tuned settings
(lr 0.008, Muon lr 0.02) on the reference GPT, its schedule spread over 3000 steps, evaluated
every 5 steps up to --stop, rows appended to --out (run, workers, data_shards, step, val_loss,
train_loss). A diagnostic of lab/notes/long-h.md ("The data shards: why the loss climbs between syncs"), not a
benchmark:

    PYTHONPATH=.:lab python lab/notes/long-h/within_interval.py --name h30-bf16 --workers 2 \
        --settings '{"sync_every": 30, "value_dtype": "bf16"}' --data-shards contiguous --out within.csv
"""

import argparse
import csv
import dataclasses
import json
from pathlib import Path

from lowcomm_bench.long_h import recipe_settings
from lowcomm_bench.sweep import train_one
from lowcomm_bench.time_to_loss import entry_spec
from lowcomm_bench.tuning import with_settings
from lowcomm_task.data import DATA_SHARDS
from lowcomm_task.workers import run_local_workers

MODEL = {"n_layer": 2, "n_embd": 128, "n_head": 4, "seq_len": 128}
DENSE = {"lr": 0.008, "peer.muon_lr": 0.02}  # dense Muon's tuning on every machine kind so far


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--settings", default='{"sync_every": 30, "value_dtype": "bf16"}',
                    help="the candidate's lowcomm settings over the recipe (long_h's grid form)")
    ap.add_argument("--data-shards", default="contiguous", choices=DATA_SHARDS)
    ap.add_argument("--stop", type=int, default=720)
    ap.add_argument("--out", default="within_interval.csv")
    args = ap.parse_args()
    base, _ = entry_spec("muloco_sign", 3000, 5, MODEL)
    base = dataclasses.replace(base, warmup=100, lowcomm={}, stop_at_step=args.stop, seed=0,
                               data_shards=args.data_shards)
    spec, _ = with_settings(base, None, recipe_settings(DENSE, json.loads(args.settings)))
    history = run_local_workers(train_one, args.workers, spec, None)[0]["history"]
    out = Path(args.out)
    new = not out.exists()
    with open(out, "a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["run", "workers", "data_shards", "step", "val_loss", "train_loss"])
        w.writerows([args.name, args.workers, args.data_shards, h["step"], round(h["val_loss"], 4),
                     round(h["train_loss"], 4)] for h in history)


if __name__ == "__main__":
    main()
