"""``python -m lowcomm_bench sweep``: an entry's settings that matter, against steps to adamw's
held-out loss and the loss at a fixed budget, on one or more seeds.

The entries are ``time_to_loss``'s, built the same way (:func:`lowcomm_bench.time_to_loss.entry_spec`):
ds_lowcomm's methods and variants, and the peers (DDP + PowerSGD, torchft's DiLoCo and Streaming
DiLoCo, the DDP forms of adamw). For each combination of ``--grid`` (JSON: ``{"lr": [..],
"lowcomm.sync_every": [..], "peer.rank": [..]}``; keys: the spec's :data:`SPEC_KEYS`, a method's
``lowcomm.<key>`` or a peer's ``peer.<key>`` of :data:`PEER_SETTINGS`, merged over the entry's
recipe) and each of ``--seeds`` (the spec's ``seed``: initialisation and the order of the
batches), the reference task trains on ``--workers`` local processes for ``--budget`` steps (its
schedule spread over them) and records the first evaluation at or below ``--target`` (adamw's
held-out loss after 300 steps on 2 workers, 2.1140, the target of ``time_to_loss``; rows before
2026-11-25 used 2.1075, adamw's loss at step 225 of its 900-step schedule, slightly stricter),
the final held-out loss and the bytes sent per worker. Steps and losses do not depend on the link
(the exchanges are deterministic), so this runs on loopback and its steps hold for
``time_to_loss``'s test hosts. Each (configuration, seed) runs in its own worker processes and
its row is appended to ``sweep.csv`` under ``--out`` as it finishes.

``sweep.csv``: one row per (configuration, seed); the ``method`` column holds the entry's name
(a method, variant or peer) and ``seed`` is the last column. Rows written before it had a seed
column (all at the spec's default seed 0) still load: :func:`read_rows` reads a missing or empty
seed as 0, and appending to such a file rewrites its header with ``seed`` added (those rows'
seed left empty).

The fair protocol (issue 27): the same count of configurations for every entry (``--budget-configs
N`` refuses a grid of another size; :func:`configs_per_entry` counts them in a sweep.csv), tuned on
seed 0 (:func:`best`: each entry's configuration with the fewest steps to the target there, ties
by final loss), which ``time_to_loss --from-sweep sweep.csv`` then runs on every seed.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import os
from pathlib import Path

from ds_lowcomm.config import ConfigError
from lowcomm_task.train import train_worker
from lowcomm_task.workers import run_local_workers

from .runs import add_model_args, model_of
from .time_to_loss import ENTRIES, entry_spec, steps_to_target
from .tuning import (PEER_SETTINGS, SPEC_KEYS, allowed_keys, best, check_keys, configs_per_entry, parse_seeds,  # noqa: F401
                     read_rows, with_settings)

COLUMNS = ["method", "workers", "budget", "settings", "steps_to_target", "final_val_loss", "target_loss",
           "bytes_sent_per_worker", "seed"]
def parse_grid(text: str) -> list[dict]:
    """The configurations of ``--grid`` (a JSON object of non-empty lists), in product order."""
    try:
        grid = json.loads(text)
    except json.JSONDecodeError as err:
        raise SystemExit(f"--grid: not JSON ({err})") from None
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise SystemExit('--grid: a JSON object whose values are non-empty lists, e.g. {"lr": [0.001]}')
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def train_one(rank: int, world: int, spec, peer: dict | None) -> dict:
    """One run in a worker process (a fresh one per run: a peer patches torch.distributed and
    starts torchft's servers for the life of its process)."""
    make_step = None
    if peer is not None:
        from .peers import peer_step

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # torchft's peer finds its own address from it
        make_step = peer_step(peer)
    r = train_worker(rank, world, spec, make_step=make_step)
    return {"history": r["history"], "final_val_loss": r["final_val_loss"], "bytes_sent": r["bytes_sent"]}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--entry", "--method", dest="entry", required=True,
                    help=f"a time_to_loss entry: {', '.join(ENTRIES)}")
    ap.add_argument("--grid", required=True,
                    help='JSON object of lists, e.g. {"lr": [0.001, 0.002], "peer.rank": [4, 8]}')
    ap.add_argument("--seeds", default="0", help="comma list: every configuration runs at each (default 0)")
    ap.add_argument("--budget-configs", type=int, default=None, metavar="N",
                    help="refuse a grid of other than N configurations (the same tuning budget for every entry)")
    ap.add_argument("--target", type=float, default=2.1140, help="held-out loss to reach (adamw's, 300 steps)")
    ap.add_argument("--budget", type=int, default=900)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--stop-at-target", action="store_true", help="stop each run at the target (faster)")
    ap.add_argument("--out", default="runs/bench/sweep")
    add_model_args(ap)
    args = ap.parse_args(argv)
    if args.entry not in ENTRIES:
        raise SystemExit(f"--entry: unknown {args.entry!r}; allowed: {', '.join(ENTRIES)}")
    combos, seeds = parse_grid(args.grid), parse_seeds(args.seeds)
    if args.budget_configs is not None and len(combos) != args.budget_configs:
        raise SystemExit(f"--grid has {len(combos)} configurations; --budget-configs asks for {args.budget_configs}")
    # everything checked before any worker starts: the keys, every spec, the file's header
    base, base_peer = entry_spec(args.entry, args.budget, args.eval_every, model_of(args))
    check_keys(args.entry, base_peer, combos[0])
    jobs = []
    for combo in combos:
        try:
            spec, peer = with_settings(base, base_peer, combo)
        except (ConfigError, TypeError, ValueError) as err:
            raise SystemExit(f"--grid {json.dumps(combo, sort_keys=True)}: {err}") from None
        if args.stop_at_target:
            spec = dataclasses.replace(spec, stop_at_val_loss=args.target)
        jobs += [(combo, seed, dataclasses.replace(spec, seed=seed), peer) for seed in seeds]
    path = Path(args.out) / "sweep.csv"
    _header_of(path)
    rows = []
    for combo, seed, spec, peer in jobs:
        per_rank = run_local_workers(train_one, args.workers, spec, peer)
        r = per_rank[0]
        rows.append({"method": args.entry, "workers": args.workers, "budget": args.budget,
                     "settings": json.dumps(combo, sort_keys=True),
                     "steps_to_target": steps_to_target(r["history"], args.target),
                     "final_val_loss": r["final_val_loss"], "target_loss": args.target,
                     "bytes_sent_per_worker": sum(x["bytes_sent"] for x in per_rank) / args.workers, "seed": seed})
        print(f"{args.entry} {rows[-1]['settings']} seed {seed}: steps to target {rows[-1]['steps_to_target']}, "
              f"final {r['final_val_loss']:.4f}", flush=True)
        append_rows(path, rows[-1:])
    return rows


def _header_of(path: Path) -> list[str] | None:
    """The header of an existing sweep.csv (None if there is none); refuses one that is neither
    :data:`COLUMNS` nor the columns before ``seed`` (the format before seeds)."""
    if not path.exists() or path.stat().st_size == 0:
        return None
    with open(path, newline="") as f:
        header = next(csv.reader(f), None)
    if header not in (COLUMNS, COLUMNS[:-1]):
        raise SystemExit(f"{path}: header {header} is not a sweep.csv's ({', '.join(COLUMNS)})")
    return header


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append ``rows`` to ``path`` (with a header if new); a file without the seed column gets it
    (its rows' seed left empty, which :func:`read_rows` reads as 0)."""
    header = _header_of(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if header == COLUMNS[:-1]:
        with open(path, newline="") as f:
            old = list(csv.DictReader(f))
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows({**r, "seed": ""} for r in old)
        header = COLUMNS
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        if header is None:
            w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
