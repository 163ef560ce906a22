"""``python -m lowcomm_bench figures``: the results' figures, rendered from the CSVs they quote.

README.md's Results and every page of docs/results/ hold their figures between markers
(``<!-- figures: NAME -->`` ... ``<!-- /figures -->``) and nowhere else: each block is rendered
here from committed CSVs under docs/bench/ (:mod:`lowcomm_bench.committed` names them), so a
figure cannot drift from its evidence. With no option every block of every page is checked, and
the prose around the blocks for figures of its own (:func:`prose_figures`; tests/test_docs_figures.py
runs the same checks); ``--write`` rewrites the blocks from the CSVs. A block renders for the page
it is on: its links are relative to that page, so one block (``recipes``, say) may stand on
several pages.

A new figure is a renderer here (a function of the page, returning the block's text), its name in
:data:`RENDER`, and the block on the page; a new CSV gets its name in :mod:`lowcomm_bench.committed`.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import re
import statistics
from pathlib import Path

from . import committed
from .committed import BENCH, ROOT

BLOCK = re.compile(r"<!-- figures: (?P<name>[a-z0-9_]+) -->\n(?P<body>.*?)<!-- /figures -->", re.S)
# A figure quoted in prose: a decimal, a ratio, a share, a measured size or time. A results page may
# state its setup's counts (steps, link rates, replicas); the README's Results not even those.
FIGURE = re.compile(r"\d+\.\d+|\b\d+(?:\s*(?:x\b|%|MB\b|kB\b|GB\b|ms\b|s\b))")
README_FIGURE = re.compile(r"\d+\.\d+|\b\d+(?:\s*(?:x\b|%|MB|kB|GB|Mbit|Gbit|steps\b|s\b|ms\b))")
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results"


def pages() -> list[Path]:
    """Every page whose figures are rendered here: README.md and docs/results/*.md."""
    return [README, *sorted(RESULTS.glob("*.md"))]


def _rows(rel: str) -> list[dict]:
    with open(BENCH / rel, newline="") as f:
        return list(csv.DictReader(f))


def href(page: Path, rel: str) -> str:
    """The link from ``page`` to ``rel`` (a path under the repository's root)."""
    return Path(os.path.relpath(ROOT / rel, page.parent)).as_posix()


def csv_link(page: Path, rel: str, text: str = "CSV") -> str:
    """A link from ``page`` to the committed file ``rel`` (relative to docs/bench/)."""
    return f"[{text}]({href(page, 'docs/bench/' + rel)})"


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |",
            *("| " + " | ".join(r) + " |" for r in rows)]


def captioned(head: list[str], rows: list[list[str]], caption: str) -> str:
    """A block's text: the table, then its caption (what was measured, the CSV it came from)."""
    return "\n".join([*table(head, rows), "", caption]) + "\n"


def times(x: float) -> str:
    """A ratio as the pages write it: two decimals under 10, whole above."""
    return f"{x:.2f}x" if x < 10 else f"{x:.0f}x"


def _pct(x: float) -> str:
    return f"{x:+.1%}".replace("-", "−")


def _params(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def reference_parameters() -> int:
    """The reference GPT's parameter count (its default configuration)."""
    from lowcomm_task.model import GPT, GPTConfig

    return sum(p.numel() for p in GPT(GPTConfig()).parameters())


# -- which recipe ---------------------------------------------------------------------------------
def _ttl(rows: list[dict], link: str, entry: str) -> dict:
    return next(r for r in rows if r["link"] == link and r["entry"] == entry)


# The one-bit recipe's entries of the time-to-loss runs: the situation each is for, its config, and
# the run that measured it (the overlapped sync: the run evaluated every step, which looks at a
# blocking and an overlapped sync alike)
TTL_ROWS = (
    ("You train with Muon over a slow link: the default", "muloco_sign", "H 5",
     "[muloco_sign.json](configs/muloco_sign.json) (ds_lowcomm's Muon; set any ZeRO stage, bf16) or "
     "[muloco_sign_zero2_bf16.json](configs/muloco_sign_zero2_bf16.json) (DeepSpeed's Muon section, ZeRO 1-3, bf16)",
     committed.MUON_RECIPES_TTL),
    ("Fewer bytes still, a few more steps", "muloco_sign_h10", "H 10", "the same with `sync_every` 10",
     committed.MUON_RECIPES_TTL),
    ("A link so slow that a sync takes longer than a step", "muloco_sign_overlap_d1",
     "H 5, sync overlapped by 1 step (evaluated every step)", "[muloco_sign_overlap.json](configs/muloco_sign_overlap.json)",
     committed.MUON_EVERY_STEP_TTL),
)


def _config_links(page: Path, text: str) -> str:
    return re.sub(r"\]\((configs/[^)]+)\)", lambda m: f"]({href(page, m[1])})", text)


def render_recipes(page: Path) -> str:
    scale = _rows(committed.SCALE_SUMMARY) if (BENCH / committed.SCALE_SUMMARY).exists() else []
    head = ("| your situation | use | steps to the target, vs the same optimizer dense | bytes per worker, fewer than "
            "dense | time to the target vs dense, 10 / 3 Mbit/s | evidence |\n| --- | --- | --- | --- | --- | --- |\n")
    lines = []
    for situation, entry, settings, config, rel in TTL_ROWS:
        ttl = _rows(rel)
        dense, r = _ttl(ttl, "unshaped", "muon_bf16"), _ttl(ttl, "unshaped", entry)
        steps, dense_steps = int(r["steps_to_target"]), int(dense["steps_to_target"])
        fewer = float(dense["bytes_sent_per_worker"]) / float(r["bytes_sent_per_worker"])
        faster = [float(_ttl(ttl, link, entry)["speedup_vs_dense"]) for link in ("10mbit", "3mbit")]
        lines.append(f"| {situation} | {_config_links(page, config)}: {settings} | {steps} vs {dense_steps} "
                     f"({times(steps / dense_steps)}) | {times(fewer)} (DDP + Muon, bf16 gradients) | "
                     f"{times(faster[0])} / {times(faster[1])} faster | reference GPT "
                     f"({_params(reference_parameters())}), 2 replicas, {dense['seeds']} seeds "
                     f"({csv_link(page, rel, 'time to loss')}) |")
    lines += _long_h_recipe_rows(page)
    for size in sorted({int(r["parameters"]) for r in scale}):
        for form, entry, situation, config in (
                ("muon", "muloco_sign", f"Muon: H against model size (here {_params(size)} parameters)", "muloco_sign"),
                ("adamw", "adamw_sign", f"You train with AdamW ({_params(size)} parameters)",
                 "[adamw_sign.json](configs/adamw_sign.json)")):
            rows = [r for r in scale if int(r["parameters"]) == size and r["form"] == form and r["device"] == "cpu"]
            base = next((r for r in rows if r["entry"] != entry), None)
            recipe = [r for r in rows if r["entry"] == entry]
            if base is None or not recipe:
                continue
            ratio = {r["H"]: times(float(r["ratio_to_dense"])) if r["ratio_to_dense"] else "missed on a seed"
                     for r in recipe}
            cells = ", ".join(f"H {h}: {ratio[h]}" for h in sorted(ratio, key=int))
            fewer = ", ".join(f"H {r['H']}: {times(float(r['bytes_ratio_to_dense']))}"
                              for r in sorted(recipe, key=lambda r: int(r["H"])))
            n_seeds = len(base["seeds"].split(","))
            lines.append(f"| {situation} | {_config_links(page, config)}, inner settings your dense run's | median "
                         f"steps vs dense {form} ({base['median_steps']}): {cells} | {fewer} (DDP, fp32 gradients) | "
                         f"not measured | reference GPT at {_params(size)}, 2 replicas, {n_seeds} seeds, CPU "
                         f"({csv_link(page, committed.SCALE, 'model size')}) |")
    return head + "\n".join(lines) + "\n"


def _long_h_recipe_rows(page: Path) -> list[str]:
    """The long-H recipe's row (recipes.RECOMMENDED's muloco_sign_long): its measured entry at its
    H and growth in the long_h summary, per model size and replica count."""
    from ds_lowcomm.optim.recipes import RECOMMENDED

    from .measured import runs_recipe
    from .runs import run_group

    if not (BENCH / committed.LONG_H_SUMMARY).exists():
        return []
    section = RECOMMENDED["muloco_sign_long"]["lowcomm"]
    schedule = section.get("sync_every_schedule", ())
    how = f"H {section['sync_every']}" + "".join(f", {h} from step {step}" for step, h in schedule)
    if section.get("outer_momentum"):
        how += f", outer lr {section['outer_lr']} and Nesterov momentum {section['outer_momentum']}"
    lines = []
    rows = _rows(committed.LONG_H_SUMMARY)
    for r in rows:
        if not runs_recipe(r, "muloco_sign_long"):
            continue
        dense = next(d for d in rows if d["entry"] == "muon" and run_group(d) == run_group(r))
        ratio = times(float(r["ratio_to_muon"])) if r["ratio_to_muon"] else "missed on a seed"
        seeds = len(r["seeds"].split(","))
        lines.append(f"| You train for thousands of steps and want the fewest bytes | "
                     f"{_config_links(page, '[muloco_sign_long.json](configs/muloco_sign_long.json)')} or "
                     f"{_config_links(page, '[muloco_sign_long_zero2_bf16.json](configs/muloco_sign_long_zero2_bf16.json)')} "
                     f"(DeepSpeed's Muon section): {how} | {r['median_steps'] or 'missed'} vs "
                     f"{dense['median_steps']} ({ratio}) | {times(float(r['vs_ddp_bf16']))} (DDP + Muon, bf16 gradients) | "
                     f"not measured | reference GPT ({_params(int(r['parameters']))}), {r['replicas']} replicas, "
                     f"{seeds} seed{'s' if seeds > 1 else ''}, a {r['budget']}-step budget, {r['data_shards']} data shards, on {r['machine']} "
                     f"({csv_link(page, committed.LONG_H, 'long intervals')}) |")
    return lines


COMPARE_ORDER = ("muon", "muloco_sign", "adamw", "demo", "diloco", "dct_diloco", "sparseloco", "mtdao")


def render_compare(page: Path) -> str:
    rows = {r["method"]: r for r in _rows(committed.COMPARE_RESULTS)}
    muon = float(rows["muon"]["bytes_sent_per_worker"])
    out = ["| entry | held-out loss | MB sent per worker | fewer than dense (DDP's fp32 all-reduce) |",
           "| --- | --- | --- | --- |"]
    for name in (n for n in COMPARE_ORDER if n in rows):
        r = rows[name]
        sent = float(r["bytes_sent_per_worker"])
        out.append(f"| {name} | {float(r['final_val_loss']):.4f} | {sent / 1e6:.2f} | {times(muon / sent)} |")
    steps, workers = {r["steps"] for r in rows.values()}, {r["workers"] for r in rows.values()}
    out.append("")
    out.append(f"({'/'.join(sorted(workers))} workers, {'/'.join(sorted(steps))} steps, seed 0, "
               f"{csv_link(page, committed.COMPARE_RESULTS, 'results.csv')})")
    return "\n".join(out) + "\n"


# -- replicas -------------------------------------------------------------------------------------
def _one_bit_sync_bytes() -> dict:
    """{(exchange, replicas): row} of the one-bit recipe's bytes per sync."""
    return {(r["exchange"], int(r["replicas"])): r for r in _rows(committed.ONE_BIT_BYTES_PER_SYNC)
            if r["entry"] == "muloco_sign"}


def render_replica_bytes(page: Path) -> str:
    rows = _rows(committed.ONE_BIT_BYTES_PER_SYNC)

    def per_sync(r: dict) -> float:  # the wire's payload (for muloco_sign the ledger's received, to the byte)
        return float(r["wire_bytes_per_sync"])

    def how(r: dict) -> str:
        if r["measured"] != "True":
            return "formula"
        return (f"measured: veth sent {float(r['measured_bytes_per_sync']) / 1e3:.1f}, "
                f"received {float(r['measured_received_bytes_per_sync']) / 1e3:.1f}")

    sign = _one_bit_sync_bytes()
    ddp = {int(r["replicas"]): r for r in rows if r["entry"] == "muon_bf16"}
    base = per_sync(sign[("auto", 2)])
    out = ["| replicas | muloco_sign (H 5), kB per worker per sync | vs its 2 replicas | as an all-gather | "
           "DDP + Muon (bf16 gradients), kB per worker per step | fewer bytes a step than DDP | how (kB, with headers) |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for n in sorted({n for _, n in sign}):
        auto = sign[("auto", n)]
        gather = sign.get(("all_gather", n), auto if auto["exchange_used"] == "all_gather" else None)
        mine, step = per_sync(auto), per_sync(auto) / float(auto["sync_every"])
        dense = per_sync(ddp[n]) if n in ddp else None
        out.append(f"| {n} | {mine / 1e3:.1f} ({auto['exchange_used'].replace('_', '-')}) | {times(mine / base)} | "
                   + (f"{per_sync(gather) / 1e3:.1f} ({times(per_sync(gather) / base)})" if gather else "-") + " | "
                   + (f"{dense / 1e3:.0f} | {times(dense / step)}" if dense else "- | -") + f" | {how(auto)} |")
    out.append("")
    out.append("(reference GPT, 446k parameters; bytes on the wire, each way: a worker receives what it sends; "
               f"{csv_link(page, committed.ONE_BIT_BYTES_PER_SYNC)})")
    return "\n".join(out) + "\n"


def render_replica_steps(page: Path) -> str:
    """Steps to the fair target by replica count and exchange (seeds 1-3), and the bytes to it."""
    runs: dict[tuple[int, str], list[int | None]] = {}
    for r in _rows(committed.ONE_BIT_STEPS):
        exchange = json.loads(r["settings"])["lowcomm.exchange"]
        runs.setdefault((int(r["workers"]), exchange), []).append(int(r["steps_to_target"]) if r["steps_to_target"] else None)
    two = _ttl(_rows(committed.MUON_RECIPES_TTL), "unshaped", "muloco_sign")
    sync = _one_bit_sync_bytes()
    h = 5
    body, medians = [], {}
    for (n, exchange), steps in [((2, "all_gather"), None), *sorted(runs.items())]:
        if steps is None:  # the 2-replica all-gather: the time-to-loss run's seeds 1-3 at the same configuration
            median, spread = int(two["steps_to_target"]), two["steps_range"]
        else:
            if n == 2 or None in steps:
                continue
            median, spread = int(statistics.median(steps)), f"{min(steps)}-{max(steps)}"
        medians[(n, exchange)] = median
        wire = sync.get((exchange, n)) or sync[("auto", n)]
        vs = times(median / medians[(n, "all_gather")]) if exchange == "all_reduce" else "-"
        label = exchange.replace("_", "-") + (" (auto)" if wire["exchange_used"] == exchange and wire["exchange"] == "auto"
                                              else "")
        body.append([str(n), label, f"{median} ({spread})", vs, f"{median / h * float(wire['wire_bytes_per_sync']) / 1e6:.2f}"])
    return captioned(["replicas", "exchange", "steps to the target, median (range), seeds 1-3", "vs the all-gather",
                 "MB per worker to the target (median steps / H x the wire's bytes a sync)"], body,
                     f"(the recipe at H {h}; 2 replicas: the time-to-loss run; "
                f"{csv_link(page, committed.ONE_BIT_STEPS, 'steps')}, {csv_link(page, committed.ONE_BIT_BYTES_PER_SYNC, 'bytes')})")


# The methods' entries at their bench settings, by the exchange their bytes grow with
METHOD_BYTES = (("adamw", "adamw, muon: fp32 all-reduce"), ("muon_bf16", "DDP + Muon, bf16 gradients (all-reduce)"),
                ("demo", "demo (all-gather, 1 of 64, int8)"), ("demo_muon_c16", "demo_muon_c16 (all-gather)"),
                ("dion", "dion (all-reduce of factors)"), ("diloco", "diloco, muloco (H 20, fp32 all-reduce)"),
                ("dct_diloco", "dct_diloco (H 20, all-gather)"), ("sparseloco", "sparseloco (H 20, all-gather)"),
                ("muloco_dct", "muloco_dct (H 5, all-gather)"), ("mtdao", "mtdao (H 32, all-reduce)"),
                ("powersgd_r8", "DDP + PowerSGD rank 8 (all-reduce of P, Q)"))


def render_replica_methods(page: Path) -> str:
    """Each method's bytes per worker per step by replica count (measured at 2 and 4, formula beyond)."""
    rows = {(r["entry"], int(r["replicas"])): r for r in _rows(committed.BYTES_PER_STEP_BY_METHOD)}
    counts = sorted({n for _, n in rows})
    ddp = {n: float(rows[("muon_bf16", n)]["wire_bytes_per_step"]) for n in counts}
    body = []
    for entry, label in METHOD_BYTES:
        step = {n: float(rows[(entry, n)]["wire_bytes_per_step"]) for n in counts}
        body.append([label, *(f"{step[n] / 1e3:.1f}" for n in counts),
                     *(times(ddp[n] / step[n]) for n in (counts[0], counts[-1]))])
    measured = sorted({n for (_, n), r in rows.items() if r["measured"] == "True"})
    return captioned(["entry", *(f"kB per worker per step, {n} replicas" for n in counts),
                 f"fewer than DDP + Muon bf16, {counts[0]} replicas", f"at {counts[-1]}"], body,
                     f"(reference GPT, 446k parameters; measured on {' and '.join(map(str, measured))} test hosts (veth "
                f"counters), the planner's formula beyond; {csv_link(page, committed.BYTES_PER_STEP_BY_METHOD)})")


def render_sharded_replicas(page: Path) -> str:
    rows = _rows(committed.SHARDED_REPLICA_BYTES)
    body = [[r["replica_size"], r["world"], f"{float(r['cross_replica_bytes_per_rank']) / 1e6:.3f}",
             f"{float(r['cross_replica_bytes_per_replica']) / 1e6:.3f}", "yes" if r["replicas_identical"] == "True" else "no"]
            for r in rows]
    return captioned(["ranks per replica", "world", "MB across replicas per rank", "per replica", "replicas identical"], body,
                     f"(DeepSpeed engines, ZeRO 0, dct_diloco, 2 replicas; {csv_link(page, committed.SHARDED_REPLICA_BYTES)})")


# -- slow links -----------------------------------------------------------------------------------
LINK_NAMES = {"unshaped": "unshaped", "100mbit": "100 Mbit/s", "25mbit": "25 Mbit/s", "10mbit": "10 Mbit/s",
              "3mbit": "3 Mbit/s"}


def _ratio(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def ttl_table(page: Path, rel: str, entries: tuple[tuple[str, str], ...], links: tuple[str, ...],
              bytes_vs: str | None = None) -> str:
    """A time-to-loss run's table: each entry's steps to the target (median and range over the
    seeds), its bytes to the target, and on each link its time to the target (median over the
    seeds) with its speed-up over the run's dense baseline there."""
    rows = [r for r in _rows(rel) if r["hosts"] == "2"]
    at = {(r["link"], r["entry"]): r for r in rows}
    speed, base = (("speedup_vs_dense", "dense_baseline") if "speedup_vs_dense" in rows[0]
                   else ("speedup_vs_adamw", "adamw_baseline"))
    ratio = {link: float(at[(link, entries[0][0])]["comm_compute_ratio"]) for link in links}
    head = ["entry", "steps (median, range)", "MB per worker to the target",
            *([f"fewer bytes than {bytes_vs}"] if bytes_vs else []),
            *(f"{LINK_NAMES[link]} (ratio {_ratio(ratio[link])}): s, vs dense" for link in links)]
    body = []
    for entry, label in entries:
        r = at[("unshaped", entry)]
        sent = float(r["bytes_sent_per_worker"])
        cells = [label, f"{r['steps_to_target']} ({r['steps_range']})", _mb(sent)]
        if bytes_vs:
            cells.append(times(float(at[("unshaped", bytes_vs)]["bytes_sent_per_worker"]) / sent))
        for link in links:
            s = at[(link, entry)]
            cells.append(f"{float(s['time_to_target_s']):.1f}, {times(float(s[speed]))}")
        body.append(cells)
    baselines = ", ".join(f"{LINK_NAMES[link]} {at[(link, entries[0][0])][base]}" for link in links)
    seeds = rows[0]["seeds"]
    return captioned(head, body,
                     f"(2 test hosts; steps and bytes from {seeds} seeds on the unshaped link, seconds from each link's "
                f"timing run at each seed's steps, medians; the dense baseline on each link: {baselines}; "
                f"{csv_link(page, rel)})")


MUON_LINKS = ("unshaped", "10mbit", "3mbit")
# Each time-to-loss table: its run, the entries it shows (as labelled), its links, the entry whose
# bytes the others are set against
TTL_TABLES = {
    "ttl_muon": (committed.MUON_RECIPES_TTL, (
        ("muon_bf16", "DDP + Muon, bf16 gradients"), ("muloco_sparse", "MuLoCo's design (top-k 1024 of 4096, 2-bit, H 10)"),
        ("muloco_dct", "muloco_dct (DCT top-8 of 64, 2-bit, H 5)"), ("muloco_dct_overlap", "muloco_dct, overlapped"),
        ("muloco_sign", "**muloco_sign** (H 5)"), ("muloco_sign_h10", "muloco_sign, H 10"),
        ("muloco_sign_overlap", "muloco_sign, sync overlapped by 2 steps")), MUON_LINKS, "muon_bf16"),
    "ttl_muon_every_step": (committed.MUON_EVERY_STEP_TTL, (
        ("muon_bf16", "DDP + Muon, bf16 gradients"), ("muloco_sparse", "MuLoCo's design"),
        ("muloco_sign", "muloco_sign (blocking, H 5)"), ("muloco_sign_overlap", "muloco_sign, overlapped by 2 steps"),
        ("muloco_sign_overlap_d1", "**muloco_sign, overlapped by 1 step**")), MUON_LINKS, "muon_bf16"),
    "ttl_muon_peers": (committed.MUON_PEERS_TTL, (
        ("muon", "DDP + Muon, fp32 gradients"), ("muon_bf16", "DDP + Muon, bf16 gradients"),
        ("demo_muon", "demo with Muon's step"), ("muloco", "MuLoCo uncompressed (diloco + Muon, H 10)"),
        ("muloco_sparse", "MuLoCo's design (top-k 1024 of 4096, 2-bit, H 10)"),
        ("muloco_dct", "muloco_dct (DCT top-8 of 64, 2-bit, H 5)"),
        ("torchft_streaming_diloco_muon", "torchft Streaming DiLoCo + Muon (H 20)")), MUON_LINKS, "muon_bf16"),
    "ttl_adamw": (committed.ADAMW_TTL, (
        ("adamw", "adamw (blocking fp32 all-reduce)"), ("adamw_overlap", "DDP, fp32, overlapped"),
        ("adamw_overlap_bf16", "DDP, bf16 hook"), ("demo", "demo, tuned alike"),
        ("demo_recipe", "demo's recipe (tuned before, outside the equal budget)"),
        ("powersgd_r8", "DDP + PowerSGD (rank 16 from step 30)"), ("torchft_diloco", "torchft DiLoCo (H 20)"),
        ("torchft_streaming_diloco", "torchft Streaming DiLoCo (H 20, 4 fragments)")),
        ("unshaped", "100mbit", "25mbit", "10mbit", "3mbit"), None),
    "ttl_demo_muon": (committed.DEMO_MUON_TTL, (
        ("adamw", "adamw (tuned)"), ("adamw_overlap_bf16", "DDP, bf16 hook"),
        ("demo_recipe", "demo (sign step; its recipe)"), ("demo_muon", "**demo_muon** (Muon's step)"),
        ("demo_muon_c16", "**demo_muon_c16** (Muon's step, 2 of 256)"),
        ("torchft_streaming_diloco", "torchft Streaming DiLoCo (tuned)")), MUON_LINKS, "adamw_overlap_bf16"),
}


def render_streaming(page: Path) -> str:
    rows = _rows(committed.STREAMING)
    body = []
    for link in ("100mbit", "unshaped"):
        for variant in dict.fromkeys(r["variant"] for r in rows):
            group = [r for r in rows if r["link"] == link and r["variant"] == variant]
            med = {k: statistics.median(float(r[k]) for r in group)
                   for k in ("median_step_s", "sync_step_s", "stall_per_sync_s", "comm_blocked_s", "wall_s", "final_val_loss")}
            body.append([LINK_NAMES[link], variant,
                         f"{med['median_step_s']:.3f}", f"{med['sync_step_s']:.3f}", f"{med['stall_per_sync_s']:.3f}",
                         f"{med['comm_blocked_s']:.2f}", f"{med['wall_s']:.1f}", f"{med['final_val_loss']:.4f}"])
    return captioned(["link", "variant", "ordinary step, s", "step where a sync lands, s", "stall per sync, s",
                 "blocked in comm over the run, s", "wall, s", "held-out loss"], body,
                     f"(2 test hosts, a 3.2M-parameter GPT, 60 steps, medians of 3; {csv_link(page, committed.STREAMING)})")


# -- long outer intervals -------------------------------------------------------------------------
def _schedule(r: dict) -> str:
    """H as the row ran it: one value, or its growth ("5, 10 from 100, ...")."""
    if not r.get("schedule"):
        return str(r["H"])
    return ", ".join([str(r["H"])] + [f"{h} from {step}" for step, h in json.loads(r["schedule"])])


def _how(settings: str) -> str:
    """What a long-H row changes over the recipe: its values and outer step, its overlap."""
    s = json.loads(settings)
    parts = []
    if s.get("lowcomm.value_dtype", "sign") != "sign":
        parts.append(f"{s['lowcomm.value_dtype']} values")
    if s.get("lowcomm.outer_momentum"):
        parts.append(f"outer lr {s['lowcomm.outer_lr']}, Nesterov {s['lowcomm.outer_momentum']}")
    if s.get("lowcomm.fragments", 1) > 1:
        parts.append(f"{s['lowcomm.fragments']} fragments, mixed {s.get('lowcomm.fragment_mix', 0)}")
    if s.get("lowcomm.eager"):
        parts.append("eager")
    if s.get("lowcomm.sync_delay"):
        parts.append(f"landing {s['lowcomm.sync_delay']} step(s) on")
    return "; ".join(parts) or "the recipe"


def render_long_h(page: Path) -> str:
    """Per model size, replica count and budget: dense Muon and each measured candidate, median
    steps to the target over seeds 1-3 and bytes per worker to it against DDP's with bf16 gradients."""
    body = []
    for r in _rows(committed.LONG_H_SUMMARY):
        dense = r["entry"] == "muon"
        body.append([_params(int(r["parameters"])), r["replicas"], r["budget"], "dense Muon" if dense else r["entry"],
                     "" if dense else _schedule(r), "" if dense else _how(r["settings"]),
                     r["seeds"].replace(",", ", "), r["steps"].replace("None", "missed").replace(",", ", "),
                     r["median_steps"] or "-",
                     times(float(r["ratio_to_muon"])) if r["ratio_to_muon"] else "missed on a seed",
                     _mb(float(r["median_bytes_per_worker"])), times(float(r["vs_ddp_bf16"])) if r["vs_ddp_bf16"] else "-",
                     r["data_shards"], r["machine"]])
    return captioned(["parameters", "replicas", "budget", "entry", "H", "over the recipe", "seeds", "steps to the target",
                      "median", "vs dense Muon", "MB per worker to the target", "fewer bytes than DDP, bf16 gradients",
                      "data shards", "machine"],
                     body, f"(CPU, gloo; each ratio against dense Muon on the same machine; the target dense Muon's "
                           f"held-out loss at 2/3 of the budget; "
                           f"{csv_link(page, committed.LONG_H)}, {csv_link(page, committed.LONG_H_SUMMARY, 'medians')})")


def render_long_h_tuning(page: Path) -> str:
    """Each candidate's configurations on the tuning seed, steps and bytes to the target."""
    rows = [r for r in _rows(committed.LONG_H) if r["role"] == "tune"]
    body = []
    for r in rows:
        sent = max(float(r["bytes_sent_per_worker"]), float(r["bytes_received_per_worker"] or 0))
        body.append([_params(int(r["parameters"])), r["replicas"], "dense Muon" if r["entry"] == "muon" else r["entry"],
                     "" if r["entry"] == "muon" else _schedule(r),
                     f"Muon lr {json.loads(r['settings'])['peer.muon_lr']}" if r["entry"] == "muon" else _how(r["settings"]),
                     r["steps_to_target"] or "missed", f"{float(r['final_val_loss']):.4f}", _mb(sent), r["data_shards"],
                     r["machine"]])
    return captioned(["parameters", "replicas", "entry", "H", "configuration", "steps to the target, seed 0",
                      "held-out loss at its last evaluation", "MB per worker to the target", "data shards", "machine"], body,
                     f"(seed 0, each entry's configurations; dense Muon by its Muon lr, each run its whole budget; "
                     f"{csv_link(page, committed.LONG_H)})")


# -- model size -----------------------------------------------------------------------------------
def render_scale(page: Path) -> str:
    """Per model size: dense and the one-bit recipe at each H, steps to the target on each seed."""
    rows = [r for r in _rows(committed.SCALE_SUMMARY) if r["device"] == "cpu"]
    body = []
    for r in sorted(rows, key=lambda r: (int(r["parameters"]), r["form"] != "muon", int(r["H"]))):
        dense = r["entry"] in ("muon", "adamw")
        steps = ", ".join("missed" if s == "None" else s for s in r["steps"].split(","))
        body.append([_params(int(r["parameters"])), r["form"], f"dense {r['form']}" if dense else r["entry"],
                     "" if dense else r["H"], steps, r["median_steps"] or "-",
                     times(float(r["ratio_to_dense"])) if r["ratio_to_dense"] else
                     f"missed on {steps.count('missed')} of {len(r['steps'].split(','))} seeds",
                     times(float(r["bytes_ratio_to_dense"]))])
    return captioned(["parameters", "form", "entry", "H", "steps to the target, seeds 1-3", "median", "vs dense",
                 "bytes to the target, fewer than dense"], body,
                     f"(2 workers, CPU; the recipe's inner settings the dense run's tuned ones; {csv_link(page, committed.SCALE)}, "
                f"{csv_link(page, committed.SCALE_SUMMARY, 'medians')})")


def render_cnn(page: Path) -> str:
    rows = _rows(committed.CNN)
    body = [[r["method"], f"{float(r['held_out_accuracy']):.1%}", f"{float(r['held_out_loss']):.3f}",
             f"{float(r['mb_sent_per_worker']):.2f}", times(float(r["compression_vs_adamw"]))] for r in rows]
    return captioned(["method", "held-out accuracy", "held-out loss", "MB sent per worker", "fewer than adamw"], body,
                     f"(a 9.9k-parameter CNN on scikit-learn's digits, 2 workers, 300 steps, first-try recipes; "
                f"{csv_link(page, committed.CNN)})")


def render_cnn_ablation(page: Path) -> str:
    rows = _rows(committed.CNN_ABLATION)
    body = [[r["variant"], f"{float(r['held_out_accuracy']):.1%}", f"{float(r['held_out_loss']):.3f}",
             f"{float(r['mb_sent_per_worker']):.3f}"] for r in rows]
    return captioned(["dct_diloco, one change at a time", "held-out accuracy", "held-out loss", "MB sent per worker"], body,
                     f"(one seed, 16 CPU cores; {csv_link(page, committed.CNN_ABLATION)})")


# -- fault tolerance ------------------------------------------------------------------------------
def _faults_cells(r: dict, heals: str) -> list[str]:
    rate = float(r["survivor_steps_per_s"]) / float(r["no_fault_steps_per_s"])
    loss, clean = float(r["final_val_loss"]), float(r["no_fault_final_val_loss"])
    return [r["kills"], f"{float(r['survivor_steps_per_s']):.2f} / {float(r['no_fault_steps_per_s']):.2f}",
            f"{rate:.2f}", f"{float(r['time_to_target_s']):.1f}", f"{loss:.4f} ({_pct(loss / clean - 1)})", heals]


def render_faults(page: Path) -> str:
    """Today's fault-tolerance path: the outer method with the full and the lean heal, demo."""
    heals = {r["entry"]: r for r in _rows(committed.FAULTS_HEALS)}
    demo = next(r for r in _rows(committed.FAULTS_DEMO) if r["quorum"] == "sync")
    body = [["diloco (full heal)", *_faults_cells(heals["diloco"], _heal(heals["diloco"]))],
            ["diloco, `heal_inner_state: false`", *_faults_cells(heals["diloco_lean"], _heal(heals["diloco_lean"]))],
            ["demo", *_faults_cells(demo, _heal(demo))]]
    return captioned(["entry", "kills", "steps/s, faults / no faults", "ratio", "s to the target", "held-out loss, faults "
                 "(vs no faults)", "MB healed per kill"], body,
                     f"(3 replicas on 10 Mbit/s, a kill every 30 s, alone on the machine; "
                f"{csv_link(page, committed.FAULTS_HEALS, 'diloco')}, {csv_link(page, committed.FAULTS_DEMO, 'demo')})")


def _heal(r: dict) -> str:
    return f"{float(r['heal_bytes']) / int(r['kills']) / 1e6:.2f}"


FAULTS_PEERS = (("diloco", "diloco (ds_lowcomm over torchft)"), ("demo", "demo (ds_lowcomm over torchft)"),
                ("torchft_diloco", "torchft's DiLoCo"), ("restart", "stop-and-restart (diloco, a checkpoint every sync)"))


def render_faults_peers(page: Path) -> str:
    rows = {r["entry"]: r for r in _rows(committed.FAULTS_PEERS)}
    body = [[label, *_faults_cells(rows[e], f"{float(rows[e]['heal_bytes']) / 1e6:.1f}")[:-1],
             f"{float(rows[e]['heal_bytes']) / 1e6:.1f}"] for e, label in FAULTS_PEERS]
    return captioned(["entry", "kills", "steps/s, faults / no faults", "ratio", "s to the target",
                 "held-out loss, faults (vs no faults)", "MB healed, all kills"], body,
                     f"(the first run, before the retries, the background heal and the lean heal; "
                f"{csv_link(page, committed.FAULTS_PEERS)})")


def render_absent(page: Path) -> str:
    rows = _rows(committed.ABSENT)
    none = float(next(r for r in rows if r["absent"] == "none")["final_val_loss"])
    faults = float(next(r for r in _rows(committed.FAULTS_HEALS) if r["entry"] == "diloco")["final_val_loss"])
    two_kills = "1:100,120;2:200,220"  # the faults run's schedule: replica 1 dead at the syncs of 100 and 120, 2 at 200, 220

    def label(absent: str) -> str:
        if absent == "none":
            return "none"
        return "; ".join(f"replica {rep} at steps {steps.replace(',', ', ')}"
                         for rep, steps in (part.split(":") for part in absent.split(";")))
    body = []
    for r in rows:
        loss = float(r["final_val_loss"])
        body.append([label(r["absent"]), f"{loss:.4f}", "" if r["absent"] == "none" else _pct(loss / none - 1),
                     f"{faults:.4f} ({_pct(faults / loss - 1)} over this)" if r["absent"] == two_kills else ""])
    return captioned(["replicas left out of the syncs", "held-out loss after 300 steps", "vs none",
                 "the faults run with these syncs missed (diloco, 2 kills)"], body,
                     f"(diloco, 3 replicas, no fault at all: a replica sits the sync out; "
                f"{csv_link(page, committed.ABSENT)})")


# -- codec ----------------------------------------------------------------------------------------
def _codec_rows(rel: str) -> list[list[str]]:
    """Each case of a codec run: ds_lowcomm's time beside the per-parameter reference's."""
    rows = _rows(rel)
    pairs: dict[tuple, dict] = {}
    for r in rows:
        pairs.setdefault((r["case"], r["shape"], r["chunk"]), {})[r["implementation"]] = r
    body = []
    for (case, shape, chunk), p in pairs.items():
        ours, ref = p["ds_lowcomm"], p["reference"]
        name = "reference model, 28 tensors" if case == "model" else ("vector of " + shape if "x" not in shape
                                                                      else shape.replace("x", "×"))
        body.append([name, chunk, f"{float(ours['median_s']) * 1e3:.2f} ms ({float(ours['gbps']):.2f} GB/s)",
                     f"{float(ref['median_s']) * 1e3:.2f} ms ({float(ref['gbps']):.2f} GB/s)",
                     times(float(ref["median_s"]) / float(ours["median_s"]))])
    return body


CODEC_HEAD = ["tensor", "chunk", "ds_lowcomm", "per-parameter reference", "speed-up"]


def render_codec_cpu(page: Path) -> str:
    return captioned(CODEC_HEAD, _codec_rows(committed.CODEC_CPU),
                     f"(one CPU thread, fp32, density 1/128, medians of 5; {csv_link(page, committed.CODEC_CPU)})")


def render_codec_h100(page: Path) -> str:
    return captioned(CODEC_HEAD, _codec_rows(committed.CODEC_H100),
                     f"(one NVIDIA H100 80GB, fp32, density 1/128, medians of 20; {csv_link(page, committed.CODEC_H100)})")


def render_codec_share(page: Path) -> str:
    rows = _rows(committed.CODEC_SHARE)
    body = [[r["method"], r["syncs"], f"{float(r['codec_s_per_sync']) * 1e3:.1f}", f"{float(r['step_s']) * 1e3:.1f}",
             f"{float(r['codec_share']):.1%}"] for r in rows]
    return captioned(["method", "syncs in 60 steps", "codec ms per sync", "ms per step", "codec share of the step"], body,
                     f"(reference GPT, 2 workers, CPU, the recipes of compare; {csv_link(page, committed.CODEC_SHARE)})")


# -- frameworks -----------------------------------------------------------------------------------
def render_megatron(page: Path) -> str:
    rows = {(r["tp"], r["entry"]): r for r in _rows(committed.MEGATRON)}
    labels = {"stock": "stock Megatron DDP", "adamw": "adamw (through ds_lowcomm)"}
    entries = dict.fromkeys(e for _, e in rows)
    body = []
    for e in entries:
        cells = [labels.get(e, e)]
        for tp in ("1", "2"):
            r = rows[(tp, e)]
            cells += [f"{int(r['bytes_per_step_per_worker']):,}", times(float(r["x_fewer_than_stock"])),
                      f"{float(r['val_loss']):.4f}"]
        body.append(cells)
    return captioned(["method", "bytes per iteration per worker, TP 1", "fewer than stock", "held-out loss",
                 "bytes, TP 2 (4 ranks)", "fewer than stock", "held-out loss"], body,
                     f"(a 137k-parameter GPTModel, 2 data-parallel replicas, 200 iterations, one seed; "
                f"{csv_link(page, committed.MEGATRON)})")


def render_hf_trainer(page: Path) -> str:
    rows = _rows(committed.HF_TRAINER)
    at = {(r["entry"], r["link"], r["steps"]): r for r in rows}
    plain = float(at[("deepspeed", "unshaped", "200")]["bytes_sent_per_worker"])
    body = []
    for (entry, link, steps), r in at.items():
        if link != "unshaped":
            continue
        shaped = at.get((entry, "10mbit", steps))
        name = "deepspeed (plain, ZeRO 1)" if entry == "deepspeed" else entry
        if steps != "200":
            name += f", lr 4e-3, {steps} steps"
        sent = float(r["bytes_sent_per_worker"])
        body.append([name, f"{float(r['held_out_loss']):.4f}", _mb(sent), times(plain / sent), f"{float(r['step_s']):.3f}",
                     f"{float(shaped['step_s']):.3f}" if shaped else "-"])
    return captioned(["entry", "held-out loss", "MB sent per worker", "fewer than plain DeepSpeed", "s a step, unshaped",
                 "s a step, 10 Mbit/s"], body,
                     f"(transformers' Llama, 390k parameters, 2 test hosts, 200 steps, one seed, the methods at their "
                f"compare recipes; {csv_link(page, committed.HF_TRAINER)})")


def render_hf_one_bit(page: Path) -> str:
    rows = [r for r in _rows(committed.HF_ONE_BIT) if r["adam_lr"] == "0.024"]
    lrs = sorted({float(r["lr"]) for r in rows})
    at = {(r["entry"], float(r["lr"])): r for r in rows}

    def line(entry: str, label: str) -> list[str]:
        return [label, *(f"{float(at[(entry, lr)]['held_out_loss']):.4f}" for lr in lrs)]
    dense = float(at[("deepspeed_muon", lrs[0])]["bytes_sent_per_worker"])
    recipe = float(at[("muloco_sign", lrs[0])]["bytes_sent_per_worker"])
    return captioned(["Muon lr", *(f"{lr:g}" for lr in lrs)], [
        line("deepspeed_muon", f"DeepSpeed's Muon, ZeRO 0 ({dense / 1e6:.0f} MB per worker)"),
        line("muloco_sign", f"muloco_sign at the same settings ({recipe / 1e6:.2f} MB, {times(dense / recipe)} fewer)")],
                     f"(the same Llama through the Trainer, 200 steps, one seed, loopback, Adam half's lr 0.024; "
                f"{csv_link(page, committed.HF_ONE_BIT)})")


def render_pipeline_activations(page: Path) -> str:
    rows = _rows(committed.PIPELINE_ACTIVATIONS)
    none = next(r for r in rows if r["codec"] == "none")
    body = [[r["codec"] + (f": {r['settings']}" if r["settings"] else ""), f"{int(r['bytes_per_microbatch_per_boundary']):,}",
             times(int(none["bytes_per_microbatch_per_boundary"]) / int(r["bytes_per_microbatch_per_boundary"])),
             r["held_out_loss"], "-" if r is none else _pct(float(r["held_out_loss"]) / float(none["held_out_loss"]) - 1)]
            for r in rows]
    return captioned(["codec (forward = backward)", "bytes per micro-batch per boundary", "fewer than none",
                 "held-out loss, 300 steps", "vs none"], body,
                     f"(the reference GPT as a 2-stage DeepSpeed pipeline, adamw, one seed; "
                f"{csv_link(page, committed.PIPELINE_ACTIVATIONS)})")


def render_mixed_replicas(page: Path) -> str:
    rows = _rows(committed.MIXED_REPLICAS)
    body = [[r["layout"], r["replicas"], r["held_out_loss"], r["method_mb_per_worker"], r["activation_mb_per_worker"],
             f"{r['loop_s_run1']} / {r['loop_s_run2']}"] for r in rows]
    return captioned(["layout", "replicas", "held-out loss", "MB across replicas per worker", "MB between stages per worker",
                 "loop s (two runs)"], body,
                     f"(3 test hosts at 100 Mbit/s, sparseloco's recipe, 300 steps, one seed; "
                f"{csv_link(page, committed.MIXED_REPLICAS)})")


# -- peers ----------------------------------------------------------------------------------------
MTDAO_ENTRIES = (("adamw", "adamw"), ("mtdao", "mtdao (its authors' recipe)"),
                 ("local_adam", "local Adam (DES-LOC's baseline)"), ("diloco", "diloco (H 32)"), ("demo", "demo"))


def render_mtdao(page: Path) -> str:
    rows = _rows(committed.MTDAO)
    body = []
    for entry, label in MTDAO_ENTRIES:
        mine = [r for r in rows if r["entry"] == entry]
        tuning = [r for r in mine if r["seed"] == "0"]
        best = min(tuning, key=lambda r: float(r["final_val_loss"]))
        ran = next((r["lr"] for r in mine if r["seed"] != "0"), best["lr"])  # the lr the other seeds ran at
        loss = {r["seed"]: f"{float(r['final_val_loss']):.4f}" for r in mine if r["lr"] == ran}
        body.append([label, ", ".join(f"{float(r['lr']):g}" for r in tuning),
                     f"{float(best['final_val_loss']):.4f} (lr {float(best['lr']):g})", f"{float(ran):g}",
                     *(loss.get(s, "-") for s in ("0", "1", "2")), f"{float(mine[0]['bytes_sent_per_worker']) / 1e6:.0f}"])
    return captioned(["entry", "lrs tried on seed 0", "seed 0, best of them", "lr of the seeds", "held-out loss, seed 0",
                 "seed 1", "seed 2", "MB sent per worker"], body,
                     f"(reference task, 2 workers, 3000 steps; {csv_link(page, committed.MTDAO)})")


RENDER = {
    "recipes": render_recipes, "compare": render_compare,
    "replica_bytes": render_replica_bytes, "replica_steps": render_replica_steps,
    "replica_methods": render_replica_methods, "sharded_replicas": render_sharded_replicas,
    **{name: functools.partial(ttl_table, rel=rel, entries=entries, links=links, bytes_vs=bytes_vs)
       for name, (rel, entries, links, bytes_vs) in TTL_TABLES.items()},
    "streaming": render_streaming,
    "scale": render_scale, "cnn": render_cnn, "cnn_ablation": render_cnn_ablation,
    "long_h": render_long_h, "long_h_tuning": render_long_h_tuning,
    "faults": render_faults, "faults_peers": render_faults_peers, "absent": render_absent,
    "codec_cpu": render_codec_cpu, "codec_h100": render_codec_h100, "codec_share": render_codec_share,
    "megatron": render_megatron, "hf_trainer": render_hf_trainer, "hf_one_bit": render_hf_one_bit,
    "pipeline_activations": render_pipeline_activations, "mixed_replicas": render_mixed_replicas,
    "mtdao": render_mtdao,
}


def blocks(text: str) -> dict[str, str]:
    return {m["name"]: m["body"] for m in BLOCK.finditer(text)}


def render(name: str, page: Path) -> str:
    if name not in RENDER:
        raise SystemExit(f"{page}: figures block {name!r} is no renderer's; known: {', '.join(RENDER)}")
    return RENDER[name](page)


def rewrite(text: str, page: Path) -> str:
    return BLOCK.sub(lambda m: f"<!-- figures: {m['name']} -->\n{render(m['name'], page)}<!-- /figures -->", text)


def stale(page: Path, text: str | None = None) -> list[str]:
    """The blocks of ``page`` (its ``text``, by default the file's) that differ from their rendering."""
    text = page.read_text() if text is None else text
    return [name for name, body in blocks(text).items() if body != render(name, page)]


def results_section(text: str) -> str:
    """README.md's "## Results" section."""
    start = text.index("## Results\n")
    return text[start:text.index("\n## ", start + 5)]


def prose_figures(page: Path, text: str | None = None) -> list[str]:
    """The figures ``page`` quotes outside its rendered blocks (README.md: in its Results section),
    commands, code and link targets aside: none is allowed."""
    text = page.read_text() if text is None else text
    pattern = README_FIGURE if page == README else FIGURE
    if page == README:
        text = results_section(text)
    text = BLOCK.sub("", text)
    for aside, kept in ((r"```.*?```", ""), (r"`[^`\n]*`", ""), (r"<!--.*?-->", ""), (r"\]\([^)]*\)", "]")):
        text = re.sub(aside, kept, text, flags=re.S)
    return pattern.findall(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench figures", description=__doc__.split("\n\n")[0])
    ap.add_argument("pages", nargs="*", help="the pages (default: README.md and docs/results/*.md)")
    ap.add_argument("--write", action="store_true", help="rewrite the blocks from the CSVs")
    args = ap.parse_args(argv)
    failed = False
    for path in [Path(p).resolve() for p in args.pages] or pages():
        text = path.read_text()
        if args.write:
            path.write_text(rewrite(text, path))
            print(f"{path.relative_to(ROOT)}: {', '.join(blocks(text)) or 'no blocks'} rewritten from their CSVs")
            continue
        drifted, loose = stale(path), prose_figures(path)
        problems = ([f"stale: {', '.join(drifted)}"] if drifted else []) + \
                   ([f"figures outside a block: {', '.join(loose)}"] if loose else [])
        failed |= bool(problems)
        print(f"{path.relative_to(ROOT)}: {'; '.join(problems) or 'every block matches its CSVs'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
