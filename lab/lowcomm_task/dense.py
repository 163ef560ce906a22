"""The dense step a user runs on the reference task: PyTorch DDP (bucketed all-reduces overlapped
with the backward pass, fp32 or reduced in bf16) and then AdamW, or torch's Muon on the hidden
matrices with AdamW on the rest, every all-reduce counted in a ds_lowcomm ledger. ``ds-lowcomm
compare`` runs it as its ``muon`` baseline; the benchmarks' DDP peers (lowcomm_bench.peers) are
built from it."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ds_lowcomm.comm import ByteLedger

from .spec import TrainSpec
from .train import mean_over_ranks


# DDP's bucket cap for the overlapped baselines. DDP's default, 25 MB, holds the whole reference
# model (0.45M parameters, 1.8 MB in fp32) in one bucket: its all-reduce could only start once the
# whole backward pass is done, which is no overlap at all. At real scale the default gives tens of
# buckets (a 124M-parameter model, 500 MB in fp32: about 20), so the cap is scaled down with the
# model: 0.25 MB gives the reference model 7 buckets (each about one of its larger weight matrices;
# counted in a 2-process run: 22 all-reduces in 4 steps, as DDP starts with one bucket and rebuilds
# them in gradient order after the first step). The first buckets' all-reduces run while the
# backward pass goes on; only the last one's (the embeddings, whose gradients are complete last) is
# exposed. Smaller buckets would add a message per bucket for little more overlap.
OVERLAP_BUCKET_CAP_MB = 0.25


def count_all_reduces(ledger: ByteLedger) -> None:
    """Route every torch.distributed.all_reduce of this process through ``ledger``, but the
    training loop's all-reduce of its evaluation metrics (:func:`mean_over_ranks`: not the
    method's traffic, and not in ds_lowcomm's ledgers either)."""
    original = dist.all_reduce
    if getattr(original, "_lowcomm_counted", False):
        return
    metrics = mean_over_ranks.__code__

    def counted(tensor, *args, **kwargs):
        if sys._getframe(1).f_code is not metrics:
            n = tensor.numel() * tensor.element_size()
            ledger.record("ddp_all_reduce", n, n)
        return original(tensor, *args, **kwargs)

    counted._lowcomm_counted = True
    dist.all_reduce = counted


DENSE_OPTIMIZERS = ("adamw", "muon")


def dense_optimizer(model: torch.nn.Module, spec: TrainSpec, peer: dict) -> torch.optim.Optimizer:
    """The optimizer after a dense all-reduce: ``peer["optimizer"]`` "adamw" (torch's AdamW with
    the spec's lr, betas and weight decay) or "muon" (torch's Muon, Nesterov, on the hidden matrices at
    ``peer["muon_lr"]``, momentum ``peer["muon_momentum"]`` (0.95), Nesterov, lr adjusted by
    ``peer["adjust_lr_fn"]`` (torch's default, "original"), and AdamW as above on embeddings and
    1-D parameters: :class:`ds_lowcomm.optim.muon.MuonWithAdamW`, as Muon is run)."""
    kind = peer.get("optimizer", "adamw")
    if kind not in DENSE_OPTIMIZERS:
        raise ValueError(f"peer.optimizer must be one of {', '.join(DENSE_OPTIMIZERS)}; got {kind!r}")
    adamw = {"lr": spec.lr, "betas": spec.betas, "weight_decay": spec.weight_decay}
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), **adamw)
    from ds_lowcomm.optim.muon import MuonWithAdamW, split_muon_params

    muon = {"lr": peer.get("muon_lr", 0.02), "momentum": peer.get("muon_momentum", 0.95), "nesterov": True,
            "weight_decay": spec.weight_decay, "adjust_lr_fn": peer.get("adjust_lr_fn")}
    return MuonWithAdamW(*split_muon_params(model), muon=muon, adamw=adamw)


def ddp_setup(model: torch.nn.Module, spec: TrainSpec, peer: dict):
    """The step's (module to run, optimizer, ledger): DDP, its gradient all-reduced in buckets of
    ``peer["bucket_cap_mb"]`` as each bucket's gradients are complete (overlapped with the rest of
    the backward pass), then AdamW. ``compress``: "none" (fp32, DDP's own all-reduce hook, the
    same arithmetic as DDP without a hook: the bucket divided by the world size, then summed) or
    "bf16" (``bf16_compress_hook``: the bucket cast to bf16, divided, summed in bf16, cast back)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    def bf16_over_any_backend(state, bucket):  # (no annotations: DDP checks them, and here they are strings)
        # torch's bf16_compress_hook itself; DDP refuses that hook by its name unless CUDA with NCCL
        # >= 2.10 (NCCL's bf16 reduction) is there, but gloo sums bf16 too (the benchmarks' CPU runs)
        return default_hooks.bf16_compress_hook(state, bucket)

    hooks = {"none": default_hooks.allreduce_hook, "bf16": bf16_over_any_backend}
    compress = peer.get("compress", "none")
    if compress not in hooks:
        raise ValueError(f"peer.compress must be one of {', '.join(hooks)}; got {compress!r}")
    ledger = ByteLedger()
    # Several buckets over gloo are safe here, unlike PowerSGD's (see peer_setup): DDP calls the
    # hook of each bucket in bucket order from the backward pass itself, and each hook issues its
    # one all-reduce there (gloo numbers collectives as they are issued); nothing is issued from a
    # completion callback. Checked in 2-process runs, loopback and shaped links.
    ddp = DistributedDataParallel(model, bucket_cap_mb=peer.get("bucket_cap_mb", OVERLAP_BUCKET_CAP_MB))
    count_all_reduces(ledger)  # the hooks' all-reduces (DDP's built-in one, without a hook, is C++: uncounted)
    ddp.register_comm_hook(None, hooks[compress])
    opt = dense_optimizer(model, spec, peer)
    opt.register_step_post_hook(lambda *_: ledger.end_step())  # one ledger step per optimizer step
    return ddp, opt, ledger


def dense_step(model: torch.nn.Module, spec: TrainSpec, rank: int, loss, peer: dict):
    """The training loop's step (``make_step``) for DDP with ``peer``'s settings (:func:`ddp_setup`)."""
    from .steps import TorchStep

    return TorchStep.build(model, spec, rank, loss, setup=lambda m, s: ddp_setup(m, s, peer))
