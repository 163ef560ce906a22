"""A tiny Megatron-Core GPTModel trained by Megatron's own DDP, optimizer, schedules and
finalize_model_grads, with or without a ds_lowcomm method: shared by the Megatron tests, run
inside worker processes after ``initialize_model_parallel``."""

from __future__ import annotations

import re

import torch

from ds_lowcomm.checkpoint_io import params_digest

VOCAB, SEQ, BATCH = 32, 16, 4


def batch(gen: torch.Generator):
    """Sequences counting up mod VOCAB from a random start: learnable in a few steps."""
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=gen)
    tokens = (start + torch.arange(SEQ + 1)) % VOCAB
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def train(lowcomm, steps, *, lr=1e-2, micro=1, overlap=False, bf16=False, on_inner_step=None, seed=1234,
          nan_in_grads=False, after_apply=None):
    """Build the model (same initial parameters in every replica), train ``steps`` iterations,
    each replica on its own batches (every rank of a replica the same ones). Returns the model,
    the optimizer (ds_lowcomm's wrapper when ``lowcomm`` is given) and, per step, the mean loss
    on the last pipeline stage (None elsewhere) and the digest of this rank's parameters.
    ``nan_in_grads``: Megatron's NaN check on (``check_for_nan_in_grad``) and a NaN weight, so
    every gradient is NaN. ``after_apply(opt, model)``: called once ds_lowcomm is in."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patches import apply

    torch.manual_seed(seed)  # the same initial parameters in every replica
    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
                               pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
                               pipeline_dtype=dtype, params_dtype=dtype, bf16=bf16, hidden_dropout=0.0,
                               attention_dropout=0.0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    if bf16:
        model = Float16Module(config, model)
    model = DistributedDataParallel(
        config, DistributedDataParallelConfig(overlap_grad_reduce=overlap, grad_reduce_in_fp32=bf16,
                                              check_for_nan_in_grad=nan_in_grads), model)
    config.finalize_model_grads_func = finalize_model_grads  # as Megatron-LM's training loop sets them
    if overlap:
        config.no_sync_func = model.no_sync
        config.grad_sync_func = model.start_grad_sync
    megatron_opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.01, clip_grad=0.0, bf16=bf16), [model])
    opt = apply([model], megatron_opt, lowcomm) if lowcomm is not None else megatron_opt
    if after_apply is not None:
        after_apply(opt, model)
    if nan_in_grads:
        with torch.no_grad():
            next(p for p in model.parameters() if p.dim() == 2).fill_(float("nan"))
    if on_inner_step is not None:  # observe the parameters right after Megatron's own step
        megatron_step = megatron_opt.step

        def step():
            out = megatron_step()
            on_inner_step([p.detach().clone() for p in model.parameters()])
            return out
        megatron_opt.step = step

    gen = torch.Generator().manual_seed(100 + ps.get_data_parallel_rank())  # each replica its own data
    positions = torch.arange(SEQ).expand(BATCH, SEQ)

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        out = model(tokens, positions, None, labels=labels)

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach().clone()}  # Megatron divides loss in place
        return out, loss_func

    forward_backward = get_forward_backward_func()
    losses, digests = [], []
    for _ in range(steps):
        model.zero_grad_buffer()
        opt.zero_grad()
        out = forward_backward(forward_step_func=forward_step, data_iterator=iter([batch(gen) for _ in range(micro)]),
                               model=[model], num_microbatches=micro, seq_length=SEQ, micro_batch_size=BATCH)
        losses.append(sum(float(d["lm loss"]) for d in out) / len(out) if out else None)
        ok, _, _ = opt.step()
        assert ok
        digests.append(params_digest(model))
    return model, opt, losses, digests


def coordinates() -> tuple[int, int, int]:
    """(tensor-parallel rank, pipeline rank, data-parallel rank) of this process."""
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank())


def whole_tensors(model, tensors: dict, layers: int = 2) -> dict:
    """{this rank's parameter name: a tensor shaped as that parameter (its value, its Adam
    moment...)} -> {the whole model's name: the whole tensor}: shards all-gathered over the
    tensor-parallel group and concatenated along the axis Megatron splits the parameter on, the
    pipeline stage's local layer numbers shifted to the model's (``layers`` in all). The
    reference for checkpoints loaded at another layout."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_patches.internals import tensor_parallel_shard

    params = dict(model.named_parameters())
    offset = ps.get_pipeline_model_parallel_rank() * (layers // ps.get_pipeline_model_parallel_world_size())
    tp = ps.get_tensor_model_parallel_world_size()
    out = {}
    for name, t in tensors.items():
        dim = tensor_parallel_shard(params[name])
        if dim is not None and tp > 1:
            shards = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(shards, t.contiguous(), group=ps.get_tensor_model_parallel_group())
            t = torch.cat(shards, dim)
        out[re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + offset}.", name)] = t
    return out
