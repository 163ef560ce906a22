"""``ds-lowcomm plan``'s command line: its options, what ``--config`` says, and the table it prints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..optim.recipes import DENSE_BASELINES, PLANNED
from ..optim.registry import METHODS
from ..settings import ConfigError
from .pricing import PlanInputs, muon_memory, plan
from .shapes import MODELS, model_shapes, other_rule_tensors


def add_arguments(p) -> None:
    d = PlanInputs()
    p.add_argument("--model", default=d.model, help=f"one of {', '.join(MODELS)}")
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--gpus-per-replica", type=int, default=d.gpus_per_replica)
    p.add_argument("--zero-stage", type=int, default=None,
                   help=f"default: --config's zero_optimization.stage, else {d.zero_stage}")
    p.add_argument("--link-gbit", type=float, default=d.link_gbit, help="Gbit/s between replicas, per worker")
    p.add_argument("--latency-ms", type=float, default=d.latency_ms, help="one-way, between replicas")
    p.add_argument("--compute-s", type=float, default=d.compute_s, help="one step's compute, no communication")
    p.add_argument("--grad-bytes", type=int, default=None,
                   help=f"4 (fp32) or 2 (bf16) per dense element; default: 2 where --config enables bf16 or fp16, "
                        f"else {d.grad_bytes}")
    p.add_argument("--param-bytes", type=int, default=d.param_bytes)
    p.add_argument("--device", default=d.device, help="whose measured codec throughput is the default: gpu, cpu")
    p.add_argument("--codec-gbps", type=float, default=None, help="your `bench codec` figure (GB/s)")
    p.add_argument("--no-overlap", dest="overlap_backward", action="store_false",
                   help="the dense baselines' all-reduce after the backward pass (ZeRO 1-2 without overlap_comm), "
                        "not during it")
    p.add_argument("--backward-fraction", type=float, default=d.backward_fraction,
                   help="the backward pass's share of --compute-s (the dense all-reduce's overlap window)")
    p.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb,
                   help="MiB of gradients per all-reduce bucket: DDP's bucket_cap_mb (25); DeepSpeed ZeRO 1-2: "
                        "reduce_bucket_size x bytes per element / 2**20 (5e8 elements in bf16: 954)")
    p.add_argument("--methods", default=None,
                   help=f"comma list of {', '.join(PLANNED)} (the compare recipes, the dense baselines, the "
                        "recommended recipes); default: all of them, or with a DeepSpeed --config its own row")
    p.add_argument("--config", default=None,
                   help="a DeepSpeed config with a lowcomm section (priced as it runs), or JSON {name: {lowcomm "
                        "settings}} over the named entries")
    p.add_argument("--steps-ratio", default=None, help="JSON {name: steps to target over its baseline's}")
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--muon", action="store_true",
                   help="also: optimizer bytes per GPU of demo's Muon step against DeepSpeed's own Muon")


def config_methods(raw: Any, where: str = "--config", name: str = "config") -> tuple[dict, dict, dict]:
    """``--config``'s JSON -> ({row: lowcomm section}, {row: local optimizer}, what it says of the
    planner's inputs). Either a DeepSpeed config with a ``"lowcomm"`` section (the files users copy,
    ``configs/*.json``), read as training reads it (``split_config``): one row ``name``, its method
    at exactly those settings, DeepSpeed's Muon section as its local optimizer, and the config's ZeRO
    stage and 2-byte gradients where bf16 or fp16 is enabled (DeepSpeed reduces them in that dtype);
    or ``{name: {settings}}`` over the named entries' sections."""
    if isinstance(raw, dict) and "lowcomm" in raw:
        section = raw["lowcomm"]
        if not isinstance(section, dict) or "method" not in section:
            raise ConfigError(f"{where}: the config's lowcomm section must be an object with a method, one of "
                              f"{', '.join(METHODS)}; got {section!r}")
        if "replicas" in section:
            raise ConfigError(f"{where}: lowcomm.replicas (replicas of different shapes) is not planned: the planner's "
                              "replicas are alike (--replicas, --gpus-per-replica); drop it from a copy to plan one shape")
        from ..deepspeed.config import split_config

        split = split_config(raw)
        framework = {"zero_stage": split.zero_stage}
        if any(isinstance(raw.get(k), dict) and raw[k].get("enabled") for k in ("bf16", "fp16")):
            framework["grad_bytes"] = 2
        optimizers = {name: "muon"} if split.muon is not None else {}
        return {name: split.lowcomm.effective()}, optimizers, framework
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ConfigError(f"{where} must be a DeepSpeed config with a \"lowcomm\" section, or an object "
                          "{name: {lowcomm settings}} over the named entries; got " + repr(raw)[:200])
    unknown = [m for m in raw if m not in PLANNED]
    if unknown:
        raise ConfigError(f"{where}: {', '.join(unknown)} name no entry; allowed: {', '.join(PLANNED)}")
    return {m: {**PLANNED[m]["lowcomm"], **over} for m, over in raw.items()}, {}, {}


def format_table(result: dict) -> str:
    i = result["inputs"]
    overlap = (f"dense all-reduce overlapped with the backward pass ({i['backward_fraction']:.2g} of compute, "
               f"{i['bucket_cap_mb']:g} MiB buckets)" if i["overlap_backward"]
               else "dense all-reduce after the backward pass")
    lines = [f"{i['model']} ({result['parameters'] / 1e6:,.1f}M parameters), {i['replicas']} replicas x "
             f"{i['gpus_per_replica']} GPUs, ZeRO {i['zero_stage']}, {i['link_gbit']:g} Gbit/s, "
             f"{i['latency_ms']:g} ms, compute {i['compute_s']:g} s/step; comm/compute ratio "
             f"{result['comm_compute_ratio']:.2f}; {overlap}; codec {result['codec_gbps']:g} GB/s"
             + (f" ({result['codec_default']})" if result["codec_default"] else ""),
             f"bytes per worker per step: the ledger's (an all-gather of P counts P, an all-reduce of N counts N) "
             f"and on the wire at {i['replicas']} replicas (ring: (n-1) P, 2 (n-1) N / n); x fewer: the baseline's "
             f"wire bytes over the row's, at {i['replicas']} replicas"]
    groups = {}
    for r in result["rows"]:
        groups.setdefault(r["baseline"], []).append(r)
    for n, (baseline, rows) in enumerate(groups.items()):
        if n:  # adamw's group first, with no title
            about = DENSE_BASELINES[baseline]["about"]
            lines.append(f"against {baseline} ({about}): x fewer, +state, steps x and speed-up against it")
        width = max(11, *(len(r["method"]) for r in rows))
        lines.append(f"{'method':<{width}} {'H':>4} {'ledger MB':>10} {'wire MB':>10} {'x fewer':>8} {'comm s':>8} "
                     f"{'waited s':>8} {'codec s':>8} {'step s':>8} {'+state GB':>9} {'steps x':>7} {'speed-up':>8}")
        for r in rows:
            lines.append(f"{r['method']:<{width}} {r['sync_every']:>4} {r['bytes_per_step'] / 1e6:>10.4f} "
                         f"{r['wire_bytes_per_step'] / 1e6:>10.4f} {r['wire_bytes_vs_baseline'] or float('nan'):>8.1f} "
                         f"{r['comm_s_per_step']:>8.4f} {r['exposed_comm_s_per_step']:>8.4f} "
                         f"{r['codec_s_per_step']:>8.4f} {r['step_s']:>8.4f} {r['added_state_bytes_per_gpu'] / 1e9:>9.2f} "
                         f"{r['steps_ratio'] or float('nan'):>7.2f} {r['speedup_vs_baseline'] or float('nan'):>8.2f}")
    sources = [f"  {r['method']}: {r['steps_ratio']:.3g} ({r['steps_ratio_source']})" for r in result["rows"]
               if r["steps_ratio"] is not None and r["steps_ratio_source"] != "definition"]
    return "\n".join([*lines, *(["steps x, each over its baseline's steps to the target:", *sources] if sources else [])])


def describe_row(r: dict, path: str) -> str:
    """What ``--config``'s row runs, and where its steps ratio comes from, in words."""
    what = (f"{r['method']} (--config {path}): {r['runs']} at its settings"
            + (f", {r['optimizer']} its local optimizer" if r["optimizer"] else "")
            + f", a sync every {r['sync_every']} step(s) of {', '.join(r['ops'])} at {r['replicas']} replicas")
    if r["steps_ratio_source"] == "given":
        return f"{what}; steps x given"
    if r["recipe"] is not None and r["steps_ratio"] is not None:
        return f"{what}; it runs the recipe {r['recipe']}: steps x is its measured ratio over {r['baseline']}"
    return (f"{what}; {r['steps_ratio_source']}: steps x and speed-up not predicted (--steps-ratio "
            "'{\"" + r["method"] + "\": R}' gives yours)")


def run_plan(args) -> dict:
    names = PLANNED if args.methods is None else [m.strip() for m in args.methods.split(",") if m.strip()]
    methods = {m: dict(PLANNED[m]["lowcomm"]) if m in PLANNED else {} for m in names}
    optimizers = {m: PLANNED[m]["optimizer"] for m in names if "optimizer" in PLANNED.get(m, {})}
    given, framework = {}, {}
    if args.config:
        from ..deepspeed.config import load_config

        raw = load_config(args.config)
        given, given_optimizers, framework = config_methods(raw, f"--config {args.config}", Path(args.config).stem)
        if framework and args.methods is None:  # a DeepSpeed config: its own row (and its baseline)
            methods, optimizers = {}, {}
        methods.update(given)
        if framework:  # the config's row chooses its own local optimizer, whatever its name
            optimizers = {m: k for m, k in optimizers.items() if m not in given}
        optimizers.update(given_optimizers)
    defaults = PlanInputs()
    zero_stage = args.zero_stage if args.zero_stage is not None else framework.get("zero_stage", defaults.zero_stage)
    grad_bytes = args.grad_bytes if args.grad_bytes is not None else framework.get("grad_bytes", defaults.grad_bytes)
    inputs = PlanInputs(model=args.model, replicas=args.replicas, gpus_per_replica=args.gpus_per_replica,
                        zero_stage=zero_stage, link_gbit=args.link_gbit, latency_ms=args.latency_ms,
                        compute_s=args.compute_s, grad_bytes=grad_bytes, param_bytes=args.param_bytes,
                        device=args.device, overlap_backward=args.overlap_backward,
                        backward_fraction=args.backward_fraction, bucket_cap_mb=args.bucket_cap_mb,
                        codec_gbps=args.codec_gbps, methods=methods, optimizers=optimizers,
                        steps_ratio=json.loads(args.steps_ratio) if args.steps_ratio else {})
    result = plan(inputs)
    print(format_table(result))
    if framework:
        print(f"from --config: {', '.join(f'{k} {v}' for k, v in framework.items())} (a flag overrides it)")
    rows = {r["method"]: r for r in result["rows"]}
    for m in given:
        print(describe_row(rows[m], args.config))
    if getattr(args, "muon", False):
        shapes = model_shapes(args.model)
        result["muon"] = m = muon_memory(shapes, other_rule_tensors(args.model, shapes), args.gpus_per_replica,
                                         zero_stage)
        print(f"Muon at ZeRO {zero_stage}, per GPU: DeepSpeed's Muon state "
              f"{m['deepspeed_muon_state_bytes_per_gpu'] / 1e9:.3f} GB, demo (update muon) "
              f"{m['demo_muon_state_bytes_per_gpu'] / 1e9:.3f} GB: added {m['added_state_bytes_per_gpu'] / 1e9:+.3f} GB; "
              f"demo's step adds {m['demo_muon_transient_bytes_per_gpu'] / 1e9:.3f} GB while it runs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return result
