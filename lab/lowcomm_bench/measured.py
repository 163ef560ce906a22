"""``python -m lowcomm_bench measured``: the planner's measured defaults (ds_lowcomm/measured.json,
the library's package data, which ``ds-lowcomm plan`` reads), and how the benchmarks write them.

Each figure is written by the benchmark that measures it, with where it comes from and its date:
the GPU codec throughput by ``gpu_check`` (its ``methods`` part on a GPU, not a dry run), the CPU
codec throughput by ``plan_scale --record``, the steps ratios by ``time_to_loss --record``. With no
option this prints them; ``--gpu-csv PATH`` records the GPU codec throughput from a gpu_check
``<date>-<gpu>-methods.csv`` (one fetched from a lent machine, whose own copy of the file stays
there). A figure is not replaced by an older one (its ``date``) unless ``--force``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import tempfile
from pathlib import Path

from ds_lowcomm.plan import MEASURED_PATH, load_measured


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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench measured", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu-csv", default=None, metavar="PATH", help="record the GPU codec throughput of this gpu_check methods CSV")
    ap.add_argument("--force", action="store_true", help="record even where the file's figure is newer")
    ap.add_argument("--file", default=str(MEASURED_PATH), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.gpu_csv:
        entry = gpu_codec_from_methods_csv(Path(args.gpu_csv))
        if entry is None:
            raise SystemExit(f"{args.gpu_csv}: no GPU run of demo with a codec throughput in it")
        record("codec_gbps", "gpu", entry, Path(args.file), args.force)
    data = load_measured(Path(args.file))
    for section in ("codec_gbps", "steps_ratio"):
        for key, e in data[section].items():
            print(f"{section}.{key:<11} {e['value']:9.4g}  {e['source']}")
    return data


if __name__ == "__main__":
    main()
