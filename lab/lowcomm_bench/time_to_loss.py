"""``python -m lowcomm_bench time_to_loss``: time to adamw's held-out loss against the
comm/compute ratio, the number that decides what compression buys.

On each link, adamw's run on these test hosts gives the ratio: its communication seconds per step
(the blocking all-reduce, from its ledger) over its compute seconds per step (the rest of the
step). Every entry (ds_lowcomm's methods, adamw included, its best-practice forms
``adamw_overlap`` and ``adamw_overlap_bf16``: DDP's bucketed all-reduces overlapped with the
backward pass, fp32 or bf16, and peers such as DDP+PowerSGD) trains to the target: adamw's
held-out loss after ``--steps`` steps on the unshaped link, with ``--budget-factor`` times the
steps and its schedule spread over them, stopping at the first evaluation that reaches it (as
``bench network``). Reported per (hosts, link, entry): steps and training seconds to the target,
bytes sent per worker until then, the speed-up (``speedup_vs_dense``) to the fastest dense entry on
that link (named in ``dense_baseline``: of :data:`~lowcomm_bench.peers.DENSE_ENTRIES` run,
adamw, its DDP forms adamw_overlap and adamw_overlap_bf16, or DDP with Muon, muon and muon_bf16,
whichever reaches the target first) and the no-communication limit against the same baseline
(``(1 + ratio) x adamw's steps / the entry's steps``, times the baseline's time over plain adamw's).
The ratio stays plain adamw's on every row (its blocking all-reduce is the one whose seconds a
ledger can time; the overlapped entries hide part of theirs behind the backward pass), so
``speedup_over_1_plus_ratio`` divides a speed-up over the fastest dense entry by plain adamw's
``1 + ratio``. Files written before 2026-11-28 name these columns ``speedup_vs_adamw`` and
``adamw_baseline`` (the dense entries were all AdamW then). Writes
``time_to_loss.csv/.json/.png``; runs are cached (shared with ``network`` and ``peers``).
With ``--from-sweep``, each entry runs at its best configuration in a ``bench sweep`` CSV
(:func:`lowcomm_bench.tuning.best`, by ``--tune-by`` at ``--tune-budget``), adamw's target run
too, and the DDP forms at the fp32 entry's with their optimizer (adamw's for adamw_overlap and
adamw_overlap_bf16, muon's for muon_bf16) unless they have rows of their own; without it, at its
recipe.

Seeds (issue 27's fair protocol): with ``--seeds 1,2,3`` every entry trains to the target from
each seed (the target stays adamw's on seed 0, the tuning seed); rows report the median steps and
seconds and their ranges (``seeds``, ``steps_range``, ``time_range_s``). Steps depend on the seed,
not on the link (the exchanges are deterministic), so with ``--timing-steps N`` only the unshaped
link (and ``--check-links``) runs every seed to the target; on the other links each entry runs
once for its first N steps of the same schedule (``TrainSpec.stop_at_step``; more steps where
PowerSGD's start or an outer sync period needs them) and its seconds to the target are that run's
seconds at each seed's step (:func:`seconds_at_step`: past the run, at its second half's rate).
The unshaped link too takes its seconds from a timing run then, so ``--steps-only`` can run the
seeds beside other work (steps do not depend on the machine's load; seconds do). On a check link
both are done and the rows carry the estimate beside the measured seconds (``estimate_s``,
``estimate_within_range``: within the seeds' range).

The ratio moves with the link here: bytes and compute both grow with the model, so a larger model
barely moves it, while a slower link (or fewer tokens per step) does. lab/notes/test-hosts.md places
real deployments on the same axis. Needs root (network namespaces).
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
from .network import PEERS as _PEERS
from .peers import BASELINES, DENSE_ENTRIES
from .runs import (LINKS, VARIANTS, add_model_args, add_repeat_args, at_target, method_spec, model_of, peer_spec,
                   repeats_per_run, run_cached, time_to_loss)
from .tuning import TUNE_BY, best, parse_seeds, with_settings

# Entries with a peer's step (the network benchmark's peers and the best-practice adamw entries)
PEERS = {**_PEERS, **BASELINES}
COLUMNS = ["setting", "hosts", "link", "comm_compute_ratio", "entry", "steps_to_target", "time_to_target_s",
           "speedup_vs_dense", "dense_baseline", "no_comm_limit", "speedup_over_1_plus_ratio", "bytes_sent_per_worker",
           "final_val_loss", "target_loss", "repeats", "seeds", "steps_range", "time_range_s", "time_from",
           "estimate_s", "estimate_within_range"]
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


def step_at_target(history: list[dict], target: float) -> float | None:
    """The (fractional) step where held-out loss first reaches ``target``, interpolated as
    :func:`~lowcomm_bench.runs.time_to_loss` interpolates seconds."""
    step = at_target(history, target, "step")
    return None if step is None else float(step)


def seconds_at_step(timing: dict, step: float) -> float:
    """Training seconds a run of this entry on this link takes to ``step``, from a timing run
    (its first steps): inside the run, its seconds interpolated between evaluations; past it, its
    last evaluation's seconds plus the steps beyond at the rate of the run's second half (past any
    start-up: the first all-reduces, PowerSGD's uncompressed steps, the first outer sync)."""
    h = timing["history"]
    points = [(0, 0.0)] + [(r["step"], r["train_s"]) for r in h]
    last_step, last_s = points[-1]
    if step > last_step:
        half = min(points, key=lambda p: abs(p[0] - last_step / 2))
        rate = (last_s - half[1]) / (last_step - half[0])
        return last_s + (step - last_step) * rate
    for (s0, t0), (s1, t1) in zip(points, points[1:]):
        if step <= s1:
            return t0 + (step - s0) / (s1 - s0) * (t1 - t0)
    return last_s


def bytes_to_target(history: list[dict], target: float, total: float) -> float:
    """Bytes sent per worker until the first evaluation at the target (the run's total if none is)."""
    return next((h["bytes_sent"] for h in history if h["val_loss"] <= target), total)


def comm_compute_ratio(run: dict) -> float:
    """adamw's communication seconds per step over its compute seconds per step (both over the
    same steps, so the totals' ratio)."""
    compute = run["train_s"] - run["comm_s"] - run["codec_s"]
    return run["comm_s"] / compute if compute > 0 else float("inf")


@dataclasses.dataclass
class Result:
    """One (hosts, link, entry): its runs and, per seed, steps and training seconds to the target.

    ``runs``: {seed: the repeats of that seed's run to the target on this link} (empty where the
    seconds come from a timing run); ``timing``: the timing run (the entry's first
    ``--timing-steps`` steps on this link) or None; ``steps``/``seconds``: {seed: steps to the
    target (an evaluation's step), seconds to it (the repeats' median, or the timing run's seconds
    at the seed's interpolated step on the unshaped link)}; ``estimate``: {seed: the timing run's
    seconds} where both exist (the check that the two ways agree); ``reference``: the first
    seed's run to the target (on this link, else the unshaped one): its bytes and final loss."""
    runs: dict
    timing: dict | None
    steps: dict
    seconds: dict
    estimate: dict
    reference: dict | None = None


def result_of(runs: dict, timing: dict | None, unshaped: dict | None, target: float) -> Result:
    """A :class:`Result` from ``runs`` ({seed: repeats} on this link) and/or a ``timing`` run;
    ``unshaped``: {seed: a run to the target on the unshaped link} (where the steps come from
    when this link has only a timing run)."""
    steps, seconds, estimate = {}, {}, {}
    for seed, reps in runs.items():
        steps[seed] = steps_to_target(reps[0]["history"], target)
        times = [time_to_loss(r["history"], target) for r in reps]
        seconds[seed] = statistics.median(times) if None not in times else None
    if timing is not None:
        for seed, run in (unshaped or {}).items():
            at = step_at_target(run["history"], target)
            t = seconds_at_step(timing, at) if at is not None else None
            if seed in runs:
                estimate[seed] = t
            else:
                steps[seed], seconds[seed] = steps_to_target(run["history"], target), t
    reference = next(iter(runs.values()))[0] if runs else next(iter((unshaped or {}).values()), None)
    return Result(runs, timing, steps, seconds, estimate, reference)


def median_or_none(values) -> float | None:
    """The median of ``values``; None if any is None (a seed that never reached the target)."""
    values = list(values)
    return statistics.median(values) if values and None not in values else None


def fastest_dense(entries: list[str], results: dict[str, Result]) -> str:
    """The dense entry among ``entries`` (:data:`DENSE_ENTRIES`: adamw, adamw_overlap,
    adamw_overlap_bf16, muon, muon_bf16) that reaches the target first on this link (median over
    seeds); on a tie the first of them, and adamw when none of them reaches it."""
    times = {e: median_or_none(results[e].seconds.values()) for e in DENSE_ENTRIES if e in entries}
    reached = [e for e in times if times[e] is not None]
    return min(reached, key=lambda e: times[e]) if reached else "adamw"


def _range(values) -> str | None:
    values = list(values)
    if not values or None in values:
        return None
    lo, hi = min(values), max(values)
    return f"{lo:g}-{hi:g}" if isinstance(lo, int) else f"{lo:.1f}-{hi:.1f}"


def rows_for(hosts: int, link: str, entries: list[str], results: dict[str, Result], target: float) -> list[dict]:
    """The rows of one (hosts, link): medians over seeds, speed-ups against the fastest dense
    entry there; the ratio (and with it ``1 + ratio`` and the no-communication limit's steps)
    from plain adamw."""
    adamw = results["adamw"]
    ratio = comm_compute_ratio(adamw.timing) if adamw.timing else statistics.median(
        comm_compute_ratio(r) for reps in adamw.runs.values() for r in reps)
    adamw_time = median_or_none(adamw.seconds.values())
    adamw_steps = median_or_none(adamw.steps.values())
    baseline = fastest_dense(entries, results)
    base_time = median_or_none(results[baseline].seconds.values())
    # plain adamw takes adamw_steps x compute x (1 + ratio); an entry whose own communication were
    # free, its steps x compute: the limit against the baseline is that scaled by the baseline's time
    base_scale = base_time / adamw_time if base_time and adamw_time else None
    rows = []
    for entry in entries:
        res = results[entry]
        t, steps = median_or_none(res.seconds.values()), median_or_none(res.steps.values())
        limit = base_scale * (1 + ratio) * adamw_steps / steps if steps and adamw_steps and base_scale else None
        speedup = base_time / t if t and base_time else None
        first = res.reference
        estimate = median_or_none(res.estimate.values()) if res.estimate else None
        rows.append({
            "setting": f"{hosts}h-{link}", "hosts": hosts, "link": link, "comm_compute_ratio": ratio, "entry": entry,
            "steps_to_target": steps, "time_to_target_s": t, "speedup_vs_dense": speedup, "dense_baseline": baseline,
            "no_comm_limit": limit, "speedup_over_1_plus_ratio": speedup / (1 + ratio) if speedup else None,
            "bytes_sent_per_worker": bytes_to_target(first["history"], target, first["bytes_sent_per_worker"])
            if first else None,
            "final_val_loss": first["final_val_loss"] if first else None, "target_loss": target,
            "repeats": max((len(reps) for reps in res.runs.values()), default=0),
            "seeds": len(res.steps), "steps_range": _range(res.steps.values()),
            "time_range_s": _range(res.seconds.values()),
            "time_from": "runs to the target" if res.runs else f"timing run of {res.timing['history'][-1]['step']} steps",
            "estimate_s": estimate,
            "estimate_within_range": (min(res.seconds.values()) <= estimate <= max(res.seconds.values()))
            if estimate is not None and None not in res.seconds.values() else None,
        })
    return rows


def timing_steps_of(steps: int, spec, peer: dict | None) -> int:
    """A timing run's steps: ``steps``, or more where the entry's start-up or sync period needs it
    (twice PowerSGD's start iteration, twice an outer sync period), so that the run's second half
    is steady."""
    period = max((peer or {}).get("start_iter", 0), (peer or {}).get("sync_every", 0),
                 spec.lowcomm.get("sync_every", 0) if spec.lowcomm else 0)
    return max(steps, 2 * period)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench time_to_loss", description=__doc__.split("\n\n")[0])
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
    ap.add_argument("--seeds", default="0",
                    help="comma list: every entry trains to the target from each (medians and ranges reported); "
                         "the target is adamw's on seed 0, the tuning seed")
    ap.add_argument("--timing-steps", type=int, default=None, metavar="N",
                    help="steps from the unshaped runs of each seed; seconds per step on each link (unshaped "
                         "included) from one run of N steps (more where an entry's start-up or sync period "
                         "needs it); without it every link runs every seed to the target")
    ap.add_argument("--steps-only", action="store_true",
                    help="with --timing-steps: only the unshaped runs of every seed (steps do not depend on "
                         "the machine's load, so they may run beside other work), then stop")
    ap.add_argument("--check-links", default="",
                    help="comma list of links of --links where every seed also runs to the target with "
                         "--timing-steps, to check that the two ways agree (columns estimate_s, "
                         "estimate_within_range)")
    ap.add_argument("--from-sweep", default=None, metavar="SWEEP_CSV",
                    help="run each entry (and adamw's target run) at its best configuration in this bench sweep "
                         "CSV (sweep.best on seed 0 at --tune-budget); entries without rows there run their recipe")
    ap.add_argument("--tune-budget", type=int, default=None,
                    help="the sweep rows' budget to pick the best configuration from (default: this run's, "
                         "--steps x --budget-factor)")
    ap.add_argument("--tune-by", choices=TUNE_BY, default="steps",
                    help="steps: fewest steps to the sweep's target, ties by final loss; final_loss: the lowest "
                         "final held-out loss at the tuning budget")
    ap.add_argument("--keep-other-hosts", action="store_true",
                    help="keep the rows and runs of other host counts already in --out (add 4 hosts to a 2-host run)")
    ap.add_argument("--record", action="store_true",
                    help="record each method's steps ratio at its recipe (unshaped link, first host count) as the "
                         "planner's default (ds_lowcomm/measured.json)")
    add_repeat_args(ap)
    add_model_args(ap)
    args = ap.parse_args(argv)
    hosts_list = [int(h) for h in args.hosts.split(",")]
    links = [x.strip() for x in args.links.split(",")]
    entries = [x.strip() for x in args.entries.split(",")]
    check_links = [x.strip() for x in args.check_links.split(",") if x.strip()]
    bad = [x for x in links if x not in LINKS] + [e for e in entries if e not in ENTRIES]
    if bad or "adamw" not in entries:
        raise SystemExit(f"unknown link(s)/entries: {', '.join(bad) or '-'} (adamw is required); links: "
                         f"{', '.join(LINKS)}; entries: {', '.join(ENTRIES)}")
    if any(x not in links or x == "unshaped" for x in check_links):
        raise SystemExit(f"--check-links must name shaped links of --links ({', '.join(links)}); got {args.check_links}")
    if check_links and not args.timing_steps:
        raise SystemExit("--check-links needs --timing-steps (it checks the timing runs against full runs)")
    if args.timing_steps is not None and args.timing_steps < 2:
        raise SystemExit(f"--timing-steps must be >= 2; got {args.timing_steps}")
    if args.steps_only and not args.timing_steps:
        raise SystemExit("--steps-only needs --timing-steps (without it every link runs every seed)")
    seeds = parse_seeds(args.seeds)
    repeats_of = repeats_per_run(args, links, entries)
    check_can_create()
    model = model_of(args)
    budget = int(args.steps * args.budget_factor)
    tuned = {}
    if args.from_sweep:
        tuned = {e: r["settings"] for e, r in best(args.from_sweep, budget=args.tune_budget or budget,
                                                   rank_by=args.tune_by).items()}
        # the DDP forms without rows of their own: the tuning of the fp32 entry with their optimizer (the
        # same optimizer and math, the gradient reduced in fp32 or bf16): adamw's for adamw_overlap(_bf16),
        # muon's for muon_bf16
        for entry, peer in BASELINES.items():
            reference = "adamw" if peer.get("optimizer", "adamw") == "adamw" else peer["optimizer"]
            if entry not in tuned and reference in tuned:
                tuned[entry] = tuned[reference]
        print(f"from {args.from_sweep}: {', '.join(f'{e} {json.dumps(tuned[e])}' for e in entries if e in tuned)}; "
              f"recipe: {', '.join(e for e in entries if e not in tuned) or '-'}", flush=True)

    def spec_of(entry: str, steps: int) -> tuple:
        spec, peer = entry_spec(entry, steps, args.eval_every, model)
        return with_settings(spec, peer, tuned[entry]) if entry in tuned else (spec, peer)

    for entry in entries:  # every spec checked before any run
        spec_of(entry, budget)

    cache, out = Path(args.cache), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    results, rows = {}, []
    if args.keep_other_hosts:
        results, rows = earlier_results(out, hosts_list)
    for hosts in hosts_list:
        target = run_cached(cache, hosts, "unshaped", spec_of("adamw", args.steps)[0])["final_val_loss"]

        def to_target(entry: str, link: str) -> dict:
            spec, peer = spec_of(entry, budget)
            return {seed: [run_cached(cache, hosts, link, dataclasses.replace(spec, seed=seed, stop_at_val_loss=target),
                                      r, peer) for r in range(repeats_of.get((link, entry), 1))] for seed in seeds}

        def timing(entry: str, link: str) -> dict:
            spec, peer = spec_of(entry, budget)
            n = timing_steps_of(args.timing_steps, spec, peer)
            return run_cached(cache, hosts, link, dataclasses.replace(spec, seed=seeds[0], stop_at_step=n), 0, peer)

        unshaped = {}
        if args.timing_steps:  # the steps of every seed, from the unshaped link
            for e in entries:
                unshaped[e] = {s: reps[0] for s, reps in to_target(e, "unshaped").items()}
                print(f"{hosts} hosts {e:<12} steps to the target by seed: "
                      f"{ {s: steps_to_target(r['history'], target) for s, r in unshaped[e].items()} }", flush=True)
            if args.steps_only:
                continue
        for link in links:
            full = not args.timing_steps or link in check_links
            for entry in entries:  # adamw first: the ratio comes from it
                runs = to_target(entry, link) if full else {}
                timed = timing(entry, link) if args.timing_steps else None
                results[hosts, link, entry] = result_of(runs, timed, unshaped.get(entry), target)
                res = results[hosts, link, entry]
                print(f"{hosts} hosts {link:<13} {entry:<12} steps {res.steps} seconds "
                      f"{ {s: round(t, 1) if t else None for s, t in res.seconds.items()} }"
                      + (f" estimate { {s: round(t, 1) if t else None for s, t in res.estimate.items()} }"
                         if res.estimate else ""), flush=True)
            here = {e: results[hosts, link, e] for e in entries}
            rows += rows_for(hosts, link, entries, here, target)
            for r in rows[-len(entries):]:
                t = f"{r['time_to_target_s']:.1f} s" if r["time_to_target_s"] else "never"
                print(f"  ratio {r['comm_compute_ratio']:6.2f} {r['entry']:<12} {t:>9} "
                      f"steps {r['steps_to_target']} ({r['steps_range']}) x{r['speedup_vs_dense'] or 0:.2f} "
                      f"vs {r['dense_baseline']}", flush=True)
            write(out, rows, results, args)
    if args.record:
        record_steps_ratios(rows, hosts_list[0], args, out)
    return rows


def recipe_entries(entries: list[str], from_sweep: bool) -> dict[str, str]:
    """method -> the entry that trained it at its recipe (the settings the planner prices): a
    ``<method>_recipe`` variant, else the method's own entry unless a sweep chose its settings."""
    found = {m: m for m in entries if m in METHODS and not from_sweep}
    found.update({VARIANTS[e][0]: e for e in entries if e in VARIANTS and VARIANTS[e] == (VARIANTS[e][0], {})})
    return found


def record_steps_ratios(rows: list[dict], hosts: int, args, out: Path, measured: Path | None = None) -> None:
    """The planner's steps ratios (ds_lowcomm/measured.json): each method's median steps to the
    target at its recipe over adamw's, on the unshaped link."""
    import datetime

    from .measured import record

    steps = {r["entry"]: r["steps_to_target"] for r in rows if r["hosts"] == hosts and r["link"] == "unshaped"}
    if not steps.get("adamw"):
        raise SystemExit("--record: adamw did not reach its target on the unshaped link; nothing recorded")
    date = datetime.date.today().isoformat()
    seeds = len(parse_seeds(args.seeds))
    source = (f"time_to_loss, {date} ({out}/time_to_loss.csv: {hosts} hosts, {seeds} seed(s), adamw's loss after "
              f"{args.steps} steps{', tuned: ' + args.from_sweep if args.from_sweep else ''})")
    for method, entry in recipe_entries(list(steps), bool(args.from_sweep)).items():
        if method != "adamw" and steps.get(entry):
            record("steps_ratio", method, {"value": steps[entry] / steps["adamw"], "steps": steps[entry],
                                           "adamw_steps": steps["adamw"], "date": date, "source": source},
                   *([measured] if measured else []))


def earlier_results(out: Path, skip_hosts: list[int]) -> tuple[dict, list[dict]]:
    """The results and rows of ``out``'s time_to_loss.json for host counts other than ``skip_hosts``."""
    path = out / "time_to_loss.json"
    if not path.exists():
        return {}, []
    data = json.loads(path.read_text())
    renamed = {"speedup_vs_adamw": "speedup_vs_dense", "adamw_baseline": "dense_baseline"}  # before 2026-11-28
    rows = [{renamed.get(k, k): v for k, v in r.items()} for r in data["rows"] if r["hosts"] not in skip_hosts]
    results = {}
    for key, value in data["results"].items():
        hosts, link, entry = key.split("@")
        if int(hosts) not in skip_hosts:
            results[int(hosts), link, entry] = Result(
                {int(s): reps for s, reps in value["runs"].items()}, value["timing"],
                *({int(s): v for s, v in value[f].items()} for f in ("steps", "seconds", "estimate")),
                value.get("reference"))
    return results, rows


def write(out: Path, rows: list[dict], results: dict, args) -> None:
    with open(out / "time_to_loss.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    (out / "time_to_loss.json").write_text(json.dumps(
        {"args": vars(args), "rows": rows,
         "results": {f"{h}@{l}@{e}": dataclasses.asdict(v) for (h, l, e), v in results.items()}}, indent=1))
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
            pts = sorted((r["comm_compute_ratio"], r["speedup_vs_dense"]) for r in rows
                         if r["entry"] == entry and r["hosts"] == h and r["speedup_vs_dense"])
            if pts:
                style = "--" if entry in PEERS else "-"
                label = entry if len(hosts) == 1 else f"{entry}, {h} hosts"
                ax.plot(*zip(*pts), style, marker=marker, color=f"C{i % 10}", label=label)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_yscale("log")
    ax.set_xlabel("adamw's comm/compute ratio on the link")
    ax.set_ylabel("speed-up over the fastest dense entry, to adamw's loss")
    ax.set_title(f"Time to adamw's loss, {'/'.join(map(str, hosts))} test hosts", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
