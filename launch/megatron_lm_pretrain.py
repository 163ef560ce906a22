#!/usr/bin/env python
"""Megatron-LM's own ``pretrain_gpt.py`` with ds_lowcomm: its training loop, arguments, data and
checkpoints, plus the ``--lowcomm-*`` arguments. Run it where you would run ``pretrain_gpt.py``,
naming your Megatron-LM checkout::

    torchrun --nproc_per_node 2 launch/megatron_lm_pretrain.py --megatron-lm /path/to/Megatron-LM \\
        <pretrain_gpt.py's arguments> --lowcomm-method diloco --lowcomm-sync-every 5

What it does, and nothing else: imports the CPU shim where there is no GPU; puts the checkout on
``sys.path``; passes ``megatron_patches.args.add_lowcomm_args`` as Megatron-LM's
``extra_args_provider``; wraps the ``get_megatron_optimizer`` Megatron-LM's training loop calls so
the optimizer it builds comes back through ``megatron_patches.apply`` (without ``--lowcomm-*`` it
is left alone), before any checkpoint is loaded into it; then calls Megatron-LM's ``pretrain`` with pretrain_gpt.py's own
providers (imported from the checkout, not copied). Checked by hand with Megatron-LM
``core_v0.16.1`` (docs/megatron_lm.md).
"""

from __future__ import annotations

import contextlib
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout of ds_lowcomm


def _take_checkout(argv: list[str]) -> str:
    if "--megatron-lm" not in argv:
        raise SystemExit("megatron_lm_pretrain.py: --megatron-lm PATH (a Megatron-LM checkout) is required")
    i = argv.index("--megatron-lm")
    path = argv[i + 1] if i + 1 < len(argv) else ""
    del argv[i : i + 2]
    if not (Path(path) / "pretrain_gpt.py").is_file():
        raise SystemExit(f"megatron_lm_pretrain.py: --megatron-lm {path!r} holds no pretrain_gpt.py")
    return str(Path(path).resolve())


class _CpuStream:
    """Stands in for a CUDA stream on the CPU, where everything runs in order."""

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_event(self, event) -> None:
        pass


def _cpu_only(training) -> None:
    """Megatron-LM on a machine without a GPU (tests, laptops): its initialisation asserts CUDA
    unless told the run is CPU-only, builds its CUDA fused kernels (skipped: the local
    implementations run), and sets up no model-parallel groups (it only does where it sees a
    GPU): set them up as it would, with the sizes from its arguments. Pass
    ``--use-cpu-initialization`` there."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.legacy import fused_kernels
    from megatron.training import get_args, initialize

    fused_kernels.load = lambda args: None
    # CUDA streams and memory statistics Megatron-LM's loop asks for: one CPU "stream", no memory.
    stream = _CpuStream()
    torch.cuda.Stream = lambda *a, **k: stream
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.default_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *a, **k: 0)

    training.initialize_megatron = partial(training.initialize_megatron, allow_no_cuda=True)
    init_distributed = initialize._initialize_distributed

    def init_distributed_and_groups(get_embedding_ranks, get_position_embedding_ranks, *rest, **kwargs):
        init_distributed(get_embedding_ranks, get_position_embedding_ranks, *rest, **kwargs)
        if not mpu.model_parallel_is_initialized():
            args = get_args()
            mpu.initialize_model_parallel(
                args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                args.virtual_pipeline_model_parallel_size, context_parallel_size=args.context_parallel_size,
                expert_model_parallel_size=args.expert_model_parallel_size,
                distributed_timeout_minutes=args.distributed_timeout_minutes,
                get_embedding_ranks=get_embedding_ranks, get_position_embedding_ranks=get_position_embedding_ranks)
            # Megatron-LM seeds its RNG tracker only where it sees a GPU; dropout forks need it.
            model_parallel_cuda_manual_seed(args.seed)

    initialize._initialize_distributed = init_distributed_and_groups


def main() -> None:
    checkout = _take_checkout(sys.argv)
    import torch

    if not torch.cuda.is_available():
        import megatron_patches.cpu_shim  # noqa: F401  before megatron
    sys.path.insert(0, checkout)

    import pretrain_gpt  # Megatron-LM's, from the checkout
    from megatron.core.enums import ModelType
    from megatron.training import get_args, training

    from megatron_patches import apply
    from megatron_patches.args import add_lowcomm_args, lowcomm_config

    build_optimizer = training.get_megatron_optimizer

    def build_optimizer_with_lowcomm(config, model_chunks, *args, **kwargs):
        # Wrapped where Megatron-LM builds it, before its checkpoint is loaded into it, so
        # load_checkpoint restores the method's state too (with --ckpt-format torch).
        optimizer = build_optimizer(config, model_chunks, *args, **kwargs)
        lowcomm = lowcomm_config(get_args())
        return apply(model_chunks, optimizer, lowcomm) if lowcomm is not None else optimizer

    training.get_megatron_optimizer = build_optimizer_with_lowcomm
    if not torch.cuda.is_available():
        _cpu_only(training)
    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True  # as its __main__ block
    training.pretrain(
        pretrain_gpt.train_valid_test_datasets_provider,
        partial(pretrain_gpt.model_provider, pretrain_gpt.gpt_builder),
        ModelType.encoder_or_decoder,
        pretrain_gpt.forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        extra_args_provider=add_lowcomm_args,
        get_embedding_ranks=pretrain_gpt.get_embedding_ranks,
    )


if __name__ == "__main__":
    main()
