"""``python -m lowcomm_bench mtdao``: MT-DAO as its authors run it, against adamw and the other
local methods, over runs long enough for a 0.999 momentum to matter (issue 43).

Every entry trains the reference task on 2 local workers for ``--steps`` steps (3000: the authors'
16M recipe scaled down, its switch at a third) under the authors' schedule for every entry: a
linear warm-up over the first third, then the peak held (their ``decay_ratio`` 0), and their
gradient clipping (1.0). The entries (:data:`ENTRIES`) are the spec's lowcomm section and lr;
``--grid`` sets any of them per run (``lr``, spec fields, ``lowcomm.<key>``), as ``bench sweep``.
Each (entry, configuration, seed) run is cached as JSON under ``--out/runs`` with its history,
so a run is never trained twice and the table is rebuilt from every cached run of ``--steps``
steps: ``mtdao.csv`` (entry, steps, seed, final_val_loss, steps_to_target, bytes_sent_per_worker,
settings) with the steps to ``--target`` (the tuned adamw's final held-out loss on the tuning
seed) read from each run's evaluations.

    B="python -m lowcomm_bench mtdao --out runs/mtdao"
    $B --entries adamw --grid '{"lr": [0.001, 0.002, 0.003, 0.004]}' --seeds 0      # tuning
    $B --entries mtdao --grid '{"lr": [0.0005, 0.001, 0.0015, 0.002]}' --seeds 0
    $B --entries adamw,mtdao,local_adam,diloco,demo --grid '{"lr": [...]}' --seeds 1,2,3   # each at its best
    $B --table --target 2.0 --csv docs/bench/peers/<date>-cpu-mtdao-authors-recipe.csv   # the table
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
from pathlib import Path

from ds_lowcomm.optim.recipes import MTDAO_PUBLISHED, MTDAO_TWO_MOMENTA
from lowcomm_task.spec import TrainSpec
from lowcomm_task.train import train_worker
from lowcomm_task.workers import run_local_workers

from .codec import write_csv
from .runs import add_model_args, model_of
from .sweep import parse_grid
from .time_to_loss import steps_to_target
from .tuning import parse_seeds, with_settings

# The authors' 16M recipe (compare's mtdao recipe) and the one ds_lowcomm ran before issue 43
PUBLISHED, TWO_MOMENTA = MTDAO_PUBLISHED, MTDAO_TWO_MOMENTA

# entry -> (lowcomm section, lr, spec fields); "switch_step": True is replaced by a third of the steps.
ENTRIES = {
    "adamw": ({"method": "adamw"}, 3e-3, {}),
    "mtdao": ({**PUBLISHED, "switch_step": True}, 1e-3, {}),
    # DES-LOC's baseline: Adam's one momentum (0.9, weight 1), parameters and both moments every 32
    # steps, after the same warm start and switch as mtdao's
    "local_adam": ({**PUBLISHED, "momentum_betas": [0.9], "momentum_weights": [1.0], "switch_step": True}, 1e-3, {}),
    "diloco": ({"method": "diloco", "sync_every": 32}, 3e-3, {}),
    "demo": ({"method": "demo", "topk": 1, "chunk": 8, "decay": 0.995, "value_dtype": "int8"}, 2e-3, {}),
    # The recipe's parts, one at a time (each from the published recipe)
    "mtdao_beta2_0.95": ({**PUBLISHED, "beta2": 0.95, "switch_step": True}, 1e-3, {}),
    "mtdao_two_momenta": ({**PUBLISHED, "momentum_betas": [0.9, 0.999], "momentum_weights": [0.5, 0.3],
                           "switch_step": True}, 1e-3, {}),
    "mtdao_no_warm_start": ({**PUBLISHED, "switch_lr_scale": 1.0}, 4e-3, {}),
    "mtdao_no_lr_scale": ({**PUBLISHED, "switch_lr_scale": 1.0, "switch_step": True}, 1e-3, {}),
    "mtdao_no_clip": ({**PUBLISHED, "switch_step": True}, 1e-3, {"clip_grad": 0.0}),
    "mtdao_nesterov": ({**PUBLISHED, "switch_step": True, "outer_optimizer": "sgd"}, 1e-3, {}),
    # the recipe before issue 43, at the same schedule and clipping
    "mtdao_two_momenta_recipe": (TWO_MOMENTA, 2e-3, {}),
}
COLUMNS = ["entry", "steps", "seed", "final_val_loss", "steps_to_target", "target_loss", "bytes_sent_per_worker",
           "lr", "settings"]


def entry_spec(entry: str, steps: int, eval_every: int, model: dict) -> TrainSpec:
    """``entry``'s spec at the benchmark's protocol (see the module's docstring)."""
    lowcomm, lr, fields = ENTRIES[entry]
    lowcomm = {k: (steps // 3 if v is True else v) for k, v in lowcomm.items()}
    base = dict(steps=steps, warmup=steps // 3, lr_decay="none", clip_grad=1.0, eval_every=eval_every, model=model,
                label=entry)
    return TrainSpec(**{**base, **fields}, lowcomm=lowcomm, lr=lr)


def _run(rank: int, world: int, spec: TrainSpec) -> dict:
    r = train_worker(rank, world, spec)
    return {"history": r["history"], "final_val_loss": r["final_val_loss"], "bytes_sent": r["bytes_sent"]}


def run_cached(out: Path, entry: str, combo: dict, spec: TrainSpec) -> dict:
    # the training's fields (not its progress lines or label)
    key = json.dumps({k: v for k, v in spec.to_dict().items() if k not in ("verbose", "label")}, sort_keys=True)
    path = out / "runs" / f"{entry}-s{spec.seed}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"
    if path.exists():
        return json.loads(path.read_text())
    per_rank = run_local_workers(_run, 2, spec)
    result = {"entry": entry, "settings": combo, "seed": spec.seed, "steps": spec.steps, "lr": spec.lr,
              "spec": spec.to_dict(), "final_val_loss": per_rank[0]["final_val_loss"],
              "bytes_sent_per_worker": sum(r["bytes_sent"] for r in per_rank) / len(per_rank),
              "history": per_rank[0]["history"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def table(out: Path, steps: int, target: float | None) -> list[dict]:
    """Every cached run of ``steps`` steps as a row (steps to ``target`` from its history)."""
    rows, seen = [], set()
    for path in sorted((out / "runs").glob("*.json")):
        r = json.loads(path.read_text())
        run = (r["entry"], r["seed"], r["lr"], json.dumps(r["settings"], sort_keys=True))
        if r["steps"] != steps or run in seen:  # (one run cached under two names is one row)
            continue
        seen.add(run)
        rows.append({"entry": r["entry"], "steps": r["steps"], "seed": r["seed"], "final_val_loss": r["final_val_loss"],
                     "steps_to_target": steps_to_target(r["history"], target) if target is not None else None,
                     "target_loss": target, "bytes_sent_per_worker": r["bytes_sent_per_worker"], "lr": r["lr"],
                     "settings": json.dumps(r["settings"], sort_keys=True)})
    rows.sort(key=lambda r: (list(ENTRIES).index(r["entry"]) if r["entry"] in ENTRIES else 99, r["seed"], r["lr"],
                             r["settings"]))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench mtdao", description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", default="", help=f"comma list of: {', '.join(ENTRIES)}")
    ap.add_argument("--grid", default="{}", help='JSON object of lists, e.g. {"lr": [0.001, 0.002]} (default: the recipe)')
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--out", default="runs/mtdao")
    ap.add_argument("--table", action="store_true", help="write the table of every cached run (no training)")
    ap.add_argument("--target", type=float, default=None, help="held-out loss for steps_to_target")
    ap.add_argument("--csv", default=None, help="where the table goes (default: OUT/mtdao.csv)")
    add_model_args(ap)
    args = ap.parse_args(argv)
    out = Path(args.out)
    entries = [e.strip() for e in args.entries.split(",") if e.strip()]
    unknown = [e for e in entries if e not in ENTRIES]
    if unknown:
        raise SystemExit(f"--entries: unknown {', '.join(unknown)}; allowed: {', '.join(ENTRIES)}")
    combos = parse_grid(args.grid) if args.grid.strip() != "{}" else [{}]
    jobs = []  # every spec built (and checked) before any run starts
    for entry in entries:
        base = entry_spec(entry, args.steps, args.eval_every, model_of(args))
        for combo in combos:
            spec, _ = with_settings(base, None, combo)
            jobs += [(entry, combo, dataclasses.replace(spec, seed=seed)) for seed in parse_seeds(args.seeds)]
    for entry, combo, spec in jobs:
        r = run_cached(out, entry, combo, spec)
        print(f"{entry} {json.dumps(combo, sort_keys=True)} seed {spec.seed}: final {r['final_val_loss']:.4f}, "
              f"{r['bytes_sent_per_worker'] / 1e6:.1f} MB sent", flush=True)
    rows = table(out, args.steps, args.target)
    path = Path(args.csv) if args.csv else out / "mtdao.csv"
    if args.table or jobs:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_csv(path, rows, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
