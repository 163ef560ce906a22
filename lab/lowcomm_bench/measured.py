"""``python -m lowcomm_bench measured``: the planner's measured defaults (ds_lowcomm/measured.json,
the library's package data, which ``ds-lowcomm plan`` reads), and how the benchmarks write them.

Each figure is written by the benchmark that measures it, with where it comes from and its date:
the GPU codec throughput by ``gpu_check`` (its ``methods`` part on a GPU, not a dry run), the CPU
codec throughput by ``plan_scale --record`` (at each width it ran: the planner follows the model's
size between them), the compare recipes' steps ratios by ``time_to_loss --record``. With no option
this prints them; ``--gpu-csv PATH`` records the GPU codec throughput from a gpu_check
``<date>-<gpu>-methods.csv`` (one fetched from a lent machine, whose own copy of the file stays
there), ``--plan-scale-csv PATH`` the CPU's from a plan_scale.csv, ``--scale-summary-csv PATH`` the
recommended recipes' steps ratios against their dense baselines from a ``scale`` summary (at each
model size it holds), ``--long-h-summary-csv PATH`` the long-H recipe's from a ``long_h`` summary. A figure is not replaced by an older one (its ``date``) unless ``--force``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import tempfile
from pathlib import Path

from ds_lowcomm.optim.recipes import RECOMMENDED
from ds_lowcomm.plan import MEASURED_PATH, load_measured

from .runs import run_group


def record(section: str, key: str, entry: dict, path: Path = MEASURED_PATH, force: bool = False) -> bool:
    """Set ``section.key`` to ``entry`` ({"value", "source", "date", ...}) in ``path`` (atomically);
    False, and nothing written, where the figure there is newer."""
    data = load_measured(path)
    old = data[section].get(key)
    if old and not force and old.get("date", "") > entry.get("date", ""):
        print(f"measured: {section}.{key} kept ({old['value']:.4g}, {old.get('date')}: newer than {entry.get('date')})")
        return False
    data[section][key] = entry
    with tempfile.NamedTemporaryFile("w", dir=Path(path).parent, suffix=".tmp", delete=False) as f:
        f.write(json.dumps(data, indent=1) + "\n")
    os.replace(f.name, path)
    print(f"measured: {section}.{key} = {entry['value']:.4g} ({entry['source']}) in {path}")
    return True


def gpu_codec_from_methods_csv(path: Path) -> dict | None:
    """demo's in-training codec throughput in a gpu_check methods CSV (``<date>-<gpu>-methods.csv``;
    a dry run's, ``<date>-cpu-methods.csv``, is no GPU's: None), as a ``codec_gbps.gpu`` entry."""
    path = Path(path)
    if path.name[11:].startswith("cpu-"):
        return None
    with open(path) as f:
        for row in csv.DictReader(f):
            if row.get("entry") == "demo" and row.get("ok") == "True" and row.get("codec_gbps"):
                size = f"{int(row['parameters']) / 1e6:.0f}M" if row.get("parameters") else "?"
                return {"value": float(row["codec_gbps"]), "date": path.name[:10],
                        "source": f"{row.get('device', 'GPU')}, demo's recipe in training at {size} parameters, "
                                  f"{path.name[:10]} (docs/bench/gpu/{path.name})"}
    return None


def cpu_codec_entry(rows: list[dict], source: str, date: str | None = None) -> dict | None:
    """demo's in-training codec throughput at each model size of plan_scale's rows (dicts, or a
    plan_scale.csv's rows), as a ``codec_gbps.cpu`` entry: ``by_elements`` [[parameters, GB/s],
    ...] and, as its ``value``, the largest size's. None where no demo row has a codec time."""
    demo = sorted(((int(float(r["parameters"])), 4 / float(r["codec_ns_per_element"])) for r in rows
                   if r["method"] == "demo" and r.get("codec_ns_per_element") not in (None, "")), key=lambda p: p[0])
    if not demo:
        return None
    date = date or datetime.date.today().isoformat()
    sizes = ", ".join(f"{n / 1e6:.3g}M" for n, _ in demo)
    return {"value": round(demo[-1][1], 4), "by_elements": [[n, round(g, 4)] for n, g in demo], "date": date,
            "source": f"CPU, demo's recipe in training at {sizes} parameters (the default follows the model's "
                      f"size between them), {date} ({source})"}


def recipe_ratio_entries(rows: list[dict], source: str, date: str | None = None) -> dict[str, dict]:
    """The steps ratios of each recommended recipe (recipes.RECOMMENDED) against its dense baseline
    in a ``scale`` summary's rows (scale_summary.csv: the median steps over the seeds to the dense
    run's target): the rows of its entry (``measured_as``) at its H, one ratio per model size (``by_parameters``; where a
    size was run twice, the run over more seeds), as ``steps_ratio`` entries; a recipe the rows do
    not hold at its H is left out."""
    date = date or datetime.date.today().isoformat()
    out = {}
    for name, recipe in RECOMMENDED.items():
        if recipe.get("measured_in", "scale") != "scale":
            continue
        h, baseline, entry = recipe["lowcomm"]["sync_every"], recipe["baseline"], recipe.get("measured_as", name)
        dense = {(r["parameters"], r["device"]): r for r in rows if r["entry"] == baseline and r["form"] == baseline}
        runs: dict[int, dict] = {}
        for r in rows:
            if (r["entry"] == entry and r["form"] == baseline and int(r["H"]) == h and r.get("ratio_to_dense") not in (None, "")
                    and (r["parameters"], r["device"]) in dense):
                size, seeds = int(r["parameters"]), len(str(r["seeds"]).split(","))
                if size not in runs or seeds > len(str(runs[size]["seeds"]).split(",")):
                    runs[size] = r
        if not runs:
            continue
        sizes = sorted(runs)
        measured = "; ".join(
            f"{n / 1e6:.3g}M parameters ({runs[n]['device']}, seeds {runs[n]['seeds']}): {float(runs[n]['median_steps']):g} "
            f"over {float(dense[(runs[n]['parameters'], runs[n]['device'])]['median_steps']):g} steps" for n in sizes)
        out[name] = {"value": float(runs[sizes[-1]]["ratio_to_dense"]), "baseline": baseline, "sync_every": h,
                     "by_parameters": [[n, float(runs[n]["ratio_to_dense"])] for n in sizes], "csv": source, "date": date,
                     "source": f"{source}, H {h} against dense {baseline}, median steps to its target: {measured}"}
    return out


def runs_recipe(row: dict, name: str) -> bool:
    """Whether a long_h summary row ran recipes.RECOMMENDED's ``name``: its entry (``measured_as``)
    at the recipe's H and growth of H."""
    recipe = RECOMMENDED[name]
    section = recipe["lowcomm"]
    return (row["entry"] == recipe.get("measured_as", name) and int(row["H"]) == section["sync_every"]
            and (json.loads(row["schedule"]) if row.get("schedule") else [])
            == [list(e) for e in section.get("sync_every_schedule", ())])


def long_h_ratio_entries(rows: list[dict], source: str, date: str | None = None) -> dict[str, dict]:
    """The steps ratios of the recommended recipes measured by ``long_h`` (``measured_in``) against
    dense Muon in a long_h summary's rows (long_h-summary.csv): the rows of its entry
    (``measured_as``) at its H and H's growth, at 2 replicas (where its settings were tuned), one
    ratio per model size (a size measured under both data layouts: its interleaved shards', what
    users' replicas read), each against dense Muon of the same budget, machine and layout, as
    ``steps_ratio`` entries; a recipe the rows do not hold is left out."""
    date = date or datetime.date.today().isoformat()
    out = {}
    for name, recipe in RECOMMENDED.items():
        if recipe.get("measured_in") != "long_h":
            continue
        section, entry = recipe["lowcomm"], recipe.get("measured_as", name)
        h = section["sync_every"]
        measured_rows = [r for r in rows if runs_recipe(r, name) and int(r["replicas"]) == 2
                         and r.get("ratio_to_muon") not in (None, "")]
        # where a size ran under both data layouts, the interleaved shards' (what users' replicas read)
        users = {int(r["parameters"]) for r in measured_rows if r.get("data_shards") == "interleaved"}
        measured_rows = [r for r in measured_rows if int(r["parameters"]) not in users
                         or r.get("data_shards") == "interleaved"]
        runs = {int(r["parameters"]): r for r in measured_rows}
        if len(runs) < len(measured_rows):
            raise SystemExit(f"{source}: {entry} measured twice at one model size and data layout (two budgets "
                             "or machines); keep one run of each in the summary")
        # each ratio's denominator: dense Muon of the same size, replicas, budget, machine and data
        dense = {n: d for n, r in runs.items() for d in rows if d["entry"] == "muon" and run_group(d) == run_group(r)}
        sizes = sorted(n for n in runs if n in dense)
        if not sizes:
            continue
        measured = "; ".join(
            f"{n / 1e6:.3g}M parameters ({runs[n]['budget']}-step budget, seeds {runs[n]['seeds']}, {runs[n]['data_shards']} "
            f"data shards, on {runs[n]['machine']}): "
            f"{float(runs[n]['median_steps']):g} over {float(dense[n]['median_steps']):g} steps" for n in sizes)
        out[name] = {"value": float(runs[sizes[-1]]["ratio_to_muon"]), "baseline": recipe["baseline"], "sync_every": h,
                     "by_parameters": [[n, float(runs[n]["ratio_to_muon"])] for n in sizes], "csv": source, "date": date,
                     "source": f"{source}, {entry} against dense muon at 2 replicas, median steps to its target: {measured}"}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench measured", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu-csv", default=None, metavar="PATH", help="record the GPU codec throughput of this gpu_check methods CSV")
    ap.add_argument("--plan-scale-csv", default=None, metavar="PATH",
                    help="record the CPU codec throughput of this plan_scale.csv (what plan_scale --record writes)")
    ap.add_argument("--scale-summary-csv", default=None, metavar="PATH",
                    help="record the recommended recipes' steps ratios of this scale summary (scale_summary.csv)")
    ap.add_argument("--long-h-summary-csv", default=None, metavar="PATH",
                    help="record the long-H recipes' steps ratios of this long_h summary (long_h-summary.csv)")
    ap.add_argument("--date", default=None, help="the date of the summary's runs (default: the file's)")
    ap.add_argument("--force", action="store_true", help="record even where the file's figure is newer")
    ap.add_argument("--file", default=str(MEASURED_PATH), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.gpu_csv:
        entry = gpu_codec_from_methods_csv(Path(args.gpu_csv))
        if entry is None:
            raise SystemExit(f"{args.gpu_csv}: no GPU run of demo with a codec throughput in it")
        record("codec_gbps", "gpu", entry, Path(args.file), args.force)
    if args.plan_scale_csv:
        with open(args.plan_scale_csv) as f:
            rows = list(csv.DictReader(f))
        modified = datetime.date.fromtimestamp(os.path.getmtime(args.plan_scale_csv)).isoformat()
        entry = cpu_codec_entry(rows, args.plan_scale_csv, modified)
        if entry is None:
            raise SystemExit(f"{args.plan_scale_csv}: no demo row with a codec time in it")
        record("codec_gbps", "cpu", entry, Path(args.file), args.force)
    for path, derive, what in ((args.scale_summary_csv, recipe_ratio_entries, "recommended recipe at its H"),
                               (args.long_h_summary_csv, long_h_ratio_entries, "recommended long-H recipe")):
        if not path:
            continue
        with open(path) as f:
            rows = list(csv.DictReader(f))
        date = args.date or datetime.date.fromtimestamp(os.path.getmtime(path)).isoformat()
        entries = derive(rows, path, date)
        if not entries:
            raise SystemExit(f"{path}: no {what} with a steps ratio in it")
        for name, entry in entries.items():
            record("steps_ratio", name, entry, Path(args.file), args.force)
    data = load_measured(Path(args.file))
    for section in ("codec_gbps", "steps_ratio"):
        for key, e in data[section].items():
            print(f"{section}.{key:<11} {e['value']:9.4g}  {e['source']}")
    return data


if __name__ == "__main__":
    main()
