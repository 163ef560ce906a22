"""``python -m lowcomm_bench scale``: the one-bit recipe against its dense optimizer at a model size,
with the recipe's inner settings derived from the dense run's (issue 55).

At one size of the reference GPT (``--n-layer``, ``--n-embd``, ``--seq-len``), for each dense form
(``--forms``: "muon", DDP with torch's Muon on the hidden matrices and AdamW on the rest; "adamw",
the all-reduce baseline with AdamW):

1. **The dense baseline is tuned** on seed 0 over ``--muon-grid`` / ``--adamw-grid`` (JSON objects
   of lists, :func:`lowcomm_bench.sweep.parse_grid`), each run the whole ``--budget``; the best is
   the lowest final held-out loss.
2. **The target** is that best run's held-out loss at step ``--target-frac`` x budget (2/3: the
   dense baseline reaches it at 200 of 300 steps, leaving the recipe room to be 1.5x slower).
3. **Measured on ``--seeds``** (1,2,3: not the tuning seed), every run stopping at the target
   (its schedule still spread over the budget): the tuned dense baseline, and the recipe at each H
   of ``--sync-every``, its inner optimizer the dense one at the tuned dense settings
   (:func:`ds_lowcomm.optim.recipes.sign_recipe`: only H and the recipe's outer settings are its own).

Rows go to ``scale.csv`` under ``--out`` (one per run, tuning runs included: ``role`` tune or
seed), with ``steps_to_target`` (the first evaluation at or below the target),
``steps_interpolated`` (linearly between evaluations) and ``bytes_sent_per_worker`` to the target
(the ledger's). ``summary.csv``: per form, entry and H, the median steps over the seeds and the
ratio to the dense median. Every run's result is cached under ``--out``/cache by its exact spec,
so an interrupted invocation resumes where it stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
from pathlib import Path

from ds_lowcomm.optim.recipes import DENSE_FORMS, RECOMMENDED, SIGN_OUTER, sign_recipe
from lowcomm_task.workers import run_local_workers

from .codec import collect_args, collect_csv, read_typed_csv, write_csv
from .runs import at_target
from .sweep import parse_grid, train_one
from .time_to_loss import bytes_to_target, entry_spec, steps_to_target
from .tuning import parse_seeds, with_settings

COLUMNS = ["entry", "form", "parameters", "device", "role", "seed", "H", "steps_to_target", "steps_interpolated",
           "target_loss", "bytes_sent_per_worker", "final_val_loss", "last_step", "budget", "settings"]
SUMMARY_COLUMNS = ["form", "entry", "parameters", "device", "H", "seeds", "median_steps", "steps", "ratio_to_dense",
                   "median_bytes_sent_per_worker", "bytes_ratio_to_dense", "target_loss", "dense_settings"]
# The dense entries of time_to_loss and the recipe's entry around each (its lowcomm section is
# replaced by sign_recipe's)
DENSE_ENTRY = {"muon": "muon", "adamw": "adamw"}
RECIPE_ENTRY = {"muon": "muloco_sign", "adamw": "dct_diloco"}
RECIPE_NAME = {"muon": "muloco_sign", "adamw": "adamw_sign"}
DEFAULT_GRIDS = {"muon": '{"peer.muon_lr": [0.02, 0.03, 0.05], "lr": [0.008]}',
                 "adamw": '{"lr": [0.002, 0.004, 0.008]}'}


def parameters_of(model: dict) -> int:
    from lowcomm_task.model import GPT, GPTConfig

    return sum(p.numel() for p in GPT(GPTConfig(**model)).parameters())


def derived_recipe(form: str, dense_settings: dict, sync_every: int, **outer) -> dict:
    """The recipe's grid settings over its entry: the dense run's own (its lr, warm-up, Muon lr) and
    the lowcomm section of :func:`sign_recipe` at H ``sync_every`` (and ``outer``'s other outer settings)."""
    spec_keys = {k: v for k, v in dense_settings.items() if not k.startswith("peer.")}
    muon = {"muon_lr": dense_settings["peer.muon_lr"]} if form == "muon" else {}
    if form == "muon" and "peer.muon_momentum" in dense_settings:
        muon["muon_momentum"] = dense_settings["peer.muon_momentum"]
    section = sign_recipe(form, sync_every=sync_every, **muon, **outer)
    return {**spec_keys, **{f"lowcomm.{k}": v for k, v in section.items()}}


LONG_ENTRY = "muloco_sign_long"
LONG_BUDGET = 3000  # the budget over which the long-H recipe's growth of H was picked (long_h)


def long_recipe(dense_settings: dict, budget: int) -> dict:
    """The long-H recipe (recipes.RECOMMENDED's muloco_sign_long) around the dense Muon run's settings,
    its growth of H scaled from its 3000-step budget to ``budget`` (each from_step at least one past
    the last): the same shape of H over a shorter run."""
    section = RECOMMENDED[LONG_ENTRY]["lowcomm"]
    settings = derived_recipe("muon", dense_settings, **{k: v for k, v in section.items() if k in SIGN_OUTER})
    schedule, last = [], 0
    for step, h in section.get("sync_every_schedule", ()):
        last = max(last + 1, round(step * budget / LONG_BUDGET))
        schedule.append([last, h])
    return {**settings, **({"lowcomm.sync_every_schedule": schedule} if schedule else {})}


class Runner:
    """Runs (spec, peer) on ``workers`` local processes, each result cached by its exact spec."""

    def __init__(self, out: Path, workers: int):
        self.cache, self.workers = out / "cache", workers

    def __call__(self, spec, peer) -> dict:
        key = json.dumps({"spec": spec.to_dict(), "peer": peer, "workers": self.workers}, sort_keys=True, default=str)
        path = self.cache / f"{spec.label}-s{spec.seed}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
        if path.exists():
            return json.loads(path.read_text())
        per_rank = run_local_workers(train_one, self.workers, spec, peer)
        result = {"history": per_rank[0]["history"], "final_val_loss": per_rank[0]["final_val_loss"],
                  "bytes_sent_per_worker": sum(r["bytes_sent"] for r in per_rank) / self.workers}
        self.cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(path)
        return result


def loss_at_step(history: list[dict], step: int) -> float:
    """Held-out loss of the evaluation at ``step`` (refused when there is none: pick --target-frac
    and --eval-every so that it is one)."""
    for h in history:
        if h["step"] == step:
            return h["val_loss"]
    raise SystemExit(f"no evaluation at step {step}: --target-frac x --budget must be a multiple of --eval-every")


def tune_dense(runner, base, base_peer, grid: list[dict], target_frac: float, budget: int, log, name: str):
    """Steps 1-2 of the fair protocol: each of ``grid`` on seed 0 over the whole budget, the best the
    lowest final held-out loss, the target its held-out loss at ``target_frac`` x ``budget``.
    Returns (the runs as (final loss, settings, run), the best settings, its run, the target)."""
    tuned = []
    for combo in grid:
        spec, peer = with_settings(dataclasses.replace(base, seed=0), base_peer, combo)
        run = runner(spec, peer)
        tuned.append((run["final_val_loss"], combo, run))
        log(f"tune {name} {json.dumps(combo, sort_keys=True)}: final {run['final_val_loss']:.4f}")
    _, best_combo, best_run = min(tuned, key=lambda t: t[0])
    target_step = round(target_frac * budget)
    target = loss_at_step(best_run["history"], target_step)
    log(f"best of {name}: {json.dumps(best_combo, sort_keys=True)}, target {target:.4f} (its loss at step {target_step})")
    return tuned, best_combo, best_run, target


def row_of(entry, form, run, target, role, seed, sync_every, settings, common) -> dict:
    history = run["history"]
    steps = steps_to_target(history, target) if target is not None else None
    interp = at_target(history, target, "step") if target is not None else None
    sent = bytes_to_target(history, target, run["bytes_sent_per_worker"]) if target is not None \
        else run["bytes_sent_per_worker"]
    return {**common, "entry": entry, "form": form, "role": role, "seed": seed, "H": sync_every,
            "steps_to_target": steps, "steps_interpolated": None if interp is None else round(interp, 2),
            "target_loss": target, "bytes_sent_per_worker": sent, "final_val_loss": run["final_val_loss"],
            "last_step": history[-1]["step"] if history else 0, "settings": json.dumps(settings, sort_keys=True)}


def run_form(form: str, args, runner: Runner, model: dict, common: dict, log) -> list[dict]:
    rows = []
    dense_entry = DENSE_ENTRY[form]
    base, base_peer = entry_spec(dense_entry, args.budget, args.eval_every, model)
    base = dataclasses.replace(base, warmup=args.warmup, batch=args.batch, device=args.device, backend=args.backend)
    grid = parse_grid(getattr(args, f"{form}_grid") or DEFAULT_GRIDS[form])
    # 1-2. the dense baseline tuned on seed 0, whole budget; the target
    tuned, best_combo, best_run, target = tune_dense(runner, base, base_peer, grid, args.target_frac, args.budget,
                                                     lambda m: log(f"{form} {m}"), dense_entry)
    for _, combo, run in tuned:
        rows.append(row_of(dense_entry, form, run, target, "tune", 0, 1, combo, common))
    recipe_base, _ = entry_spec(RECIPE_ENTRY[form], args.budget, args.eval_every, model)
    recipe_base = dataclasses.replace(recipe_base, label=RECIPE_NAME[form], warmup=args.warmup, batch=args.batch,
                                      device=args.device, backend=args.backend)
    for seed in parse_seeds(args.seeds):  # 3. every entry on the measuring seeds, to the target
        if seed == 0:  # the tuning seed (a one-seed check, as on a lent GPU): the best tuning run itself
            dense_run = best_run
        else:
            spec, peer = with_settings(dataclasses.replace(base, seed=seed, stop_at_val_loss=target), base_peer,
                                       best_combo)
            dense_run = runner(spec, peer)
        rows.append(row_of(dense_entry, form, dense_run, target, "seed", seed, 1, best_combo, common))
        log(f"{form} seed {seed} {dense_entry}: steps {rows[-1]['steps_to_target']}")
        for h in args.sync_every:
            settings = derived_recipe(form, best_combo, h)
            spec, _ = with_settings(dataclasses.replace(recipe_base, seed=seed, stop_at_val_loss=target,
                                                        lowcomm={}), None, settings)
            rows.append(row_of(RECIPE_NAME[form], form, runner(spec, None), target, "seed", seed, h, settings, common))
            log(f"{form} seed {seed} {RECIPE_NAME[form]} H {h}: steps {rows[-1]['steps_to_target']}")
        if form == "muon" and args.long:  # the long-H recipe, its row's H the last of its growth
            settings = long_recipe(best_combo, args.budget)
            spec, _ = with_settings(dataclasses.replace(recipe_base, label=LONG_ENTRY, seed=seed, stop_at_val_loss=target,
                                                        lowcomm={}), None, settings)
            schedule = settings.get("lowcomm.sync_every_schedule")
            h = schedule[-1][1] if schedule else settings["lowcomm.sync_every"]
            rows.append(row_of(LONG_ENTRY, form, runner(spec, None), target, "seed", seed, h, settings, common))
            log(f"{form} seed {seed} {LONG_ENTRY} H {h}: steps {rows[-1]['steps_to_target']}")
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per model size, device, form, entry and H: the measuring seeds' median steps to the target
    and its ratio to the dense entry's (None where a seed missed the target), and the bytes' ratio."""
    out = []
    for size, device, form in dict.fromkeys((r["parameters"], r["device"], r["form"]) for r in rows):
        seeds = [r for r in rows if (r["parameters"], r["device"], r["form"]) == (size, device, form)
                 and r["role"] == "seed"]
        groups = {}
        for r in seeds:
            groups.setdefault((r["entry"], r["H"]), []).append(r)
        dense = next(v for (e, _), v in groups.items() if e == DENSE_ENTRY[form])
        dense_steps = _median([r["steps_to_target"] for r in dense])
        dense_bytes = statistics.median(r["bytes_sent_per_worker"] for r in dense)
        for (entry, h), group in groups.items():
            med = _median([r["steps_to_target"] for r in group])
            sent = statistics.median(r["bytes_sent_per_worker"] for r in group)
            out.append({"form": form, "entry": entry, "parameters": group[0]["parameters"],
                        "device": group[0]["device"], "H": h, "seeds": ",".join(str(r["seed"]) for r in group),
                        "median_steps": med, "steps": ",".join(str(r["steps_to_target"]) for r in group),
                        "ratio_to_dense": None if med is None or not dense_steps else round(med / dense_steps, 4),
                        "median_bytes_sent_per_worker": sent,
                        "bytes_ratio_to_dense": round(dense_bytes / sent, 2) if sent else None,
                        "target_loss": group[0]["target_loss"], "dense_settings": dense[0]["settings"]})
    return out


def largest_h_within(summary: list[dict], form: str, ratio: float, parameters=None) -> int | None:
    """The largest H of ``form``'s recipe whose median steps are within ``ratio`` x the dense's (at
    the model size ``parameters``, where a summary holds several)."""
    ok = [int(r["H"]) for r in summary if r["form"] == form and r["entry"] == RECIPE_NAME[form]
          and (parameters is None or int(r["parameters"]) == int(parameters))
          and r["ratio_to_dense"] not in (None, "") and float(r["ratio_to_dense"]) <= ratio]
    return max(ok) if ok else None


def read_csv(path: str | Path) -> list[dict]:
    """A scale.csv's rows, typed as the benchmark writes them."""
    return read_typed_csv(path, ("parameters", "seed", "H", "steps_to_target", "last_step", "budget"),
                          ("steps_interpolated", "target_loss", "bytes_sent_per_worker", "final_val_loss"))


def collect(out: str | Path, sources: list[str]) -> list[dict]:
    """Every run's rows of ``sources`` (scale.csv files: CPU sizes, a GPU check's -scale.csv) into
    ``out`` (docs/bench/model-size/steps-to-target.csv), and their summary beside it (:func:`summary_path`); a row that
    ``out`` already holds (same entry, size, device, role, seed, H, settings) is replaced."""
    return collect_csv(out, sources, read_csv, ("entry", "parameters", "device", "role", "seed", "H", "settings"),
                       lambda r: (r["parameters"], r["device"], r["form"], r["role"] != "tune", r["seed"],
                                  r["entry"] != DENSE_ENTRY[r["form"]], r["H"]), COLUMNS, summarize, SUMMARY_COLUMNS)


def _median(values):
    return statistics.median(values) if values and None not in values else None


def main(argv: list[str] | None = None) -> dict:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    collecting = collect_args(argv, "scale.csv")
    if collecting:
        rows = collect(*collecting)
        return {"rows": rows, "summary": summarize(rows)}
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="sequences per worker per step")
    ap.add_argument("--budget", type=int, default=300, help="each run's schedule, in steps")
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--target-frac", type=float, default=2 / 3,
                    help="the target: the tuned dense run's held-out loss at this fraction of the budget")
    ap.add_argument("--forms", default="muon", help=f"comma list of {', '.join(DENSE_FORMS)}")
    ap.add_argument("--muon-grid", default=None, help=f"dense Muon's tuning grid (default {DEFAULT_GRIDS['muon']})")
    ap.add_argument("--adamw-grid", default=None, help=f"dense AdamW's tuning grid (default {DEFAULT_GRIDS['adamw']})")
    ap.add_argument("--seeds", default="1,2,3", help="the measuring seeds (tuning is on seed 0)")
    ap.add_argument("--sync-every", default="5,10,20", help="the recipe's H values, comma list")
    ap.add_argument("--long", action="store_true",
                    help="with form muon, also the long-H recipe (muloco_sign_long), its growth of H scaled to --budget")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--out", default="runs/bench/scale")
    args = ap.parse_args(argv)
    forms = [f.strip() for f in args.forms.split(",") if f.strip()]
    if not forms or any(f not in DENSE_FORMS for f in forms):
        raise SystemExit(f"--forms must name {', '.join(DENSE_FORMS)}; got {args.forms!r}")
    try:
        args.sync_every = [int(h) for h in args.sync_every.split(",")]
    except ValueError:
        args.sync_every = []
    if not args.sync_every or any(h < 1 for h in args.sync_every):
        raise SystemExit(f"--sync-every: a comma list of integers >= 1; got {args.sync_every!r}")
    if not 0 < args.target_frac <= 1:
        raise SystemExit(f"--target-frac must be in (0, 1]; got {args.target_frac}")
    model = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "seq_len": args.seq_len}
    out = Path(args.out)
    device = args.device
    if device.startswith("cuda"):
        import torch

        device = torch.cuda.get_device_name(0)
    common = {"parameters": parameters_of(model), "device": device, "budget": args.budget}
    runner = Runner(out, args.workers)

    def log(msg):
        print(f"[scale {args.n_layer}x{args.n_embd}] {msg}", flush=True)

    rows = []
    for form in forms:
        rows += run_form(form, args, runner, model, common, log)
        out.mkdir(parents=True, exist_ok=True)
        write_csv(out / "scale.csv", rows, COLUMNS)
    summary = summarize(rows)
    write_csv(out / "summary.csv", summary, SUMMARY_COLUMNS)
    for r in summary:
        log(f"{r['form']} {r['entry']} H {r['H']}: median steps {r['median_steps']} ({r['steps']}), "
            f"{r['ratio_to_dense']}x dense, {r['bytes_ratio_to_dense']}x fewer bytes")
    for form in forms:
        log(f"{form}: largest H within 1.10x dense: {largest_h_within(summary, form, 1.10)}")
    return {"rows": rows, "summary": summary}


if __name__ == "__main__":
    main()
