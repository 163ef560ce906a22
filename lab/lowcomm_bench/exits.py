"""``python -m lowcomm_bench exits``: a user's script (exit_script.py: its own model with an unused
layer, the one-bit outer loop, a few steps, then ``destroy_process_group()`` and nothing else)
launched ``--runs`` times in a row per exchange at ``--ranks`` ranks under torchrun: how many
launches exited 0, how many aborted ("terminate called without an active exception"), and how far
the unused layer moved. Rows to ``exits.csv`` under ``--out``."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from .codec import write_csv

SCRIPT = Path(__file__).with_name("exit_script.py")
COLUMNS = ["exchange", "ranks", "runs", "exited_0", "aborted", "max_unused_moved"]


def launch(exchange: str, ranks: int) -> dict:
    """One torchrun launch of the script: its return code, whether a rank aborted, rank 0's line."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), str(SCRIPT),
                           exchange], capture_output=True, text=True, timeout=600)
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    return {"returncode": done.returncode, "aborted": "terminate called" in done.stderr,
            "result": lines[0] if lines else None, "stderr": done.stderr[-3000:]}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench exits", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--exchanges", default="all_gather,all_reduce")
    ap.add_argument("--out", default="runs/bench/exits")
    args = ap.parse_args(argv)
    rows = []
    for exchange in args.exchanges.split(","):
        launches = [launch(exchange, args.ranks) for _ in range(args.runs)]
        rows.append({"exchange": exchange, "ranks": args.ranks, "runs": args.runs,
                     "exited_0": sum(d["returncode"] == 0 for d in launches),
                     "aborted": sum(d["aborted"] for d in launches),
                     "max_unused_moved": max(d["result"]["unused_moved"] for d in launches if d["result"])})
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_csv(Path(args.out) / "exits.csv", rows, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
