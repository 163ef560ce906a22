#!/usr/bin/env python
"""Megatron-LM's own ``pretrain_gpt.py`` with ds_lowcomm: its training loop, arguments, data and
checkpoints, plus the ``--lowcomm-*`` arguments. Run it where you would run ``pretrain_gpt.py``,
naming your Megatron-LM checkout::

    torchrun --nproc_per_node 2 launch/megatron_lm_pretrain.py --megatron-lm /path/to/Megatron-LM \\
        <pretrain_gpt.py's arguments> --lowcomm-method diloco --lowcomm-sync-every 5

What it does, and nothing else: puts the checkout on ``sys.path`` (first: its ``megatron``) and,
where there is no GPU, installs the CPU shim and patches Megatron-LM's start-up for the CPU
(``_cpu_only``); passes ``megatron_patches.args.add_lowcomm_args`` as Megatron-LM's
``extra_args_provider``; wraps the ``get_megatron_optimizer`` Megatron-LM's training loop calls so
that checkpoint settings which would lose or misread the method's state are refused there (a
``ConfigError``, on every rank) and the optimizer it builds comes back through
``megatron_patches.apply`` (without ``--lowcomm-*`` it is left alone), before any checkpoint is
loaded into it; then calls Megatron-LM's ``pretrain`` with pretrain_gpt.py's own providers
(imported from the checkout, not copied). Checked by hand with Megatron-LM ``core_v0.16.1``
(docs/megatron_lm.md).
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
    implementations run), sets up no model-parallel groups (it only does where it sees a GPU:
    set them up as it would, with the sizes from its arguments), asks the GPU's architecture in
    its argument checks with tensor parallelism (none: as before Blackwell), and lets PyTorch's
    DataLoader draw from the generator that here stands in for the GPU's (kept as it was). Pass
    ``--use-cpu-initialization`` there. Nothing of this runs where a GPU is present."""
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.legacy import fused_kernels
    from megatron.training import arguments, get_args, initialize

    fused_kernels.load = lambda args: None
    # Its argument checks ask the GPU's architecture with tensor (or context) parallelism: none
    # here, i.e. before Blackwell, so its CUDA_DEVICE_MAX_CONNECTIONS=1 check applies as on a Hopper.
    arguments.get_device_arch_version = lambda: 0
    # CUDA streams and memory statistics Megatron-LM's loop asks for: one CPU "stream", no memory.
    stream = _CpuStream()
    torch.cuda.Stream = lambda *a, **k: stream
    torch.cuda.current_stream = lambda *a, **k: stream
    torch.cuda.default_stream = lambda *a, **k: stream
    torch.cuda.stream = lambda s: contextlib.nullcontext()
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *a, **k: 0)

    training.initialize_megatron = partial(training.initialize_megatron, allow_no_cuda=True)
    # Here one generator stands in for the CPU's and the GPU's (megatron_patches.cpu_shim), so
    # dropout draws from the one PyTorch's DataLoader draws a seed from when its iterator is made
    # (after a checkpoint's RNG state is loaded). On a GPU that draw leaves dropout's generator
    # alone: leave it alone here too, or a resumed run's dropout is one draw off the saved state.
    build_iterators = training.build_train_valid_test_data_iterators

    def build_iterators_keeping_rng(*args, **kwargs):
        state = torch.get_rng_state()
        try:
            return build_iterators(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    training.build_train_valid_test_data_iterators = build_iterators_keeping_rng
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


def _saved_lowcomm_state(args) -> tuple[str, dict | None] | None:
    """``(directory, its content metadata's "ds_lowcomm" entry or None)`` of the torch_dist
    checkpoint whose optimizer state Megatron-LM's ``load_checkpoint`` will load, found as it finds
    it (tracker file, ``--ckpt-step``); None where it loads none (no ``--load``, no checkpoint
    there, a release or non-distributed checkpoint, ``--finetune``, ``--no-load-optim``, or one
    saved with ``--no-save-optim``). Reads the same files on every rank (``read_metadata`` is
    collective)."""
    import os

    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import (get_checkpoint_name, get_checkpoint_tracker_filename,
                                                 read_metadata)

    if args.load is None or args.finetune or args.no_load_optim:
        return None
    iteration, release = -1, False
    tracker = get_checkpoint_tracker_filename(args.load)
    if os.path.isfile(tracker):
        iteration, release = read_metadata(tracker)
    if getattr(args, "ckpt_step", None):
        iteration = args.ckpt_step
    if iteration == -1 or release:
        return None
    directory = get_checkpoint_name(args.load, iteration, release, return_base_dir=True)
    if not dist_checkpointing.check_is_distributed_checkpoint(directory):
        return None
    common = dist_checkpointing.load_common_state_dict(directory)
    if getattr(common.get("args"), "no_save_optim", False):
        return None
    from megatron_patches.sharded_state import METADATA_KEY

    return directory, (dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or {}).get(METADATA_KEY)


def _check_checkpointing(args, lowcomm) -> None:
    """Refuse, on every rank alike and before anything is built, checkpoint settings that would
    lose or misread the method's state (a ConfigError naming the flags)."""
    from ds_lowcomm.settings import ConfigError
    from megatron_patches.sharded_state import problem_with

    method = lowcomm.method if lowcomm is not None else None
    if method is not None:
        if (args.save is not None or args.load is not None) and args.ckpt_format != "torch_dist":
            raise ConfigError(
                f"--lowcomm-method {method} with --save/--load needs --ckpt-format torch_dist (Megatron-LM's default), "
                f"not {args.ckpt_format}: Megatron-LM's other formats save the optimizer state of data-parallel rank 0 "
                "only (or do not ask the optimizer for its sharded state), so every replica's own method state "
                "(DeMo's momenta, an outer loop's inner optimizer) would be lost")
        unsupported = [flag for flag, on in (("--ckpt-assume-constant-structure", args.ckpt_assume_constant_structure),
                                             ("--async-save", args.async_save)) if on]
        if unsupported:
            raise ConfigError(f"--lowcomm-method {method} does not support {' and '.join(unsupported)} "
                              "(not tried with ds_lowcomm's checkpoint state): drop it")
    saved = _saved_lowcomm_state(args)
    if saved is not None:
        problem = problem_with(saved[1], method)
        if problem:
            raise ConfigError(f"--load {args.load} ({saved[0]}): {problem}")


def main() -> None:
    checkout = _take_checkout(sys.argv)
    import torch

    sys.path.insert(0, checkout)  # before anything imports megatron: the checkout's megatron.core, not site-packages
    if not torch.cuda.is_available():
        from megatron_patches import cpu_shim

        cpu_shim.install()  # before megatron (it imports megatron.core)

    import pretrain_gpt  # Megatron-LM's, from the checkout
    from megatron.core.enums import ModelType
    from megatron.training import get_args, training

    from megatron_patches import apply
    from megatron_patches.args import add_lowcomm_args, lowcomm_config

    build_optimizer = training.get_megatron_optimizer

    def build_optimizer_with_lowcomm(config, model_chunks, *args, **kwargs):
        # Wrapped where Megatron-LM builds it (on every rank, after its arguments are parsed and
        # before its checkpoint is loaded into it), so load_checkpoint restores the method's state
        # too (torch_dist: MegatronLowcomm.sharded_state_dict); checkpoint settings that would lose
        # or misread that state are refused here first.
        lowcomm = lowcomm_config(get_args())
        _check_checkpointing(get_args(), lowcomm)
        optimizer = build_optimizer(config, model_chunks, *args, **kwargs)
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
