"""Checkpoints for a Megatron-Core model trained with ds_lowcomm, in either of Megatron-LM's
formats (``--ckpt-format``), so a resume is exact:

- ``torch``: one file per rank holding the model chunks, Megatron's optimizer and the method's
  state (what the object ``apply`` returned gives in ``state_dict()``: momenta, outer-loop
  anchors, ledger) and the RNG states (the CPU generator's and Megatron's RNG tracker's streams,
  which dropout draws from). :func:`save` / :func:`load`.
- ``torch_dist`` (Megatron-LM's default): Megatron-Core's ``dist_checkpointing`` with the
  model's and the optimizer's ``sharded_state_dict`` as Megatron-LM's ``save_checkpoint`` builds
  it (each parameter's state sharded as the parameter, so it reshards to another TP / PP / DP:
  megatron_patches/sharded_state.py), the RNG states per rank (loaded at the same layout only, as
  Megatron-LM does), and a sha256 sidecar for every file. :func:`save_dist` / :func:`load_dist`. Its loader is
  PyTorch's distributed checkpoint, which unpickles the ``.metadata`` file: before it does, every
  rank checks the digests and reads ``.metadata`` with an unpickler that admits only PyTorch's
  checkpoint metadata classes, torch sizes and dtypes (:func:`dcp_metadata_problem`). Only
  tensors are asked for (``common.pt`` is torch's ``weights_only`` load), so nothing else a
  checkpoint might hold is unpickled.

Layout (Megatron-LM's names): ``DIR/iter_0000020/rank_003.pt`` (``torch``) or
``DIR/iter_0000020/__3_0.distcp`` ... (``torch_dist``) and ``DIR/latest_checkpointed_iteration.txt``. Every file is written under a temporary name, flushed
to disk and renamed, with its sha256 beside it (ds_lowcomm/checkpoint_io.py); the tracker names an
iteration only after every rank's file is in place, so a crash mid-save leaves the previous
checkpoint as the latest. Files load after their digest is checked, with
``torch.load(weights_only=True)`` (no code runs from a checkpoint), and carry the layout they were
written with (TP, PP, DP sizes) and the ds_lowcomm method (None: stock Megatron), checked at load
(``torch``: the same layout; ``torch_dist``: what sharded_state.problem_with allows).
Every rank's verdict on its own file (digest, data only, layout, method) is agreed before any rank
loads a tensor: one bad file stops every rank, before the first iteration.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from ds_lowcomm.checkpoint_io import (CheckpointError, agree_on_problems, check_digests, load_file,
                                      params_digest, save_file, write_digest, write_text)

from . import internals as mi
from . import sharded_state
from .wrapper import MegatronLowcomm

TRACKER = "latest_checkpointed_iteration.txt"


FORMATS = ("torch_dist", "torch")  # Megatron-LM's --ckpt-format values this module writes
_layout = sharded_state.layout


def rng_states() -> dict:
    """This rank's RNG: the CPU generator's state and Megatron's RNG tracker's streams (on a GPU,
    the CUDA generator's too)."""
    states = {"cpu": torch.get_rng_state(), "tracker": dict(mi.live(mi.RNG_TRACKER)().get_states())}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])
    mi.live(mi.RNG_TRACKER)().set_states(dict(states["tracker"]))


def rank_file(directory: str | os.PathLike, iteration: int, rank: int | None = None) -> Path:
    rank = dist.get_rank() if rank is None else rank
    return Path(directory) / f"iter_{iteration:07d}" / f"rank_{rank:03d}.pt"


def save(directory: str | os.PathLike, iteration: int, model_chunks: Sequence[torch.nn.Module], optimizer) -> None:
    """Every rank writes its file; then rank 0 moves the tracker to ``iteration``. Collective."""
    path = rank_file(directory, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"iteration": iteration, "layout": _layout(), "lowcomm_method": _method_of(optimizer),
             "model": [c.state_dict() for c in model_chunks],
             "optimizer": optimizer.state_dict(), "rng": rng_states()}
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
    why = sharded_state.method_problem(state["lowcomm_method"], _method_of(optimizer)) if "lowcomm_method" in state else None
    if why:
        problems.append(f"{path} {why}")
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
    rng = state["rng"]
    set_rng_states(rng if isinstance(rng, dict) else {"cpu": rng, "tracker": {}})  # files from before the tracker's
    return int(state["iteration"])


def iteration_dir(directory: str | os.PathLike, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:07d}"


def _rng_sharded() -> dict:
    """This rank's RNG states as ShardedTensors under keys naming the rank (the loaded ones come
    back under the same names: :func:`_rng_from_sharded`)."""
    sharded_tensor, rank = mi.live(mi.SHARDED_TENSOR), dist.get_rank()
    states = rng_states()
    flat = {"cpu": states["cpu"], **{f"tracker.{k}": v for k, v in states["tracker"].items()}}
    if "cuda" in states:
        flat["cuda"] = states["cuda"]
    return {name: sharded_tensor.from_rank_offsets(f"rng.rank_{rank:05d}.{name}", t.clone(), replica_id=0)
            for name, t in flat.items()}


def _rng_from_sharded(flat: dict) -> dict:
    """:func:`rng_states`' layout from what :func:`_rng_sharded`'s request loaded."""
    states = {"cpu": flat["cpu"], "tracker": {k.removeprefix("tracker."): v for k, v in flat.items()
                                              if k.startswith("tracker.")}}
    if "cuda" in flat:
        states["cuda"] = flat["cuda"]
    return states


def _unwrapped(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside Megatron's DDP and Float16Module wrappers (as Megatron-LM's unwrap_model)."""
    wrappers = (mi.live(mi.DDP), mi.live(mi.FLOAT16_MODULE))
    while isinstance(chunk, wrappers):
        chunk = chunk.module
    return chunk


def _model_keys(model_chunks: Sequence[torch.nn.Module]) -> list[str]:
    """Megatron-LM's names: ``model`` (one chunk) or ``model0``, ``model1``, ..."""
    return ["model"] if len(model_chunks) == 1 else [f"model{i}" for i in range(len(model_chunks))]


def _model_sharded(model_chunks: Sequence[torch.nn.Module]) -> dict:
    return {key: _unwrapped(chunk).sharded_state_dict() for key, chunk in zip(_model_keys(model_chunks), model_chunks)}


def save_dist(directory: str | os.PathLike, iteration: int, model_chunks: Sequence[torch.nn.Module], optimizer) -> None:
    """A ``torch_dist`` checkpoint, as Megatron-LM's ``save_checkpoint`` writes it (model and
    optimizer through their ``sharded_state_dict``, content metadata), plus the RNG states per
    rank and a digest beside every file; the tracker moves last. Collective."""
    path = iteration_dir(directory, iteration)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    metadata: dict = {"layout": _layout()}  # the content metadata (ds_lowcomm's method state adds its part)
    state = _model_sharded(model_chunks)
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
    state["rng_state"] = _rng_sharded()
    state["iteration"] = iteration
    mi.live(mi.DIST_SAVE)(state, str(path), content_metadata=metadata)
    dist.barrier()  # every file is written
    for f in _dist_files(path, dist.get_rank()):
        write_digest(f)
    dist.barrier()
    if dist.get_rank() == 0:
        write_text(Path(directory) / TRACKER, f"{iteration}\n")
    dist.barrier()


_SHARED_FILES = (".metadata", "common.pt", "metadata.json")  # what dist_checkpointing's rank 0 writes; all read


def _dist_files(path: Path, rank: int) -> list[Path]:
    """The files of a torch_dist checkpoint one rank vouches for: those it wrote (``__RANK_*``)
    and, on rank 0, the shared ones."""
    mine = sorted(path.glob(f"__{rank}_*.distcp"))
    return mine + [path / name for name in _SHARED_FILES] if rank == 0 else mine


_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                "torch.distributed.checkpoint.filesystem")
_DCP_FUNCTIONS = {("torch.serialization", "_get_layout")}  # maps a layout's name to torch's layout object


class _MetadataUnpickler(pickle.Unpickler):
    """Admits PyTorch's checkpoint metadata classes (dataclasses and enums), ``torch.Size`` and
    torch dtypes, nothing else: no function or class outside them can be called while loading."""

    def find_class(self, module: str, name: str):
        import importlib

        if module in _DCP_MODULES:
            obj = vars(importlib.import_module(module)).get(name)
            if isinstance(obj, type):
                return obj
        elif (module, name) in _DCP_FUNCTIONS:
            return vars(importlib.import_module(module))[name]
        elif module == "torch":
            obj = vars(torch).get(name)
            if obj is torch.Size or isinstance(obj, torch.dtype):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")


def dcp_metadata_problem(path: Path) -> str | None:
    """Why a distributed checkpoint's ``.metadata`` file holds more than metadata, or None."""
    try:
        with open(path, "rb") as f:
            _MetadataUnpickler(f).load()
    except Exception as err:  # noqa: BLE001  (any failure to read it as metadata is the answer)
        return (f"{path} holds objects other than checkpoint metadata and is not loaded (no code runs from a "
                f"checkpoint): {err}")
    return None


def load_dist(directory: str | os.PathLike, model_chunks: Sequence[torch.nn.Module], optimizer) -> int:
    """Load the latest ``torch_dist`` checkpoint; returns the iteration to resume at. Every
    rank checks the digests of the shared files and of its own, and the method and layout the
    checkpoint holds; one collective decision, before anything is unpickled or loaded."""
    iteration = latest_iteration(directory)
    path = iteration_dir(directory, iteration)
    if not path.is_dir() or not any(path.glob("*.distcp")):
        problems = [f"{path}: no torch_dist checkpoint there (saved with --ckpt-format torch? then load with it)"]
    else:  # the files every rank reads, and its own
        shared = [path / name for name in _SHARED_FILES]
        problems = check_digests(shared + [f for f in _dist_files(path, dist.get_rank()) if f not in shared])
        if not problems:
            problems = [why for why in [dcp_metadata_problem(path / ".metadata")] if why]
    metadata = None
    if not problems:
        metadata = mi.live(mi.DIST_CONTENT_METADATA)(str(path)) or {}
        why = sharded_state.problem_with(metadata.get(sharded_state.METADATA_KEY), _method_of(optimizer))
        if why:
            problems.append(f"{path}: {why}")
    agree_on_problems(problems)
    saved_layout = metadata.get("layout", _layout())
    request = _model_sharded(model_chunks)
    request["optimizer"] = optimizer.sharded_state_dict(request, is_loading=True, metadata=metadata)
    same_layout = saved_layout == _layout()
    if same_layout:  # as Megatron-LM: the RNG states are per rank, ignored at another layout
        request["rng_state"] = _rng_sharded()
    loaded = mi.live(mi.DIST_LOAD)(request, str(path))
    for key, chunk in zip(_model_keys(model_chunks), model_chunks):
        _unwrapped(chunk).load_state_dict(loaded[key])
    optimizer.load_state_dict(loaded["optimizer"])
    if same_layout:
        set_rng_states(_rng_from_sharded(loaded["rng_state"]))
    elif dist.get_rank() == 0:
        print(f"{path}: resharded from layout {saved_layout} to {_layout()}; the RNG states (per rank) are not loaded",
              flush=True)
    return int(loaded.get("iteration", iteration))


__all__ = ["FORMATS", "TRACKER", "dcp_metadata_problem", "latest_iteration", "load", "load_dist", "params_digest",
           "rank_file", "rng_states", "save", "save_dist", "set_rng_states"]
