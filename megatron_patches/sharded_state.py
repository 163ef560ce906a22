"""The method's state in Megatron's distributed checkpoints (``torch_dist``, Megatron-LM's
default format): what :meth:`MegatronLowcomm.sharded_state_dict` returns and
:meth:`MegatronLowcomm.load_state_dict` takes back.

What goes in, from every rank (every data-parallel replica included: DeMo's momenta, an outer
loop's inner Adam and the parameters between syncs differ by replica): the wrapper's whole
``state_dict()`` (Megatron's optimizer state, the method's anchors, momenta, residuals, counters,
ledger) and the parameters its optimizer steps (fp32 main copies under mixed precision). Every
tensor becomes one ``ShardedTensor`` (flattened, under a key naming the rank), so each rank writes
its own and nothing is deduplicated across replicas; Megatron's own optimizer state is not asked
for (it is inside ours, per rank).

Method state is created lazily (Adam's moments, DeMo's momenta, the ledger's per-step counts), so
a fresh run cannot know the shapes of what it is about to load. Those, and every value that is no
tensor (counters, settings, ledger totals), are written into the checkpoint's *content metadata*
(the ``metadata`` dict Megatron-LM passes to ``sharded_state_dict`` and saves with
``dist_checkpointing.save(..., content_metadata=)``, and gives back when loading), gathered from
every rank under ``"ds_lowcomm"``. Loading builds the request from it. The metadata is plain
data (it goes into the checkpoint's ``common.pt``, loaded by torch with ``weights_only``), and no
``ShardedObject`` is used: PyTorch's distributed checkpoint unpickles those (``weights_only=False``).

A checkpoint is bound to the layout it was written with (world, TP, PP, DP sizes) and to the
method: a different one is refused, on every rank alike (the metadata is the same everywhere),
before any tensor is read.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import internals as mi

METADATA_KEY = "ds_lowcomm"
TENSORS_KEY = "ds_lowcomm_tensors"  # the key of the sharded part in what sharded_state_dict returns
FORMAT = 1
_TENSOR = "__ds_lowcomm_tensor__"  # marks a tensor's place in the skeleton


class ShardedStateError(RuntimeError):
    """A distributed checkpoint that cannot resume this run (raised alike on every rank)."""


def layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "world": dist.get_world_size()}


def split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with every tensor replaced by ``{_TENSOR: index}`` (appended to ``tensors``);
    anything but tensors, containers and plain scalars is refused."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {_TENSOR: len(tensors) - 1}
    if isinstance(obj, dict):
        return {k: split(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(split(v, tensors) for v in obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"a {type(obj).__name__} in the method's state cannot go into a distributed checkpoint")


def join(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`split`."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR}:
            return tensors[skeleton[_TENSOR]]
        return {k: join(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(join(v, tensors) for v in skeleton)
    return skeleton


def _key(rank: int, index: int) -> str:
    return f"ds_lowcomm.rank_{rank:05d}.{index}"


_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
                                torch.int16, torch.int8, torch.uint8, torch.bool)}


def _dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise ShardedStateError(f"the checkpoint's ds_lowcomm metadata names an unknown dtype {name!r}")
    return dtype


def for_saving(state: dict, method: str, metadata: dict | None) -> dict:
    """``state`` (plain data and tensors) as ShardedTensors keyed by this rank, its skeleton and
    shapes gathered from every rank into ``metadata["ds_lowcomm"]``. Collective (the default group)."""
    if not isinstance(metadata, dict):
        raise ShardedStateError(
            "ds_lowcomm saves the method's non-tensor state and shapes in the checkpoint's content metadata: "
            "call sharded_state_dict(model_sd, metadata=md) with a dict md and pass the same dict to "
            "dist_checkpointing.save(..., content_metadata=md), as Megatron-LM's save_checkpoint does")
    sharded_tensor = mi.live(mi.SHARDED_TENSOR)
    rank = dist.get_rank()
    tensors: list[torch.Tensor] = []
    skeleton = split(state, tensors)
    specs = [(list(t.shape), str(t.dtype)) for t in tensors]
    sharded = {str(i): sharded_tensor.from_rank_offsets(_key(rank, i), t.detach().reshape(-1), replica_id=0)
               for i, t in enumerate(tensors) if t.numel()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"skeleton": skeleton, "specs": specs})
    metadata[METADATA_KEY] = {"format": FORMAT, "method": method, "layout": layout(), "ranks": everyone}
    return {TENSORS_KEY: sharded}


def for_loading(method: str | None, metadata: dict | None) -> tuple[dict, dict]:
    """What to ask ``dist_checkpointing.load`` for (this rank's tensors, shaped as saved) and this
    rank's entry of the metadata (to :func:`rebuild` the state from what comes back). Refuses a
    checkpoint without ds_lowcomm's metadata, or of another layout or method."""
    saved = (metadata or {}).get(METADATA_KEY)
    problem = problem_with(saved, method)
    if problem:
        raise ShardedStateError(problem)
    sharded_tensor = mi.live(mi.SHARDED_TENSOR)
    rank = dist.get_rank()
    mine = saved["ranks"][rank]
    request = {}
    for i, (shape, dtype) in enumerate(mine["specs"]):
        numel = int(torch.Size(shape).numel())
        if numel:
            request[str(i)] = sharded_tensor.from_rank_offsets(_key(rank, i), torch.empty(numel, dtype=_dtype(dtype)),
                                                               replica_id=0)
    return {TENSORS_KEY: request}, mine


def method_problem(saved: str | None, method: str | None) -> str | None:
    """Why a checkpoint saved with ds_lowcomm's ``saved`` method (None: stock Megatron) cannot
    resume a run with ``method`` (None: no ``--lowcomm-*`` flags): words following the
    checkpoint's name; None where they match."""
    if saved == method:
        return None
    if method is None:
        return (f"holds ds_lowcomm's {saved} state; this run has no --lowcomm-* flags: resume with the flags it was "
                f"saved with (--lowcomm-method {saved} and the same settings, or the same --lowcomm-config FILE)")
    if saved is None:
        return (f"holds no ds_lowcomm state (saved by stock Megatron); this run has --lowcomm-method {method}: "
                "resume it without the --lowcomm-* flags, or start without --load")
    return f"was saved with --lowcomm-method {saved}; this run has --lowcomm-method {method}"


def problem_with(saved: dict | None, method: str | None) -> str | None:
    """Why a checkpoint whose content metadata holds ``saved`` (None: none of ds_lowcomm's) cannot
    resume a run with ``method`` (None: stock Megatron); None where it can."""
    why = method_problem(None if saved is None else saved.get("method"), method)
    if why or saved is None:
        return why and f"the checkpoint {why}"
    if saved.get("format") != FORMAT:
        return f"the checkpoint's ds_lowcomm state has format {saved.get('format')!r}; this ds_lowcomm reads {FORMAT}"
    if saved["layout"] != layout():
        return (f"the checkpoint's ds_lowcomm state was written with layout {saved['layout']}; this run has "
                f"{layout()} (the method's state is per rank: resume with the same sizes)")
    return None


def rebuild(loaded: dict, mine: dict) -> Any:
    """The state :func:`for_saving` was given, from what ``dist_checkpointing.load`` returned."""
    flat = loaded[TENSORS_KEY]
    tensors = []
    for i, (shape, dtype) in enumerate(mine["specs"]):
        t = flat.get(str(i))
        tensors.append(torch.empty(shape, dtype=_dtype(dtype)) if t is None else t.reshape(shape))
    return join(mine["skeleton"], tensors)


def is_sharded(state: Any) -> bool:
    return isinstance(state, dict) and TENSORS_KEY in state


__all__ = ["METADATA_KEY", "ShardedStateError", "for_loading", "for_saving", "is_sharded", "layout", "method_problem",
           "problem_with",
           "rebuild"]
