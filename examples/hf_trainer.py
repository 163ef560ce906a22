"""A Hugging Face Trainer script made a ds_lowcomm one by one line (marked below) and a "lowcomm"
section in its DeepSpeed config: a Llama-architecture LlamaForCausalLM (transformers' own, from a
small LlamaConfig) trained on the reference corpus (bytes of Python's standard library, a byte
vocabulary).

    torchrun --nproc_per_node 2 examples/hf_trainer.py --deepspeed examples/hf_trainer.json --out run

Without the "lowcomm" section the same script is plain DeepSpeed under the Trainer.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab"))  # the reference corpus (lowcomm_task)

import ds_lowcomm.deepspeed  # noqa: E402

ds_lowcomm.deepspeed.install()  # the one line: deepspeed.initialize goes through ds_lowcomm where the config says so

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from lowcomm_task.data import ByteCorpus  # noqa: E402


class Windows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq`` bytes: a causal LM's inputs (the labels are the inputs:
    the model shifts them)."""

    def __init__(self, data: torch.Tensor, seq: int, limit: int | None = None):
        n = data.numel() // seq
        self.data, self.seq, self.n = data, seq, n if limit is None else min(n, limit)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = self.data[i * self.seq : (i + 1) * self.seq]
        return {"input_ids": x, "labels": x}


def llama(width: int, layers: int, tied: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=width * 8 // 3 // 8 * 8,
                         num_hidden_layers=layers, num_attention_heads=max(1, width // 32),
                         num_key_value_heads=max(1, width // 64), max_position_embeddings=512, tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def run(deepspeed_config, out: str, steps: int = 20, save_steps: int = 0, resume: str | None = None, width: int = 64,
        layers: int = 2, seq: int = 128, batch: int = 8, lr: float = 3e-3, corpus: ByteCorpus | None = None,
        callbacks=None, eval_windows: int = 64, tied: bool = True, bf16: bool = False) -> dict:
    """Train with the Trainer (``deepspeed_config``: a path or a dict) and report what happened
    (every rank's parameter digest; the method's bytes where the config has a lowcomm section)."""
    corpus = corpus or ByteCorpus()
    model = llama(width, layers, tied)
    training = TrainingArguments(
        output_dir=out, deepspeed=deepspeed_config, per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch, max_steps=steps, learning_rate=lr, warmup_steps=2,
        lr_scheduler_type="cosine", weight_decay=0.0, logging_steps=1, save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500, report_to=[], seed=0, data_seed=0, dataloader_drop_last=True,
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True, bf16=bf16)
    trainer = Trainer(model=model, args=training, train_dataset=Windows(corpus.train, seq),
                      eval_dataset=Windows(corpus.val, seq, limit=eval_windows), callbacks=callbacks)
    result = trainer.train(resume_from_checkpoint=os.path.join(out, resume) if resume else None)
    held_out = trainer.evaluate()["eval_loss"]
    engine = trainer.model_wrapped
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, _digest(model))
    report = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h], "held_out_loss": held_out,
              "train_loss": result.training_loss, "global_step": trainer.state.global_step, "digests": everyone,
              "parameters": sum(p.numel() for p in model.parameters()),
              "lowcomm": engine.lowcomm.summary() if hasattr(engine, "lowcomm") else None}
    # the engine released (the Trainer's Accelerate references; DeepSpeed's engine.destroy() drops
    # DeepSpeed's own, to the parameters): see end()
    trainer.accelerator.free_memory()
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepspeed", required=True, help="the DeepSpeed config (JSON)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-steps", type=int, default=0)
    ap.add_argument("--resume", default=None, help="a checkpoint folder of --out to resume from")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--local_rank", type=int, default=-1)
    args = ap.parse_args()
    report = run(args.deepspeed, args.out, args.steps, args.save_steps, args.resume, args.width, args.layers)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(args.out, "report.json"), "w") as f:
            json.dump(report, f, default=str)


def end() -> None:
    """The end of a run, after main() returned (its engines released, nothing of them held), in this order:
    the engines' last reference cycles collected while the process groups are still up, then
    DeepSpeed's torch.distributed torn down (DeepSpeed drops its own references to the groups too;
    torch's destroy_process_group(), which Accelerate's end_training() calls, leaves those) and
    the groups collected, so that torch joins their gloo worker threads now. A worker still holding
    its last collective's tensors when the interpreter shuts down aborts the process
    (pytorch/pytorch#190489)."""
    import deepspeed

    gc.collect()
    deepspeed.comm.destroy_process_group()
    gc.collect()


def _digest(model) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


if __name__ == "__main__":
    main()
    end()
