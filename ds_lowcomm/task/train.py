"""One worker of the reference task: the training loop every method runs in ``ds-lowcomm compare``.

``train_worker(rank, world_size, spec)`` runs inside an initialised torch.distributed process
group (see :func:`ds_lowcomm.comm.run_local_workers`) and returns its metrics. All
method-specific communication goes through the optimizer and is in its ledger; the evaluation
metrics are averaged over ranks with a separate 2-float all-reduce that is not method traffic.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from ..codec import FLOAT_DTYPES
from ..comm import backend_device, build_transport
from ..config import LowcommConfig
from ..optim import build_optimizer
from .data import ByteCorpus
from .model import GPT, GPTConfig


def lr_lambda(warmup: int, total: int, floor: float = 0.1):
    """Linear warm-up, then cosine down to ``floor`` x the peak."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def params_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())  # any dtype
    return h.hexdigest()


@torch.no_grad()
def evaluate(model, batches) -> float:
    model.eval()
    loss = sum(model(x, y).item() for x, y in batches) / len(batches)
    model.train()
    return loss


def mean_over_ranks(*values: float) -> list[float]:
    """Evaluation metrics averaged over ranks (a plain all-reduce: not method traffic)."""
    t = torch.tensor(values, dtype=torch.float64, device=backend_device())
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def worker_device(name: str, rank: int) -> torch.device:
    """``spec["device"]``: "cpu", or "cuda" for this rank's GPU (LOCAL_RANK modulo the GPUs
    present, as torchrun would place it), or an explicit "cuda:N"."""
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device is 'cuda' but no CUDA device is visible; allowed: cpu, cuda, cuda:N")
        local = int(os.environ.get("LOCAL_RANK", rank))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device(name)


def lowcomm_setup(model: torch.nn.Module, spec: dict):
    """The module to run, the optimizer and its byte ledger: a ds_lowcomm method from spec["lowcomm"]."""
    cfg = LowcommConfig.from_dict(spec["lowcomm"])
    transport = build_transport(cfg.transport)
    opt = build_optimizer(
        cfg, model.parameters(), lr=spec["lr"], weight_decay=spec.get("weight_decay", 0.0),
        betas=tuple(spec.get("betas", (0.9, 0.95))), transport=transport,
    )
    return model, opt, opt.ledger


def train_worker(rank: int, world_size: int, spec: dict, setup=lowcomm_setup) -> dict:
    """``setup(model, spec) -> (module, optimizer, ledger)``; benchmarks pass their own for peer
    baselines (e.g. DDP with PowerSGD), which then train exactly like the methods."""
    cfg = LowcommConfig.from_dict(spec["lowcomm"])
    model_cfg = GPTConfig(**spec.get("model", {}))
    steps, batch, seq = spec["steps"], spec["batch"], model_cfg.seq_len
    eval_every = spec.get("eval_every", max(1, steps // 10))
    corpus = ByteCorpus(spec.get("data"), **spec.get("data_limits", {}))
    val = corpus.val_batches(spec.get("val_batches", 8), batch, seq)

    device, dtype = worker_device(spec.get("device", "cpu"), rank), spec.get("dtype", "fp32")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(FLOAT_DTYPES)}; got {dtype!r}")
    val = [(x.to(device), y.to(device)) for x, y in val]

    torch.manual_seed(spec.get("seed", 0))  # same init on every rank and for every method (and device)
    model = GPT(model_cfg).to(device=device, dtype=FLOAT_DTYPES[dtype])
    net, opt, ledger = setup(model, spec)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec.get("warmup", 0) or 1, steps))
    start_step = 0
    if spec.get("resume_from"):
        ckpt = torch.load(os.path.join(spec["resume_from"], f"rank{rank}.pt"), weights_only=False, map_location=device)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        start_step = ckpt["step"]

    history, recent, train_s, step_times = [], [], 0.0, []
    label = spec.get("label", cfg.method)
    for step in range(start_step, steps):
        t0 = time.perf_counter()
        x, y = corpus.train_batch(rank, world_size, step, batch, seq, spec.get("seed", 0))
        loss = net(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        step_times.append(time.perf_counter() - t0)
        train_s += step_times[-1]
        recent = (recent + [loss.item()])[-eval_every:]
        done = step + 1
        if done % eval_every == 0 or done == steps:
            train_loss, val_loss = mean_over_ranks(sum(recent) / len(recent), evaluate(model, val))
            row = {"step": done, "train_loss": train_loss, "val_loss": val_loss,
                   "bytes_sent": ledger.sent, "bytes_received": ledger.received,
                   "train_s": train_s}  # training time so far, evaluations left out
            history.append(row)
            if rank == 0 and spec.get("verbose", True):
                print(f"[{label}] step {done:5d}/{steps}  train {train_loss:.4f}  val {val_loss:.4f}  "
                      f"sent {row['bytes_sent'] / 1e6:9.3f} MB", flush=True)
        if spec.get("save_at") == done:
            os.makedirs(spec["save_dir"], exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "step": done},
                       os.path.join(spec["save_dir"], f"rank{rank}.pt"))
            if spec.get("stop_after_save"):
                break
        target = spec.get("stop_at_val_loss")
        if target is not None and history and history[-1]["step"] == done and history[-1]["val_loss"] <= target:
            break  # the held-out loss is averaged over ranks: every rank stops at the same step

    summary = ledger.summary()
    return {
        "method": cfg.method,
        "label": label,
        "settings": cfg.effective(),
        "model": asdict(model_cfg),
        "num_params": model.num_params(),
        "history": history,
        "final_train_loss": history[-1]["train_loss"] if history else float("nan"),
        "final_val_loss": history[-1]["val_loss"] if history else float("nan"),
        "bytes_sent": summary["bytes_sent"],
        "bytes_received": summary["bytes_received"],
        "ledger": summary,
        "train_s": train_s,
        "step_times": step_times,  # wall seconds of each step (forward, backward, optimizer incl. its syncs)
        "codec_s": summary["seconds"].get("codec", 0.0),
        "comm_s": summary["seconds"].get("comm", 0.0),
        "params_digest": params_digest(model),
    }
