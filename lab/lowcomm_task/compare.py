"""``ds-lowcomm compare``: train the reference task with several methods from the same
initialisation, each with real worker processes over gloo, and report loss against bytes. The
library's CLI finds this module through the ``ds_lowcomm.commands`` entry point (lab/pyproject.toml):
:data:`HELP`, :func:`add_arguments`, :func:`run`.

Writes ``OUT/results.csv`` (one row per method), ``OUT/history.csv`` (held-out loss over steps),
``OUT/results.json`` (everything, ledgers included) and ``OUT/loss_vs_bytes.png``.

With ``--pipeline-stages S`` every method runs through DeepSpeed's pipeline engine (the GPT in S
stages, one pipeline per replica, :class:`lowcomm_task.steps.PipelineStep`): bytes are still
the method's, across replicas; the stages' activations and DeepSpeed's own traffic inside a
pipeline are in ``activation_bytes_sent_per_worker`` / ``engine_bytes_sent_per_worker``.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import time
from functools import partial
from pathlib import Path

import torch

from ds_lowcomm.comm.ledger import SETUP_OP
from ds_lowcomm.config import METHODS, ConfigError
from ds_lowcomm.optim.recipes import RECIPE_FIELDS, RECIPES, sign_recipe

from .data import DATA_SHARDS
from .dense import dense_step
from .reference import ReferenceTask
from .spec import DEFAULTS, TrainSpec
from .train import train_worker
from .workers import run_local_workers

# Entries beside the methods: dense Muon, the baseline of the recommended recipe (PyTorch DDP, then
# torch's Muon on the hidden matrices and AdamW on the rest, at its settings tuned on this task over
# 15 configurations: the muon rows of docs/bench/slow-links/2026-11-27-cpu-muon-tuning.csv), and that recipe (the one-bit outer loop,
# ds_lowcomm.optim.recipes.sign_recipe) with its inner optimizer at exactly dense Muon's settings.
DENSE_MUON = {"lr": 0.008, "muon_lr": 0.05, "muon_momentum": 0.95}
ENTRIES = {
    "muon": {"lr": DENSE_MUON["lr"], "lowcomm": {"method": "adamw"},
             "dense": {"kind": "ddp", "compress": "none", "optimizer": "muon", "muon_lr": DENSE_MUON["muon_lr"],
                       "muon_momentum": DENSE_MUON["muon_momentum"]}},
    "muloco_sign": {"lr": DENSE_MUON["lr"], "lowcomm": sign_recipe("muon", muon_lr=DENSE_MUON["muon_lr"],
                                                                    muon_momentum=DENSE_MUON["muon_momentum"])},
}
NAMES = (*METHODS, *ENTRIES)

RESULT_COLUMNS = [
    "method", "workers", "steps", "final_train_loss", "final_val_loss", "bytes_sent_per_worker",
    "bytes_received_per_worker", "compression_vs_adamw", "compression_vs_diloco", "wall_s", "codec_share",
    "synced", "replicas_identical",
]


HELP = "train the reference task with several methods and compare loss vs bytes"


def add_arguments(c) -> None:
    """``ds-lowcomm compare``'s options on the argparse (sub)parser ``c``."""
    c.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated names: methods ({', '.join(METHODS)}; the default: all), dense Muon (muon) "
                        "and the recommended recipe around it (muloco_sign)")
    c.add_argument("--workers", type=int, default=2, help="worker processes per method (gloo on this machine)")
    c.add_argument("--steps", type=int, default=DEFAULTS.steps)
    c.add_argument("--out", default="runs/compare", help="output directory")
    c.add_argument("--batch", type=int, default=DEFAULTS.batch, help="sequences per worker per step")
    c.add_argument("--seq-len", type=int, default=DEFAULTS.model.seq_len)
    c.add_argument("--n-layer", type=int, default=DEFAULTS.model.n_layer)
    c.add_argument("--n-embd", type=int, default=DEFAULTS.model.n_embd)
    c.add_argument("--warmup", type=int, default=DEFAULTS.warmup)
    c.add_argument("--eval-every", type=int, default=0, help="default: steps/10")
    c.add_argument("--seed", type=int, default=DEFAULTS.seed)
    c.add_argument("--device", default=DEFAULTS.device,
                   help="cpu, or cuda (each worker on GPU LOCAL_RANK modulo the GPUs present)")
    c.add_argument("--backend", default=DEFAULTS.backend,
                   help="torch.distributed backend of the workers: gloo, or nccl (one GPU per worker)")
    c.add_argument("--data", default=DEFAULTS.data, help="text file or directory (default: the Python standard library sources)")
    c.add_argument("--data-shards", default=DEFAULTS.data_shards, choices=DATA_SHARDS,
                   help="how the training bytes are split between workers: contiguous (a run of files each) or "
                        "interleaved (4 KiB blocks dealt in turn, as a DistributedSampler's shuffled samples)")
    c.add_argument("--pipeline-stages", type=int, default=DEFAULTS.pipeline_stages,
                   help="> 0: each method through DeepSpeed's pipeline engine, the GPT in this many stages, one "
                        "pipeline per replica (--workers: a multiple of it; --batch: per pipeline)")
    c.add_argument("--config", default=None, help="JSON/YAML overrides: {method: {lr: .., lowcomm: {...}}}")


def run(args) -> None:
    """The command (the CLI catches ConfigError)."""
    run_compare(args)

def load_overrides(path: str | None) -> dict:
    """A JSON or YAML file {method: {"lr": ..., "lowcomm": {...}}} merged over the recipes."""
    if not path:
        return {}
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of method name -> settings")
    return data


def build_specs(methods: list[str], base: TrainSpec, overrides: dict, workers: int) -> list[TrainSpec]:
    """Validate everything before any worker starts; return ``base`` with each method's recipe
    (learning rate, lowcomm settings, :data:`RECIPE_FIELDS`, a warm start's switch and warm-up;
    ``overrides`` merged over them)."""
    unknown = [m for m in methods if m not in NAMES]
    if unknown:
        raise ConfigError(f"--methods: unknown method(s) {', '.join(unknown)}; allowed: {', '.join(NAMES)}")
    if workers < 1:
        raise ConfigError(f"--workers must be >= 1; got {workers}")
    stages = base.pipeline_stages
    if stages and workers % stages:
        raise ConfigError(f"--workers must be a multiple of --pipeline-stages ({stages}); got {workers}")
    if base.backend == "nccl" and (base.device != "cuda" or workers > torch.cuda.device_count()):
        raise ConfigError(f"--backend nccl needs --device cuda and one GPU per worker ({workers} workers, "
                          f"{torch.cuda.device_count()} GPUs); use --backend gloo")
    specs = []
    for method in methods:
        recipe, over = ENTRIES.get(method) or RECIPES[method], overrides.get(method, {})
        lowcomm = copy.deepcopy(recipe["lowcomm"])
        fields = {k: over.get(k, recipe.get(k, getattr(base, k))) for k in RECIPE_FIELDS}
        warm = over.get("warm_start", recipe.get("warm_start"))  # a fraction of this run's steps (0: none)
        if warm:
            switch = max(1, round(base.steps * warm))
            lowcomm["switch_step"], fields["warmup"] = switch, switch
        spec = dataclasses.replace(
            base, lowcomm={**lowcomm, **over.get("lowcomm", {}), "method": lowcomm.get("method", method)},
            label=method if method in ENTRIES else base.label,
            lr=over.get("lr", recipe["lr"]), **fields,
            names={"lowcomm": f"{method}.lowcomm", "lr": f"{method}.lr", **{k: f"{method}.{k}" for k in RECIPE_FIELDS}},
        )
        if spec.lowcomm_config.transport != "torch":
            raise ConfigError(f"{method}.lowcomm.transport must be torch in ds-lowcomm compare (it starts its own "
                              "workers; the MPI transport needs processes started by mpirun: use launch/train.py)")
        specs.append(spec)
    return specs


def run_compare(args) -> list[dict]:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise ConfigError(f"--methods must name at least one of {', '.join(METHODS)}; got {args.methods!r}")
    specs = build_specs(methods, TrainSpec.from_args(args), load_overrides(args.config), args.workers)
    out = writable_dir(args.out)
    rows = []
    for spec in specs:
        start = time.perf_counter()
        dense = ENTRIES.get(spec.label, {}).get("dense")
        make_step = partial(dense_step, peer=dense) if dense else None
        per_rank = run_local_workers(train_worker, args.workers, spec, ReferenceTask, make_step, backend=spec.backend)
        wall = time.perf_counter() - start
        r0 = per_rank[0]
        rows.append({
            "method": spec.label if spec.label in ENTRIES else r0["method"],
            "workers": args.workers,
            "steps": args.steps,
            "final_train_loss": r0["final_train_loss"],
            "final_val_loss": r0["final_val_loss"],
            "bytes_sent_per_worker": sum(r["bytes_sent"] for r in per_rank) / len(per_rank),
            "bytes_received_per_worker": sum(r["bytes_received"] for r in per_rank) / len(per_rank),
            "wall_s": wall,
            "codec_share": r0["codec_s"] / r0["train_s"] if r0["train_s"] else 0.0,
            # (pipelines: every stage's ranks agree; each rank digests its own stage)
            "replicas_identical": all(len({r["params_digest"] for r in per_rank if r.get("stage") == s}) == 1
                                      for s in {r.get("stage") for r in per_rank}),
            "pipeline_stages": spec.pipeline_stages,
            "activation_bytes_sent_per_worker": sum(r.get("activation_bytes_sent", 0) for r in per_rank) / len(per_rank),
            "engine_bytes_sent_per_worker": sum(r.get("engine_bytes_sent", 0) for r in per_rank) / len(per_rank),
            "settings": r0["settings"],
            "lr": spec.lr,
            "num_params": r0["num_params"],
            "history": r0["history"],
            "ledger": r0["ledger"],
            # Did the method exchange anything beyond the start-up checks (an outer method with
            # sync_every > steps never does: its bytes are not a compression ratio)?
            "synced": all(any(op != SETUP_OP and v["sent"] for op, v in r["ledger"]["by_op"].items())
                          for r in per_rank),
        })
    for baseline in ("adamw", "diloco"):
        base = next((r["bytes_sent_per_worker"] for r in rows if r["method"] == baseline and r["synced"]), None)
        for r in rows:
            sent = r["bytes_sent_per_worker"]
            ok = r["synced"] and base and sent
            r[f"compression_vs_{baseline}"] = base / sent if ok else float("nan")
    write_outputs(out, rows)
    print_table(rows)
    return rows


def writable_dir(path: str) -> Path:
    """``--out``, created and checked writable before any worker starts."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".ds_lowcomm_write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"--out {path}: cannot write results there ({err.strerror or err})") from None
    return out


def write_outputs(out: Path, rows: list[dict]) -> None:
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULT_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    with open(out / "history.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "step", "train_loss", "val_loss", "bytes_sent", "bytes_received"])
        for r in rows:
            for h in r["history"]:
                w.writerow([r["method"], h["step"], h["train_loss"], h["val_loss"], h["bytes_sent"], h["bytes_received"]])
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    plot(out / "loss_vs_bytes.png", rows)


def plot(path: Path, rows: list[dict]) -> None:
    workers = rows[0]["workers"] if rows else 0
    plot_history(path, rows, "val_loss", "held-out loss (nats/byte)",
                 f"Reference task, {workers} workers: held-out loss against bytes sent and steps")


def plot_history(path: Path, rows: list[dict], metric: str, ylabel: str, title: str) -> None:
    """Each row's ``history`` (the training loop's evaluations): ``metric`` against MB sent
    per worker and against steps, one line per ``row["method"]``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed (pip install 'ds_lowcomm[plot]'): no {path.name}")
        return
    fig, (ax_bytes, ax_steps) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in rows:
        h = r["history"]
        values = [x[metric] for x in h]
        ax_bytes.plot([max(x["bytes_sent"], 1) / 1e6 for x in h], values, marker="o", ms=3, label=r["method"])
        ax_steps.plot([x["step"] for x in h], values, marker="o", ms=3, label=r["method"])
    ax_bytes.set_xscale("log")
    ax_bytes.set_xlabel("MB sent per worker (log)")
    ax_steps.set_xlabel("step")
    for ax in (ax_bytes, ax_steps):
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(rows: list[dict]) -> None:
    head = (f"{'method':<12}{'val loss':>10}{'train loss':>12}{'MB sent/worker':>16}{'vs adamw':>10}{'vs diloco':>11}"
            f"{'wall s':>9}{'codec %':>9}")
    print(head)
    print("-" * len(head))

    def ratio(x: float, width: int) -> str:
        return f"{x:>{width - 1}.1f}x" if x == x else f"{'n/a':>{width}}"  # NaN: no ratio

    for r in rows:
        print(f"{r['method']:<12}{r['final_val_loss']:>10.4f}{r['final_train_loss']:>12.4f}"
              f"{r['bytes_sent_per_worker'] / 1e6:>16.3f}{ratio(r['compression_vs_adamw'], 10)}"
              f"{ratio(r['compression_vs_diloco'], 11)}"
              f"{r['wall_s']:>9.1f}{100 * r['codec_share']:>8.1f}%")
    for r in rows:
        if not r["synced"]:
            print(f"{r['method']}: no sync ran in {r['steps']} steps (its bytes are start-up checks only): "
                  "no compression ratio; use more --steps or a smaller sync_every")
        if not r["replicas_identical"]:
            print(f"{r['method']}: the replicas' parameters differ at the end (no sync since their last local "
                  "steps); the held-out loss is rank 0's")
