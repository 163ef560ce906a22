"""``python -m lowcomm_bench streaming``: does the step still pay for the outer sync?

DiLoCo (every replica blocks on the all-reduce of the whole pseudo-gradient every H steps)
against streaming DiLoCo (the same bytes in P fragments on a staggered schedule, each landing
``sync_delay`` inner steps after it is sent), on 2 test hosts over unshaped and shaped links.
Reports per-step wall time: median of ordinary steps, mean of the steps where a sync lands, the
time blocked in communication (the ledger's "comm" seconds: issuing + waiting), and the loss.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path

from lowcomm_task.spec import TrainSpec

from .hosts import run_on_hosts
from .netns import LinkShape, TestNetwork, check_can_create

SHAPES = {"unshaped": LinkShape(), "100mbit": LinkShape("100mbit"), "100mbit-20ms": LinkShape("100mbit", 20)}
COLUMNS = ["link", "variant", "repeat", "wall_s", "median_step_s", "sync_step_s", "stall_per_sync_s",
           "comm_blocked_s", "syncs", "final_val_loss", "mb_sent_per_worker"]


def variants(h: int, fragments: int, delay: int) -> dict[str, dict]:
    return {
        "diloco": {"method": "diloco", "sync_every": h},
        f"streaming P={fragments} delay={delay}": {"method": "diloco", "sync_every": h, "fragments": fragments,
                                                   "sync_delay": delay},
    }


def landing_steps(lowcomm: dict, steps: int) -> list[int]:
    """Steps (1-based) at which a sync lands, from the method's schedule."""
    h, p, d = lowcomm["sync_every"], lowcomm.get("fragments", 1), lowcomm.get("sync_delay", 0)
    out = []
    for f in range(p):
        offset = (f + 1) * h // p
        out += [t + d for t in range(offset, steps + 1, h) if t + d <= steps]
    return sorted(out)


def summarise(link: str, name: str, repeat: int, lowcomm: dict, per_rank: list[dict], wall: float) -> dict:
    r0 = per_rank[0]
    times = r0["step_times"]
    lands = set(landing_steps(lowcomm, len(times)))
    ordinary = [t for i, t in enumerate(times, start=1) if i not in lands]
    at_sync = [t for i, t in enumerate(times, start=1) if i in lands]
    median = statistics.median(ordinary)
    return {
        "link": link, "variant": name, "repeat": repeat, "wall_s": wall, "median_step_s": median,
        "sync_step_s": statistics.mean(at_sync) if at_sync else float("nan"),
        "stall_per_sync_s": (sum(at_sync) - median * len(at_sync)) / max(1, len(at_sync)),
        "comm_blocked_s": max(r["comm_s"] for r in per_rank), "syncs": len(at_sync),
        "final_val_loss": r0["final_val_loss"],
        "mb_sent_per_worker": sum(r["bytes_sent"] for r in per_rank) / len(per_rank) / 1e6,
        "step_times": times,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench streaming", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/streaming")
    ap.add_argument("--links", default="unshaped,100mbit", help=f"comma list of {', '.join(SHAPES)} "
                    "(a delay needs the kernel's netem qdisc)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--sync-every", type=int, default=20)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--sync-delay", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    links = [x.strip() for x in args.links.split(",") if x.strip()]
    bad = [x for x in links if x not in SHAPES]
    if bad:
        raise SystemExit(f"--links: unknown {', '.join(bad)}; allowed: {', '.join(SHAPES)}")
    check_can_create()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for link in links:
        with TestNetwork(2, SHAPES[link]) as net:
            for repeat in range(args.repeats):
                for name, lowcomm in variants(args.sync_every, args.fragments, args.sync_delay).items():
                    spec = TrainSpec(lowcomm=lowcomm, lr=1e-3, steps=args.steps, batch=args.batch,
                                     warmup=max(1, args.steps // 10), eval_every=args.steps,
                                     model={"n_layer": args.n_layer, "n_embd": args.n_embd, "seq_len": args.seq_len},
                                     label=name, verbose=False)
                    per_rank, wall = run_on_hosts(net, spec)
                    row = summarise(link, name, repeat, lowcomm, per_rank, wall)
                    rows.append(row)
                    print(f"{link:>14} {name:<26} step {row['median_step_s']:.3f} s, at a landing "
                          f"{row['sync_step_s']:.3f} s, blocked {row['comm_blocked_s']:.2f} s, wall {wall:.1f} s, "
                          f"val {row['final_val_loss']:.4f}", flush=True)
    with open(out / "streaming.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / "streaming.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    plot(out / "streaming.png", rows)
    return rows


def plot(path: Path, rows: list[dict], link_order: list[str] | None = None) -> None:
    """Each row's step wall times, one panel per link (also the overlap benchmark's plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = sorted({r["link"] for r in rows}, key=(link_order or list(SHAPES)).index)
    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 4), squeeze=False)
    for ax, link in zip(axes[0], links):
        for r in rows:
            if r["link"] == link and r["repeat"] == 0:
                ax.plot(range(1, len(r["step_times"]) + 1), r["step_times"], marker=".", label=r["variant"])
        ax.set_title(f"2 hosts, link {link}")
        ax.set_xlabel("step")
        ax.set_ylabel("step wall time (s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
