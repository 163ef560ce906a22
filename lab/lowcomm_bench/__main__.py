"""``python -m lowcomm_bench <name> [options]``: the benchmarks (each writes CSV + PNG)."""

from __future__ import annotations

import importlib
import sys

# name -> module of lowcomm_bench with a main(argv) that writes its CSV (most also a PNG) under --out
BENCHMARKS = {name: name for name in ("network", "peers", "codec", "scaling", "vision", "streaming", "hetero", "gpu_check",
                                      "megatron", "demo_sign", "overlap", "time_to_loss", "sweep", "faults", "ft_memory", "hf",
                                      "plan_check", "plan_scale", "muon_memory", "mtdao",
                                      "muon_directions", "replica_bytes", "measured", "absent", "scale", "long_h", "exits", "figures")}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in BENCHMARKS:
        raise SystemExit(f"usage: python -m lowcomm_bench <name> [options]; names: {', '.join(BENCHMARKS)}")
    module = importlib.import_module(f"lowcomm_bench.{BENCHMARKS[sys.argv[1]]}")
    result = module.main(sys.argv[2:])
    if isinstance(result, int) and not isinstance(result, bool):  # a check's exit status (figures)
        raise SystemExit(result)


if __name__ == "__main__":
    main()
