"""``python -m lowcomm_bench overlap``: does demo's per-step exchange still cost step time with
``overlap`` on, and what does the one-step-delayed update cost in loss?

demo (the reference recipe) against the same with ``"overlap": true`` on 2 test hosts, over an
unshaped link and rate-limited ones. Reports the median step wall time (first steps left out), the
time blocked in communication (the ledger's "comm" seconds: issuing + waiting) and the held-out
loss, for repeats side by side in one run.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

from ds_lowcomm.optim.recipes import RECIPES
from lowcomm_task.spec import TrainSpec

from .hosts import run_on_hosts
from .netns import LinkShape, TestNetwork, check_can_create
from .streaming import plot

SHAPES = {"unshaped": LinkShape(), "100mbit": LinkShape("100mbit"), "10mbit": LinkShape("10mbit")}
COLUMNS = ["link", "variant", "repeat", "wall_s", "median_step_s", "comm_blocked_s", "final_val_loss",
           "mb_sent_per_worker"]


def variants() -> dict[str, dict]:
    demo = RECIPES["demo"]["lowcomm"]
    return {"demo": dict(demo), "demo overlap": {**demo, "overlap": True}}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench overlap", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/overlap")
    ap.add_argument("--links", default="unshaped,100mbit,10mbit", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    links = [x.strip() for x in args.links.split(",") if x.strip()]
    bad = [x for x in links if x not in SHAPES]
    if bad:
        raise SystemExit(f"--links: unknown {', '.join(bad)}; allowed: {', '.join(SHAPES)}")
    check_can_create()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for link in links:
        with TestNetwork(2, SHAPES[link]) as net:
            for repeat in range(args.repeats):
                for name, lowcomm in variants().items():
                    spec = TrainSpec(lowcomm=lowcomm, lr=RECIPES["demo"]["lr"], steps=args.steps, batch=args.batch,
                                     eval_every=args.steps,
                                     model={"n_layer": args.n_layer, "n_embd": args.n_embd, "seq_len": args.seq_len},
                                     label=name, verbose=False)
                    per_rank, wall = run_on_hosts(net, spec)
                    r0 = per_rank[0]
                    times = r0["step_times"]
                    row = {"link": link, "variant": name, "repeat": repeat, "wall_s": wall,
                           "median_step_s": statistics.median(times[5:] or times),
                           "comm_blocked_s": max(r["comm_s"] for r in per_rank),
                           "final_val_loss": r0["final_val_loss"],
                           "mb_sent_per_worker": sum(r["bytes_sent"] for r in per_rank) / len(per_rank) / 1e6,
                           "step_times": times}
                    rows.append(row)
                    print(f"{link:>9} {name:<13} step {row['median_step_s'] * 1e3:7.1f} ms, blocked "
                          f"{row['comm_blocked_s']:.2f} s, wall {wall:.1f} s, val {row['final_val_loss']:.4f}",
                          flush=True)
    with open(out / "overlap.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / "overlap.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    plot(out / "overlap.png", rows, list(SHAPES))
    return rows
