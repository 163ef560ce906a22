"""``python -m lowcomm_bench muon_memory``: memory per rank of demo with Muon's step against
DeepSpeed's own Muon, both at ZeRO 2 in bf16, measured and as ``ds-lowcomm plan --muon`` predicts.

A Llama (transformers' ``LlamaForCausalLM``, untied head, a 32,000-token vocabulary so that the
embeddings and head, which take Adam's step under DeepSpeed's Muon and sign's under demo, are a
large share) on 2 local processes (gloo, one replica of 2 ranks: ZeRO 2 partitions every group
over them, so demo's matrices are assembled over the replica). Entries: ``deepspeed_muon`` (plain
DeepSpeed, ``"type": "Muon"``, ``torch_adam``) and ``demo_muon`` (ds_lowcomm's demo, ``update``
muon, ``configs/zero2_bf16_demo_muon.json``'s codec). Per entry and rank: the resident memory
after the engine is built and the peak over a few steps (``ru_maxrss``); ``muon_memory.csv``
holds them beside the planner's figures. On a GPU, ``torch.cuda.max_memory_allocated`` is the
figure to read instead (not measured here: no GPU).
"""

from __future__ import annotations

import argparse
import os
import resource
from pathlib import Path

from ds_lowcomm import plan as planner
from lowcomm_task.workers import run_local_workers

from .codec import write_csv

COLUMNS = ["entry", "parameters", "rss_built_mb", "peak_rss_mb", "peak_over_built_mb", "predicted_state_mb",
           "predicted_transient_mb"]
VOCAB, SEQ, BATCH = 32000, 64, 2
DEMO = {"method": "demo", "update": "muon", "topk": 2, "chunk": 16, "decay": 0.995, "value_dtype": "int8",
        "replica_size": 2}


def _rss_mb() -> float:
    """This process's resident memory now (MB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _worker(rank: int, world: int, entry: str, width: int, layers: int, steps: int) -> dict:
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import ds_lowcomm.deepspeed as dl

    torch._dynamo.config.disable = True  # DeepSpeed's Muon kernels eager, as everything else here
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=width * 8 // 3 // 8 * 8,
                                         num_hidden_layers=layers, num_attention_heads=max(1, width // 64),
                                         num_key_value_heads=max(1, width // 64), tie_word_embeddings=False))
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    if entry == "deepspeed_muon":
        config["optimizer"] = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3, "torch_adam": True}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    else:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 6e-3, "weight_decay": 0.0}}
        engine, *_ = dl.initialize(model=model, config={**config, "lowcomm": DEMO})
    built = _rss_mb()
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    return {"built_mb": built, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "parameters": sum(p.numel() for p in model.parameters())}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench muon_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/muon_memory")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    width = args.width
    heads = max(1, width // 64)
    shapes = planner.llama_shapes(width, args.layers, width * 8 // 3 // 8 * 8, VOCAB, heads, heads)
    predicted = planner.muon_memory(shapes, {0, len(shapes) - 1}, gpus=2, zero_stage=2)
    rows = []
    for entry in ("deepspeed_muon", "demo_muon"):
        per_rank = run_local_workers(_worker, 2, entry, width, args.layers, args.steps)
        built = max(r["built_mb"] for r in per_rank)
        peak = max(r["peak_mb"] for r in per_rank)
        state = predicted["deepspeed_muon_state_bytes_per_gpu" if entry == "deepspeed_muon"
                          else "demo_muon_state_bytes_per_gpu"] / 2**20
        rows.append({"entry": entry, "parameters": per_rank[0]["parameters"], "rss_built_mb": built,
                     "peak_rss_mb": peak, "peak_over_built_mb": peak - built, "predicted_state_mb": state,
                     "predicted_transient_mb": predicted["demo_muon_transient_bytes_per_gpu"] / 2**20
                     if entry == "demo_muon" else None})
        print(f"{entry:<15} built {built:8.1f} MB  peak {peak:8.1f} MB  (plan: state {state:7.1f} MB)", flush=True)
    ds, demo = rows
    print(f"demo_muon - deepspeed_muon, per rank: peak RSS {demo['peak_rss_mb'] - ds['peak_rss_mb']:+.1f} MB; plan: "
          f"state {predicted['added_state_bytes_per_gpu'] / 2**20:+.1f} MB, demo's step transient "
          f"{predicted['demo_muon_transient_bytes_per_gpu'] / 2**20:.1f} MB", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "muon_memory.csv", rows, COLUMNS)
    return rows


if __name__ == "__main__":
    main()
