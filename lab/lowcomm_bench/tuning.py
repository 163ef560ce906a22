"""What ``bench sweep`` records, read back: an entry's grid keys and how a configuration applies
to its (spec, peer) (:func:`with_settings`), the rows of a sweep.csv, the tuning budget each
entry had (:func:`configs_per_entry`) and each entry's best configuration (:func:`best`), which
``time_to_loss --from-sweep`` runs. No import of the benchmarks themselves: ``sweep`` builds on
``time_to_loss``'s entries, and ``time_to_loss`` reads the sweep's results through this module.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

# The spec's fields a grid may set (the optimizer and its schedule; the budget, evaluations and
# seeds have their own flags)
SPEC_KEYS = ("lr", "betas", "weight_decay", "warmup", "clip_grad", "lr_decay")
# A peer's settings a grid may set (``peer.<key>``), by peer kind (see lowcomm_bench.peers)
PEER_SETTINGS = {
    "ddp_powersgd": ("rank", "start_iter"),
    "torchft_diloco": ("sync_every", "fragments", "sync_delay", "fragment_update_alpha", "outer_lr", "outer_momentum",
                       "optimizer", "muon_lr", "muon_momentum", "adjust_lr_fn"),
    "ddp": ("compress", "bucket_cap_mb", "optimizer", "muon_lr", "muon_momentum", "adjust_lr_fn"),
}


def allowed_keys(peer: dict | None) -> list[str]:
    """The grid keys of an entry: :data:`SPEC_KEYS`, then ``lowcomm.<key>`` (a method) or the
    ``peer.<key>`` of its kind (a peer)."""
    if peer is None:
        return [*SPEC_KEYS, "lowcomm.<key>"]
    return [*SPEC_KEYS, *(f"peer.{k}" for k in PEER_SETTINGS.get(peer["kind"], ()))]


def check_keys(entry: str, peer: dict | None, keys) -> None:
    """Refuse (SystemExit) a grid key ``entry`` does not take, naming it and the allowed ones."""
    allowed = allowed_keys(peer)
    for key in keys:
        ok = key in SPEC_KEYS or (key.startswith("lowcomm.") and peer is None and len(key) > len("lowcomm.")) \
            or (peer is not None and key in allowed)
        if not ok:
            raise SystemExit(f"--grid: key {key!r} is not a setting of {entry}; allowed: {', '.join(allowed)}")


def with_settings(spec, peer: dict | None, settings: dict):
    """(spec, peer) with ``settings`` applied: :data:`SPEC_KEYS` fields of the spec,
    ``lowcomm.<key>`` in its lowcomm section, ``peer.<key>`` in (a copy of) the peer's settings.
    The spec is checked as it is built (a bad lowcomm key or value raises ConfigError)."""
    if not settings:
        return spec, peer
    lowcomm, fields, peer = dict(spec.lowcomm), {}, (dict(peer) if peer is not None else None)
    for key, value in settings.items():
        if key.startswith("lowcomm."):
            lowcomm[key.split(".", 1)[1]] = value
        elif key.startswith("peer."):
            peer[key.split(".", 1)[1]] = value
        else:
            fields[key] = value
    return dataclasses.replace(spec, lowcomm=lowcomm, **fields), peer


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds: a comma list of distinct integers >= 0, e.g. 0,1,2; got {text!r}")
    return seeds


def read_rows(path: str | Path) -> list[dict]:
    """sweep.csv's rows, typed: settings a dict, steps_to_target an int or None, seed an int (0
    where the file has no seed column or the row none: the spec's default seed those runs used)."""
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            out.append({**r, "workers": int(r["workers"]), "budget": int(r["budget"]),
                        "settings": json.loads(r["settings"]),
                        "steps_to_target": int(r["steps_to_target"]) if r["steps_to_target"] else None,
                        "final_val_loss": float(r["final_val_loss"]), "target_loss": float(r["target_loss"]),
                        "bytes_sent_per_worker": float(r["bytes_sent_per_worker"]),
                        "seed": int(r.get("seed") or 0)})
    return out


def _config(row: dict) -> tuple:
    return row["budget"], json.dumps(row["settings"], sort_keys=True)


def configs_per_entry(path: str | Path) -> dict[str, int]:
    """{entry: how many configurations (distinct settings at a budget) sweep.csv holds for it},
    whatever their seeds: the tuning budget each entry had, to compare across entries."""
    configs: dict[str, set] = {}
    for row in read_rows(path):
        configs.setdefault(row["method"], set()).add(_config(row))
    return {entry: len(c) for entry, c in configs.items()}


# How :func:`best` ranks an entry's configurations
TUNE_BY = ("steps", "final_loss")


def best(path: str | Path, seed: int = 0, budget: int | None = None, rank_by: str = "steps") -> dict[str, dict]:
    """{entry: its best row}: among the entry's rows on the tuning ``seed`` at ``budget`` (default:
    the budget of its last such row), and at the target and worker count of the last of those
    (rows at another target are not comparable), by ``rank_by``: ``steps``, the fewest steps to
    the target, ties and entries that never reach it by the lower final held-out loss;
    ``final_loss``, the lowest final held-out loss (the fair protocol's rule: adamw's target is
    its tuned final loss, and every entry is ranked as adamw was). The row's ``settings`` are
    what :func:`with_settings` applies over the entry's recipe."""
    if rank_by not in TUNE_BY:
        raise ValueError(f"rank_by must be one of {', '.join(TUNE_BY)}; got {rank_by!r}")
    by_entry: dict[str, list[dict]] = {}
    for row in read_rows(path):
        if row["seed"] == seed and (budget is None or row["budget"] == budget):
            by_entry.setdefault(row["method"], []).append(row)
    out = {}
    for entry, rows in by_entry.items():
        last = rows[-1]
        same = [r for r in rows if (r["budget"], r["target_loss"], r["workers"]) ==
                (last["budget"], last["target_loss"], last["workers"])]
        if rank_by == "final_loss":
            out[entry] = min(same, key=lambda r: r["final_val_loss"])
        else:
            out[entry] = min(same, key=lambda r: (r["steps_to_target"] is None, r["steps_to_target"] or 0,
                                                  r["final_val_loss"]))
    return out
