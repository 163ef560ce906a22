"""``python -m lowcomm_bench network``: wall-clock through slow links.

Each method trains the reference task on 2 and 4 test hosts (one network namespace per worker,
veth pairs through a bridge, tc-shaped egress) over unshaped, 1 Gbit/s 5 ms and 100 Mbit/s
20 ms links. The target is the held-out loss adamw reaches in the step budget on that host
count; then every entry, adamw included, gets ``--budget-factor`` times the steps (its schedule
spread over that budget) and stops at the first evaluation that reaches the target. Reported per
(hosts, link, method): the training time to the target (evaluations are not timed), the held-out
loss reached within a fixed budget (adamw's training time on the unshaped link), the final loss,
bytes and wall time, to ``network-<hosts>h.csv/.json/.png``. Needs root; the namespaces are
removed after every run.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
from pathlib import Path

from ds_lowcomm.config import METHODS

from .netns import check_can_create
from .runs import (LINKS, add_model_args, add_repeat_args, loss_at_time, method_spec, model_of, peer_spec,
                   repeats_per_run, run_cached, time_to_loss)

# What users would pick instead; torchft's DiLoCo with the diloco recipe's H, outer lr and momentum.
PEERS = {"powersgd_r4": {"kind": "ddp_powersgd", "rank": 4}, "powersgd_r8": {"kind": "ddp_powersgd", "rank": 8},
         "torchft_diloco": {"kind": "torchft_diloco", "sync_every": 20, "outer_lr": 0.7, "outer_momentum": 0.9},
         # torchft's Streaming DiLoCo with the settings of ds_lowcomm's diloco_streaming
         "torchft_streaming_diloco": {"kind": "torchft_diloco", "sync_every": 20, "outer_lr": 0.7,
                                      "outer_momentum": 0.9, "fragments": 4, "sync_delay": 4}}
# the same two with Muon (Nesterov) on the hidden matrices and AdamW on the rest as the inner
# optimizer (bench.peers.dense_optimizer), as a torchft user would run MuLoCo
PEERS.update({f"{name}_muon": {**PEERS[name], "optimizer": "muon"}
              for name in ("torchft_diloco", "torchft_streaming_diloco")})

COLUMNS = ["hosts", "link", "delay_applied", "method", "steps_run", "final_val_loss", "target_loss", "time_to_target_s",
           "speedup_vs_adamw", "speedup_vs_powersgd", "budget_s", "loss_at_budget", "train_s", "wall_s", "mb_sent_per_worker", "repeats"]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench network", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/network")
    ap.add_argument("--cache", default="runs/bench/cache", help="results of single runs, shared with 'peers'")
    ap.add_argument("--hosts", default="2,4")
    ap.add_argument("--links", default="unshaped,1gbit-5ms,100mbit-20ms", help=f"comma list of {', '.join(LINKS)}")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--peers", default="", help=f"peer baselines to add: comma list of {', '.join(PEERS)}")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=15)
    ap.add_argument("--budget-factor", type=float, default=3.0,
                    help="steps for the other methods, as a multiple of --steps (they stop at the target)")
    add_repeat_args(ap)
    add_model_args(ap)
    args = ap.parse_args(argv)
    hosts_list = [int(h) for h in args.hosts.split(",")]
    links = [x.strip() for x in args.links.split(",")]
    peers = [m.strip() for m in args.peers.split(",") if m.strip()]
    methods = [m.strip() for m in args.methods.split(",")] + peers
    bad = [x for x in links if x not in LINKS] + [m for m in methods if m not in METHODS and m not in PEERS]
    if bad:
        raise SystemExit(f"unknown link(s)/method(s): {', '.join(bad)}; links: {', '.join(LINKS)}; "
                         f"methods: {', '.join(METHODS)}")
    repeats_of = repeats_per_run(args, links, methods, "--methods/--peers")
    if "adamw" not in methods or "unshaped" not in links:
        raise SystemExit("the target loss and time budget come from adamw on the unshaped link: keep both")
    check_can_create()
    model = model_of(args)
    cache, out = Path(args.cache), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    runs: dict[tuple[int, str, str], list[dict]] = {}
    targets: dict[int, float] = {}
    for hosts in hosts_list:
        # adamw first, unshaped first: its final loss is the target of everything on these hosts
        adamw = method_spec("adamw", args.steps, args.eval_every, **model)
        target = targets[hosts] = run_cached(cache, hosts, "unshaped", adamw)["final_val_loss"]
        for link in links:
            for method in methods:
                budget_steps = int(args.steps * args.budget_factor)
                # peers: on adamw's recipe, with the same longer budget and stop
                spec = (peer_spec if method in PEERS else method_spec)(method, budget_steps, args.eval_every, **model)
                spec = dataclasses.replace(spec, stop_at_val_loss=target)
                runs[hosts, link, method] = [run_cached(cache, hosts, link, spec, r, PEERS.get(method))
                                             for r in range(repeats_of[link, method])]
                first = runs[hosts, link, method][0]
                print(f"{hosts} hosts {link:<13} {method:<11} val {first['final_val_loss']:.4f}  "
                      f"train {statistics.median(x['train_s'] for x in runs[hosts, link, method]):7.1f} s", flush=True)

    rows = []
    for hosts in hosts_list:
        target = targets[hosts]
        budget = statistics.median(x["train_s"] for x in runs[hosts, "unshaped", "adamw"])
        for link in links:
            adamw_time = statistics.median(time_to_loss(x["history"], target) for x in runs[hosts, link, "adamw"])
            for method in methods:
                reps = runs[hosts, link, method]
                times = [time_to_loss(x["history"], target) for x in reps]
                t = statistics.median(times) if None not in times else None
                rows.append({
                    "hosts": hosts, "link": link, "delay_applied": reps[0]["delay_applied"], "method": method,
                    "steps_run": reps[0]["history"][-1]["step"],
                    "final_val_loss": reps[0]["final_val_loss"], "target_loss": target, "time_to_target_s": t,
                    "speedup_vs_adamw": adamw_time / t if t else None, "budget_s": budget,
                    "speedup_vs_powersgd": None,
                    "loss_at_budget": statistics.median(loss_at_time(x["history"], budget) for x in reps),
                    "train_s": statistics.median(x["train_s"] for x in reps),
                    "wall_s": statistics.median(x["wall_s"] for x in reps),
                    "mb_sent_per_worker": reps[0]["bytes_sent_per_worker"] / 1e6, "repeats": len(reps),
                })
    for r in rows:  # against the fastest PowerSGD to the target on the same hosts and link
        peer_times = [x["time_to_target_s"] for x in rows if x["method"] in PEERS and x["hosts"] == r["hosts"]
                      and x["link"] == r["link"] and x["time_to_target_s"]]
        if peer_times and r["time_to_target_s"]:
            r["speedup_vs_powersgd"] = min(peer_times) / r["time_to_target_s"]
    # named by host counts, so 2- and 4-host runs made separately sit side by side
    name = f"network-{'-'.join(map(str, hosts_list))}h"
    with open(out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    (out / f"{name}.json").write_text(json.dumps(
        {"args": vars(args), "rows": rows, "runs": {f"{h}@{l}@{m}": v for (h, l, m), v in runs.items()}}, indent=1))
    plot(out / f"{name}.png", runs, hosts_list, links, methods)
    return rows


def plot(path: Path, runs, hosts_list, links, methods) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(hosts_list), len(links), figsize=(5 * len(links), 3.8 * len(hosts_list)),
                             squeeze=False)
    for i, hosts in enumerate(hosts_list):
        for j, link in enumerate(links):
            ax = axes[i][j]
            for method in methods:
                h = runs[hosts, link, method][0]["history"]
                ax.plot([x["train_s"] for x in h], [x["val_loss"] for x in h], marker=".", ms=3, label=method)
            delay = "" if runs[hosts, link, methods[0]][0]["delay_applied"] else " (delay not applied)"
            ax.set_title(f"{hosts} hosts, {link}{delay}", fontsize=10)
            ax.set_xlabel("training seconds")
            ax.set_ylabel("held-out loss")
            ax.set_ylim(top=3.2)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
