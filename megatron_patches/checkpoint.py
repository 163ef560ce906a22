"""Checkpoints for a Megatron-Core model trained with ds_lowcomm: one file per rank holding the
model chunks, Megatron's optimizer and the method's state (what the object ``apply`` returned
gives in ``state_dict()``: momenta, outer-loop anchors, ledger), so a resume is exact.

Layout (Megatron-LM's names): ``DIR/iter_0000020/rank_003.pt`` and
``DIR/latest_checkpointed_iteration.txt``. Every file is written under a temporary name, flushed
to disk and renamed, with its sha256 beside it (ds_lowcomm/checkpoint_io.py); the tracker names an
iteration only after every rank's file is in place, so a crash mid-save leaves the previous
checkpoint as the latest. Files load after their digest is checked, with
``torch.load(weights_only=True)`` (no code runs from a checkpoint), and carry the layout they were
written with (TP, PP, DP sizes) and the ds_lowcomm method (None: stock Megatron), checked at load.
Every rank's verdict on its own file (digest, data only, layout, method) is agreed before any rank
loads a tensor: one bad file stops every rank, before the first iteration.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from ds_lowcomm.checkpoint_io import (CheckpointError, agree_on_problems, check_digests, load_file, params_digest,
                                      save_file, write_text)

from .wrapper import MegatronLowcomm

TRACKER = "latest_checkpointed_iteration.txt"


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "world": dist.get_world_size()}


def rank_file(directory: str | os.PathLike, iteration: int, rank: int | None = None) -> Path:
    rank = dist.get_rank() if rank is None else rank
    return Path(directory) / f"iter_{iteration:07d}" / f"rank_{rank:03d}.pt"


def save(directory: str | os.PathLike, iteration: int, model_chunks: Sequence[torch.nn.Module], optimizer) -> None:
    """Every rank writes its file; then rank 0 moves the tracker to ``iteration``. Collective."""
    path = rank_file(directory, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"iteration": iteration, "layout": _layout(), "lowcomm_method": _method_of(optimizer),
             "model": [c.state_dict() for c in model_chunks],
             "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()}
    save_file(state, path)
    dist.barrier()  # every rank's file is complete before the tracker names it
    if dist.get_rank() == 0:
        write_text(Path(directory) / TRACKER, f"{iteration}\n")
    dist.barrier()


def latest_iteration(directory: str | os.PathLike) -> int:
    tracker = Path(directory) / TRACKER
    try:
        return int(tracker.read_text().strip())
    except FileNotFoundError:
        raise FileNotFoundError(f"--load {directory}: no {TRACKER} (no complete checkpoint there)") from None


def _method_of(optimizer) -> str | None:
    """The ds_lowcomm method around Megatron's optimizer, None for stock Megatron's."""
    return optimizer.method if isinstance(optimizer, MegatronLowcomm) else None


def _mismatches(path: Path, state: dict, optimizer) -> list[str]:
    """What in a loaded file does not fit this run: the parallel layout, the ds_lowcomm method
    (files from before the method was recorded: not checked here, their state is)."""
    problems = []
    if state["layout"] != _layout():
        problems.append(f"{path} was written with layout {state['layout']}; this run has {_layout()}")
    if "lowcomm_method" in state and state["lowcomm_method"] != _method_of(optimizer):
        saved, now = state["lowcomm_method"], _method_of(optimizer)
        if now is None:
            problems.append(f"{path} holds ds_lowcomm's {saved} state; this run has no --lowcomm-* flags: resume "
                            f"with the flags it was saved with (--lowcomm-method {saved} and the same settings, or "
                            "the same --lowcomm-config FILE)")
        elif saved is None:
            problems.append(f"{path} was saved by stock Megatron (no ds_lowcomm method); this run has "
                            f"--lowcomm-method {now}: resume it without the --lowcomm-* flags, or start without --load")
        else:
            problems.append(f"{path} was saved with --lowcomm-method {saved}; this run has --lowcomm-method {now}")
    return problems


def load(directory: str | os.PathLike, model_chunks: Sequence[torch.nn.Module], optimizer) -> int:
    """Load this rank's part of the latest checkpoint; returns the iteration to resume at.
    Collective: raises on every rank if any rank's file is bad or does not fit this run."""
    iteration = latest_iteration(directory)
    path = rank_file(directory, iteration)
    problems, state = check_digests([path]), None
    if not problems:
        try:
            state = load_file(path, map_location="cpu", digest="checked")
        except CheckpointError as err:  # objects other than data: refused here, and so everywhere
            problems = [str(err)]
        else:
            problems = _mismatches(path, state, optimizer)
    agree_on_problems(problems)  # every rank stops if any rank's file is bad
    for chunk, sd in zip(model_chunks, state["model"]):
        chunk.load_state_dict(sd)
    # Megatron's mixed-precision optimizer restores its fp32 main params from its own state
    # (so no reload_model_params, which would round them through the bf16 model params).
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["iteration"])


__all__ = ["save", "load", "latest_iteration", "params_digest", "rank_file", "TRACKER"]
