"""``python -m lowcomm_bench figures``: README.md's result tables, rendered from the CSVs they quote.

README.md's figures live between markers (``<!-- figures: NAME -->`` ... ``<!-- /figures -->``)
and nowhere else in its Results: each block is rendered here from its CSVs under docs/bench/, so a
figure cannot drift from its evidence. ``--write`` rewrites the blocks in README.md;
``--check`` (tests/test_docs_figures.py) fails on a block that differs from its rendering.

- ``recipes``: which recipe for which situation, and what it buys against the same optimizer
  dense, with the evidence's model size and replica count named: the time-to-loss run of the
  one-bit recipe (docs/bench/issue41/sign/time_to_loss.csv: 2 test hosts, 3 seeds, shaped links)
  and the scale runs (docs/bench/scale_summary.csv: the recipe's inner settings derived from the
  dense run's, per model size);
- ``compare``: the README's first command on this machine (docs/bench/compare/results.csv);
- ``replica_bytes``: the one-bit recipe's bytes per worker per sync as replicas grow, its
  exchange chosen by ``exchange`` auto against the all-gather, beside DDP + Muon with bf16
  gradients (docs/bench/replica_bytes.csv: measured on 2, 4 and 8 test hosts, the planner's
  formula beyond).
"""

from __future__ import annotations

import argparse
import csv
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "docs" / "bench"
BLOCK = re.compile(r"<!-- figures: (?P<name>[a-z_]+) -->\n(?P<body>.*?)<!-- /figures -->", re.S)


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def times(x: float) -> str:
    """A ratio as the README writes it: two decimals under 10, whole above."""
    return f"{x:.2f}x" if x < 10 else f"{x:.0f}x"


def _ttl(rows: list[dict], link: str, entry: str) -> dict:
    return next(r for r in rows if r["link"] == link and r["entry"] == entry)


def reference_parameters() -> int:
    """The reference GPT's parameter count (its default configuration)."""
    from lowcomm_task.model import GPT, GPTConfig

    return sum(p.numel() for p in GPT(GPTConfig()).parameters())


def _params(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


# The one-bit recipe's entries of the time-to-loss run: the situation each is for, and its config
TTL_ROWS = (
    ("You train with Muon over a slow link: the default", "muloco_sign", "H 5",
     "[muloco_sign.json](configs/muloco_sign.json) (ds_lowcomm's Muon; set any ZeRO stage, bf16) or "
     "[muloco_sign_zero2_bf16.json](configs/muloco_sign_zero2_bf16.json) (DeepSpeed's Muon section, ZeRO 1-3, bf16)"),
    ("Fewer bytes still, a few more steps", "muloco_sign_h10", "H 10", "the same with `sync_every` 10"),
    ("A link so slow that a sync takes longer than a step", "muloco_sign_overlap", "H 5, sync overlapped by 2 steps",
     "[muloco_sign_overlap.json](configs/muloco_sign_overlap.json)"),
)


def render_recipes() -> str:
    ttl = _rows(BENCH / "issue41" / "sign" / "time_to_loss.csv")
    scale = _rows(BENCH / "scale_summary.csv") if (BENCH / "scale_summary.csv").exists() else []
    dense = _ttl(ttl, "unshaped", "muon_bf16")
    seeds = dense["seeds"]
    head = ("| your situation | use | steps to the target, vs the same optimizer dense | bytes per worker, fewer than "
            "dense | time to the target vs dense, 10 / 3 Mbit/s | evidence |\n| --- | --- | --- | --- | --- | --- |\n")
    lines = []
    for situation, entry, settings, config in TTL_ROWS:
        r = _ttl(ttl, "unshaped", entry)
        steps, dense_steps = int(r["steps_to_target"]), int(dense["steps_to_target"])
        fewer = float(dense["bytes_sent_per_worker"]) / float(r["bytes_sent_per_worker"])
        faster = [float(_ttl(ttl, link, entry)["speedup_vs_dense"]) for link in ("10mbit", "3mbit")]
        lines.append(f"| {situation} | {config}: {settings} | {steps} vs {dense_steps} ({times(steps / dense_steps)}) "
                     f"| {times(fewer)} (DDP + Muon, bf16 gradients) | {times(faster[0])} / {times(faster[1])} faster "
                     f"| reference GPT ({_params(reference_parameters())}), 2 replicas, {seeds} seeds "
                     f"([time_to_loss.csv](docs/bench/issue41/sign/time_to_loss.csv)) |")
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
            lines.append(f"| {situation} | {config}, inner settings your dense run's | median steps vs dense "
                         f"{form} ({base['median_steps']}): {cells} | {fewer} (DDP, fp32 gradients) | not measured "
                         f"| reference GPT at {_params(size)}, 2 replicas, {n_seeds} seeds, CPU "
                         f"([scale.csv](docs/bench/scale.csv)) |")
    return head + "\n".join(lines) + "\n"


COMPARE_ORDER = ("muon", "muloco_sign", "adamw", "demo", "diloco", "dct_diloco", "sparseloco", "mtdao")


def render_compare() -> str:
    rows = {r["method"]: r for r in _rows(BENCH / "compare" / "results.csv")}
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
               "[results.csv](docs/bench/compare/results.csv))")
    return "\n".join(out) + "\n"


def render_replica_bytes() -> str:
    rows = _rows(BENCH / "replica_bytes.csv")

    def per_sync(r: dict) -> float:  # the wire's payload (for muloco_sign the ledger's received, to the byte)
        return float(r["wire_bytes_per_sync"])

    def how(r: dict) -> str:
        if r["measured"] != "True":
            return "formula"
        return (f"measured: veth sent {float(r['measured_bytes_per_sync']) / 1e3:.1f}, "
                f"received {float(r['measured_received_bytes_per_sync']) / 1e3:.1f}")

    sign = {(r["exchange"], int(r["replicas"])): r for r in rows if r["entry"] == "muloco_sign"}
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
               "[replica_bytes.csv](docs/bench/replica_bytes.csv))")
    return "\n".join(out) + "\n"


RENDER = {"recipes": render_recipes, "compare": render_compare, "replica_bytes": render_replica_bytes}


def blocks(text: str) -> dict[str, str]:
    return {m["name"]: m["body"] for m in BLOCK.finditer(text)}


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: f"<!-- figures: {m['name']} -->\n{RENDER[m['name']]()}<!-- /figures -->", text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench figures", description=__doc__.split("\n\n")[0])
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    ap.add_argument("--write", action="store_true", help="rewrite the blocks from the CSVs")
    args = ap.parse_args(argv)
    path = Path(args.readme)
    text = path.read_text()
    if args.write:
        path.write_text(rewrite(text))
        print(f"{path}: {', '.join(blocks(text))} rewritten from their CSVs")
        return 0
    stale = [name for name, body in blocks(text).items() if body != RENDER[name]()]
    print(f"{path}: {'stale: ' + ', '.join(stale) if stale else 'every block matches its CSVs'}")
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
