"""The planner's measured defaults (ds_lowcomm/measured.json, package data; written by the
benchmarks that measure each figure: lab/lowcomm_bench/measured.py), each with where it comes from:

- the codec's throughput (GB/s of fp32 elements through encode + decode, one rank), per device.
  CPU: in training, demo's recipe on the reference GPT at 0.44M, 6.5M and 101M parameters, 2
  workers on 2 cores (``python -m lowcomm_bench plan_scale --record``): the cost per element grows
  with the tensors, so the default follows the model's size between those (its ``by_elements``),
  the largest's beyond. GPU: in training too, demo's recipe at about 125M parameters on the newest
  lent GPU (``bash launch/gpu_check.sh``);
- steps to the target over the baseline's, each recipe's against its dense baseline (``baseline``,
  adamw where none is named): the compare recipes' on the reference task (``python -m lowcomm_bench
  time_to_loss --record``), the recommended recipes' at each model size measured (``by_parameters``:
  ``python -m lowcomm_bench measured --scale-summary-csv``; the planner takes the size nearest the
  planned model's). An input: --steps-ratio.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

MEASURED_PATH = Path(__file__).resolve().parents[1] / "measured.json"
DEFAULT_BASELINE = "adamw"  # the baseline of a steps ratio that names none


def load_measured(path: Path = MEASURED_PATH) -> dict:
    """The measured defaults: {"codec_gbps": {device: entry}, "steps_ratio": {name: entry}}, an
    entry {"value": ..., "source": ..., ...}."""
    return json.loads(Path(path).read_text())


MEASURED = load_measured()
CODEC_GBPS = {device: (e["value"], e["source"]) for device, e in MEASURED["codec_gbps"].items()}
# Where a device's entry was measured at several model sizes (plan_scale at several widths): the
# codec's cost per element grows with the tensors (caches), so the default follows the model's size
CODEC_BY_ELEMENTS = {device: sorted((float(n), float(g)) for n, g in e.get("by_elements", ()))
                     for device, e in MEASURED["codec_gbps"].items()}

STEPS_RATIO = {m: e["value"] for m, e in MEASURED["steps_ratio"].items()}
STEPS_RATIO_SOURCE = {m: e["source"] for m, e in MEASURED["steps_ratio"].items()}


def default_codec_gbps(device: str, elements: float) -> float:
    """The measured codec throughput for ``elements`` parameters per worker: the device's figure;
    where it was measured at several sizes, linear in log(elements) between the two nearest, the
    nearest's beyond them."""
    points = CODEC_BY_ELEMENTS.get(device) or []
    if not points:
        return CODEC_GBPS[device][0]
    if elements <= points[0][0]:
        return points[0][1]
    for (n0, g0), (n1, g1) in zip(points, points[1:]):
        if elements <= n1:
            t = math.log(elements / n0) / math.log(n1 / n0)
            return g0 + t * (g1 - g0)
    return points[-1][1]


def measured_steps_ratio(name: str, parameters: float) -> tuple[float, str, str] | None:
    """(steps over the baseline's, the baseline, where it comes from) measured for recipe ``name``
    (None: never measured). Measured at several model sizes: the one nearest ``parameters`` (in
    log size), said in the source."""
    entry = MEASURED["steps_ratio"].get(name)
    if entry is None:
        return None
    baseline = entry.get("baseline", DEFAULT_BASELINE)
    sizes = entry.get("by_parameters")
    if not sizes:
        return entry["value"], baseline, entry["source"]
    size, ratio = min(sizes, key=lambda p: abs(math.log(p[0] / parameters)))
    return ratio, baseline, f"at {size / 1e6:.3g}M parameters, the nearest measured size: {entry['source']}"
