"""``python -m lowcomm_bench vision``: does it generalise to CNNs (the seed paper's claim)?

A small CNN on scikit-learn's bundled digits (1797 8x8 images, 10 classes, no download), a fixed
stratified 20% held out (seed 0), each worker training on its own shard of the rest, with every
method from the same initialisation on real gloo worker processes. Reported: held-out accuracy
and loss (averaged over ranks), bytes per worker from the optimizer's ledger, ratios against
adamw and diloco, and whether the replicas ended identical.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lowcomm_task.compare import plot_history
from lowcomm_task.spec import TrainSpec
from lowcomm_task.train import train_worker
from lowcomm_task.workers import run_local_workers

# Per-method recipes for this task (chosen on 2-worker runs; see docs/results/model-size.md).
RECIPES = {
    "adamw": {"lr": 3e-3, "lowcomm": {"method": "adamw"}},
    "demo": {"lr": 3e-3, "lowcomm": {"method": "demo", "topk": 2, "chunk": 8, "decay": 0.9, "value_dtype": "int8"}},
    "diloco": {"lr": 3e-3, "lowcomm": {"method": "diloco", "sync_every": 10}},
    "dct_diloco": {"lr": 3e-3, "lowcomm": {"method": "dct_diloco", "sync_every": 10, "topk": 8, "chunk": 8,
                                           "value_dtype": "bf16", "average": "world"}},
    "sparseloco": {"lr": 3e-3, "lowcomm": {"method": "sparseloco", "sync_every": 10, "topk": 8, "chunk": 8}},
}
# ``--ablate``: dct_diloco's recipe with one setting changed at a time, to find what costs it
# accuracy on the CNN (diloco is the control: what dct_diloco would reach sending everything).
ABLATIONS = {
    "dct_diloco recipe": {},
    "fp32 values": {"value_dtype": "fp32"},
    "senders average": {"average": "senders"},
    "no outer momentum, outer lr 1": {"outer_momentum": 0.0, "outer_lr": 1.0},
    "no transform (raw top-k)": {"transform": "none"},
    "decay 0.95": {"decay": 0.95},
    "decay 0.5": {"decay": 0.5},
    "topk 16 of 8x8": {"topk": 16},
    "topk 32 of 8x8": {"topk": 32},
    "everything sent (topk 64)": {"topk": 64},
    "4x4 blocks, topk 2": {"chunk": 4, "topk": 2},
    "diloco (control)": None,
}
COLUMNS = ["method", "workers", "steps", "held_out_accuracy", "held_out_loss", "mb_sent_per_worker",
           "compression_vs_adamw", "compression_vs_diloco", "replicas_identical", "wall_s"]


class DigitsCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.head = torch.nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def load_digits_split(seed: int = 0):
    """(x_train, y_train, x_test, y_test): images in [0, 1] as (N, 1, 8, 8), a stratified 20% held out."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(torch.arange(len(y)).numpy(), test_size=0.2, stratify=y.numpy(),
                                           random_state=seed)
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]


@torch.no_grad()
def evaluate(model, x, y) -> tuple[float, float]:
    model.eval()
    logits = model(x)
    model.train()
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


class DigitsTask:
    """The training loop's task (:class:`lowcomm_task.train.Task`): the CNN on the digits,
    each worker sampling its own shard, held-out loss and accuracy."""

    def __init__(self, spec: TrainSpec):
        self.seed = spec.seed
        self.x_train, self.y_train, self.x_test, self.y_test = load_digits_split(spec.seed)

    @staticmethod
    def build_model() -> torch.nn.Module:
        return DigitsCNN()

    def train_batch(self, rank: int, world: int, index: int, batch: int):
        mine = torch.arange(rank, len(self.y_train), world)  # this worker's shard
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + rank * 10_007 + index)  # reproducible batches
        idx = mine[torch.randint(len(mine), (batch,), generator=g)]
        return self.x_train[idx], self.y_train[idx]

    @staticmethod
    def loss(module, x, y):
        return F.cross_entropy(module(x), y)

    def evaluation(self, batch: int, device):
        x, y = self.x_test.to(device), self.y_test.to(device)
        return lambda module: dict(zip(("val_loss", "accuracy"), evaluate(module, x, y)))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench vision", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/vision")
    ap.add_argument("--methods", default="adamw,demo,diloco,dct_diloco,sparseloco")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="a few steps (smoke test)")
    ap.add_argument("--ablate", action="store_true",
                    help="instead: dct_diloco with one setting changed at a time (vision_ablation.csv)")
    ap.add_argument("--jobs", type=int, default=1, help="--ablate: variants trained at once (each has --workers processes)")
    args = ap.parse_args(argv)
    if args.ablate:
        return ablate(args)
    methods = [m.strip() for m in args.methods.split(",")]
    unknown = [m for m in methods if m not in RECIPES]
    if unknown:
        raise SystemExit(f"--methods: unknown {', '.join(unknown)}; allowed: {', '.join(RECIPES)}")
    steps = 20 if args.quick else args.steps
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for method in methods:
        lowcomm = dict(RECIPES[method]["lowcomm"])
        if args.quick and "sync_every" in lowcomm:
            lowcomm["sync_every"] = 5
        spec = _spec(lowcomm, RECIPES[method]["lr"], steps, args.batch)
        start = time.perf_counter()
        per_rank, figures = train(method, 11, spec, args.workers)
        r0 = per_rank[0]
        rows.append({"method": method, "workers": args.workers, "steps": steps, **figures,
                     "replicas_identical": len({r["params_digest"] for r in per_rank}) == 1,
                     "wall_s": time.perf_counter() - start, "history": r0["history"], "num_params": r0["num_params"]})
    for base in ("adamw", "diloco"):
        ref = next((r["mb_sent_per_worker"] for r in rows if r["method"] == base), None)
        for r in rows:
            r[f"compression_vs_{base}"] = ref / r["mb_sent_per_worker"] if ref and r["mb_sent_per_worker"] else float("nan")
    with open(out / "vision.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / "vision.json").write_text(json.dumps({"args": vars(args), "recipes": RECIPES, "rows": rows}, indent=1))
    plot(out / "vision.png", rows)
    return rows


def train(name: str, width: int, spec: TrainSpec, workers: int, threads: int | None = None):
    """Train ``spec`` on the digits; (per-rank results, the figures of rank 0's last evaluation)."""
    per_rank = run_local_workers(train_worker, workers, spec, DigitsTask, threads=threads)
    last = per_rank[0]["history"][-1]
    figures = {"held_out_accuracy": last["accuracy"], "held_out_loss": last["val_loss"],
               "mb_sent_per_worker": sum(r["bytes_sent"] for r in per_rank) / len(per_rank) / 1e6}
    print(f"{name:<{width}} accuracy {figures['held_out_accuracy']:.4f}  loss {figures['held_out_loss']:.4f}  "
          f"{figures['mb_sent_per_worker']:.3f} MB", flush=True)
    return per_rank, figures


def _spec(lowcomm: dict, lr: float, steps: int, batch: int) -> TrainSpec:
    return TrainSpec(lowcomm=lowcomm, lr=lr, steps=steps, batch=batch, warmup=max(1, steps // 10),
                     eval_every=max(1, steps // 10), verbose=False)


def ablate(args) -> list[dict]:
    """dct_diloco's recipe with one setting changed at a time (ABLATIONS), to vision_ablation.csv."""
    from concurrent.futures import ThreadPoolExecutor

    steps = 20 if args.quick else args.steps
    base = RECIPES["dct_diloco"]
    variants = {name: ({**base["lowcomm"], **change} if change is not None else dict(RECIPES["diloco"]["lowcomm"]))
                for name, change in ABLATIONS.items()}
    if args.quick:
        variants = dict(list(variants.items())[:2])
        for lowcomm in variants.values():
            lowcomm["sync_every"] = 5

    def one(item):
        name, lowcomm = item
        _, figures = train(name, 32, _spec(lowcomm, base["lr"], steps, args.batch), args.workers, threads=1)
        return {"variant": name, "settings": json.dumps(lowcomm, sort_keys=True), "steps": steps, **figures}

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rows = list(pool.map(one, variants.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "vision_ablation.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return rows


def plot(path: Path, rows: list[dict]) -> None:
    plot_history(path, rows, "accuracy", "held-out accuracy",
                 f"Digits CNN ({rows[0]['num_params']} parameters), {rows[0]['workers']} workers")
