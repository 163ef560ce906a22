"""``python -m lowcomm_bench demo_sign``: DeMo with 1-bit sign values, a small sweep of
topk / chunk / decay on the reference task against adamw (``ds-lowcomm compare``'s task,
2 workers, the same steps and seed), for the issue-16 target: >= 300x fewer bytes than adamw at
<= 3% higher held-out loss. Each setting is one ``compare`` run of demo with ``--config``
overrides; adamw runs once. Writes ``results.csv`` (one row per setting: bytes per worker, the
ratio to adamw, held-out loss and its excess over adamw's)."""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

# (topk, chunk, decay, value_dtype): the recipe with int8 (today's), then sign values.
SETTINGS = [
    (1, 8, 0.9, "int8"),
    (1, 8, 0.9, "sign"),
    (2, 16, 0.9, "sign"),
    (1, 16, 0.9, "sign"),
    (4, 32, 0.9, "sign"),
    (2, 16, 0.95, "sign"),
    (2, 16, 0.999, "sign"),
]
COLUMNS = ["setting", "topk", "chunk", "decay", "value_dtype", "steps", "bytes_sent_per_worker", "x_fewer_than_adamw",
           "final_val_loss", "loss_vs_adamw_pct"]


def _compare(out: Path, method: str, steps: int, overrides: dict) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    config = out / "overrides.json"
    config.write_text(json.dumps(overrides))
    cmd = [sys.executable, "-m", "ds_lowcomm.cli", "compare", "--methods", method, "--workers", "2",
           "--steps", str(steps), "--out", str(out), "--config", str(config)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return next(csv.DictReader(open(out / "results.csv")))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m lowcomm_bench demo_sign", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default="runs/bench/demo_sign")
    args = p.parse_args(argv)
    out = Path(args.out)
    adamw = _compare(out / "adamw", "adamw", args.steps, {})
    base_bytes, base_loss = float(adamw["bytes_sent_per_worker"]), float(adamw["final_val_loss"])
    rows = [{"setting": "adamw", "steps": args.steps, "bytes_sent_per_worker": round(base_bytes),
             "x_fewer_than_adamw": 1.0, "final_val_loss": round(base_loss, 4), "loss_vs_adamw_pct": 0.0}]
    print(rows[-1], flush=True)
    for topk, chunk, decay, value_dtype in SETTINGS:
        name = f"topk{topk}_chunk{chunk}_decay{decay}_{value_dtype}"
        r = _compare(out / name, "demo", args.steps, {"demo": {"lowcomm": {
            "topk": topk, "chunk": chunk, "decay": decay, "value_dtype": value_dtype}}})
        sent, loss = float(r["bytes_sent_per_worker"]), float(r["final_val_loss"])
        rows.append({"setting": name, "topk": topk, "chunk": chunk, "decay": decay, "value_dtype": value_dtype,
                     "steps": args.steps, "bytes_sent_per_worker": round(sent),
                     "x_fewer_than_adamw": round(base_bytes / sent, 1), "final_val_loss": round(loss, 4),
                     "loss_vs_adamw_pct": round(100 * (loss / base_loss - 1), 2)})
        print(rows[-1], flush=True)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
