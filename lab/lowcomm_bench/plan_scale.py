"""``python -m lowcomm_bench plan_scale``: do bytes, codec time and memory scale as the planner
assumes? The reference GPT at several widths (2 layers: 128 wide, 0.4M parameters; 512 wide,
6.5M; 2048 wide, about 100M), every method for a few steps on 2 local worker processes (gloo), outer methods syncing every
2 steps. Per method and width (``plan_scale.csv``): the ledger's bytes per sync against
``ds-lowcomm plan``'s, the codec's seconds per sync and per exchanged element (the planner takes
a constant throughput), and each process's peak resident memory (``ru_maxrss``) against adamw's
beside the planner's added optimizer state. Single-threaded workers.
"""

from __future__ import annotations

import argparse
import math
import resource
from pathlib import Path

from ds_lowcomm import plan as planner
from ds_lowcomm.optim.recipes import RECIPES
from ds_lowcomm.optim.registry import planned_state_bytes, planned_wire
from lowcomm_task.model import GPTConfig
from lowcomm_task.spec import TrainSpec
from lowcomm_task.train import train_worker
from lowcomm_task.workers import run_local_workers

from .codec import write_csv

METHODS = ("adamw", "demo", "diloco", "dct_diloco", "sparseloco", "mtdao")
COLUMNS = ["method", "width", "parameters", "syncs", "measured_bytes_per_sync", "predicted_bytes_per_sync",
           "codec_s_per_sync", "codec_ns_per_element", "peak_rss_mb", "rss_over_adamw_mb",
           "predicted_added_state_mb"]
SEQ, N_LAYER = 64, 2


def _spec(method: str, width: int, steps: int, sync_every: int) -> TrainSpec:
    lowcomm = dict(RECIPES[method]["lowcomm"])
    if "sync_every" in lowcomm:
        lowcomm["sync_every"] = sync_every
    return TrainSpec(lowcomm=lowcomm, lr=RECIPES[method]["lr"], steps=steps, batch=2, warmup=1, eval_every=steps,
                     val_batches=1, verbose=False, model=GPTConfig(n_layer=N_LAYER, n_embd=width, n_head=4, seq_len=SEQ),
                     max_train_bytes=400_000)


def _worker(rank: int, world: int, spec: TrainSpec) -> dict:
    report = train_worker(rank, world, spec)
    return {**report, "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench plan_scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/plan_scale")
    ap.add_argument("--widths", default="128,512,2048")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sync-every", type=int, default=2)
    ap.add_argument("--record", action="store_true",
                    help="record demo's codec throughput at each width as the planner's CPU default "
                         "(ds_lowcomm/measured.json)")
    args = ap.parse_args(argv)
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        shapes = planner.gpt_shapes(N_LAYER, width, 256, SEQ)
        elements = sum(math.prod(s) for s in shapes)
        adamw_rss = None
        for method in (m.strip() for m in args.methods.split(",")):
            spec = _spec(method, width, args.steps, args.sync_every)
            per_rank = run_local_workers(_worker, 2, spec)
            settings = per_rank[0]["settings"]
            wire = planned_wire(settings, shapes)
            messages = wire.messages
            syncs = args.steps // wire.sync_every
            sent = [sum(v["sent"] for op, v in r["ledger"]["by_op"].items() if op != "setup") for r in per_rank]
            codec = sum(r["codec_s"] for r in per_rank) / len(per_rank)
            coded = sum(m.codec_elements for m in messages)
            rss = max(r["peak_rss_kb"] for r in per_rank) / 1024
            adamw_rss = rss if method == "adamw" else adamw_rss
            added = (planned_state_bytes(settings, shapes) - planned_state_bytes({"method": "adamw"}, shapes)) / elements
            rows.append({"method": method, "width": width, "parameters": elements, "syncs": syncs,
                         "measured_bytes_per_sync": max(sent) / syncs, "predicted_bytes_per_sync": sum(m.nbytes for m in messages),
                         "codec_s_per_sync": codec / syncs, "codec_ns_per_element": 1e9 * codec / syncs / coded if coded else None,
                         "peak_rss_mb": rss, "rss_over_adamw_mb": None if adamw_rss is None else rss - adamw_rss,
                         "predicted_added_state_mb": added * elements / 2**20})
            r = rows[-1]
            print(f"{method:<11} {elements / 1e6:7.2f}M  bytes/sync {r['measured_bytes_per_sync']:>13,.0f} "
                  f"(plan {r['predicted_bytes_per_sync']:>13,})  codec {r['codec_s_per_sync']:.3f} s/sync"
                  f"  peak RSS {rss:7.0f} MB (+{r['rss_over_adamw_mb'] or 0:6.0f} vs adamw; plan "
                  f"+{r['predicted_added_state_mb']:6.0f})", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "plan_scale.csv", rows, COLUMNS)
    if args.record:
        record_cpu_codec(rows, out / "plan_scale.csv")
    return rows


def record_cpu_codec(rows: list[dict], csv_path: Path) -> None:
    """The planner's CPU codec throughput (ds_lowcomm/measured.json): demo's fp32 bytes per second
    of exchanged elements, in training, at every width run (``by_elements``: the planner follows the
    model's size between them) and, as the entry's figure, at the largest."""
    from .measured import cpu_codec_entry, record

    entry = cpu_codec_entry(rows, str(csv_path))
    if entry is None:
        raise SystemExit("--record: no demo row with a codec time; nothing recorded")
    record("codec_gbps", "cpu", entry)


if __name__ == "__main__":
    main()
