"""``python -m ds_lowcomm.bench time_to_loss``: time to adamw's held-out loss against the
comm/compute ratio, the number that decides what compression buys.

On each link, adamw's run on these test hosts gives the ratio: its communication seconds per step
(the blocking all-reduce, from its ledger) over its compute seconds per step (the rest of the
step). Every entry (ds_lowcomm's methods, adamw included, its best-practice forms
``adamw_overlap`` and ``adamw_overlap_bf16``: DDP's bucketed all-reduces overlapped with the
backward pass, fp32 or bf16, and peers such as DDP+PowerSGD) trains to the target: adamw's
held-out loss after ``--steps`` steps on the unshaped link, with ``--budget-factor`` times the
steps and its schedule spread over them, stopping at the first evaluation that reaches it (as
``bench network``). Reported per (hosts, link, entry): steps and training seconds to the target,
bytes sent per worker until then, the speed-up to the fastest adamw entry on that link (named in
``adamw_baseline``: adamw, adamw_overlap or adamw_overlap_bf16, whichever of those run reaches the
target first) and the no-communication limit against the same baseline (``(1 + ratio) x adamw's
steps / the entry's steps``, times the baseline's time over plain adamw's). The ratio stays plain
adamw's on every row (its blocking all-reduce is the one whose seconds a ledger can time; the
overlapped entries hide part of theirs behind the backward pass), so ``speedup_over_1_plus_ratio``
divides a speed-up over the fastest adamw entry by plain adamw's ``1 + ratio``. Writes
``time_to_loss.csv/.json/.png``; runs are cached (shared with ``network`` and ``peers``).
With ``--from-sweep``, each entry runs at its best configuration in a ``bench sweep`` CSV
(:func:`ds_lowcomm.bench.tuning.best`), adamw's target run too; without it, at its recipe.

The ratio moves with the link here: bytes and compute both grow with the model, so a larger model
barely moves it, while a slower link (or fewer tokens per step) does. docs/benchmarks.md places
real deployments on the same axis. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
from pathlib import Path

from ..config import METHODS
from .netns import check_can_create
from .network import PEERS as _PEERS
from .peers import ADAMW_ENTRIES, BASELINES
from .runs import (LINKS, VARIANTS, add_model_args, add_repeat_args, method_spec, model_of, peer_spec,
                   repeats_per_run, run_cached, time_to_loss)

# Entries with a peer's step (the network benchmark's peers and the best-practice adamw entries)
PEERS = {**_PEERS, **BASELINES}
COLUMNS = ["setting", "hosts", "link", "comm_compute_ratio", "entry", "steps_to_target", "time_to_target_s",
           "speedup_vs_adamw", "adamw_baseline", "no_comm_limit", "speedup_over_1_plus_ratio", "bytes_sent_per_worker",
           "final_val_loss", "target_loss", "repeats"]
DEFAULT_LINKS = "unshaped,25mbit,10mbit"
DEFAULT_ENTRIES = ("adamw,adamw_overlap,adamw_overlap_bf16,demo,diloco,dct_diloco,sparseloco,mtdao,diloco_streaming,"
                   "powersgd_r8,torchft_diloco,torchft_streaming_diloco")
ENTRIES = (*METHODS, *VARIANTS, *PEERS)  # every entry this benchmark (and bench sweep) can run


def entry_spec(entry: str, steps: int, eval_every: int, model: dict) -> tuple:
    """An entry's (spec, peer settings): a method's or variant's recipe (peer None), or a peer on
    adamw's recipe with its settings (a copy of :data:`PEERS`'s); ``bench sweep`` builds its runs
    with this too."""
    if entry in PEERS:
        return peer_spec(entry, steps, eval_every, **model), dict(PEERS[entry])
    return method_spec(entry, steps, eval_every, **model), None


def steps_to_target(history: list[dict], target: float) -> int | None:
    """The step of the first evaluation at or below ``target`` (None if none is)."""
    return next((h["step"] for h in history if h["val_loss"] <= target), None)


def bytes_to_target(history: list[dict], target: float, total: float) -> float:
    """Bytes sent per worker until the first evaluation at the target (the run's total if none is)."""
    return next((h["bytes_sent"] for h in history if h["val_loss"] <= target), total)


def comm_compute_ratio(run: dict) -> float:
    """adamw's communication seconds per step over its compute seconds per step (both over the
    same steps, so the totals' ratio)."""
    compute = run["train_s"] - run["comm_s"] - run["codec_s"]
    return run["comm_s"] / compute if compute > 0 else float("inf")


def median_time(reps: list[dict], target: float) -> float | None:
    """The repeats' median training seconds to ``target`` (None if any repeat never reaches it)."""
    times = [time_to_loss(r["history"], target) for r in reps]
    return statistics.median(times) if None not in times else None


def fastest_adamw(hosts: int, link: str, entries: list[str], runs: dict, target: float) -> str:
    """The adamw entry among ``entries`` (:data:`ADAMW_ENTRIES`: adamw, adamw_overlap,
    adamw_overlap_bf16) that reaches ``target`` first on this link (median time); on a tie the
    first of them, and adamw when none of them reaches it."""
    times = {e: median_time(runs[hosts, link, e], target) for e in ADAMW_ENTRIES if e in entries}
    reached = [e for e in times if times[e] is not None]
    return min(reached, key=lambda e: times[e]) if reached else "adamw"


def rows_for(hosts: int, link: str, entries: list[str], runs: dict, target: float) -> list[dict]:
    """The rows of one (hosts, link): speed-ups against the fastest adamw entry there; the ratio
    (and with it ``1 + ratio`` and the no-communication limit's steps) from plain adamw."""
    adamw = runs[hosts, link, "adamw"]
    ratio = statistics.median(comm_compute_ratio(r) for r in adamw)
    adamw_time = median_time(adamw, target)
    adamw_steps = steps_to_target(adamw[0]["history"], target)
    baseline = fastest_adamw(hosts, link, entries, runs, target)
    base_time = median_time(runs[hosts, link, baseline], target)
    # plain adamw takes adamw_steps x compute x (1 + ratio); an entry whose own communication were
    # free, its steps x compute: the limit against the baseline is that scaled by the baseline's time
    base_scale = base_time / adamw_time if base_time and adamw_time else None
    rows = []
    for entry in entries:
        reps = runs[hosts, link, entry]
        t = median_time(reps, target)
        steps = steps_to_target(reps[0]["history"], target)
        limit = base_scale * (1 + ratio) * adamw_steps / steps if steps and adamw_steps and base_scale else None
        speedup = base_time / t if t and base_time else None
        rows.append({
            "setting": f"{hosts}h-{link}", "hosts": hosts, "link": link, "comm_compute_ratio": ratio, "entry": entry,
            "steps_to_target": steps, "time_to_target_s": t, "speedup_vs_adamw": speedup, "adamw_baseline": baseline,
            "no_comm_limit": limit, "speedup_over_1_plus_ratio": speedup / (1 + ratio) if speedup else None,
            "bytes_sent_per_worker": bytes_to_target(reps[0]["history"], target, reps[0]["bytes_sent_per_worker"]),
            "final_val_loss": reps[0]["final_val_loss"], "target_loss": target, "repeats": len(reps),
        })
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m ds_lowcomm.bench time_to_loss", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/time_to_loss")
    ap.add_argument("--cache", default="runs/bench/cache", help="results of single runs, shared with 'network'")
    ap.add_argument("--hosts", default="2")
    ap.add_argument("--links", default=DEFAULT_LINKS, help=f"comma list of {', '.join(LINKS)}")
    ap.add_argument("--entries", default=DEFAULT_ENTRIES,
                    help=f"methods ({', '.join(METHODS)}), variants ({', '.join(VARIANTS)}) and peers "
                         f"({', '.join(PEERS)}); adamw is required")
    ap.add_argument("--steps", type=int, default=300, help="adamw's steps on the unshaped link: its loss is the target")
    ap.add_argument("--eval-every", type=int, default=15)
    ap.add_argument("--budget-factor", type=float, default=3.0)
    ap.add_argument("--from-sweep", default=None, metavar="SWEEP_CSV",
                    help="run each entry (and adamw's target run) at its best configuration in this bench sweep "
                         "CSV (sweep.best: seed 0, this run's budget); entries without rows there run their recipe")
    ap.add_argument("--keep-other-hosts", action="store_true",
                    help="keep the rows and runs of other host counts already in --out (add 4 hosts to a 2-host run)")
    add_repeat_args(ap)
    add_model_args(ap)
    args = ap.parse_args(argv)
    hosts_list = [int(h) for h in args.hosts.split(",")]
    links = [x.strip() for x in args.links.split(",")]
    entries = [x.strip() for x in args.entries.split(",")]
    bad = [x for x in links if x not in LINKS] + [e for e in entries if e not in ENTRIES]
    if bad or "adamw" not in entries:
        raise SystemExit(f"unknown link(s)/entries: {', '.join(bad) or '-'} (adamw is required); links: "
                         f"{', '.join(LINKS)}; entries: {', '.join(ENTRIES)}")
    repeats_of = repeats_per_run(args, links, entries)
    check_can_create()
    model = model_of(args)
    budget = int(args.steps * args.budget_factor)
    tuned = {}
    if args.from_sweep:
        from .tuning import best, with_settings

        tuned = {e: r["settings"] for e, r in best(args.from_sweep, budget=budget).items()}
        print(f"from {args.from_sweep}: {', '.join(f'{e} {json.dumps(tuned[e])}' for e in entries if e in tuned)}; "
              f"recipe: {', '.join(e for e in entries if e not in tuned) or '-'}", flush=True)

    def spec_of(entry: str, steps: int) -> tuple:
        spec, peer = entry_spec(entry, steps, args.eval_every, model)
        return with_settings(spec, peer, tuned[entry]) if entry in tuned else (spec, peer)

    for entry in entries:  # every spec checked before any run
        spec_of(entry, budget)

    cache, out = Path(args.cache), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    runs, rows = {}, []
    if args.keep_other_hosts:
        runs, rows = earlier_results(out, hosts_list)
    for hosts in hosts_list:
        target = run_cached(cache, hosts, "unshaped", spec_of("adamw", args.steps)[0])["final_val_loss"]
        for link in links:
            for entry in entries:  # adamw first: the ratio comes from it
                spec, peer = spec_of(entry, budget)
                spec = dataclasses.replace(spec, stop_at_val_loss=target)
                runs[hosts, link, entry] = [run_cached(cache, hosts, link, spec, r, peer)
                                            for r in range(repeats_of[link, entry])]
                first = runs[hosts, link, entry][0]
                print(f"{hosts} hosts {link:<13} {entry:<12} val {first['final_val_loss']:.4f} "
                      f"train {first['train_s']:7.1f} s", flush=True)
            rows += rows_for(hosts, link, entries, runs, target)
            for r in rows[-len(entries):]:
                t = f"{r['time_to_target_s']:.1f} s" if r["time_to_target_s"] else "never"
                print(f"  ratio {r['comm_compute_ratio']:6.2f} {r['entry']:<12} {t:>9} "
                      f"steps {r['steps_to_target']} x{r['speedup_vs_adamw'] or 0:.2f} vs {r['adamw_baseline']}",
                      flush=True)
            write(out, rows, runs, args)
    return rows


def earlier_results(out: Path, skip_hosts: list[int]) -> tuple[dict, list[dict]]:
    """The runs and rows of ``out``'s time_to_loss.json for host counts other than ``skip_hosts``."""
    path = out / "time_to_loss.json"
    if not path.exists():
        return {}, []
    data = json.loads(path.read_text())
    rows = [r for r in data["rows"] if r["hosts"] not in skip_hosts]
    runs = {}
    for key, value in data["runs"].items():
        hosts, link, entry = key.split("@")
        if int(hosts) not in skip_hosts:
            runs[int(hosts), link, entry] = value
    return runs, rows


def write(out: Path, rows: list[dict], runs: dict, args) -> None:
    with open(out / "time_to_loss.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    (out / "time_to_loss.json").write_text(json.dumps(
        {"args": vars(args), "rows": rows, "runs": {f"{h}@{l}@{e}": v for (h, l, e), v in runs.items()}}, indent=1))
    plot(out / "time_to_loss.png", rows)


def plot(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ratios = sorted({r["comm_compute_ratio"] for r in rows})
    ax.plot(ratios, [1 + x for x in ratios], "k:", label="1 + ratio (no communication, adamw's steps)")
    hosts = sorted({r["hosts"] for r in rows})
    for i, entry in enumerate(dict.fromkeys(r["entry"] for r in rows)):  # a colour per entry, a marker per host count
        for h, marker in zip(hosts, "os^v"):
            pts = sorted((r["comm_compute_ratio"], r["speedup_vs_adamw"]) for r in rows
                         if r["entry"] == entry and r["hosts"] == h and r["speedup_vs_adamw"])
            if pts:
                style = "--" if entry in PEERS else "-"
                label = entry if len(hosts) == 1 else f"{entry}, {h} hosts"
                ax.plot(*zip(*pts), style, marker=marker, color=f"C{i % 10}", label=label)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_yscale("log")
    ax.set_xlabel("adamw's comm/compute ratio on the link")
    ax.set_ylabel("speed-up to adamw's held-out loss")
    ax.set_title(f"Time to adamw's loss, {'/'.join(map(str, hosts))} test hosts", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
