#!/usr/bin/env python
"""Train a Megatron-Core GPTModel on the reference corpus (bytes; lab/lowcomm_task/data.py) with
Megatron's tensor/pipeline parallelism, Megatron's schedules, DDP and optimizer, and, with any
``--lowcomm-*`` option, a ds_lowcomm method across the data-parallel replicas
(``megatron_patches.apply``: adamw, demo, mtdao, diloco, dct_diloco, sparseloco; MuLoCo with
``--lowcomm-inner-optimizer muon``: ds_lowcomm's Muon in place of Megatron's Adam)::

    torchrun --nproc_per_node 2 launch/pretrain_gpt.py --tensor-model-parallel-size 2 --train-iters 20
    torchrun --nproc_per_node 2 launch/pretrain_gpt.py --pipeline-model-parallel-size 2 --train-iters 20
    torchrun --nproc_per_node 2 launch/pretrain_gpt.py --train-iters 40 \\
        --lowcomm-method sparseloco --lowcomm-sync-every 10
    torchrun --nproc_per_node 2 launch/pretrain_gpt.py --overlap-grad-reduce --lowcomm-method demo

Checkpoints: ``--save DIR --save-interval N`` writes Megatron-LM's default ``--ckpt-format
torch_dist`` (Megatron-Core's dist_checkpointing; the method's state goes in through the
optimizer's ``sharded_state_dict``, each parameter's sharded as the parameter) or ``--ckpt-format
torch`` (one file per rank: model, Megatron's optimizer, the method's state), each with the RNG
states, and then ``DIR/latest_checkpointed_iteration.txt``; ``--load DIR`` resumes from it,
exactly, with the same format (megatron_patches/checkpoint.py); a torch_dist checkpoint also at
another TP / PP / DP layout (docs/megatron.md says what follows a new replica count).

Dropout is off unless asked for (``--hidden-dropout 0.1 --attention-dropout 0.1`` are
Megatron-LM's defaults); resume is exact with it on (the RNG tracker's streams are saved).
``--check-for-nan-in-loss-and-grad`` / ``--check-for-large-grads`` are Megatron's gradient
checks, honoured by every method.

``--lowcomm-activations-forward int8`` (and ``-backward``, ...) codes what crosses the pipeline
stages (megatron_patches/activations.py).

Without ``--lowcomm-*`` it is plain Megatron data-parallel training (gradient all-reduce).
On a machine without a GPU it runs on the CPU over gloo (megatron_patches/cpu_shim.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab"))  # and its laboratory (lowcomm_task)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ds_lowcomm.settings import ConfigError  # noqa: E402
from megatron_patches.args import activation_settings, add_lowcomm_args, lowcomm_config  # noqa: E402  (megatron itself is imported in main)
from megatron_patches.checkpoint import FORMATS as CKPT_FORMATS  # noqa: E402

VOCAB = 256  # bytes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--train-iters", type=int, default=20)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="sequences per iteration over all replicas (default: micro batch x data-parallel size)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="linear warmup from 0 to --lr over these iterations (set in the param groups each iteration)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="Megatron's default")
    p.add_argument("--bf16", action="store_true", help="bf16 parameters with fp32 main params/grads (Megatron's)")
    p.add_argument("--fp16", action="store_true",
                   help="fp16 parameters with fp32 main params and Megatron's dynamic loss scale (not with demo, mtdao)")
    p.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32, help="fp16's dynamic loss scale starts here")
    p.add_argument("--hidden-dropout", type=float, default=0.0, help="Megatron-LM's default is 0.1")
    p.add_argument("--attention-dropout", type=float, default=0.0, help="Megatron-LM's default is 0.1")
    p.add_argument("--check-for-nan-in-loss-and-grad", action="store_true",
                   help="Megatron's check of every bucket's local gradients (and the loss) for NaN / Inf")
    p.add_argument("--check-for-large-grads", action="store_true", help="Megatron's unexpectedly-large-gradient check")
    p.add_argument("--overlap-grad-reduce", action="store_true", help="start each bucket's sync during backward")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--optimizer", default="adam", choices=("adam", "muon"),
                   help="Megatron's Adam, or Megatron-Core's Muon (needs NVIDIA's emerging-optimizers package at "
                        "the API megatron-core 0.16 calls, its v0.1.0 release; refused saying why where it cannot "
                        "be built; with the outer methods: their inner optimizer)")
    p.add_argument("--clip-grad", type=float, default=0.0, help="Megatron's gradient clipping (0: none) of the gradients its optimizer holds: the mean (stock, adamw), "
                        "each replica's own (mtdao, the outer methods)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data", default=None, help="text file or directory (default: the Python standard library)")
    p.add_argument("--eval-iters", type=int, default=2, help="held-out micro batches evaluated at the end")
    p.add_argument("--log-interval", type=int, default=1)
    p.add_argument("--metrics-out", default=None, help="JSON file the first replica's last stage writes")
    p.add_argument("--save", default=None, help="checkpoint directory")
    p.add_argument("--save-interval", type=int, default=None, help="iterations between checkpoints")
    p.add_argument("--load", default=None, help="resume from the latest checkpoint in this directory")
    p.add_argument("--ckpt-format", default="torch_dist", choices=CKPT_FORMATS,
                   help="torch_dist: Megatron's distributed checkpoint (Megatron-LM's default); torch: one file per rank")
    add_lowcomm_args(p)
    return p.parse_args(argv)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    lowcomm = lowcomm_config(args)  # configuration errors before any rank starts work
    activations = activation_settings(args)
    if activations is not None and args.pipeline_model_parallel_size < 2:
        raise ConfigError("--lowcomm-activations-*: codecs between pipeline stages need "
                          "--pipeline-model-parallel-size > 1")
    tp, pp, world = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, int(os.environ.get("WORLD_SIZE", 1))
    if tp < 1 or pp < 1 or world % (tp * pp):
        raise ConfigError(f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} must be >= 1 "
                          f"and divide the world size ({world} ranks started): the data-parallel size is "
                          "world / (TP x PP)")
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16: choose one")
    if args.save_interval is not None and (args.save is None or args.save_interval < 1):
        raise ConfigError("--save-interval takes a positive number of iterations and needs --save DIR")
    if not torch.cuda.is_available():
        from megatron_patches import cpu_shim

        cpu_shim.install()  # before megatron
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from lowcomm_task.data import ByteCorpus
    from megatron_patches import apply, checkpoint
    from megatron_patches.activations import install_activation_compression

    if args.optimizer == "muon":  # before any rank communicates: whether Megatron-Core's Muon can be built here
        from megatron_patches.install import check_megatron_muon

        check_megatron_muon()

    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    dist.init_process_group("nccl" if gpu else "gloo")
    ps.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    model_parallel_cuda_manual_seed(args.seed)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    gbs = args.global_batch_size or args.micro_batch_size * dp_size
    if gbs % (args.micro_batch_size * dp_size):
        raise SystemExit(f"--global-batch-size {gbs} must be a multiple of micro batch x data-parallel size "
                         f"({args.micro_batch_size} x {dp_size})")
    num_micro = gbs // (args.micro_batch_size * dp_size)

    torch.manual_seed(args.seed)  # every replica and every TP rank alike (CPU initialisation)
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    half = args.bf16 or args.fp16
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, pipeline_dtype=dtype,
        use_cpu_initialization=True, params_dtype=dtype, bf16=args.bf16, fp16=args.fp16,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=args.seq_length, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    if gpu:
        model.cuda()
    if half:  # as Megatron-LM's get_model: bf16/fp16 inside, fp32 inputs and outputs
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=half, overlap_grad_reduce=args.overlap_grad_reduce,
                                               use_distributed_optimizer=args.use_distributed_optimizer,
                                               check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
                                               check_for_large_grads=args.check_for_large_grads)
    model = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    if args.overlap_grad_reduce:  # as Megatron-LM's training loop: the schedules drive the bucket syncs
        config.no_sync_func = model.no_sync
        config.grad_sync_func = model.start_grad_sync
    opt_config = OptimizerConfig(optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay,
                                 clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
                                 initial_loss_scale=args.initial_loss_scale,
                                 use_distributed_optimizer=args.use_distributed_optimizer)
    if args.optimizer == "muon":  # Megatron-Core's own (megatron/core/optimizer/muon.py), as Megatron-LM builds it
        from megatron_patches.install import megatron_muon_optimizer

        optimizer = megatron_muon_optimizer(opt_config, [model])
    else:
        optimizer = get_megatron_optimizer(opt_config, [model])
    if args.fp16:  # as Megatron-LM's setup: the schedules scale the loss by the dynamic loss scale
        config.grad_scale_func = optimizer.scale_loss
    if lowcomm is not None:
        optimizer = apply([model], optimizer, lowcomm)
    activation_ledger = install_activation_compression(activations) if activations is not None else None
    first = 0
    save, load = ((checkpoint.save_dist, checkpoint.load_dist) if args.ckpt_format == "torch_dist"
                  else (checkpoint.save, checkpoint.load))
    if args.load:
        first = load(args.load, [model], optimizer)

    corpus = ByteCorpus(args.data)
    device = torch.device("cuda") if gpu else torch.device("cpu")
    positions = torch.arange(args.seq_length, device=device).expand(args.micro_batch_size, -1)

    def forward_step(data_iterator, model):
        tokens, labels = (t.to(device) for t in next(data_iterator))
        out = model(tokens, positions, None, labels=labels)

        def loss_func(per_token):
            loss = per_token.float().mean()
            if args.check_for_nan_in_loss_and_grad and not torch.isfinite(loss):
                raise RuntimeError(f"Rank {dist.get_rank()}: found NaN or Inf in the local loss ({float(loss)})")
            return loss, {"lm loss": loss.detach().clone()}  # Megatron divides loss in place
        return out, loss_func

    def run(batches, forward_only):
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            forward_only=forward_only)
        if not ps.is_pipeline_last_stage():
            return None
        return sum(float(d["lm loss"]) for d in out) / len(out)

    reporter = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and dp_rank == 0
    losses, start, skipped = [], time.time(), 0
    for it in range(first, args.train_iters):
        # Every rank of one replica sees the same micro batches; each replica its own shard.
        batches = [corpus.train_batch(dp_rank, dp_size, it * num_micro + m, args.micro_batch_size, args.seq_length,
                                      seed=args.seed) for m in range(num_micro)]
        if args.lr_warmup_iters:  # as Megatron's scheduler: each group's lr from its own peak (max_lr: --lr,
            for group in optimizer.param_groups:  # or inner_muon_lr for the Muon half of MuLoCo's inner optimizer)
                group["lr"] = group.get("max_lr", args.lr) * min(1.0, (it + 1) / args.lr_warmup_iters)
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = run(batches, forward_only=False)
        update_successful, _, _ = optimizer.step()
        skipped += not update_successful  # fp16: an overflow skips the step (and lowers the loss scale)
        if loss is not None:
            losses.append(loss)
            if reporter and (it + 1) % args.log_interval == 0:
                print(f"iteration {it + 1}/{args.train_iters} lm loss {loss:.4f} skipped iterations {skipped}", flush=True)
        if args.save and args.save_interval and (it + 1) % args.save_interval == 0:
            save(args.save, it + 1, [model], optimizer)
    val = None
    if args.eval_iters:
        model.eval()
        with torch.no_grad():
            val = run(corpus.val_batches(args.eval_iters, args.micro_batch_size, args.seq_length), forward_only=True)
        model.train()
    metrics = None
    if reporter:
        metrics = {"train_loss": losses, "val_loss": val, "seconds": time.time() - start, "skipped_iterations": skipped,
                   "tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size, "dp": dp_size,
                   "lowcomm": lowcomm.effective() if lowcomm is not None else None}
        if lowcomm is not None:
            ledger = optimizer.ledger
            metrics["outer_steps"] = getattr(getattr(optimizer, "outer", None), "outer_steps", None)
            metrics["bytes_sent_per_step"] = [ledger.step_bytes(i)[0] for i in range(ledger.steps)]
            metrics["bytes_by_op"] = ledger.summary()["by_op"]  # e.g. the gradient all-reduce apart from its health flag
        metrics["params_digest"] = checkpoint.params_digest([model])
        if activation_ledger is not None:  # this rank's sends to the previous stage (it is the last)
            metrics["activation_bytes_sent"] = activation_ledger.sent
        print(f"validation lm loss {val:.4f}" if val is not None else "done", flush=True)
        if args.metrics_out:
            Path(args.metrics_out).write_text(json.dumps(metrics, indent=1))
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()
    return metrics


if __name__ == "__main__":
    try:
        main()
    except ConfigError as err:
        print(f"pretrain_gpt: configuration error: {err}", file=sys.stderr)
        sys.exit(2)
