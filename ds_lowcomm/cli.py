"""The ``ds-lowcomm`` command."""

from __future__ import annotations

import argparse
import sys

from .config import METHODS, ConfigError
from .task.spec import DEFAULTS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds-lowcomm", description="Low-communication distributed training.")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="train the reference task with several methods and compare loss vs bytes")
    c.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated method names (default: all, {', '.join(METHODS)})")
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
    c.add_argument("--pipeline-stages", type=int, default=DEFAULTS.pipeline_stages,
                   help="> 0: each method through DeepSpeed's pipeline engine, the GPT in this many stages, one "
                        "pipeline per replica (--workers: a multiple of it; --batch: per pipeline)")
    c.add_argument("--config", default=None, help="JSON/YAML overrides: {method: {lr: .., lowcomm: {...}}}")
    p = sub.add_parser("plan", help="predict each method's bytes, step time, memory and speed-up for a model, "
                                    "cluster and link (ds_lowcomm/plan.py)")
    from .plan import add_arguments

    add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "compare":
            from .compare import run_compare

            run_compare(args)
        elif args.command == "plan":
            from .plan import run_plan

            run_plan(args)
    except ConfigError as err:
        print(f"ds-lowcomm: configuration error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
