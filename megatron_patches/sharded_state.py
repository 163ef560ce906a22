"""The method's state in Megatron's distributed checkpoints (``torch_dist``, Megatron-LM's
default format): what :meth:`MegatronLowcomm.sharded_state_dict` returns and
:meth:`MegatronLowcomm.load_state_dict` takes back. It reshards, as Megatron's own optimizer
state does.

**State of a parameter follows the parameter.** Every tensor of the method's state that belongs
to one parameter and has its shape (Megatron's Adam moments, the fp32 main copy, an outer loop's
anchor and outer momentum, DeMo's momentum, a residual, MT-DAO's moments...) becomes a
``ShardedTensor`` built from that parameter's own (``make_sharded_optimizer_tensor``, what
Megatron's optimizers use: the parameter's key, global shape, offsets and axis fragmentation),
under ``ds_lowcomm.<holder>.<state>.<the parameter's key>``. So a checkpoint saved at one tensor-
and pipeline-parallel layout loads at another: each rank reads its new shard of the global tensor.

**Replicas.** Whether such a tensor is equal on every data-parallel replica is checked when it is
saved (a digest of its bytes, compared across the data-parallel group; all shards of a key
decide together):

- equal (stock Megatron's and adamw's whole state, DeMo's parameters, an outer loop's anchors
  and outer momentum, the parameters right after a sync, MT-DAO's state right after its sync):
  saved once, with the parameter's ``replica_id``, and followed by any new layout, replica
  count included;
- different (each replica's own: DeMo's momenta, DCT-DiLoCo's and SparseLoCo's residuals,
  MT-DAO's unsent changes and moments between syncs, the parameters between two syncs, the inner
  Adam of diloco, dct_diloco and sparseloco): saved once per replica, under
  ``...<state>.replica_<d>.<key>``. It follows a new tensor/pipeline layout with the same number
  of replicas. With another number of replicas the load is refused, naming the method and the
  state, except for the outer methods' inner optimizer state (Megatron's Adam moments), which is
  not error feedback: every new replica starts from the mean of the saved replicas' (what one
  replica training on all their data would hold as its first moment).

Everything else (counters, settings, the ledger, param-group settings, small tensors) is plain
data in the checkpoint's *content metadata* (the ``metadata`` dict Megatron-LM passes to
``sharded_state_dict`` and saves with ``dist_checkpointing.save(..., content_metadata=)``), gathered
from every rank under ``"ds_lowcomm"``; a rank's own non-parameter tensors (the ledger's per-step
counts) are ShardedTensors under keys naming the rank. At another layout each rank takes those
from the saved rank of its own number (rank 0 where the saved run had fewer). Per-parameter
counters (an outer loop's step counts, Adam's step) follow their parameter. Method state is made
lazily (at the first step), so a fresh run learns from the metadata which states each parameter
has, their dtypes and whether they are per replica. The metadata is plain data (torch loads
``common.pt`` with ``weights_only``); no ``ShardedObject`` is used (PyTorch's distributed
checkpoint unpickles those).

Checkpoints of the first format (every tensor flattened under a key naming the rank) still load,
at the layout they were written with; at another one they are refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import internals as mi

METADATA_KEY = "ds_lowcomm"
TENSORS_KEY = "ds_lowcomm_tensors"  # the key of the sharded part in what sharded_state_dict returns
FORMAT = 2
READS = (1, 2)  # the formats this ds_lowcomm loads (1: per rank, same layout only)
_TENSOR = "__ds_lowcomm_tensor__"  # marks a rank's own tensor's place in the skeleton
_PARAM = "__ds_lowcomm_param__"  # marks a stepped parameter's place (the run's own takes it)
_PER_PARAM = "__ds_lowcomm_per_param__"  # a torch optimizer's per-parameter "state", kept by parameter key
_PREFIX = "ds_lowcomm"
# Holders whose per-replica state every new replica may take as the replicas' mean (outer methods
# only): the inner optimizers inside Megatron's (Adam's moments), not error feedback.
_INNER = "inner"


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


_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
                                torch.int16, torch.int8, torch.uint8, torch.bool)}


def _dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise ShardedStateError(f"the checkpoint's ds_lowcomm metadata names an unknown dtype {name!r}")
    return dtype


def _rank_key(rank: int, index: int) -> str:
    return f"{_PREFIX}.rank_{rank:05d}.{index}"


# --- The parameters' shards ----------------------------------------------------------------------
class Holder:
    """A torch optimizer whose per-parameter ``state`` goes into checkpoints by parameter:
    ``label`` names it in keys (``inner0``: the one inside Megatron's first optimizer, ``outer``,
    ``demo``), ``params`` its parameters in torch's state_dict order."""

    def __init__(self, label: str, optimizer):
        self.label, self.optimizer = label, optimizer

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]


def sharded_params(model_sharded_state_dict, model_of: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """``shard_of(p)``: the model's ShardedTensor (or factory) of ``p`` (a model parameter, or a
    main copy that ``model_of`` maps to its model parameter), from the model's sharded state
    dict (its tensors hold the parameters themselves, as Megatron's optimizers rely on)."""
    kinds = (mi.live(mi.SHARDED_TENSOR), mi.live(mi.SHARDED_TENSOR_FACTORY))
    by_id: dict[int, Any] = {}

    def walk(node):
        if isinstance(node, kinds):
            by_id.setdefault(id(node.data), node)
        elif isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, (list, tuple)):
            for v in node:
                walk(v)

    walk(model_sharded_state_dict or {})

    def shard_of(p: torch.Tensor):
        sh = by_id.get(id(model_of(p)))
        if sh is None:
            raise ShardedStateError(f"a parameter of shape {tuple(p.shape)} that the optimizer steps is not in the "
                                    "model's sharded_state_dict: pass the model's sharded state dict (as Megatron-LM's "
                                    "save_checkpoint and load_checkpoint do)")
        return sh
    return shard_of


def _local_shape(sh) -> tuple[int, ...]:
    return tuple(sh.data.shape) if isinstance(sh, mi.live(mi.SHARDED_TENSOR_FACTORY)) else tuple(sh.local_shape)


def _param_id(sh) -> str:
    """One parameter, whatever the layout: its key, and where it sits on the axes Megatron
    prepends (a transformer block's layers are one key, stacked along the global layer number)."""
    if isinstance(sh, mi.live(mi.SHARDED_TENSOR_FACTORY)) or not sh.prepend_axis_num:
        return sh.key
    return f"{sh.key}@{tuple(sh.global_offset[:sh.prepend_axis_num])}"


def _shard_name(sh) -> str:
    """One shard of a parameter (key, where it starts, which non-data-parallel copy it is)."""
    offset = () if isinstance(sh, mi.live(mi.SHARDED_TENSOR_FACTORY)) else tuple(sh.global_offset)
    rid = sh.replica_id
    rid = tuple(rid[:-1]) if isinstance(rid, tuple) else rid
    return f"{sh.key}@{offset}@{rid}"


def _state_tensor(sh, tensor: torch.Tensor, holder: str, name: str, replica: int | None):
    """``tensor`` (the state ``name`` of holder ``holder`` for the parameter ``sh`` shards)
    sharded as the parameter is; ``replica``: saved per data-parallel replica (its own key, and
    the main copy of it in every replica)."""
    prefix = f"{_PREFIX}.{holder}.{name}" + ("" if replica is None else f".replica_{replica}")
    out = mi.live(mi.MAKE_SHARDED_OPTIMIZER_TENSOR)(sh, tensor, prefix=prefix)
    if replica is not None:
        rid = out.replica_id
        out = dataclasses.replace(out, replica_id=(*rid[:-1], 0) if isinstance(rid, tuple) else 0)
    return out


def _digest(t: torch.Tensor) -> str:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:32]


def _encode(value: Any) -> Any:
    """Plain data for the metadata (a small tensor as its values and dtype)."""
    if isinstance(value, torch.Tensor):
        return {_TENSOR: value.detach().cpu().tolist(), "dtype": str(value.dtype), "shape": list(value.shape)}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {_TENSOR, "dtype", "shape"}:
        return torch.tensor(value[_TENSOR], dtype=_dtype(value["dtype"])).reshape(value["shape"])
    return value


def _is_torch_state(node: Any) -> bool:
    return (isinstance(node, dict) and isinstance(node.get("state"), dict)
            and isinstance(node.get("param_groups"), list)
            and all(isinstance(k, int) for k in node["state"]))


class _Saver:
    """One rank's state, split into parameter shards (ShardedTensors), its own tensors, and plain
    data (the skeleton)."""

    def __init__(self, holders: list[Holder], stepped: list[torch.Tensor], shard_of):
        self.shard_of = shard_of
        self.owner: dict[int, str] = {}  # id(state tensor) -> holder label
        for h in holders:
            for p in h.params:
                for v in (h.optimizer.state[p].values() if p in h.optimizer.state else ()):
                    if isinstance(v, torch.Tensor):
                        self.owner[id(v)] = h.label
        self.order = {h.label: h.params for h in holders}
        self.stepped = {id(p): p for p in stepped}
        # (holder, state, shard, tensor): the parameters' shards; plain per-parameter values
        self.shards: list[tuple[str, str, Any, torch.Tensor]] = []
        self.plain: dict[str, dict[str, dict[str, Any]]] = {}  # holder -> parameter key -> state -> value
        self.tensors: list[torch.Tensor] = []  # this rank's own (not per parameter)
        self.layout_bound: list[str] = []
        self.saved_params: set[int] = set()

    def skeleton(self, node: Any, path: str = "") -> Any:
        if isinstance(node, torch.Tensor):
            if id(node) in self.stepped:
                p = self.stepped[id(node)]
                if id(p) not in self.saved_params:
                    self.saved_params.add(id(p))
                    sh = self.shard_of(p)
                    self.shards.append(("params", "param", sh, p))
                    self.plain.setdefault("params", {})[_param_id(sh)] = {"param": {"shard": str(p.dtype)}}
                return {_PARAM: True}
            self.tensors.append(node)
            return {_TENSOR: len(self.tensors) - 1}
        if _is_torch_state(node):
            label = next((self.owner[id(v)] for entry in node["state"].values() for v in entry.values()
                          if isinstance(v, torch.Tensor) and id(v) in self.owner), None)
            if label is None and node["state"]:
                self.layout_bound.append(path or "the optimizer state")
            if label is not None:
                order = self.order[label]
                for index, entry in node["state"].items():
                    p = order[index]
                    sh = self.shard_of(p)
                    plain = self.plain.setdefault(label, {}).setdefault(_param_id(sh), {})
                    for name, value in entry.items():
                        if isinstance(value, torch.Tensor) and tuple(value.shape) == _local_shape(sh):
                            self.shards.append((label, name, sh, value))
                            plain[name] = {"shard": str(value.dtype)}
                        else:
                            plain[name] = {"value": _encode(value)}
                return {k: ({_PER_PARAM: label} if k == "state" else self.skeleton(v, f"{path}.{k}"))
                        for k, v in node.items()}
        if isinstance(node, dict):
            return {k: self.skeleton(v, f"{path}.{k}") for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(self.skeleton(v, f"{path}.{i}") for i, v in enumerate(node))
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise TypeError(f"a {type(node).__name__} in the method's state cannot go into a distributed checkpoint")


def _state_id(holder: str, name: str, key: str) -> str:
    return f"{holder}|{name}|{key}"


def for_saving(state: dict, stepped: list[torch.Tensor], holders: list[Holder], shard_of, method: str,
               metadata: dict | None) -> dict:
    """``state`` (the wrapper's ``state_dict()``; ``stepped``: the parameters its optimizer
    steps) as ShardedTensors, each parameter's state sharded as the parameter; its plain data and
    the states' kinds gathered from every rank into ``metadata["ds_lowcomm"]``. Collective."""
    if not isinstance(metadata, dict):
        raise ShardedStateError(
            "ds_lowcomm saves the method's non-tensor state and shapes in the checkpoint's content metadata: "
            "call sharded_state_dict(model_sd, metadata=md) with a dict md and pass the same dict to "
            "dist_checkpointing.save(..., content_metadata=md), as Megatron-LM's save_checkpoint does")
    from megatron.core import parallel_state as ps

    saver = _Saver(holders, stepped, shard_of)
    skeleton = {"state": saver.skeleton(state), "params": {_PARAM: True}}
    for p in stepped:  # parameters no state_dict names (fp32 optimizers hold the model's own)
        saver.skeleton(p)
    digests = {f"{holder}|{name}|{_shard_name(sh)}": _digest(t) for holder, name, sh, t in saver.shards}
    rank, dp = dist.get_rank(), ps.get_data_parallel_rank()
    mine = {"skeleton": skeleton, "specs": [(list(t.shape), str(t.dtype)) for t in saver.tensors],
            "plain": saver.plain, "layout_bound": saver.layout_bound, "dp_rank": dp}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (mine, digests))
    # A state is per replica if any shard of it differs between two data-parallel replicas.
    seen: dict[str, str] = {}
    per_replica: set[str] = set()
    for _, their in everyone:
        for shard, digest in their.items():
            if seen.setdefault(shard, digest) != digest:
                holder, name, key = shard.split("|", 2)
                per_replica.add(_state_id(holder, name, key.split("@", 1)[0]))
    sharded = {}
    for holder, name, sh, t in saver.shards:
        replica = dp if _state_id(holder, name, sh.key) in per_replica else None
        sharded[str(len(sharded))] = _state_tensor(sh, t.detach(), holder, name, replica)  # (a key may hold
        # several of this rank's shards: the layers of a transformer block are one tensor)
    own = {str(i): mi.live(mi.SHARDED_TENSOR).from_rank_offsets(_rank_key(rank, i), t.detach().reshape(-1),
                                                                  replica_id=0)
           for i, t in enumerate(saver.tensors) if t.numel()}
    metadata[METADATA_KEY] = {"format": FORMAT, "method": method, "layout": layout(),
                              "per_replica": sorted(per_replica), "ranks": [m for m, _ in everyone]}
    return {TENSORS_KEY: {"params": sharded, "own": own}}


# --- Loading ---------------------------------------------------------------------------------------
_HOLDER_WORDS = {"params": "the parameters", "outer": "the outer loop's", "demo": "DeMo's"}


def _words(holder: str, name: str) -> str:
    if holder == "params":
        return "the parameters (saved between two syncs, where the replicas' differ)"
    where = _HOLDER_WORDS.get(holder, "the inner optimizer's" if holder.startswith(_INNER) else holder)
    return f"{where} {name}"


def _averaged(holder: str, name: str, method: str | None) -> bool:
    """Per-replica state that a new replica count takes as the replicas' mean: the outer methods'
    inner optimizer state, and their error feedback (each sync sends the replicas' mean residual,
    so every new replica holding that mean keeps what is still to be sent, whatever their number)."""
    from ds_lowcomm.optim.registry import OUTER_METHODS

    return method in OUTER_METHODS and (holder.startswith(_INNER) or (holder == "outer" and name == "residual"))


def problem_with(saved: dict | None, method: str | None) -> str | None:
    """Why a checkpoint whose content metadata holds ``saved`` (None: none of ds_lowcomm's) cannot
    resume a run with ``method`` (None: stock Megatron) at this run's layout; None where it can."""
    why = method_problem(None if saved is None else saved.get("method"), method)
    if why or saved is None:
        return why and f"the checkpoint {why}"
    if saved.get("format") not in READS:
        return f"the checkpoint's ds_lowcomm state has format {saved.get('format')!r}; this ds_lowcomm reads {READS}"
    now, then = layout(), saved["layout"]
    if then == now:
        return None
    if saved["format"] == 1:
        return (f"the checkpoint's ds_lowcomm state was written with layout {then} in ds_lowcomm's first format (the "
                f"method's state per rank); this run has {now}: resume it with the same sizes")
    bound = sorted({path for r in saved["ranks"] for path in r["layout_bound"]})
    if bound:
        return (f"the checkpoint's ds_lowcomm state has per-parameter state it could not tie to parameters "
                f"({', '.join(bound)}); it resumes only with its layout {then}, this run has {now}")
    if then["dp"] != now["dp"]:
        refused = sorted({_words(*sid.split("|")[:2]) for sid in saved["per_replica"]
                          if not _averaged(*sid.split("|")[:2], method)})
        if refused:
            return (f"the checkpoint holds {saved['method']} state that differs between its {then['dp']} data-parallel "
                    f"replicas and cannot follow a new replica count ({now['dp']}): {'; '.join(refused)}. Resume it "
                    f"with {then['dp']} replicas (any tensor/pipeline layout), or from a checkpoint saved where that "
                    "state is alike on every replica")
    differ = sorted({f"{_words(h, name)}" for h, keys in _plain_values(saved).items() for k, names in keys.items()
                     for name, values in names.items() if len(values) > 1})
    if differ:
        return (f"the checkpoint's {saved['method']} state holds per-parameter values that differ between ranks "
                f"({', '.join(differ)}); it resumes only with its layout {then}, this run has {now}")
    return None


def _plain_values(saved: dict) -> dict[str, dict[str, dict[str, list]]]:
    """holder -> parameter key -> state -> the distinct plain values the saved ranks hold."""
    out: dict[str, dict[str, dict[str, list]]] = {}
    for r in saved["ranks"]:
        for holder, keys in r["plain"].items():
            for key, names in keys.items():
                for name, entry in names.items():
                    if "value" in entry:
                        values = out.setdefault(holder, {}).setdefault(key, {}).setdefault(name, [])
                        if entry["value"] not in values:
                            values.append(entry["value"])
    return out


class LoadPlan:
    """What one rank asked ``dist_checkpointing.load`` for, and how to put the state back."""

    def __init__(self, saved: dict, source: int, requests: list, own: dict, holders: list[Holder], entries: dict):
        self.saved, self.source, self.requests, self.own, self.holders = saved, source, requests, own, holders
        self.entries = entries  # holder -> id(param) -> [(state name, value or request index)]


def for_loading(method: str | None, metadata: dict | None, holders: list[Holder], stepped: list[torch.Tensor],
                shard_of) -> tuple[dict, Any]:
    """What to ask ``dist_checkpointing.load`` for (this rank's shards of every state the saved
    run had for its parameters, shaped as now) and the plan to rebuild the state from it. Refuses
    a checkpoint without ds_lowcomm's metadata, of another method, or one whose state cannot
    follow this run's layout (:func:`problem_with`)."""
    saved = (metadata or {}).get(METADATA_KEY)
    problem = problem_with(saved, method)
    if problem:
        raise ShardedStateError(problem)
    if saved["format"] == 1:
        return _for_loading_v1(saved)
    from megatron.core import parallel_state as ps

    same = saved["layout"] == layout()
    rank = dist.get_rank()
    source = rank if same or rank < len(saved["ranks"]) else 0  # whose plain data and own tensors this rank takes
    dp_then, dp = saved["layout"]["dp"], ps.get_data_parallel_rank()
    per_replica = set(saved["per_replica"])
    kinds: dict[str, dict[str, list]] = {}  # holder -> key -> [(name, dtype or value)] in saved order
    for r in ([saved["ranks"][source]] + saved["ranks"]):
        for holder, keys in r["plain"].items():
            for key, names in keys.items():
                kinds.setdefault(holder, {}).setdefault(key, list(names.items()))
    requests: list = []  # (ShardedTensor keys) per request
    sharded: dict = {}

    def request(holder: str, name: str, sh, dtype: str) -> int:
        empty = torch.empty(_local_shape(sh), dtype=_dtype(dtype))
        if _state_id(holder, name, sh.key) not in per_replica:
            replicas = [None]
        elif saved["layout"]["dp"] == layout()["dp"]:
            replicas = [dp]
        else:  # the replicas' mean (problem_with allowed it)
            replicas = list(range(dp_then))
        keys = []
        for d in replicas:
            keys.append(str(len(sharded)))
            sharded[keys[-1]] = _state_tensor(sh, empty if len(replicas) == 1 else empty.clone(), holder, name, d)
        requests.append(keys)
        return len(requests) - 1

    entries: dict[str, dict[int, list]] = {}
    for label, params in [("params", stepped)] + [(h.label, h.params) for h in holders]:
        for p in params:
            sh = shard_of(p)
            for name, entry in kinds.get(label, {}).get(_param_id(sh), []):
                value = (("request", request(label, name, sh, entry["shard"])) if "shard" in entry
                         else ("value", _decode(entry["value"])))
                entries.setdefault(label, {}).setdefault(id(p), []).append((name, value))
    own_specs = saved["ranks"][source]["specs"]
    own = {str(i): mi.live(mi.SHARDED_TENSOR).from_rank_offsets(
        _rank_key(source, i), torch.empty(int(torch.Size(shape).numel()), dtype=_dtype(dtype)), replica_id=0)
        for i, (shape, dtype) in enumerate(own_specs) if torch.Size(shape).numel()}
    plan = LoadPlan(saved, source, requests, own, holders, entries)
    return {TENSORS_KEY: {"params": sharded, "own": own}}, plan


# What a method records beside its settings that describes the layout, not the method (its
# state_dict's lowcomm.settings): this run's own where the checkpoint is resharded.
# (param_dtypes: this run's where they are the same dtypes, so a dtype change is still refused)
LAYOUT_RECORD = ("world_size", "param_shapes", "param_dtypes")


def _merge(skeleton: Any, live: Any, fill: Callable[[str], dict], own: list[torch.Tensor], relayout: bool) -> Any:
    """The saved ``skeleton`` with this run's parameters, per-parameter state and param-group
    parameter lists (from ``live``, the wrapper's state_dict now) in place; ``relayout``: the
    layout changed (the methods' records of it are this run's)."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR}:
            return own[skeleton[_TENSOR]]
        if set(skeleton) == {_PARAM}:
            return live
        if relayout and isinstance(skeleton.get("settings"), dict) and isinstance(live, dict) and isinstance(
                live.get("settings"), dict):
            saved, now = skeleton["settings"], live["settings"]
            settings = {**saved, **{k: now[k] for k in LAYOUT_RECORD if k in now and k in saved and (
                k != "param_dtypes" or set(now[k]) == set(saved[k]))}}
            skeleton = {**skeleton, "settings": settings}
        if _is_torch_state(skeleton) or (isinstance(skeleton.get("state"), dict) and _PER_PARAM in skeleton["state"]
                                          and isinstance(skeleton.get("param_groups"), list)):
            # A torch optimizer's state: this run's parameters in its groups (the saved groups'
            # settings), its per-parameter state by parameter key
            groups = skeleton["param_groups"]
            if not isinstance(live, dict) or len(live.get("param_groups", ())) != len(groups):
                raise ShardedStateError(f"the checkpoint's optimizer has {len(groups)} param groups; this run's has "
                                        f"{len((live or {}).get('param_groups', ()))}")
            out = {k: _merge(v, live.get(k), fill, own, relayout) for k, v in skeleton.items()
                   if k not in ("state", "param_groups")}
            state = skeleton["state"]
            out["state"] = fill(state[_PER_PARAM]) if _PER_PARAM in state else _merge(state, None, fill, own, relayout)
            out["param_groups"] = [{**g, "params": lg["params"]} for g, lg in zip(groups, live["param_groups"])]
            return {k: out[k] for k in skeleton}
        return {k: _merge(v, live.get(k) if isinstance(live, dict) else None, fill, own, relayout)
                for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        if _has_param(skeleton):  # a list of the stepped parameters (fp32_from_fp16_params): this run's
            return live
        return type(skeleton)(_merge(v, live[i] if isinstance(live, (list, tuple)) and i < len(live) else None, fill,
                                     own, relayout) for i, v in enumerate(skeleton))
    return skeleton


def _has_param(node: Any) -> bool:
    if isinstance(node, dict):
        return set(node) == {_PARAM}
    if isinstance(node, (list, tuple)):
        return any(_has_param(v) for v in node)
    return False


def rebuild(loaded: dict, plan, live_state: dict, stepped: list[torch.Tensor]) -> tuple[Any, list[torch.Tensor]]:
    """The wrapper's state_dict to load and the values of its stepped parameters, from what
    ``dist_checkpointing.load`` returned (``live_state``: the wrapper's ``state_dict()`` now)."""
    if isinstance(plan, dict):  # the first format
        state = _rebuild_v1(loaded, plan)
        return state["state"], state["params"]
    got = loaded[TENSORS_KEY]["params"]
    values = []
    for keys in plan.requests:
        parts = [got[k] for k in keys]
        values.append(parts[0] if len(parts) == 1 else
                      (sum(t.double() for t in parts) / len(parts)).to(parts[0].dtype))
    own_loaded = loaded[TENSORS_KEY]["own"]
    own = [(own_loaded[str(i)].reshape(shape) if str(i) in own_loaded else torch.empty(shape, dtype=_dtype(dtype)))
           for i, (shape, dtype) in enumerate(plan.saved["ranks"][plan.source]["specs"])]

    def value(v):
        return values[v[1]] if v[0] == "request" else v[1]

    by_label = {h.label: h for h in plan.holders}

    def fill(label: str) -> dict:
        entries = plan.entries.get(label, {})
        return {i: {name: value(v) for name, v in entries[id(p)]} for i, p in enumerate(by_label[label].params)
                if id(p) in entries}

    skeleton = plan.saved["ranks"][plan.source]["skeleton"]
    state = _merge(skeleton["state"], live_state, fill, own, plan.saved["layout"] != layout())
    params_entries = plan.entries.get("params", {})
    missing = [i for i, p in enumerate(stepped) if id(p) not in params_entries]
    if missing:
        raise ShardedStateError(f"the checkpoint holds no values for {len(missing)} of the parameters this rank's "
                                "optimizer steps")
    params = [value(dict(params_entries[id(p)])["param"]) for p in stepped]
    return state, params


# --- The first format (every tensor per rank, flattened): read at its own layout -----------------------
def _for_loading_v1(saved: dict) -> tuple[dict, dict]:
    sharded_tensor = mi.live(mi.SHARDED_TENSOR)
    rank = dist.get_rank()
    mine = saved["ranks"][rank]
    request = {}
    for i, (shape, dtype) in enumerate(mine["specs"]):
        numel = int(torch.Size(shape).numel())
        if numel:
            request[str(i)] = sharded_tensor.from_rank_offsets(f"{_PREFIX}.rank_{rank:05d}.{i}",
                                                               torch.empty(numel, dtype=_dtype(dtype)), replica_id=0)
    return {TENSORS_KEY: request}, mine


def _rebuild_v1(loaded: dict, mine: dict) -> Any:
    flat = loaded[TENSORS_KEY]
    tensors = []
    for i, (shape, dtype) in enumerate(mine["specs"]):
        t = flat.get(str(i))
        tensors.append(torch.empty(shape, dtype=_dtype(dtype)) if t is None else t.reshape(shape))
    return join(mine["skeleton"], tensors)


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


def is_sharded(state: Any) -> bool:
    return isinstance(state, dict) and TENSORS_KEY in state


__all__ = ["FORMAT", "Holder", "LoadPlan", "METADATA_KEY", "READS", "ShardedStateError", "for_loading", "for_saving",
           "is_sharded", "layout", "method_problem", "problem_with", "rebuild", "sharded_params"]
