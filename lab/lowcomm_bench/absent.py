"""``python -m lowcomm_bench absent``: what an outer method loses when a replica is missing from
some syncs, without any fault: the control for the faults benchmark's loss.

The faults benchmark's diloco replicas (3 of them, its recipe and 300 steps) train here as one
plain torch.distributed world on this machine, no torchft, no kill, no heal. At the syncs named
by ``--absent`` a replica sits the exchange out as a replica with a non-finite pseudo-gradient
does (it sends nothing; the others' mean is applied on every replica, itself included): what the
survivors of a kill do at the syncs the dead replica misses and at the one a healed replica sits
out. Its work of those intervals is lost; nothing else is. So the gap between a row and the
``none`` row is the cost of the missing contributions alone, and the gap between the faults
benchmark's loss and that row is what the fault-tolerance path adds.
Writes ``absent.csv`` (one row per configuration: the held-out loss at every evaluation)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lowcomm_task.reference import ReferenceTask
from lowcomm_task.train import default_step, train_worker
from lowcomm_task.workers import run_local_workers

from .codec import write_csv
from .runs import add_model_args, method_spec, model_of


def parse_absent(text: str) -> dict[int, set[int]]:
    """``"1:100,120;2:200,220"`` -> {replica: the steps of the syncs it sits out}."""
    absent: dict[int, set[int]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        replica, _, steps = part.partition(":")
        try:
            absent[int(replica)] = {int(s) for s in steps.split(",") if s.strip()}
        except ValueError:
            raise SystemExit(f"--absent: expected 'replica:step,step;replica:step', got {text!r}") from None
    return absent


class AbsentStep:
    """``make_step`` for train_worker (picklable, for spawned workers): the default step, whose
    transport on this rank sits out the syncs of its steps in ``absent[rank]`` (``sits_out``: the
    sync goes on without its contribution; it takes the others' mean)."""

    def __init__(self, absent: dict[int, set[int]]):
        self.absent = absent

    def __call__(self, model, spec, rank, loss):
        step = default_step(spec)(model, spec, rank, loss)
        sits_out, count = self.absent.get(rank, set()), [0]

        def before(opt, args, kwargs):
            count[0] += 1
            opt.transport.sits_out = count[0] in sits_out

        def after(opt, args, kwargs):
            opt.transport.sits_out = False

        step.opt.register_step_pre_hook(before)
        step.opt.register_step_post_hook(after)
        return step


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench absent", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/absent")
    ap.add_argument("--method", default="diloco")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=15)
    ap.add_argument("--absent", action="append", default=[],
                    help="'replica:step,step;replica:step': the syncs each replica sits out (repeat for more "
                         "configurations; a configuration with none always runs)")
    add_model_args(ap)
    args = ap.parse_args(argv)
    configs = [(text, parse_absent(text)) for text in ["", *args.absent]]
    for _, absent in configs:
        bad = [r for r in absent if not 0 <= r < args.replicas]
        if bad:
            raise SystemExit(f"--absent: replicas must be 0..{args.replicas - 1}; got {bad}")
    spec = method_spec(args.method, args.steps, args.eval_every, **model_of(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for text, absent in configs:
        results = run_local_workers(train_worker, args.replicas, spec, ReferenceTask, AbsentStep(absent))
        history = results[0]["history"]  # the held-out loss is averaged over the ranks
        rows.append({"method": args.method, "replicas": args.replicas, "absent": text or "none",
                     "final_val_loss": history[-1]["val_loss"],
                     "val_loss_by_step": json.dumps({h["step"]: round(h["val_loss"], 4) for h in history})})
        print(f"{args.method} absent {text or 'none':<24} final held-out loss {rows[-1]['final_val_loss']:.4f}",
              flush=True)
        write_csv(out / "absent.csv", rows, list(rows[0]))
    return rows


if __name__ == "__main__":
    main()
