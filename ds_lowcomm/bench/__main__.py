"""``python -m ds_lowcomm.bench <name> [options]``: the benchmarks (each writes CSV + PNG)."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {"streaming": "streaming"}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHMARKS:
        raise SystemExit(f"usage: python -m ds_lowcomm.bench <name> [options]; names: {', '.join(BENCHMARKS)}")
    module = importlib.import_module(f"ds_lowcomm.bench.{BENCHMARKS[sys.argv[1]]}")
    module.main(sys.argv[2:])


if __name__ == "__main__":
    main()
