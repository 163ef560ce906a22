"""``python -m lowcomm_bench long_h``: the one-bit recipe at long outer intervals against dense Muon,
over budgets as long as users train, each long-H candidate tuned alike.

The fair protocol of ``bench scale`` at a longer ``--budget``:

1. **Dense Muon tuned** on seed 0 over ``--muon-grid`` (each run the whole budget); the best is
   the lowest final held-out loss. With ``--tuned-from`` (a long_h.csv of another replica count)
   its best settings carry over instead (one run, no tuning: the settings tuned at 2 replicas
   run at 8), read from that CSV's rows of the model size, replicas and budget it tuned at. With
   ``--dense-from`` (a long_h.csv measured on this machine) that CSV's dense Muon tuning rows of
   this model, replica count and budget stand in for dense Muon's seed-0 runs (its best's
   settings, target and steps), so they are not run again; losses differ between machines, so
   only a CSV of the same machine will do.
2. **The target**: that run's held-out loss at ``--target-frac`` x budget.
3. **Each candidate tuned** on seed 0 over its grid (:data:`CANDIDATES`; the same count of
   configurations as dense Muon's, ``--budget-configs`` refuses another), every run stopping at the
   target: its settings over the recipe (:func:`ds_lowcomm.optim.recipes.sign_recipe`) around the
   tuned dense Muon. Its best (:func:`pick`): the fewest bytes to the target among its
   configurations within ``--within`` x dense Muon's steps on seed 0, else the fewest steps.
4. **Measured on ``--seeds``** (1,2,3): dense Muon and every candidate's best, to the target.

Rows go to ``long_h.csv`` under ``--out`` (``role`` tune or seed), with bytes per worker to the
target sent and received (the ledgers' mean over ranks at the first evaluation at the target;
DDP's by its comm hook), and ``vs_ddp_bf16``: DDP's bytes with bf16 gradients to dense Muon's
median steps (a ring all-reduce: 2(n-1)/n x 2 bytes a parameter a step) over the larger of the
two. ``long_h_summary.csv``: per entry the medians over the seeds, and ratios to dense Muon.
Every run is cached under ``--out``/cache by its exact spec (fields left at their defaults are
left out of the key, so a new field does not void old runs): a stopped invocation resumes.

Every row names its ``machine`` (:func:`runs.machine_kind`): the same commit gives other losses on
another kind of machine, so figures are compared only within one. A cached run made on another
kind is refused, as is ``--dense-from`` with another kind's rows; the summary keeps each kind's
rows apart; ``--tuned-from`` carries settings from any kind (settings carry, losses don't). The
same holds for ``--data-shards`` (how the training bytes are split between replicas): each row
names its layout, and figures are compared within one.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
from pathlib import Path

from ds_lowcomm.optim.recipes import sign_recipe
from lowcomm_task.data import DATA_SHARDS
from lowcomm_task.spec import TrainSpec
from lowcomm_task.workers import run_local_workers

from .codec import collect_args, collect_csv, read_typed_csv, write_csv
from .runs import NOT_RECORDED, at_target, machine_kind, run_group
from .scale import parameters_of, tune_dense
from .sweep import parse_grid, train_one
from .time_to_loss import entry_spec, steps_to_target
from .tuning import parse_seeds, with_settings

COLUMNS = ["entry", "parameters", "replicas", "budget", "seed", "H", "schedule", "steps_to_target", "bytes_sent_per_worker",
           "bytes_received_per_worker", "settings", "role", "target_loss", "steps_interpolated", "final_val_loss",
           "last_step", "device", "vs_ddp_bf16", "machine", "data_shards"]
SUMMARY_COLUMNS = ["entry", "parameters", "replicas", "budget", "H", "schedule", "seeds", "steps", "median_steps", "ratio_to_muon",
                   "median_bytes_per_worker", "vs_ddp_bf16", "target_loss", "settings", "machine", "data_shards"]
DENSE = "muon"
DEFAULT_MUON_GRID = '{"peer.muon_lr": [0.02, 0.03, 0.05], "lr": [0.008]}'
# Each candidate: a grid of lowcomm settings over the recipe (sign_recipe's keys and the outer
# loop's), three configurations each (dense Muon's tuning budget).
CANDIDATES: dict[str, dict | list] = {
    "recipe": {"sync_every": [20, 30, 50]},
    # DiLoCo's outer Nesterov momentum (outer lr 0.7, momentum 0.9) and around it: the same
    # momentum at a smaller lr (0.2: about the recipe's step in a steady direction), a lighter one
    "nesterov": [{"sync_every": 30, "outer_lr": 0.7, "outer_momentum": 0.9},
                 {"sync_every": 30, "outer_lr": 0.2, "outer_momentum": 0.9},
                 {"sync_every": 30, "outer_lr": 0.6, "outer_momentum": 0.5}],
    # two bits an element (a 4-level lookup per tensor): twice the bytes a sync, so H twice as long
    "two_bit": {"value_dtype": ["2bit"], "sync_every": [40, 60, 80]},
    # Streaming DiLoCo: each sync carries one of the fragments in turn, landing a step later, mixed
    # half and half with the local fragment (the paper's alpha 0.5)
    "streaming": {"sync_every": [30], "fragments": [2, 3, 5], "sync_delay": [1], "fragment_mix": [0.5]},
    # H growing during training: H 5 for 100 steps, reaching 30 / 50 / 80 before mid-budget (of
    # 3000); 101 / 84 / 76 syncs to step 2000 (H 20 throughout: 100), so the bytes can reach 400x
    # DDP's (a ramp that stays short until step 1500 syncs about 160 times there)
    "growing": {"sync_every": [5], "sync_every_schedule": [[[100, 10], [300, 20], [600, 30]],
                                                           [[100, 10], [300, 25], [800, 50]],
                                                           [[100, 10], [300, 30], [1000, 80]]]},
    # (eager updates, arXiv 2502.12996, the outer step at the send: measured at H 20, 30 and 50,
    # lost to the growing H and deleted; docs/results/long-intervals.md)
}


class Runner:
    """Runs (spec, peer) on ``workers`` local processes; each result cached by its spec's fields
    that differ from TrainSpec's defaults, the peer and the worker count, with the ``machine`` it
    ran on (a cached run of another kind is refused; one cached before the field existed is taken)."""

    def __init__(self, out: Path, workers: int, machine: str):
        self.cache, self.workers, self.machine = out / "cache", workers, machine

    def key(self, spec, peer) -> str:
        default = TrainSpec().to_dict()
        fields = {k: v for k, v in spec.to_dict().items() if v != default.get(k)}
        return json.dumps({"spec": fields, "peer": peer, "workers": self.workers}, sort_keys=True, default=str)

    def __call__(self, spec, peer) -> dict:
        path = self.cache / f"{spec.label}-s{spec.seed}-{hashlib.sha256(self.key(spec, peer).encode()).hexdigest()[:16]}.json"
        if path.exists():
            cached = json.loads(path.read_text())
            if cached.get("machine", self.machine) != self.machine:
                raise SystemExit(f"{path}: a run cached on {cached['machine']}, and this machine is {self.machine}; "
                                 "losses differ between kinds of machine: give this one its own --out")
            return cached
        per_rank = run_local_workers(train_one_bytes, self.workers, spec, peer)
        history = per_rank[0]["history"]
        for i, row in enumerate(history):  # every rank's bytes, averaged
            row["bytes_sent"] = statistics.fmean(r["history"][i]["bytes_sent"] for r in per_rank)
            row["bytes_received"] = statistics.fmean(r["history"][i].get("bytes_received", 0) for r in per_rank)
        result = {"history": history, "final_val_loss": per_rank[0]["final_val_loss"], "machine": self.machine}
        self.cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(path)
        return result


def configs_of(candidate: dict | list) -> list[dict]:
    """A candidate's configurations: its grid's product, or its list of configurations as given."""
    return [dict(c) for c in candidate] if isinstance(candidate, list) else parse_grid(json.dumps(candidate))


def train_one_bytes(rank: int, world: int, spec, peer) -> dict:
    return train_one(rank, world, spec, peer)


def bytes_at_target(history: list[dict], target: float | None) -> tuple[float, float]:
    """(sent, received) per worker at the first evaluation at the target (the run's last if none)."""
    row = next((h for h in history if target is not None and h["val_loss"] <= target), history[-1])
    return row["bytes_sent"], row.get("bytes_received", 0.0)


def ddp_bf16_bytes(parameters: int, replicas: int, steps: float) -> float:
    """Bytes per worker of DDP's per-step ring all-reduce of bf16 gradients over ``steps`` steps."""
    return 2 * (replicas - 1) / replicas * 2 * parameters * steps


def row_of(entry, run, target, role, seed, settings, common) -> dict:
    history = run["history"]
    sent, received = bytes_at_target(history, target)
    interp = at_target(history, target, "step")
    return {**common, "entry": entry, "role": role, "seed": seed,
            "H": settings.get("lowcomm.sync_every", 1) if entry != DENSE else 1,
            # H's growth, where it grows: [from_step, H] pairs
            "schedule": json.dumps(settings["lowcomm.sync_every_schedule"]) if settings.get("lowcomm.sync_every_schedule") else "",
            "steps_to_target": steps_to_target(history, target),
            "steps_interpolated": None if interp is None else round(interp, 2), "target_loss": target,
            "bytes_sent_per_worker": sent, "bytes_received_per_worker": received,
            "final_val_loss": run["final_val_loss"], "last_step": history[-1]["step"] if history else 0,
            "settings": json.dumps(settings, sort_keys=True)}


def pick(rows: list[dict], dense_steps: int, within: float) -> dict:
    """A candidate's best tuning row: the fewest bytes to the target among those within ``within``
    x dense Muon's steps, else the fewest steps (ties by final loss)."""
    ok = [r for r in rows if r["steps_to_target"] is not None and r["steps_to_target"] <= within * dense_steps]
    if ok:
        return min(ok, key=lambda r: (max(r["bytes_sent_per_worker"], r["bytes_received_per_worker"]),
                                      r["steps_to_target"]))
    return min(rows, key=lambda r: (r["steps_to_target"] is None, r["steps_to_target"] or 0, r["final_val_loss"]))


def recipe_settings(dense_settings: dict, candidate: dict) -> dict:
    """The recipe's grid settings over its entry: the dense run's own (lr, Muon lr) and the lowcomm
    section of :func:`sign_recipe` with the candidate's outer settings over it."""
    spec_keys = {k: v for k, v in dense_settings.items() if not k.startswith("peer.")}
    muon = {"muon_lr": dense_settings["peer.muon_lr"]}
    if "peer.muon_momentum" in dense_settings:
        muon["muon_momentum"] = dense_settings["peer.muon_momentum"]
    outer = {k: v for k, v in candidate.items() if k in ("sync_every", "outer_lr", "outer_momentum", "decay",
                                                         "value_dtype", "topk", "chunk", "transform", "average")}
    section = {**sign_recipe("muon", **muon, **outer), **{k: v for k, v in candidate.items() if k not in outer}}
    return {**spec_keys, **{f"lowcomm.{k}": v for k, v in section.items()}}


def describe(group: tuple) -> str:
    parameters, replicas, budget, machine, shards = group
    return f"{parameters} parameters, {replicas} replicas, budget {budget}, {shards} data shards, on {machine}"


def dense_rows_from(path: str | Path, common: dict) -> list[dict]:
    """``path``'s dense Muon tuning rows of this run's model size, replica count, budget, machine and
    data layout (:func:`run_group`)."""
    rows = [r for r in read_csv(path) if r["entry"] == DENSE and r["role"] == "tune"
            and run_group(r) == run_group(common)]
    if not rows:
        raise SystemExit(f"--dense-from {path}: no dense Muon tuning row of {describe(run_group(common))} "
                         "(losses differ between machine kinds and data layouts: only this run's stand in)")
    return rows


def tuned_rows_from(path: str | Path) -> list[dict]:
    """``path``'s rows of the one (model size, replicas, budget) its candidates were tuned at: where
    a candidate has tuning rows (runs that carried settings elsewhere write none), else where dense
    Muon has more than one (a carried dense Muon writes one). A long_h.csv also holds the rows its
    settings were carried to (8 replicas, a larger model), and those must not stand in for the tuning."""
    rows = read_csv(path)
    tuned = {run_group(r) for r in rows if r["role"] == "tune" and r["entry"] != DENSE}
    if not tuned:
        dense = [run_group(r) for r in rows if r["role"] == "tune" and r["entry"] == DENSE]
        tuned = {g for g in dense if dense.count(g) > 1}
    if len(tuned) != 1:
        found = "; ".join(describe(g) for g in sorted(tuned)) or "none"
        raise SystemExit(f"--tuned-from {path}: needs the tuning of one model size, replica count, budget, machine "
                         "and data layout; "
                         f"tuned there: {found}")
    at = tuned.pop()
    return [r for r in rows if run_group(r) == at]


def carried_settings(rows: list[dict], name: str, path: str | Path) -> dict:
    """The settings ``name`` was measured with in its tuning's rows (:func:`tuned_rows_from`)."""
    measured = {r["settings"] for r in rows if r["entry"] == name and r["role"] == "seed"}
    if len(measured) != 1:
        at = describe(run_group(rows[0]))
        raise SystemExit(f"--tuned-from {path}: {len(measured) or 'no'} measured settings of {name} at {at}; "
                         "needs exactly one")
    return json.loads(measured.pop())


def pick_dense(rows: list[dict]) -> dict:
    """Dense Muon's best tuning row: the lowest final held-out loss (as :func:`scale.tune_dense` picks)."""
    return min(rows, key=lambda r: r["final_val_loss"])


def read_csv(path: str | Path) -> list[dict]:
    """A long_h.csv's rows, typed as the benchmark writes them (``machine`` :data:`NOT_RECORDED` in
    rows written before the column)."""
    rows = read_typed_csv(path, ("parameters", "replicas", "budget", "seed", "H", "steps_to_target", "last_step"),
                          ("bytes_sent_per_worker", "bytes_received_per_worker", "target_loss", "steps_interpolated",
                           "final_val_loss", "vs_ddp_bf16"))
    for r in rows:
        r["machine"] = r.get("machine") or NOT_RECORDED
        r["data_shards"] = r.get("data_shards") or "contiguous"  # the one layout before the column
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Per :func:`run_group` (size, replicas, budget, machine, data shards), entry and settings over
    the measuring seeds: median steps, its ratio to dense Muon's (of the same group), median bytes per worker to the target
    (the larger of sent and received), and DDP-bf16's bytes to dense Muon's median steps over that."""
    out = []
    for size, replicas, budget, machine, shards in dict.fromkeys(run_group(r) for r in rows):
        seeds = [r for r in rows if run_group(r) == (size, replicas, budget, machine, shards) and r["role"] == "seed"]
        groups: dict[tuple, list[dict]] = {}
        for r in seeds:
            groups.setdefault((r["entry"], r["settings"]), []).append(r)
        dense = [g for (e, _), g in groups.items() if e == DENSE]
        dense_steps = _median([r["steps_to_target"] for r in dense[0]]) if dense else None
        for (entry, settings), group in groups.items():
            med = _median([r["steps_to_target"] for r in group])
            per_worker = statistics.median(max(r["bytes_sent_per_worker"], r["bytes_received_per_worker"] or 0)
                                           for r in group)
            ddp = ddp_bf16_bytes(size, replicas, dense_steps) if dense_steps else None
            out.append({"entry": entry, "parameters": size, "replicas": replicas, "budget": budget,
                        "H": group[0]["H"], "schedule": group[0].get("schedule", ""),
                        "seeds": ",".join(str(r["seed"]) for r in group),
                        "steps": ",".join(str(r["steps_to_target"]) for r in group), "median_steps": med,
                        "ratio_to_muon": round(med / dense_steps, 4) if med and dense_steps else None,
                        "median_bytes_per_worker": per_worker,
                        "vs_ddp_bf16": round(ddp / per_worker, 1) if ddp and per_worker else None,
                        "target_loss": group[0]["target_loss"], "settings": settings, "machine": machine,
                        "data_shards": shards})
    return out


def collect(out: str | Path, sources: list[str]) -> list[dict]:
    """Every row of ``sources`` (long_h.csv files: sizes, replica counts) into ``out``
    (docs/bench/long_h.csv) and their summary beside it; a row ``out`` already holds (same entry,
    size, replicas, budget, role, seed, settings) is replaced."""
    return collect_csv(out, sources, read_csv, ("entry", "parameters", "replicas", "budget", "role", "seed", "settings",
                                                "machine", "data_shards"),
                       lambda r: (r["parameters"], r["replicas"], r["budget"], r["machine"], r["data_shards"],
                                  r["role"] != "tune", r["seed"],
                                  r["entry"] != DENSE), COLUMNS, summarize, SUMMARY_COLUMNS)


def _median(values):
    return statistics.median(values) if values and None not in values else None


def main(argv: list[str] | None = None) -> dict:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    collecting = collect_args(argv, "long_h.csv")
    if collecting:
        rows = collect(*collecting)
        return {"rows": rows, "summary": summarize(rows)}
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench long_h", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="sequences per worker per step")
    ap.add_argument("--data-shards", default="contiguous", choices=DATA_SHARDS,
                    help="how the training bytes are split between replicas (lowcomm_task.data)")
    ap.add_argument("--budget", type=int, default=3000, help="each run's schedule, in steps")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--target-frac", type=float, default=2 / 3)
    ap.add_argument("--muon-grid", default=DEFAULT_MUON_GRID, help="dense Muon's tuning grid (JSON object of lists)")
    ap.add_argument("--candidates", default=",".join(CANDIDATES),
                    help=f"comma list of {', '.join(CANDIDATES)} (empty: dense Muon alone)")
    ap.add_argument("--grid", action="append", default=[], metavar="NAME=JSON",
                    help="a candidate's grid in place of (or beside) the built-in ones, e.g. "
                         "'recipe={\"sync_every\": [20, 30, 50]}'")
    ap.add_argument("--tuned-from", default=None,
                    help="a long_h.csv: dense Muon's and each candidate's best there (its rows of the size, "
                         "replicas and budget tuned at) run here untuned")
    ap.add_argument("--tune-dense", action="store_true",
                    help="with --tuned-from: dense Muon tuned here over --muon-grid all the same (another model size)")
    ap.add_argument("--dense-from", default=None,
                    help="a long_h.csv measured on this machine: its dense Muon tuning rows of this model, replica "
                         "count and budget stand in for dense Muon's seed-0 runs (settings, target, steps)")
    ap.add_argument("--within", type=float, default=1.10, help="a candidate's pick: fewest bytes within this x dense")
    ap.add_argument("--budget-configs", type=int, default=None, help="refuse a grid of another size")
    ap.add_argument("--seeds", default="1,2,3", help="the measuring seeds (tuning is on seed 0)")
    ap.add_argument("--seed-candidates", default=None,
                    help="comma list: only these candidates run the measuring seeds (default: every one); the "
                         "others stop at their tuning (dropped on their seed-0 numbers)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--out", default="runs/bench/long_h")
    args = ap.parse_args(argv)
    grids = dict(CANDIDATES)
    for item in args.grid:
        name, _, text = item.partition("=")
        grids[name] = json.loads(text)
    names = [c for c in args.candidates.split(",") if c]
    unknown = [c for c in names if c not in grids]
    if unknown:
        raise SystemExit(f"--candidates: unknown {unknown}; allowed: {', '.join(grids)}")
    model = {"n_layer": args.n_layer, "n_embd": args.n_embd, "n_head": args.n_head, "seq_len": args.seq_len}
    out = Path(args.out)
    machine = machine_kind(args.device)
    runner = Runner(out, args.workers, machine)
    common = {"parameters": parameters_of(model), "replicas": args.workers, "budget": args.budget,
              "device": args.device, "machine": machine, "data_shards": args.data_shards}

    def log(msg):
        print(f"[long_h {args.n_layer}x{args.n_embd} {args.workers}r {args.budget}] {msg}", flush=True)

    if args.dense_from and args.tune_dense:
        raise SystemExit("--dense-from: dense Muon's tuning measured before; --tune-dense would run it again")
    tuned_from = tuned_rows_from(args.tuned_from) if args.tuned_from else None
    dense_from = dense_rows_from(args.dense_from, common) if args.dense_from else None
    carried = pick_dense(dense_from) if dense_from else None  # dense Muon's best, measured before
    base, base_peer = entry_spec(DENSE, args.budget, args.eval_every, model)
    base = dataclasses.replace(base, warmup=args.warmup, batch=args.batch, device=args.device, backend=args.backend,
                               data_shards=args.data_shards)
    if dense_from:
        dense_grid = [json.loads(carried["settings"])]
    elif tuned_from and not args.tune_dense:
        best_dense = pick_dense([r for r in tuned_from if r["entry"] == DENSE and r["role"] == "tune"])
        dense_grid = [json.loads(best_dense["settings"])]
    else:
        dense_grid = parse_grid(args.muon_grid)
    if args.budget_configs is not None and not tuned_from:
        sizes = {c: len(configs_of(grids[c])) for c in names}
        if not dense_from:  # dense Muon's tuning ran before, on its own grid
            sizes["muon"] = len(dense_grid)
        wrong = {k: v for k, v in sizes.items() if v != args.budget_configs}
        if wrong:
            raise SystemExit(f"--budget-configs {args.budget_configs}: these grids differ: {wrong}")
    rows = []
    if dense_from:  # 1-2. measured before on this machine: dense Muon's rows, its best and target carried in
        dense_best, dense_run, target = dense_grid[0], None, carried["target_loss"]
        dense_tune_steps = carried["steps_to_target"]
        rows += [dict(r) for r in dense_from]
        log(f"muon {json.dumps(dense_best, sort_keys=True)}: target {target:.4f}, steps {dense_tune_steps} "
            f"(from {args.dense_from})")
    else:
        # 1-2. dense Muon tuned on seed 0, whole budget; the target
        tuned, dense_best, dense_run, target = tune_dense(runner, base, base_peer, dense_grid, args.target_frac,
                                                          args.budget, log, DENSE)
        for _, combo, run in tuned:
            rows.append(row_of(DENSE, run, target, "tune", 0, combo, common))
        dense_tune_steps = rows[[t[1] for t in tuned].index(dense_best)]["steps_to_target"]

    recipe_base, _ = entry_spec("muloco_sign", args.budget, args.eval_every, model)
    recipe_base = dataclasses.replace(recipe_base, warmup=args.warmup, batch=args.batch, device=args.device,
                                      backend=args.backend, lowcomm={}, data_shards=args.data_shards)

    def recipe_run(settings: dict, seed: int, label: str):
        spec, _ = with_settings(dataclasses.replace(recipe_base, seed=seed, stop_at_val_loss=target, label=label),
                                None, settings)
        return runner(spec, None)

    chosen = {}
    for name in names:  # 3. each candidate tuned on seed 0, to the target
        if tuned_from:
            chosen[name] = carried_settings(tuned_from, name, args.tuned_from)
            if args.tune_dense:  # the candidate's outer settings around this size's tuned dense Muon
                chosen[name] = {**chosen[name], **{k: v for k, v in dense_best.items() if not k.startswith("peer.")},
                                "lowcomm.inner_muon_lr": dense_best["peer.muon_lr"]}
            continue
        cand_rows = []
        for combo in configs_of(grids[name]):
            settings = recipe_settings(dense_best, combo)
            run = recipe_run(settings, 0, name)
            cand_rows.append(row_of(name, run, target, "tune", 0, settings, common))
            r = cand_rows[-1]
            log(f"tune {name} {json.dumps(combo, sort_keys=True)}: steps {r['steps_to_target']}, "
                f"bytes {max(r['bytes_sent_per_worker'], r['bytes_received_per_worker']) / 1e6:.3f} MB")
        rows += cand_rows
        chosen[name] = json.loads(pick(cand_rows, dense_tune_steps, args.within)["settings"])
        log(f"{name}: picked {json.dumps(chosen[name], sort_keys=True)}")
    for seed in parse_seeds(args.seeds):  # 4. the measuring seeds
        if seed == 0 and dense_from:  # its seed-0 run is the carried row
            rows.append({**carried, "role": "seed"})
        else:
            if seed == 0:
                dense_seed_run = dense_run
            else:
                spec, peer = with_settings(dataclasses.replace(base, seed=seed, stop_at_val_loss=target), base_peer,
                                           dense_best)
                dense_seed_run = runner(spec, peer)
            rows.append(row_of(DENSE, dense_seed_run, target, "seed", seed, dense_best, common))
        log(f"seed {seed} muon: steps {rows[-1]['steps_to_target']}")
        for name, settings in chosen.items():
            if args.seed_candidates is not None and name not in args.seed_candidates.split(","):
                continue
            rows.append(row_of(name, recipe_run(settings, seed, name), target, "seed", seed, settings, common))
            log(f"seed {seed} {name}: steps {rows[-1]['steps_to_target']}")
    summary = summarize(rows)
    ddp_of = {(s["entry"], s["settings"]): s["vs_ddp_bf16"] for s in summary}
    for r in rows:
        r["vs_ddp_bf16"] = ddp_of.get((r["entry"], r["settings"]))
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "long_h.csv", rows, COLUMNS)
    write_csv(out / "long_h_summary.csv", summary, SUMMARY_COLUMNS)
    for s in summary:
        log(f"{s['entry']} H {s['H']}: median steps {s['median_steps']} ({s['steps']}), {s['ratio_to_muon']}x muon, "
            f"{s['vs_ddp_bf16']}x fewer bytes than DDP bf16")
    return {"rows": rows, "summary": summary}


if __name__ == "__main__":
    main()
