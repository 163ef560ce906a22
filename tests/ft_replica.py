"""One replica of the live fault-tolerance tests (tests/test_fault_tolerance.py), run as its own
process, as a replica would be its own job: a small model, this replica's own data shard (by its
id, not by how many replicas are alive), an outer method over torchft (ds_lowcomm's
FaultTolerance). Writes one JSON line per step to --out."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ds_lowcomm.checkpoint_io import params_digest  # noqa: E402
from ds_lowcomm.optim.fault_tolerance import FaultTolerance, FaultToleranceSettings  # noqa: E402
from ds_lowcomm.optim.registry import METHOD_CLASSES  # noqa: E402


def tensors_digest(tensors) -> str:
    """What every replica holds alike between syncs (outer methods: the anchors)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica-id", required=True)
    ap.add_argument("--method", default="diloco")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--sync-every", type=int, default=5)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo's fragments (outer methods)")
    ap.add_argument("--timeout-s", type=float, default=5.0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hold-at", type=int, default=None, help="at this step, wait for --hold-file to exist")
    ap.add_argument("--hold-file", default=None)
    ap.add_argument("--start-file", default=None, help="before the first quorum, wait for this file to exist")
    ap.add_argument("--join-file", default=None,
                    help="before joining at all (its torchft manager heartbeats from then on), wait for this file")
    ap.add_argument("--exchange", default="auto", help="dct_diloco_sign's exchange")
    ap.add_argument("--exit-in-exchange", type=int, default=None,
                    help="in the sync of this step, exit (code 3) as its all-gather would start")
    args = ap.parse_args()
    torch.manual_seed(0)  # the same initial parameters in every replica
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    while args.join_file and not Path(args.join_file).exists():  # imported, not known to the lighthouse yet
        time.sleep(0.05)
    ft = FaultTolerance(FaultToleranceSettings(lighthouse=args.lighthouse, replica_id=args.replica_id,
                                               timeout_s=args.timeout_s, quorum_timeout_s=120), host="127.0.0.1")
    if args.method == "demo":  # per step: a quorum every step
        opt = METHOD_CLASSES["demo"](model.parameters(), lr=3e-3, transport=ft.transport, topk=8, chunk=8)
    elif args.method == "mtdao":  # parameters and moments averaged every --sync-every steps
        opt = METHOD_CLASSES["mtdao"](model.parameters(), lr=1e-2, transport=ft.transport, sync_every=args.sync_every,
                                      momentum_sync_every=(args.sync_every,), second_moment_sync_every=args.sync_every)
    elif args.method == "adamw":
        opt = METHOD_CLASSES["adamw"](model.parameters(), lr=1e-2, transport=ft.transport)
    else:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        extra = {"topk": 8, "chunk": 8} if args.method in ("dct_diloco", "sparseloco") else {}
        method = args.method
        if method == "dct_diloco_sign":  # every element one sign bit: exchange auto, each quorum's by its size
            method, extra = "dct_diloco", {"topk": 64, "chunk": 8, "transform": "none", "value_dtype": "sign",
                                           "outer_lr": 1.0, "outer_momentum": 0.0, "decay": 0.95,  # the recipe's
                                           "exchange": args.exchange}
        opt = METHOD_CLASSES[method](inner, transport=ft.transport, sync_every=args.sync_every,
                                     fragments=args.fragments, **extra)
    out = open(args.out, "a")
    out.write(json.dumps({"event": "start", "time": time.time()}) + "\n")
    out.flush()
    while args.start_file and not Path(args.start_file).exists():  # all replicas up before the first quorum
        time.sleep(0.05)
    if args.exit_in_exchange is not None:  # dies in an exchange its peers have started
        def then_exit(first):
            def collective(*a):
                if ft.step == args.exit_in_exchange:  # the step counts from its start (a sync ends it)
                    os._exit(3)
                return first(*a)
            return collective

        # the all-gather's, or the compressed all-reduce's first phase
        ft.transport._all_gather = then_exit(ft.transport._all_gather)
        ft.transport._all_to_all = then_exit(ft.transport._all_to_all)
    # a decaying schedule, stepped after the optimizer: a joining replica heals its position
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.02 * s))
    ft.attach(opt, sched, after_step=(sched.step,))  # a joining replica heals here
    asks = ft.manager.start_quorum

    def announced(*a, **k):  # the test sees a replica ask for a quorum
        out.write(json.dumps({"event": "quorum", "step": ft.step, "time": time.time()}) + "\n")
        out.flush()
        return asks(*a, **k)

    ft.manager.start_quorum = announced
    shard = int(args.replica_id.rsplit("_", 1)[-1])
    while ft.step < args.steps:
        step = ft.step
        if step == args.hold_at:  # the test holds the run here until a restarted replica is up
            while not Path(args.hold_file).exists():
                time.sleep(0.05)
        # this replica's shard, at its data position (its step, less what it jumped over to sit out a sync)
        batch = ft.data_step
        gen = torch.Generator().manual_seed(10_000 * shard + batch)
        x = torch.randn(16, 8, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x[:, :4].sum(1, keepdim=True))  # learnable
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        out.write(json.dumps({"step": ft.step, "lr": opt.param_groups[0]["lr"], "outer_steps": getattr(opt, "outer_steps", None), "loss": float(loss),
                              "digest": params_digest(model), **ft.report(), "torchft_step": ft.manager.current_step(),
                              "anchors": tensors_digest(opt.replica_tensors()), "batch": batch,
                              "heal_bytes": opt.ledger.by_op.get("heal", [0, 0, 0])[2],
                              "sent": opt.ledger.sent, "ops": sorted(opt.ledger.by_op), "time": time.time()}) + "\n")
        out.flush()
        time.sleep(args.step_sleep)
    out.write(json.dumps({"event": "done", "time": time.time()}) + "\n")
    out.close()
    ft.shutdown()


if __name__ == "__main__":
    main()
