"""``python -m lowcomm_bench plan_check``: ``ds-lowcomm plan`` against what was measured here.

Three checks, each against something the planner did not compute itself:

- **Step time** (``plan_check.csv``): every shaped-link run of the committed benchmarks is
  predicted and set beside its measured step: the network benchmark (every method on 2 and 4
  hosts), the fair time-to-loss benchmark against AdamW (ds_lowcomm's adamw, whose all-reduce
  follows the backward pass, DDP with its all-reduce overlapped with the backward pass in fp32 and
  with the bf16 hook, demo), the time-to-loss runs against dense Muon (the outer methods with Muon
  inside, blocking and overlapped) and the streaming benchmark (the step where a DiLoCo or a
  streaming fragment's sync lands); the files are :mod:`lowcomm_bench.committed`'s. The planner's one measured input
  is the compute, as a user gives it: the entry's step on the unshaped link of the same hosts (a
  run of its own), less the codec seconds that run's ledger timed; the planner then adds its own
  codec seconds (the CPU default, not the measured ones) and the link's communication. The target
  (issues 31, 44): every predicted step within 15% of the measured one.
- **Codec time** (the same rows): the planner's codec seconds per step (the CPU default
  throughput) against the codec seconds the run's ledger timed (encode and decode around every
  exchange, ``comm/collectives.py``), in the very runs whose steps are checked.
- **Bytes** (``plan_wire.csv``): what each worker's process wrote to its sockets while the
  method stepped (``/proc/self/io`` ``wchar``: every byte gloo's transport hands the kernel, all
  threads), in a run of its own here (local gloo workers, 2 and 4 of them, the reference model,
  the ``compare`` recipes with syncs every 2 steps), against the planner's wire bytes at that
  worker count (the methods' declared messages, :func:`ds_lowcomm.plan.wire_bytes_sent`: ring
  collectives) plus gloo's framing, measured in the same run as what a one-byte all-gather writes
  beyond its byte. The ledger's
  bytes (an all-gather of P counts P) beside them. Target: within 0.5%.

Also writes the table of docs/planning.md (``plan_table.csv``) and its figure.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from pathlib import Path

from ds_lowcomm import plan as planner
from ds_lowcomm.optim.recipes import MTDAO_TWO_MOMENTA, RECIPES
from ds_lowcomm.optim.registry import LowcommConfig, planned_wire

from . import committed
from .codec import write_csv
from .netns import rate_bits
from .runs import LINKS

# The recipes the committed network runs were made with, where they
# changed since: mtdao's before issue 43 (no warm start)
MEASURED_WITH = {"mtdao": MTDAO_TWO_MOMENTA}
COLUMNS = ["source", "setting", "method", "compute_s", "measured_step_s", "predicted_step_s", "timed_codec_s_per_step",
           "predicted_codec_s_per_step"]
WIRE_COLUMNS = ["workers", "method", "syncs", "socket_bytes_per_sync", "predicted_socket_bytes_per_sync",
                "predicted_wire_bytes_per_sync", "gloo_framing_bytes_per_sync", "ledger_bytes_per_sync",
                "ledger_received_bytes_per_sync"]
STEP_WITHIN, BYTES_WITHIN = 0.15, 0.005


def _plan_row(method: str, settings: dict, *, hosts: int, rate: str | None, latency_ms: float, compute_s: float,
              shapes=None, overlap: bool = False, grad_bytes: int = 4) -> dict:
    """The planner's row for one measured setting (the reference model unless ``shapes``)."""
    inputs = planner.PlanInputs(model="reference", replicas=hosts, link_gbit=rate_bits(rate) / 1e9 if rate else 1e3,
                                latency_ms=latency_ms, compute_s=compute_s, device="cpu", grad_bytes=grad_bytes,
                                overlap_backward=overlap, methods={method: settings}, warm_start={})
    return planner.plan_method(method, inputs, shapes)


def _row(source: str, setting: str, method: str, compute: float, measured: float, codec: float | None,
         plan_row: dict) -> dict:
    return {"source": source, "setting": setting, "method": method, "compute_s": compute, "measured_step_s": measured,
            "predicted_step_s": plan_row["step_s"], "timed_codec_s_per_step": codec,
            "predicted_codec_s_per_step": plan_row["codec_s_per_step"] if codec is not None else None}


def _per_step(run: dict, key: str) -> float:
    return run[key] / run["history"][-1]["step"]


def network_rows(path: Path) -> list[dict]:
    """Every shaped run group of a network benchmark (its JSON: each repeat's train, comm and codec
    seconds): medians over the repeats."""
    runs = json.loads(path.read_text())["runs"]
    groups: dict[tuple, list[dict]] = {}
    for group in runs.values():
        r = group[0]
        groups[(r["hosts"], r["link"], r["label"])] = group
    out = []
    for (hosts, link, method), group in groups.items():
        if link == "unshaped" or method not in RECIPES:
            continue
        unshaped = groups[(hosts, "unshaped", method)]
        compute = statistics.median(_per_step(r, "train_s") - _per_step(r, "codec_s") for r in unshaped)
        shape = LINKS[link]
        row = _plan_row(method, MEASURED_WITH.get(method, RECIPES[method]["lowcomm"]), hosts=hosts, rate=shape.rate,
                        latency_ms=shape.delay_ms if group[0]["delay_applied"] else 0.0, compute_s=compute)
        out.append(_row(path.name, f"{hosts}h-{link}", method, compute,
                        statistics.median(_per_step(r, "train_s") for r in group),
                        statistics.median(_per_step(r, "codec_s") for r in group), row))
    return out


# time_to_loss's entries the planner models: entry -> (method, settings, adamw overlapped, gradient bytes)
TTL_ENTRIES = {"adamw": ("adamw", {}, False, 4),  # ds_lowcomm's adamw: its all-reduce after the backward pass
               "adamw_overlap": ("adamw", {}, True, 4),  # DDP: bucketed, overlapped with the backward pass
               "adamw_overlap_bf16": ("adamw", {}, True, 2),  # DDP with the bf16 compression hook
               "demo": ("demo", RECIPES["demo"]["lowcomm"], False, 4),
               "demo_recipe": ("demo", RECIPES["demo"]["lowcomm"], False, 4)}


def time_to_loss_rows(path: Path, entries: dict | None = None, source: str | None = None) -> list[dict]:
    """Every shaped timing run of the time-to-loss benchmark (each entry's step times come from
    one timing run per link, its JSON's ``timing``) for ``entries`` (entry -> (method, settings,
    adamw overlapped, gradient bytes); default :data:`TTL_ENTRIES`), on the run's own model."""
    data = json.loads(path.read_text())
    entries = TTL_ENTRIES if entries is None else entries
    shapes = planner.gpt_shapes(data["args"]["n_layer"], data["args"]["n_embd"], 256, data["args"]["seq_len"])
    results, out = data["results"], []
    for key, value in results.items():
        hosts, link, entry = key.split("@")
        timing = value.get("timing")
        if link == "unshaped" or entry not in entries or not timing:
            continue
        method, settings, overlap, grad_bytes = entries[entry]
        unshaped = results[f"{hosts}@unshaped@{entry}"]["timing"]
        compute = _per_step(unshaped, "train_s") - _per_step(unshaped, "codec_s")
        row = _plan_row(method, settings, hosts=int(hosts), rate=LINKS[link].rate,
                        latency_ms=LINKS[link].delay_ms if timing["delay_applied"] else 0.0, compute_s=compute,
                        shapes=shapes, overlap=overlap, grad_bytes=grad_bytes)
        out.append(_row(source or path.name, f"{hosts}h-{link}", entry, compute, _per_step(timing, "train_s"),
                        _per_step(timing, "codec_s"), row))
    return out


# The outer entries with Muon inside, blocking and overlapped (sync_delay, carry_local_steps), by
# the time-to-loss run against dense Muon that timed them (its JSON)
TUNED_OUTER_ENTRIES = {"overlap": ("muloco_dct", "muloco_dct_overlap", "muloco_sparse", "muloco_sparse_overlap"),
                       "sign": ("muloco_sign", "muloco_sign_h10", "muloco_sign_overlap")}
TUNED_OUTER_RUNS = {"overlap": committed.MUON_TOPK_OVERLAP_TTL, "sign": committed.MUON_RECIPES_TTL}


def tuned_outer_rows(path: Path, sweep_csv: Path, entry_names: tuple[str, ...]) -> list[dict]:
    """:func:`time_to_loss_rows` of a time-to-loss run with ``--from-sweep`` (the runs against
    dense Muon) for the ds_lowcomm outer entries, each planned at the settings it ran with (its variant's,
    the sweep's best row over them): the blocking sync waited for, the overlapped one hidden behind
    sync_delay steps."""
    from .time_to_loss import entry_spec
    from .tuning import best, with_settings

    args = json.loads(path.read_text())["args"]
    tuned = best(sweep_csv, budget=args["tune_budget"], rank_by=args["tune_by"])
    model = {k: args[k] for k in ("n_layer", "n_embd", "seq_len")}
    entries = {}
    for entry in entry_names:
        spec, _ = with_settings(*entry_spec(entry, args["steps"], args["eval_every"], model), tuned[entry]["settings"])
        lowcomm = dict(spec.lowcomm)
        entries[entry] = (lowcomm.pop("method"), lowcomm, False, 4)
    return time_to_loss_rows(path, entries)


def streaming_rows(path: Path) -> list[dict]:
    """The streaming benchmark (2 hosts; the GPT of its JSON's args): the step where a sync lands
    (DiLoCo's whole sync; a streaming fragment's, sync_delay steps after it was sent), predicted
    from the variant's ordinary step on the unshaped link (no codec: dense syncs)."""
    from .streaming import SHAPES, variants

    args = json.loads(path.with_suffix(".json").read_text())["args"]
    shapes = planner.gpt_shapes(args["n_layer"], args["n_embd"], 256, args["seq_len"])
    lowcomm = variants(args["sync_every"], args["fragments"], args["sync_delay"])
    rows = list(csv.DictReader(open(path)))
    out = []
    for link in dict.fromkeys(r["link"] for r in rows):
        if link == "unshaped":
            continue
        for variant, settings in lowcomm.items():
            compute = statistics.median(float(r["median_step_s"]) for r in rows
                                        if r["link"] == "unshaped" and r["variant"] == variant)
            measured = statistics.median(float(r["sync_step_s"]) for r in rows
                                         if r["link"] == link and r["variant"] == variant)
            shape = SHAPES[link]
            row = _plan_row("diloco", settings, hosts=2, rate=shape.rate, latency_ms=shape.delay_ms, compute_s=compute,
                            shapes=shapes)
            # the step a sync lands on: the compute and what the step waits for of one fragment's sync
            fragments = settings.get("fragments", 1)
            landing = dict(row, step_s=compute + row["exposed_comm_s_per_step"] * row["sync_every"] / fragments)
            out.append(_row(path.name, f"2h-{link}", variant, compute, measured, None, landing))
    return out


# -- bytes at the socket --------------------------------------------------------------------------
def socket_bytes_written() -> int:
    """Bytes this process has handed to write-like system calls (all threads): gloo's TCP transport
    writes with them, so around a collective with nothing else written this is what it sent."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def gloo_framing_per_round() -> float:
    """What gloo writes beyond the payload per ring round: a one-byte all-gather's bytes less its
    byte, per round (after one to open the connections), through the transport the methods use."""
    import torch

    from ds_lowcomm.comm import TorchDistTransport

    transport = TorchDistTransport()
    one = torch.zeros(1, dtype=torch.uint8)
    transport.all_gather_bytes(one)
    before = socket_bytes_written()
    transport.all_gather_bytes(one)
    return (socket_bytes_written() - before - (transport.world_size - 1)) / (transport.world_size - 1)


# Beside the recipes: the one-bit outer loop (every element a sign bit, no transform) with each
# exchange (the compressed all-reduce and the all-gather)
WIRE_VARIANTS = {f"dct_diloco_sign_{exchange}": ("dct_diloco", {"topk": 64, "chunk": 8, "transform": "none",
                                                               "value_dtype": "sign", "exchange": exchange})
                 for exchange in ("all_reduce", "all_gather")}


def wire_settings(name: str) -> tuple[str, dict, float]:
    """(method, its raw lowcomm settings with outer syncs every 2 steps, lr) of a recipe or a
    :data:`WIRE_VARIANTS` entry."""
    method, extra = WIRE_VARIANTS.get(name, (name, {}))
    raw = {**RECIPES[method]["lowcomm"], **extra, "method": method}
    if "sync_every" in raw:
        raw["sync_every"] = 2
    return method, raw, RECIPES[method]["lr"]


def wire_worker(rank: int, world: int, methods: list[str], steps: int, n_layer: int, n_embd: int,
                seq_len: int) -> dict:
    """Each method (its compare recipe; outer methods syncing every 2 steps) stepped ``steps``
    times on the reference GPT: the bytes this process wrote while its optimizer stepped, the
    ledger's, and gloo's framing per round."""
    import torch

    from ds_lowcomm.optim.registry import build_optimizer, model_param_groups
    from lowcomm_task.model import GPT, GPTConfig

    framing = gloo_framing_per_round()
    out = {"framing": framing, "methods": {}}
    for method in methods:
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=n_layer, n_embd=n_embd, seq_len=seq_len))
        _, raw, lr = wire_settings(method)
        cfg = LowcommConfig.from_dict(raw)
        opt = build_optimizer(cfg, model_param_groups(cfg, model, model.parameters()), lr=lr)
        x = torch.randint(0, 256, (2, seq_len + 1), generator=torch.Generator().manual_seed(rank))
        written = 0
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            before = socket_bytes_written()
            opt.step()
            written += socket_bytes_written() - before
            opt.zero_grad()
        ledger = sum(sent for op, (_, sent, _) in opt.ledger.by_op.items() if op != "setup")
        received = sum(got for op, (_, _, got) in opt.ledger.by_op.items() if op != "setup")
        out["methods"][method] = {"socket": written, "ledger": ledger, "ledger_received": received}
    return out


def wire_rows(results: list[dict], workers: int, methods: list[str], steps: int, shapes) -> list[dict]:
    """The planner's wire bytes (and gloo's framing, measured) against what each worker wrote."""
    framing = statistics.median(r["framing"] for r in results)
    matrices = planner.hidden_matrices("reference", shapes)  # dion's orthonormal matrices
    rows = []
    for name in methods:
        _, raw, _ = wire_settings(name)
        wire = planned_wire(raw, shapes, matrices=matrices, replicas=workers)
        messages = wire.messages
        syncs = steps // wire.sync_every
        wire = sum(planner.wire_bytes_sent(m.kind, m.nbytes, workers) for m in messages)
        # gloo's all-to-all writes half a ring round's framing per part it sends (measured at 3 workers)
        frames = sum(planner.ring_rounds(m.kind, workers)[0] * (0.5 if m.kind == "all_to_all" else 1.0)
                     for m in messages) * framing
        socket = max(r["methods"][name]["socket"] for r in results) / syncs
        rows.append({"workers": workers, "method": name, "syncs": syncs, "socket_bytes_per_sync": socket,
                     "predicted_socket_bytes_per_sync": wire + frames, "predicted_wire_bytes_per_sync": wire,
                     "gloo_framing_bytes_per_sync": frames,
                     "ledger_bytes_per_sync": max(r["methods"][name]["ledger"] for r in results) / syncs,
                     "ledger_received_bytes_per_sync": max(r["methods"][name].get("ledger_received", 0)
                                                           for r in results) / syncs})
    return rows


def measure_wire(workers: int, methods: list[str], steps: int = 4, n_layer: int = 2, n_embd: int = 128,
                 seq_len: int = 128) -> list[dict]:
    from lowcomm_task.workers import run_local_workers

    results = run_local_workers(wire_worker, workers, methods, steps, n_layer, n_embd, seq_len, threads=1)
    return wire_rows(results, workers, methods, steps, planner.gpt_shapes(n_layer, n_embd, 256, seq_len))


def step_rows(bench: Path) -> list[dict]:
    """Every measured step of the committed benchmarks under ``bench`` beside the planner's."""
    return [*(row for name in (committed.NETWORK_2_HOSTS, committed.NETWORK_4_HOSTS, committed.NETWORK_2_HOSTS_TODAY)
              for row in network_rows(bench / name)),
            *time_to_loss_rows((bench / committed.ADAMW_TTL).with_suffix(".json")),
            *streaming_rows(bench / committed.STREAMING),
            *(row for run, names in TUNED_OUTER_ENTRIES.items()
              for row in tuned_outer_rows((bench / TUNED_OUTER_RUNS[run]).with_suffix(".json"),
                                          bench / committed.MUON_TUNING, names))]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench plan_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", default=str(committed.BENCH), help="where the measured benchmark files are")
    ap.add_argument("--out", default="runs/bench/plan_check")
    ap.add_argument("--workers", default="2,4", help="worker counts of the bytes-at-the-socket runs ('' : none)")
    args = ap.parse_args(argv)
    rows = step_rows(Path(args.bench))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "plan_check.csv", rows, COLUMNS)
    step_misses = [r for r in rows if abs(r["predicted_step_s"] / r["measured_step_s"] - 1) > STEP_WITHIN]
    for r in rows:
        codec = r["timed_codec_s_per_step"]
        print(f"{r['source']:<19} {r['setting']:<13} {r['method']:<24} step {r['measured_step_s']:.4f} -> "
              f"{r['predicted_step_s']:.4f} ({r['predicted_step_s'] / r['measured_step_s'] - 1:+6.1%})  codec "
              + (f"{codec * 1e3:6.1f} ms timed, {r['predicted_codec_s_per_step'] * 1e3:6.1f} planned"
                 if codec else "-"))
    coded = [r for r in rows if r["timed_codec_s_per_step"]]
    print(f"{len(rows)} rows: step within {STEP_WITHIN:.0%}: {len(rows) - len(step_misses)}; codec planned/timed: "
          + ", ".join(f"{r['method']}@{r['setting']} "
                      f"{r['predicted_codec_s_per_step'] / r['timed_codec_s_per_step']:.2f}" for r in coded))
    wire = []
    methods = list(RECIPES)
    for workers in (int(w) for w in args.workers.split(",") if w.strip()):
        wire += measure_wire(workers, methods)
    if wire:
        write_csv(out / "plan_wire.csv", wire, WIRE_COLUMNS)
        for r in wire:
            print(f"{r['workers']} workers {r['method']:<11} socket {r['socket_bytes_per_sync']:>12,.0f} B/sync, "
                  f"planned {r['predicted_socket_bytes_per_sync']:>12,.0f} "
                  f"({r['predicted_socket_bytes_per_sync'] / r['socket_bytes_per_sync'] - 1:+.3%}; of it gloo's "
                  f"framing {r['gloo_framing_bytes_per_sync']:,.0f}); ledger {r['ledger_bytes_per_sync']:>12,.0f}")
        misses = [r for r in wire
                  if abs(r["predicted_socket_bytes_per_sync"] / r["socket_bytes_per_sync"] - 1) > BYTES_WITHIN]
        print(f"bytes at the socket within {BYTES_WITHIN:.1%}: {len(wire) - len(misses)} of {len(wire)}")
    table = table_rows()
    write_csv(out / "plan_table.csv", table, TABLE_COLUMNS)
    plot_speedup(out / "plan_speedup.png")
    return rows


# The published table (docs/planning.md): each model on REPLICAS replicas of GPUS GPUs (H100s at
# MFU of their 989 TFLOP/s bf16 peak, TOKENS tokens per GPU per step), the replicas joined by links
# of RATES Gbit/s per replica, which its GPUs share (each worker 1/GPUS of it), LATENCY_MS one way;
# adamw all-reduces bf16 gradients (DeepSpeed's bf16 default: the strong baseline), overlapped with
# the backward pass as DDP and ZeRO's overlap_comm run it; the methods keep their fp32 state and
# fp32 master weights.
TABLE_MODELS = {"llama-1b": (8, 2), "llama-8b": (8, 2), "llama-70b": (64, 3)}  # model -> (GPUs per replica, ZeRO)
REPLICAS, TOKENS, MFU, PEAK, LATENCY_MS, RATES = 4, 16384, 0.4, 989e12, 10.0, (1.0, 10.0, 100.0)
TABLE_METHODS = {m: r["lowcomm"] for m, r in RECIPES.items()}  # the compare recipes, each against adamw
TABLE_COLUMNS = ["model", "parameters", "replicas", "gpus_per_replica", "zero_stage", "link_gbit", "method", "compute_s",
                 "comm_compute_ratio", "bytes_per_step", "wire_bytes_per_step", "wire_bytes_vs_adamw", "step_s",
                 "adamw_step_s_without_overlap", "steps_ratio", "speedup_vs_adamw", "speedup_vs_adamw_without_overlap",
                 "added_state_gb_per_gpu"]


def table_plan(model: str, rate: float, overlap: bool = True) -> dict:
    """The planner's result for one model of the table at ``rate`` Gbit/s per replica."""
    gpus, zero = TABLE_MODELS[model]
    params = sum(math.prod(s) for s in planner.model_shapes(model))
    return planner.plan(planner.PlanInputs(model=model, replicas=REPLICAS, gpus_per_replica=gpus, zero_stage=zero,
                                           link_gbit=rate / gpus, latency_ms=LATENCY_MS,
                                           compute_s=6 * params * TOKENS / (MFU * PEAK), device="gpu", grad_bytes=2,
                                           overlap_backward=overlap, methods=dict(TABLE_METHODS)))


def table_rows() -> list[dict]:
    rows = []
    for model, (gpus, zero) in TABLE_MODELS.items():
        for rate in RATES:
            result = table_plan(model, rate)
            plain = table_plan(model, rate, overlap=False)
            plain_adamw = plain["rows"][0]["step_s"]
            params, compute = result["parameters"], result["inputs"]["compute_s"]
            for r in result["rows"]:
                rows.append({"model": model, "parameters": params, "replicas": REPLICAS, "gpus_per_replica": gpus,
                             "zero_stage": zero, "link_gbit": rate, "method": r["method"], "compute_s": compute,
                             "comm_compute_ratio": result["comm_compute_ratio"], "bytes_per_step": r["bytes_per_step"],
                             "wire_bytes_per_step": r["wire_bytes_per_step"],
                             "wire_bytes_vs_adamw": r["wire_bytes_vs_baseline"], "step_s": r["step_s"],
                             "adamw_step_s_without_overlap": plain_adamw, "steps_ratio": r["steps_ratio"],
                             "speedup_vs_adamw": r["speedup_vs_baseline"],
                             "speedup_vs_adamw_without_overlap": plain_adamw / (r["steps_ratio"] * r["step_s"]),
                             "added_state_gb_per_gpu": r["added_state_bytes_per_gpu"] / 1e9})
    return rows


def plot_speedup(path: Path, model: str = "llama-8b") -> None:
    """Speed-up in time to target against the link rate, per method, for one model of the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [10 ** (x / 8) for x in range(-8, 25)]  # 0.1 .. 1000 Gbit/s per replica
    curves: dict[str, list[float]] = {}
    for rate in rates:
        for r in table_plan(model, rate)["rows"]:
            curves.setdefault(r["method"], []).append(r["speedup_vs_baseline"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, ys in curves.items():
        ax.plot(rates, ys, label=method)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link between replicas (Gbit/s per replica)")
    ax.set_ylabel("predicted speed-up in time to target vs adamw")
    ax.set_title(f"ds-lowcomm plan: {model}, {REPLICAS} replicas x {TABLE_MODELS[model][0]} H100s, adamw overlapped "
                 "(docs/planning.md)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
