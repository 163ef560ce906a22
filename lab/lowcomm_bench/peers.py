"""``python -m lowcomm_bench peers``: ds_lowcomm's methods beside what users would pick instead,
on the same task and steps: AdamW with a dense all-reduce (the ``adamw`` method, what DDP does)
and PyTorch DDP with its PowerSGD communication hook (rank 4 and 8, AdamW), on 2 test hosts,
unshaped and at 100 Mbit/s.

PowerSGD's bytes are counted where they are sent: every ``torch.distributed.all_reduce`` issued
during training (the hook's P, Q and uncompressed-tensor all-reduces, and its first
``start_powerSGD_iter`` plain all-reduces) goes to a ledger with the same convention as
ds_lowcomm's (all-reduce of N bytes: sent N, received N). DDP's start-up broadcast (and its
broadcast of the rebuilt buckets' order after the first step) is not counted (nor is ds_lowcomm's
start-up check in the per-step totals), nor is the training loop's own all-reduce of the
evaluation metrics.

Also here: :data:`BASELINES`, the best-practice form of the ``adamw`` entry (PyTorch DDP, bucketed
all-reduces overlapped with the backward pass, in fp32 or with the gradient reduced in bf16), the
entries ``adamw_overlap`` and ``adamw_overlap_bf16`` of ``bench time_to_loss``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from ds_lowcomm.comm import ByteLedger
from ds_lowcomm.config import METHODS
from ds_lowcomm.optim.outer import contiguous_fragments
from lowcomm_task.spec import TrainSpec
from lowcomm_task.dense import (DENSE_OPTIMIZERS, OVERLAP_BUCKET_CAP_MB, count_all_reduces,  # noqa: F401
                                 ddp_setup, dense_optimizer)
from lowcomm_task.steps import TorchStep

from .runs import LINKS, add_model_args, effective_shape, model_of, method_spec, peer_spec, run_cached

POWERSGD_RANKS = (4, 8)
COLUMNS = ["name", "final_val_loss", "mb_sent_per_worker", "compression_vs_adamw", "wall_s_unshaped",
           "wall_s_100mbit", "delay_applied"]

PEER_KINDS = ("ddp_powersgd", "torchft_diloco", "ddp")

# The adamw entry as a DDP user runs it: torch.optim.AdamW (the adamw recipe's lr, betas, weight
# decay and schedule, through peer_spec) after DDP's bucketed all-reduces, overlapped with the
# backward pass; fp32, or the gradient reduced in bf16 (DDP's bf16_compress_hook; DeepSpeed and
# FSDP reduce in bf16 for bf16 training).
BASELINES = {
    "adamw_overlap": {"kind": "ddp", "compress": "none", "bucket_cap_mb": OVERLAP_BUCKET_CAP_MB},
    "adamw_overlap_bf16": {"kind": "ddp", "compress": "bf16", "bucket_cap_mb": OVERLAP_BUCKET_CAP_MB},
    # the same DDP with torch's Muon on the hidden matrices and AdamW on the rest (dense_optimizer)
    "muon": {"kind": "ddp", "compress": "none", "bucket_cap_mb": OVERLAP_BUCKET_CAP_MB, "optimizer": "muon"},
    "muon_bf16": {"kind": "ddp", "compress": "bf16", "bucket_cap_mb": OVERLAP_BUCKET_CAP_MB, "optimizer": "muon"},
}
# The dense entries (every step a full all-reduce of the gradient, AdamW or Muon after it): the
# speed-ups of time_to_loss are against the fastest of them on each link, named in its reports
DENSE_ENTRIES = ("adamw", *BASELINES)


def peer_step(peer: dict):
    """The training loop's step factory for a peer: a :class:`TorchStep` whose optimizer is
    ``peer``'s (``{"kind": "ddp_powersgd", "rank": r, "start_iter": i}``,
    ``{"kind": "torchft_diloco", "sync_every": h, "outer_lr": a, "outer_momentum": m}``, with
    ``"fragments": p, "sync_delay": d`` and ``"fragment_update_alpha": a`` (torchft's mix of the
    local fragment into the synced one; default 0, the synced one alone) for torchft's Streaming
    DiLoCo, and ``"optimizer": "muon"`` (with ``muon_lr``...: :func:`dense_optimizer`) for a Muon
    inner optimizer, or
    ``{"kind": "ddp", "compress": "none" | "bf16", "bucket_cap_mb": c}``: plain DDP)."""
    setups = {"ddp_powersgd": peer_setup, "torchft_diloco": torchft_setup, "ddp": ddp_setup}
    if peer.get("kind") not in setups:
        raise ValueError(f"peer.kind must be one of {', '.join(PEER_KINDS)}; got {peer.get('kind')!r}")
    if peer.get("fault_tolerance"):  # torchft's DiLoCo as one replica of its own job (bench faults)
        return partial(_torchft_replica_step, peer=peer)
    return partial(TorchStep.build, setup=partial(setups[peer["kind"]], peer=peer))


class TorchftReplica:
    """torchft's DiLoCo as one replica of its own job, for the training loop: where the replica is
    in its data (its inner steps, healed from a peer with the model), its heals, its shutdown."""

    discarded = None  # torchft does not say
    data_lag = 0  # a healed replica resumes where its peer's schedule is (its skipped batches unread)

    def __init__(self):
        self.step, self.heals, self.manager, self.scheduler = 0, 0, None, None

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    def report(self) -> dict:
        """What the run's report says of fault tolerance, as ds_lowcomm's FaultTolerance.report."""
        return {"heals": self.heals, "discarded": self.discarded}


def _torchft_replica_step(model, spec: TrainSpec, rank: int, loss, peer: dict) -> TorchStep:
    replica = TorchftReplica()
    step = TorchStep.build(model, spec, rank, loss, setup=partial(torchft_setup, peer=peer, replica=replica))
    replica.scheduler = step.sched  # healed with the rest (its position in the schedule)
    step.fault_tolerance = replica
    ft = peer["fault_tolerance"]
    step.data_rank, step.data_world = int(ft["replica_id"]), ft["num_replica_groups"]
    return step


def peer_setup(model: torch.nn.Module, spec: TrainSpec, peer: dict):
    """The step's (module to run, optimizer, ledger): DDP with PowerSGD, AdamW."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel

    ledger = ByteLedger()
    # One gradient bucket: with several, PowerSGD's chained all-reduces (issued from completion
    # callbacks) got matched out of order across ranks over gloo through the test hosts' links
    # (gloo: "Received data size doesn't match expected size"). DDP broadcasts rank 0's
    # parameters here (start-up, not counted).
    ddp = DistributedDataParallel(model, bucket_cap_mb=1024)
    count_all_reduces(ledger)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=peer["rank"],
                                   start_powerSGD_iter=peer.get("start_iter", 2))
    ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=spec.betas, weight_decay=spec.weight_decay)
    opt.register_step_post_hook(lambda *_: ledger.end_step())  # one ledger step per optimizer step
    return ddp, opt, ledger


_KEEP_ALIVE: list = []  # torchft's lighthouse, manager and DiLoCo live as long as the worker


def _own_address() -> str:
    """This test host's address: the one it reaches the rendezvous host from."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((os.environ["MASTER_ADDR"], 9))  # no packet leaves: UDP connect only picks a route
        return s.getsockname()[0]


class _Fragment(torch.nn.Module):
    """Some of a model's parameters (the same tensors) as the module torchft syncs as one fragment."""

    def __init__(self, params: list[torch.nn.Parameter]):
        super().__init__()
        self.params = torch.nn.ParameterList(params)


def torchft_setup(model: torch.nn.Module, spec: TrainSpec, peer: dict, replica: TorchftReplica | None = None):
    """The step's (module, inner optimizer, ledger) for torchft's DiLoCo, as its users set it up:
    every worker its own replica group (one torchft Manager each, with its own store), a
    lighthouse on rank 0's host, the outer step torchft's (SGD, Nesterov) around an inner AdamW
    with the spec's settings. Its all-reduces of pseudo-gradients are counted where the manager
    issues them (fp32, sent N / received N as ours); lighthouse and manager RPCs are not.
    With ``replica`` (and ``peer["fault_tolerance"]``: lighthouse, replica_id, host), this process
    is one replica of its own job: the lighthouse is elsewhere, a quorum goes on without a dead
    replica, and a restarted one heals from a peer (model, inner optimizer, schedule and position;
    torchft's DiLoCo adds its own fragments' state) over an HTTP transport that advertises ``host``."""
    from datetime import timedelta

    from torchft import Manager, ProcessGroupGloo
    from torchft.coordination import LighthouseServer
    from torchft.local_sgd import DiLoCo

    inner = dense_optimizer(model, spec, peer)  # AdamW, or with peer["optimizer"] "muon" Muon + AdamW
    wait, faults = timedelta(seconds=600), {}
    if replica is None:
        rank, world = dist.get_rank(), dist.get_world_size()
        me = _own_address()
        address = [None]
        if rank == 0:
            lighthouse = LighthouseServer(bind="0.0.0.0:0", min_replicas=world)
            _KEEP_ALIVE.append(lighthouse)
            address = [f"http://{me}:{lighthouse.address().rsplit(':', 1)[1]}"]
        dist.broadcast_object_list(address, src=0)
        state = {"load_state_dict": lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["inner"])),
                 "state_dict": lambda: {"model": model.state_dict(), "inner": inner.state_dict()}}
    else:
        from ds_lowcomm.comm.torchft import safe_http_transport
        from ds_lowcomm.optim.fault_tolerance import tensor_bytes

        section = peer["fault_tolerance"]
        rank, world, me, address = int(section["replica_id"]), 1, section["host"], [f"http://{section['lighthouse']}"]
        wait = timedelta(seconds=section.get("timeout_s", 30.0))
        # counted before DiLoCo's hook syncs (and heals) in the same step, on every replica alike
        inner.register_step_post_hook(lambda *_: setattr(replica, "step", replica.step + 1))

        def load(sd):
            model.load_state_dict(sd["model"])
            inner.load_state_dict(sd["inner"])
            replica.scheduler.load_state_dict(sd["scheduler"])
            replica.step, replica.heals = int(sd["position"]), replica.heals + 1
            # what this load gets (model, inner optimizer); torchft's DiLoCo loads its fragments'
            # anchors and outer momenta beside it, uncounted here
            nbytes = tensor_bytes(sd)
            print(f"torchft replica {rank}: healed from a peer at step {replica.step}: {nbytes} bytes at "
                  f"{time.time()}", flush=True)

        state = {"load_state_dict": load,
                 "state_dict": lambda: {"model": model.state_dict(), "inner": inner.state_dict(),
                                        "scheduler": replica.scheduler.state_dict(), "position": replica.step}}
        faults = {"checkpoint_transport": safe_http_transport(wait, me), "quorum_timeout": timedelta(seconds=600)}
    store = dist.TCPStore(me, 0, is_master=True, wait_for_workers=False)
    # Streaming DiLoCo: the same contiguous fragments as ds_lowcomm's (torchft syncs fragment
    # i % P every H / P steps, sending it sync_delay steps before it lands), and an outer optimizer
    # per fragment: one over the whole model would also step the other fragments along their
    # inner gradients, still in .grad when torchft's hook runs (measured: the loss diverges).
    fragments = [_Fragment(ps) for ps in contiguous_fragments(list(model.parameters()), peer.get("fragments", 1))]
    outer = [torch.optim.SGD(f.parameters(), lr=peer.get("outer_lr", 0.7), momentum=peer.get("outer_momentum", 0.9),
                             nesterov=True) for f in fragments]
    manager = Manager(
        pg=ProcessGroupGloo(timeout=wait), min_replica_size=world, use_async_quorum=False, **state,
        replica_id=f"replica_{rank}", store_addr=me, store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=address[0], hostname=me, timeout=wait, connect_timeout=wait,
        # every replica starts from the same seeded weights (torchft's documented case for False);
        # with True, step 0 heals over HTTP at socket.gethostname(), which a test host cannot reach
        init_sync=False, **{"quorum_timeout": wait, **faults})
    if replica is not None:
        replica.manager = manager
    ledger = ByteLedger()
    issue = manager.allreduce

    def counted(tensor, *args, **kwargs):
        n = tensor.numel() * tensor.element_size()
        ledger.record("torchft_allreduce", n, n)
        return issue(tensor, *args, **kwargs)

    manager.allreduce = counted
    diloco = DiLoCo(manager, fragments, inner, outer, sync_every=peer.get("sync_every", 20), pin_memory=False,
                    fragment_sync_delay=peer.get("sync_delay", 0),
                    fragment_update_alpha=peer.get("fragment_update_alpha", 0.0))
    diloco.__enter__()  # registers its hooks on the inner optimizer; left in place for the run
    _KEEP_ALIVE.extend([store, manager, diloco])
    inner.register_step_post_hook(lambda *_: ledger.end_step())
    return model, inner, ledger


def entries(steps: int, eval_every: int, model: dict) -> dict[str, tuple[TrainSpec, dict | None]]:
    """name -> (spec, peer): the methods, then PowerSGD at each rank."""
    out = {m: (method_spec(m, steps, eval_every, **model), None) for m in METHODS}
    for r in POWERSGD_RANKS:
        name = f"powersgd_r{r}"
        out[name] = (peer_spec(name, steps, eval_every, **model), {"kind": "ddp_powersgd", "rank": r})
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench peers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/peers")
    ap.add_argument("--cache", default="runs/bench/cache", help="results of single runs, shared with 'network'")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=15)
    ap.add_argument("--slow-link", default="100mbit-20ms", choices=[k for k in LINKS if k != "unshaped"])
    ap.add_argument("--repeats", type=int, default=1, help="wall times are medians over repeats")
    ap.add_argument("--names", default=None, help="subset of the entries (comma list)")
    add_model_args(ap)
    args = ap.parse_args(argv)
    model = model_of(args)
    specs = entries(args.steps, args.eval_every, model)
    if args.names:
        wanted = [n.strip() for n in args.names.split(",")]
        unknown = [n for n in wanted if n not in specs]
        if unknown:
            raise SystemExit(f"--names: unknown {', '.join(unknown)}; allowed: {', '.join(specs)}")
        specs = {n: specs[n] for n in wanted}
    cache, out = Path(args.cache), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, runs = [], {}
    for name, (spec, peer) in specs.items():
        for link in ("unshaped", args.slow_link):
            runs[name, link] = [run_cached(cache, 2, link, spec, r, peer) for r in range(args.repeats)]
            print(f"{name:<14} {link:<13} val {runs[name, link][0]['final_val_loss']:.4f}  "
                  f"wall {statistics.median(x['wall_s'] for x in runs[name, link]):.1f} s", flush=True)
    base = runs.get(("adamw", "unshaped"))
    for name in specs:
        first = runs[name, "unshaped"][0]
        sent = first["bytes_sent_per_worker"]
        rows.append({
            "name": name, "final_val_loss": first["final_val_loss"], "mb_sent_per_worker": sent / 1e6,
            "compression_vs_adamw": base[0]["bytes_sent_per_worker"] / sent if base and sent else float("nan"),
            "wall_s_unshaped": statistics.median(x["wall_s"] for x in runs[name, "unshaped"]),
            "wall_s_100mbit": statistics.median(x["wall_s"] for x in runs[name, args.slow_link]),
            "delay_applied": effective_shape(LINKS[args.slow_link])[1],
        })
    with open(out / "peers.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    (out / "peers.json").write_text(json.dumps({"args": vars(args), "rows": rows,
                                                "runs": {f"{k[0]}@{k[1]}": v for k, v in runs.items()}}, indent=1))
    plot(out / "peers.png", rows, args.slow_link)
    return rows


def plot(path: Path, rows: list[dict], slow: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in rows:
        ax_b.scatter(r["mb_sent_per_worker"], r["final_val_loss"])
        ax_b.annotate(r["name"], (r["mb_sent_per_worker"], r["final_val_loss"]), fontsize=8)
    ax_b.set_xscale("log")
    ax_b.set_xlabel("MB sent per worker (log)")
    ax_b.set_ylabel("held-out loss")
    names = [r["name"] for r in rows]
    x = range(len(rows))
    ax_t.bar([i - 0.2 for i in x], [r["wall_s_unshaped"] for r in rows], 0.4, label="unshaped")
    ax_t.bar([i + 0.2 for i in x], [r["wall_s_100mbit"] for r in rows], 0.4, label=slow)
    ax_t.set_xticks(list(x), names, rotation=35, ha="right", fontsize=8)
    ax_t.set_ylabel("wall s (2 hosts)")
    ax_t.legend()
    for ax in (ax_b, ax_t):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
