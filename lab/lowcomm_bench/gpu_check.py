"""``python -m lowcomm_bench gpu_check``: the first run on a GPU, in one command.

A GPU machine is lent to some sessions only, for minutes, and takes minutes to start: this is the
check prepared beforehand, run first whenever one is lent (``bash launch/gpu_check.sh``, which
installs what the machine lacks from carried wheels). On one GPU, within ``--budget-s``, each part
in its own process with its own time limit (a part that hangs or fails costs only its own share):

- ``codec``: the codec's throughput in bf16 (momenta and pseudo-gradients of a bf16 model) over
  every tensor of GPT-2 small (125M), GPT-2 medium (350M) and Llama 3.2 1B shapes, at each method's
  compression settings: one rank's encode plus the decode of 2 ranks' payloads (the exchange's own
  code over a loopback transport), medians of repeats, device synchronised around each call;
- ``newton_schulz``: Muon's orthogonalisation per step over the same models' hidden matrices:
  demo's ``orthogonalize`` (fp32) and ``torch.optim.Muon``'s whole step (bf16 Newton-Schulz);
- ``methods``: every method (and demo with Muon's step, dense DDP + Muon) training the reference
  GPT at about 125M parameters (18 layers x 768) with 2 ranks on the one GPU for a few dozen steps,
  one launch for all: median step time, codec seconds per step (synchronised), the peak of
  ``torch.cuda.max_memory_allocated`` per rank, bytes sent per step, replicas bit-identical after
  the last sync. NCCL refuses two ranks on one device, so the ranks talk over gloo (the transport
  stages buffers through host memory, as across datacenters);
- ``deepspeed``: DeepSpeed engines on the GPU with the same 2 ranks (gloo): ds_lowcomm's demo at
  ZeRO 0 and diloco at ZeRO 2 in bf16, and DeepSpeed's own Muon (``"type": "Muon"``) at ZeRO 2 bf16;
- ``tests``: ``pytest tests/test_gpu.py`` (the 33 GPU tests, skipped in CI), in parallel workers;
- ``scale`` (issue 55; not in the default parts: a call of its own, first whenever a GPU is lent,
  ``--parts scale --budget-s 480``): dense Muon against the one-bit recipe at the same 128M model,
  the recipe's inner optimizer at dense Muon's settings, H 5 and the long-H recipe (H growing to
  30, its growth scaled to the budget), one seed, 390 steps, evaluations every 10 (:mod:`lowcomm_bench.scale`); its rows go into docs/bench/model-size/steps-to-target.csv.

Each part writes ``<date>-<gpu>-<part>.csv`` under ``--out``; the run ends with ``<date>-<gpu>-
summary.json`` (the machine, each part's status, seconds and error) and a short table.
``--dry-run`` runs the same parts on the CPU at tiny sizes (the test suite runs it, so the script
cannot rot before a GPU is lent): the tests part then only collects the GPU tests, and without
``--out`` the files go to a new temporary folder (the run prints it), not beside the GPU figures.
On a GPU the ``methods`` part records demo's in-training codec throughput as ``ds-lowcomm plan``'s
GPU default (ds_lowcomm/measured.json, :mod:`lowcomm_bench.measured`; from a CSV fetched from a lent
machine: ``python -m lowcomm_bench measured --gpu-csv docs/bench/gpu/<date>-<gpu>-methods.csv``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PARTS = ("codec", "newton_schulz", "methods", "deepspeed", "tests", "scale")
# What runs without --parts: the first check of a machine. ``scale`` (issue 55) is a call of its
# own, run first whenever a GPU is lent: ``--parts scale --budget-s 480``.
DEFAULT_PARTS = ("codec", "newton_schulz", "methods", "deepspeed", "tests")
# Each part's share of the budget (seconds, before the budget's end cuts it) on a GPU
PART_LIMITS = {"codec": 60, "newton_schulz": 40, "methods": 250, "deepspeed": 90, "tests": 240, "scale": 480}
# The scale part: dense Muon (muon_lr 0.03, lr 0.008: its 128M settings) against the one-bit recipe at
# its settings (derived) at H 5 and the long-H recipe (its growth of H scaled to the budget), one
# seed, 390 steps (three runs of what four of 300 took; 2/3 of it an evaluation), evaluations every 10 (lowcomm_bench.scale)
SCALE = {"gpu": {"budget": 390, "warmup": 40, "eval_every": 10, "sync_every": "5", "batch": 8},
         "dry": {"budget": 12, "warmup": 2, "eval_every": 4, "sync_every": "2,4", "batch": 2}}
SCALE_DENSE = '{"peer.muon_lr": [0.03], "lr": [0.008]}'
ROOT = Path(__file__).resolve().parents[2]  # the repository (tests/ and ds_lowcomm/ beside lab/)

# The codec settings the methods send with (their compare recipes and demo_muon_c16's).
CODEC_CASES = {
    "demo": {"chunk": 8, "topk": 1, "value_dtype": "int8"},
    "demo_c16": {"chunk": 16, "topk": 2, "value_dtype": "int8"},
    "dct_diloco": {"chunk": 16, "topk": 32, "value_dtype": "bf16"},
    "sparseloco": {"chunk": 64, "topk": 256, "value_dtype": "2bit", "transform": "none"},
}
SIZES = {"gpu": ("gpt-125m", "gpt-350m", "llama-1b"), "dry": ("reference",)}
# The methods part: entries -> (recipe, lowcomm settings over it); outer methods sync every
# ``sync_every`` steps here so a few dozen steps hold several syncs.
METHOD_ENTRIES = ("adamw", "demo", "demo_muon", "diloco", "dct_diloco", "sparseloco", "mtdao", "diloco_streaming",
                  "muon", "dion", "muloco_dct", "muloco_sign")  # issue 41: dense Muon, the compressed outer loops, dion
MODEL = {"gpu": {"n_layer": 18, "n_embd": 768, "n_head": 12, "seq_len": 256},
         "dry": {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 32}}


def gpu_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def slug(name: str) -> str:
    """A file-name form of the device's name: "NVIDIA H200" -> "h200"."""
    short = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.I).split()[0] if name.strip() else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", short.lower()).strip("-") or "gpu"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up: allocations, bases, kernels
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- parts ------------------------------------------------------------------------------------------
def part_codec(args) -> list[dict]:
    from ds_lowcomm.comm import SparseAllGather
    from ds_lowcomm.plan import model_shapes
    from .codec import LoopbackTransport

    device = torch.device("cuda" if not args.dry_run else "cpu")
    rows = []
    for model in SIZES["dry" if args.dry_run else "gpu"]:
        shapes = model_shapes(model)
        elements = sum(math.prod(s) for s in shapes)
        gen = torch.Generator(device=device).manual_seed(0)
        own = [torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) for s in shapes]
        for case, settings in CODEC_CASES.items():
            kw = {"transform": "dct", **settings}
            other = [torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16) for s in shapes]
            # the other rank's payload, made as it would have been (then only decoded here)
            maker = SparseAllGather(shapes, **kw, average="senders", transport=LoopbackTransport([], device))
            payload, _ = maker.codec.compress(other)
            del other
            flag = torch.ones(1, dtype=torch.uint8, device=device)
            exchange = SparseAllGather(shapes, **kw, average="senders",
                                       transport=LoopbackTransport([torch.cat([payload, flag])], device))
            buffers = [t.clone() for t in own]
            seconds = _median_s(lambda: exchange.exchange(buffers), args.repeats)
            rows.append({"model": model, "parameters": elements, "case": case, **kw, "dtype": "bf16", "world": 2,
                         "median_s": seconds, "gbps_bf16": 2 * elements / seconds / 1e9,
                         "ns_per_element": 1e9 * seconds / elements, "wire_bytes": exchange.payload_bytes})
            print(f"codec {model:<9} {case:<11} {seconds * 1e3:9.2f} ms  {rows[-1]['gbps_bf16']:7.2f} GB/s (bf16)",
                  flush=True)
            del exchange, maker, payload, buffers
        del own
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def part_newton_schulz(args) -> list[dict]:
    from ds_lowcomm.optim.demo import orthogonalize
    from ds_lowcomm.plan import model_shapes

    device = torch.device("cuda" if not args.dry_run else "cpu")
    rows = []
    for model in SIZES["dry" if args.dry_run else "gpu"]:
        shapes = model_shapes(model)
        # the hidden matrices: not the token embedding (and an untied head: vocab rows), nor the
        # GPT's position embedding (its second tensor)
        vocab = shapes[0][0]
        positions = {1} if model.startswith(("gpt", "reference")) else set()
        hidden = [s for i, s in enumerate(shapes) if len(s) == 2 and vocab not in s and i not in positions]
        gen = torch.Generator(device=device).manual_seed(0)
        qs = [torch.randn(s, generator=gen, device=device) for s in hidden]
        ours = _median_s(lambda: [orthogonalize(q) for q in qs], args.repeats)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen, device=device)) for s in hidden]
        for p in params:
            p.grad = torch.randn_like(p)
        muon = torch.optim.Muon(params, lr=1e-3)
        theirs = _median_s(muon.step, args.repeats)
        elements = sum(math.prod(s) for s in hidden)
        for impl, seconds in (("ds_lowcomm.orthogonalize fp32", ours), ("torch.optim.Muon.step (bf16 NS)", theirs)):
            rows.append({"model": model, "matrices": len(hidden), "elements": elements, "implementation": impl,
                         "median_s_per_step": seconds})
            print(f"newton-schulz {model:<9} {impl:<32} {seconds * 1e3:9.2f} ms a step over {len(hidden)} matrices",
                  flush=True)
        del qs, params, muon
    return rows


def method_specs(args) -> list:
    from lowcomm_task.compare import build_specs
    from lowcomm_task.model import GPTConfig
    from lowcomm_task.spec import TrainSpec
    from .runs import VARIANTS

    steps, sync_every = args.steps, max(1, args.steps // 3)
    base = TrainSpec(steps=steps, warmup=2, eval_every=steps, val_batches=2, batch=args.batch, verbose=False,
                     model=GPTConfig(**MODEL["dry" if args.dry_run else "gpu"]), max_train_bytes=2_000_000,
                     max_val_bytes=100_000, device="cpu" if args.dry_run else "cuda")
    specs = []
    for entry in args.entries.split(","):
        if entry == "muon":  # dense DDP + torch's Muon: adamw's spec, the peer's step
            spec = build_specs(["adamw"], base, {}, workers=2)[0]
        else:
            recipe, over = VARIANTS.get(entry, (entry, {}))
            lowcomm = dict(over)
            if recipe in ("diloco", "dct_diloco", "sparseloco", "mtdao"):
                lowcomm["sync_every"] = sync_every  # muloco_dct's too: the run ends on a sync
            if entry == "diloco_streaming":
                lowcomm.update(fragments=2, sync_delay=1)
            spec = build_specs([recipe], base, {recipe: {"lowcomm": lowcomm}}, workers=2)[0]
        specs.append(dataclasses.replace(spec, label=entry))
    return specs


def _method_worker(rank: int, world: int, specs: list) -> list[dict]:
    """One process trains every entry in turn (processes and the group start once)."""
    from lowcomm_task.reference import ReferenceTask
    from lowcomm_task.train import train_worker
    from .peers import BASELINES, peer_step

    out = []
    for spec in specs:
        cuda = spec.device != "cpu"
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            make_step = peer_step(dict(BASELINES[spec.label])) if spec.label == "muon" else None
            report = train_worker(rank, world, spec, ReferenceTask, make_step)
            times = report["step_times"][1:] or report["step_times"]  # the first step warms up
            out.append({"entry": spec.label, "ok": True, "num_params": report["num_params"],
                        "step_s": statistics.median(times), "codec_s": report.get("codec_s", 0.0),
                        "steps": len(report["step_times"]), "bytes_sent": report["bytes_sent"],
                        "final_val_loss": report["final_val_loss"], "params_digest": report["params_digest"],
                        "max_memory_allocated": torch.cuda.max_memory_allocated() if cuda else None})
        except Exception as err:  # noqa: BLE001 (reported per entry; the others go on)
            out.append({"entry": spec.label, "ok": False, "error": f"{type(err).__name__}: {err}"[-2000:]})
            import torch.distributed as dist

            dist.barrier()  # both ranks failed alike (or one waits here for the other's failure)
    return out


def part_methods(args) -> list[dict]:
    from lowcomm_task.workers import run_local_workers

    specs = method_specs(args)
    per_rank = run_local_workers(_method_worker, 2, specs)
    rows = []
    for i, spec in enumerate(specs):
        r0, r1 = per_rank[0][i], per_rank[1][i]
        if not (r0["ok"] and r1["ok"]):
            rows.append({"entry": spec.label, "ok": False, "error": r0.get("error") or r1.get("error")})
            print(f"method {spec.label:<17} FAILED: {rows[-1]['error'][:300]}", flush=True)
            continue
        steps = r0["steps"]
        codec_per_step = r0["codec_s"] / steps
        syncs = steps if spec.label in ("adamw", "demo", "demo_muon", "muon") else \
            steps // max(1, int(spec.lowcomm.get("sync_every", 1)))
        rows.append({
            "entry": spec.label, "ok": True, "device": gpu_name(), "world": 2, "backend": "gloo",
            "parameters": r0["num_params"], "steps": steps, "step_s": max(r0["step_s"], r1["step_s"]),
            "codec_s_per_step": codec_per_step,
            # the codec's in-training throughput: fp32-equivalent bytes of the exchanged elements
            "codec_gbps": (4 * r0["num_params"] * syncs / r0["codec_s"] / 1e9) if r0["codec_s"] > 0 else None,
            "max_memory_allocated_mb": max(r0["max_memory_allocated"] or 0, r1["max_memory_allocated"] or 0) / 2**20,
            "bytes_sent_per_step": r0["bytes_sent"] / steps, "final_val_loss": r0["final_val_loss"],
            # streaming fragments sync at different steps: no step has every fragment just synced
            "replicas_identical": None if spec.lowcomm.get("fragments", 1) > 1 else r0["params_digest"] == r1["params_digest"],
        })
        r = rows[-1]
        print(f"method {spec.label:<17} step {r['step_s'] * 1e3:8.1f} ms  codec {codec_per_step * 1e3:7.2f} ms/step  "
              f"mem {r['max_memory_allocated_mb']:8.0f} MB  sent {r['bytes_sent_per_step'] / 1e6:9.3f} MB/step  "
              f"val {r['final_val_loss']:.4f}  identical {r['replicas_identical']}", flush=True)
    return rows


# DeepSpeed engines on the GPU: (label, optimizer section, zero stage, bf16, lowcomm section or None).
# Stock DeepSpeed's AdamW first: the reference the others' losses are read against.
DS_CASES = (
    ("deepspeed adamw zero2 bf16", {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, 2, True, None),
    ("demo zero0 bf16", {"type": "AdamW", "params": {"lr": 2e-3, "torch_adam": True}}, 0, True,
     {"method": "demo", "topk": 1, "chunk": 8, "value_dtype": "int8", "decay": 0.995}),
    ("diloco zero2 bf16", {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, 2, True,
     {"method": "diloco", "sync_every": 4}),
    ("deepspeed muon zero2 bf16", {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95,
                                                              "torch_adam": True}}, 2, True, None),
)
DS_WARMUP = 4  # steps of linear warm-up (every case: a 128M model takes no full-lr step from its start)


def _deepspeed_worker(rank: int, world: int, args_dict: dict) -> list[dict]:
    # Both ranks share the one GPU: DeepSpeed places a rank on cuda:LOCAL_RANK
    if args_dict["cuda"]:
        os.environ["LOCAL_RANK"] = "0"
    import deepspeed
    import torch.distributed as dist

    from ds_lowcomm.optim.muon import takes_muon_step
    from lowcomm_task.model import GPT, GPTConfig

    deepspeed.init_distributed(dist_backend="gloo")
    out = []
    gen = torch.Generator().manual_seed(1)
    cfg = GPTConfig(**args_dict["model"])
    batches = [(torch.randint(0, 256, (args_dict["batch"], cfg.seq_len), generator=gen),) for _ in range(args_dict["steps"])]
    for label, optimizer, stage, bf16, lowcomm in DS_CASES:
        torch.manual_seed(0)
        model = GPT(cfg)
        decision = takes_muon_step(model)  # DeepSpeed's Muon asks every parameter's use_muon: ours decides
        for p in model.parameters():
            p.use_muon = decision[id(p)]
        config = {"train_micro_batch_size_per_gpu": args_dict["batch"], "gradient_accumulation_steps": 1,
                  "optimizer": optimizer, "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
                  "steps_per_print": 10**9, "gradient_clipping": 0.0}
        baseline = 0
        if args_dict["cuda"]:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()  # what earlier cases left: not this one's
        schedule = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / DS_WARMUP))  # noqa: E731
        try:
            if lowcomm is not None:
                import ds_lowcomm.deepspeed as dslc

                engine, *_ = dslc.initialize(model=model, config={**config, "lowcomm": lowcomm}, lr_scheduler=schedule)
            else:
                engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                  lr_scheduler=schedule)
            times, losses = [], []
            for (x,) in batches:
                x = x.to(engine.device)
                _sync()
                t0 = time.perf_counter()
                loss = engine(x, x)  # a copy task (targets = inputs): the cost of a step, and that it learns
                engine.backward(loss)
                engine.step()
                _sync()
                times.append(time.perf_counter() - t0)
                losses.append(float(loss.item()))
            digest = torch.cat([p.detach().float().flatten().cpu() for p in engine.module.parameters()]).sum().item()
            out.append({"case": label, "ok": True, "step_s": statistics.median(times[1:] or times),
                        "first_loss": losses[0], "last_loss": losses[-1], "digest": digest,
                        "max_memory_allocated": torch.cuda.max_memory_allocated() - baseline if args_dict["cuda"] else None})
            del engine
        except Exception as err:  # noqa: BLE001 (reported per case)
            out.append({"case": label, "ok": False, "error": f"{type(err).__name__}: {err}"[-2000:]})
        dist.barrier()
    return out


def part_deepspeed(args) -> list[dict]:
    from lowcomm_task.workers import run_local_workers

    args_dict = {"cuda": not args.dry_run, "model": MODEL["dry" if args.dry_run else "gpu"],
                 "batch": args.batch, "steps": max(3, args.steps // 2)}
    per_rank = run_local_workers(_deepspeed_worker, 2, args_dict)
    rows = []
    for r0, r1 in zip(*per_rank):
        ok = r0["ok"] and r1["ok"]
        row = {"case": r0["case"], "ok": ok, "device": gpu_name(), "world": 2, "backend": "gloo"}
        if ok:
            row.update(step_s=max(r0["step_s"], r1["step_s"]), first_loss=r0["first_loss"], last_loss=r0["last_loss"],
                       max_memory_allocated_mb=max(r0["max_memory_allocated"] or 0, r1["max_memory_allocated"] or 0) / 2**20,
                       replicas_identical=r0["digest"] == r1["digest"])
            print(f"deepspeed {row['case']:<26} step {row['step_s'] * 1e3:8.1f} ms  mem {row['max_memory_allocated_mb']:8.0f} MB"
                  f"  loss {row['first_loss']:.3f} -> {row['last_loss']:.3f}  identical {row['replicas_identical']}",
                  flush=True)
        else:
            row["error"] = r0.get("error") or r1.get("error")
            print(f"deepspeed {row['case']:<26} FAILED: {row['error'][:300]}", flush=True)
        rows.append(row)
    return rows


def part_tests(args) -> list[dict]:
    """The GPU tests' outcomes, one row each (dry run: collected only)."""
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_gpu.py")]
    if args.dry_run:
        cmd += ["-q", "--collect-only"]
    else:
        cmd += ["-rA", "-v", "--timeout", "200"]
        try:
            import xdist  # noqa: F401

            cmd += ["-n", str(args.test_workers)]
        except ImportError:
            pass
    # its own options only: a caller's PYTEST_ADDOPTS (-v, --durations) changes the lines read below
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    print(proc.stdout[-6000:], proc.stderr[-3000:], sep="\n", flush=True)
    rows, seen = [], set()
    for line in proc.stdout.splitlines():
        m = re.search(r"(PASSED|FAILED|SKIPPED|ERROR)\s+(tests/\S+)", line) or \
            re.search(r"(tests/\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR)", line)
        if m:
            outcome, test = (m.group(1), m.group(2)) if m.group(1).isupper() else (m.group(2), m.group(1))
            if test not in seen:
                seen.add(test)
                rows.append({"test": test, "outcome": outcome})
        elif args.dry_run and "::" in line:
            rows.append({"test": line.strip(), "outcome": "collected"})
    if not rows:
        rows.append({"test": "pytest", "outcome": f"exit {proc.returncode}"})
    return rows


def part_scale_check(args) -> list[dict]:
    """Dense Muon against the one-bit recipe at 128M parameters (issue 55): ``bench scale`` on the
    one GPU, one seed (0: the dense run is its own tuning run, at the settings it had at 128M), the
    recipe's inner optimizer at the dense settings, H 5 and the long-H recipe; its per-run rows."""
    from .scale import main as scale_main

    kind = "dry" if args.dry_run else "gpu"
    model, cfg = MODEL[kind], SCALE[kind]
    out = Path(args.out) / f"scale-{args.date}"
    result = scale_main(["--n-layer", str(model["n_layer"]), "--n-embd", str(model["n_embd"]),
                         "--n-head", str(model["n_head"]), "--seq-len", str(model["seq_len"]),
                         "--batch", str(cfg["batch"]), "--budget", str(cfg["budget"]), "--warmup", str(cfg["warmup"]),
                         "--eval-every", str(cfg["eval_every"]), "--forms", "muon", "--muon-grid", SCALE_DENSE,
                         "--seeds", "0", "--sync-every", cfg["sync_every"], "--long", "--out", str(out),
                         "--device", "cpu" if args.dry_run else "cuda"])
    return result["rows"]


PART_FUNCTIONS = {"codec": part_codec, "newton_schulz": part_newton_schulz, "methods": part_methods,
                  "deepspeed": part_deepspeed, "tests": part_tests, "scale": part_scale_check}


# -- the run ----------------------------------------------------------------------------------------
def write_rows(path: Path, rows: list[dict]) -> None:
    import csv

    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


def prefix(out: Path, date: str, device: str) -> Path:
    return out / f"{date}-{slug(device)}"


def run_part(args) -> None:
    rows = PART_FUNCTIONS[args.part](args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = Path(f"{prefix(out, args.date, gpu_name() if not args.dry_run else 'cpu')}-{args.part}.csv")
    write_rows(path, rows)
    if args.part == "methods" and not args.dry_run:  # the planner's GPU codec default (a dry run's is no GPU's)
        from .measured import gpu_codec_from_methods_csv, record

        entry = gpu_codec_from_methods_csv(path)
        if entry is not None:
            record("codec_gbps", "gpu", entry)


def machine() -> dict:
    info = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device": gpu_name(), "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()
        info.update(memory_gib=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count,
                    nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
    for dist_name in ("deepspeed", "torchft", "megatron-core"):
        from ds_lowcomm.versions import installed_version

        info[dist_name] = installed_version(dist_name)
    return info


def run_limited(cmd: list[str], env: dict, limit: float) -> tuple[str, int | None]:
    """Run ``cmd`` in its own process group for at most ``limit`` seconds; its output and exit code
    (None: stopped at the limit, with every process it started, so none holds the GPU after)."""
    import signal
    import tempfile

    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            code = None
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the part's leftovers (spawned ranks), done or not
        except ProcessLookupError:
            pass
        proc.wait()
        log.seek(0)
        return log.read(), code


def part_scale(args, part: str) -> float:
    """The methods part's limit grows with its work: steps over the default 24, times the share of
    the entries run (at least the default limit)."""
    if part != "methods":
        return 1.0
    return max(1.0, args.steps / 24 * len(args.entries.split(",")) / len(METHOD_ENTRIES))


def default_out(dry_run: bool) -> str:
    """Where a run writes without ``--out``: a GPU's figures beside the committed ones
    (docs/bench/gpu), a dry run's (the CPU at tiny sizes: no evidence of anything) a new temporary
    folder, so that neither the suite nor a user's try leaves files in the checkout."""
    if dry_run:
        return tempfile.mkdtemp(prefix="gpu_check-dry-run-")
    from .committed import BENCH

    return str(BENCH / "gpu")


def orchestrate(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    device = "cpu" if args.dry_run else info["device"]
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device is visible (use --dry-run on a CPU machine)")
    deadline = time.monotonic() + args.budget_s
    base = [sys.executable, "-m", "lowcomm_bench", "gpu_check", "--out", str(out), "--date", info["date"],
            "--steps", str(args.steps), "--batch", str(args.batch), "--repeats", str(args.repeats),
            "--test-workers", str(args.test_workers), "--entries", args.entries,
            *(["--dry-run"] if args.dry_run else [])]
    status, log = {}, []
    # The interpreter's own tools first on PATH, as the test suite does (tests/conftest.py: DeepSpeed
    # JIT-builds its CPU comm op with the first ninja found, and a switch between two rebuilds it)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "lab"), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])}
    for part in args.parts.split(","):
        left = deadline - time.monotonic()
        limit = min(PART_LIMITS[part] * (1 if not args.dry_run else 2) * part_scale(args, part), left)
        if limit < 5:
            status[part] = {"status": "skipped (budget spent)", "seconds": 0}
            continue
        t0 = time.monotonic()
        print(f"== {part} (limit {limit:.0f} s)", flush=True)
        text, code = run_limited([*base, "--part", part], env, limit)
        state = "ok" if code == 0 else (f"timed out after {limit:.0f} s" if code is None else f"failed (exit {code})")
        seconds = time.monotonic() - t0
        lines = [line for line in text.splitlines() if not line.startswith(("[W", "[rank"))]
        print("\n".join(lines[-40:]), flush=True)
        status[part] = {"status": state, "seconds": round(seconds, 1)}
        if state != "ok":
            status[part]["error_tail"] = "\n".join(lines[-25:])
        log += [f"== {part}: {state} in {seconds:.1f} s", *lines]
    summary = {**info, "dry_run": args.dry_run, "budget_s": args.budget_s, "parts": status}
    stem = prefix(out, info["date"], device)
    Path(f"{stem}-summary.json").write_text(json.dumps(summary, indent=1))
    Path(f"{stem}-log.txt").write_text("\n".join(log)[-4_000_000:])
    print(f"\n== gpu_check on {device} ({info['torch']}, CUDA {info['cuda']}), {info['date']}")
    for part, s in status.items():
        print(f"  {part:<14} {s['status']:<28} {s['seconds']:7.1f} s")
    print(f"  files in {out}")
    return summary


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="where the dated CSVs go (on the lent machine: $OUT; default "
                    "docs/bench/gpu, for a dry run a new temporary folder)")
    ap.add_argument("--dry-run", action="store_true", help="the same parts on the CPU at tiny sizes")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock seconds for all parts together")
    ap.add_argument("--parts", default=",".join(DEFAULT_PARTS),
                    help=f"comma list of {', '.join(PARTS)} (default: {', '.join(DEFAULT_PARTS)})")
    ap.add_argument("--steps", type=int, default=None, help="training steps per method (default 24; dry run 6)")
    ap.add_argument("--entries", default=",".join(METHOD_ENTRIES),
                    help=f"the methods part's entries, a comma list of {', '.join(METHOD_ENTRIES)} (default: all)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per rank per step (default 8; dry run 2)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per codec / Newton-Schulz case")
    ap.add_argument("--test-workers", type=int, default=8, help="pytest-xdist workers for the GPU tests")
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)  # one part, in this process
    ap.add_argument("--date", default=datetime.date.today().isoformat(), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    bad = [p for p in args.parts.split(",") if p not in PARTS]
    if bad:
        raise SystemExit(f"--parts must name {', '.join(PARTS)}; got {', '.join(bad)}")
    bad = [e for e in args.entries.split(",") if e not in METHOD_ENTRIES]
    if bad:
        raise SystemExit(f"--entries must name {', '.join(METHOD_ENTRIES)}; got {', '.join(bad)}")
    args.out = args.out or default_out(args.dry_run)
    args.steps = args.steps or (6 if args.dry_run else 24)
    args.batch = args.batch or (2 if args.dry_run else 8)
    args.repeats = args.repeats or (1 if args.dry_run else 10)
    if args.part:
        run_part(args)
        return None
    return orchestrate(args)


if __name__ == "__main__":
    main()
